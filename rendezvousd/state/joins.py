"""Joining, in the state machine: one join (with PublishId), the forming of a
generation, and a parked join that ends.

A join (one request, ``placement.JoinArgs``) seats an attendee: a worker of one rank
(``Join``, the thin form) or a node agent of gpus_per_node ranks (``JoinNode``), never
both in one generation. Node generations
form when max_nodes nodes joined, or when at least min_nodes joined and ``last_call``
passed since the last arrival (checked on each arrival and each tick), once node 0's
id is known. While one runs with fewer than max_nodes nodes, another node parks for the
next generation and the running nodes hear NODES_WAITING; when the generation ends the
parked node is placed in the next one. Pure."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rendezvousd.common import validation
from rendezvousd.common.model import (
    EventKind,
    JobState,
    JoinMode,
    JoinResult,
    MemberState,
    Parked,
    Rejoin,
    Transition,
    Warn,
)
from rendezvousd.common.newest import keep_newest
from rendezvousd.errors import Code, Reason, RendezvousFault
from rendezvousd.state import barriers, fences, placement, rounds, seats, waits
from rendezvousd.state.job import (
    ENDED_WAITS_KEPT,
    Closed,
    EndedWait,
    Job,
    Member,
    Node,
    abort_cause_meta,
)
from rendezvousd.state.placement import JoinArgs

if TYPE_CHECKING:
    from rendezvousd.state.machine import RendezvousState

# Hot-path members as module names: on Python 3.11 each Enum.MEMBER lookup is a
# descriptor call (~0.2 us), and a join or heartbeat made several.
_JOIN, _NODE = waits.WaitKind.JOIN, JoinMode.NODE

#: The least time between two NODES_WAITING events of one job (the first is at once).
NODES_WAITING_INTERVAL_S = 0.5


def join(sm: RendezvousState, args: JoinArgs, now: float) -> JoinResult | Parked:
    """A join: it takes its seat (a worker's rank, a node agent's node), then one path
    admits it: the id from the seat holding rank 0, forming, ``id_required``, parking."""
    seats.not_draining(sm)
    placement.check(args, sm.limits)
    if (known := sm.jobs.get(args.job_id)) is not None and (
        late := launched_for_ended_run(known, args, now) or launched_before_close(known, args, now)
    ) is not None:
        raise late
    if known is None and (late := launched_for_run_forgotten(sm, args, now)) is not None:
        raise late
    if args.standby and (parked := stand_by(sm, args, now)) is not None:
        return parked
    job = job_for(sm, args, now)
    if job.state is JobState.RUNNING and (held := _left_behind(job, args)) is not None:
        # Its agent joins again, having given this generation up (the daemon was
        # unreachable to it for its window: a restart longer than that left the
        # restored generation with seats nobody holds any more, and every re-join was
        # refused WORLD_FULL). Its workers are stopped: the generation fails, for the
        # daemon's outage where that was longer than every node's window.
        if job.gen.outage_s is not None:
            rounds.end_for_outage(sm, job, held, job.gen.outage_s, now)
        else:
            rounds.lose_seated(sm, job, held, REJOINED, now)
        job = job_for(sm, args, now)
    if sm.stateless_since is not None:
        # Read only by a daemon that keeps no state (``seats.forgotten``): one with
        # --state-dir restores its runs, and a set per generation on every join is waste.
        job.saw(args.instance_id)
    seat: Member | Node
    if args.local_rank is not None:
        seat, added = _worker_seat(sm, job, args, args.local_rank, now)
        key: int | str = seat.rank  # ``job.key(seat)``, without the call per Join
    elif job.state is JobState.RUNNING and args.instance_id not in job.gen.nodes:
        if for_next_run(job, args):
            # Refused (WORLD_FULL, or its --node-rank "held" by a node still finishing),
            # a user re-running the job read a full world or a duplicate rank where
            # waiting for the last node's exit was all it took.
            return park_scaleup(sm, job, args, now, next_run=True)
        if (
            job.max_nodes > 1
            and args.node_rank is not None
            and (other := job.gen.nodes.named_at.get(args.node_rank))
            and other.state is MemberState.ACTIVE  # (one that left holds nothing)
        ):
            # The node rank it names is held in the running generation: not a newcomer
            # but a second agent for that node (a relaunch beside a frozen predecessor,
            # or two nodes given one rank), whatever room the next generation has. (A
            # single node's agent always names rank 0: a second one finds the world
            # full, and may stand by, --standby-if-full.)
            raise placement.duplicate(job, args, other, now)
        return park_scaleup(sm, job, args, now)  # a newcomer waits for the next generation
    elif (
        args.standby
        and args.instance_id not in job.gen.nodes
        and placement.claim(job, args, now) is None
        and not placement.has_room(job, now)
    ):
        return park_scaleup(sm, job, args, now)  # its freed slot was taken meanwhile
    else:
        seat, added = _node_seat(sm, job, args, now)
        key = seat.instance_id
    if job.state is JobState.FORMING:
        seat.lost_as = seat.lost_at = None  # its joiner is back: a kept death was none
    try:
        if args.unique_id and (args.local_rank is not None or seat is placement.holder(job)):
            sent = "Join with one" if isinstance(seat, Member) else "JoinNode with one"
            placement.accept_id(job, seat, args.unique_id, sent)
        # (A node that is not node 0 any more, e.g. one whose JoinNode was retried across a
        # restart that fenced the generation it was node 0 of, has its id dropped, as an
        # accepted id is when node 0 changes (``settle_holder``): it waits as any node.)
        return admit(sm, job, seat, key, args.wait_s, now)
    except RendezvousFault:
        if added:  # refused (capacity, a bad id): the seat stays free for the retry
            unseat(sm, job, seat, now)
        raise


def launched_for_ended_run(job: Job, args: JoinArgs, now: float) -> RendezvousFault | None:
    """JOB_ENDED for a node agent launched before the job's run ended (every member
    left), while the job is ENDED or the generation a join opened after that end
    forms: it was launched for the run that ended (a node that could not join before
    its run ended: a slow pod, one rescheduled mid-run, a scale-up). Before, it opened the
    job's next generation and waited its join timeout (600 s) for nodes that were
    done. A node launched after the end is a new run of the job id, as is any join
    that does not say when it was launched."""
    ended, launched = job.ended_at, args.launched_at
    if ended is None or launched is None or launched > ended:
        return None
    if args.instance_id in job.next_run_nodes:
        # Parked while the run finished (``Job.next_run_waiters``), woken by its end:
        # the job id's next run, which heard this refusal and exited 0 unrun.
        return None
    if args.previous is not None and args.previous in job.ended_leavers:
        return None  # its own goodbye ended the run: a new run, as before
    reopened = job.state is JobState.FORMING and job.gen.after_end is not None
    if not (job.state is JobState.ENDED or reopened):
        return None
    return job.fault(*_ended_run(job.job_id, ended, launched, now), **_ended_ms(ended, now))


def launched_for_run_forgotten(
    sm: RendezvousState, args: JoinArgs, now: float
) -> RendezvousFault | None:
    """JOB_ENDED, as ``launched_for_ended_run`` says it, for a node agent launched before
    the run of a job the daemon forgot early (its max_jobs slot went to a new job,
    ``rounds.make_room``) ended: its TTL would have kept the job to tell it so."""
    ended, launched = sm.early_ends.get(args.job_id), args.launched_at
    if ended is None or launched is None or launched > ended:
        return None
    code, reason, message = _ended_run(args.job_id, ended, launched, now)
    return RendezvousFault(
        code,
        reason,
        message,
        {"job_id": args.job_id, **_ended_ms(ended, now)},
    )


def _ended_run(job_id: str, ended: float, launched: float, now: float) -> tuple[Code, Reason, str]:
    return (
        Code.FAILED_PRECONDITION,
        Reason.JOB_ENDED,
        f"job {job_id!r} ended {now - ended:.1f} s ago (every member left), after this "
        f"node was launched ({now - launched:.1f} s ago): it was launched for the run that "
        "ended, which needs it no more. A node launched after the end starts a new run of "
        "the job id (run it again with nodes started once every node of the run before "
        "has exited)",
    )


def _ended_ms(ended: float, now: float) -> dict[str, str]:
    return {"ended_ms_ago": str(round((now - ended) * 1000))}


def launched_before_close(job: Job, args: JoinArgs, now: float) -> RendezvousFault | None:
    """JOB_ABORTED for a node agent launched before the job's run was closed (AbortJob
    with ``close``: a torchrun agent out of restarts whose round the others cannot
    form without it), while the generation it closed is the job's or the next one
    forms: a survivor of that run re-joining after the closing agent stopped watching
    (it waited 35 s for one) opened the next generation and waited its join timeout
    (600 s) there for nodes that will not come. A node launched after the close
    starts a new run of the job id, as does any join that does not say when it was
    launched."""
    closed, launched = job.closed, args.launched_at
    if closed is None or launched is None or launched > closed.at:
        return None
    forming_next = job.generation == closed.generation + 1 and job.state is JobState.FORMING
    if job.generation != closed.generation and not forming_next:
        return None
    return job.fault(
        Code.ABORTED,
        Reason.JOB_ABORTED,
        f"job {job.job_id!r} was closed {now - closed.at:.1f} s ago, after this node was "
        f"launched ({now - launched:.1f} s ago): {closed.reason}",
        reason=closed.reason,
        closed="true",
        # A node agent's setup error that closed it: this node ends as on its own.
        **abort_cause_meta(closed.cause),
    )


def standbys_closed_out(sm: RendezvousState, job: Job) -> None:
    """The standbys parked on ``job`` as its run is closed are told so at once, as
    torch's c10d ends a node of its redundancy list when its rendezvous closes: each
    stayed parked until its wait ended, or was called into the aborted generation,
    and heard the close only on its next join."""
    closed = job.closed
    if closed is None:
        return
    for waiter in list(job.standby_waiters):
        job.standby_waiters.discard(waiter)
        job.scaleup_waiters.pop(waiter, None)
        fault = job.fault(
            Code.ABORTED,
            Reason.JOB_ABORTED,
            f"job {job.job_id!r} was closed while this standby node waited for a slot "
            f"(it is not needed: the run ended for good): {closed.reason}",
            reason=closed.reason,
            closed="true",
        )
        sm.calls.wake(waiter, fault=fault)


def closed_as_given_up(sm: RendezvousState, job: Job, now: float) -> None:
    """Every node of ``job``'s failed (or aborted) generation said it will not re-join
    (a final Leave: out of restarts, or stopped by a signal), or was lost: nobody is
    left to re-form the run, so it is closed, as a torchrun agent out of restarts
    closes it (``close_run``). Only a running generation ends when its members leave:
    a failed one stayed FAILED, its parked standbys were never told (they stood by in
    silence), and a standby asking again at its join timeout opened a new generation
    of the dead job, every 600 s, for ever (h122 D1). Now they hear it at once
    (``standbys_closed_out``), and a node launched before the close is refused
    (``launched_before_close``); one launched after starts the job id's next run."""
    gen = job.gen
    if gen.join_mode is not JoinMode.NODE or job.state not in (
        JobState.FAILED,
        JobState.ABORTED,
    ):
        return
    if not gen.gone or (job.closed is not None and job.closed.generation == job.generation):
        return
    if any(i not in gen.gone and n.state is not MemberState.LOST for i, n in gen.nodes.items()):
        return  # a node re-joins: the run goes on
    failure = job.last_failure
    cause = (
        failure.cause
        if failure is not None and failure.generation == job.generation
        else gen.abort_reason
    )
    reason = (
        f"every node of generation {job.generation} gave up (no restarts left) or was "
        f"stopped, after its failure: {cause}"
    )
    job.closed = Closed(now, reason, job.generation)
    sm.calls.emit(Warn(job.job_id, job.generation, f"run closed: {reason}"))
    standbys_closed_out(sm, job)


