"""A log line said at most once per interval per key, with how many it held back.

For the lines a caller can make the daemon say again and again (a joiner a running
job refuses, a refused token, a bad status-page login, a status-page bug): a line
per call filled the log (4 MB in 3 s, h121 F2). The caller's clock comes as
``now``, so the state machine, which reads none, throttles by its own time."""

from __future__ import annotations

from typing import Generic, NamedTuple, TypeVar

from rendezvousd.common.newest import keep_newest

K = TypeVar("K")


class Due(NamedTuple):
    """A line due now: how many lines of its key were held back since the last one,
    and how long ago that one was said (None: this key's first)."""

    skipped: int
    since_s: float | None


class LogThrottle(Generic[K]):
    """At most one line per ``every_s`` per key, of at most ``keys`` keys: a new key
    beyond them forgets the key said longest ago (its next line is then due at once),
    so a caller naming keys without end (hosts) holds a bounded table."""

    def __init__(self, every_s: float, keys: int = 1) -> None:
        self.every_s = every_s
        self.keys = keys
        # Per key: when its last line was said and how many were held back since, in
        # the order the lines were said (the oldest first: the one a new key evicts).
        self._said: dict[K, tuple[float, int]] = {}

    def due(self, key: K, now: float) -> Due | None:
        """Whether ``key``'s line is said now (``Due``), or held back and counted (None)."""
        said = self._said.get(key)
        if said is not None and now - said[0] < self.every_s:
            self._said[key] = (said[0], said[1] + 1)
            return None
        keep_newest(self._said, key, (now, 0), self.keys)
        return Due(0, None) if said is None else Due(said[1], now - said[0])
