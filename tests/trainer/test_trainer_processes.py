"""The trainer with real processes and a real daemon: the seed's multi-node
catalogue (all-reduce equals the single-process baseline, one checkpoint
writer, retry policy, loud failures) plus worker and daemon deaths."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from rendezvousd.trainer import demo, shm_group
from rendezvousd.trainer.errors import CommunicatorTimeout, RetriesExhausted
from rendezvousd.trainer.retry import with_retry
from rendezvousd.trainer.supervisor import WorkerExit, first_failure
from tests.support import (
    ROOT,
    WORKERS,
    DaemonProcess,
    free_port,
    parallel,
    spawn_daemon,
    wait_for,
    write_token,
)

LAUNCH = (sys.executable, "-m", "rendezvousd.trainer.launcher")
SMOKE = ROOT / "trainer" / "configs" / "multinode_smoke.toml"


def test_two_nodes_by_two_workers_match_single_process_baseline_and_one_checkpoint(
    tmp_path: Path,
) -> None:
    card = demo.run(steps=12, out=tmp_path / "card.json", workdir=tmp_path)
    assert card["success"], card
    assert card["topology"]["world_size"] == 4 and card["steps"] == 12
    # Two simulated nodes: inter-node traffic stays on TCP even on one machine.
    assert card["topology"]["collective_transport"] == "tcp-ring"
    assert card["max_abs_grad_diff_vs_single_process"] <= 1e-5
    assert card["checkpoints_written"] == ["ckpt-0000000012.npz"]
    assert json.loads((tmp_path / "card.json").read_text()) == card


def test_transient_timeout_gets_exactly_one_retry_then_fails_loudly() -> None:
    calls: list[int] = []

    def always_times_out() -> None:
        calls.append(1)
        raise CommunicatorTimeout("rank 2 did not answer within 5 s")

    with pytest.raises(RetriesExhausted, match=r"failed 2 times.*rank 2 did not answer"):
        with_retry("ring setup", always_times_out, attempts=1, backoff_s=0.01)
    assert len(calls) == 2
    flaky = iter([CommunicatorTimeout("blip"), None])

    def once() -> str:
        if (e := next(flaky)) is not None:
            raise e
        return "ok"

    assert with_retry("ring setup", once, attempts=1, backoff_s=0.01) == "ok"
    with pytest.raises(ValueError):  # permanent errors are never retried
        with_retry(
            "x", lambda: (_ for _ in ()).throw(ValueError("bad")), attempts=3, backoff_s=0.01
        )


def _worker_env(d: DaemonProcess, job: str, local: int, gpus: int) -> dict[str, str]:
    return {
        **os.environ,
        "RENDEZVOUSD_LOCAL_RANK": str(local),
        "RENDEZVOUSD_ENDPOINT": d.endpoint,
        "RENDEZVOUSD_TOKEN_FILE": str(d.token_file),
        "RENDEZVOUSD_JOB_ID": job,
        "RENDEZVOUSD_NUM_NODES": "1",
        "RENDEZVOUSD_GPUS_PER_NODE": str(gpus),
        "RENDEZVOUSD_NODE_RANK": "0",
        "RENDEZVOUSD_CONFIG": str(SMOKE),
    }


def test_sigkill_mid_all_reduce_fails_survivors_naming_the_rank(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path
) -> None:
    d = start_daemon("--heartbeat-timeout-s", "5")
    stop = tmp_path / "stop"
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKERS / "trainer_worker.py"), str(stop)],
            env=_worker_env(d, job_id, i, 3),
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(3)
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            ready = json.loads(p.stdout.readline())
            assert ready["event"] == "ready"
            # One node on one host: the all-reduces run through shared memory.
            expected = "shared-memory" if shm_group.unsupported_reason() is None else "tcp-ring"
            assert ready["transport"] == expected
        for p in procs:  # every rank has finished an all-reduce: all are inside the loop
            assert p.stdout is not None
            assert json.loads(p.stdout.readline())["event"] == "reducing"
        killed_at = time.time()
        procs[1].send_signal(signal.SIGKILL)
        for p in (procs[0], procs[2]):
            out = json.loads(p.communicate(timeout=30)[0].strip().splitlines()[-1])
            assert out["event"] == "error", out
            assert "rank 1" in out["message"], out
            assert out["at"] - killed_at < 15
    finally:
        stop.touch()
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)


def test_launcher_stops_other_workers_and_names_the_failed_rank(tmp_path: Path) -> None:
    script = tmp_path / "w.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['LOCAL_RANK'] == '1':\n    sys.exit(7)\n"
        "time.sleep(60)\n"
    )
    started = time.monotonic()
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "rendezvousd.trainer.launcher",
            "--standalone",
            "--nproc-per-node",
            "3",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 7
    assert "worker rank 1" in run.stderr and "exit code 7" in run.stderr
    assert time.monotonic() - started < 30  # the sleeping workers were stopped, not waited for


def test_launcher_sets_torchrun_style_environment(tmp_path: Path) -> None:
    script = tmp_path / "env.py"
    out = tmp_path / "env"
    script.write_text(
        "import json, os, sys\n"
        f"open('{out}-' + os.environ['LOCAL_RANK'], 'w').write(json.dumps({{k: os.environ[k] for k in "
        "('RANK','WORLD_SIZE','LOCAL_RANK','LOCAL_WORLD_SIZE','NODE_RANK','RENDEZVOUSD_ENDPOINT')}))\n"
    )
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "rendezvousd.trainer.launcher",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--nproc-per-node",
            "2",
            "--rdzv-endpoint",
            "127.0.0.1:1",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    envs = [json.loads(Path(f"{out}-{i}").read_text()) for i in range(2)]
    assert [(e["RANK"], e["LOCAL_RANK"]) for e in envs] == [("2", "0"), ("3", "1")]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"} and {e["NODE_RANK"] for e in envs} == {"1"}
    assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"}


def test_daemon_sigkill_and_restart_during_training_run_still_succeeds(tmp_path: Path) -> None:
    port = free_port()
    token_file = tmp_path / "tok"
    token = write_token(token_file)
    flags = ("--state-dir", str(tmp_path / "state"), "--heartbeat-timeout-s", "6")
    d = spawn_daemon(tmp_path, *flags, token=token, listen=f"127.0.0.1:{port}")
    results = tmp_path / "results"
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rendezvousd.trainer.launcher",
                "--nnodes",
                "2",
                "--node-rank",
                str(n),
                "--nproc-per-node",
                "2",
                "--rdzv-endpoint",
                d.endpoint,
                "--token-file",
                str(token_file),
                "--backend",
                "cpu",
                "--config",
                str(SMOKE),
                "--job-id",
                "restart-acceptance",
                "-m",
                "rendezvousd.trainer.example",
                "--steps",
                "80",
                "--step-sleep",
                "0.05",
                "--result-dir",
                str(results),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in range(2)
    ]
    logs: list[list[str]] = [[] for _ in nodes]
    pumps = [
        threading.Thread(target=lambda n=n, log=log: log.extend(n.stderr), daemon=True)
        for n, log in zip(nodes, logs, strict=True)
    ]
    for t in pumps:
        t.start()
    d2 = None
    try:
        # Rank 0 (on node 0) logs step 1 once the ring is up and the first step is
        # all-reduced: from then on the daemon dies mid-training.
        deadline = time.monotonic() + 60
        while not any("step 1/80" in line for line in list(logs[0])):
            assert time.monotonic() < deadline, logs
            assert all(n.poll() is None for n in nodes), logs
            time.sleep(0.05)  # poll interval of the condition above
        d.kill()  # SIGKILL mid-run; returns once the process is gone
        d2 = spawn_daemon(tmp_path, *flags, token=token, listen=f"127.0.0.1:{port}")
        codes = [n.wait(timeout=120) for n in nodes]
        for t in pumps:
            t.join(10)
        assert codes == [0, 0], logs
        per_rank = [json.loads(p.read_text()) for p in sorted(results.glob("rank-*.json"))]
        assert len(per_rank) == 4 and all(r["steps"] == 80 for r in per_rank)
        assert per_rank[0]["max_abs_grad_diff_vs_single_process"] <= 1e-5
        assert "restored 1 job" in d2.log()
    finally:
        for n in nodes:
            if n.poll() is None:
                n.kill()
        d.kill()
        if d2 is not None:
            d2.kill()


def test_launcher_refuses_a_bad_node_rank_from_env_instead_of_dropping_it(tmp_path: Path) -> None:
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit(9)\n")
    run = subprocess.run(
        [
            *LAUNCH,
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--rdzv-endpoint",
            "127.0.0.1:1",
            str(script),
        ],
        env={**os.environ, "RENDEZVOUSD_NODE_RANK": "x"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert "$RENDEZVOUSD_NODE_RANK='x'" in run.stderr and "'auto'" in run.stderr


def test_launcher_with_node_rank_auto_takes_ranks_from_the_daemon(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path
) -> None:
    from rendezvousd.client import RendezvousClient
    from rendezvousd.client.errors import RendezvousError

    d = start_daemon()

    def node(rank: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [
                *LAUNCH,
                "--nnodes",
                "2",
                "--node-rank",
                rank,
                "--nproc-per-node",
                "1",
                "--rdzv-endpoint",
                d.endpoint,
                "--token-file",
                str(d.token_file),
                "--job-id",
                job_id,
                str(WORKERS / "trainer_worker.py"),
                str(tmp_path / "stop"),
                "--ready-only",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    # Auto assignment is per host, and both "nodes" share this one: node 0 joins
    # explicitly first, so the auto node must be given the free node rank 1.
    nodes = [node("0")]
    try:
        with RendezvousClient(d.endpoint, token=d.token) as probe:
            deadline = time.monotonic() + 30
            while True:
                assert time.monotonic() < deadline and nodes[0].poll() is None
                with contextlib.suppress(RendezvousError):
                    if len(probe.get_job(job_id).members) == 1:
                        break
                time.sleep(0.05)  # poll interval of the condition above
        nodes.append(node("auto"))
        outs = [n.communicate(timeout=60) for n in nodes]
    finally:
        for n in nodes:
            if n.poll() is None:
                n.kill()
    assert [n.returncode for n in nodes] == [0, 0], outs
    fixed, auto = (json.loads(out.splitlines()[0]) for out, _ in outs)
    assert (fixed["rank"], fixed["node_rank"], fixed["env_rank"]) == (0, 0, "0")
    # The daemon's membership decides: not the config's default node rank 0.
    assert (auto["rank"], auto["node_rank"]) == (1, 1)
    assert auto["env_rank"] is None  # not known when the launcher started the worker
    assert "global ranks are not known" in outs[1][1]


def test_example_without_a_launcher_runs_as_a_world_of_one(tmp_path: Path) -> None:
    # No launcher, no config, no RENDEZVOUSD_* variables: the default file transport
    # with no path gives a private world of one (rank 0 starts and stops its own daemon).
    env = {k: v for k, v in os.environ.items() if not k.startswith("RENDEZVOUSD_")}
    run = subprocess.run(
        [sys.executable, "-m", "rendezvousd.trainer.example", "--steps", "3", "--log-every", "1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "step 3/3" in run.stderr + run.stdout
    assert "world_size=1" in run.stderr + run.stdout


def _launch_node(d: DaemonProcess, job: str, node: int, stop: Path) -> subprocess.Popen[str]:
    """One simulated node of 2 running tests/workers/trainer_worker.py; the
    workers' JSON lines come out on the launcher's stdout (they inherit it)."""
    return subprocess.Popen(
        [
            *LAUNCH,
            "--nnodes",
            "2",
            "--node-rank",
            str(node),
            "--nproc-per-node",
            "2",
            "--rdzv-endpoint",
            d.endpoint,
            "--token-file",
            str(d.token_file),
            "--job-id",
            job,
            "--config",
            str(SMOKE),
            str(WORKERS / "trainer_worker.py"),
            str(stop),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _running_pids(nodes: list[subprocess.Popen[str]]) -> dict[int, int]:
    """Global rank -> worker pid, once every worker of every node is in its loop."""
    pids: dict[int, int] = {}
    for n in nodes:
        assert n.stdout is not None
        events = [json.loads(n.stdout.readline()) for _ in range(4)]  # 2 ready + 2 reducing
        assert [e["event"] for e in events].count("reducing") == 2, events
        pids.update({e["rank"]: e["pid"] for e in events if e["event"] == "ready"})
    assert sorted(pids) == [0, 1, 2, 3]
    return pids


def _gone(pid: int) -> bool:
    """Exited: no /proc entry, or a zombie waiting for whoever inherited it."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status


