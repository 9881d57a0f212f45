"""Where a joiner sits: the one join request and its checks, node ranks (named, by host,
or assigned at forming), node 0 and rank 0's id, freeing a seat, and what a join is told.

A join is a node contributing ranks to a generation of ``min_nodes``..``max_nodes`` nodes
of ``gpus_per_node`` ranks: a node agent's JoinNode contributes its node's every rank; a
worker's Join, the thin form (``JoinArgs.worker``), one, with bounds num_nodes..num_nodes.
Pure functions over one job; ``joins`` decides when a joiner is admitted, parked,
formed or failed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

from rendezvousd.common import validation
from rendezvousd.common.limits import Limits
from rendezvousd.common.model import (
    FailedInfo,
    JobState,
    JoinMode,
    JoinResult,
    MemberInfo,
    MemberState,
)
from rendezvousd.errors import Code, Reason, RendezvousFault
from rendezvousd.state.job import Job, Member, Node


@dataclass(frozen=True)
class JoinArgs:
    job_id: str
    min_nodes: int
    max_nodes: int
    gpus_per_node: int
    node_rank: int | None
    host: str
    # One per local rank contributed, from local rank 0 (a worker's: its own, if any).
    addresses: tuple[str, ...]
    unique_id: bytes
    instance_id: str
    # How long this join may wait, and the last call it asks for (0: defaults). Rank 0
    # (node 0) answered id_required holds its seat this long at most without the id.
    wait_s: float = 0.0
    last_call_s: float = 0.0
    # The one rank a worker's Join contributes, by its local rank; None: a node agent's
    # JoinNode, contributing every local rank of its node.
    local_rank: int | None = None
    # A node agent's standby: it parks while the world is full and takes a seat only
    # when a failure frees one (``joins.stand_by``), so that a lost node is replaced
    # by an agent already running with warm spares.
    standby: bool = False
    # The instance id this node agent held in the job's last generation ("" for its
    # first join; None: a client too old to say), so that it takes the seat the
    # next generation keeps for it (``claim``).
    previous: str | None = None
    # When this node agent was launched, on the daemon's clock, if its first join says
    # (``JoinNodeRequest.launched_ms_ago``): a job whose run ended after that refuses
    # it (``joins.launched_for_ended_run``).
    launched_at: float | None = None
    # What this node agent's workers speak to other nodes' (``JoinNodeRequest.
    # wire_version``; "" from an agent from before it, and from any per-rank Join):
    # every node of a generation must send the same (``joins.job_for``).
    wire_version: str = ""
    # The node agent's own id, the same in every join it sends ("" from an older
    # client, or a worker's Join): its join whose wait ended and its join again are
    # one node (``joins.seat_node``, ``waits.world_incomplete``).
    agent: str = ""

    @classmethod
    def worker(
        cls,
        job_id: str,
        num_nodes: int,
        gpus_per_node: int,
        node_rank: int | None,
        local_rank: int,
        host: str,
        address: str,
        unique_id: bytes,
        instance_id: str,
        wait_s: float = 0.0,
    ) -> JoinArgs:
        """A worker's per-rank Join: a node join of one rank, its bounds num_nodes..num_nodes."""
        return cls(
            job_id,
            num_nodes,
            num_nodes,
            gpus_per_node,
            node_rank,
            host,
            (address,),
            unique_id,
            instance_id,
            wait_s,
            0.0,
            local_rank,
        )

    @property
    def mode(self) -> JoinMode:
        return _NODE if self.local_rank is None else _RANK


#: The longest ``wire_version`` a join may send (it is stored with the job).
MAX_WIRE_VERSION = 128


# Hot-path members as module names: on Python 3.11 each Enum.MEMBER lookup is a
# descriptor call (~0.2 us), and a join made several.
_NODE, _RANK, _LOST = JoinMode.NODE, JoinMode.RANK, MemberState.LOST


