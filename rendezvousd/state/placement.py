"""Where a joiner goes: the Join request's checks, its node rank, rank 0's id, Join's answers.

Pure functions over one job. ``RendezvousState`` decides whether a joiner is
admitted, parks it, starts the generation and fails it; this module only places
a joiner in the world (or frees its rank again) and words what a Join is told.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from rendezvousd.common import validation
from rendezvousd.common.limits import Limits
from rendezvousd.common.model import JobState, JoinResult, MemberState, seat_of
from rendezvousd.errors import Code, Reason, RendezvousFault
from rendezvousd.state.job import Job, Member


@dataclass(frozen=True)
class JoinArgs:
    job_id: str
    num_nodes: int
    gpus_per_node: int
    node_rank: int | None
    local_rank: int
    host: str
    address: str
    unique_id: bytes
    instance_id: str
    # How long this Join may wait (0: the daemon's default). Rank 0 answered
    # id_required holds its rank this long at most without publishing the id.
    wait_s: float = 0.0


def check(args: JoinArgs, limits: Limits) -> None:
    """Refuses a malformed request before it can create or touch a job."""
    validation.job_id(args.job_id)
    validation.topology(args.num_nodes, args.gpus_per_node, limits)
    validation.text_field("host", args.host, limits.max_host_bytes, required=True)
    validation.text_field("address", args.address, limits.max_host_bytes, required=False)
    validation.text_field("instance_id", args.instance_id, 128, required=True)
    if args.unique_id:
        validation.unique_id(args.unique_id)
    validation.rank_in_range(
        "local_rank", args.local_rank, "gpus_per_node", args.gpus_per_node, job_id=args.job_id
    )
    if args.node_rank is not None:
        validation.rank_in_range(
            "node_rank", args.node_rank, "num_nodes", args.num_nodes, job_id=args.job_id
        )


def rejoin_of_current(job: Job, args: JoinArgs) -> bool:
    """A retried Join of a member whose generation already ended stays fenced."""
    return any(m.instance_id == args.instance_id for m in job.gen.members.values()) and (
        job.state is not JobState.ENDED
    )


def node_rank(job: Job, args: JoinArgs) -> int:
    """The joiner's node: the one it named, else its host's, else the first free one."""
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


def duplicate_rank(
    job: Job, args: JoinArgs, rank: int, node: int, holder: Member
) -> RendezvousFault:
    """Another worker instance already holds the rank this joiner was placed on."""
    return job.fault(
        Code.ALREADY_EXISTS,
        Reason.DUPLICATE_RANK,
        f"rank {rank} (node_rank={node}, local_rank={args.local_rank}) of job "
        f"{args.job_id!r} is already held by a worker on {holder.host}; give each worker "
        "a distinct (node_rank, local_rank)",
        ranks=str(rank),
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


def accept_id(job: Job, rank: int, unique_id: bytes) -> None:
    """Takes rank 0's id for the generation, or raises why it cannot be used."""
    if rank != 0:
        raise validation.invalid(
            Reason.INVALID_ID,
            f"only global rank 0 supplies the unique id; this worker is rank {rank}",
            job_id=job.job_id,
        )
    digest = hashlib.sha256(unique_id).digest()
    if job.gen.unique_id == unique_id:
        return
    if job.gen.unique_id is None and job.gen.restored_id_digest == digest:
        # Restored after a restart with only the digest: a replay of the same id
        # (e.g. a PublishId retried across the restart) is accepted, nothing else.
        job.gen.unique_id = unique_id
        return
    if job.id_digest() is not None:
        raise job.fault(
            Code.ALREADY_EXISTS,
            Reason.ID_CONFLICT,
            f"{job.named} already has a different unique id; the first one is kept",
        )
    if digest in job.used_id_digests:
        raise validation.invalid(
            Reason.ID_REUSED,
            f"this unique id was already used by an earlier generation of job {job.job_id!r}; "
            "every generation needs a fresh id",
            job_id=job.job_id,
        )
    job.gen.unique_id = unique_id


def result(job: Job, member: Member) -> JoinResult:
    """A running generation's answer: the id and the member table."""
    assert job.gen.unique_id is not None
    return JoinResult(
        **_seat(job, member),
        id_required=False,
        unique_id=job.gen.unique_id,
        members=job.gen.member_table,
    )


def id_required(job: Job, member: Member) -> JoinResult:
    """Rank 0's answer while the generation has no id: create one and PublishId it."""
    return JoinResult(**_seat(job, member), id_required=True, unique_id=b"", members=())


def _seat(job: Job, member: Member) -> dict[str, Any]:
    return seat_of(job, rank=member.rank, node_rank=member.node_rank, local_rank=member.local_rank)


def unplace(job: Job, rank: int, now: float) -> None:
    """A joiner gave up before the world was complete: free its rank."""
    if job.state is not JobState.FORMING or rank in job.gen.join_waiters.values():
        return  # a retry of the same join is still waiting for the rank
    member = job.gen.members.pop(rank, None)
    if member is None:
        return
    if not any(m.host == member.host for m in job.gen.members.values()):
        job.gen.host_nodes.pop(member.host, None)
    if rank == 0 and job.gen.unique_id is not None:
        # rank 0's process (and the listener behind its id) may be gone.
        job.remember_id()
        job.gen.unique_id = None
    if not job.gen.members:
        job.state_since = now
