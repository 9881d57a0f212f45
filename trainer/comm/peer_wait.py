"""A collective's wait on one peer, said while it lasts (the cpu backend's gray failures).

A peer that is stopped (SIGSTOP, a debugger), throttled by its cgroup, or behind a link
that drops its data but not its heartbeat keeps every other rank waiting in the
collective, silently, until ``collective_timeout_s`` (300 s). So the waiting rank says
which peer it waits on: once the wait on one receive has lasted ``slow_peer_warn_s``,
then each time it has doubled, and once more when data comes again.

The waiting itself is not touched: a receive stamps what it waits for (``begin``, a
clock read and one tuple per chunk on the ring's hot path; the shared-memory group only
once it goes to sleep) and a thread of the communicator's own reads the stamp. Capping
the kernel's receive timeout to wake the waiter instead changed what a cut link says
(helper-165), and a poll before every receive costs a syscall per chunk.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Final

__all__ = ["DEFAULT_WARN_S", "PeerWaits", "mark_step"]

log = logging.getLogger("rendezvousd.trainer")

#: The trainer's ``slow_peer_warn_s`` default: far above any healthy receive (a 4 MiB
#: chunk on a slow link takes well under a second), far below the 300 s timeout.
DEFAULT_WARN_S: Final = 30.0

#: What a stamp waits for: the ring's data from its left neighbour, the right
#: neighbour's acknowledgement of what it was sent, a peer's shared-memory progress.
DATA: Final = 0
ACK: Final = 1
SHARED: Final = 2

# The last step this process reported (``DistributedContext.progress``/``save_state``):
# one training loop per worker process, so a process-wide note names it right.
_last_step: int | None = None


def mark_step(step: int) -> None:
    """The step this worker's training loop last reported, said in a wait's line."""
    global _last_step
    _last_step = step


# (since, peer, the collective's (kind, op, dtype, seq, bytes, ...), DATA/ACK/SHARED)
Stamp = tuple[float, int, tuple[int, ...], int]


class PeerWaits:
    """One communicator's receive stamps and the thread that says the long ones.

    ``hosts``: how each peer is named beside its rank (``host 10.0.0.2``, ``pid 41 on
    this host``); ``context``: where this communicator runs (``generation 3``).
    """

    def __init__(self, rank: int, warn_s: float, timeout_s: float, context: str = "") -> None:
        self.rank = rank
        self.hosts: dict[int, str] = {}
        #: Set by the waiting thread before a receive, None once it returned: one
        #: attribute store, read whole by the watcher (a tuple, never half written).
        self.current: Stamp | None = None
        self._warn_s = warn_s
        self._timeout_s = timeout_s
        self._context = context
        #: Set once the communicator failed: a wait that ended so heard nothing again.
        self.broken = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name=f"cpu-ring-waits-r{self.rank}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(1.0)

    def begin(self, peer: int, expect: tuple[int, ...], kind: int) -> None:
        self.current = (time.monotonic(), peer, expect, kind)

    def _run(self) -> None:
        # Sleeps up to a quarter of the threshold when no wait is long yet: a wait is
        # said at most that late, for a few wake-ups a minute at the default.
        idle = min(max(self._warn_s / 4, 0.05), 5.0)
        said: Stamp | None = None
        said_for = 0.0
        due = self._warn_s
        # When this process last ran again after not running at all (its own SIGSTOP,
        # a frozen VM): its waits count from then. A stopped rank let go blamed its
        # healthy peer for the time it was itself stopped. Told from a wake-up late by
        # half the threshold, far more than a loaded machine delays a thread (a late
        # wake-up only delays the note).
        frozen = max(idle, self._warn_s / 2)
        thawed = 0.0
        while not self._stop.is_set():
            stamp = self.current
            now = time.monotonic()
            if said is not None and stamp is not said:
                if not self.broken:
                    self._resumed(said, said_for)
                said = None
            sleep = idle
            if stamp is not None:
                since = max(stamp[0], thawed)
                waited = now - since
                if stamp is not said:
                    due = self._warn_s
                if waited >= due:
                    self._say(stamp, waited)
                    said = stamp
                    due *= 2  # the interval grows: said at 30, 60, 120, 240 s
                if stamp is said:
                    said_for = waited
                sleep = min(idle, max(0.01, since + due - now))
            self._stop.wait(sleep)
            if time.monotonic() - (now + sleep) > frozen:
                thawed = time.monotonic()
        if said is not None and self.current is not said and not self.broken:
            # Heard again since the last look, and stopped before the next (up to 5 s
            # apart at the defaults): a run that ended just after the wait said nothing
            # of its end (helper-175).
            self._resumed(said, said_for)

    def _peer(self, peer: int) -> str:
        where = self.hosts.get(peer)
        return f"rank {peer} ({where})" if where else f"rank {peer}"

    def _collective(self, expect: tuple[int, ...]) -> str:
        said = _described(expect)
        where = [self._context] if self._context else []
        if _last_step is not None:
            where.append(f"after step {_last_step}")
        return f"{said} of {', '.join(where)}" if where else said

    def _say(self, stamp: Stamp, waited: float) -> None:
        _, peer, expect, kind = stamp
        named = self._peer(peer)
        what = {
            DATA: f"for data from {named}",
            ACK: f"for {named} to acknowledge what this rank sent it",
            SHARED: f"for {named} to post its part in shared memory",
        }[kind]
        log.warning(
            "rank %d: %s has waited %.1f s %s: rank %d is stopped, throttled or far "
            "behind, or the network drops its data (a rank that waits on its own "
            "upstream peer passes the wait on, so the stalled rank is the one that says "
            "no such wait itself); this rank fails the collective after %g s without "
            "data (collective_timeout_s), and says this again as the wait doubles",
            self.rank,
            self._collective(expect),
            waited,
            what,
            peer,
            self._timeout_s,
        )

    def _resumed(self, stamp: Stamp, waited: float) -> None:
        _, peer, expect, _ = stamp
        log.warning(
            "rank %d: %s heard from %s again after waiting at least %.1f s",
            self.rank,
            _described(expect),
            self._peer(peer),
            waited,
        )


def _described(expect: tuple[int, ...]) -> str:
    # Imported when said: ``mark_step``'s callers (every worker's training loop)
    # need not load the ring's wire.
    from rendezvousd.trainer.comm.ring_wire import describe_collective

    return describe_collective(*expect[:5])
