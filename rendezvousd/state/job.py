"""One job's mutable state: its generation, members, barriers and key-value store."""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from rendezvousd.common.log_throttle import LogThrottle
from rendezvousd.common.model import (
    AbortCause,
    FailedInfo,
    JobFailure,
    JobState,
    JoinMode,
    MemberInfo,
    MemberState,
    Progress,
    failed_text,
)
from rendezvousd.errors import Code, Reason, RendezvousFault, shown
from rendezvousd.state.id_history import IdHistory

# Hot-path members as module names: on Python 3.11 each Enum.MEMBER lookup is a
# descriptor call (~0.2 us), and a join or heartbeat made several.
_NODE = JoinMode.NODE
#: How many joins' instance ids a generation keeps (``Generation.joined``): four times
#: the most ranks a job has by default (max_members_per_job), for its re-joins.
JOINS_KEPT = 4 * 8192
# How often the log says a joiner the running generation refused, per job
# (``rounds.refused``): a node of the wrong launch crash-looping under its supervisor
# re-joins every few seconds.
REFUSAL_LOG_S = 60.0


@dataclass(kw_only=True)
class Attendee:
    """What a heartbeat stream keeps alive: a member, or a node agent for its members."""

    # How a loss of it is worded: by silence, by its stream's end, and by its parked
    # join's cancel while forming.
    who: ClassVar[str] = "worker"
    stream_closed: ClassVar[str] = "heartbeat stream closed"
    cancelled: ClassVar[str] = "its Join was cancelled (worker died or disconnected)"
    # ...and by its client leaving the seat of a join it gave up (``LeaveRequest.given_up``).
    given_up: ClassVar[str] = (
        "its Join was given up by its caller (a deadline, a cancelled task, Ctrl-C) "
        "and not sent again"
    )
    # What it is called in a joiner's faults.
    joiner: ClassVar[str] = "worker"

    state: MemberState = MemberState.JOINING
    last_seen: float = 0.0
    # The gap between its last two beats: its cadence, which a drained restart uses to
    # tell a silent attendee from one between two beats (``snapshot.resume_silence``).
    # None until it beat twice: its first beat's gap is from its join or attach.
    beat_gap: float | None = None
    beaten: bool = False
    # Increases with every heartbeat stream attached, so that an old stream
    # closing after a reconnect is not mistaken for the attendee dying.
    stream_token: int = 0
    stream_open: bool = False
    # When its stream ended without a goodbye, while it has that long to re-attach
    # (a node agent's: ``liveness.cut_grace_s``); None otherwise. Not durable: a
    # restored attendee is given its time to reattach anyway.
    cut_at: float | None = None
    # The latest Progress its stream's beats carried (not durable: the next beat
    # after a daemon restart brings it back).
    progress: Progress | None = None
    # It said goodbye (Leave), kept when a failed commit undid that (``rollback``): its
    # stream's end or silence is then its goodbye again, not a loss.
    said_goodbye: bool = False
    # The cause it was lost with by its stream's end, its silence or its cut, kept when
    # a failed commit undid that loss (``rollback``), or found while storage fails: it is
    # still dead, and nothing else would say so again with its cause (its stream is
    # gone; the tick would next find it silent). Lost with it once storage takes writes
    # (``liveness.tick``). Not durable: a restart finds it again by the liveness rules.
    lost_as: str | None = None
    # ...and when it went (the daemon's clock): the kept losses of an outage are made
    # together, each at its own time, the first to go the root cause.
    lost_at: float | None = None
    # The host its last heartbeat stream came from (not durable: a restarted daemon
    # knows it from its next stream), matched against the hosts refused for their token.
    peer: str = ""
    # The gRPC peer (address and port: one connection) its last heartbeat stream came
    # over, not durable either: a call that names no instance id is an old SDK's only
    # when it rides this connection (``seats.own_connection``).
    connection: str = ""

    def attach(self, now: float) -> int:
        """A heartbeat stream opened; returns its token for ``detach``."""
        self.stream_token += 1
        self.stream_open = True
        self.cut_at = None
        self.lost_as = self.lost_at = None  # back: an undone loss was no death
        self.last_seen = now
        return self.stream_token

    def detach(self, token: int) -> bool:
        """The stream ``token`` ended; True when that loses an active attendee (no
        Leave came first). An older stream, replaced by a reconnect, changes nothing."""
        if self.stream_token != token:
            return False
        self.stream_open = False
        return self.state is MemberState.ACTIVE