def check(args: JoinArgs, limits: Limits) -> None:
    """Refuses a malformed request before it can create or touch a job."""
    validation.job_id(args.job_id)
    validation.topology(args.max_nodes, args.gpus_per_node, limits)
    if not 1 <= args.min_nodes <= args.max_nodes:
        raise validation.invalid(
            Reason.INVALID_TOPOLOGY,
            f"min_nodes={args.min_nodes} max_nodes={args.max_nodes} is invalid: give "
            "1 <= min_nodes <= max_nodes to join_node() (rendezvous-run/torchrun: "
            "--nnodes MIN:MAX)",
            job_id=args.job_id,
        )
    validation.text_field("host", args.host, limits.max_host_bytes, required=True)
    validation.text_field("instance_id", args.instance_id, 128, required=True)
    validation.text_field("previous_instance_id", args.previous or "", 128, required=False)
    validation.text_field("wire_version", args.wire_version, MAX_WIRE_VERSION, required=False)
    validation.text_field("agent_id", args.agent, 128, required=False)
    if len(args.addresses) > args.gpus_per_node:
        raise validation.invalid(
            Reason.INVALID_ARGUMENT,
            f"{len(args.addresses)} addresses for gpus_per_node={args.gpus_per_node}: "
            "give at most one per local rank",
            job_id=args.job_id,
        )
    for address in args.addresses:
        validation.text_field("address", address, limits.max_host_bytes, required=False)
    if args.unique_id:
        validation.unique_id(args.unique_id)
    if args.local_rank is not None:
        validation.rank_in_range(
            "local_rank", args.local_rank, "gpus_per_node", args.gpus_per_node, job_id=args.job_id
        )
    if args.node_rank is not None:
        nodes = "num_nodes" if args.min_nodes == args.max_nodes else "max_nodes"
        validation.rank_in_range(
            "node_rank", args.node_rank, nodes, args.max_nodes, job_id=args.job_id
        )


def returning(job: Job | None, args: JoinArgs) -> bool:
    """Whether the joiner is a retry of a seat in ``job``'s current generation, so that
    its join does not open the next one: a node agent's while its node is listed and not
    lost; a worker's only in a generation that failed or was aborted, and not lost (a
    retried Join of a member stays fenced; the look is a scan of its members).

    A seat lost is not returning: its joiner is alive after all (its Join or JoinNode cut
    by a connection blip, read as its death, and re-sent by its SDK or by gRPC's retry;
    or its answer lost with the connection), and answered its generation's PEER_FAILED,
    it read its own loss as a peer's: torchrun's handler listed "the node joining from
    <its own host>" among the nodes to replace, and a worker was told its own rank
    failed. It joins the next one."""
    if job is None:
        return False
    if args.local_rank is None:
        node = job.gen.nodes.get(args.instance_id)
        return node is not None and node.state is not _LOST
    return job.state in (JobState.FAILED, JobState.ABORTED) and any(
        m.instance_id == args.instance_id and m.state is not _LOST for m in job.gen.members.values()
    )


def node_rank(job: Job, args: JoinArgs) -> int:
    """A worker's node: the one it named, else its host's, else the first free one."""
    if args.node_rank is not None:
        return args.node_rank
    known = job.gen.host_nodes.get(args.host)
    if known is not None:
        return known
    taken = set(job.gen.host_nodes.values()) | {m.node_rank for m in job.gen.members.values()}
    for node in range(job.num_nodes):
        if node not in taken:
            return node
    raise job.fault(
        Code.RESOURCE_EXHAUSTED,
        Reason.WORLD_FULL,
        f"job {job.job_id!r} already has num_nodes={job.num_nodes} hosts; {args.host!r} cannot "
        "get a node rank",
    )


def abandoned(job: Job, member: Member) -> bool:
    """Whether no call holds ``member``'s rank any more: a joiner of a forming generation
    with no Join (or PublishId) parked. An undone commit leaves one (it wakes every
    parked call of the job), and so does rank 0 answered ``id_required`` until its
    PublishId arrives: its worker may retry, or another instance take the rank.

    Rank 0 owing the id is held by no call: nothing tells the daemon that its worker
    died before PublishId, so its restart takes the rank at once rather than waiting
    out the old Join's wait; a PublishId of the old instance is then refused as
    another instance's (a parked one ties the rank to its call: its end fails the
    generation at once)."""
    if job.state is not JobState.FORMING or member.state is not MemberState.JOINING:
        return False
    return member.rank not in job.gen.join_waiters.values()


