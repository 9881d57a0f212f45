"""What inspection sees of a job (GetJob, ListJobs, the ``status`` command): read-only snapshots.

Built from the job record on demand, so a view can never drift from the state
it reports, and nothing a caller does with one reaches back into the job.
"""

from __future__ import annotations

from rendezvousd.job import Job
from rendezvousd.model import JobView, MemberState, MemberView


def job_view(job: Job, now: float) -> JobView:
    members = tuple(
        MemberView(
            m.info(),
            m.state,
            # Only an active member's silence means anything; others are not expected to beat.
            max(0.0, now - m.last_seen) if m.state is MemberState.ACTIVE else 0.0,
            m.stream_open,
        )
        for _, m in sorted(job.members.items())
    )
    return JobView(
        job.job_id,
        job.state,
        job.generation,
        job.num_nodes,
        job.gpus_per_node,
        len(job.present()),
        max(0.0, now - job.state_since),
        members,
        tuple(job.failed),
        # Whether an id is held, never the id: views reach logs and the status command.
        job.unique_id is not None,
        len(job.kv),
        job.abort_reason,
    )