@dataclass
class Member(Attendee):
    rank: int
    node_rank: int
    local_rank: int
    host: str
    address: str
    instance_id: str
    # A call for this rank came without an instance id over its own heartbeat stream's
    # connection and was refused: an SDK from before member instance ids, which sends
    # one in its Join and heartbeat only. Its loss is then worded as that
    # (``rounds.loss_cause``), not as the stream's end that followed.
    without_instance_id: bool = False

    def info(self) -> MemberInfo:
        return MemberInfo(self.rank, self.node_rank, self.local_rank, self.host, self.address)

    def loss(self, cause: str, now: float, witness: int | None = None) -> FailedInfo:
        """The record of losing this member at ``now``, relaying ``witness``'s report
        of it when set."""
        return FailedInfo(
            self.rank, self.host, cause, self.node_rank, self.local_rank, now, witness
        )


@dataclass
class Node(Attendee):
    """A node agent joined by JoinNode, holding gpus_per_node members once the
    generation forms. Its one heartbeat stream is the liveness of all of them."""

    who: ClassVar[str] = "node"
    stream_closed: ClassVar[str] = "node agent's heartbeat stream closed"
    # Its stream's end without its goodbye, not re-attached in time
    # (``liveness.cut_grace_s``): a connection reset looks the same as the agent's death.
    stream_cut: ClassVar[str] = (
        "node agent's heartbeat stream was cut and not re-attached in {gone:.1f} s "
        "(its connection was reset: a firewall or middlebox between, or the node agent died)"
    )
    cancelled: ClassVar[str] = "its JoinNode was cancelled (node agent died or disconnected)"
    given_up: ClassVar[str] = (
        "its JoinNode was given up by its node agent (a deadline, a cancelled task, "
        "Ctrl-C) and not sent again"
    )
    joiner: ClassVar[str] = "node agent"

    instance_id: str
    host: str
    addresses: tuple[str, ...]
    # The rank it asked for (``named``) while forming; its assigned rank once formed.
    node_rank: int
    named: bool
    arrived: float
    # The seat kept for it that it took (``Generation.owed``'s key), given back if
    # it leaves the forming generation while the seat is still kept.
    kept: str = ""
    # Its node rank in the last generation (the kept seat's), while forming: the nodes
    # expected back take the free ranks in this order, ahead of newcomers.
    before: int | None = None
    # Its agent's own id (``JoinArgs.agent``), kept with its wait if that ends. Not
    # stored: a restart forgets it, which costs only those words.
    agent: str = field(default="", repr=False)