#: The cause of a node lost by its own agent's re-join (``_left_behind``).
REJOINED = "its node agent left this generation and joined again (its workers were stopped)"


def _left_behind(job: Job, args: JoinArgs) -> Node | None:
    """The node of ``job``'s running generation that a node agent's join names as the
    one it held before (``previous_instance_id``, which only that agent knows): the
    agent gave it up to join again."""
    if args.local_rank is not None or not args.previous:
        return None
    node = job.gen.nodes.get(args.previous)
    return node if node is not None and node.state is MemberState.ACTIVE else None


def _node_seat(sm: RendezvousState, job: Job, args: JoinArgs, now: float) -> tuple[Node, bool]:
    """A node agent's seat: its node, added unless this is a retry."""
    node = job.gen.nodes.get(args.instance_id)
    if node is not None:
        return node, False
    if job.state in rounds.TERMINAL:
        raise job.generation_fault()
    if args.previous and (claimer := job.gen.by_host.get(args.previous)):
        take_back(sm, job, job.gen.nodes[claimer], now)
    kept = placement.claim(job, args, now)
    if len(job.gen.nodes) >= job.max_nodes or (kept is None and not placement.has_room(job, now)):
        raise placement.world_full(job, args.host, now)
    if args.node_rank is not None and (other := job.gen.nodes.named_at.get(args.node_rank)):
        raise placement.duplicate(job, args, other, now)
    node = Node(
        args.instance_id,
        args.host,
        args.addresses,
        args.node_rank or 0,
        args.node_rank is not None,
        now,
        kept or "",
        None if kept is None else job.gen.ranks_before.get(kept),
        agent=args.agent,
    )
    if args.agent:
        # Its own join whose wait ended before is this node, not another that came.
        for key in [k for k, e in job.gen.ended_waits.items() if e.agent == args.agent]:
            del job.gen.ended_waits[key]
    if kept is not None:
        del job.gen.owed[kept]
        if args.previous is None and kept != args.instance_id:
            job.gen.by_host[kept] = args.instance_id
    job.gen.nodes[args.instance_id] = node
    job.gen.last_arrival = now
    settle_holder(sm, job, now)  # it may be the new node 0
    return node, True


