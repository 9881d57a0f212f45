"""What inspection sees of a job (GetJob, ListJobs, the ``status`` command): read-only snapshots.

Built from the job record on demand, so a view can never drift from the state
it reports, and nothing a caller does with one reaches back into the job.
"""

from __future__ import annotations

import hashlib

from rendezvousd.common import grid
from rendezvousd.common.model import JobState, JobView, JoiningNode, JoinMode, MemberView
from rendezvousd.state import placement
from rendezvousd.state.job import Attendee, Job, Member
from rendezvousd.state.liveness import members_present, watched


def instance_tag(instance_id: str) -> str:
    """What inspection shows of a seat's instance id: the first 8 hex digits of its
    SHA-256, which tells two agents of one host apart. The id itself is the seat's
    secret (its calls name it to prove they are its own), never shown."""
    return hashlib.sha256(instance_id.encode()).hexdigest()[:8]


def _beating(job: Job, rank: int, member: Attendee) -> Attendee:
    """Whose heartbeat keeps ``rank`` alive: in a node job its node agent's (nodes
    heartbeat, ranks do not), else the member's own."""
    if job.gen.node_at and job.gpus_per_node:
        node = job.gen.node_at.get(rank // job.gpus_per_node)
        if node is not None:
            return node
    return member


def _step(beating: Attendee, member: Member) -> int | None:
    """``member``'s last step from its stream's progress (a node's by local rank)."""
    progress = beating.progress
    if progress is None:
        return None
    at = 0 if beating is member else member.local_rank
    return progress.steps[at] if at < len(progress.steps) else None


def _loss_pending(job: Job, member: Member, beating: Attendee) -> str:
    """The cause of ``member``'s loss kept while storage fails (``Attendee.lost_as``):
    it is dead, yet ACTIVE until its loss is made; "" for any other."""
    if not watched(job, member) or beating.stream_open or beating.lost_as is None:
        return ""
    return beating.lost_as


def job_view(job: Job, now: float, *, with_members: bool = True) -> JobView:
    """``job`` as inspection shows it; without ``with_members``, a summary (no member
    rows, the cost of which grows with the world: ListJobs shows only counts)."""
    members = []
    for r, m in sorted(job.gen.members.items()) if with_members else ():
        beating = _beating(job, r, m)
        step = _step(beating, m)
        members.append(
            MemberView(
                m.info(),
                m.state,
                # Only a watched member's silence means anything (an active one of a
                # running generation); others are not expected to beat.
                max(0.0, now - beating.last_seen) if watched(job, m) else 0.0,
                beating.stream_open,
                step,
                _loss_pending(job, m, beating),
            )
        )
    # Restart budgets are node agents' (a per-rank worker has none to report).
    by_node = job.gen.join_mode is JoinMode.NODE
    nodes = job.gen.node_at.values() if by_node else ()
    budgets = [n.progress for n in nodes if n.progress is not None]
    # Node agents parked to join: for the next generation (scale-up), or this one.
    parked = set(job.scaleup_waiters.values()) | (
        set(job.gen.join_waiters.values()) if by_node else set()
    )
    forming = by_node and job.state is JobState.FORMING
    missing = placement.missing_node_ranks(job) if forming else None
    return JobView(
        job.job_id,
        job.state,
        job.generation,
        job.num_nodes,
        job.gpus_per_node,
        members_present(job),
        max(0.0, now - job.state_since),
        tuple(members),
        tuple(job.gen.failed),
        # Whether an id is held, never the id: views reach logs and the status command.
        job.gen.unique_id is not None,
        len(job.gen.kv),
        job.gen.abort_reason,
        len(parked),
        job.standby_count,
        max((p.restarts_used for p in budgets), default=None),
        min((max(0, p.max_restarts - p.restarts_used) for p in budgets), default=None),
        grid.job_step(((m.state, m.step) for m in members), ended=job.state is JobState.ENDED),
        # A seat claimed by host alone is kept still: its holder may take it back.
        (kept := placement.kept_for_others(job, now) + len(job.gen.by_host)),
        max(0.0, job.gen.owed_until - now) if kept else 0.0,
        (
            max(0.0, now - job.gen.after_end)
            if job.gen.after_end is not None and job.state is JobState.FORMING
            else None
        ),
        "" if job.gen.conflict is None else job.gen.conflict.message,
        job.last_failure,
        job.failures,
        tuple(
            JoiningNode(
                n.node_rank if n.named else None,
                n.host,
                instance_tag(n.instance_id),
                max(0.0, now - n.arrived),
            )
            for n in (job.gen.nodes.values() if forming and with_members else ())
        ),
        None if missing is None else tuple(missing),
        placement.nodes_needed(job) if forming else 0,
        job.min_nodes if by_node else 0,
    )
