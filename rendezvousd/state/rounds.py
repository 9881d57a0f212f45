"""A generation's life in the state machine: a job created and its next generation opened,
formed, failed by a loss or a conflicting joiner, ended by its members leaving, and put back
after an undone commit; the events its attendees hear. Pure, like every module of the
state machine: functions over ``RendezvousState``, which they queue effects on."""

from __future__ import annotations

import ipaddress
from dataclasses import replace
from typing import TYPE_CHECKING

from rendezvousd.common import validation
from rendezvousd.common.escape import bounded, escape, shortened
from rendezvousd.common.members import NAMED_LOSSES, WITNESS_WINDOW_S
from rendezvousd.common.model import (
    FORGOTTEN,
    NEVER_ATTACHED,
    AbortCause,
    EventKind,
    FailedInfo,
    JobFailure,
    JobState,
    JoinMode,
    MemberState,
    Notify,
    Rejoin,
    Transition,
    Warn,
)
from rendezvousd.common.newest import keep_newest
from rendezvousd.errors import RendezvousFault
from rendezvousd.state import barriers, kv, placement, seats
from rendezvousd.state.job import OLD_SDK, Attendee, Job, Member, Node
from rendezvousd.state.job import REFUSAL_LOG_S as REFUSAL_LOG_S  # said here, kept there

if TYPE_CHECKING:
    from rendezvousd.state.machine import RendezvousState

TERMINAL = (JobState.FAILED, JobState.ABORTED, JobState.ENDED)


def put_back(
    sm: RendezvousState, job_id: str, job: Job | None, fault: RendezvousFault, detail: str
) -> None:
    """``job`` (None: no job) replaces ``job_id``'s job: the durable form it had
    before changes that are undone. What a call parked on it waited for may be gone,
    so each wakes with ``fault``."""
    if sm.calls.per_job.get(job_id):
        for waiter in [w for w, rec in sm.calls.waiting.items() if rec.job_id == job_id]:
            sm.calls.wake(waiter, fault=fault)
    old = sm.jobs.pop(job_id, None)
    if job is not None:
        sm.jobs[job_id] = job
    shown = job or old
    if shown is not None:
        sm.calls.emit(
            Transition(
                job_id,
                shown.generation,
                old.state if old else None,
                job.state if job else None,
                detail,
                shown.world_size,
                # Back to a state already counted when it was committed: no new event.
                restored=True,
            )
        )


def set_state(
    sm: RendezvousState, job: Job, new: JobState, now: float, detail: str, *, lost: bool = False
) -> None:
    """``job`` enters ``new``; ``lost``: a lost member failed it."""
    old = job.state
    job.state = new
    job.state_since = now
    change = Transition(job.job_id, job.generation, old, new, detail, job.world_size, lost=lost)
    sm.calls.emit(change)
    if change.failure:
        job.failures += 1
        if new is JobState.FAILED:
            job.last_failure = JobFailure(job.generation, bounded(detail), now)
    if new in TERMINAL:
        wake_parked(sm, job)
    if new is JobState.RUNNING or new is JobState.ENDED:
        job.standbys_called.clear()  # seated by now, or not needed
    if new is JobState.RUNNING:
        job.next_run_nodes.clear()
    if new is JobState.ENDED:
        job.ended_at = now
        job.ended_leavers = frozenset(
            # said_goodbye: the last leaver's own state is set after this.
            n.instance_id
            for n in job.gen.nodes.values()
            if n.said_goodbye and n.state is not MemberState.LOST
        )