class NodeTable(dict[str, Node]):
    """A generation's node agents by instance id, in arrival order, with the two
    lookups every JoinNode makes kept cheap: who holds a named node rank, and the
    first unnamed node in rank order (``first_unnamed``). (A scan of every node on each
    join made forming 1,024+ nodes quadratic: 11 of 24 s of the daemon's CPU at 4,096
    agents.)"""

    def __init__(self) -> None:
        super().__init__()
        self.named_at: dict[int, Node] = {}
        self.unnamed: dict[str, Node] = {}  # arrival order, as the table itself
        # (rank before, arrival, instance id) of the unnamed nodes expected back: a heap
        # whose entries for a node gone or changed are dropped when met (``first_unnamed``).
        self._before: list[tuple[int, float, str]] = []

    def _index(self, node: Node) -> None:
        if node.named:
            self.named_at[node.node_rank] = node
        else:
            self.unnamed[node.instance_id] = node
            if node.before is not None:
                heapq.heappush(self._before, (node.before, node.arrived, node.instance_id))

    def _unindex(self, node: Node) -> None:
        if node.named:
            if self.named_at.get(node.node_rank) is node:
                del self.named_at[node.node_rank]
        else:
            self.unnamed.pop(node.instance_id, None)

    def __setitem__(self, key: str, node: Node) -> None:
        if key in self:
            self._unindex(self[key])
        super().__setitem__(key, node)
        self._index(node)

    def __delitem__(self, key: str) -> None:
        self._unindex(self[key])
        super().__delitem__(key)

    def pop(self, key: str, *default: Node | None) -> Node | None:  # type: ignore[override]
        if key in self:
            self._unindex(self[key])
        return super().pop(key, *default)

    def clear(self) -> None:
        super().clear()
        self.named_at.clear()
        self.unnamed.clear()
        self._before.clear()

    def first_unnamed(self) -> Node | None:
        """The unnamed node that takes the first free rank (``placement.assignment``):
        the one expected back with the lowest rank before, else the earliest arrival."""
        while self._before:
            before, arrived, inst = self._before[0]
            node = self.get(inst)
            if node and not node.named and (node.before, node.arrived) == (before, arrived):
                return node
            heapq.heappop(self._before)
        return next(iter(self.unnamed.values()), None)

    def in_rank_order(self) -> list[Node]:
        """The unnamed nodes in the order they take the free ranks: those expected back
        by their rank before, then the others by arrival."""
        back = sorted(
            (n for n in self.unnamed.values() if n.before is not None),
            key=lambda n: (n.before, n.arrived),
        )
        return back + [n for n in self.unnamed.values() if n.before is None]


@dataclass
class BarrierState:
    completed: int = 0
    # rank -> waiters parked for the current round (a retried call adds one).
    arrived: dict[int, set[int]] = field(default_factory=dict)


@dataclass(frozen=True)
class EndedWait:
    """A joiner of a forming generation whose own join's deadline freed its seat: it
    came, and is not what the generation lacks. The joiners whose waits end after it
    name it so (their world lacked it by then, and they named it as missing: a node 0
    that came, its wait ended 27 ms before a peer's, read as the node to go and start)."""

    # "node 0", "a node" (no rank named yet), "rank 3": how messages name the seat.
    seat: str
    host: str
    at: float
    # The node rank it named, or a worker's rank; None: a node that named none.
    rank: int | None
    # Its node agent's own id (``JoinArgs.agent``; "" when it sent none): that agent's
    # join again drops this record, since it is the same node.
    agent: str = ""


#: How many ended waits a forming generation keeps (``Generation.ended_waits``): the
#: messages name 8 and count the rest.
ENDED_WAITS_KEPT = 64


