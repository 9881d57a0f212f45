"""What an operator reads of failures, from a real in-process daemon: its metrics (its
registry), its log, GetJob and ``rendezvousd status``. Each test names the defect of an
observability review it pins (the gauge of a dead job's survivor, a restart counted as
failures, a failure nobody was told of left uncounted, a stale members gauge, failure
history lost at a restart, a join a running job refused leaving no trace)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rendezvousd.cli.probe import render, render_job
from rendezvousd.client import AsyncRendezvousClient, RendezvousError
from rendezvousd.common.model import SCALE_UP_REASON, JobFailure, JobState, Progress, Warn
from rendezvousd.config import DaemonConfig
from rendezvousd.daemon import Daemon
from rendezvousd.errors import RendezvousFault
from rendezvousd.state.machine import JoinArgs, RendezvousState
from rendezvousd.state.rounds import REFUSAL_LOG_S
from tests.support import InProcessDaemon


@contextlib.asynccontextmanager
async def daemon_on(state_dir: Path | None = None) -> AsyncIterator[InProcessDaemon]:
    token = secrets.token_urlsafe(32)
    server = Daemon(
        DaemonConfig(listen="127.0.0.1:0", heartbeat_timeout_s=3.0, state_dir=state_dir),
        [token],
    )
    port = await server.start()
    try:
        yield InProcessDaemon(server, f"127.0.0.1:{port}", token)
    finally:
        await server.stop(grace=0)


def sample(d: InProcessDaemon, name: str, **labels: str) -> float | None:
    return d.server.metrics.registry.get_sample_value(name, labels)


def tick_gauges(d: InProcessDaemon, later_s: float = 0.0) -> None:
    """The tick's gauges as a tick ``later_s`` from now would set them."""
    d.server.metrics.observe_tick(d.server.state, time.monotonic() + later_s)


async def two_ranks(d: InProcessDaemon, job: str) -> list[AsyncRendezvousClient]:
    clients = [d.client(job) for _ in range(2)]
    for c in clients:
        await c.connect()
    await asyncio.gather(
        *(
            c.join(num_nodes=1, gpus_per_node=2, node_rank=0, local_rank=r, timeout=10)
            for r, c in enumerate(clients)
        )
    )
    for c in clients:
        c.start_heartbeat(0.2)
    await d.until("both streams", lambda: sample(d, "rendezvousd_heartbeat_streams") == 2)
    return clients


async def test_a_failed_jobs_survivor_is_not_a_late_heartbeat_nor_a_member() -> None:
    """Rank 1 fails; rank 0 hears it and closes without a goodbye (an SDK ``with``
    block ended by the error). It stayed ACTIVE: the heartbeat gauge climbed for the
    job's TTL (RendezvousdHeartbeatsLate fired for a dead job), the members gauge
    counted it, and ``status`` showed it ACTIVE with a growing heartbeat age."""
    async with daemon_on() as d:
        survivor, failing = await two_ranks(d, "stale")
        await failing.report_failure(1, "RuntimeError: boom")
        await survivor.close()
        await failing.close()
        assert d.view("stale").state.name == "FAILED"
        tick_gauges(d, later_s=60.0)
        assert sample(d, "rendezvousd_heartbeat_age_max_seconds") == 0.0
        assert sample(d, "rendezvousd_members") == 0
        async with d.client("stale") as probe:
            job = await probe.get_job()
        text = render([job])
        assert "ACTIVE (job failed)" in text and "heartbeat -" in text, text
        assert "heartbeat 0.0s" not in text, text  # the lost rank's row too
        assert "LOST" in text