def wake_parked(sm: RendezvousState, job: Job) -> None:
    """The generation ended. Nodes parked for a scale-up wanted the next generation,
    not this one: they ask again and open it, instead of hearing this one's fault.
    Standbys are called, in the order they parked, only into the slots that the nodes
    kept and woken leave free; the others stay parked for a later failure. A job that
    ended needs none: they hear so."""
    waiters, standby = job.scaleup_waiters, job.standby_waiters
    woken = {inst for w, inst in waiters.items() if w not in standby}
    room = job.max_nodes - placement.kept_nodes(job) - len(woken)
    ended = job.state is JobState.ENDED
    called = job.standbys_called
    for waiter, inst in list(waiters.items()):
        if waiter in standby:
            if ended:
                sm.calls.wake(waiter, fault=job.generation_fault())
            elif inst in called or room > 0:
                if inst not in called:
                    called.add(inst)
                    room -= 1
                woken.add(inst)
                sm.calls.wake(waiter, Rejoin())
            else:
                continue  # stays parked for a later failure
            standby.discard(waiter)
        else:
            if waiter in job.next_run_waiters:
                job.next_run_nodes.add(inst)
            sm.calls.wake(waiter, Rejoin())
        del waiters[waiter]
        job.next_run_waiters.discard(waiter)
    job.gen.woken = woken


#: The ends of jobs forgotten early for a new job's max_jobs slot (``make_room``) the
#: daemon keeps, so that a node agent launched for such a run is still told it ended
#: (``joins.launched_for_run_forgotten``), as it would be while its TTL kept the job. About
#: 100 bytes each.
EARLY_ENDS_KEPT = 4096


def idle(job: Job) -> bool:
    """Whether ``job`` holds nothing live, so that its TTL runs: its generation failed,
    was aborted or ended, or forms with nobody in it."""
    return job.state in TERMINAL or (
        job.state is JobState.FORMING and not job.gen.members and not job.gen.nodes
    )


def spare(sm: RendezvousState, job: Job, now: float) -> bool:
    """Whether ``job`` fills no max_jobs slot, which a new job may take (``make_room``):
    idle with no call parked on it, and nothing its record still tells late callers
    that a new run of its id would not: a closed run (its late nodes are refused until
    its TTL), a topology conflict late workers of its launch are told of (for one
    heartbeat timeout)."""
    if not idle(job) or job.closed is not None or job.all_waiters():
        return False
    conflict = job.gen.conflict is not None and job.state is JobState.FAILED
    return not (conflict and now - job.state_since < sm.timing.heartbeat_timeout_s)


def forget(sm: RendezvousState, job: Job, detail: str) -> None:
    """The daemon forgets ``job`` (its TTL passed, or its slot went to a new job):
    ``detail`` starts with FORGOTTEN, which the adapter records as the job's end."""
    del sm.jobs[job.job_id]
    seats.forget(sm, job.job_id)
    sm.calls.emit(Transition(job.job_id, job.generation, job.state, None, detail))


def make_room(sm: RendezvousState, job_id: str, now: float) -> None:
    """A slot for new job ``job_id`` in a daemon holding max_jobs jobs: the oldest
    finished (or empty forming) jobs are forgotten early, as their TTL would forget
    them; only live jobs (forming with someone in them, running) fill max_jobs. A busy
    daemon kept every finished job for --job-ttl-s and refused new ones while one ran
    (an SRE review: 1 running, 900 ended or failed, joins refused)."""
    limit = sm.limits.max_jobs
    if len(sm.jobs) < limit:
        return
    spares = sorted((j for j in sm.jobs.values() if spare(sm, j, now)), key=lambda j: j.state_since)
    need = len(sm.jobs) - limit + 1
    if len(spares) < need:
        live = len(sm.jobs) - len(spares)  # at least max_jobs: more when restored so
        held = f"max_jobs={limit}" if live == limit else f"{live} (over max_jobs={limit})"
        raise validation.limit_exceeded(
            "max_jobs",
            f"job {job_id!r} cannot start: the daemon already holds {held} live jobs "
            "(forming with a joiner present, or running); wait for one to end (a finished "
            "job's slot goes to the next new job at once), or start the daemon with a "
            "larger --max-jobs",
            job_id=job_id,
        )
    for job in spares[:need]:
        if job.state is JobState.ENDED and job.ended_at is not None:
            keep_newest(sm.early_ends, job.job_id, job.ended_at, EARLY_ENDS_KEPT)
        forget(
            sm,
            job,
            f"{FORGOTTEN} early, {now - job.state_since:.1f} s after it became "
            f"{job.state.name}, before --job-ttl-s ({sm.timing.job_ttl_s:g} s): its "
            f"max_jobs={limit} slot went to new job {job_id!r}",
        )


