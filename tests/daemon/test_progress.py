"""Training progress on a node's heartbeat: each rank's last step and the agent's
restart budget reach GetJob and the status page's JSON, with a step rate."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client import RendezvousClient, RendezvousError
from rendezvousd.common.model import JoinMode, JoinResult, MemberState, Progress
from rendezvousd.errors import RendezvousFault
from rendezvousd.state.job import Node
from rendezvousd.state.machine import JoinArgs, RendezvousState
from tests.daemon.test_status_page import api
from tests.support import ROOT, WORKERS, DaemonProcess, launcher_cmd, wait_for

UID = b"\x5b" * 128


def test_a_nodes_progress_reaches_getjob_and_the_page(daemon: DaemonProcess, job_id: str) -> None:
    with RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as agent:
        agent.join_node(
            min_nodes=1, max_nodes=1, gpus_per_node=2, id_factory=lambda: UID, timeout=20
        )
        agent.report_progress([5, 7], restarts_used=1, max_restarts=3)
        agent.start_heartbeat(0.1)
        wait_for(
            "the first beat's progress in GetJob",
            lambda: [m.step for m in agent.get_job().members] == [5, 7],
        )
        job = agent.get_job()
        assert (job.restarts_used, job.restarts_left) == (1, 2)
        page = api(daemon, f"/api/jobs/{job_id}", token=daemon.token)
        assert page["step"] == 5  # the slowest rank's
        assert page["nodes"]["rows"][0]["step"] == 5
        assert (page["restarts_used"], page["restarts_left"]) == (1, 2)
        # Later beats carry what is reported later; the page measures a rate from it.
        agent.report_progress([None, 9], restarts_used=2, max_restarts=3)
        wait_for(
            "a rank without a step yet",
            lambda: [m.HasField("step") for m in agent.get_job().members] == [False, True],
        )
        for step in range(10, 40, 10):
            agent.report_progress([step, step], restarts_used=2, max_restarts=3)
            wait_for(f"step {step}", lambda s=step: agent.get_job().members[0].step == s)
            time.sleep(0.6)  # the page samples a job at most every 0.5 s (its view's age)
            api(daemon, "/api/jobs", token=daemon.token)
        overview = api(daemon, "/api/jobs", token=daemon.token)["jobs"][0]
        assert overview["step"] == 30 and overview["restarts_left"] == 1
        assert overview["steps_per_s"] is not None and overview["steps_per_s"] > 0


def test_too_many_steps_are_refused_once_joined_and_cut_before_so_no_beat_fails(
    daemon: DaemonProcess, job_id: str
) -> None:
    """25,000 steps were accepted and put on every beat, over the daemon's message
    limit: the heartbeat was refused and the whole job failed (an SDK misuse review).
    Joined, the client refuses more steps than its stream's ranks; a list given before
    the join is known is cut to them on the beat."""
    many = list(range(1_000_000, 1_025_000))
    with RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as member:
        member.report_progress(many)  # before the join: not known how many ranks
        member.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=20)
        with pytest.raises(RendezvousError, match=r"steps= has 25000 entries.* 1 rank: "):
            member.report_progress(many)
        member.start_heartbeat(0.1)
        wait_for("the first beat's step", lambda: member.get_job().members[0].step == many[0])
        time.sleep(0.5)  # beats on
        assert member.failure is None
        assert member.get_job().summary.state == pb.JobState.JOB_STATE_RUNNING
        member.report_progress([7])
        wait_for("the next step", lambda: member.get_job().members[0].step == 7)


def test_the_goodbye_carries_the_last_steps(daemon: DaemonProcess, job_id: str) -> None:
    """An ended job showed the steps of the beat before its members' goodbyes, up to
    an interval old (`status` read 127 and 141 of a 150-step run): the goodbye now
    carries what was reported last, and the daemon keeps it."""
    with RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as agent:
        agent.join_node(
            min_nodes=1, max_nodes=1, gpus_per_node=2, id_factory=lambda: UID, timeout=20
        )
        agent.report_progress([1, 1])
        agent.start_heartbeat(60)  # no beat after the first before the goodbye
        wait_for("the first beat", lambda: [m.step for m in agent.get_job().members] == [1, 1])
        # The goodbye goes on the stream once its ack is read (else by a Leave call,
        # which carries no steps): under load the daemon's view came first (CI, once).
        wait_for("the stream's ack", lambda: agent._s.stream_leave)
        agent.report_progress([150, 149])
    with RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as probe:
        job = probe.get_job()
    assert job.summary.state == pb.JOB_STATE_ENDED
    assert [m.step for m in job.members] == [150, 149]


def test_a_job_without_progress_shows_none(daemon: DaemonProcess, job_id: str) -> None:
    with RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as c:
        c.join(num_nodes=1, gpus_per_node=1, local_rank=0, unique_id=UID, timeout=20)
        c.start_heartbeat(0.1)
        job = c.get_job()
        assert not job.members[0].HasField("step") and not job.HasField("restarts_used")
        page = api(daemon, f"/api/jobs/{job_id}", token=daemon.token)
        assert page["step"] is None and page["steps_per_s"] is None
        assert page["restarts_used"] is None and page["nodes"]["rows"][0]["step"] is None


def test_the_state_keeps_as_many_steps_as_the_node_has_ranks() -> None:
    sm = RendezvousState()
    one = JoinArgs("j", 1, 1, 2, None, "host-a", (), UID, "a", 60.0)
    assert isinstance(sm.join(one, 0.0), JoinResult)
    sm.report_progress("j", 1, 0, Progress((1, 2, 3, 4), 0, 0), mode=JoinMode.NODE)
    node = sm.jobs["j"].gen.node_at[0]
    assert isinstance(node, Node) and node.progress == Progress((1, 2), 0, 0)
    with pytest.raises(RendezvousFault):  # a stale generation's stream
        sm.report_progress("j", 2, 0, Progress((1,), 0, 0), mode=JoinMode.NODE)
    view = sm.view("j", 1.0)
    assert [m.step for m in view.members if m.state is MemberState.ACTIVE] == [1, 2]


def test_rendezvous_runs_workers_steps_and_budget_reach_the_daemon(
    daemon: DaemonProcess, job_id: str, tmp_path: Path
) -> None:
    done = tmp_path / "done"
    cmd = launcher_cmd(1, 0, 2, endpoint=daemon.endpoint, token_file=daemon.token_file, job=job_id)
    launcher = subprocess.Popen(
        [*cmd, "--max-restarts", "3", str(WORKERS / "progress_worker.py"), str(done)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        with RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as c:

            def steps() -> list[int | None]:
                try:
                    members = c.get_job().members
                except RendezvousError:
                    return []  # the job is not there yet
                return [m.step if m.HasField("step") else None for m in members]

            wait_for("each worker's step from its agent's heartbeat", lambda: steps() == [40, 41])
            job = c.get_job()
            assert (job.restarts_used, job.restarts_left) == (0, 3)
        done.touch()
        _, err = launcher.communicate(timeout=60)
        assert launcher.returncode == 0, err
    finally:
        launcher.kill()
        launcher.wait()