@dataclass
class Generation:
    """What one round of a job owns: its members and node agents, the id, barriers, the
    key-value store, its parked calls and how it ended. The next round gets a new one
    (``Job.open_generation``): nothing is reset by hand, so nothing can be forgotten."""

    join_mode: JoinMode = JoinMode.NONE
    members: dict[int, Member] = field(default_factory=dict)
    host_nodes: dict[str, int] = field(default_factory=dict)
    unique_id: bytes | None = None
    failed: list[FailedInfo] = field(default_factory=list)
    abort_reason: str = ""
    # What the abort is, as data (AbortJobRequest.cause): what its peers act on.
    abort_cause: AbortCause = AbortCause.UNSPECIFIED
    barriers: dict[str, BarrierState] = field(default_factory=dict)
    # The Persister keeps the last committed generation's store, to put back should
    # opening the next one be undone by a failed commit.
    kv: dict[str, bytes] = field(default_factory=dict)
    kv_bytes: int = 0
    kv_waiters: dict[str, set[int]] = field(default_factory=dict)
    # waiter -> the seat its parked join waits in for the generation to form: a
    # worker's rank (Join, PublishId), a node agent's instance id (JoinNode).
    join_waiters: dict[int, int | str] = field(default_factory=dict)
    member_table: tuple[MemberInfo, ...] = ()
    # Kept as a count so a barrier arrival is O(1), not a scan of every member.
    left: int = 0
    # Restored from disk after a restart: the id is gone (it is never written).
    restored: bool = False
    # The id digest when only the digest survived a restart, so a replayed PublishId
    # can be told from a second, different id.
    restored_id_digest: bytes | None = None
    # Restored after the daemon was down this many seconds, at least a heartbeat
    # timeout: longer than every node's reconnect window, so each of its node agents
    # stopped its workers and joins again. Their re-joins fail it for the daemon's
    # outage, not for the node that came back first (``joins.join``). None otherwise.
    outage_s: float | None = None
    # Set when a joiner's topology contradicted the forming generation's: that
    # fault, not PEER_FAILED, is what every call on the failed generation gets.
    conflict: RendezvousFault | None = None
    # When rank 0 (node 0), answered id_required, loses its seat unless it sends the id.
    id_deadline: float | None = None
    # Since when every seat of this forming per-rank generation is held by no call
    # (``joins.unheld_seats_lapse``); None while a Join is parked or none is seated.
    unheld_since: float | None = None
    last_arrival: float = 0.0
    nodes: NodeTable = field(default_factory=NodeTable)  # by node instance id
    node_at: dict[int, Node] = field(default_factory=dict)  # by node rank, once formed
    # The node instance that supplied the id (it must stay node 0).
    id_node: str = ""
    # The node 0 whose parked JoinNode was last looked for (``joins.settle_holder``): node 0
    # never parks while it is node 0, so only a new node 0 needs the look.
    holder_seen: str = ""
    # The nodes-waiting count the running nodes were last told, and when (the events
    # are coalesced: joins.tell_waiting).
    waiting_told: int = 0
    waiting_told_at: float = 0.0
    # The instance ids of the nodes parked when this generation ended (scale-ups,
    # and standbys called into freed slots), woken to re-join.
    woken: set[str] = field(default_factory=set)
    # How many nodes the generation before this one expected back (its nodes not
    # lost, and its woken nodes) after it failed or was aborted; 0: none (a fresh
    # launch, or a relaunch after a clean end).
    rejoin_expected: int = 0
    # The seats standbys may take in this forming generation for nodes a first launch
    # lost while it formed (their agents died in their JoinNode): such a generation
    # expects nobody back, and read as a fresh launch, where a standby takes no seat;
    # the lost node's standby stood by while the others waited out their join
    # timeout. Only as many as were lost: the launch's other nodes keep theirs.
    standby_seats: int = 0
    # The seats kept for those of them not back yet: the instance id each held (or,
    # woken, holds) -> its host, until ``owed_until``. A re-join naming one takes
    # it; a newcomer gets only the seats they leave (``placement.claim``).
    owed: dict[str, str] = field(default_factory=dict)
    owed_until: float = 0.0
    # The instance id of every join that reached this generation in this daemon
    # process, seated or not (``saw``): a call of a seat of this generation from an
    # instance none of them is came from a run of the job this process never had
    # (``seats.forgotten``). None: too many to keep (``JOINS_KEPT``), nothing said.
    joined: set[str] | None = field(default_factory=set)
    # Kept seats claimed by host (a client too old to send previous_instance_id) ->
    # the claimer's instance id: provisional until owed_until, since the node that
    # held the seat may still come for it (``joins.take_back``).
    by_host: dict[str, str] = field(default_factory=dict)
    # The node rank each seat kept held in the last generation (``owed``'s keys).
    ranks_before: dict[str, int] = field(default_factory=dict)
    # Node instances of this generation that will not re-join (a final Leave): none
    # of the seats above is kept for them. Not stored: a restart forgets it, which
    # costs at most one seat hold.
    gone: set[str] = field(default_factory=set)
    # When the generation before this one ENDED (every member left), if it did: this
    # one was opened by a join after that end, a new run of the job id, or a node of
    # the run that ended started late (a pod restarted after success), which would
    # wait its join timeout here for nodes that are done. GetJob says so while this
    # one forms. Not stored: a restart forgets it, which costs only that hint.
    after_end: float | None = None
    # The joiners whose seats their own join's deadline freed while this generation
    # formed, by seat key (``Job.key``), oldest first, at most ``ENDED_WAITS_KEPT``;
    # a seat taken again is dropped (``waits.world_incomplete`` names the rest). Not
    # stored: a restart forgets it, which costs only those words.
    ended_waits: dict[int | str, EndedWait] = field(default_factory=dict)


