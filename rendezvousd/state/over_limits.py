"""What restored jobs hold beyond the limits this daemon now runs with, in the words its
start-up log says. A restart with lower limits (or a release that adds one) restores
every job as it was and drops nothing; each limit then applies only to what grows, so
the operator hears at start what will be refused later. Pure: no I/O, no logging."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from rendezvousd.common.limits import Limits
from rendezvousd.state.job import Job
from rendezvousd.state.rounds import idle

#: Jobs over a limit said one line each up to this many; beyond, one summary line
#: (a restart with a much lower limit must not print a line per job of thousands).
NAMED_JOBS = 8


def _job_overs(job: Job, limits: Limits) -> list[tuple[str, str]]:
    """The per-job limits ``job`` holds more than: each limit's name, and what it holds
    over it with what a later call meets."""
    overs = []
    keys = len(job.gen.kv)
    if keys > limits.max_keys_per_job:
        overs.append(
            (
                "max_keys_per_job",
                f"{keys} keys, over max_keys_per_job={limits.max_keys_per_job} (a new key is "
                "refused until it deletes keys)",
            )
        )
    cap = limits.kv_bytes_per_job
    if job.gen.kv_bytes > cap:
        overs.append(
            (
                "max_kv_bytes_per_job",
                f"{job.gen.kv_bytes} key-value bytes, over the {cap} one job may now hold "
                "(max_kv_bytes_per_job, at most half of max_kv_bytes; a write that grows it is "
                "refused until it deletes keys)",
            )
        )
    if job.world_size > limits.max_members_per_job:
        overs.append(
            (
                "max_members_per_job",
                f"a world of {job.world_size} ranks, over max_members_per_job="
                f"{limits.max_members_per_job} (its generation goes on; a join of that world "
                "size, its next generation's, is refused)",
            )
        )
    return overs


def over_limits(jobs: Mapping[str, Job], limits: Limits) -> list[str]:
    """The warnings for ``jobs`` as restored under ``limits``: one line per job over a
    per-job limit (one summary line when more than ``NAMED_JOBS`` are), and one when
    there are more live jobs than ``max_jobs``. Empty when everything fits."""
    lines = []
    over = [(job, overs) for job in jobs.values() if (overs := _job_overs(job, limits))]
    keep = "it keeps them; restart with the limit raised, or let the job end"
    if len(over) <= NAMED_JOBS:
        for job, overs in over:
            said = "; ".join(text for _, text in overs)
            lines.append(f"job {job.job_id!r} holds {said}: {keep}")
    else:
        named = ", ".join(repr(job.job_id) for job, _ in over[:NAMED_JOBS])
        lines.append(
            f"{len(over)} restored jobs hold more than the limits now allow ("
            f"{_counts(overs for _, overs in over)}): jobs {named} and "
            f"{len(over) - NAMED_JOBS} more; they keep it; restart with the limits raised, "
            "or let the jobs end (`rendezvousd status` lists them)"
        )
    # Only live jobs fill max_jobs: a restored finished one gives its slot to a new job.
    live = sum(1 for job in jobs.values() if not idle(job))
    if live > limits.max_jobs:
        lines.append(
            f"restored {live} live jobs, over max_jobs={limits.max_jobs}: every one is kept, "
            f"and no new job can start until fewer than {limits.max_jobs} remain live "
            "(forming with a joiner present, or running); restart with a larger --max-jobs "
            "to start new ones meanwhile"
        )
    return lines


def _counts(overs: Iterable[list[tuple[str, str]]]) -> str:
    """How many jobs are over each limit, by the limit's name."""
    counts: dict[str, int] = {}
    for job_overs in overs:
        for name, _ in job_overs:
            counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{n} over {name}" for name, n in counts.items())
