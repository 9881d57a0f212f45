"""Workers started as srun starts them (one process per GPU, no launcher), with
docs/trainer.md's "Under srun" exports run as written and srun's variables set by
hand: where they are placed, what a wait for a late rank says, and what their logs
carry with default settings."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.trainer.agent.waiting_note import rank_note
from rendezvousd.trainer.config import load_config
from rendezvousd.trainer.errors import ConfigError
from tests.support import ROOT, WORKERS, DaemonProcess, wait_for

DOC = ROOT / "docs" / "trainer.md"
WORKER = [sys.executable, str(WORKERS / "srun_worker.py")]
#: What the SDK logs when it beats faster than the interval it was given.
FASTER = re.compile(r"heartbeat every [\d.]+ s, not [\d.]+ s")


def task_script(d: DaemonProcess, tmp_path: Path) -> Path:
    """The doc's task.sh, pointed at ``d`` and at the test's worker: its srun lines as
    the doc gives them."""
    section = DOC.read_text().split("### Under srun", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    for placeholder in ("daemon-host:29420", "$HOME/.rendezvousd/token", "python train.py"):
        assert placeholder in block, placeholder
    block = (
        block.replace("daemon-host:29420", d.endpoint)
        .replace("$HOME/.rendezvousd/token", str(d.token_file))
        .replace("python train.py", " ".join(WORKER))
    )
    script = tmp_path / "task.sh"
    script.write_text(block)
    script.chmod(0o700)
    return script


def srun_env(procid: int, nodes: int, per_node: int, job: str, step: str) -> dict[str, str]:
    """What srun sets for task ``procid`` of ``nodes`` x ``per_node`` (its default block
    distribution), over an environment without our own variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RENDEZVOUSD_", "SLURM_"))}
    return {
        **env,
        "SLURM_JOB_ID": job,
        "SLURM_STEP_ID": step,
        "SLURM_PROCID": str(procid),
        "SLURM_NTASKS": str(nodes * per_node),
        "SLURM_NNODES": str(nodes),
        "SLURM_NODEID": str(procid // per_node),
        "SLURM_LOCALID": str(procid % per_node),
        # Bounds the test, should the job never form; the doc leaves the default.
        "RENDEZVOUSD_JOIN_TIMEOUT_S": "60",
    }


@pytest.fixture
def tasks(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []

    def start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[str]:
        with log.open("w") as err:
            p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        started.append(p)
        return p

    yield start
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(10)


def test_the_documented_srun_exports_place_a_2x2_job_and_a_late_rank_is_named(
    start_daemon: Callable[..., DaemonProcess],
    tmp_path: Path,
    tasks: Callable[..., subprocess.Popen[str]],
) -> None:
    """Every export of the doc's block, run: the ranks are srun's, the job id carries the
    step. Rank 3 starts late: the ranks waiting for it said nothing for the whole join
    timeout (600 s by default), where rendezvous-run's joins say what they wait for."""
    d = start_daemon()  # a daemon's defaults: its heartbeat timeout too
    script = task_script(d, tmp_path)
    logs = [tmp_path / f"task{i}.err" for i in range(4)]
    procs = [tasks([str(script)], srun_env(i, 2, 2, "77", "3"), logs[i]) for i in range(3)]
    # The lowest local rank waiting on the (one) host of each node says it; node 0's
    # local rank 1 waits beside its local rank 0, and keeps quiet.
    note = "still waiting for job 'slurm-77.3' generation 1 to form after"
    missing = "3 of 4 ranks joined, missing rank 3 (no worker joined as it)"
    for i in (0, 2):
        wait_for(f"task {i}'s waiting note", lambda i=i: note in logs[i].read_text(), 30)
        assert missing in logs[i].read_text(), logs[i].read_text()
    procs.append(tasks([str(script)], srun_env(3, 2, 2, "77", "3"), logs[3]))
    ready = []
    for i, p in enumerate(procs):
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0, (out, logs[i].read_text())
        ready.append(json.loads(out.splitlines()[0]))
    placed = [(r["rank"], r["node_rank"], r["local_rank"], r["world_size"]) for r in ready]
    assert placed == [(0, 0, 0, 4), (1, 0, 1, 4), (2, 1, 0, 4), (3, 1, 1, 4)]
    assert {r["job_id"] for r in ready} == {"slurm-77.3"}
    errs = [log.read_text() for log in logs]
    assert note not in errs[1], errs[1]
    assert not any(FASTER.search(e) for e in errs), errs  # (the test below)
    assert d.token not in "".join(errs)


@pytest.mark.parametrize("interval", [None, "5"])
def test_only_a_heartbeat_interval_somebody_set_is_said_to_be_cut(
    start_daemon: Callable[..., DaemonProcess],
    tmp_path: Path,
    tasks: Callable[..., subprocess.Popen[str]],
    interval: str | None,
) -> None:
    """A default worker against a default daemon (timeout 10 s) beats as the daemon
    allows, silently: every rank logged that it beat every 3.33 s, not the 5 s the
    trainer's default asked for. A value set above the daemon's third is still said."""
    d = start_daemon()
    env = {
        **srun_env(0, 1, 1, "78", "0"),
        "RENDEZVOUSD_ENDPOINT": d.endpoint,
        "RENDEZVOUSD_TOKEN_FILE": str(d.token_file),
        "RENDEZVOUSD_JOB_ID": f"beat-{interval}",
    }
    if interval is not None:
        env["RENDEZVOUSD_HEARTBEAT_INTERVAL_S"] = interval
    log = tmp_path / "task.err"
    p = tasks(WORKER, env, log)
    out, _ = p.communicate(timeout=60)
    said = log.read_text()
    assert p.returncode == 0, (out, said)
    assert json.loads(out.splitlines()[0])["world_size"] == 1
    if interval is None:
        assert not FASTER.search(said), said
    else:
        assert "heartbeat every 3.33 s, not 5 s" in said, said


@pytest.mark.parametrize("logging", ["none", "warning"])
def test_rank_0s_world_line_shows_where_the_script_configured_no_logging(
    start_daemon: Callable[..., DaemonProcess],
    tmp_path: Path,
    tasks: Callable[..., subprocess.Popen[str]],
    logging: str,
) -> None:
    """The doc's task.sh with a train.py that configures no logging: rank 0's
    "distributed: ..." line never showed (an INFO record, dropped by Python's last
    resort), though the waiting notes did (h140 F2). A script that configured logging
    at WARNING keeps it out."""
    d = start_daemon()
    script = task_script(d, tmp_path)
    script.write_text(
        script.read_text().replace(" ".join(WORKER), f"{' '.join(WORKER)} --logging {logging}")
    )
    job = f"world-{logging}"
    logs = [tmp_path / f"task{i}.err" for i in range(2)]
    procs = [tasks([str(script)], srun_env(i, 2, 1, job, "0"), logs[i]) for i in range(2)]
    for i, p in enumerate(procs):
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0, (out, logs[i].read_text())
    errs = [log.read_text() for log in logs]
    said = [line for line in errs[0].splitlines() if line.startswith("distributed: ")]
    if logging == "none":
        assert len(said) == 1, errs[0]
        assert said[0].startswith("distributed: backend=cpu world_size=2 num_nodes=2 "), said
        assert "auth=token," in said[0] and " rendezvous=" in said[0], said
    else:
        assert said == [], errs[0]
    assert "distributed: " not in errs[1], errs[1]  # rank 0's alone
    assert d.token not in "".join(errs)


def test_a_srun_rank_without_the_nodes_says_node_rank_was_never_set() -> None:
    base = {
        "RENDEZVOUSD_RANK": "3",
        "RENDEZVOUSD_NUM_NODES": "3",
        "RENDEZVOUSD_GPUS_PER_NODE": "2",
        "RENDEZVOUSD_ENDPOINT": "127.0.0.1:29420",
    }
    with pytest.raises(ConfigError) as unset:
        load_config(None, env=base)
    said = str(unset.value)
    assert "rank=3 lies on node 1, not node_rank=0 (rank from $RENDEZVOUSD_RANK)" in said
    assert "node_rank was never set (0 is its default)" in said, said
    assert "RENDEZVOUSD_NODE_RANK=$SLURM_NODEID" in said and "'auto'" in said, said
    # Set, it is named with its origin, and the advice for a default is not given.
    with pytest.raises(ConfigError) as given:
        load_config(None, env={**base, "RENDEZVOUSD_NODE_RANK": "0"})
    said = str(given.value)
    assert "node_rank from $RENDEZVOUSD_NODE_RANK" in said and "never set" not in said, said
    # The suggested fixes are taken.
    assert load_config(None, env={**base, "RENDEZVOUSD_NODE_RANK": "1"}).node_rank == 1
    assert load_config(None, env={**base, "RENDEZVOUSD_NODE_RANK": "auto"}).node_rank is None


def _job(state: int, members: list[tuple[int, int, str, int]]) -> pb.GetJobResponse:
    """A per-rank job of 2 nodes x 2 as GetJob shows it: (rank, local rank, host, state)."""
    job = pb.GetJobResponse()
    job.summary.job_id, job.summary.generation, job.summary.world_size = "j", 1, 4
    job.summary.state = state  # type: ignore[assignment]
    for rank, local, host, member_state in members:
        m = job.members.add()
        m.member.rank, m.member.local_rank, m.member.host = rank, local, host
        m.state = member_state  # type: ignore[assignment]
    return job


def test_one_rank_per_host_says_the_note_and_a_running_run_is_named() -> None:
    joining = pb.MEMBER_STATE_JOINING
    forming = _job(pb.JOB_STATE_FORMING, [(0, 0, "a", joining), (1, 1, "a", joining)])
    forming.members.add().CopyFrom(_job(0, [(3, 1, "b", joining)]).members[0])
    # Host a: its local rank 0 speaks, local rank 1 beside it keeps quiet.
    said = rank_note(forming, 5.0, 600.0, "a", 0)
    assert said == (
        "still waiting for job 'j' generation 1 to form after 5 s: 3 of 4 ranks joined, "
        "missing rank 2 (no worker joined as it); waiting up to 600 s in all, then this "
        "ends naming what is missing"
    )
    assert rank_note(forming, 5.0, 600.0, "a", 1) is None
    # Host b: its lowest local rank joined is 1, which speaks.
    assert rank_note(forming, 5.0, 600.0, "b", 1) == said
    active = pb.MEMBER_STATE_ACTIVE
    running = _job(pb.JOB_STATE_RUNNING, [(0, 0, "a", active), (1, 1, "a", pb.MEMBER_STATE_LEFT)])
    said = rank_note(running, 35.0, 600.0, "c", 0)
    assert said is not None
    assert "an earlier run of this job id, is still running after 35 s (1 of its 4" in said
    assert "`rendezvousd status j`" in said
    ended = _job(pb.JOB_STATE_RUNNING, [(0, 0, "a", pb.MEMBER_STATE_LEFT)])
    assert rank_note(ended, 35.0, 600.0, "c", 0) is None


def test_a_worker_finding_the_daemon_at_max_jobs_waits_for_room_within_its_join_timeout(
    start_daemon: Callable[..., DaemonProcess],
    tmp_path: Path,
    tasks: Callable[..., subprocess.Popen[str]],
) -> None:
    """init_distributed()'s own per-rank join raised LimitExceeded at once when the
    daemon held --max-jobs jobs: every worker launched while it was full for a moment
    failed. It waits for room now, saying once which limit it waits for."""
    from rendezvousd.client import RendezvousClient

    d = start_daemon("--max-jobs", "1", "--job-ttl-s", "1")
    env = {
        **srun_env(0, 1, 1, "79", "0"),
        "RENDEZVOUSD_ENDPOINT": d.endpoint,
        "RENDEZVOUSD_TOKEN_FILE": str(d.token_file),
        "RENDEZVOUSD_JOB_ID": "full-79",
    }
    log = tmp_path / "task.err"
    with RendezvousClient(d.endpoint, "holder-79", token=d.token) as holder:
        holder.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=30)
        holder.start_heartbeat()
        p = tasks(WORKER, env, log)
        wait_for(
            "the worker to say the daemon is full",
            lambda: "daemon is full" in log.read_text() or p.poll() is not None,
            60,
        )
        assert p.poll() is None, log.read_text()
        holder.leave()
    out, _ = p.communicate(timeout=60)
    said = log.read_text()
    assert p.returncode == 0, (out, said)
    assert json.loads(out.splitlines()[0])["job_id"] == "full-79"
    assert said.count("daemon is full") == 1, said
    assert "job 'full-79', local rank 0 on " in said, said
    assert "its max_jobs limit, held by other jobs" in said and "--max-jobs" in said, said