def test_every_launcher_names_the_sigkilled_rank_and_its_host_as_root_cause(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path
) -> None:
    d = start_daemon("--heartbeat-timeout-s", "5")
    nodes = [_launch_node(d, job_id, n, tmp_path / "stop") for n in range(2)]
    try:
        pids = _running_pids(nodes)
        os.kill(pids[3], signal.SIGKILL)
        outs = [n.communicate(timeout=30) for n in nodes]
    finally:
        (tmp_path / "stop").touch()
        for n in nodes:
            if n.poll() is None:
                n.kill()
    host = socket.gethostname()
    for n, (_, err) in zip(nodes, outs, strict=True):
        assert n.returncode != 0, err
        causes = [line for line in err.splitlines() if "root cause:" in line]
        assert len(causes) == 1, err
        # The daemon's record, on both nodes: the killed rank, not a sibling that
        # failed right after it with PeerFailed.
        assert re.search(
            rf"root cause: rank 3 \(node 1, local rank 1\) on host {re.escape(host)} "
            r"was lost \(.+\)",
            causes[0],
        ), err
    # Node 1 saw the kill itself: its first local failure is rank 3, not rank 2.
    assert "worker rank 3 (pid" in outs[1][1] and "signal SIGKILL" in outs[1][1], outs[1][1]
    assert nodes[1].returncode == 128 + signal.SIGKILL