async def test_a_failed_jobs_survivor_still_attached_is_present_on_no_surface() -> None:
    """Rank 1 fails; rank 0 stays attached (its stream open, no goodbye yet). The members
    gauge (``liveness.live_members``) counted it 0, while GetJob/ListJobs'
    ``members_present``, ``rendezvousd status``'s PRESENT and the status page's members
    and nodes counted 1 (the view used ``Job.present()``, another rule)."""
    from rendezvousd.server.scope import ADMIN
    from rendezvousd.web.status_page import StatusPage

    async with daemon_on() as d:
        survivor, failing = await two_ranks(d, "dead")
        await failing.report_failure(1, "RuntimeError: boom")
        await failing.close()
        assert d.view("dead").state.name == "FAILED"
        # The survivor: still a member of the failed generation (it said no goodbye).
        assert d.view("dead").members[0].state.name == "ACTIVE"
        tick_gauges(d)
        assert sample(d, "rendezvousd_members") == 0
        assert d.view("dead").members_present == 0
        async with d.client("dead") as probe:
            (summary,) = await probe.list_jobs()
            job = await probe.get_job()
        assert summary.members_present == 0 and job.summary.members_present == 0
        row = render([job]).splitlines()[1].split()
        assert row[:2] == ["dead", "FAILED"] and row[4] == "0", row
        page = StatusPage(
            d.server.state,
            d.server.metrics,
            d.server.timeline,
            lambda _: None,
            lambda *_: asyncio.sleep(0, 0),
            secure_cookie=False,
        )
        (shown,) = page.overview(ADMIN)["jobs"]
        assert (shown["members_present"], shown["nodes_present"]) == (0, 0), shown
        await survivor.close()


async def test_the_members_gauge_follows_a_leave_without_a_transition() -> None:
    """It was set only when a job changed state: a member that left a running job
    (no transition) stayed counted."""
    async with daemon_on() as d:
        staying, leaving = await two_ranks(d, "leaver")
        assert sample(d, "rendezvousd_members") == 2
        await leaving.leave()
        await d.until("the rank LEFT", lambda: d.view("leaver").members_present == 1)
        tick_gauges(d)
        assert sample(d, "rendezvousd_members") == 1
        await staying.leave()
        await leaving.close()
        await staying.close()


async def test_a_failure_nobody_is_told_of_is_counted() -> None:
    """failures_detected counted a pushed PEER_FAILED, not a generation failed by a
    loss: a single-rank job's failure (nobody to tell) was never counted, while
    job_transitions_total{failed} was."""
    async with daemon_on() as d:
        async with d.client("one") as c:
            await c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
            await c.report_failure(0, "CUDA error: an illegal memory access")
        assert sample(d, "rendezvousd_job_transitions_total", state="failed") == 1
        assert sample(d, "rendezvousd_failures_detected_total") == 1