def take_back(sm: RendezvousState, job: Job, claimer: Node, now: float) -> None:
    """The node that held a kept seat came for it, and ``claimer`` had claimed it by
    host alone (``Generation.by_host``): the seat is kept for its holder again, and the
    claimer stays as a newcomer where the world has room for one beside the seats
    kept, else is refused. Hand the seat to whichever came first, and a JoinNode
    without ``previous_instance_id`` (any token holder can send one; an old client's
    replacement pod may reuse a survivor's hostname) would leave the survivor, holding
    the job's in-memory state, outside the world."""
    seat = claimer.kept
    del job.gen.by_host[seat]
    job.gen.owed[seat] = claimer.host
    claimer.kept, claimer.before = "", None  # a newcomer (its heap entry goes stale)
    if len(job.gen.nodes) + len(job.gen.owed) <= job.max_nodes:
        return
    fault = job.fault(
        Code.RESOURCE_EXHAUSTED,
        Reason.WORLD_FULL,
        f"the seat of {job.named} that the node agent on {claimer.host!r} took, kept for "
        "the node agent that held it in the last generation, was taken back by that node "
        f"agent; no other seat is free (max_nodes={job.max_nodes}). This node agent's "
        "JoinNode named no previous_instance_id (a client older than that field), so it "
        "took a seat kept on its host: upgrade its SDK",
        max_nodes=str(job.max_nodes),
        offending_host=claimer.host,
    )
    wake_seat(sm, job, claimer.instance_id, fault=fault)
    unseat(sm, job, claimer, now)


def wake_seat(
    sm: RendezvousState,
    job: Job,
    key: int | str,
    value: object = None,
    fault: RendezvousFault | None = None,
) -> bool:
    """Answers the joins parked in seat ``key`` (``Generation.join_waiters``) with
    ``value`` or ``fault``; whether there were any."""
    woken = [waiter for waiter, seat in job.gen.join_waiters.items() if seat == key]
    for waiter in woken:
        del job.gen.join_waiters[waiter]
        sm.calls.wake(waiter, value, fault)
    return bool(woken)


