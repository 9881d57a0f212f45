"""The digests of the ids a job's recent generations used: bounded, oldest first.

A new generation must not reuse an earlier generation's id: a stale worker of that
generation could otherwise still reach the new NCCL world. Kept: the last
``USED_ID_HISTORY`` digests, exact (a reused id within the window is always refused,
a fresh one never is). Not a Bloom filter: its false positives would refuse a fresh
random id, failing a healthy job's restart, and a filter sized for a crash-looping
job's millions of generations would be larger than this window. Older ids are
forgotten: their workers were fenced off generations ago (every call names its
generation, and a lost member is failed within the heartbeat timeout).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from rendezvousd.common.newest import keep_newest

# 256 generations of a job: far more restarts than any job lives through before its old
# workers are gone, at about 180 bytes each on disk (a row and its index entry: 45 KiB a
# job) and about 100 bytes each in memory (25 KiB a job, 25 MiB with all 1,024 of
# --max-jobs full). Documented in operations.md.
USED_ID_HISTORY = 256


class IdHistory:
    """An insertion-ordered set of SHA-256 digests holding the newest ``USED_ID_HISTORY``."""

    __slots__ = ("_digests",)

    def __init__(self, digests: Iterable[bytes] = ()) -> None:
        self._digests: dict[bytes, None] = {}
        for digest in digests:
            self.add(digest)

    def add(self, digest: bytes) -> None:
        keep_newest(self._digests, digest, None, USED_ID_HISTORY)  # used again: the newest

    def __contains__(self, digest: object) -> bool:
        return digest in self._digests

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, IdHistory):
            return NotImplemented
        return list(self._digests) == list(other._digests)

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return f"IdHistory({len(self._digests)} digests)"