def member_instance_id(node_instance: str, local_rank: int) -> str:
    """The instance id a node's worker acts under: derived from the node's own secret
    instance id, so only that node's agent (and whom it tells) knows it."""
    return hashlib.sha256(f"{node_instance}/{local_rank}".encode()).hexdigest()[:32]


def holder(job: Job) -> Member | Node | None:
    """The seat holding global rank 0, which supplies the id: a worker's rank 0; in a node
    generation node 0 once formed, while forming the node that named rank 0, else the
    earliest arrival that named none."""
    if job.gen.join_mode is not _NODE:
        return job.gen.members.get(0)
    if job.gen.node_at:
        return job.gen.node_at.get(0)
    # The first unnamed node in the order ``assignment`` gives the free ranks in.
    return job.gen.nodes.named_at.get(0) or job.gen.nodes.first_unnamed()


def assignment(job: Job) -> dict[str, int] | None:
    """Node ranks for the nodes now present (by instance id), or None when the named
    ranks do not fit 0..n-1 yet: named ranks are kept, the others fill the free
    ranks in order: the nodes expected back after a failure in the order of their
    last ranks, then the others by arrival (``NodeTable.in_rank_order``). So node 0
    stays node 0 and the survivors keep their order whichever re-joins first (the
    node whose own worker failed hears it first), and a newcomer comes after them."""
    count = len(job.gen.nodes)
    named = {n.node_rank for n in job.gen.nodes.values() if n.named}
    if any(r >= count for r in named):
        return None
    free = iter(r for r in range(count) if r not in named)
    ranks = {n.instance_id: n.node_rank for n in job.gen.nodes.values() if n.named}
    for node in job.gen.nodes.in_rank_order():
        ranks[node.instance_id] = next(free)
    return ranks


def missing_node_ranks(job: Job) -> list[int] | None:
    """The node ranks no node of the forming generation took, where that is known: a
    fixed-size job (min_nodes = max_nodes) whose every node named its rank (rendezvous-run
    --node-rank). None otherwise: a node that names none takes any free rank, so only a
    count of the nodes still needed says what is missing (``nodes_needed``)."""
    if job.gen.join_mode is not _NODE or job.min_nodes != job.max_nodes:
        return None
    if job.gen.nodes.unnamed:
        return None
    taken = job.gen.nodes.named_at
    return [r for r in range(job.max_nodes) if r not in taken]


def nodes_needed(job: Job) -> int:
    """How many more nodes the forming node generation needs to reach min_nodes."""
    return max(0, job.min_nodes - len(job.gen.nodes))


def place(job: Job, ranks: dict[str, int]) -> None:
    """Turns the forming nodes into members: node r holds ranks r * gpus_per_node ..."""
    job.num_nodes = len(ranks)
    job.gen.members.clear()
    job.gen.node_at.clear()
    for node in job.gen.nodes.values():
        node.node_rank = ranks[node.instance_id]
        job.gen.node_at[node.node_rank] = node
        for local in range(job.gpus_per_node):
            rank = job.rank_of(node.node_rank, local)
            address = node.addresses[local] if local < len(node.addresses) else ""
            job.gen.members[rank] = Member(
                rank,
                node.node_rank,
                local,
                node.host,
                address,
                member_instance_id(node.instance_id, local),
            )


def cancelled(job: Job, seat: Member | Node, now: float) -> FailedInfo:
    """A forming joiner whose parked join was cancelled (its process died or
    disconnected): its loss, at its first rank (a node's as if the generation formed now)."""
    if isinstance(seat, Member):
        return seat.loss(seat.cancelled, now)
    node_rank = (assignment(job) or {}).get(seat.instance_id, seat.node_rank)
    return FailedInfo(job.rank_of(node_rank, 0), seat.host, seat.cancelled, node_rank, 0, now)