def _worker_seat(
    sm: RendezvousState, job: Job, args: JoinArgs, local_rank: int, now: float
) -> tuple[Member, bool]:
    """A worker's seat: its rank on its node, added unless this is a retry; a rank no
    call holds any more (``placement.abandoned``) is taken over by a new instance."""
    node_rank = placement.node_rank(job, args)
    rank = job.rank_of(node_rank, local_rank)
    member = job.gen.members.get(rank)
    if member is not None and member.instance_id != args.instance_id:
        if not placement.abandoned(job, member):
            raise placement.duplicate(job, args, member, now)
        unseat(sm, job, member, now)
        member = None
    if member is not None:
        return member, False
    if job.state is not JobState.FORMING:
        raise job.generation_fault()
    address = args.addresses[0] if args.addresses else ""
    member = Member(rank, node_rank, local_rank, args.host, address, args.instance_id)
    job.gen.members[rank] = member
    if args.node_rank is None:
        job.gen.host_nodes.setdefault(args.host, node_rank)
    return member, True


def admit(
    sm: RendezvousState, job: Job, seat: Member | Node, key: int | str, wait_s: float, now: float
) -> JoinResult | Parked:
    """A seated joiner's one outcome: answered once its generation runs; the seat holding
    rank 0 asked for the id (``id_required``) while none is known; else parked until the
    generation forms."""
    try_form(sm, job, now)
    if job.state is JobState.RUNNING:
        if seat.state is MemberState.LEFT:
            raise fences.joined_after_leaving(job, seat)
        if job.gen.unique_id is None:
            # Restored after a restart: the id was never on disk, so this seat can no
            # longer be given it. Fence the generation.
            cause = f"daemon restarted before this {seat.joiner} got the id"
            rounds.lose_seated(sm, job, seat, cause, now)
            raise job.generation_fault()
        return placement.answer(job, seat)
    if job.state in rounds.TERMINAL:
        raise job.generation_fault()
    if job.gen.unique_id is None and placement.holder(job) is seat:
        # A holder that crashes before sending the id must not keep the job forming
        # forever: its seat is freed at its join's own (capped) deadline (``id_overdue``).
        # Its restart need not wait for that: no call holds the seat.
        job.gen.id_deadline = now + min(wait_s or sm.timing.default_wait_s, sm.timing.max_wait_s)
        return placement.answer(job, seat, id_required=True)
    parked = sm.calls.park(job, _JOIN, -1, "", now)
    job.gen.join_waiters[parked.waiter] = key
    return parked


def stand_by(sm: RendezvousState, args: JoinArgs, now: float) -> Parked | None:
    """A standby node's join (``JoinArgs.standby``): None when it takes a seat as any
    node does (seated already, called into a slot a failure freed, or finding one
    now); else parked beyond max_nodes until a failure frees a slot
    (``rounds.wake_parked`` calls it) or the job ends (it hears JOB_ENDED). Its bounds
    are checked without failing the generation: a misconfigured spare must not
    stop the job it backs. On a job that ended it parks unchecked: the job's relaunch
    (the same job id, maybe other bounds) may be starting beside it; if none comes
    within its wait, it hears JOB_ENDED then."""
    job = sm.jobs.get(args.job_id)
    if job is None:
        job = job_for(sm, args, now)  # started before any node: nobody is seated yet
    elif job.state is not JobState.ENDED:  # (an ended job's relaunch sets new bounds)
        # A per-rank generation only: one that no node joined yet has no mode (the
        # generation a restart fenced a forming one with), and refused a standby there
        # as "joined by per-rank Join calls" (a chaos review, a SIGTERM restart).
        if job.gen.join_mode is JoinMode.RANK:
            raise placement.mode_mismatch(job, _NODE, args.host)
        bounds = (args.min_nodes, args.max_nodes, args.gpus_per_node)
        if (job.min_nodes, job.max_nodes, job.gpus_per_node) != bounds:
            raise job.topology_conflict(args.host, bounds)
        if (refused := _other_version(job, args)) is not None:
            raise refused  # (the standby only: the job it backs goes on)
        if args.instance_id in job.gen.nodes or args.instance_id in job.standbys_called:
            return None
        if placement.claim(job, args, now) is not None:
            return None  # a seat is kept for it (a restart forgot that it was called)
        if placement.standby_room(job, now):
            job.standbys_called.add(args.instance_id)
            if job.state is not JobState.FORMING:  # (forming, it is seated by this call)
                job.gen.woken.add(args.instance_id)  # the next generation keeps it a seat
            elif job.gen.standby_seats > 0:
                job.gen.standby_seats -= 1
            return None
    return park_scaleup(sm, job, args, now)


def park_scaleup(
    sm: RendezvousState, job: Job, args: JoinArgs, now: float, *, next_run: bool = False
) -> Parked:
    """A node parked for the next generation: a scale-up, which must fit in max_nodes,
    or a standby, which may wait beyond it, or (``next_run``) a node of the job id's
    next run, parked until the finishing one ended, which the next run's bounds check."""
    if not args.standby and not next_run:
        fitting = {
            i
            for w, i in job.scaleup_waiters.items()
            if w not in job.standby_waiters and w not in job.next_run_waiters
        }
        if job.num_nodes + len(fitting | {args.instance_id}) > job.max_nodes:
            raise placement.world_full(job, args.host)
    parked = sm.calls.park(job, waits.WaitKind.SCALEUP, -1, args.instance_id, now)
    job.scaleup_waiters[parked.waiter] = args.instance_id
    if args.standby:
        job.standby_waiters.add(parked.waiter)
    if next_run:
        job.next_run_waiters.add(parked.waiter)
    tell_waiting(sm, job, now)
    return parked