async def test_a_transition_a_failed_commit_undid_is_not_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ReportFailure fails the running generation, and the commit carrying it fails (a
    full disk, injected through the real Persister and SQLite): the undo puts the job
    back RUNNING, yet job_transitions_total{failed} and failures_detected had counted the
    failure (applied before the commit), and the undo's own put-back counted a second
    {running}: RendezvousdJobsFailingRepeatedly saw failures that never stood."""
    import sqlite3

    async with daemon_on(tmp_path / "state") as d:
        staying, failing = await two_ranks(d, "undo")
        assert sample(d, "rendezvousd_job_transitions_total", state="running") == 1
        store = d.server.persister.store
        assert store is not None
        written = store.write

        def full_disk(*_: object, **__: object) -> bool:
            raise sqlite3.OperationalError("database or disk is full")

        # Joins whose commit failed are no completed joins: rank 1's, which formed the
        # generation, and rank 0's PublishId it woke.
        joins = sample(d, "rendezvousd_joins_total")
        first, second = d.client("undone-join"), d.client("undone-join")
        for c in (first, second):
            await c.connect()
        parked = asyncio.ensure_future(
            first.join(num_nodes=1, gpus_per_node=2, local_rank=0, timeout=10)
        )
        await d.until("rank 0 parked", lambda: d.members_present("undone-join") == 1)
        await d.server.persister.durable()
        monkeypatch.setattr(store, "write", full_disk)
        for joining in (
            second.join(num_nodes=1, gpus_per_node=2, local_rank=1, timeout=10),
            parked,
        ):
            with pytest.raises(RendezvousError) as refused:
                await joining
            assert refused.value.reason == "STORAGE_UNAVAILABLE"
        await first.close()
        await second.close()
        monkeypatch.setattr(store, "write", written)
        await d.until("storage back", lambda: d.server.persister.healthy)
        assert sample(d, "rendezvousd_joins_total") == joins
        monkeypatch.setattr(store, "write", full_disk)
        with pytest.raises(RendezvousError) as refused:
            await failing.report_failure(1, "RuntimeError: boom")
        assert refused.value.reason == "STORAGE_UNAVAILABLE"
        assert d.view("undo").state is JobState.RUNNING  # undone
        monkeypatch.setattr(store, "write", written)
        await d.until("storage back", lambda: d.server.persister.healthy)
        await d.server.persister.durable()
        assert sample(d, "rendezvousd_job_transitions_total", state="failed") == 0
        assert sample(d, "rendezvousd_failures_detected_total") == 0
        assert sample(d, "rendezvousd_job_transitions_total", state="running") == 1
        # A change that is committed is still counted.
        await failing.report_failure(1, "RuntimeError: boom")
        assert sample(d, "rendezvousd_job_transitions_total", state="failed") == 1
        assert sample(d, "rendezvousd_failures_detected_total") == 1
        await staying.close()
        await failing.close()


async def test_a_restart_counts_nothing_and_keeps_the_failure_history(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A restart counted every restored job as entering its state (transitions{failed}
    +1 per failed job: RendezvousdJobsFailingRepeatedly fired on a restart) and kept no
    failure history: the cause was only in old log lines, the restore's line said
    "FAILED (restored)", and its timeline entry had the restart's time."""
    state_dir = tmp_path / "state"
    async with daemon_on(state_dir) as d:
        survivor, failing = await two_ranks(d, "r1")
        await failing.report_failure(1, "CUDA error: an illegal memory access")
        reported_at = time.time()
        await survivor.close()
        await failing.close()
        assert sample(d, "rendezvousd_job_transitions_total", state="failed") == 1
    failed_at = time.time()
    # A restart's time 0.3 s past the report's, told apart from it (12 ms apart here
    # without: the restart's time passed for the report's).
    await asyncio.sleep(0.3)
    caplog.set_level(logging.INFO, logger="rendezvousd")
    async with daemon_on(state_dir) as d:
        await d.until(
            "the restored job in its state's gauge",
            lambda: sample(d, "rendezvousd_jobs", state="failed") == 1,
        )
        assert sample(d, "rendezvousd_job_transitions_total", state="failed") == 0
        assert sample(d, "rendezvousd_failures_detected_total") == 0
        lines = [r.getMessage() for r in caplog.records]
        restored = [r for r in caplog.records if "(restored" in r.getMessage()]
        assert len(restored) == 1 and restored[0].levelno == logging.INFO, restored
        # Said (and the gauges set) before the daemon serves, not at its first tick.
        serving = next(i for i, line in enumerate(lines) if "serving on" in line)
        assert lines.index(restored[0].getMessage()) < serving, lines
        assert "CUDA error: an illegal memory access" in restored[0].getMessage()
        (entry,) = d.server.timeline.of("r1")
        # At the report, not the restart: within 50 ms of it, as the monotonic time
        # kept comes back as wall-clock time through the daemons' clock frames (once
        # 7 ms after the first daemon's end under load: asserted against that end).
        assert entry.at <= reported_at + 0.05 and "CUDA error" in entry.detail, entry
        async with d.client("r1") as probe:
            job = await probe.get_job()
        assert job.failures == 1 and job.last_failure.generation == 1
        assert "CUDA error: an illegal memory access" in job.last_failure.cause
        assert abs(job.last_failure.failed_unix_ms / 1000 - failed_at) < 60
        # When the loss was is kept too (GetJob's age was 0, "unknown", after a restart).
        assert job.failed[0].age_ms > 0, job.failed


async def test_the_last_failure_outlives_the_generation_and_a_restart(tmp_path: Path) -> None:
    """After the job re-formed, `status JOB` and GetJob showed only the grid and
    "restarts 1 used": the cause was on the status page alone, and a restart lost it
    there too."""
    state_dir = tmp_path / "state"
    async with daemon_on(state_dir) as d:
        async with d.client("k1") as c:
            await c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
            await c.report_failure(0, "exit code 3")
        async with d.client("k1") as again:
            await again.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
            assert d.view("k1").generation == 2
            await again.leave()
    async with daemon_on(state_dir) as d:
        async with d.client("k1") as probe:
            job = await probe.get_job()
        assert job.summary.generation == 2 and not job.failed
        assert (job.last_failure.generation, job.failures) == (1, 1)
        text = render_job(job)
        assert "last failure: generation 1" in text and "(exit code 3)" in text, text
        page = d.server.timeline  # the page reads the view's history, not the timeline
        assert page.of("k1")[0].detail == "restored"


