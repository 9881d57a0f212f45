"""What a join gives a worker: its ``Membership`` and the ``Member`` table of its generation."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client.errors import InvalidRequest, JobAborted, ProtocolError
from rendezvousd.common import member_table
from rendezvousd.common.address import is_loopback
from rendezvousd.common.members import MemberInfo, Seat
from rendezvousd.errors import shown

__all__ = [
    "LOOPBACK_ADDRESS",
    "NODE_STOPPED",
    "SETUP_ERROR",
    "LazyTable",
    "Member",
    "Membership",
    "NodeMembership",
    "advertises_loopback",
    "from_join_node_response",
    "from_join_response",
    "loopback_conflict",
    "loopback_refused",
]


@dataclass(frozen=True)
class Member(MemberInfo):
    """One worker of a formed generation: its ranks, host and advertised address
    (the daemon's record of it, under the SDK's name)."""


class LazyTable:
    """A slim join's member table: fetched with GetMembers on first use (pages by rank
    range), checked against the digest the join answered (or, for a worker attached
    without one, the digest every page carries), then kept."""

    def __init__(
        self,
        fetch_page: Callable[[int], pb.GetMembersResponse],
        world_size: int,
        digest: bytes = b"",
    ) -> None:
        self._fetch_page = fetch_page
        self._world_size = world_size
        self._digest = digest
        self._lock = threading.Lock()
        self._members: list[pb.Member] | None = None

    @property
    def loaded(self) -> bool:
        return self._members is not None

    def pages(self) -> Generator[int, pb.GetMembersResponse, list[pb.Member]]:
        """Assembling the table (sans-IO): yields each page's start rank, is sent
        that page, returns the checked table."""
        members: list[pb.Member] = []
        digest = self._digest
        while len(members) < self._world_size:
            page = yield len(members)
            digest = digest or page.table_digest
            if not page.members or page.table_digest != digest:
                break
            members.extend(page.members)
        return self.checked(members, digest)

    def load(self) -> Sequence[pb.Member]:
        with self._lock:
            if self._members is None:
                pages = self.pages()
                try:
                    start = next(pages)
                    while True:
                        start = pages.send(self._fetch_page(start))
                except StopIteration as done:
                    self._members = done.value
            return self._members

    def accept(self, members: list[pb.Member]) -> None:
        """Keep a table assembled elsewhere (as steps of an SDK call: ``pages()``)."""
        with self._lock:
            self._members = members

    def checked(self, members: list[pb.Member], digest: bytes) -> list[pb.Member]:
        if len(members) != self._world_size or member_table.digest(members) != digest:
            raise ProtocolError(
                f"the member table assembled from GetMembers ({len(members)} of "
                f"{self._world_size} members) does not match the digest of the join's "
                "table: the generation changed while it was fetched, or the daemon is "
                "misbehaving; rejoin",
                reason="TABLE_DIGEST_MISMATCH",
            )
        return members


@dataclass(frozen=True)
class Membership(Seat):
    """What a join gives a worker: its seat (``job_id``, ``generation``, ``rank``,
    ``world_size``, ``node_rank``, ``num_nodes``, ``gpus_per_node``, ``local_rank``)
    and the id. ``unique_id`` is kept out of repr and logs."""

    local_rank: int
    unique_id: bytes = field(repr=False)
    # Decoded on first use: at thousands of ranks, building every rank's copy
    # of the table eagerly costs more than the whole rendezvous.
    _table: Any = field(repr=False, compare=False, default=())

    @functools.cached_property
    def members(self) -> tuple[Member, ...]:
        """Every member by rank. After a slim join (current SDKs) the first access
        fetches the table from the daemon (one GetMembers call per 4096 members) and
        checks its digest; raises the SDK's errors if that fails."""
        table = self._table.load() if isinstance(self._table, LazyTable) else self._table
        return tuple(Member(m.rank, m.node_rank, m.local_rank, m.host, m.address) for m in table)


@dataclass(frozen=True)
class NodeMembership(Seat):
    """What ``join_node()`` gives a node agent: its node's block of ranks in this
    generation (``job_id``, ``generation``, ``node_rank``, ``num_nodes``,
    ``gpus_per_node``, ``world_size``, ``first_rank``; ``local_rank`` is None: all of
    them), the id, and the instance id of each local rank's member. ``unique_id`` and
    the instance ids are kept out of repr and logs."""

    unique_id: bytes = field(repr=False)
    heartbeat_timeout_ms: int = 0
    _member_ids: tuple[str, ...] = field(repr=False, compare=False, default=())
    _table: Any = field(repr=False, compare=False, default=())

    @property
    def first_rank(self) -> int:
        return self.rank

    def _check(self, local_rank: int) -> None:
        number = isinstance(local_rank, int) and not isinstance(local_rank, bool)
        if not number or not 0 <= local_rank < self.gpus_per_node:
            raise InvalidRequest(
                f"local_rank={local_rank} is out of range for gpus_per_node="
                f"{self.gpus_per_node} (expected 0..{self.gpus_per_node - 1})"
            )

    def membership_for(self, local_rank: int) -> Membership:
        """The ``Membership`` of this node's worker at ``local_rank``."""
        self._check(local_rank)
        return Membership(
            self.job_id,
            self.generation,
            self.node_rank,
            self.num_nodes,
            self.gpus_per_node,
            local_rank,
            self.unique_id,
            self._table,
        )

    def member_instance_id(self, local_rank: int) -> str:
        """The instance id the daemon registered for the worker at ``local_rank``: the
        worker passes it to ``attach()``. A secret: hand it over privately (a pipe, a
        0600 file), never in argv or the environment."""
        self._check(local_rank)
        return self._member_ids[local_rank]