def owed_back(job: Job) -> dict[str, str]:
    """The nodes that should re-join after ``job``'s node generation failed or was
    aborted, by the instance id each held (or, woken from parking, holds) -> its
    host: its nodes that were not lost, and the nodes woken to re-join (scale-ups,
    standbys called into freed slots), less those that said they will not (a final
    Leave); none (nobody in particular) after any other end, nor after a close
    (``Job.closed_now``: its nodes are refused as closed
    while the next generation forms, ``joins.launched_before_close``; it kept a seat
    for each for a seat hold, and the new run's nodes were refused WORLD_FULL)."""
    if (
        job.gen.join_mode is not JoinMode.NODE
        or job.state not in (JobState.FAILED, JobState.ABORTED)
        or job.closed_now
    ):
        return {}
    owed = {n.instance_id: n.host for n in _staying(job)}
    gone = job.gen.gone
    owed.update((inst, "") for inst in job.gen.woken if inst not in owed and inst not in gone)
    return owed


def ranks_before(job: Job) -> dict[str, int]:
    """The node rank of each node of ``job``'s formed generation, by instance id: the
    order its nodes expected back keep (``Node.before``)."""
    return {n.instance_id: rank for rank, n in job.gen.node_at.items()}


def keep_seats(job: Job, owed: dict[str, str], hold_s: float, now: float) -> None:
    """The generation just opened keeps a seat for each node in ``owed`` for
    ``hold_s``: the survivors re-join within a second or two (seconds under heavy
    load), and a replacement started meanwhile (a pod rescheduled, a
    ``--standby-if-full`` node) must not take a survivor's seat, which would leave
    the survivor, holding the job's in-memory state, outside the world."""
    job.gen.owed = owed
    job.gen.owed_until = now + hold_s


def claim(job: Job, args: JoinArgs, now: float) -> str | None:
    """The seat kept for this joiner in a forming generation (the key of
    ``Generation.owed``), or None: a woken node by its own instance id, a survivor by
    the one it held (``JoinArgs.previous``), a client too old to say by its host."""
    owed = job.gen.owed
    if not owed or now >= job.gen.owed_until:
        return None
    if args.instance_id in owed:
        return args.instance_id
    if args.previous is not None:
        return args.previous if args.previous in owed else None
    return next((inst for inst, host in owed.items() if host == args.host), None)


def seats_kept(job: Job) -> dict[str, str]:
    """Every seat ``job``'s forming generation keeps for a node expected back, claimed
    or not (the set it opened with, less the lapsed): what a restarted daemon keeps
    again in the generation it fences this one with."""
    claimed = {n.kept: n.host for n in job.gen.nodes.values() if n.kept}
    return claimed | job.gen.owed


def kept_for_others(job: Job, now: float) -> int:
    """How many seats of ``job``'s forming generation are still kept for nodes
    expected back (0 once the hold ran out)."""
    return len(job.gen.owed) if now < job.gen.owed_until else 0


def has_room(job: Job, now: float) -> bool:
    """Whether a newcomer (a joiner for whom no seat is kept) may take a seat now."""
    return len(job.gen.nodes) + kept_for_others(job, now) < job.max_nodes


def _staying(job: Job) -> Iterator[Node]:
    """The nodes of ``job``'s generation that were not lost, nor said they will not
    re-join (a final Leave)."""
    gone = job.gen.gone
    return (n for n in job.gen.nodes.values() if n.state is not _LOST and n.instance_id not in gone)


def kept_nodes(job: Job) -> int:
    """How many nodes of ``job``'s generation stay (``_staying``)."""
    return sum(1 for _ in _staying(job))


def waiting_count(job: Job) -> int:
    """The parked nodes the running generation has room for: what NODES_WAITING
    tells. A standby parked while the world is full is not counted: the running
    nodes would end their generation to re-form the same world; nor is a node of
    the job's next run parked while this one finishes (``Job.next_run_waiters``)."""
    parked = len(
        {i for w, i in job.scaleup_waiters.items() if w not in job.next_run_waiters}
        if job.next_run_waiters
        else set(job.scaleup_waiters.values())
    )
    return min(parked, max(0, job.max_nodes - job.num_nodes))


