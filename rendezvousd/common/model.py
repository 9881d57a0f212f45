"""Values the state machine hands to its adapters: states, results and effects.

Nothing here holds the unique id except ``JoinResult``, which the servicer
serializes straight onto the wire. The member values the SDK and the node agent use
too live in ``members.py`` (a node's processes import that, never this module) and
are re-exported here with the daemon's own.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from rendezvousd.common.members import (
    NAMED_LOSSES,
    NEVER_ATTACHED,
    SCALE_UP_REASON,
    FailedInfo,
    MemberInfo,
    Seat,
    failed_text,
    never_attached,
    seat_of,
)
from rendezvousd.errors import RendezvousFault

__all__ = [
    "FORGOTTEN",
    "NAMED_LOSSES",
    "NEVER_ATTACHED",
    "SCALE_UP_REASON",
    "Effect",
    "EventKind",
    "FailedInfo",
    "JobFailure",
    "JobState",
    "JobView",
    "JoinMode",
    "JoinResult",
    "JoiningNode",
    "MemberInfo",
    "MemberState",
    "MemberView",
    "Notify",
    "Parked",
    "Progress",
    "Rejoin",
    "Seat",
    "Transition",
    "Wake",
    "Warn",
    "failed_text",
    "never_attached",
    "seat_of",
]


class JobState(enum.Enum):
    FORMING = 1
    RUNNING = 2
    FAILED = 3
    ABORTED = 4
    ENDED = 5


class MemberState(enum.Enum):
    JOINING = 1
    ACTIVE = 2
    LEFT = 3
    LOST = 4


class JoinMode(enum.Enum):
    """How a generation is joined: by nobody yet, per rank (``Join``, each worker its
    own attendee) or per node (``JoinNode``, one agent attending for its ranks). Its
    value is the stored form (``snapshot.py``)."""

    NONE = ""
    RANK = "rank"
    NODE = "node"

    @classmethod
    def of_caller(cls, node: bool) -> JoinMode:
        """The mode a call's ``node`` flag says its caller joined in."""
        return cls.NODE if node else cls.RANK


class AbortCause(enum.Enum):
    """Why an abort ended a generation, as data beside its reason's words (the proto's
    ``AbortCause``, its names without the prefix): what a peer acts on, since any
    caller of AbortJob chooses the words."""

    UNSPECIFIED = 0
    LOOPBACK_ADDRESS = 1
    NODE_STOPPED = 2
    SETUP_ERROR = 3

    @classmethod
    def of(cls, value: int) -> AbortCause:
        """A request's value; one this daemon does not know (a newer client's) is an
        abort like any other, as an older daemon takes it."""
        try:
            return cls(value)
        except ValueError:
            return cls.UNSPECIFIED


class EventKind(enum.Enum):
    PEER_FAILED = 1
    JOB_ABORTED = 2
    JOB_ENDED = 3
    DAEMON_DRAINING = 4
    NODES_WAITING = 6


@dataclass(frozen=True)
class JoinResult(Seat):
    """A join's answer, per rank or per node alike: the joiner's seat, the id and the
    member table."""

    id_required: bool
    unique_id: bytes
    # Shared by every rank of a generation, so adapters may cache its encoding.
    members: tuple[MemberInfo, ...]
    # A node agent's: the instance id of each local rank's member (secrets, like the id).
    member_instance_ids: tuple[str, ...] = ()

    def __repr__(self) -> str:  # the id and instance ids are secrets: keep them out of logs
        return (
            f"JoinResult(job_id={self.job_id!r}, generation={self.generation}, "
            f"rank={self.rank}, world_size={self.world_size}, node_rank={self.node_rank}, "
            f"local_rank={self.local_rank}, id_required={self.id_required})"
        )


@dataclass(frozen=True)
class Rejoin:
    """A parked scale-up JoinNode's generation ended: the adapter asks again, which
    places the node in the next generation."""


@dataclass(frozen=True)
class Parked:
    """The call must wait; the adapter parks it under ``waiter``."""

    waiter: int


@dataclass(frozen=True)
class Wake:
    """Resolve a parked call with a value or a fault."""

    waiter: int
    value: object = None
    fault: RendezvousFault | None = None


@dataclass(frozen=True)
class Notify:
    """Push an event to the heartbeat streams of ``to``: attendees of ``mode`` (workers
    by rank, node agents by node rank)."""

    job_id: str
    generation: int
    mode: JoinMode
    to: tuple[int, ...]
    kind: EventKind
    failed: tuple[FailedInfo, ...] = ()
    reason: str = ""
    nodes_waiting: int = 0
    abort_cause: AbortCause = AbortCause.UNSPECIFIED
    # On JOB_ABORTED: the abort closed the job's run (JobEvent.closed).
    closed: bool = False