@dataclass(frozen=True)
class Closed:
    """A close of a job's run (``Job.closed``)."""

    at: float
    reason: str
    generation: int
    #: The closing abort's cause, told to the nodes refused as closed: a node agent's
    #: setup error (``SETUP_ERROR``) ends them as one of their own.
    cause: AbortCause = AbortCause.UNSPECIFIED


@dataclass
class Job:
    job_id: str
    num_nodes: int
    gpus_per_node: int
    generation: int
    state: JobState
    state_since: float
    gen: Generation = field(default_factory=Generation)
    # When this daemon saw the job's last run end (ENDED: every member left). Not
    # stored: a restart forgets it, and nodes launched before the restart are then
    # not told apart from a new run's (``joins.launched_for_ended_run``).
    ended_at: float | None = None
    # The node instances parked for the job id's next run while that run finished
    # (``next_run_waiters``), woken by its end: launched before the end, they are no
    # nodes of the run that ended started late (``joins.launched_for_ended_run``),
    # which a node parked while the run still ran would be. Until the next run forms.
    # Not stored: a restart forgets it, and such a node is then told JOB_ENDED.
    next_run_nodes: set[str] = field(default_factory=set)
    # The node instances that left the run that ended by their own goodbye (not lost):
    # one of them re-joining is no node launched for that run, but its own agent
    # whose Leave ended it (a worker's failure it could not report), which the
    # refusal would have had exit 0 for a failed run (review).
    ended_leavers: frozenset[str] = frozenset()
    # A close of the job's run (AbortJob with ``close``): when, why, and the
    # generation it named; node agents launched before it are refused while that
    # generation, or the next one forming, is the job's (``joins.launched_before_close``).
    # Stored (a restart must not let them in), as Unix time.
    closed: Closed | None = None
    # SHA-256 of the ids this job's recent generations used: a new one needs a fresh id.
    used_id_digests: IdHistory = field(default_factory=IdHistory)
    # JoinNode generations: the elastic bounds (num_nodes is max_nodes while
    # forming, the formed count after) and the last call.
    min_nodes: int = 0
    max_nodes: int = 0
    last_call_s: float = 0.0
    # What the generation's node agents speak to each other's nodes
    # (``JoinNodeRequest.wire_version``; "" from an agent from before it), set by its
    # first joiner with the bounds: a node of another version is refused
    # (``version_conflict``). None: not known, a job restored from a row written
    # before it was stored; the next joiner sets it.
    wire_version: str | None = None
    # When the daemon began to drain (SIGTERM) while this job ran: its row is written
    # then with each attendee's last beat, so that a restart goes on counting their
    # silence (``snapshot.resume_silence``). None otherwise, and in a restored job.
    drained_at: float | None = None
    # How long the job had been in its state when the daemon began to drain (any
    # state): its row keeps it, and a restart puts ``state_since`` that far back from
    # its own now. A restarted daemon whose wall clock is ahead of the old one's read
    # the Unix ``state_since_unix`` as that much older (an ended job expired at once).
    # None otherwise, and in a restored job.
    state_age_at_drain: float | None = None
    # Whether the daemon said (``Warn``) that a member of this job calls without its
    # instance id (an SDK from before them): once per job, not per refused call.
    told_old_sdk: bool = False
    # waiter -> node instance id: JoinNode calls parked, while this generation runs,
    # for the next one.
    scaleup_waiters: dict[int, str] = field(default_factory=dict)
    # The scale-up waiters that are standbys (``JoinArgs.standby``): parked beyond
    # max_nodes too, counted as waiting only while the world has room for them.
    standby_waiters: set[int] = field(default_factory=set)
    # The scale-up waiters that parked while the running generation was finishing (a
    # member had left): a new run of the job id started before the last one's nodes
    # were all gone. Not told to the running nodes (NODES_WAITING would have them
    # re-form a run that is ending to take in a node of the next), nor bound by
    # max_nodes: they join the generation that opens once the run ended.
    next_run_waiters: set[int] = field(default_factory=set)
    # Standby node instance ids called into slots a failure freed: their JoinNode
    # takes a seat in the next generation (until it forms).
    standbys_called: set[str] = field(default_factory=set)
    # The job's failure history, which outlives its generations and is stored: its
    # latest failed generation, and how many failed or were aborted (a scale-up not).
    # A restart had kept only the current generation's losses: "restarts 2 used"
    # beside no cause anywhere but old log lines.
    last_failure: JobFailure | None = None
    failures: int = 0
    # Joins the running generation refused (another topology, version or mode): when
    # the last one was said in the log, and how many were not said since. Not stored:
    # a job restored or put back says its next refusal at once.
    refusals: LogThrottle[None] = field(
        default_factory=lambda: LogThrottle(REFUSAL_LOG_S), compare=False, repr=False
    )

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def standby_count(self) -> int:
        """Standby node agents parked on this job (one call each, retries aside)."""
        return len({self.scaleup_waiters[w] for w in self.standby_waiters})

    def rank_of(self, node_rank: int, local_rank: int) -> int:
        return node_rank * self.gpus_per_node + local_rank

    def attendees(self, mode: JoinMode) -> Mapping[int, Member | Node]:
        """Who a call of ``mode`` names by its rank: in a per-rank generation each worker
        (its global rank), in a node generation each formed node agent (its node rank).
        Streams, heartbeats, leaves and losses are the one path over these."""
        return self.gen.node_at if mode is _NODE else self.gen.members

    def covered(self, seated: Member | Node) -> list[Member]:
        """The members whose liveness ``seated``'s heartbeat stream is: a worker is its
        own, a node agent holds gpus_per_node."""
        if isinstance(seated, Member):
            return [seated]
        first = self.rank_of(seated.node_rank, 0)
        ranks = range(first, first + self.gpus_per_node)
        return [self.gen.members[r] for r in ranks if r in self.gen.members]

    def seat(self, key: int | str) -> Member | Node | None:
        """A forming joiner's seat (``Generation.join_waiters``): a worker's by its rank, a
        node agent's by its instance id."""
        return self.gen.members.get(key) if isinstance(key, int) else self.gen.nodes.get(key)

    @staticmethod
    def key(seat: Member | Node) -> int | str:
        """The key ``Job.seat`` finds ``seat`` by: a worker's rank, a node agent's
        instance id."""
        return seat.rank if isinstance(seat, Member) else seat.instance_id

    def missing_ranks(self) -> list[int]:
        return [r for r in range(self.world_size) if r not in self.gen.members]

    def present(self) -> list[Member]:
        return [
            m
            for m in self.gen.members.values()
            if m.state in (MemberState.JOINING, MemberState.ACTIVE)
        ]

    def participants(self) -> set[int]:
        """Ranks a barrier waits for: everyone who has not left."""
        return {r for r, m in self.gen.members.items() if m.state is not MemberState.LEFT}

    def barrier_complete(self, arrived: int) -> bool:
        """Whether ``arrived`` distinct non-leaving ranks are everyone a barrier waits for."""
        return arrived >= len(self.gen.members) - self.gen.left

    def all_waiters(self) -> set[int]:
        waiters = set(self.gen.join_waiters) | set(self.scaleup_waiters)
        for barrier in self.gen.barriers.values():
            for ws in barrier.arrived.values():
                waiters |= ws
        for ws in self.gen.kv_waiters.values():
            waiters |= ws
        return waiters

    def id_digest(self) -> bytes | None:
        if self.gen.unique_id is None:
            return self.gen.restored_id_digest
        return hashlib.sha256(self.gen.unique_id).digest()

    def remember_id(self) -> None:
        if self.gen.unique_id is not None:
            self.used_id_digests.add(hashlib.sha256(self.gen.unique_id).digest())

    def saw(self, instance_id: str) -> None:
        """A join of ``instance_id`` reached the current generation (``Generation.joined``)."""
        joined = self.gen.joined
        if joined is not None and instance_id not in joined:
            if len(joined) >= JOINS_KEPT:
                self.gen.joined = None
            else:
                joined.add(instance_id)

    def open_generation(self, now: float) -> None:
        """Start over with no members; everything scoped to the old generation goes."""
        self.remember_id()
        self.generation += 1
        self.state = JobState.FORMING
        self.state_since = now
        self.gen = Generation()

    @property
    def named(self) -> str:
        """How messages name this job's current generation."""
        return f"job {self.job_id!r} generation {self.generation}"

    def fault(
        self, code: Code, reason: Reason, message: str, /, **metadata: str
    ) -> RendezvousFault:
        """A fault about this job's current generation: its metadata names both."""
        scope = {"job_id": self.job_id, "generation": str(self.generation)}
        return RendezvousFault(code, reason, message, scope | metadata)

    def topology_conflict(self, host: str, asked: tuple[int, ...]) -> RendezvousFault:
        """Why a joiner asking for another topology is refused. When the generation
        is forming, the same fault fails it and either side may be the wrong one, so
        it names both topologies and every host joined so far.

        ``asked`` is ``(num_nodes, gpus_per_node)`` from a per-rank Join, or
        ``(min_nodes, max_nodes, gpus_per_node)`` from a node agent's JoinNode.
        """
        by_node = self.gen.join_mode is JoinMode.NODE
        ours = (self.min_nodes, self.max_nodes) if by_node else (self.num_nodes,)
        have, have_code = _topology_text((*ours, self.gpus_per_node))
        want, want_code = _topology_text(asked)
        hosts = sorted(
            {m.host for m in self.gen.members.values()} | {n.host for n in self.gen.nodes.values()}
        )
        joined = f" (hosts so far: {shown(hosts)})" if hosts else ""
        asker, fix = (
            (
                "the node agent",
                # Only what differs: torchrun's agents are nodes of one rank each, so
                # theirs can only be --nnodes (their --nproc-per-node may differ).
                "every node of a job must use the same --nnodes (MIN:MAX): fix it and relaunch"
                if asked[-1] == self.gpus_per_node
                else "every node of a job must use the same --nnodes and --nproc-per-node: "
                "fix them and relaunch",
            )
            if by_node
            else (
                "a worker",
                "every worker of a job must join with the same num_nodes and gpus_per_node "
                "(rendezvous-run's and torchrun's --nnodes / --nproc-per-node): fix them and "
                "relaunch",
            )
        )
        return self.fault(
            Code.FAILED_PRECONDITION,
            Reason.TOPOLOGY_MISMATCH,
            f"{self.named} has {have}{joined}, but {asker} on host {host!r} asked for {want}; "
            f"{fix}",
            topology=have_code,
            requested_topology=want_code,
            offending_host=host,
            hosts=",".join(hosts),
        )

    def version_conflict(self, host: str, theirs: str) -> RendezvousFault:
        """Why a node agent whose ``wire_version`` differs from the generation's nodes'
        is refused: the nodes run different rendezvousd versions, whose workers cannot
        talk to each other (the CPU ring refuses the handshake, after the job formed and
        burnt its restarts). It names both sides' hosts and versions, "" as an agent
        from before version reporting, and which of them to upgrade is the operator's
        call: "every node to the same rendezvousd"."""
        ours = self.wire_version or ""
        hosts = sorted(
            {m.host for m in self.gen.members.values()} | {n.host for n in self.gen.nodes.values()}
        )
        joined = f"the node agents joined so far (on {shown(hosts)})" if hosts else "its nodes"
        return self.fault(
            Code.FAILED_PRECONDITION,
            Reason.VERSION_MISMATCH,
            f"{self.named}: the node agent on host {host!r} runs another rendezvousd version "
            f"than {joined}: its wire version is {_wire_text(theirs)}, theirs "
            f"{_wire_text(ours)}. Nodes of two versions cannot train together (their "
            "workers' connections would be refused); upgrade every node of the job to the "
            "same rendezvousd, then relaunch them",
            wire_version=ours,
            requested_wire_version=theirs,
            offending_host=host,
            hosts=",".join(hosts),
        )

    @property
    def closed_now(self) -> bool:
        """Whether the job's run was closed at its current generation (``closed``)."""
        return self.closed is not None and self.closed.generation == self.generation

    def generation_fault(self) -> RendezvousFault:
        """Why calls on this (no longer usable) generation fail."""
        if self.gen.conflict is not None:
            return self.gen.conflict
        if self.state is JobState.FAILED:
            # In the order of loss, the first being the root cause; each loss with its
            # host is in the fault's details (fault_status), the metadata only lists.
            return RendezvousFault(
                Code.ABORTED,
                Reason.PEER_FAILED,
                f"{failed_text(self.named, self.gen.failed)}; restart the job (a new Join opens "
                "the next generation)",
                {
                    "job_id": self.job_id,
                    "generation": str(self.generation),
                    "ranks": ",".join(str(f.rank) for f in self.gen.failed),
                    "hosts": ",".join(dict.fromkeys(f.host for f in self.gen.failed)),
                },
                self.gen.failed,
            )
        if self.state is JobState.ABORTED:
            return self.fault(
                Code.ABORTED,
                Reason.JOB_ABORTED,
                f"{self.named} was aborted: {self.gen.abort_reason}",
                reason=self.gen.abort_reason,
                **abort_cause_meta(self.gen.abort_cause),
                # Always said ("false" too): a reader tells a close by it, not by the
                # reason's words, which any caller of AbortJob chooses. "placed": the
                # caller was in the closed generation (a standby called into it too),
                # not a node refused for a run that no longer needs it.
                closed=str(self.closed_now).lower(),
                **({"placed": "true"} if self.closed_now else {}),
            )
        if self.state is JobState.ENDED:
            return self.fault(
                Code.FAILED_PRECONDITION,
                Reason.JOB_ENDED,
                f"{self.named} has ended: every member left",
            )
        return self.fault(
            Code.FAILED_PRECONDITION,
            Reason.NOT_RUNNING,
            f"{self.named} is still forming ({len(self.gen.members)} of {self.world_size} ranks "
            "joined); wait for Join to return",
        )


