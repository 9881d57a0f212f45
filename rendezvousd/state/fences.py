"""The faults that fence a call off: a daemon shutting down, a job that does not
exist, an old generation, a rank that is not a member, a rank another worker holds.

``RendezvousState`` decides when a call is fenced; these say why, and what the
worker does next, so every RPC words the same refusal the same way.
"""

from __future__ import annotations

from rendezvousd.common.escape import shortened
from rendezvousd.common.log_time import utc_stamp
from rendezvousd.common.model import JoinMode
from rendezvousd.errors import Code, Reason, RendezvousFault
from rendezvousd.state.job import Job, Member, Node


def draining() -> RendezvousFault:
    return RendezvousFault(
        Code.UNAVAILABLE, Reason.DRAINING, "the daemon is shutting down; retry after it restarts"
    )


def left(job: Job, rank: int, ends: str) -> RendezvousFault:
    """The fault of rank ``rank``'s call once it left the job: what ``ends`` for it
    ("it takes no part in barrier 'x' any more", "its wait for key 'k' ends")."""
    return RendezvousFault(
        Code.FAILED_PRECONDITION,
        Reason.NOT_A_MEMBER,
        f"rank {rank} left job {job.job_id!r}; {ends}",
        {"job_id": job.job_id, "ranks": str(rank)},
    )


def no_such_job(job_id: str) -> RendezvousFault:
    """Only a call that expects the job gets it (a join makes the job): a member's
    call after a daemon restarted without its state read as a typo."""
    return RendezvousFault(
        Code.NOT_FOUND,
        Reason.JOB_NOT_FOUND,
        f"job {job_id!r} does not exist on this daemon (never joined, forgotten after it "
        "ended, or the daemon restarted without --state-dir); a join starts it again",
        {"job_id": job_id},
    )


def forgotten_run(
    refusal: RendezvousFault,
    job: Job,
    generation: int,
    who: int,
    mode: JoinMode,
    started: float,
) -> RendezvousFault:
    """``refusal`` (its code, reason and metadata kept) in words that say the daemon
    forgot the caller's run, for a call naming a seat of ``job`` that no join made of
    this daemon process could have given (``seats.forgotten``), on a daemon that keeps
    no state and started at ``started``: a caller that joined before that start, the
    second node agent after a restart, whose first heard that the job did not exist
    (``no_such_job``) and started it again. Read as a duplicate seat ("belongs to
    another node agent instance"), it said nothing of the restart. Said as what it
    would mean for a caller that joined before the start: a token holder naming a
    seat it never joined anywhere hears the same facts, and a duplicate that joined
    this process is not worded so at all."""
    if generation > job.generation:
        what = (
            f"job {job.job_id!r} is at generation {job.generation}, the call named "
            f"generation {generation}: the job never reached it on this daemon"
        )
        now_is = f"the job now is a new run of it, at generation {job.generation}"
    else:
        seat = f"node_rank={who}" if mode is JoinMode.NODE else f"rank {who}"
        caller = "node agent" if mode is JoinMode.NODE else "worker"
        what = (
            f"{seat} of job {job.job_id!r} generation {generation} was never this "
            f"{caller} instance's: it made no join on this daemon"
        )
        now_is = f"the job's generation {generation} now is a new run of it"
    return RendezvousFault(
        refusal.code,
        refusal.reason,
        f"{what}, which started at {utc_stamp(started)} without --state-dir: if this "
        "caller joined before then, that restart forgot its run (without --state-dir a "
        f"restart forgets every job), and {now_is}, started since by another joiner; join "
        "again to take part",
        refusal.metadata,
    )


#: How much of a failure's cause a refusal as stale carries (its middle cut).
FAILED_SHOWN_CHARS = 1000


def stale_generation(job: Job, generation: int) -> RendezvousFault:
    """The job moved on from ``generation``; where that is the one that failed last,
    what failed it (``failed``): a node dropped from it (its stream cut, its agent
    stopped) was told only that the job moved on."""
    details = {
        "job_id": job.job_id,
        "generation": str(generation),
        "current_generation": str(job.generation),
    }
    failed = ""
    if job.last_failure is not None and job.last_failure.generation == generation:
        details["failed"] = shortened(job.last_failure.cause, FAILED_SHOWN_CHARS)
        failed = f" (generation {generation} failed: {details['failed']})"
    return RendezvousFault(
        Code.ABORTED,
        Reason.STALE_GENERATION,
        f"job {job.job_id!r} is at generation {job.generation}, the call named generation "
        f"{generation}{failed}; rejoin to take part in the current generation",
        details,
    )


def not_a_member(job: Job, generation: int, rank: int) -> RendezvousFault:
    """FAILED_PRECONDITION, as every NOT_A_MEMBER (``left``, ``joined_after_leaving``):
    one reason, one code, for a client that reads either."""
    return RendezvousFault(
        Code.FAILED_PRECONDITION,
        Reason.NOT_A_MEMBER,
        f"rank {rank} is not a member of job {job.job_id!r} generation {generation}; "
        "join again to take part in the job's current generation",
        {"job_id": job.job_id, "generation": str(generation), "ranks": str(rank)},
    )