def test_sigkilled_launcher_takes_its_workers_down_and_the_other_node_is_told(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path
) -> None:
    d = start_daemon("--heartbeat-timeout-s", "5")
    nodes = [_launch_node(d, job_id, n, tmp_path / "stop") for n in range(2)]
    try:
        pids = _running_pids(nodes)
        nodes[1].kill()
        nodes[1].wait(10)
        wait_for(
            "node 1's workers to die with their launcher",
            lambda: all(_gone(pids[r]) for r in (2, 3)),
            timeout=3,
        )
        out, err = nodes[0].communicate(timeout=30)
    finally:
        (tmp_path / "stop").touch()
        for n in nodes:
            if n.poll() is None:
                n.kill()
    errors = [json.loads(line) for line in out.splitlines() if '"error"' in line]
    assert len(errors) == 2, out
    for e in errors:
        # Told by whichever comes first: the daemon (PeerFailed, or the abort it
        # triggers) or the ring connection to a dead neighbour.
        assert e["type"] in {"PeerFailed", "CommunicatorAborted", "PeerConnectionError"}, e
        assert re.search(r"rank [23]\b", e["message"]), e
    assert nodes[0].returncode == 3, err  # the workers' own exit code, passed on
    assert re.search(r"root cause: rank [23] .* was lost", err), err