def open_job(
    sm: RendezvousState,
    job_id: str,
    num_nodes: int,
    gpus_per_node: int,
    now: float,
    detail: str = "created",
) -> Job:
    """A job's first joiner creates it, FORMING its first generation."""
    make_room(sm, job_id, now)
    job = Job(job_id, num_nodes, gpus_per_node, 0, JobState.FORMING, now)
    sm.jobs[job_id] = job
    job.open_generation(now)
    sm.calls.emit(Transition(job.job_id, job.generation, None, JobState.FORMING, detail))
    return job


def next_generation(sm: RendezvousState, job: Job, now: float) -> None:
    """A newcomer to an ended generation opens the next one."""
    since = now - job.state_since
    if job.gen.conflict is not None and since < sm.timing.heartbeat_timeout_s:
        # Late workers of the launch that had the conflict hear about it too,
        # instead of opening a generation nobody else will join. Said as such: a
        # launch already fixed read the old conflict as its own, with no word of when
        # it could join.
        conflict = job.gen.conflict
        wait = sm.timing.heartbeat_timeout_s - since
        raise RendezvousFault(
            conflict.code,
            conflict.reason,
            f"{conflict.message} (the job's last launch failed on this {since:.1f} s ago; "
            f"joins within {sm.timing.heartbeat_timeout_s:g} s of it are told so, as its late "
            f"members; a launch that fixed it may join in {wait:.1f} s)",
            conflict.metadata,
            conflict.failed,
        )
    old, ended = job.state, job.state_since
    job.open_generation(now)
    job.gen.after_end = ended if old is JobState.ENDED else None
    sm.calls.emit(Transition(job.job_id, job.generation, old, JobState.FORMING, "new generation"))


def conflict(sm: RendezvousState, job: Job, fault: RendezvousFault, now: float) -> RendezvousFault:
    """``fault``, a joiner's conflict with the job's topology, to raise. Either side
    may be the wrong one: a forming generation fails, so that every waiter learns
    now, not at its join timeout, and late joiners of the launch hear it too."""
    if job.state is JobState.FORMING:
        job.gen.conflict = fault
        set_state(sm, job, JobState.FAILED, now, fault.message)
        fail_waiters(sm, job)
    return refused(sm, job, fault, now)


def refused(sm: RendezvousState, job: Job, fault: RendezvousFault, now: float) -> RendezvousFault:
    """``fault``, to raise. A running generation refuses only the joiner (another
    topology, version or mode), and so does a forming one (another version or mode):
    nothing changes, so nothing but the joiner heard of it, and the operator looking at
    the daemon saw no trace. Counted by reason, and said at most once per
    ``REFUSAL_LOG_S`` per job, with how many were not said since."""
    if job.state not in (JobState.RUNNING, JobState.FORMING):
        return fault
    reason = fault.reason.value
    if (due := job.refusals.due(None, now)) is None:
        sm.calls.emit(Warn(job.job_id, job.generation, "", refused=reason))
        return fault
    more = (
        f" ({due.skipped} more refused in the {due.since_s:.0f} s since the last line, not logged)"
        if due.skipped
        else ""
    )
    sm.calls.emit(
        Warn(
            job.job_id,
            job.generation,
            f"refused a joiner ({reason}; the {job.state.name.lower()} generation goes on): "
            f"{fault.message}{more}",
            refused=reason,
        )
    )
    return fault


