"""Parked calls: the record of one, and what a Join or KvGet is told when its deadline passes.

``RendezvousState`` parks, wakes and cancels the calls; a barrier's timeout is
worded by ``barriers.timed_out``, next to the rounds it reports on.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from rendezvousd.common.escape import escape, quoted
from rendezvousd.common.model import JoinMode
from rendezvousd.errors import Code, Reason, RendezvousFault, ranks_text
from rendezvousd.state import placement
from rendezvousd.state.barriers import short_ranks
from rendezvousd.state.job import EndedWait, Job, Node


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


def world_incomplete(job: Job, waited: str, now: float) -> RendezvousFault:
    """A join's deadline passed before its generation formed: it names who joined and
    who is missing (a worker's: the ranks; a node agent's: the nodes joined by rank and
    host, and the node ranks no node took, or how many more it needs), and the joiners
    that came but whose own wait ended first, so that none of them reads as missing."""
    ended = _ended_waits(job)
    if job.gen.join_mode is JoinMode.NODE:
        return _nodes_incomplete(job, waited, now, ended)
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
    came = [e for e in ended if e.rank is not None and e.rank in set(missing)]
    return job.fault(
        Code.DEADLINE_EXCEEDED,
        Reason.WORLD_INCOMPLETE,
        f"{job.named}: {job.world_size - len(missing)} of {job.world_size} ranks joined after "
        f"{waited}; missing ranks {short_ranks(missing)}" + _came_too(came, now),
        ranks=ranks_text(missing[:64]),
    )


def _ended_waits(job: Job) -> list[EndedWait]:
    """The generation's ended waits whose seat was not taken again since."""
    return [e for key, e in job.gen.ended_waits.items() if job.seat(key) is None]


def _came_too(ended: list[EndedWait], now: float) -> str:
    """The joiners that came but whose own wait ended before this one's: not missing."""
    if len(ended) == 1:
        e = ended[0]
        return (
            f"; {e.seat} on {escape(e.host)} joined too, but its own wait ended at its "
            f"deadline {now - e.at:.3f} s before this one, before the generation formed"
        )
    if not ended:
        return ""
    named = ", ".join(
        f"{e.seat} on {escape(e.host)} ({now - e.at:.3f} s before this one)" for e in ended[-NAMED:]
    )
    more = f" and {len(ended) - NAMED} more" if len(ended) > NAMED else ""
    return (
        "; these joined too, but their own waits ended at their deadlines before the "
        f"generation formed: {named}{more}"
    )


#: How many nodes (or ended waits) a message names; the rest are counted.
NAMED = 8


def node_list(nodes: list[Node]) -> str:
    """Nodes as a message names them: "node 0 on n0, node 2 on n2", or "a node on n1"
    for one that named no rank yet; the first ``NAMED``, the rest counted."""
    said = ", ".join(
        f"{f'node {n.node_rank}' if n.named else 'a node'} on {escape(n.host)}"
        for n in nodes[:NAMED]
    )
    return said + (f" and {len(nodes) - NAMED} more" if len(nodes) > NAMED else "")


def _nodes_incomplete(job: Job, waited: str, now: float, ended: list[EndedWait]) -> RendezvousFault:
    nodes = list(job.gen.nodes.values())
    most = "" if job.min_nodes == job.max_nodes else f" (up to {job.max_nodes})"
    said = (
        f"{job.named} did not form within {waited}: {len(nodes)} node(s) joined of the "
        f"min_nodes={job.min_nodes}{most} it needs"
    )
    said += f" ({node_list(nodes)})" if nodes else ""
    said += _came_too(ended, now)
    missing = placement.missing_node_ranks(job)
    if missing is not None:
        ended_ranks = {e.rank for e in ended}
        never = [r for r in missing if r not in ended_ranks]
    short = max(0, placement.nodes_needed(job) - len(ended))
    if missing is not None and never:
        ranks = ", ".join(str(r) for r in never[:16]) + (", ..." if len(never) > 16 else "")
        them = "it" if len(never) == 1 else "them"
        said += (
            f"; no node agent joined as node {ranks}: start {them} (rendezvous-run "
            f"--node-rank {ranks}) or lower --nnodes"
        )
    elif missing is None and short:
        said += (
            f"; {short} more node(s) never joined: start the missing node agents or lower --nnodes"
        )
    elif ended:
        # Every node came, but not while the others still waited. Which flag set the
        # wait that ran out, the daemon cannot tell (rendezvous-run's first join waits
        # --join-timeout-s, one after a failure --rejoin-timeout-s): name both.
        said += (
            "; every node the job needs came, but not within one another's waits: start "
            f"them within one wait ({waited} here) of each other, or raise it "
            "(rendezvous-run: --join-timeout-s for a node's first join, --rejoin-timeout-s "
            "after a failure)"
        )
    else:
        said += "; start the missing node agents or lower --nnodes"
    head = placement.holder(job)
    if job.gen.unique_id is None and head is not None:
        # The seat holding rank 0 was asked for the id and has not sent it.
        said += f"; node 0 (on {escape(head.host)}) has not sent its id yet"
    hosts = sorted({n.host for n in nodes})
    extra = {} if missing is None else {"missing_node_ranks": ranks_text(missing[:64])}
    return job.fault(
        Code.DEADLINE_EXCEEDED,
        Reason.WORLD_INCOMPLETE,
        said,
        hosts=",".join(hosts),
        **extra,
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