async def test_a_join_the_running_job_refuses_is_logged_once_a_minute_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A third agent of another --nproc-per-node, refused TOPOLOGY_MISMATCH by the
    running job: its launcher said so, the daemon nowhere (while forming, the same
    refusal shows everywhere)."""
    caplog.set_level(logging.INFO, logger="rendezvousd")
    async with daemon_on() as d:
        assert sample(d, "rendezvousd_joins_refused_total", reason="topology_mismatch") == 0
        async with d.client("t2") as member:
            await member.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
            for _ in range(3):
                async with d.client("t2") as wrong:
                    with pytest.raises(RendezvousError) as refused:
                        await wrong.join(num_nodes=1, gpus_per_node=2, local_rank=0, timeout=5)
                    assert refused.value.reason == "TOPOLOGY_MISMATCH"
            assert d.view("t2").state.name == "RUNNING"
            await member.leave()
        said = [r for r in caplog.records if "refused a joiner" in r.getMessage()]
        assert len(said) == 1 and said[0].levelno == logging.WARNING, said
        assert "TOPOLOGY_MISMATCH" in said[0].getMessage()
        assert "gpus_per_node=2" in said[0].getMessage()
        assert sample(d, "rendezvousd_joins_refused_total", reason="topology_mismatch") == 3


async def test_every_job_state_has_a_series_from_start_and_a_scale_up_is_no_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A fresh daemon had no rendezvousd_jobs series (panels said "no data"); an
    agent's scale-up abort, planned, was logged at WARNING like a failure."""
    caplog.set_level(logging.INFO, logger="rendezvousd")
    async with daemon_on() as d:
        for state in ("forming", "running", "failed", "aborted", "ended"):
            assert sample(d, "rendezvousd_jobs", state=state) == 0, state
        async with d.client("grow") as c:
            await c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
            await c.abort(SCALE_UP_REASON)
        (line,) = [r for r in caplog.records if "-> ABORTED" in r.getMessage()]
        assert line.levelno == logging.INFO, line
        # Still counted as an abort (the state it entered): docs/operations.md says so.
        assert sample(d, "rendezvousd_job_transitions_total", state="aborted") == 1


# -- the state machine's part, pure ----------------------------------------------


def _join(sm: RendezvousState, job: str, gpus: int, local: int, now: float) -> object:
    uid = bytes([int(now) % 251 + 1]) * 128 if local == 0 else b""  # fresh per generation
    return sm.join(
        JoinArgs.worker(job, 1, gpus, 0, local, "h0", "", uid, f"{job}-{local}-{now}"), now
    )


def _running(sm: RendezvousState, job: str, gpus: int, now: float) -> None:
    for local in range(gpus):
        _join(sm, job, gpus, local, now)
    assert sm.jobs[job].state is JobState.RUNNING
    sm.take_effects()


def test_the_failure_history_counts_failures_and_aborts_but_not_a_scale_up() -> None:
    sm = RendezvousState()
    _running(sm, "j", 1, 0.0)
    sm.abort("j", 0, SCALE_UP_REASON, 1.0)
    assert (sm.jobs["j"].failures, sm.jobs["j"].last_failure) == (0, None)
    _running(sm, "j", 1, 2.0)
    sm.report_failure("j", 2, 0, sm.jobs["j"].gen.members[0].instance_id, 0, "boom", 3.0)
    _running(sm, "j", 1, 4.0)
    sm.abort("j", 0, "operator", 5.0)
    _running(sm, "j", 1, 6.0)
    view = sm.view("j", 7.0)
    assert view.generation == 4 and view.failures == 2
    assert view.last_failure == JobFailure(2, "rank 0 on h0 (boom)", 3.0)