def not_seated(job: Job, generation: int, who: int, mode: JoinMode) -> RendezvousFault:
    """No such member; for a node agent, no node of that rank this caller holds (its
    instance id is its secret: another agent's node is not told apart from none)."""
    if mode is not JoinMode.NODE:
        return not_a_member(job, generation, who)
    return RendezvousFault(
        Code.ALREADY_EXISTS,
        Reason.DUPLICATE_RANK,
        f"node_rank={who} of job {job.job_id!r} generation {generation} belongs to "
        "another node agent instance (or to none); rejoin to take part",
        {"job_id": job.job_id, "generation": str(generation)},
    )


def holds_no_seat(job: Job, mode: JoinMode) -> RendezvousFault:
    """A Leave for a join given up (``LeaveRequest.given_up``) whose instance holds no
    seat in the job's current generation: never seated, or its seat already gone (its
    generation moved on, its wait ended, it was lost)."""
    joined = "JoinNode" if mode is JoinMode.NODE else "Join"
    return RendezvousFault(
        Code.FAILED_PRECONDITION,
        Reason.NOT_A_MEMBER,
        f"the given-up {joined} of this instance holds no seat in job {job.job_id!r} "
        f"generation {job.generation}: nothing to leave (it was never seated, or its "
        "seat is gone already); join again to take part",
        {"job_id": job.job_id, "generation": str(job.generation)},
    )


def joined_after_leaving(job: Job, seat: Member | Node) -> RendezvousFault:
    """A join of the instance that said goodbye to ``job``'s running generation: a replay
    of its old request (or a retry sent after its Leave). Answered, it got the id of a
    generation it had left; after a restart (no id to give) it was marked LOST without
    failing anything, and its job, one LEFT member short, never ended."""
    if isinstance(seat, Member):
        who, ranks, again = f"rank {seat.rank}", str(seat.rank), "a new worker process"
    else:
        first = job.rank_of(seat.node_rank, 0)
        who = f"the node agent of node_rank={seat.node_rank}"
        ranks, again = f"{first}-{first + job.gpus_per_node - 1}", "a new node agent"
    return job.fault(
        Code.FAILED_PRECONDITION,
        Reason.NOT_A_MEMBER,
        f"{who} on host {seat.host!r} left {job.named} (Leave) and cannot join it again: "
        "this join is a replay of its request from before its goodbye; to take part "
        f"again, start {again}, which joins the job's next generation once this one ends",
        ranks=ranks,
    )


def report_while_forming(job: Job, who: int, mode: JoinMode) -> RendezvousFault:
    """A ReportFailure naming a generation still forming: no member of it runs yet, so
    there is nothing to fail. Recorded, a worker's report left its rank LOST in a
    generation that went on forming, and later named it the root cause of an
    unrelated failure; a node agent's found no node (ranks come as it forms)."""
    seat = f"node_rank={who}" if mode is JoinMode.NODE else f"rank {who}"
    joiner = "JoinNode" if mode is JoinMode.NODE else "Join"
    return job.fault(
        Code.FAILED_PRECONDITION,
        Reason.NOT_RUNNING,
        f"ReportFailure for {seat} of {job.named} refused: the generation is still "
        f"forming, so none of its members runs yet to fail; a joiner that fails before "
        f"it forms ends its {joiner} instead (its process exiting cancels it, which fails "
        f"the forming generation for every joiner), and reports a failure only once its "
        f"{joiner} has returned",
        ranks=str(who),
    )


def rank_stream_in_node_job(job: Job, rank: int) -> RendezvousFault:
    """A worker of a node generation opened a heartbeat stream of its own."""
    return job.fault(
        Code.FAILED_PRECONDITION,
        Reason.JOIN_MODE_MISMATCH,
        f"{job.named}: rank {rank} belongs to a node joined by its node agent, "
        "whose heartbeat covers it; an attached worker does not open a heartbeat "
        "stream of its own (call attach(), not start_heartbeat())",
        rank=str(rank),
    )


def other_instance(job: Job, generation: int, rank: int, instance_id: str) -> RendezvousFault:
    """The caller holds the token but is not the worker that joined as ``rank``."""
    # A call without one comes from an SDK older than member instance ids, whose Join
    # was taken (it sent one there): a rejoin, the other hint, would be refused alike.
    hint = (
        "the call names no instance_id, which SDKs from before member instance ids "
        "(2026-12-01) leave out of their calls after the join: upgrade the worker's "
        "rendezvousd SDK"
        if not instance_id
        else "the caller is not the worker that joined as this rank; rejoin to take part"
    )
    return RendezvousFault(
        Code.ALREADY_EXISTS,
        Reason.DUPLICATE_RANK,
        f"rank {rank} of job {job.job_id!r} generation {generation} belongs to another "
        f"worker instance: {hint}",
        {"job_id": job.job_id, "generation": str(generation), "ranks": str(rank)},
    )