def silent(sm: RendezvousState, who: str) -> str:
    """The cause of losing an attendee to the heartbeat timeout; ``who``: "node" or
    "worker". Worded apart from a closed stream: survivors can tell a host that went
    silent (partition, power loss, a stopped process) from a process that died."""
    return f"no heartbeat for {sm.timing.heartbeat_timeout_s:.1f} s ({who} unreachable)"


def refused_silence(sm: RendezvousState, seated: Attendee) -> str | None:
    """The silence of ``seated`` worded by its token, when calls from its host were
    refused for their token since its last heartbeat (a rotation that removed the token
    its node still sends): not "unreachable", which sent the operator to the network."""
    for host in _hosts(seated):
        at = sm.token_refused.get(host)
        if at is not None and at >= seated.last_seen:
            return (
                f"no heartbeat for {sm.timing.heartbeat_timeout_s:.1f} s: calls from its "
                f"host {host} were refused for their token since its last one (was the "
                "daemon's token rotated? give the node a token the daemon's token file lists)"
            )
    return None


def _hosts(seated: Attendee) -> list[str]:
    """The hosts ``seated`` is known by: its heartbeat stream's, and the addresses it
    advertised (durable: a restarted daemon that refused its stream knows only these)."""
    if isinstance(seated, Node):
        advertised: tuple[str, ...] = seated.addresses
    elif isinstance(seated, Member):
        advertised = (seated.address,)
    else:
        advertised = ()
    hosts = [seated.peer] if seated.peer else []
    for address in advertised:
        try:
            hosts.append(str(ipaddress.ip_address(address)))  # a bare host, v6 too
        except ValueError:
            host = address.rpartition(":")[0].removeprefix("[").removesuffix("]")
            if host:
                hosts.append(host)
    return hosts


def silence_cause(sm: RendezvousState, seated: Attendee) -> str:
    """Why the tick loses ``seated``: a node agent that never attached a heartbeat
    stream since it was placed is worded apart (``NEVER_ATTACHED``), so that the
    other agents do not count a stray JoinNode as a failure of the job; one whose
    token was refused, by that (``refused_silence``)."""
    if seated.stream_token != 0:
        return loss_cause(seated, refused_silence(sm, seated) or silent(sm, seated.who))
    timeout = sm.timing.heartbeat_timeout_s
    if isinstance(seated, Node):
        return f"{NEVER_ATTACHED} (none within {timeout:.1f} s)"
    # A live SDK user's worker read "unreachable" for a start_heartbeat() it never
    # called (the README's own second worker did not).
    return loss_cause(
        seated,
        f"joined, then sent no heartbeat within {timeout:.1f} s (start_heartbeat() "
        "was not called after join(), or the process stopped before it)",
    )


def stream_end_cause(sm: RendezvousState, attendee: Attendee, now: float) -> str:
    """Why the end of ``attendee``'s stream loses it: its stream closed, unless it had
    been silent for the heartbeat timeout by then. The daemon's own keepalive ends the
    connection of a peer that stopped answering (``rendezvousd/daemon.py``), which may come a
    moment before the tick that would have named the silence: the silence is still
    the cause, not the cut that followed it."""
    if now - attendee.last_seen >= sm.timing.heartbeat_timeout_s:
        return loss_cause(attendee, refused_silence(sm, attendee) or silent(sm, attendee.who))
    return loss_cause(attendee, attendee.stream_closed)


def cut_cause(attendee: Attendee, gone: float) -> str:
    """Why a node agent whose stream ended without its goodbye and did not re-attach
    in ``gone`` seconds is lost (``liveness.cut_grace_s``)."""
    if isinstance(attendee, Node):
        return attendee.stream_cut.format(gone=gone)
    return loss_cause(attendee, attendee.stream_closed)