def standby_room(job: Job, now: float) -> bool:
    """Whether a standby may take a seat now: a failed (aborted) generation, or the
    one forming after it, has a slot that the nodes expected back do not fill (nor
    the seats kept for them, ``keep_seats``); so does one forming after a first
    launch lost nodes while it formed, as many as it lost (``lost_forming``). A fresh
    launch's forming generation has none (a standby never displaces a node started
    to be part of it)."""
    if job.state in (JobState.FAILED, JobState.ABORTED):
        return kept_nodes(job) + len(job.gen.woken) < job.max_nodes
    if job.state is JobState.FORMING and (job.gen.rejoin_expected or job.gen.standby_seats):
        return has_room(job, now)
    return False


def lost_forming(job: Job) -> int:
    """How many node agents ``job``'s generation lost before it ever formed (their
    JoinNode cut: ``joins.join_wait_ended``), if it failed so; else 0."""
    if job.state is not JobState.FAILED or job.gen.join_mode is not JoinMode.NODE:
        return 0
    if job.closed_now:  # a new run next: its standbys are refused as closed
        return 0
    if job.gen.node_at:  # it formed: its losses free seats the usual way (owed_back)
        return 0
    return sum(1 for n in job.gen.nodes.values() if n.state is _LOST)


def everyone_back(job: Job) -> bool:
    """Every node the last generation expects back has joined this one: forming need
    not wait out the last call.

    The last call exists so that nodes starting at about the same time land in one
    generation. After a failure the daemon knows who is coming: the survivors (the
    lost nodes' agents are gone) and any node that was waiting for a scale-up. Once
    they are all here, waiting ``last_call_s`` (30 s by default) would only stall the
    survivors. A replacement for a lost node that starts later is not waited for: it
    parks, the running nodes hear NODES_WAITING and re-form with it, which costs no
    restart. A generation that ended cleanly (ENDED) expects nobody, so a relaunch
    with the same job id keeps the last call. A newcomer seated beside them does not
    stand in for one: a node not back is waited for while its seat is kept (one
    heartbeat timeout, ``joins.seats_lapse``), then not."""
    return job.gen.rejoin_expected > 0 and not job.gen.owed


def _sender(seat: Member | Node) -> str:
    where = f"rank {seat.rank}" if isinstance(seat, Member) else f"node {seat.node_rank}"
    return f"{where} on {seat.host!r}"


def not_rank_zero(job: Job, seat: Member | Node, call: str) -> str:
    """How an id sent by ``seat``, which does not hold global rank 0, is refused (by a
    join carrying one, or a PublishId): the same words for either call."""
    return (
        f"only global rank 0 (node 0's) supplies the unique id of {job.named}; "
        f"{_sender(seat)} sent {call}"
    )


def accept_id(job: Job, seat: Member | Node, unique_id: bytes, call: str) -> None:
    """Takes the generation's id from ``seat``, which must hold global rank 0
    (``holder``), or raises why it cannot be used; ``call``: what sent it, as the
    refusal words it."""
    if seat is not holder(job):
        raise validation.invalid(
            Reason.INVALID_ID, not_rank_zero(job, seat, call), job_id=job.job_id
        )
    digest = hashlib.sha256(unique_id).digest()
    # The same id again is a retry; so is, restored after a restart with only the
    # digest, a replay of it (e.g. a PublishId retried across the restart).
    replay = job.gen.unique_id == unique_id or (
        job.gen.unique_id is None and job.gen.restored_id_digest == digest
    )
    if not replay and job.id_digest() is not None:
        raise job.fault(
            Code.ALREADY_EXISTS,
            Reason.ID_CONFLICT,
            f"{_sender(seat)} sent a unique id other than the one {job.named} already "
            "has; the first one is kept: a restarted rank 0 must join again, not re-publish",
        )
    if not replay and digest in job.used_id_digests:
        raise validation.invalid(
            Reason.ID_REUSED,
            f"this unique id was already used by an earlier generation of job {job.job_id!r}; "
            "every generation needs a fresh id",
            job_id=job.job_id,
        )
    job.gen.unique_id = unique_id
    job.gen.id_node, job.gen.id_deadline = seat.instance_id, None