#: What sends a Join with its instance id but none in its later calls.
OLD_SDK = "an SDK from before member instance ids (2026-12-01)"


#: When node agents started sending ``wire_version``: an agent that sends none is older.
VERSION_REPORTING = "2026-12-07"


def _wire_text(version: str) -> str:
    """A node's ``wire_version`` as a version conflict words it."""
    if not version:
        return (
            "not said (a rendezvous-run from before version reporting, "
            f"{VERSION_REPORTING}, or a node agent that is not rendezvous-run)"
        )
    return repr(version)


def _topology_text(topology: tuple[int, ...]) -> tuple[str, str]:
    """A topology in words and in the compact form of a fault's metadata."""
    if len(topology) == 3:
        low, high, gpus = topology
        return f"nodes {low}:{high} x gpus_per_node={gpus}", f"{low}:{high}x{gpus}"
    num_nodes, gpus = topology
    return f"num_nodes={num_nodes} gpus_per_node={gpus}", f"{num_nodes}x{gpus}"


def abort_cause_meta(cause: AbortCause) -> dict[str, str]:
    """An abort's cause in a JOB_ABORTED fault's metadata: absent for an abort like any
    other, as from a daemon before causes."""
    return {} if cause is AbortCause.UNSPECIFIED else {"abort_cause": cause.name}