def seats_lapse(sm: RendezvousState, job: Job, now: float) -> None:
    """The seats a forming generation kept for nodes expected back (``placement.
    keep_seats``) are held one heartbeat timeout: a node not back by then is not
    waited for (a survivor that died before re-joining must not stall forming), and
    its seat goes to the standbys parked for one, called in the order they parked
    and kept for them in turn, then to any newcomer."""
    gen = job.gen
    if now < gen.owed_until:
        return
    gen.by_host.clear()  # nobody came for those seats: their claims stand
    if not gen.owed:
        return
    hosts = sorted({host or "a woken node" for host in gen.owed.values()})
    called = call_standbys(sm, job, job.max_nodes - len(gen.nodes))
    # Said, so that an operator sees why the generation did not wait for that node.
    _still_forming(
        sm,
        job,
        f"{len(gen.owed)} node(s) expected back ({', '.join(hosts)}) did not re-join "
        f"within {sm.timing.hold_s:.1f} s: their seats are free"
        + (f", {len(called)} standby(s) called" if called else ""),
    )
    placement.keep_seats(job, called, sm.timing.hold_s, now)


def call_standbys(sm: RendezvousState, job: Job, room: int) -> dict[str, str]:
    """The standbys parked on ``job`` called, in the order they parked, into ``room``
    freed seats: woken to re-join, and returned (instance id -> "") for the seats to
    keep for them."""
    called: dict[str, str] = {}
    for waiter, inst in list(job.scaleup_waiters.items()):
        if len(called) >= room:
            break
        if waiter in job.standby_waiters:
            del job.scaleup_waiters[waiter]
            job.standby_waiters.discard(waiter)
            job.standbys_called.add(inst)
            called[inst] = ""
            sm.calls.wake(waiter, Rejoin())
    return called


def seat_given_up(sm: RendezvousState, job: Job, instance_id: str, now: float) -> None:
    """A node expected back by ``job``'s forming generation said it will not re-join
    (a final Leave): its kept seat is free now, not at the hold's end. Forming no
    longer waits for it, and a standby parked for a seat is called into it (kept for
    it in turn), as when the hold ends."""
    gen = job.gen
    host = gen.owed.pop(instance_id)
    gen.rejoin_expected -= 1
    called = call_standbys(
        sm, job, job.max_nodes - len(gen.nodes) - placement.kept_for_others(job, now)
    )
    gen.owed.update(called)
    _still_forming(
        sm,
        job,
        f"the node agent on {host or 'a woken node'} will not re-join: its seat is free"
        + (f", {len(called)} standby(s) called" if called else ""),
    )
    try_form(sm, job, now)


def tell_waiting(sm: RendezvousState, job: Job, now: float) -> None:
    """NODES_WAITING to the running nodes when the count of parked nodes changed:
    the first change at once (it is what makes the agents re-form), later ones at
    most every NODES_WAITING_INTERVAL_S, the latest count, from the tick (200 nodes
    parking one by one made 200 events for every node)."""
    if job.state is not JobState.RUNNING:
        return
    count = placement.waiting_count(job)
    if count == job.gen.waiting_told:
        return
    if job.gen.waiting_told and now - job.gen.waiting_told_at < NODES_WAITING_INTERVAL_S:
        return  # the tick tells the latest count
    job.gen.waiting_told, job.gen.waiting_told_at = count, now
    rounds.notify(sm, job, EventKind.NODES_WAITING, nodes_waiting=count)


def settle_holder(sm: RendezvousState, job: Job, now: float) -> None:
    """Keeps the id with the seat holding rank 0: an id from a seat that no longer holds
    it is dropped, and a parked node that became node 0 is asked for one."""
    head = placement.holder(job)
    if job.gen.unique_id is not None and (head is None or head.instance_id != job.gen.id_node):
        job.remember_id()
        job.gen.unique_id, job.gen.id_node = None, ""
    if head is None or job.gen.unique_id is not None or job.gen.holder_seen == head.instance_id:
        return
    # The holder is answered id_required at once rather than parked, so its parked
    # call, if any, predates its becoming the holder: look once per new holder, not on
    # every join (that look was O(parked nodes) a join, quadratic in all).
    job.gen.holder_seen = head.instance_id
    if wake_seat(sm, job, job.key(head), placement.answer(job, head, id_required=True)):
        # Its SDK answers at once; one heartbeat timeout is ample to hear it.
        job.gen.id_deadline = now + sm.timing.heartbeat_timeout_s