def _table_of(
    response: pb.JoinResponse | pb.JoinNodeResponse,
    fetch_page: Callable[[int], pb.GetMembersResponse],
) -> Any:
    if response.members or not response.table_digest:
        return response.members  # an older daemon
    return LazyTable(fetch_page, response.world_size, response.table_digest)


def from_join_node_response(
    response: pb.JoinNodeResponse,
    fetch_page: Callable[[int], pb.GetMembersResponse],
) -> NodeMembership:
    return NodeMembership(
        response.job_id,
        response.generation,
        response.node_rank,
        response.num_nodes,
        response.gpus_per_node,
        None,
        response.unique_id,
        response.heartbeat_timeout_ms,
        tuple(response.member_instance_ids),
        _table_of(response, fetch_page),
    )


def from_join_response(
    response: pb.JoinResponse,
    gpus_per_node: int,
    fetch_page: Callable[[int], pb.GetMembersResponse],
) -> Membership:
    """The ``Membership`` a JoinResponse (or PublishId's) to a join of ``gpus_per_node``
    ranks a node describes; after a slim answer ``fetch_page(start_rank)`` serves its
    table on first use."""
    return Membership(
        response.job_id,
        response.generation,
        response.node_rank,
        response.world_size // gpus_per_node,
        gpus_per_node,
        response.local_rank,
        response.unique_id,
        _table_of(response, fetch_page),
    )


def advertises_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0] if address.count(":") == 1 else address
    return bool(address) and is_loopback(host.strip("[]"))


#: What a rank advertising loopback is told to do, in the trainer's words; each caller
#: with flags of its own says them instead (rendezvous-run: ``_LAUNCHER_WORDS``).
LOOPBACK_ADVICE = (
    "(rendezvousd.trainer: unset RENDEZVOUSD_RING_HOST, and workers advertise their "
    "address towards the daemon)"
)
#: The abort cause (``abort(cause=...)``, the proto's ABORT_CAUSE_LOOPBACK_ADDRESS) a
#: rank or node that advertised loopback aborts its job with: what its peers act on.
LOOPBACK_ADDRESS = "LOOPBACK_ADDRESS"
#: The abort cause (the proto's ABORT_CAUSE_NODE_STOPPED) of a node agent stopped by a
#: signal, which leaves the job for good: its peers tell a scale-down by it.
NODE_STOPPED = "NODE_STOPPED"
#: The abort cause (the proto's ABORT_CAUSE_SETUP_ERROR) of a node agent that leaves
#: the job for good on a setting of its own no restart changes, closing the run: its
#: peers end on it as on a setup error of their own.
SETUP_ERROR = "SETUP_ERROR"


def loopback_conflict(m: Membership, address: str) -> str | None:
    """Why this rank's advertised ``address`` cannot serve ``m``'s job, or None.

    A loopback address is only reachable from its own host: in a job with ranks on
    other hosts the peers would dial themselves and hang until their timeout. Only
    a rank advertising loopback decodes the table (the common case stays O(1)).
    """
    if not advertises_loopback(address):
        return None
    mine = m.members[m.rank].host
    others = sorted({x.host for x in m.members} - {mine})
    if not others:
        return None
    return (
        f"rank {m.rank} on host {mine!r} advertises the loopback address {address!r}, but "
        f"job {m.job_id!r} also has ranks on {shown(others, 3)}, which cannot reach it. Advertise an "
        f"address of {mine!r} that the other hosts can reach {LOOPBACK_ADVICE}"
    )


def loopback_refused(error: JobAborted) -> bool:
    """Whether an abort is ``loopback_conflict``'s: a setup error of the rank it names,
    which no restart of any node changes. Its peers hear only the abort (each checking
    every member's address would fetch the whole table at every join), and tell it by
    its cause, as data: matched on its words, any abort reason of that shape ended
    them. An abort by an agent, or through a daemon, from before causes has none: its
    peers take it as any abort (they restart, and wait for the refusing node)."""
    return error.abort_cause == LOOPBACK_ADDRESS
