"""Liveness, in the state machine: one path over attendees (workers of a per-rank
generation, node agents of a node generation): heartbeat streams attached, beating and
ending, silence found by the tick, a Leave, and a ReportFailure (a node agent's for its
worker, or a per-rank worker's own). Pure."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from rendezvousd.common import validation
from rendezvousd.common.escape import bounded
from rendezvousd.common.model import (
    FORGOTTEN,
    EventKind,
    JobState,
    JoinMode,
    MemberState,
    Notify,
    Progress,
)
from rendezvousd.common.newest import keep_newest
from rendezvousd.errors import Code, Reason, RendezvousFault
from rendezvousd.state import fences, joins, placement, rounds, seats

if TYPE_CHECKING:
    from rendezvousd.state.job import Attendee, Job, Member, Node
    from rendezvousd.state.machine import RendezvousState

# The hosts refused for their token that the state machine keeps at once.
TOKEN_REFUSED_HOSTS = 4096
#: A node agent's stream that ends without its goodbye has this many of its beats to
#: re-attach before its node is lost (``cut_grace_s``), as the SDK's own window
#: counts a prompt break (``PROMPT_BREAK_BEATS``).
CUT_GRACE_BEATS = 1.5
#: ...but at least this long: a reset seen on one side only is seen on the other at
#: its next segment after the network heals, and its redial follows at gRPC's backoff.
CUT_GRACE_MIN_S = 1.0


def report_failure(
    sm: RendezvousState,
    job_id: str,
    generation: int,
    node_rank: int,
    instance_id: str,
    local_rank: int,
    cause: str,
    now: float,
    *,
    witness: int | None = None,
    connection: str = "",
) -> None:
    """Lose the member at ``local_rank`` of ``node_rank`` with ``cause``; ``witness``:
    the rank whose report of it the worker relays (``rounds._witness_first``);
    ``connection``: the gRPC peer the call came over (``seats.seated``)."""

    def in_range(name: str, value: int, bound_name: str, bound: int) -> None:
        validation.rank_in_range(name, value, bound_name, bound, job_id=job_id)

    job = seats.find_job(sm, job_id)
    member: Member
    forming = generation == job.generation and job.state is JobState.FORMING
    if job.gen.join_mode is JoinMode.RANK:
        # A worker joined by rank (no node agent: srun, a pod per GPU) reports its own
        # failure, by its seat and its own instance id: its exception, not "heartbeat
        # stream closed" when it exits, is then what every survivor and `status` read.
        reporter, told = "the worker", job.rank_of(node_rank, local_rank)
        in_range("node_rank", node_rank, "num_nodes", job.num_nodes)
        in_range("local_rank", local_rank, "gpus_per_node", job.gpus_per_node)
        if forming:
            # Refused as a node agent's is (the generation has no node ranks yet): the
            # forming generation fails when a joiner ends its Join, which every
            # parked joiner hears. (Unless its caller's run is forgotten: a restart.)
            refusal = fences.report_while_forming(job, told, JoinMode.RANK)
            raise seats.forgotten(sm, job, generation, instance_id, told, JoinMode.RANK, refusal)
        job, member = seats.caller(
            sm, job_id, generation, told, instance_id, running=False, connection=connection
        )
    else:
        reporter, told = "its node agent", node_rank
        if forming:
            refusal = fences.report_while_forming(job, told, JoinMode.NODE)
            raise seats.forgotten(sm, job, generation, instance_id, told, JoinMode.NODE, refusal)
        job, node = seats.seated(
            sm, job_id, generation, node_rank, instance_id, JoinMode.NODE, running=False
        )
        in_range("local_rank", local_rank, "gpus_per_node", job.gpus_per_node)
        member = job.gen.members[job.rank_of(node.node_rank, local_rank)]
    # Any text is a cause (a traceback has newlines): kept bounded, escaped only
    # where shown. Refusing it would leave a healthy rank, lost after, as the root cause.
    cause = bounded(cause) or f"{reporter} reported a failure without a cause"
    if member.state in (MemberState.ACTIVE, MemberState.JOINING):
        if cut := _cut_nodes(job, now):
            # A node whose stream was cut is waited for (``cut_grace_s``), and its peers'
            # rings see its workers go first when its agent died: their report, lost
            # first, named the reporter as the root cause, not the node that went.
            rounds.lose_all_seated(sm, job, cut, now)
        rounds.lose(sm, job, [member], cause, now, told=told, witness=witness)


def _cut_nodes(job: Job, now: float) -> list[tuple[Member | Node, str, float]]:
    """The node agents of ``job`` whose streams were cut and have not re-attached yet,
    each with its cause."""
    if job.gen.join_mode is not JoinMode.NODE or job.state is not JobState.RUNNING:
        return []
    return [
        (node, rounds.cut_cause(node, now - node.cut_at), now)
        for node in job.gen.node_at.values()
        if node.cut_at is not None and not node.stream_open and node.state is MemberState.ACTIVE
    ]


def attach_stream(
    sm: RendezvousState,
    job_id: str,
    generation: int,
    who: int,
    instance_id: str,
    now: float,
    *,
    mode: JoinMode = JoinMode.RANK,
    peer: str = "",
    connection: str = "",
) -> int:
    """A heartbeat stream of attendee ``who`` opened (from host ``peer``, over the gRPC
    peer ``connection``, if known); returns its token for ``detach_stream``."""
    job, seated = seats.seated(sm, job_id, generation, who, instance_id, mode)
    if mode is not job.gen.join_mode:
        # Its node agent's stream is this rank's liveness: a stream of the rank's own
        # would fail the whole generation when it closed (the worker exiting).
        raise fences.rank_stream_in_node_job(job, who)
    token = seated.attach(now)
    seated.peer = peer or seated.peer
    seated.connection = connection
    if waiting := placement.waiting_count(job):
        # Nodes parked before this stream (re)attached: it would miss the event.
        sm.calls.emit(
            Notify(
                job.job_id,
                job.generation,
                mode,
                (who,),
                EventKind.NODES_WAITING,
                nodes_waiting=waiting,
            )
        )
    return token


def refused_token(sm: RendezvousState, host: str, now: float) -> None:
    """A call from ``host`` was refused for its token (a gRPC peer's host)."""
    keep_newest(sm.token_refused, host, now, TOKEN_REFUSED_HOSTS)


def heartbeat(
    sm: RendezvousState,
    job_id: str,
    generation: int,
    who: int,
    now: float,
    *,
    mode: JoinMode = JoinMode.RANK,
) -> None:
    job, seated = seats.seat(sm, job_id, generation, who, mode)
    if job.state is not JobState.RUNNING:
        raise job.generation_fault()
    if seated.beaten:
        seated.beat_gap = now - seated.last_seen
    seated.beaten = True
    seated.last_seen = now
    for m in job.covered(seated):
        m.last_seen = now  # what GetJob shows as each member's heartbeat age


def report_progress(
    sm: RendezvousState,
    job_id: str,
    generation: int,
    who: int,
    progress: Progress,
    *,
    mode: JoinMode = JoinMode.RANK,
) -> None:
    """A beat carried ``progress``: kept on its attendee for views, as many steps as
    the attendee has ranks (a client's longer list is cut, not refused: it is only
    shown). A stale or unseated stream's report is dropped: its beat is refused."""
    job, seated = seats.seat(sm, job_id, generation, who, mode)
    ranks = job.gpus_per_node if mode is JoinMode.NODE else 1
    if len(progress.steps) > ranks:
        progress = replace(progress, steps=progress.steps[:ranks])
    seated.progress = progress


def detach_stream(
    sm: RendezvousState,
    job_id: str,
    generation: int,
    who: int,
    token: int,
    now: float,
    *,
    mode: JoinMode = JoinMode.RANK,
    cut: bool = False,
) -> None:
    """A heartbeat stream ended. Without a Leave first, its attendee is lost. Once
    the generation failed, the survivors' streams end as a matter of course: that is
    no loss (it would also count them out of the nodes expected back). ``cut``: the end
    may be its connection's reset, not its agent's death (every stream the daemon
    serves: gRPC ends a reset call's requests as it ends a closed one's), so a node
    agent gets ``cut_grace_s`` to re-attach; False, the end is its loss at once."""
    job = seats.stream_job(sm, job_id, generation)
    seated = job.attendees(mode).get(who) if job else None
    if job and seated and seated.detach(token) and job.state is JobState.RUNNING:
        if seated.said_goodbye:  # its Leave was undone (storage failed): still a goodbye
            _goodbye(sm, job, seated, now)
        elif (
            cut
            and mode is JoinMode.NODE
            and job.wire_version
            and now - seated.last_seen < sm.timing.heartbeat_timeout_s
        ):
            # A node agent's stream ends as its connection is reset (a firewall reload,
            # a conntrack flush) as it does when the agent dies: one second of resets
            # failed the whole job, worded as a dead agent. Its redial gets a moment
            # (the tick loses it after). Only where the nodes run our CPU ring (their
            # agents send its wire version): a killed agent's workers die with it and
            # their peers' rings (or the agents' node links) report it at once, which
            # loses the cut node first (``report_failure``), so the grace costs those
            # jobs' detection nothing but a lone node's. torchrun's agents (no wire
            # version) have no such witness: survivors with hung workers heard of a
            # killed node 8.0 s after the kill, not 2.7 s, the grace added to the push.
            # Their nodes, and a worker's own stream (its end is its process's death),
            # are lost at once.
            seated.cut_at = now
        elif sm.storage_failing:
            _pending(seated, rounds.stream_end_cause(sm, seated, now), now)
        else:
            rounds.lose_seated(sm, job, seated, rounds.stream_end_cause(sm, seated, now), now)


def cut_grace_s(sm: RendezvousState, seated: Attendee) -> float:
    """How long ``seated``, whose stream ended without a goodbye, has to re-attach:
    a beat and a half of its own cadence, at least CUT_GRACE_MIN_S, and at most half
    the heartbeat timeout (what a dead agent's loss is delayed by)."""
    timeout = sm.timing.heartbeat_timeout_s
    beat = seated.beat_gap or validation.longest_beat_s(timeout)
    return min(max(CUT_GRACE_BEATS * beat, CUT_GRACE_MIN_S), timeout / 2)


def tick(sm: RendezvousState, now: float) -> None:
    """Time-driven decisions: an id owed too long, a node generation's last call,
    silent attendees lost, old jobs forgotten."""
    for job in list(sm.jobs.values()):
        if job.gen.id_deadline is not None and now > job.gen.id_deadline:
            joins.id_overdue(sm, job, now)
        if job.state is JobState.FORMING and not sm.storage_failing:
            joins.kept_deaths(sm, job, now)
        if job.state is JobState.FORMING:
            joins.seats_lapse(sm, job, now)
            joins.unheld_seats_lapse(sm, job, now)
            joins.try_form(sm, job, now)
        elif job.state is JobState.RUNNING:
            joins.tell_waiting(sm, job, now)
            silent: list[tuple[Member | Node, str, float]] = []
            for seated in list(job.attendees(job.gen.join_mode).values()):
                # Not ``watched``: every attendee silent at this tick is lost, also
                # once the first loss failed the generation (each is named).
                if seated.state is not MemberState.ACTIVE:
                    continue
                if seated.said_goodbye and not seated.stream_open:
                    # Its goodbye undone by a failed commit after its stream had ended
                    # (another change's commit): no stream end comes to say it again.
                    _goodbye(sm, job, seated, now)
                elif (found := _loss_found(sm, seated, now)) is not None:
                    if sm.storage_failing:
                        _pending(seated, *found)
                    else:
                        silent.append((seated, *found))
            if silent:
                # One failure: the survivors hear every attendee silent at this tick
                # (a host cut off takes all of its ranks), not the first alone.
                rounds.lose_all_seated(sm, job, silent, now)
        idle = rounds.idle(job)
        if idle and now - job.state_since > sm.timing.job_ttl_s and not job.all_waiters():
            rounds.forget(sm, job, FORGOTTEN)
    ttl = sm.timing.job_ttl_s
    while sm.early_ends and now - next(iter(sm.early_ends.values())) > ttl:
        # As the job's TTL would have: past it, a join of its id is a new run.
        del sm.early_ends[next(iter(sm.early_ends))]


def _loss_found(sm: RendezvousState, seated: Member | Node, now: float) -> tuple[str, float] | None:
    """Why and since when the tick loses active ``seated`` now, if it does: a loss an
    undo took back or storage kept waiting (its own cause and time, not the silence
    that follows it), its silence, or its stream cut for longer than its grace."""
    if seated.lost_as is not None and not seated.stream_open:
        return seated.lost_as, now if seated.lost_at is None else seated.lost_at
    if now - seated.last_seen > sm.timing.heartbeat_timeout_s:
        return rounds.silence_cause(sm, seated), now
    if (
        seated.cut_at is not None
        and not seated.stream_open
        and now - seated.cut_at >= cut_grace_s(sm, seated)
    ):
        return rounds.cut_cause(seated, now - seated.cut_at), now
    return None


def _pending(seated: Attendee, cause: str, now: float) -> None:
    """``seated`` is lost at ``now`` while storage fails: the loss waits for storage,
    with its first cause and time (``Attendee.lost_as``). Made now, its commit would
    fail and be undone, and its survivors, told of it, stop: the undone generation then
    found them silent and blamed them for it."""
    if seated.lost_as is None:
        seated.lost_as, seated.lost_at = cause, now


def watched(job: Job, seated: Attendee) -> bool:
    """Whether ``seated``'s silence means anything: an active attendee of a running
    generation, which the tick loses once it is silent past the heartbeat timeout.
    A failed, aborted or ended generation's survivors are no longer watched (their
    streams end as a matter of course): the heartbeat gauge, its alert and every view
    read their silence as growing for up to the job's TTL."""
    return job.state is JobState.RUNNING and seated.state is MemberState.ACTIVE


def oldest_silence(sm: RendezvousState, now: float) -> float:
    """The longest time since a watched attendee's last heartbeat (0.0: none)."""
    # Over what beats (a node agent beats for its gpus_per_node members, which share
    # its last heartbeat): 12,500 nodes, not 100,000 ranks.
    return max(
        (
            now - a.last_seen
            for job in sm.jobs.values()
            if job.state is JobState.RUNNING
            for a in job.attendees(job.gen.join_mode).values()
            if watched(job, a)
        ),
        default=0.0,
    )


def members_present(job: Job) -> int:
    """``job``'s members present (joining or active) while its generation is forming or
    running; none once it failed, was aborted or ended: a dead generation's survivors
    are nobody's members any more, whether they left or not. The one rule the members
    gauge, GetJob/ListJobs (``members_present``), ``rendezvousd status`` and the status
    page read (the view counted a failed job's survivor, still attached, while the
    gauge did not)."""
    if job.state is JobState.RUNNING:
        # Read on every tick: a running generation's members are each active or left (a
        # loss fails it), so its count is O(1), not a look at 100,000 ranks a second.
        return len(job.gen.members) - job.gen.left
    if job.state is not JobState.FORMING:
        return 0
    if job.gen.join_mode is JoinMode.NODE:
        # A forming node generation has no members yet, only its node agents joined so
        # far, each holding its gpus_per_node ranks once it forms: counted 0, a node job
        # read as absent while `status` listed its nodes joined (per-rank jobs counted
        # their joining workers).
        return len(job.gen.nodes) * job.gpus_per_node
    return len(job.present())


def live_members(sm: RendezvousState) -> int:
    """Members present in the generations still forming or running (``members_present``)."""
    return sum(members_present(job) for job in sm.jobs.values())


def stalled(sm: RendezvousState, seconds: float) -> None:
    """The daemon itself did not run for ``seconds`` (stopped, starved of CPU, swapped
    out): that time is no attendee's silence. Their beats queued meanwhile are read
    only after the tick that ends the stall, which lost every node as silent and
    blamed them for the daemon's own pause (a standby then took a healthy node's seat:
    found by a chaos review). Silence is counted in time the daemon ran."""
    for job in sm.jobs.values():
        if job.state is JobState.RUNNING:
            for seated in job.attendees(job.gen.join_mode).values():
                seated.last_seen += seconds


def leave(
    sm: RendezvousState,
    job_id: str,
    generation: int,
    who: int,
    instance_id: str,
    now: float,
    *,
    mode: JoinMode = JoinMode.RANK,
    final: bool = False,
    connection: str = "",
) -> bool:
    """A goodbye. ``final``: a node agent that will not re-join (it gave up, or its
    process ends): no seat is kept for it in the next generation, and one kept for it
    already (the job moved on meanwhile) is freed at once. Its seat was otherwise
    kept for the hold, and a fresh launch of the job id was refused WORLD_FULL.
    True when it is a formed generation's goodbye, which an undo keeps
    (``Attendee.said_goodbye``); any other an undo takes back."""
    job = sm.jobs.get(job_id)
    if final and mode is JoinMode.NODE and job is not None and generation < job.generation:
        if job.state is JobState.FORMING and instance_id in job.gen.owed:
            joins.seat_given_up(sm, job, instance_id, now)
        return False
    job, seated = seats.seated(
        sm, job_id, generation, who, instance_id, mode, running=False, connection=connection
    )
    if final and mode is JoinMode.NODE and job.state in (JobState.FAILED, JobState.ABORTED):
        # Kept out of the next generation's seats (``placement.owed_back``). No standby
        # is called yet: whether the job re-forms at all is known when a node re-joins
        # (``joins.job_for``); had every node given up, one called here would wait in
        # a generation of its own, and the aborted job would read as forming.
        job.gen.gone.add(instance_id)
    if job.state is JobState.FORMING:
        # Only a worker holds a seat while forming (a node's comes as it forms).
        left = f"rank {who} left job {job_id!r} before it formed"
        joins.wake_seat(sm, job, who, fault=RendezvousFault(Code.ABORTED, Reason.JOB_ABORTED, left))
        joins.unseat(sm, job, seated, now)
        return False
    _goodbye(sm, job, seated, now)
    if final and mode is JoinMode.NODE:
        joins.closed_as_given_up(sm, job, now)
    return True


def leave_given_up(
    sm: RendezvousState, job_id: str, instance_id: str, now: float, *, mode: JoinMode
) -> None:
    """The seat of a join its caller gave up after sending it and will not send again
    (``LeaveRequest.given_up``), found by the join's instance id: the caller never
    learned its rank or generation. A forming generation frees the seat, as a Leave
    does. A formed one loses it at once: it will never attend, and its peers heard
    only at the heartbeat timeout that it "sent no heartbeat". A node's seat is not kept
    for it in a next generation (a final Leave's ``gone``); one kept already is freed."""
    job = seats.find_job(sm, job_id)
    if mode is JoinMode.NODE and job.state is JobState.FORMING and instance_id in job.gen.owed:
        joins.seat_given_up(sm, job, instance_id, now)
        return
    job, seated = seats.held_by(sm, job_id, instance_id, mode)
    if job.state is JobState.FORMING:
        given_up = f"the {seated.joiner}'s join was given up by its caller"
        joins.wake_seat(
            sm,
            job,
            job.key(seated),
            fault=RendezvousFault(Code.ABORTED, Reason.JOB_ABORTED, given_up),
        )
        if seated is placement.holder(job):
            job.gen.id_deadline = None  # the id it owed: whoever takes rank 0 owes it now
        joins.unseat(sm, job, seated, now)
        return
    if mode is JoinMode.NODE:
        job.gen.gone.add(instance_id)
    if job.state is JobState.RUNNING and seated.state is MemberState.ACTIVE:
        rounds.lose_seated(sm, job, seated, seated.given_up, now)


def _goodbye(sm: RendezvousState, job: Job, seated: Member | Node, now: float) -> None:
    """``seated`` leaves its formed generation, and the members it attends for."""
    seated.said_goodbye = True
    for member in job.covered(seated):
        rounds.member_left(sm, job, member, now)
    if seated.state is MemberState.ACTIVE:
        seated.state = MemberState.LEFT