def loss_cause(attendee: Attendee, cause: str) -> str:
    """``cause``, unless ``attendee`` is a member whose calls came without its instance
    id (``seats._without_instance_id``): its worker failed on the refusal, which its
    peers read as a stream closed or a silence for no reason."""
    if isinstance(attendee, Member) and attendee.without_instance_id:
        # Short enough to be shown whole; the daemon's warning says what it sent.
        return f"{OLD_SDK}: upgrade it ({cause})"
    return cause


def _witness_first(sm: RendezvousState, job: Job, now: float) -> None:
    """A failed generation's root cause was a rank's second-hand report of a broken
    link, and the newest loss is the witness's own, within WITNESS_WINDOW_S: the
    witness's words become the cause of record (docs/trainer.md, "A cut between two
    nodes"). Its hearsay wait (0.5 s more) did not always make it first: the relay's
    host was blamed in 2 of 4 cut runs (h160). Its survivors heard the first already;
    GetJob, `status` and every launcher's root cause read this order."""
    failed = job.gen.failed
    if job.state is not JobState.FAILED or len(failed) < 2:
        return
    first, newest = failed[0], failed[-1]
    # As data: an older SDK's report names no witness, and its order stands. Its
    # words once did ("(reported by rank R)"), matched back out of the cause.
    if first.witness is None or first.lost_at is None or now - first.lost_at > WITNESS_WINDOW_S:
        return
    if newest.rank != first.witness or newest.witness is not None:
        return
    failed.insert(0, failed.pop())
    if job.last_failure is not None and job.last_failure.generation == job.generation:
        job.last_failure = replace(
            job.last_failure, cause=bounded(f"{newest.describe()}, then {first.describe()}")
        )
    sm.calls.emit(
        Warn(
            job.job_id,
            job.generation,
            f"job {job.job_id!r} generation {job.generation}: the root cause of record is "
            f"now {newest.describe()}, the witness's own report, {now - first.lost_at:.2f} s "
            f"after rank {first.rank}'s report of it from a neighbour",
        )
    )


def lose_seated(
    sm: RendezvousState, job: Job, seated: Member | Node, cause: str, now: float
) -> None:
    """``seated`` is gone (silent, its stream closed), and with it the active members
    it attends for."""
    lose_all_seated(sm, job, [(seated, cause, now)], now)


def lose_all_seated(
    sm: RendezvousState,
    job: Job,
    gone: list[tuple[Member | Node, str, float]],
    now: float,
    *,
    detail: str | None = None,
) -> None:
    """Each of ``gone`` is lost with its cause and the time it went, as one failure: a
    host cut off takes its attendees silent at the same tick, and its survivors were
    told only the first (the generation had failed by the second), though ``status``
    listed every one. Losses kept while storage failed (``Attendee.lost_as``) are made
    together once it is back, each at the time it went."""
    lost: list[tuple[Member, str, float]] = []
    for seated, cause, at in gone:
        lost += [(m, cause, at) for m in job.covered(seated) if m.state is MemberState.ACTIVE]
        seated.state = MemberState.LOST
        seated.lost_as, seated.lost_at = cause, at
        seated.stream_open = False
    # The first to go is the root cause of record; those that went at the same time
    # (silent at one tick) by rank, not by when each joined. By rank alone, the kept
    # losses of an outage named the lowest rank, not the first dead.
    lost.sort(key=lambda went: (went[2], went[0].rank))
    _lose(sm, job, lost, now, told=None, attendees=len(gone), detail=detail)


def outage_cause(down_s: float, window_s: float) -> str:
    """Why a generation the daemon restored after ``down_s`` of outage ended."""
    return (
        f"the daemon was down {down_s:.1f} s (longer than the nodes' {window_s:g} s "
        "reconnect window); its nodes stopped their workers and joined again"
    )


