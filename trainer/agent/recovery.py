"""The node agent's restart decisions: which failures count, when to give up, and
the one message that names every failure. Pure: no processes, no clock.

Every failure of a generation this node saw or was told of (a local worker died
or hung, a peer node's failure pushed by the daemon, a join that failed during
recovery, a spare that died) uses one restart; a membership change (a waiting
node joining, ``NODES_WAITING``) does not, as in torchrun, and neither does the loss
of a node that was placed and never attached its heartbeat stream (``stray``): a
JoinNode by any holder of the job's token would otherwise use up the job's restarts.
After ``max_restarts`` restarts the next failure ends the launcher.

Beside them, what a join waits through, shared with the torchrun agent: the daemon
unavailable (``DaemonOutage``), and what a join still waiting says (``forming_note``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.common.escape import escape
from rendezvousd.common.members import SCALE_UP_REASON, never_attached

__all__ = [
    "FORMING_NOTE_EVERY_S",
    "FORMING_NOTE_S",
    "OUTAGE_RETRY_S",
    "SCALE_UP_REASON",
    "DaemonOutage",
    "Failure",
    "RestartBudget",
    "forming_note",
    "stray",
]

#: How often a join (rendezvous-run's, or a torchrun agent standing by) asks again
#: while the daemon is unavailable: the outage uses no restart.
OUTAGE_RETRY_S = 1.0


@dataclass
class DaemonOutage:
    """The daemon unavailable while a node joins (rendezvous-run's joins, a torchrun
    standby's): asked again every OUTAGE_RETRY_S for up to ``limit_s`` from ``since``."""

    limit_s: float
    since: float | None = None
    #: Whether the outage was told to the user (once per outage, not per retry).
    told: bool = False

    def retry_at(self, now: float) -> float | None:
        """When to ask again, or None once the outage outlasted ``limit_s``. The first
        call starts the outage (``since``) unless the caller set it."""
        if self.since is None:
            self.since = now
        return now + OUTAGE_RETRY_S if now - self.since < self.limit_s else None

    def reset(self) -> None:
        """A wait that ended normally: the next outage is a new one."""
        self.since = None
        self.told = False


#: A join still waiting this long says what it waits for, and again every
#: ``FORMING_NOTE_EVERY_S``: the launcher was silent for the whole join timeout (600 s
#: by default) while a node was missing, the rendezvous hang users know from torchrun. (rendezvous-run's joins, and
#: a torchrun agent's.)
FORMING_NOTE_S = 5.0
FORMING_NOTE_EVERY_S = 30.0


def forming_note(job: pb.GetJobResponse, fewest: int, waited_s: float, limit_s: float) -> str:
    """What a waiting join waits for, from the daemon's view of the job: the nodes
    joined so far against those the generation needs, or, while it runs, the next
    re-form that takes this node in."""
    s = job.summary
    most = s.topology.num_nodes
    named = f"job '{escape(s.job_id)}' generation {s.generation}"
    bound = f"waiting up to {limit_s:g} s in all"
    if s.state == pb.JOB_STATE_RUNNING:
        return (
            f"{named} runs with {most} node(s) after {waited_s:.0f} s: this node is taken "
            f"in when it next re-forms ({bound})"
        )
    joined = job.nodes_waiting - job.standbys
    need = str(most) if fewest == most else f"{fewest} (up to {most})"
    kept = f", {job.seats_kept} seat(s) kept for nodes re-joining" if job.seats_kept else ""
    said = (
        f"still waiting for {named} to form after {waited_s:.0f} s: {joined} node(s) joined "
        f"of the {need} it needs{kept}; {bound}, then this ends naming what is missing"
    )
    if job.HasField("previous_run_ended_ms"):
        # A pod restarted after its job succeeded, say: it opened a run nobody else
        # will join, and would wait out its join timeout without a word of why.
        ended = _ago(job.previous_run_ended_ms / 1000)
        said += (
            f". The job's previous run ended {ended} ago (every member left), and a join "
            "after that starts a new run: a node meant for the run that ended is not "
            "needed and may stop"
        )
    return said


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


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


@dataclass
class RestartBudget:
    max_restarts: int
    failures: list[Failure] = field(default_factory=list)
    restarts: int = 0

    @property
    def can_restart(self) -> bool:
        return self.restarts < self.max_restarts

    def allows(self, failure: Failure) -> bool:
        """Whether a restart may follow ``failure`` (not recorded: ``record``)."""
        return not failure.fatal and self.can_restart

    def record(self, failure: Failure) -> bool:
        """Count ``failure``; True if the job may restart, False if it must give up."""
        self.failures.append(failure)
        if not self.allows(failure):
            return False
        self.restarts += 1
        return True

    def exhausted_message(self, job_id: str) -> str:
        n = len(self.failures)
        lines = [
            f"job {job_id!r} gave up after {self.restarts} restart"
            f"{'s' if self.restarts != 1 else ''} (max_restarts={self.max_restarts}); "
            f"{n} failure{'s' if n != 1 else ''}, oldest first:"
        ]
        lines += [f"  {i}. {f.describe()}" for i, f in enumerate(self.failures, 1)]
        if self.failures and self.failures[-1].fatal:
            lines.append("no restart can change that: fix the cause named above, then rerun")
        else:
            lines.append(
                "fix the cause named above, then rerun (raise --max-restarts to ride out "
                "more transient failures)"
            )
        return "\n".join(lines)