def try_form(sm: RendezvousState, job: Job, now: float) -> bool:
    """Forms the generation if it may form now, its id known; whether it did. Workers
    form it when every rank joined; nodes when max_nodes joined, or min_nodes and the
    last call passed (or every node expected back is here), and their named node ranks
    fit, and no seat is held by a claim on its host alone while its holder may still
    come for it (``take_back``)."""
    if job.state is not JobState.FORMING or job.gen.unique_id is None:
        return False
    if job.gen.join_mode is not _NODE:
        if len(job.gen.members) != job.world_size:
            return False
        rounds.form(sm, job, now, f"all {job.world_size} ranks joined")
        return True
    count = len(job.gen.nodes)
    if job.gen.by_host:
        return False
    if count < job.min_nodes or (
        count < job.max_nodes
        and now < job.gen.last_arrival + job.last_call_s
        and not placement.everyone_back(job)
    ):
        return False
    ranks = placement.assignment(job)
    if ranks is None:
        return False
    placement.place(job, ranks)
    rounds.form(sm, job, now, f"{count} node(s) joined ({job.world_size} ranks)")
    return True


def unseat(sm: RendezvousState, job: Job, seat: Member | Node, now: float) -> None:
    """A forming joiner gave up: its seat is free (and with it the id, when it held rank
    0; a node's leaving may make another node 0)."""
    if job.state is not JobState.FORMING or job.key(seat) in job.gen.join_waiters.values():
        return  # a retry of the same join is still waiting for the seat
    if isinstance(seat, Node):
        job.gen.nodes.pop(seat.instance_id, None)
        if job.gen.by_host.get(seat.kept) == seat.instance_id:
            del job.gen.by_host[seat.kept]
        if seat.kept and now < job.gen.owed_until:
            job.gen.owed[seat.kept] = seat.host  # kept for its retry, not a newcomer
    elif job.gen.members.pop(seat.rank, None) and all(
        m.host != seat.host for m in job.gen.members.values()
    ):
        job.gen.host_nodes.pop(seat.host, None)
    settle_holder(sm, job, now)
    if not job.gen.members and not job.gen.nodes:
        job.state_since = now


def unheld_seats_lapse(sm: RendezvousState, job: Job, now: float) -> None:
    """Frees the seats of a forming per-rank generation that no call has held for longer
    than any Join may wait (``max_wait_s``). A seat is held by its parked Join, or, for
    rank 0 owing the id, by its deadline; only an undo (a failed commit puts the job
    back and releases every parked call) leaves seats held by nothing. A live worker's
    retry takes its seat again within that time; a worker that died or gave up during
    the outage kept its seat for good, and the generation, never empty, neither formed
    nor expired, holding a max_jobs slot (a model-based fuzz of the state machine)."""
    if job.gen.join_mode is not JoinMode.RANK or job.gen.id_deadline is not None:
        job.gen.unheld_since = None
        return
    members = list(job.gen.members.values())
    if not members or not all(placement.abandoned(job, m) for m in members):
        job.gen.unheld_since = None
        return
    if job.gen.unheld_since is None:
        job.gen.unheld_since = now
    elif now - job.gen.unheld_since > sm.timing.max_wait_s:
        job.gen.unheld_since = None
        for member in members:
            unseat(sm, job, member, now)
        _still_forming(
            sm,
            job,
            f"no worker held its seat for {sm.timing.max_wait_s:g} s (max_wait_s) after its "
            "join was released: the seats are free, and the job, empty, expires",
        )


def publish_id(
    sm: RendezvousState,
    job_id: str,
    generation: int,
    rank: int,
    instance_id: str,
    unique_id: bytes,
    now: float,
) -> JoinResult | Parked:
    """Rank 0's id, after its Join was answered ``id_required``; answered like a join."""
    validation.unique_id(unique_id)
    job, member = seats.seat(sm, job_id, generation, rank, JoinMode.RANK, instance_id)
    if member.instance_id != instance_id:
        refusal = fences.other_instance(job, generation, rank, instance_id)
        said = seats.forgotten(sm, job, generation, instance_id, rank, JoinMode.RANK, refusal)
        if said is not refusal:
            raise said
    if job.state in rounds.TERMINAL:
        raise job.generation_fault()
    if rank == 0 and member.instance_id != instance_id:
        # Rank 0 was taken by a restarted worker while this one owed the id.
        raise fences.other_instance(job, generation, rank, instance_id)
    if rank != 0:
        raise RendezvousFault(
            Code.PERMISSION_DENIED,
            Reason.NOT_RANK_ZERO,
            placement.not_rank_zero(job, member, "PublishId"),
            {"job_id": job_id, "ranks": str(rank)},
        )
    placement.accept_id(job, member, unique_id, "PublishId")
    return admit(sm, job, member, rank, 0.0, now)


def cancel_wait(
    sm: RendezvousState, waiter: int, now: float, *, timed_out: bool, given_up: bool = False
) -> RendezvousFault | None:
    """A parked call ended without a wake (deadline, cancel). Returns its fault.
    ``given_up``: cancelled by a caller that said so (a call stream's ``cancel``), not
    by its death."""
    w = sm.calls.unpark(waiter)
    if w is None:
        return None
    job = sm.jobs.get(w.job_id)
    if job is None:
        return None
    waited = f"{now - w.since:.1f} s"
    if w.kind is waits.WaitKind.SCALEUP:
        # Job-level, before the generation check: a standby outlives the generation
        # it parked in, and its record must go with its call.
        return _scaleup_wait_ended(sm, job, waiter, waited, now, timed_out=timed_out)
    if job.generation != w.generation:
        return None
    if w.kind is _JOIN:
        return join_wait_ended(sm, job, waiter, waited, now, timed_out=timed_out, given_up=given_up)
    if w.kind is waits.WaitKind.BARRIER:
        return barriers.timed_out(job, w.key, w.rank, waiter, waited)
    return waits.key_wait_timeout(job, w.key, waiter, waited)