def end_for_outage(sm: RendezvousState, job: Job, held: Node, down_s: float, now: float) -> None:
    """``job``'s restored generation ends for the daemon's own outage (``outage_s``):
    every node of it gave up on the daemon and stopped its workers; ``held``, the
    node whose agent re-joins first, is lost with the outage as its ranks' cause, and
    the failure's words name no node (the first node back was blamed for it). Its
    other nodes are not marked lost: still owed their seats (``placement.owed_back``),
    they take them back as they re-join, where a standby could have taken them."""
    cause = outage_cause(down_s, sm.timing.heartbeat_timeout_s)
    lose_all_seated(sm, job, [(held, cause, now)], now, detail=cause)


def lose(
    sm: RendezvousState,
    job: Job,
    lost: list[Member],
    cause: str,
    now: float,
    *,
    told: int | None = None,
    witness: int | None = None,
) -> None:
    """``lost`` members are gone: the generation fails, every other member (node
    agent in a JoinNode generation; but the node ``told``, which reported it) hears.
    ``witness``: the rank whose report of the loss its reporter relays."""
    _lose(sm, job, [(m, cause, now) for m in lost], now, told=told, attendees=1, witness=witness)


def _lose(
    sm: RendezvousState,
    job: Job,
    lost: list[tuple[Member, str, float]],
    now: float,
    *,
    told: int | None,
    attendees: int,
    witness: int | None = None,
    detail: str | None = None,
) -> None:
    """``lost`` members, each with its cause and when it went, of ``attendees`` seats,
    gone as one failure; ``detail``: the failure's own words, where no member is its
    cause."""
    for member, cause, at in lost:
        member.state = MemberState.LOST
        member.stream_open = False
        job.gen.failed.append(member.loss(cause, at, witness))
    if job.state is not JobState.RUNNING or not lost:
        _witness_first(sm, job, now)
        return  # the generation already ended: survivors were told once
    first = job.gen.failed[-len(lost)]
    more = ""
    if len(lost) > 1:
        whose = "of its node" if attendees == 1 else "lost with it"
        more = f" (and {len(lost) - 1} more {whose})"
    detail = detail or f"{first.describe()}{more}{_after_leaving(job)}"
    set_state(sm, job, JobState.FAILED, now, detail, lost=True)
    if job.last_failure is not None and first.lost_at is not None:
        # When its first loss went (earlier than now for one kept through an outage).
        job.last_failure = replace(job.last_failure, at=first.lost_at)
    fail_waiters(sm, job)
    # The event's failed list holds the whole cause; its reason only shows it.
    notify(sm, job, EventKind.PEER_FAILED, reason=shortened(lost[0][1]), skip=told)


def _after_leaving(job: Job) -> str:
    """The workers that left ``job``'s running generation before it failed, as the
    failure's context ("" for none). A goodbye there is a clean end for its worker:
    every end starts with one, the ranks leaving one by one. But one that left while
    the others still ran collectives (it finished early: uneven data) breaks theirs,
    and the loss that follows is one of its victims (its stream closed, its collective
    timed out), which the daemon's line and ``status`` named alone. Not the cause
    itself: a rank's own crash in the staggered end (its last checkpoint) also comes
    after others left. A node agent's goodbye is its whole node's end, said by its
    agents' own words."""
    if job.gen.join_mode is not JoinMode.RANK or not job.gen.left:
        return ""
    gone = [m for m in job.gen.members.values() if m.state is MemberState.LEFT]
    named = ", ".join(f"rank {m.rank} on {escape(m.host)}" for m in gone[:NAMED_LOSSES])
    more = f" and {len(gone) - NAMED_LOSSES} more" if len(gone) > NAMED_LOSSES else ""
    return f", after {named}{more} left the running generation (finished or exited early)"


def fail_waiters(sm: RendezvousState, job: Job) -> None:
    fault = job.generation_fault()
    # Scale-up calls still parked are standbys waiting for a later slot (``wake_parked``).
    for w in job.all_waiters() - job.scaleup_waiters.keys():
        sm.calls.wake(w, fault=fault)
    job.gen.join_waiters.clear()
    job.gen.kv_waiters.clear()
    for barrier in job.gen.barriers.values():
        barrier.arrived.clear()