def test_root_cause_among_failures_reaped_together_is_the_killed_one() -> None:
    killed = WorkerExit(1, "rank 1", 11, -signal.SIGKILL, at=10.02)
    sibling = WorkerExit(0, "rank 0", 10, 3, at=10.0)
    later = WorkerExit(2, "rank 2", 12, -signal.SIGTERM, at=11.0)
    # Stamped in the same instant: the signal death is the cause, whatever the order.
    assert first_failure([sibling, killed]) is killed
    # Clearly apart: the first to exit, even if a later one died of a signal.
    assert first_failure([later, sibling]) is sibling
    assert killed.exit_status == 128 + signal.SIGKILL and sibling.exit_status == 3


TINY = ("--samples", "128", "--features", "8", "--hidden", "16", "--batch", "8")


def _train(d: DaemonProcess, job: str, run: Path, steps: int, *extra: str) -> list[str]:
    """2 simulated nodes x 2 workers of the example through rendezvous-run, each
    node with its own checkpoint directory (node-local disks); the launchers'
    stderr. Results land in ``run``/results, checkpoints in ``run``/node-N."""
    nodes = [
        subprocess.Popen(
            [
                *LAUNCH,
                "--nnodes",
                "2",
                "--node-rank",
                str(n),
                "--nproc-per-node",
                "2",
                "--rdzv-endpoint",
                d.endpoint,
                "--token-file",
                str(d.token_file),
                "--job-id",
                job,
                "--config",
                str(SMOKE),
                "-m",
                "rendezvousd.trainer.example",
                *TINY,
                "--steps",
                str(steps),
                "--log-every",
                "1",
                "--result-dir",
                str(run / "results"),
                "--checkpoint-dir",
                str(run / f"node-{n}"),
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in range(2)
    ]
    try:
        return [n.communicate(timeout=60)[1] for n in nodes]
    finally:
        for n in nodes:
            if n.poll() is None:
                n.kill()


def _results(run: Path) -> list[dict[str, object]]:
    return [json.loads((run / "results" / f"rank-{r}.json").read_text()) for r in range(4)]


def test_resume_on_node_local_disks_agrees_on_the_step_and_matches_a_straight_run(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path
) -> None:
    d = start_daemon()
    straight, first, resumed = tmp_path / "straight", tmp_path / "first", tmp_path / "resumed"
    # The straight run and the first half are independent jobs: run them together.
    logs = parallel(
        [
            lambda: _train(d, f"{job_id}-s", straight, 8, "--checkpoint-every", "0"),
            lambda: _train(d, f"{job_id}-a", first, 5, "--checkpoint-every", "2"),
        ],
        limit=90,
    )
    assert all(isinstance(log, list) for log in logs), logs
    # Only node 0 (global rank 0) has checkpoints: every 2 steps and at the end.
    assert sorted(p.name for p in (first / "node-0").iterdir()) == [
        "ckpt-0000000002.npz",
        "ckpt-0000000004.npz",
        "ckpt-0000000005.npz",
    ]
    assert not (first / "node-1").exists() or not any((first / "node-1").iterdir())
    # Resume on the same node-local disks: node 1 has no checkpoint to read.
    (resumed / "results").mkdir(parents=True)
    for n in range(2):
        if (first / f"node-{n}").exists():
            (first / f"node-{n}").rename(resumed / f"node-{n}")
    errs = _train(d, f"{job_id}-b", resumed, 8, "--resume", "--checkpoint-every", "0")
    after = _results(resumed)
    assert [r["start_step"] for r in after] == [5, 5, 5, 5], errs
    assert [r["steps"] for r in after] == [3, 3, 3, 3]
    reference = _results(straight)
    assert {r["start_step"] for r in reference} == {0}
    # Bit-identical with the cpu backend: same parameter bytes and loss everywhere.
    assert {r["params_sha256"] for r in after + reference} == {reference[0]["params_sha256"]}
    assert {r["final_loss"] for r in after + reference} == {reference[0]["final_loss"]}


def test_resume_from_a_corrupt_checkpoint_fails_loudly_naming_the_file(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path
) -> None:
    d = start_daemon()
    bad = tmp_path / "node-0" / "ckpt-0000000004.npz"
    bad.parent.mkdir()
    bad.write_bytes(b"PK\x03\x04 not a whole zip archive")
    errs = _train(d, job_id, tmp_path, 8, "--resume")
    assert f"rank 0 cannot resume: checkpoint {bad} is corrupt" in errs[0], errs[0]
    # The other node is told through the rendezvous and names the same cause.
    for err in errs:
        assert re.search(r"root cause: rank 0 \(node 0, local rank 0\) on host .* was lost", err), (
            err
        )
    assert not (tmp_path / "results").exists()  # nobody trained from step 0 instead


def test_launcher_with_its_daemon_gone_still_names_the_local_failure_promptly(
    tmp_path: Path,
) -> None:
    script = tmp_path / "w.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['LOCAL_RANK'] == '1':\n    sys.exit(5)\n"
        "time.sleep(60)\n"
    )
    token = tmp_path / "tok"
    write_token(token)
    started = time.monotonic()
    run = subprocess.run(
        [
            *LAUNCH,
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--nproc-per-node",
            "2",
            "--rdzv-endpoint",
            f"127.0.0.1:{free_port()}",  # nothing listens: the daemon is gone
            "--token-file",
            str(token),
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 5, run.stderr
    assert "worker rank 3 (pid" in run.stderr and "exit code 5" in run.stderr
    assert "root cause: worker rank 3 on this node" in run.stderr
    assert "could not be asked" in run.stderr and "Traceback" not in run.stderr
    assert time.monotonic() - started < 20  # the best-effort query did not hang