def test_the_last_failure_shown_keeps_what_tells_two_failures_apart() -> None:
    """Two failures of one job: the same traceback up to its last line, the exception.
    The status page's overview and `status JOB`'s "last failure:" cut the text at its
    end, before the exception: both failures read alike there. Now the middle is cut:
    the rank and host first, the exception last, are both shown."""
    from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
    from rendezvousd.web.status_page import _last_failure

    frames = '  File "/opt/train/loop.py", line 88, in step\n' * 6
    errors = ("RuntimeError: CUDA error: an illegal memory access", "KeyError: 'lr'")
    sm = RendezvousState()
    page, status = [], []
    _running(sm, "j", 1, 0.0)
    for i, error in enumerate(errors):
        job = sm.jobs["j"]
        cause = f"Traceback (most recent call last):\n{frames}{error}"
        at = 10.0 * i + 1
        sm.report_failure("j", job.generation, 0, job.gen.members[0].instance_id, 0, cause, at)
        _running(sm, "j", 1, 10.0 * i + 2)  # re-formed: the failure is an earlier one's
        view = sm.view("j", 10.0 * i + 3)
        assert view.last_failure is not None
        page.append(_last_failure(view))
        answer = pb.GetJobResponse(
            summary=pb.JobSummary(
                job_id="j", state=pb.JOB_STATE_RUNNING, generation=view.generation
            ),
            last_failure=pb.JobFailure(
                generation=view.last_failure.generation, cause=view.last_failure.cause
            ),
            failures=view.failures,
        )
        (line,) = [x for x in render_job(answer).splitlines() if "last failure:" in x]
        status.append(line)
    for shown, error in zip(page, errors, strict=True):
        assert "rank 0 on h0 (Traceback" in shown and shown.endswith(f"{error})"), shown
    for said, error in zip(status, errors, strict=True):
        assert "rank 0 on h0 (Traceback" in said and said.endswith(f"{error})"), said


def test_an_ended_jobs_step_is_where_its_ranks_left_it() -> None:
    """ "An ended job shows where it ended" (operations.md): its node rows did, its
    job-level step was None (only active ranks counted)."""
    sm = RendezvousState()
    _running(sm, "j", 2, 0.0)
    for rank, step in ((0, 30), (1, 31)):
        sm.report_progress("j", 1, rank, Progress((step,)))
    for rank in (0, 1):
        sm.leave("j", 1, rank, sm.jobs["j"].gen.members[rank].instance_id, 1.0)
    view = sm.view("j", 2.0)
    assert view.state is JobState.ENDED and view.step == 30


def test_refusals_by_a_running_job_are_said_once_a_minute_with_the_count_since() -> None:
    sm = RendezvousState()
    _running(sm, "j", 1, 0.0)
    said = []
    for now in (1.0, 2.0, 3.0, 1.0 + REFUSAL_LOG_S):
        with pytest.raises(RendezvousFault):
            _join(sm, "j", 2, 0, now)
        (warn,) = [e for e in sm.take_effects() if isinstance(e, Warn)]
        assert warn.refused == "TOPOLOGY_MISMATCH"
        said.append(warn.message)
    assert said[0].startswith("refused a joiner (TOPOLOGY_MISMATCH; the running generation")
    assert said[1:3] == ["", ""]
    assert "(2 more refused in the 60 s since the last line, not logged)" in said[3], said[3]
    assert sm.jobs["j"].state is JobState.RUNNING


def test_status_job_shows_where_an_ended_job_ended() -> None:
    """`status JOB` drew an ended job with its node rows at step 30 and no step line."""
    from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb

    job = pb.GetJobResponse(
        summary=pb.JobSummary(
            job_id="done",
            state=pb.JOB_STATE_ENDED,
            generation=1,
            topology=pb.Topology(num_nodes=1, gpus_per_node=2),
            world_size=2,
        ),
        members=[
            pb.MemberStatus(
                member=pb.Member(rank=r, node_rank=0, local_rank=r, host="h0"),
                state=pb.MEMBER_STATE_LEFT,
                step=30 + r,
            )
            for r in range(2)
        ],
        heartbeat_timeout_ms=3000,
    )
    text = render_job(job)
    assert "    step 30" in text.splitlines()[2], text
    row = text.splitlines()[4].split()
    assert row == ["0", "h0", "-", "DD", "-", "30"], (
        text
    )  # a left node's heartbeat is no age; no address