def notify(
    sm: RendezvousState,
    job: Job,
    kind: EventKind,
    reason: str = "",
    *,
    skip: int | None = None,
    nodes_waiting: int = 0,
    abort_cause: AbortCause = AbortCause.UNSPECIFIED,
    closed: bool = False,
) -> None:
    # Attendees hear it on their streams: a node agent's covers its ranks, which
    # have none of their own.
    to = tuple(
        r
        for r, a in job.attendees(job.gen.join_mode).items()
        if a.state is MemberState.ACTIVE and r != skip
    )
    if to:
        sm.calls.emit(
            Notify(
                job.job_id,
                job.generation,
                job.gen.join_mode,
                to,
                kind,
                tuple(job.gen.failed),
                reason,
                nodes_waiting,
                abort_cause,
                closed,
            )
        )


def member_left(sm: RendezvousState, job: Job, member: Member, now: float) -> None:
    """A member of a formed generation is done; the last one ends the job. A barrier
    no longer waits for it, nor counts its arrival (counted twice, as arrived and as
    left, it let the others through before every rank still there arrived): its own
    call parked there ends."""
    if member.state is MemberState.ACTIVE:
        member.state = MemberState.LEFT
        job.gen.left += 1
    if job.state is JobState.RUNNING:
        for name, barrier in job.gen.barriers.items():
            for w in barrier.arrived.pop(member.rank, ()):
                sm.calls.wake(w, fault=barriers.left(job, member.rank, name))
        # Its own key waits end too: left from another thread, a parked kv_get waited
        # out its whole wait (600 s by default) where a barrier ended at once (an SDK
        # misuse review).
        for key, ws in list(job.gen.kv_waiters.items()):
            mine = {
                w for w in ws if (parked := sm.calls.waiting.get(w)) and parked.rank == member.rank
            }
            for w in mine:
                sm.calls.wake(w, fault=kv.left(job, member.rank, key))
            ws -= mine
            if not ws:
                del job.gen.kv_waiters[key]
        if job.gen.left == len(job.gen.members):
            set_state(sm, job, JobState.ENDED, now, "every member left")
            # A key wait a member left behind: held to its deadline, it kept the ended
            # job from expiring.
            fail_waiters(sm, job)
            return
        for barrier in job.gen.barriers.values():
            if barrier.arrived and job.barrier_complete(len(barrier.arrived)):
                for w in barriers.release(barrier):
                    sm.calls.wake(w, barrier.completed)


def form(sm: RendezvousState, job: Job, now: float, detail: str) -> None:
    """Every rank is placed and the id known: the generation runs, each attendee and
    member is live, and every parked join gets its answer."""
    for seated in (*job.gen.nodes.values(), *job.gen.members.values()):
        seated.state = MemberState.ACTIVE
        seated.last_seen = now
    job.gen.member_table = tuple(job.gen.members[r].info() for r in range(job.world_size))
    set_state(sm, job, JobState.RUNNING, now, detail)
    for waiter, key in job.gen.join_waiters.items():
        seat = job.seat(key)
        assert seat is not None  # a seat with a parked join is not freed
        sm.calls.wake(waiter, placement.answer(job, seat))
    job.gen.join_waiters.clear()


def joiner_died(
    sm: RendezvousState, job: Job, seated: Attendee, loss: FailedInfo, now: float
) -> None:
    """A forming joiner's parked call vanished (its process died or disconnected):
    everyone waiting for this world is told at once, rather than at their timeout."""
    seated.state = MemberState.LOST
    # Kept by an undo (a failed commit): made again once storage takes writes.
    seated.lost_as, seated.lost_at = seated.cancelled, loss.lost_at
    job.gen.failed.append(loss)
    set_state(sm, job, JobState.FAILED, now, loss.describe(), lost=True)
    fail_waiters(sm, job)
