"""Parked calls: the record of one, and what a Join or KvGet is told when its deadline passes.

``RendezvousState`` parks, wakes and cancels the calls; a barrier's timeout is
worded by ``barriers.timed_out``, next to the rounds it reports on.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from rendezvousd.common.escape import quoted
from rendezvousd.common.model import JoinMode
from rendezvousd.errors import Code, Reason, RendezvousFault, ranks_text
from rendezvousd.state.barriers import short_ranks
from rendezvousd.state.job import Job


class WaitKind(enum.Enum):
    """What a parked call waits for."""

    JOIN = enum.auto()  # a Join, PublishId or JoinNode: its generation to form
    SCALEUP = enum.auto()  # a JoinNode: the running generation to end
    BARRIER = enum.auto()
    KV = enum.auto()  # a KvGet: its key


@dataclass(frozen=True)
class Waiter:
    job_id: str
    # A wait belongs to one generation: its cancel after the next one opened changes nothing.
    generation: int
    kind: WaitKind
    rank: int
    key: str = ""  # barrier name or KV key
    since: float = 0.0


def world_incomplete(job: Job, waited: str) -> RendezvousFault:
    """A join's deadline passed before its generation formed: it names who is missing
    (a worker's: the ranks; a node agent's: how many nodes, and node 0's id)."""
    if job.gen.join_mode is JoinMode.NODE:
        hosts = sorted({n.host for n in job.gen.nodes.values()})
        return job.fault(
            Code.DEADLINE_EXCEEDED,
            Reason.WORLD_INCOMPLETE,
            f"{job.named}: {len(job.gen.nodes)} node(s) joined after {waited}, the generation "
            f"needs min_nodes={job.min_nodes}"
            + ("" if job.gen.unique_id is not None or not job.gen.nodes else " and node 0's id")
            + "; start the missing node agents or lower --nnodes",
            hosts=",".join(hosts),
        )
    missing = job.missing_ranks()
    zero = job.gen.members.get(0)
    if not missing and zero is not None and job.gen.unique_id is None:
        # Every rank is in: what the generation lacks is rank 0's id.
        return job.fault(
            Code.DEADLINE_EXCEEDED,
            Reason.WORLD_INCOMPLETE,
            f"{job.named}: rank 0 joined but never published the id (rank 0 on "
            f"{zero.host} was told id_required and sent no PublishId; all "
            f"{job.world_size} ranks are in after {waited}): check why rank 0's worker "
            "stopped before publishing, or restart it",
            ranks="0",
        )
    return job.fault(
        Code.DEADLINE_EXCEEDED,
        Reason.WORLD_INCOMPLETE,
        f"{job.named}: {job.world_size - len(missing)} of {job.world_size} ranks joined after "
        f"{waited}; missing ranks {short_ranks(missing)}",
        ranks=ranks_text(missing[:64]),
    )


def key_wait_timeout(job: Job, key: str, waiter: int, waited: str) -> RendezvousFault:
    """Forgets ``waiter``'s wait for ``key``; the fault saying the key never came."""
    waiting = job.gen.kv_waiters.get(key)
    if waiting is not None:
        waiting.discard(waiter)
        if not waiting:
            del job.gen.kv_waiters[key]
    return job.fault(
        Code.DEADLINE_EXCEEDED,
        Reason.KEY_WAIT_TIMEOUT,
        f"key {quoted(key)} of job {job.job_id!r} was not set within {waited}",
    )
