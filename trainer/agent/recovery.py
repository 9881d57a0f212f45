"""The node agent's restart decisions: which failures count, when to give up, and
the one message that names every failure. Pure: no processes, no clock.

Every failure of a generation this node saw or was told of (a local worker died
or hung, a peer node's failure pushed by the daemon, a join that failed during
recovery, a spare that died) uses one restart; a membership change (a waiting
node joining, ``NODES_WAITING``) does not, as in torchrun, and neither does the loss
of a node that was placed and never attached its heartbeat stream (``stray``): a
JoinNode by any holder of the job's token would otherwise use up the job's restarts.
After ``max_restarts`` restarts the next failure ends the launcher.

Beside them, what a join waits through, shared with the torchrun agent and a
worker's own per-rank join: the daemon unavailable (``DaemonOutage``), or full
(``daemon_full``: a daemon-wide limit such as --max-jobs, waited out with a backoff,
``room_wait``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rendezvousd.client.errors import LimitExceeded
from rendezvousd.common.members import SCALE_UP_REASON, never_attached

__all__ = [
    "DAEMON_WIDE_LIMITS",
    "OUTAGE_RETRY_S",
    "ROOM_RETRY_MAX_S",
    "ROOM_RETRY_S",
    "SCALE_UP_REASON",
    "SETUP_ERROR_EXIT",
    "DaemonOutage",
    "Failure",
    "RestartBudget",
    "daemon_full",
    "room_note",
    "room_wait",
    "stray",
]

#: The launcher's exit status for a setup no restart can fix that is not a worker's
#: failure: a bad setting, and nodes or a daemon of another rendezvousd version.
SETUP_ERROR_EXIT = 2

#: How often a join (rendezvous-run's, or a torchrun agent standing by) asks again
#: while the daemon is unavailable: the outage uses no restart.
OUTAGE_RETRY_S = 1.0


#: A join refused for a daemon-wide limit (``daemon_full``) asks again after this,
#: doubling up to ROOM_RETRY_MAX_S: a full daemon is busy, and every node of every
#: launch that arrived meanwhile asks; the first room may come within a second (a
#: job ending) or minutes.
ROOM_RETRY_S = 0.5
ROOM_RETRY_MAX_S = 5.0

#: The limits a join can be refused for that the whole daemon shares, and that free up
#: as other jobs' calls and jobs end: no restart of this job changes them, only time
#: (or an operator raising them). A limit of the request itself (max_members_per_job)
#: or of the job's own calls (max_waiters_per_job) is not waited for.
DAEMON_WIDE_LIMITS = frozenset({"max_jobs", "max_waiters", "max_concurrent_rpcs"})


def daemon_full(error: BaseException) -> str | None:
    """The daemon-wide limit a join was refused for (``DAEMON_WIDE_LIMITS``), or None.
    Each restart's join was refused the same way within milliseconds: a daemon at
    --max-jobs for a moment used up every --max-restarts (1000 in 2.4 s)."""
    if isinstance(error, LimitExceeded) and error.reason == "LIMIT_EXCEEDED":
        limit = error.limit
        return limit if limit in DAEMON_WIDE_LIMITS else None
    return None


@dataclass
class DaemonOutage:
    """The daemon unavailable while a node joins (rendezvous-run's joins, a torchrun
    standby's): asked again every OUTAGE_RETRY_S for up to ``limit_s`` from ``since``.
    A full daemon's (``room_wait``) backs off: every ``retry_s``, doubling up to
    ``max_retry_s``."""

    limit_s: float
    since: float | None = None
    #: Whether the outage was told to the user (once per outage, not per retry).
    told: bool = False
    retry_s: float = OUTAGE_RETRY_S
    max_retry_s: float = OUTAGE_RETRY_S
    _next_s: float = 0.0

    def retry_at(self, now: float) -> float | None:
        """When to ask again, or None once the outage outlasted ``limit_s``. The first
        call starts the outage (``since``) unless the caller set it. Never past
        ``limit_s``: a long backoff would otherwise overrun the join's timeout."""
        if self.since is None:
            self.since = now
        if now - self.since >= self.limit_s:
            return None
        pause = self._next_s or self.retry_s
        self._next_s = min(pause * 2, self.max_retry_s)
        return min(now + pause, self.since + self.limit_s)

    def wait_for_room(self, exc: LimitExceeded, limit: str, say: Callable[[str], None]) -> None:
        """A blocking join's wait after ``exc``, a refusal for the daemon-wide ``limit``
        (``daemon_full``): said once (``say``), then slept until the next ask; ``exc``
        raised, saying so, once the wait outlasted ``limit_s``."""
        if not self.told:
            self.told = True
            say(f"{exc}; {room_note(limit, self.limit_s)}")
        at = self.retry_at(time.monotonic())
        if at is None:
            exc._add(f" (still full after {self.limit_s:g} s of trying)")
            raise exc
        time.sleep(max(0.0, at - time.monotonic()))

    def reset(self) -> None:
        """A wait that ended normally: the next outage is a new one."""
        self.since = None
        self.told = False
        self._next_s = 0.0


def room_wait(limit_s: float, since: float | None = None) -> DaemonOutage:
    """The wait of a join the daemon refused for a daemon-wide limit (``daemon_full``)."""
    return DaemonOutage(limit_s, since, retry_s=ROOM_RETRY_S, max_retry_s=ROOM_RETRY_MAX_S)


def room_note(limit: str, limit_s: float) -> str:
    """What a join waiting for room in a full daemon says, once: which limit, that it
    waits and for how long, and who can change it."""
    return (
        f"the daemon is full (its {limit} limit, held by other jobs): waiting for room, "
        f"asking again after {ROOM_RETRY_S:g} s and backing off to every {ROOM_RETRY_MAX_S:g} "
        f"s, for up to {limit_s:g} s in all (no restart used); if this persists, an operator "
        f"can restart the daemon with a larger --{limit.replace('_', '-')}"
    )


def stray(causes: Sequence[str]) -> bool:
    """Whether a generation's losses (their causes, as the daemon pushed them) are all
    of nodes that never attached after placement: a re-form, not a failure."""
    return bool(causes) and all(never_attached(c) for c in causes)


@dataclass(frozen=True)
class Failure:
    """One failure, as the final error lists it."""

    generation: int | None
    cause: str
    rank: int | None = None
    host: str | None = None
    #: The launcher's exit status if this is the failure it ends on.
    exit_status: int = 1
    #: This node's local rank of the worker, for a failure of one of its own.
    local_rank: int | None = None
    #: A setup error no restart can fix (e.g. a loopback ring address across hosts).
    fatal: bool = False

    def describe(self) -> str:
        gen = f"generation {self.generation}" if self.generation is not None else "no generation"
        # No rank and no host (an abort of the whole job): no "node:" placeholder.
        who = f"rank {self.rank}" if self.rank is not None else "node" if self.host else ""
        where = f" on host {self.host}" if self.host else ""
        return f"{gen}: {who}{where}: {self.cause}" if who else f"{gen}: {self.cause}"


#: The failures a budget keeps, and the final message lists: the first ones (the
#: root cause among them) and the latest; those between are counted, not kept. An
#: agent with --max-restarts 100000 riding out failures for weeks held every one
#: (~0.5 KB each) and would end with a message of one line per failure (review).
FIRST_KEPT = 5
LAST_KEPT = 20


@dataclass
class RestartBudget:
    max_restarts: int
    #: The first ``FIRST_KEPT`` failures, and the latest ``LAST_KEPT`` after them.
    first: list[Failure] = field(default_factory=list)
    last: deque[Failure] = field(default_factory=lambda: deque(maxlen=LAST_KEPT))
    #: Every failure recorded, kept or not.
    count: int = 0
    restarts: int = 0

    @property
    def can_restart(self) -> bool:
        return self.restarts < self.max_restarts

    def allows(self, failure: Failure) -> bool:
        """Whether a restart may follow ``failure`` (not recorded: ``record``)."""
        return not failure.fatal and self.can_restart

    def record(self, failure: Failure) -> bool:
        """Count ``failure``; True if the job may restart, False if it must give up."""
        self.count += 1
        (self.first if len(self.first) < FIRST_KEPT else self.last).append(failure)
        if not self.allows(failure):
            return False
        self.restarts += 1
        return True

    def exhausted_message(self, job_id: str) -> str:
        n = self.count
        skipped = n - len(self.first) - len(self.last)
        lines = [
            f"job {job_id!r} gave up after {self.restarts} restart"
            f"{'s' if self.restarts != 1 else ''} (max_restarts={self.max_restarts}); "
            f"{n} failure{'s' if n != 1 else ''}, oldest first"
            + (
                f" (the first {len(self.first)} and the last {len(self.last)}; the {skipped} "
                "between them are not listed)"
                if skipped
                else ""
            )
            + ":"
        ]
        lines += [f"  {i}. {f.describe()}" for i, f in enumerate(self.first, 1)]
        if skipped:
            lines.append(f"  ... {skipped} more ...")
        after = n - len(self.last) + 1
        lines += [f"  {i}. {f.describe()}" for i, f in enumerate(self.last, after)]
        latest = self.last[-1] if self.last else self.first[-1] if self.first else None
        if latest is not None and latest.fatal:
            lines.append("no restart can change that: fix the cause named above, then rerun")
        else:
            lines.append(
                "fix the cause named above, then rerun (raise --max-restarts to ride out "
                "more transient failures)"
            )
        return "\n".join(lines)