def _scaleup_wait_ended(
    sm: RendezvousState, job: Job, waiter: int, waited: str, now: float, *, timed_out: bool
) -> RendezvousFault | None:
    """A parked scale-up or standby JoinNode ended unanswered. A standby that waited
    out its wait on a job that ended (and was not relaunched meanwhile) hears so."""
    job.scaleup_waiters.pop(waiter, None)
    standby = waiter in job.standby_waiters
    job.standby_waiters.discard(waiter)
    next_run = waiter in job.next_run_waiters
    job.next_run_waiters.discard(waiter)
    tell_waiting(sm, job, now)
    if not timed_out:
        return None
    if next_run:
        return placement.still_finishing(job, waited)
    if not standby:
        return placement.scaleup_timeout(job, waited)
    if job.state is JobState.ENDED:
        return job.generation_fault()
    return placement.standby_timeout(job, waited)


def join_wait_ended(
    sm: RendezvousState,
    job: Job,
    waiter: int,
    waited: str,
    now: float,
    *,
    timed_out: bool,
    given_up: bool = False,
) -> RendezvousFault | None:
    """A parked join ended unanswered. At its deadline the joiner gives up: its seat is
    freed, and it is told what the world still lacks. Cancelled by a joiner that said
    it gave up (``given_up``: alive, it may send the join again), its seat is freed
    too. Cancelled otherwise (its process died or disconnected), it fails the forming
    generation at once. Either, unless a retry of it is parked still."""
    key = job.gen.join_waiters.pop(waiter, None)
    seat = None if key is None else job.seat(key)
    if timed_out:
        fault = waits.world_incomplete(job, waited, now)
        if seat is not None and key is not None:
            unseat(sm, job, seat, now)
            if job.state is JobState.FORMING and job.seat(key) is None:
                _wait_ended(job, key, seat, now)
        return fault
    if seat is None or job.state is not JobState.FORMING or key in job.gen.join_waiters.values():
        return None
    if given_up:
        unseat(sm, job, seat, now)
        return None
    if sm.storage_failing:
        # Kept, as a formed generation's loss is (``liveness._pending``): made now, its
        # failure's commit would be undone by the next failed one, after its parked
        # joiners had heard of it. Made once storage takes writes (``kept_deaths``).
        if seat.lost_as is None:
            seat.lost_as, seat.lost_at = seat.cancelled, now
        return None
    rounds.joiner_died(sm, job, seat, placement.cancelled(job, seat, now), now)
    return None


def kept_deaths(sm: RendezvousState, job: Job, now: float) -> None:
    """Forming ``job``'s joiner whose parked Join was cancelled while storage failed,
    or whose death a failed commit undid (``Attendee.lost_as``), and that no retry
    holds again: the first of them to go fails the generation now, at its own time,
    as its death would have then."""
    held = set(job.gen.join_waiters.values())
    joiners: list[Member | Node] = [*job.present(), *job.gen.nodes.values()]
    dead = [s for s in joiners if s.lost_as is not None and job.key(s) not in held]
    if dead:
        first = min(dead, key=lambda s: now if s.lost_at is None else s.lost_at)
        went = now if first.lost_at is None else first.lost_at
        rounds.joiner_died(sm, job, first, placement.cancelled(job, first, went), now)


def _wait_ended(job: Job, key: int | str, seat: Member | Node, now: float) -> None:
    """Keeps that ``seat`` came and its own deadline freed it, for the words of the
    joiners whose waits end after it (``waits.world_incomplete``)."""
    agent = ""
    if isinstance(seat, Node):
        said = f"node {seat.node_rank}" if seat.named else "a node"
        rank, agent = (seat.node_rank if seat.named else None), seat.agent
    else:
        said, rank = f"rank {seat.rank}", seat.rank
    ended = EndedWait(said, seat.host, now, rank, agent)
    keep_newest(job.gen.ended_waits, key, ended, ENDED_WAITS_KEPT)


def id_overdue(sm: RendezvousState, job: Job, now: float) -> None:
    """The seat holding rank 0 was told id_required and neither sent the id nor waited
    since: its seat is free for a restarted worker (node agent)."""
    job.gen.id_deadline = None
    if job.state is not JobState.FORMING or job.gen.unique_id is not None:
        return
    head = placement.holder(job)
    if head is None or job.key(head) in job.gen.join_waiters.values():
        return  # its PublishId (JoinNode) is parked: that call's own deadline applies
    unseat(sm, job, head, now)
    _still_forming(
        sm,
        job,
        f"rank 0's {head.joiner} on {head.host} did not publish the id within its join's "
        "wait; its seat is free for a restart",
    )


def _still_forming(sm: RendezvousState, job: Job, detail: str) -> None:
    """A forming generation's seat freed by time (FORMING -> FORMING): the timeline and
    the log say why."""
    sm.calls.emit(
        Transition(job.job_id, job.generation, JobState.FORMING, JobState.FORMING, detail)
    )