def answer(job: Job, seat: Member | Node, *, id_required: bool = False) -> JoinResult:
    """What ``seat``'s join is told: once the generation runs, the id and the member table
    (and a node agent its members' instance ids); ``id_required``: rank 0 (node 0) is
    asked for the id, which it sends (PublishId; a node agent its JoinNode again)."""
    local = seat.local_rank if isinstance(seat, Member) else None
    ids: tuple[str, ...] = ()
    members: tuple[MemberInfo, ...] = ()
    if id_required:
        unique_id = b""
    else:
        assert job.gen.unique_id is not None
        unique_id, members = job.gen.unique_id, job.gen.member_table
        if local is None:
            # The ids ``place`` derived for the node's block (a hash each: not again).
            first = job.rank_of(seat.node_rank, 0)
            members_of = job.gen.members
            ids = tuple(members_of[first + g].instance_id for g in range(job.gpus_per_node))
    return JoinResult(
        job.job_id,
        job.generation,
        seat.node_rank,
        job.num_nodes,
        job.gpus_per_node,
        local,
        id_required,
        unique_id,
        members,
        ids,
    )


def mode_mismatch(job: Job, wanted: JoinMode, host: str) -> RendezvousFault:
    """A per-rank Join in a node-joined generation, or the reverse."""
    have = "node agents (JoinNode)" if job.gen.join_mode is JoinMode.NODE else "per-rank Join calls"
    asked = "a node join (JoinNode)" if wanted is JoinMode.NODE else "a per-rank Join"
    return job.fault(
        Code.FAILED_PRECONDITION,
        Reason.JOIN_MODE_MISMATCH,
        f"{job.named} is joined by {have}; {asked} from host {host!r} cannot take part: "
        "start every node of a job the same way (all under rendezvous-run's node agent, or "
        "all workers joining per rank)",
        offending_host=host,
    )


def duplicate(job: Job, args: JoinArgs, holder: Member | Node, now: float) -> RendezvousFault:
    """Another instance holds the seat this joiner was placed on: a worker's rank, or the
    node rank a node agent named. (Only a job of two or more nodes gets the latter: a
    single node's second agent finds the world full, and there every node must give its
    rank: a number, or ``auto``.) ``holder_heard_ms``: how long since the holder was last
    heard, its heartbeat: a node agent asking again sees a live twin's advance, a frozen
    predecessor's not. Only while the generation runs: a holder in a forming one sends no
    heartbeat yet (its join waits), so nothing would tell a live twin from a frozen one."""
    rank, local = job.rank_of(holder.node_rank, args.local_rank or 0), args.local_rank
    seat = f"node_rank={holder.node_rank}"
    if local is not None:
        seat = f"rank {rank} ({seat}, local_rank={local})"
    # A worker refused by a live member of the running generation: most often a relaunch
    # (a second srun step of one allocation, a resubmission) while the job id's earlier
    # run still trains, whose every rank read the numbering advice (h130 review F5).
    overlaps = (
        local is not None and job.state is JobState.RUNNING and holder.state is MemberState.ACTIVE
    )
    return job.fault(
        Code.ALREADY_EXISTS,
        Reason.DUPLICATE_RANK,
        f"{seat} of {job.named} is already held by the {holder.joiner} on {holder.host}; "
        + (
            f"another run of job {job.job_id!r} is still running (generation "
            f"{job.generation}, {len(job.gen.members)} ranks, rank {rank} on {holder.host}): "
            "wait for it to end, or give this run a job id of its own (under srun: "
            "$SLURM_JOB_ID.$SLURM_STEP_ID, as each step of one allocation shares "
            f"SLURM_JOB_ID); `rendezvousd status {job.job_id}` shows that run. If this "
            f"worker is one of that run's, two workers were given rank {rank}: give each "
            "its own (node_rank, and on a node a distinct local_rank)"
            if overlaps
            else f"give each worker its own (node_rank 0..{job.max_nodes - 1}, and on a node a "
            "distinct local_rank), or node_rank=None to let the daemon place it"
            if local is not None
            else f"give each node a distinct --node-rank (0..{job.max_nodes - 1}), or "
            "--node-rank auto to let the daemon assign it"
            + (
                # Said while forming, where an agent on another host is refused at once:
                # no heartbeat tells a live twin (the usual cause) from a predecessor
                # frozen or cut off while its join waits, whose replacement read only
                # the twin's advice, and ran into the same refusal again.
                ". If this node instead replaces that one (moved off a host that froze or "
                "was cut off while its join waited), that join holds the seat until it "
                "ends: stop that agent, or start this node again once the job formed "
                "(the daemon then loses a node that sends no heartbeat, within its heartbeat "
                "timeout)"
                if job.state is JobState.FORMING
                else ""
            )
        ),
        ranks=str(rank),
        node_rank=str(holder.node_rank),
        holder_host=holder.host,
        offending_host=args.host,
        **(
            {"holder_heard_ms": str(max(0, round((now - holder.last_seen) * 1000)))}
            if job.state is JobState.RUNNING
            else {}
        ),
    )