@dataclass(frozen=True)
class Transition:
    """A job changed state; adapters log it and count it."""

    job_id: str
    generation: int
    old: JobState | None
    new: JobState | None
    detail: str
    # The job's world (num_nodes x gpus_per_node) as of the change: what formed.
    world_size: int = 0
    # A job put back from storage at start-up (or to its durable state by an undo
    # after a failed commit, a state counted when it was committed): no change this
    # daemon saw, so not counted (a restart counted every restored job as entering its state again, and
    # Prometheus read the jump as new failures). ``since``: when (monotonic) the job
    # entered its state before the restart, what the status page's timeline shows.
    restored: bool = False
    since: float | None = None
    # A restored job's Unix time of entering its state, as the old daemon wrote it: a
    # drained restart's ``since`` leaves the downtime out of the state's age (its TTL),
    # and the timeline stamped a failure that much later (0.3 s down: 0.3 s late).
    since_unix: float | None = None
    # The generation failed by losing a member (not a conflicting joiner): what
    # ``rendezvousd_failures_detected_total`` counts, whoever there was to tell.
    lost: bool = False

    @property
    def failure(self) -> bool:
        """A generation that ended failed or aborted: a scale-up's abort is planned (an
        agent ended the generation for nodes waiting to join), not counted as one."""
        return self.new is JobState.FAILED or (
            self.new is JobState.ABORTED and self.detail != SCALE_UP_REASON
        )


@dataclass(frozen=True)
class Warn:
    """Something the operator should hear of that changes no job's state (a client
    too old for this daemon, a joiner a forming or running generation refused): adapters log it
    at WARNING."""

    job_id: str
    generation: int
    message: str
    # A join the forming or running generation refused, by the refusal's reason (a bounded label:
    # TOPOLOGY_MISMATCH, VERSION_MISMATCH, JOIN_MODE_MISMATCH): adapters count it. Its
    # ``message`` is "" when the job's rate limit held the line back.
    refused: str = ""


@dataclass(frozen=True)
class JobFailure:
    """The job's latest failed generation, kept with the job (across its next
    generations and a daemon restart): which, what failed it (its first loss, or a
    conflicting joiner's refusal), and when (the monotonic clock, in the daemon)."""

    generation: int
    cause: str
    at: float


Effect = Wake | Notify | Transition | Warn

#: The Transition detail of a job the daemon forgot (idle past ``job_ttl_s``): the end
#: of that job, after which a job token minted earlier opens no job of its id.
FORGOTTEN = "expired"


@dataclass(frozen=True)
class Progress:
    """Where a heartbeat stream's training stands, as its last beat said: the last
    step of each of its ranks (a node's by local rank; None before the first) and
    the node agent's restart budget. Shown only, never decided on."""

    steps: tuple[int | None, ...]
    restarts_used: int = 0
    max_restarts: int = 0


@dataclass(frozen=True)
class MemberView:
    info: MemberInfo
    state: MemberState
    heartbeat_age_s: float
    stream_open: bool
    # The rank's last step, as its stream (its node agent's) reported it.
    step: int | None = None
    # The cause of its loss, kept until storage takes writes (``Attendee.lost_as``).
    loss_pending: str = ""


@dataclass(frozen=True)
class JoiningNode:
    """A node agent seated in a forming generation, as inspection shows it: the node
    rank it named (None: it named none, the daemon assigns one at forming), its host,
    a tag of its instance id (``instance_tag``: never the id, the node's secret), and
    how long ago it joined."""

    node_rank: int | None
    host: str
    instance_tag: str
    joined_s: float


@dataclass(frozen=True)
class JobView:
    """What inspection may show: everything but the id."""

    job_id: str
    state: JobState
    generation: int
    num_nodes: int
    gpus_per_node: int
    members_present: int
    state_age_s: float
    members: tuple[MemberView, ...]
    failed: tuple[FailedInfo, ...]
    id_published: bool
    kv_keys: int
    abort_reason: str
    # Node agents parked to join (a scale-up while RUNNING, or forming): the status page.
    nodes_waiting: int = 0
    # Of those, the standbys (JoinNodeRequest.standby): waiting for a lost node's slot.
    standbys: int = 0
    # The restart budget the job's node agents reported: the most restarts any node
    # used, and the fewest any node has left (the first to run out ends the job).
    restarts_used: int | None = None
    restarts_left: int | None = None
    # The job's step: its slowest active rank's (None until one reported a step).
    step: int | None = None
    # Seats the forming generation keeps for nodes expected back after a failure, and
    # for how much longer (``placement.keep_seats``).
    seats_kept: int = 0
    seats_kept_s: float = 0.0
    # While a generation opened after the job ENDED forms: how long ago that end was.
    previous_run_ended_s: float | None = None
    # Why a forming generation FAILED with no member lost: the refusal of a joiner that
    # contradicted it (its topology, its version), as the joiners were told it.
    conflict: str = ""
    # The job's latest failed generation (None: none yet), and how many of its
    # generations failed or were aborted (``Transition.failure``), kept across a restart.
    last_failure: JobFailure | None = None
    failures: int = 0
    # While a node generation forms: its node agents seated so far (arrival order), the
    # node ranks none of them took where that is known (``placement.missing_node_ranks``;
    # None: unknown, nodes that name no rank take any free one), how many more it needs
    # to reach min_nodes, and min_nodes itself.
    joining: tuple[JoiningNode, ...] = ()
    missing_node_ranks: tuple[int, ...] | None = None
    nodes_needed: int = 0
    min_nodes: int = 0

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node