def job_for(sm: RendezvousState, args: JoinArgs, now: float) -> Job:
    """The job ``args`` joins: created, or its next generation opened unless the joiner
    is returning to the current one. The first joiner of a generation sets its mode
    (per rank or per node) and bounds (min_nodes, max_nodes, gpus_per_node); a joiner of
    the other mode is refused, and other bounds conflict with the generation."""
    mode = args.mode
    low, high, gpus = bounds = (args.min_nodes, args.max_nodes, args.gpus_per_node)
    job = sm.jobs.get(args.job_id)
    if job is None:
        detail = "created"
        if args.previous and args.local_rank is None and sm.stateless_since is not None:
            # A node agent back from a run this daemon never saw: its log said only
            # "created", and nothing said why the job started over at generation 1.
            detail = (
                "created by a node agent joining again from a run this daemon does not "
                "know (it started without --state-dir: that run's state is lost)"
            )
        job = rounds.open_job(sm, args.job_id, high, gpus, now, detail)
    elif job.state in rounds.TERMINAL and not placement.returning(job, args):
        owed = placement.owed_back(job)
        before = placement.ranks_before(job)
        lost_forming = placement.lost_forming(job)
        rounds.next_generation(sm, job, now)
        job.gen.ranks_before = {inst: before[inst] for inst in owed if inst in before}
        job.gen.rejoin_expected = len(owed)
        job.gen.standby_seats = lost_forming
        if owed:
            # It re-forms: a seat no node is expected back for (one gave up, a final
            # Leave) goes to a standby parked for one, as a lapsed seat does.
            owed |= call_standbys(sm, job, job.max_nodes - len(owed))
        placement.keep_seats(job, owed, sm.timing.hold_s, now)
    if job.state is JobState.FORMING and not job.gen.members and not job.gen.nodes:
        if placement.kept_for_others(job, now):
            return _re_forming(job, args, mode, bounds)
        # Nobody waits on this generation yet: the first joiner sets its bounds.
        job.gen.join_mode = mode
        job.num_nodes, job.gpus_per_node = high, gpus
        job.min_nodes, job.max_nodes = low, high
        job.last_call_s = args.last_call_s or sm.timing.default_last_call_s
        job.wire_version = args.wire_version
        return job
    if for_next_run(job, args):
        # Its bounds and version are the next run's, checked once this one ended: a
        # rerun with another --nnodes was refused TOPOLOGY_MISMATCH, "fix them".
        return job
    if job.gen.join_mode is not mode:
        raise rounds.refused(sm, job, placement.mode_mismatch(job, mode, args.host), now)
    if (job.min_nodes, job.max_nodes, job.gpus_per_node) != bounds:
        asked = bounds if mode is JoinMode.NODE else (high, gpus)
        raise rounds.conflict(sm, job, job.topology_conflict(args.host, asked), now)
    if (refused := _other_version(job, args)) is not None:
        # Only the newcomer, forming or running: the value is the joiner's own word, so
        # failing the forming generation on it let any JoinNode that sent another (a
        # stale pod of an older rollout, or anyone holding the job's token) end every
        # node agent of the launch (each exits on VERSION_MISMATCH, no restart) and the
        # job's relaunch for a heartbeat timeout after. The nodes joined go on waiting.
        raise rounds.refused(sm, job, refused, now)
    return job


def for_next_run(job: Job, args: JoinArgs) -> bool:
    """Whether a node agent's join is for the job id's next run: its running node
    generation is finishing (a member left: no node can join it, nor can it re-form
    with those gone) and the agent is not in it (nor a standby, which waits for a
    failure's slot in this run). It was started before every node of this run was gone,
    and waits for the run's end (``Job.next_run_waiters``)."""
    return (
        job.state is JobState.RUNNING
        and job.gen.left > 0
        and args.local_rank is None
        and job.gen.join_mode is _NODE
        and not args.standby
        and args.instance_id not in job.gen.nodes
    )


def _re_forming(job: Job, args: JoinArgs, mode: JoinMode, bounds: tuple[int, int, int]) -> Job:
    """``job``'s generation re-forms with seats kept for the nodes expected back, none
    back yet: the generation before set its mode and bounds, which stand, and a joiner
    of others is refused alone (nobody waits yet to hear of it). The first joiner set
    its own: a stray JoinNode of another ``--nnodes``, refused WORLD_FULL, left seats
    kept past the new max_nodes, a row the next daemon start refused to load; a stray
    per-rank Join took the generation over, and the survivors were refused
    JOIN_MODE_MISMATCH (a model-based fuzz of the state machine)."""
    job.gen.join_mode = JoinMode.NODE  # only a node generation keeps seats
    if mode is not JoinMode.NODE:
        raise placement.mode_mismatch(job, mode, args.host)
    if (job.min_nodes, job.max_nodes, job.gpus_per_node) != bounds:
        raise job.topology_conflict(args.host, bounds)
    # The version is still the first joiner's: a relaunch of upgraded nodes after a
    # launch that failed on a version conflict re-forms with seats kept for the old.
    job.wire_version = args.wire_version
    return job


def _other_version(job: Job, args: JoinArgs) -> RendezvousFault | None:
    """VERSION_MISMATCH for a node agent whose ``wire_version`` is not the
    generation's. "" (an agent from before version reporting) beside a value is a
    mismatch too: the daemon cannot tell an older agent that would work from one that
    would not (a CPU ring of another wire version refuses the handshake), and every node
    of a job must run one version anyway. A job restored from a row that did not store
    it takes the next joiner's."""
    if job.wire_version is None:
        job.wire_version = args.wire_version
        return None
    if args.wire_version == job.wire_version:
        return None
    return job.version_conflict(args.host, args.wire_version)