def world_full(job: Job, host: str, now: float | None = None) -> RendezvousFault:
    """The generation already has max_nodes nodes (or seats kept for nodes expected
    back fill the rest, at ``now``): a newcomer cannot join it."""
    kept = kept_for_others(job, now) if now is not None else 0
    has = (
        f"{len(job.gen.nodes)} node(s) and {kept} seat(s) kept for nodes re-joining after "
        f"the failure (max_nodes={job.max_nodes})"
        if kept
        else f"max_nodes={job.max_nodes} nodes"
    )
    return job.fault(
        Code.RESOURCE_EXHAUSTED,
        Reason.WORLD_FULL,
        f"{job.named} already has {has}; the node agent on {host!r} cannot join it",
        max_nodes=str(job.max_nodes),
        offending_host=host,
        **({"seats_kept": str(kept)} if kept else {}),
    )


def scaleup_timeout(job: Job, waited: str) -> RendezvousFault:
    """A parked scale-up JoinNode waited in vain for the running generation to end."""
    return job.fault(
        Code.DEADLINE_EXCEEDED,
        Reason.WORLD_INCOMPLETE,
        f"{job.named} kept running with {job.num_nodes} of max_nodes={job.max_nodes} nodes "
        f"for {waited}; the running nodes did not end it to take this node in",
    )


def still_finishing(job: Job, waited: str) -> RendezvousFault:
    """A node of the job id's next run waited in vain for the run before to end: some
    of its nodes left, others had not (a final checkpoint, a stuck exit)."""
    holding = sorted(
        (n.node_rank, n.host) for n in job.gen.node_at.values() if n.state is MemberState.ACTIVE
    )
    named = ", ".join(f"node {rank} on {host!r}" for rank, host in holding[:8])
    more = f" and {len(holding) - 8} more" if len(holding) > 8 else ""
    return job.fault(
        Code.DEADLINE_EXCEEDED,
        Reason.WORLD_INCOMPLETE,
        f"{job.named}, the job id's previous run, was still finishing after this node "
        f"waited {waited} for its end: {len(holding)} of its {job.num_nodes} node(s) had "
        f"not left ({named}{more}). A new run of the job id forms once every node of the "
        "previous one has exited: stop those (or wait for them), then run it again",
        finishing_hosts=",".join(host for _, host in holding[:8]),
    )


def standby_timeout(job: Job, waited: str) -> RendezvousFault:
    """A standby JoinNode's wait ended with no slot freed: it joins again to go on
    standing by (``rendezvous-run --standby`` does)."""
    return job.fault(
        Code.DEADLINE_EXCEEDED,
        Reason.WORLD_INCOMPLETE,
        f"this standby node waited {waited} for a slot in {job.named} (max_nodes="
        f"{job.max_nodes}); none was freed by a failure: join again to stand by longer",
        max_nodes=str(job.max_nodes),
    )
