"""The lookups that fence a caller off: its job, its seat (a member, or a node agent by
node rank: ``Job.attendees``) and whether it is the instance that took it. Pure."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rendezvousd.common import validation
from rendezvousd.common.model import JobState, JoinMode, Warn
from rendezvousd.errors import RendezvousFault
from rendezvousd.state import fences, placement
from rendezvousd.state.job import OLD_SDK, Job, Member, Node

if TYPE_CHECKING:
    from rendezvousd.state.machine import RendezvousState

# Hot-path members as module names: on Python 3.11 each Enum.MEMBER lookup is a
# descriptor call (~0.2 us), and a join or heartbeat made several.
_NODE = JoinMode.NODE


def not_draining(sm: RendezvousState) -> None:
    """A daemon shutting down refuses joins as UNAVAILABLE: clients retry once it is back."""
    if sm.draining:
        raise fences.draining()


def stream_current(
    sm: RendezvousState, job_id: str, generation: int, who: int, token: int, mode: JoinMode
) -> bool:
    """Whether the heartbeat stream ``token`` of attendee ``who`` still serves one:
    false once the job put back has no such attendee of that generation."""
    job = sm.jobs.get(job_id)
    if job is None or job.generation != generation:
        return False
    attendee = job.attendees(mode).get(who)
    return attendee is not None and attendee.stream_token == token


def find_job(sm: RendezvousState, job_id: str) -> Job:
    job = sm.jobs.get(validation.job_id(job_id))
    if job is None:
        raise fences.no_such_job(job_id)
    return job


def stream_job(sm: RendezvousState, job_id: str, generation: int) -> Job | None:
    """The job a heartbeat stream that just ended served, unless its generation moved
    on (the stream's end says nothing about the new one) or the daemon is draining."""
    job = sm.jobs.get(job_id)
    if job is None or job.generation != generation or sm.draining:
        return None
    return job


#: How many ids of jobs it forgot a daemon without --state-dir keeps (``forget``):
#: past them, no call is told that a restart forgot its job (``forgot_many``).
FORGOT_KEPT = 65536


def forget(sm: RendezvousState, job_id: str) -> None:
    """This process forgot ``job_id``'s job (idle past job_ttl_s): a caller of that run
    is one of a job that ended here, not of one a restart forgot."""
    if sm.stateless_since is None or sm.forgot_many:
        return
    if len(sm.forgot) >= FORGOT_KEPT:
        sm.forgot_many = True
        sm.forgot.clear()
    else:
        sm.forgot.add(job_id)


def forgotten(
    sm: RendezvousState,
    job: Job,
    generation: int,
    instance_id: str,
    who: int,
    mode: JoinMode,
    refusal: RendezvousFault,
) -> RendezvousFault:
    """``refusal`` of a call naming a seat of ``job``, reworded to say that the daemon
    forgot the caller's run where no join this daemon process saw could have given the
    seat, on a daemon that keeps no state (``fences.forgotten_run``): the generation is
    one this job never reached, or ``instance_id`` made no join in it
    (``Generation.joined``). Its caller joined before the daemon restarted without
    --state-dir (a job this process forgot after its end excepted: ``forget``), or
    never joined at all. ``refusal`` as it is wherever another reading is possible:
    any instance that joined this generation here (a duplicate agent, a given-up join,
    a replaced worker), a daemon with --state-dir, a call naming no instance id."""
    started = sm.stateless_since
    if started is None or generation < job.generation or generation < 1:
        return refusal
    if sm.forgot_many or job.job_id in sm.forgot:
        return refusal
    if generation == job.generation:
        joined = job.gen.joined
        if not instance_id or joined is None or instance_id in joined:
            return refusal
        if mode is not _NODE and job.gen.join_mode is _NODE and job.gpus_per_node:
            # A worker of a node acts under an id derived from its node's
            # (``placement.member_instance_id``).
            local = who % job.gpus_per_node
            if any(placement.member_instance_id(n, local) == instance_id for n in joined):
                return refusal
    return fences.forgotten_run(refusal, job, generation, who, mode, started)


def seat(
    sm: RendezvousState,
    job_id: str,
    generation: int,
    who: int,
    mode: JoinMode = JoinMode.RANK,
    instance_id: str = "",
) -> tuple[Job, Member | Node]:
    """The caller's job and seat (``Job.attendees``), or the fault that fences it off;
    ``instance_id``: the caller's, where the call names one."""
    job = find_job(sm, job_id)
    if generation != job.generation:
        stale = fences.stale_generation(job, generation)
        raise forgotten(sm, job, generation, instance_id, who, mode, stale)
    seated = job.attendees(mode).get(who)
    if seated is None:
        refusal = fences.not_seated(job, generation, who, mode)
        raise forgotten(sm, job, generation, instance_id, who, mode, refusal)
    return job, seated


def seated(
    sm: RendezvousState,
    job_id: str,
    generation: int,
    who: int,
    instance_id: str,
    mode: JoinMode = JoinMode.RANK,
    *,
    running: bool = True,
    connection: str = "",
) -> tuple[Job, Member | Node]:
    """``_seat``, and the caller must be the instance that took it: holding the token
    is not enough to act for another job's or another process's seat. ``connection``:
    the gRPC peer the call came over ("" when unknown), which tells an old SDK's call
    from a forged one (``own_connection``)."""
    job, seated = seat(sm, job_id, generation, who, mode, instance_id)
    refusal: RendezvousFault | None = None
    if seated.instance_id != instance_id:
        if mode is _NODE:
            refusal = fences.not_seated(job, generation, who, mode)
        else:
            refusal = fences.other_instance(job, generation, who, instance_id)
        if (said := forgotten(sm, job, generation, instance_id, who, mode, refusal)) is not refusal:
            raise said  # (before the generation's state: a forming one is the new run's)
        if mode is _NODE:
            raise refusal
    if running and job.state is not JobState.RUNNING:
        raise job.generation_fault()
    if refusal is not None:  # another worker instance's rank (a node's was raised above)
        if not instance_id and isinstance(seated, Member) and own_connection(seated, connection):
            _without_instance_id(sm, job, seated)
        raise refusal
    return job, seated


def held_by(
    sm: RendezvousState, job_id: str, instance_id: str, mode: JoinMode
) -> tuple[Job, Member | Node]:
    """The seat ``instance_id`` holds in its job's current generation (a worker's member,
    or a node agent's node: ``mode``), for a caller that never learned its rank or
    generation (a join it gave up); NOT_A_MEMBER when it holds none. The instance id is
    the caller's secret, so holding the job's token is not enough to name another's."""
    job = find_job(sm, job_id)
    seat: Member | Node | None = None
    if instance_id and mode is _NODE:
        seat = job.gen.nodes.get(instance_id)
    elif instance_id:
        seat = next((m for m in job.gen.members.values() if m.instance_id == instance_id), None)
    if seat is None:
        raise fences.holds_no_seat(job, mode)
    return job, seat


def own_connection(member: Member, connection: str) -> bool:
    """Whether a call came over ``member``'s open heartbeat stream's connection. An SDK
    from before member instance ids sends its calls over the one channel its heartbeat
    stream rides: one connection, the same gRPC peer, address and port. Any holder of
    the job's token can name the rank without an instance id too, but over a
    connection of its own (another host, or another process of the same host): its
    call is refused alike, and says nothing of the member. (A daemon listening on a
    Unix socket sees one peer for every caller: there, only callers of its own host.)"""
    return bool(connection) and member.stream_open and member.connection == connection


def _without_instance_id(sm: RendezvousState, job: Job, member: Member) -> None:
    """A call for ``member``'s rank named no instance id, over its own heartbeat
    stream's connection: an SDK from before member instance ids (every SDK since sends
    the one it joined with; the Join and heartbeat of an older one carried it, its
    later calls do not). The call is refused and its worker fails, its
    peers told only that its stream closed: so its loss says why
    (``rounds.loss_cause``), and the daemon's log says it once per job, naming the host."""
    member.without_instance_id = True
    if job.told_old_sdk:
        return
    job.told_old_sdk = True
    sm.calls.emit(
        Warn(
            job.job_id,
            job.generation,
            f"rank {member.rank} on host {member.host!r} made a call without an instance_id, "
            f"which only {OLD_SDK} does (it sends one in its Join only): its calls after "
            f"the join are refused (DUPLICATE_RANK); upgrade the rendezvousd SDK on "
            f"{member.host!r} (said once per job)",
        )
    )


def caller(
    sm: RendezvousState,
    job_id: str,
    generation: int,
    rank: int,
    instance_id: str,
    *,
    running: bool = True,
    connection: str = "",
) -> tuple[Job, Member]:
    """``_seated`` for a worker's own call (barrier, key-value, its table, its id)."""
    job, member = seated(
        sm, job_id, generation, rank, instance_id, running=running, connection=connection
    )
    assert isinstance(member, Member)  # RANK seats are members
    return job, member
