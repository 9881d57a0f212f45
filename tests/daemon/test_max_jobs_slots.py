"""Only live jobs fill max_jobs: a new job takes the slot of the oldest finished job (or
of a forming one nobody is in), which is forgotten early, as its TTL would forget it.
A busy daemon kept every finished job for --job-ttl-s and refused new ones while
almost nothing ran (an SRE review: 1 running, 904 ended or failed, 18,903 refusals)."""

from __future__ import annotations

from rendezvousd.common.limits import Limits, Timing
from rendezvousd.common.model import FORGOTTEN, JobState, Parked, Transition
from rendezvousd.errors import Code
from rendezvousd.state.machine import RendezvousState
from tests.daemon.test_node_state import join_first, node
from tests.daemon.test_state_machine import args, fault, form, inst


def _ended(sm: RendezvousState, job: str, at: float) -> None:
    """A one-rank job that ran and ended (its member left) at ``at``."""
    result = form(sm, nodes=1, gpus=1, job=job)[0]
    sm.leave(job, result.generation, 0, inst(sm, 0, job), at)
    assert sm.jobs[job].state is JobState.ENDED


def _forgotten(sm: RendezvousState) -> list[Transition]:
    return [e for e in sm.take_effects() if isinstance(e, Transition) and e.new is None]


def test_a_new_job_takes_the_slot_of_the_oldest_finished_job() -> None:
    sm = RendezvousState(Limits(max_jobs=3))
    _ended(sm, "old", 1.0)
    _ended(sm, "newer", 2.0)
    form(sm, nodes=1, gpus=1, job="runs")
    sm.take_effects()
    # Before: LIMIT_EXCEEDED max_jobs until "old" and "newer" reached their TTL (600 s).
    assert isinstance(sm.join(args(0, 1, job="new", nodes=1, gpus=2), 3.0), Parked)
    assert set(sm.jobs) == {"newer", "runs", "new"}
    [gone] = _forgotten(sm)
    assert (gone.job_id, gone.old) == ("old", JobState.ENDED)
    # Recorded as the job's end (job tokens, job_ends), said at INFO with why.
    assert gone.detail.startswith(FORGOTTEN) and "early" in gone.detail
    assert "max_jobs=3 slot went to new job 'new'" in gone.detail, gone.detail


def test_live_jobs_fill_max_jobs_and_the_refusal_says_so() -> None:
    sm = RendezvousState(Limits(max_jobs=2))
    form(sm, nodes=1, gpus=1, job="runs")
    assert isinstance(sm.join(args(0, 1, job="forms", nodes=1, gpus=2), 0.0), Parked)
    f = fault(sm.join, args(0, 0, job="new", nodes=1, gpus=1), 1.0)
    assert (f.code, f.metadata["limit"]) == (Code.RESOURCE_EXHAUSTED, "max_jobs")
    assert "holds max_jobs=2 live jobs (forming with a joiner present, or running)" in f.message
    assert "--max-jobs" in f.message
    assert set(sm.jobs) == {"runs", "forms"}


def test_a_forming_job_nobody_is_in_takes_no_slot() -> None:
    sm = RendezvousState(Limits(max_jobs=1))
    parked = sm.join(args(0, 1, job="given-up", nodes=1, gpus=2), 0.0)
    assert isinstance(parked, Parked)
    sm.cancel_wait(parked.waiter, 5.0, timed_out=True)  # its joiner gave up: 0 present
    job = sm.jobs["given-up"]
    assert job.state is JobState.FORMING and not job.present()
    assert isinstance(sm.join(args(0, 1, job="new", nodes=1, gpus=2), 6.0), Parked)
    assert set(sm.jobs) == {"new"}
    [gone] = _forgotten(sm)
    assert (gone.job_id, gone.old) == ("given-up", JobState.FORMING)


def test_a_node_launched_for_a_run_forgotten_early_is_still_told_it_ended() -> None:
    """What the job's TTL kept it for: a node agent launched before its run ended,
    joining late, hears JOB_ENDED (and exits 0), not a new run of the job id it would
    wait join_timeout in."""
    sm = RendezvousState(Limits(max_jobs=1), Timing(job_ttl_s=600.0))
    join_first(sm, node("a", lo=1, hi=1, job="done"), 0.0)
    job = sm.jobs["done"]
    assert job.state is JobState.RUNNING
    member = next(iter(job.gen.nodes.values()))
    sm.leave("done", job.generation, 0, member.instance_id, 10.0, mode=job.gen.join_mode)
    assert sm.jobs["done"].state is JobState.ENDED
    assert isinstance(sm.join(args(0, 1, job="other", nodes=1, gpus=2), 11.0), Parked)
    assert "done" not in sm.jobs
    late = fault(sm.join, node("b", lo=1, hi=1, job="done", launched=5.0), 12.0)
    assert late.reason == "JOB_ENDED" and "ended 2.0 s ago" in late.message, late.message
    # A node launched after the end is a new run of the job id (here: refused only for
    # the slot, which "other" holds live).
    after = fault(sm.join, node("c", lo=1, hi=1, job="done", launched=10.5), 12.0)
    assert after.metadata.get("limit") == "max_jobs"
    # Past the TTL it would have had, a join of its id is a new run, as it would be.
    sm.tick(700.0)
    assert "done" not in sm.early_ends


def test_a_job_with_a_parked_call_or_a_closed_run_keeps_its_slot() -> None:
    sm = RendezvousState(Limits(max_jobs=1))
    result = form(sm, nodes=1, gpus=1, job="closed")[0]
    sm.abort("closed", result.generation, "operator closed it", 1.0, close=True)
    assert sm.jobs["closed"].state is JobState.ABORTED
    f = fault(sm.join, args(0, 0, job="new", nodes=1, gpus=1), 2.0)
    assert f.metadata["limit"] == "max_jobs"
    assert set(sm.jobs) == {"closed"}
