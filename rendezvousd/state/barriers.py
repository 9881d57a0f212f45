"""Barrier rounds: who must arrive, the checks on an arrival, and the timeout's fault.

Pure functions over one job's ``BarrierState``s; ``RendezvousState`` parks and
wakes the calls.
"""

from __future__ import annotations

from rendezvousd.common import validation
from rendezvousd.common.limits import Limits
from rendezvousd.common.model import MemberState
from rendezvousd.errors import Code, Reason, RendezvousFault, ranks_text
from rendezvousd.state import fences
from rendezvousd.state.job import BarrierState, Job, Member


def enter(
    job: Job, member: Member, name: str, sequence: int, limits: Limits
) -> tuple[BarrierState, bool]:
    """The barrier ``member`` enters, and whether round ``sequence`` is already past.

    Raises when the name is invalid, a new name would exceed ``max_barriers_per_job``,
    the caller skipped or repeated a round, or it already left.
    """
    validation.text_field("barrier name", name, limits.max_key_bytes, required=True)
    rank = member.rank
    barrier = job.gen.barriers.get(name)
    if barrier is None:
        if len(job.gen.barriers) >= limits.max_barriers_per_job:
            raise validation.limit_exceeded(
                "max_barriers_per_job",
                f"{job.named} already has max_barriers_per_job={limits.max_barriers_per_job} "
                "barrier names; reuse names (each is a sequence of rounds) instead of a new name "
                "per round",
                job_id=job.job_id,
            )
        barrier = job.gen.barriers[name] = BarrierState()
    if sequence <= barrier.completed:
        return barrier, True
    if sequence != barrier.completed + 1:
        raise job.fault(
            Code.FAILED_PRECONDITION,
            Reason.BARRIER_MISMATCH,
            f"rank {rank} entered barrier {name!r} #{sequence} but job {job.job_id!r} is at "
            f"#{barrier.completed + 1}; every rank must run the same barriers in the same order",
            ranks=str(rank),
        )
    if member.state is MemberState.LEFT:
        raise left(job, rank, name)
    return barrier, False


def left(job: Job, rank: int, name: str) -> RendezvousFault:
    """The fault of rank ``rank``'s call at barrier ``name`` once it left the job."""
    return fences.left(job, rank, f"it takes no part in barrier {name!r} any more")


def release(barrier: BarrierState) -> list[int]:
    """Completes the current round; the waiters to wake with ``barrier.completed``."""
    barrier.completed += 1
    waiters = [w for ws in barrier.arrived.values() for w in ws]
    barrier.arrived.clear()
    return waiters


def timed_out(job: Job, name: str, rank: int, waiter: int, waited: str) -> RendezvousFault:
    """Forgets ``waiter``'s arrival; the fault naming the ranks still missing."""
    barrier = job.gen.barriers.get(name)
    if barrier is not None:
        ws = barrier.arrived.get(rank, set())
        ws.discard(waiter)
        if not ws:
            barrier.arrived.pop(rank, None)
        missing = sorted(job.participants() - set(barrier.arrived) - {rank})
    else:
        missing = []
    return job.fault(
        Code.DEADLINE_EXCEEDED,
        Reason.BARRIER_TIMEOUT,
        f"barrier {name!r} of {job.named} timed out on rank {rank} after {waited}; still "
        f"waiting for ranks {short_ranks(missing)}",
        ranks=ranks_text(missing[:64]),
    )


def short_ranks(ranks: list[int], limit: int = 16) -> str:
    shown = ", ".join(str(r) for r in ranks[:limit])
    return f"[{shown}{', ...' if len(ranks) > limit else ''}] ({len(ranks)} total)"
