"""The trainer with real processes and a real daemon: the seed's multi-node
catalogue (all-reduce equals the single-process baseline, one checkpoint
writer, loud failures; the retry policy is in test_nccl_setup.py) plus worker and daemon deaths."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rendezvousd.trainer.comm import shm_group
from rendezvousd.trainer.demo import run as demo
from tests.support import (
    ROOT,
    WORKERS,
    DaemonProcess,
    free_port,
    launcher_cmd,
    rest_of_stdout,
    spawn_daemon,
    stderr_of_all,
    wait_for,
    write_token,
)

SMOKE = ROOT / "trainer" / "configs" / "multinode_smoke.toml"
TORCHRUN_NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK")


def test_two_nodes_by_two_workers_match_single_process_baseline_and_one_checkpoint(
    tmp_path: Path,
) -> None:
    card = demo.run(steps=12, out=tmp_path / "card.json", workdir=tmp_path)
    assert card["success"], card
    assert card["topology"]["world_size"] == 4 and card["steps"] == 12
    # Two simulated nodes: inter-node traffic stays on TCP even on one machine.
    assert card["topology"]["collective_transport"] == "tcp-ring"
    # Every worker's daemon calls went through its node agent (client.relay).
    assert card["topology"]["daemon_calls"] == ["relayed"]
    assert card["max_abs_grad_diff_vs_single_process"] <= 1e-5
    assert card["checkpoints_written"] == ["ckpt-0000000012.npz"]
    assert json.loads((tmp_path / "card.json").read_text()) == card


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
            assert ready["generation"] == 1  # the daemon's number (read 0 without an agent)
            # One node on one host: the all-reduces run through shared memory.
            expected = "shared-memory" if shm_group.unsupported_reason() is None else "tcp-ring"
            assert ready["transport"] == expected
        for p in procs:  # every rank has finished an all-reduce: all are inside the loop
            assert p.stdout is not None
            assert json.loads(p.stdout.readline())["event"] == "reducing"
        killed_at = time.time()
        procs[1].send_signal(signal.SIGKILL)
        for p in (procs[0], procs[2]):
            out = json.loads(rest_of_stdout(p, 30).strip().splitlines()[-1])
            assert out["event"] == "error", out
            assert "rank 1" in out["message"], out
            assert out["at"] - killed_at < 15
    finally:
        stop.touch()
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)


def test_a_worker_without_a_launcher_that_raises_is_its_peers_cause(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path
) -> None:
    """Without an agent only the worker can report its exception: before, it exited
    and its peers, ``status`` and the daemon's record read only "heartbeat stream
    closed", the exception left in its own stderr."""
    from rendezvousd.client import RendezvousClient

    d = start_daemon()
    script = tmp_path / "w.py"
    script.write_text(
        "import json\n"
        "from rendezvousd.trainer.distributed import init_distributed\n"
        "try:\n"
        "    with init_distributed() as ctx:\n"
        "        ctx.communicator.barrier()\n"
        "        if ctx.rank == 1:\n"
        "            raise RuntimeError('line1\\nline2' + 'x' * 5000)\n"
        "        ctx.communicator.barrier()\n"
        "except Exception as exc:\n"
        "    print(json.dumps({'error': f'{type(exc).__name__}: {exc}'}), flush=True)\n"
    )
    survivor = _rank0s_last_line(d, job_id, script)
    # Its own ring may break first ("rank 1 left the job ..."); when its rendezvous' word
    # came first, that names the exception.
    assert "lost rank 1" in survivor["error"] or "rank 1 left the job" in survivor["error"], (
        survivor
    )
    if "lost rank 1" in survivor["error"]:
        assert "RuntimeError: line1" in survivor["error"], survivor
    with RendezvousClient(d.endpoint, job_id, token=d.token) as probe:
        failed = probe.get_job().failed
    assert failed[0].rank == 1, failed
    assert failed[0].cause.startswith("RuntimeError: line1\nline2xxx"), failed[0].cause


def _rank0s_last_line(d: DaemonProcess, job_id: str, script: Path) -> dict[str, Any]:
    """``script`` run as the two workers of a job without a launcher: rank 0's last
    stdout line, as JSON."""
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env=_worker_env(d, job_id, i, 2),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for i in range(2)
    ]
    try:
        last: dict[str, Any] = json.loads(rest_of_stdout(procs[0], 60).strip().splitlines()[-1])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
    return last


def test_a_worker_without_a_launcher_whose_ring_broke_waits_for_the_daemons_cause(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path
) -> None:
    """Rank 1's ring goes 0.5 s before its heartbeat stream does (it closes its
    communicator, then dies): rank 0, its collective broken, does not drop out at once
    (the daemon would lose it first, and name it the root cause) but waits, bounded,
    until the daemon tells it rank 1 is lost."""
    from rendezvousd.client import RendezvousClient

    d = start_daemon()
    script = tmp_path / "w.py"
    script.write_text(
        "import json, os, time\n"
        "from rendezvousd.trainer.distributed import init_distributed\n"
        "ctx = init_distributed()\n"
        "ctx.communicator.barrier()\n"
        "if ctx.rank == 1:\n"
        "    ctx.communicator.close()\n"
        "    time.sleep(0.5)\n"
        "    os._exit(9)\n"
        "try:\n"
        "    ctx.communicator.barrier()\n"
        "except Exception as exc:\n"
        "    ctx.close(clean=False, error=exc)\n"
        "    heard = ctx.rendezvous.failure\n"
        "    print(json.dumps({'error': f'{type(exc).__name__}: {exc}', 'heard': repr(heard)}))\n"
    )
    survivor = _rank0s_last_line(d, job_id, script)
    assert "rank 1 left the job" in survivor["error"], survivor  # the ring's own word
    assert survivor["heard"].startswith("PeerFailed(") and "lost rank 1 " in survivor["heard"], (
        survivor
    )
    with RendezvousClient(d.endpoint, job_id, token=d.token) as probe:
        failed = probe.get_job().failed
    assert [f.rank for f in failed[:1]] == [1], failed


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shared-memory", "tcp-ring"])
def test_a_worker_without_a_launcher_that_finishes_early_is_named_as_left_not_aborted(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path, shared_memory: bool
) -> None:
    """Rank 1 runs 3 steps, leaves its ``with`` block cleanly and exits 0 (uneven data);
    ranks 0 and 2 go on. They read "rank 1 aborted: communicator closed", and, the
    daemon having heard only rank 1's goodbye, the first survivor's stream to close was
    recorded as the loss: "rank 2 on HOST (heartbeat stream closed)", a victim blamed."""
    from rendezvousd.client import RendezvousClient

    d = start_daemon()
    script = tmp_path / "w.py"
    script.write_text(
        "import json, os, sys\n"
        "import numpy as np\n"
        "from rendezvousd.trainer.distributed import init_distributed\n"
        "try:\n"
        "    with init_distributed() as ctx:\n"
        "        for _ in range(3 if ctx.rank == 1 else 100_000):\n"
        "            ctx.communicator.all_reduce(np.ones(4))\n"
        "except Exception as exc:\n"
        "    print(json.dumps({'error': f'{type(exc).__name__}: {exc}'}), flush=True)\n"
        "    sys.exit(1)\n"
        "print(json.dumps({'done': True}), flush=True)\n"
    )
    env = {"RENDEZVOUSD_CPU_SHARED_MEMORY": str(shared_memory).lower()}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env={**_worker_env(d, job_id, i, 3), **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for i in range(3)
    ]
    try:
        lines = [json.loads(rest_of_stdout(p, 60).strip().splitlines()[-1]) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
    assert lines[1] == {"done": True} and procs[1].returncode == 0, lines
    for survivor in (lines[0], lines[2]):
        error = survivor.get("error", "")
        assert "rank 1 left the job (finished or exited early" in error, survivor
        assert "while this rank still ran collectives" in error and "aborted" not in error
    assert [p.returncode for p in procs] == [1, 0, 1]
    with RendezvousClient(d.endpoint, job_id, token=d.token) as probe:
        job = probe.get_job()
    # The record's cause is a survivor's own report, which names rank 1's leave; never
    # a victim's stream closing.
    assert job.failed and job.failed[0].rank in (0, 2), job.failed
    assert "rank 1 left the job" in job.failed[0].cause, job.failed
    assert all("heartbeat stream closed" not in f.cause for f in job.failed), job.failed
    failed_line = [line for line in d.log().splitlines() if "RUNNING -> FAILED" in line]
    assert failed_line and "rank 1 left the job" in failed_line[0], failed_line
    # The daemon's own context: the rank whose goodbye came while the others ran.
    assert (
        failed_line[0].endswith("left the running generation (finished or exited early))")
        and ", after rank 1 on " in failed_line[0]
    ), failed_line


def _standalone(per_node: int, *flags: str) -> list[str]:
    """``rendezvous-run --standalone`` for ``per_node`` workers, before its script."""
    launcher = [sys.executable, "-m", "rendezvousd.trainer.agent.launcher", "--standalone"]
    return [*launcher, "--nproc-per-node", str(per_node), *flags]


def test_a_worker_that_finishes_early_under_the_launcher_is_named_as_left(
    tmp_path: Path,
) -> None:
    """The same uneven steps under rendezvous-run: its agents report the survivors' words
    (no agent reports a worker's exit 0), which named rank 1 as "aborted"."""
    script = tmp_path / "w.py"
    script.write_text(
        "import numpy as np\n"
        "from rendezvousd.trainer.distributed import init_distributed\n"
        "with init_distributed() as ctx:\n"
        "    for _ in range(3 if ctx.rank == 1 else 100_000):\n"
        "        ctx.communicator.all_reduce(np.ones(4))\n"
    )
    run = subprocess.run(
        [*_standalone(3, "--backend", "cpu"), str(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1, run.stderr[-3000:]
    root = [ln for ln in run.stderr.splitlines() if "rendezvous-run: root cause:" in ln]
    assert root and "rank 1 left the job" in root[0], run.stderr[-3000:]
    assert "aborted" not in run.stderr, run.stderr[-3000:]


def test_launcher_stops_other_workers_and_names_the_failed_rank(tmp_path: Path) -> None:
    script = tmp_path / "w.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['LOCAL_RANK'] == '1':\n    sys.exit(7)\n"
        "time.sleep(60)\n"
    )
    started = time.monotonic()
    run = subprocess.run(
        [*_standalone(3), str(script)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 7
    assert "worker rank 1" in run.stderr and "exit code 7" in run.stderr
    assert time.monotonic() - started < 30  # the sleeping workers were stopped, not waited for


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shared-memory", "tcp-ring"])
def test_the_collective_semantics_worker_holds_on_the_cpu_backend(shared_memory: bool) -> None:
    """scripts/gpu_check.sh runs tests/workers/collective_semantics.py on NCCL; here on
    the CPU backend, whose semantics it checks as the same: checked, so that a GPU
    session runs a worker that is known to pass where the semantics hold."""
    env = {**os.environ, "RENDEZVOUSD_CPU_SHARED_MEMORY": str(shared_memory).lower()}
    run = subprocess.run(
        [*_standalone(2, "--backend", "cpu"), str(WORKERS / "collective_semantics.py")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    seen = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert sorted(s["rank"] for s in seen) == [0, 1] and all(s["ok"] for s in seen), seen
    assert all(s["avg"] == [-3, -3, -3] for s in seen), seen


def _running(pid: int) -> bool:
    """Not exited (a zombie orphan waiting for whoever inherited it has exited)."""
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("fork_server", [True, False], ids=["forked", "cold"])
@pytest.mark.parametrize("ending", ["sigterm-to-launcher", "worker-fails"])
def test_a_stopped_workers_own_child_processes_go_with_it(
    tmp_path: Path, ending: str, fork_server: bool
) -> None:
    # What a DataLoader's workers or a prefetch server are: processes of the worker's
    # own. Like torchrun (a session per worker, its group signalled), stopping a
    # worker stops them; they must not keep holding ports, memory or a GPU.
    script = tmp_path / "w.py"
    script.write_text(
        "import os, subprocess, sys, time\n"
        "from rendezvousd.trainer.distributed import init_distributed\n"
        "with init_distributed() as ctx:\n"
        "    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"    open('{tmp_path}/child-' + str(ctx.rank), 'w').write(str(child.pid))\n"
        f"    if {ending == 'worker-fails'} and ctx.rank == 1:\n"
        f"        while not (os.path.exists('{tmp_path}/child-0') and\n"
        f"                   open('{tmp_path}/child-0').read()):\n"
        "            time.sleep(0.01)  # rank 0 has its child too\n"
        "        sys.exit(7)\n"
        "    time.sleep(600)\n"
    )
    flags = [] if fork_server else ["--no-fork-server"]
    # Into a file: a child left running would hold a pipe open.
    log = tmp_path / "launcher.err"
    with log.open("w") as err:
        launcher = subprocess.Popen([*_standalone(2, *flags), str(script)], stderr=err)
    children: list[int] = []
    try:
        files = [tmp_path / f"child-{rank}" for rank in range(2)]
        wait_for("both workers' children", lambda: all(f.exists() for f in files), 60)
        wait_for("their pids", lambda: all(f.read_text() for f in files))
        children = [int(f.read_text()) for f in files]
        if ending == "sigterm-to-launcher":
            launcher.send_signal(signal.SIGTERM)
        code = launcher.wait(30)
        assert code == (128 + signal.SIGTERM if ending[0] == "s" else 7), log.read_text()
        wait_for(
            "the workers' children to be stopped with them",
            lambda: not any(_running(pid) for pid in children),
            timeout=5,
        )
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def _heard(signum: int) -> Iterator[None]:
    """``signum`` at its default while a child is started: the launcher leaves a signal
    it inherited ignored alone (nohup), and a run under ``nohup``, or in the background
    of a shell without job control (SIGINT and SIGQUIT ignored), would hand it one."""
    previous = signal.signal(signum, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signum, previous)


def _signalled_standalone(
    script: Path, tmp_path: Path, signum: int, *flags: str
) -> tuple[int, str, list[Path]]:
    """``rendezvous-run --standalone`` of 2 workers running ``script``, sent ``signum``
    once both wrote ``tmp_path/ready-<rank>``: its exit status, its stderr and what it
    left in its TMPDIR."""
    # Short: the daemon's socket goes in a directory made in it (a UNIX socket path
    # has 108 bytes at most).
    with tempfile.TemporaryDirectory(prefix="rdzv-") as name, _heard(signum):
        launcher = subprocess.Popen(
            [*_standalone(2, *flags), str(script)],
            env={**os.environ, "TMPDIR": name},
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            ready = [tmp_path / f"ready-{rank}" for rank in range(2)]
            wait_for("both workers", lambda: all(f.exists() for f in ready), 60)
            launcher.send_signal(signum)
            _, err = launcher.communicate(timeout=30)
        finally:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait(10)
        return launcher.returncode, err, list(Path(name).iterdir())


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGQUIT])
def test_a_hangup_stops_the_launcher_as_sigterm_does(tmp_path: Path, signum: int) -> None:
    # A closed terminal or SSH session (SIGHUP), or Ctrl-\ (SIGQUIT): torchrun handles
    # both as SIGTERM. Its workers hear it and the private directory goes with it.
    script = tmp_path / "w.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "from rendezvousd.trainer.distributed import init_distributed\n"
        "def stop(signum, frame):\n"
        f"    open('{tmp_path}/heard-' + os.environ['LOCAL_RANK'], 'w').write(str(signum))\n"
        "    sys.exit(0)\n"
        f"signal.signal({int(signum)}, stop)\n"
        "with init_distributed() as ctx:\n"
        f"    open('{tmp_path}/ready-' + str(ctx.rank), 'w').close()\n"
        "    time.sleep(600)\n"
    )
    code, err, left = _signalled_standalone(script, tmp_path, signum)
    assert code == 128 + signum, err
    heard = [(tmp_path / f"heard-{r}").read_text() for r in range(2)]
    assert heard == [str(int(signum))] * 2, err
    assert left == [], err  # its socket, token and directory removed


@pytest.mark.parametrize("grace", [None, "0.3"], ids=["default grace", "--stop-grace-s 0.3"])
def test_a_stopped_launchers_workers_get_their_grace_to_checkpoint(
    tmp_path: Path, grace: str | None
) -> None:
    # Preemption: the scheduler's SIGTERM reaches the launcher, whose workers then
    # save a checkpoint in their handler (2.5 s here) before they exit. Under the
    # default grace they finish (it was 1 s, as torchrun's is 30 s); a grace shorter
    # than that ends them with SIGKILL.
    script = tmp_path / "w.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "from rendezvousd.trainer.distributed import init_distributed\n"
        "def stop(signum, frame):\n"
        "    time.sleep(2.5)\n"
        f"    open('{tmp_path}/saved-' + os.environ['LOCAL_RANK'], 'w').close()\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "with init_distributed() as ctx:\n"
        f"    open('{tmp_path}/ready-' + str(ctx.rank), 'w').close()\n"
        "    time.sleep(600)\n"
    )
    flags = [] if grace is None else ["--stop-grace-s", grace]
    code, err, _ = _signalled_standalone(script, tmp_path, signal.SIGTERM, *flags)
    assert code == 128 + signal.SIGTERM, err
    saved = sorted(p.name for p in tmp_path.glob("saved-*"))
    assert saved == ([] if grace else ["saved-0", "saved-1"]), err


def test_a_stopped_node_tells_the_others_before_its_workers_are_done(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path
) -> None:
    # Node 0 is stopped and its worker takes 3 s over its handler: node 1 hears why at
    # once (the abort goes first), not after that worker is done.
    d = start_daemon()
    script = tmp_path / "w.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "from rendezvousd.trainer.distributed import init_distributed\n"
        "def stop(signum, frame):\n"
        "    time.sleep(3)\n"
        f"    open('{tmp_path}/saved', 'w').close()\n"
        "    sys.exit(0)\n"
        "with init_distributed() as ctx:\n"
        "    if ctx.rank == 0:\n"
        "        signal.signal(signal.SIGTERM, stop)\n"
        f"    open('{tmp_path}/ready-' + str(ctx.rank), 'w').close()\n"
        "    time.sleep(600)\n"
    )
    cmd = [launcher_cmd(2, n, 1, endpoint=d.endpoint, token_file=d.token_file, job=job_id)
           for n in range(2)]  # fmt: skip
    nodes = [
        subprocess.Popen([*c, "--backend", "cpu", str(script)], stderr=subprocess.PIPE, text=True)
        for c in cmd
    ]
    try:
        ready = [tmp_path / f"ready-{rank}" for rank in range(2)]
        wait_for("both workers", lambda: all(f.exists() for f in ready), 60)
        nodes[0].send_signal(signal.SIGTERM)
        _, err = nodes[1].communicate(timeout=30)
        saved_before = (tmp_path / "saved").exists()
        _, stopped = nodes[0].communicate(timeout=30)
    finally:
        for n in nodes:
            if n.poll() is None:
                n.kill()
                n.wait(10)
    assert nodes[1].returncode != 0, err
    assert "was stopped by SIGTERM" in err, err
    assert not saved_before, err  # node 1 was done before node 0's worker
    assert nodes[0].returncode == 128 + signal.SIGTERM
    assert (tmp_path / "saved").exists()
    # A daemon that answers hears the stopped node's goodbye within its bound (1 s).
    assert "could not tell the daemon" not in stopped, stopped


def _hearing_worker(tmp_path: Path) -> Path:
    """A worker that writes ``ready-<rank>``, then ``heard-<local rank>`` on SIGTERM or
    Ctrl-C (its KeyboardInterrupt), and exits 0."""
    script = tmp_path / "w.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "from rendezvousd.trainer.distributed import init_distributed\n"
        "def heard(signum, frame):\n"
        f"    open('{tmp_path}/heard-' + os.environ['LOCAL_RANK'], 'w').write(str(signum))\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, heard)\n"
        "signal.signal(signal.SIGINT, heard)\n"
        "with init_distributed() as ctx:\n"
        f"    open('{tmp_path}/ready-' + str(ctx.rank), 'w').close()\n"
        "    time.sleep(600)\n"
    )
    return script


@pytest.mark.parametrize("fate", [signal.SIGSTOP, signal.SIGKILL], ids=["stopped", "killed"])
def test_a_stopped_launcher_signals_its_workers_at_once_though_no_daemon_answers(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path, fate: int
) -> None:
    # Preemption on a node whose daemon is down or hung: the launcher's abort to the
    # daemon came first and waited out the SDK's outage window (28 s of a 30 s
    # heartbeat timeout) while its workers, not yet told, trained on: a scheduler's
    # 30 s grace was gone before their checkpoint handler ran.
    d = start_daemon("--heartbeat-timeout-s", "30")
    script = _hearing_worker(tmp_path)
    cmd = launcher_cmd(1, 0, 2, endpoint=d.endpoint, token_file=d.token_file, job=job_id)
    log = tmp_path / "launcher.err"
    with log.open("w") as err, _heard(signal.SIGTERM):
        launcher = subprocess.Popen([*cmd, "--backend", "cpu", str(script)], stderr=err)
    try:
        ready = [tmp_path / f"ready-{rank}" for rank in range(2)]
        wait_for("both workers", lambda: all(f.exists() for f in ready), 60)
        os.kill(d.proc.pid, fate)
        launcher.send_signal(signal.SIGTERM)
        heard = [tmp_path / f"heard-{rank}" for rank in range(2)]
        # A bound well under the outage window the workers waited through, not a speed.
        wait_for("both workers to hear the SIGTERM", lambda: all(f.exists() for f in heard), 5)
        # Its goodbye to the silent daemon then held its exit 6.5 s (the stream's
        # goodbye waited, then a final Leave call): now 1 s at most, said in one line
        # (below). The bound leaves room for a loaded runner (the exit took over 3 s at
        # load 14; 1.2-1.5 s idle): the line is what fails on the old code.
        assert launcher.wait(6) == 128 + signal.SIGTERM, log.read_text()
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
        with contextlib.suppress(ProcessLookupError):
            os.kill(d.proc.pid, signal.SIGCONT)
    said = log.read_text()
    assert "got SIGTERM: stopping this node's workers" in said, said
    assert "Traceback" not in said, said  # the abort, still waiting, ends with the process
    untold = f"could not tell the daemon at {d.endpoint} that node 0 of job {job_id!r} left: "
    assert said.count("could not tell the daemon") == 1 and untold in said, said


@pytest.mark.parametrize("fate", [signal.SIGSTOP, signal.SIGKILL], ids=["stopped", "killed"])
def test_a_launcher_stopped_while_its_failure_report_waits_on_a_silent_daemon_stops_at_once(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path, fate: int
) -> None:
    # A worker fails while the daemon does not answer: the agent's report of it waited
    # out the SDK's outage window (12 s measured) on the agent's loop, and a SIGTERM
    # meanwhile was acted on only after it, the node's other worker training on.
    d = start_daemon("--heartbeat-timeout-s", "10")
    script = tmp_path / "w.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "from rendezvousd.trainer.distributed import init_distributed\n"
        "def heard(signum, frame):\n"
        f"    open('{tmp_path}/heard-' + os.environ['LOCAL_RANK'], 'w').close()\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, heard)\n"
        "with init_distributed() as ctx:\n"
        f"    open('{tmp_path}/ready-' + str(ctx.rank), 'w').close()\n"
        f"    while not (ctx.rank == 1 and os.path.exists('{tmp_path}/fail')):\n"
        "        time.sleep(0.02)\n"
        "    os._exit(3)\n"
    )
    cmd = launcher_cmd(1, 0, 2, endpoint=d.endpoint, token_file=d.token_file, job=job_id)
    log = tmp_path / "launcher.err"
    with log.open("w") as err, _heard(signal.SIGTERM):
        launcher = subprocess.Popen([*cmd, "--backend", "cpu", str(script)], stderr=err)
    try:
        ready = [tmp_path / f"ready-{rank}" for rank in range(2)]
        wait_for("both workers", lambda: all(f.exists() for f in ready), 60)
        os.kill(d.proc.pid, fate)
        (tmp_path / "fail").touch()
        wait_for("the failure heard", lambda: "failed first" in log.read_text(), 10)
        launcher.send_signal(signal.SIGTERM)
        # The bound a scheduler's grace needs, well under the outage window.
        wait_for("rank 0 to hear the SIGTERM", (tmp_path / "heard-0").exists, 3)
        # Room for a loaded runner (over 5 s at load 14): before, the report's give-up
        # ended it as the failure (exit 3, after 15 s), which the status still catches.
        assert launcher.wait(10) == 128 + signal.SIGTERM, log.read_text()
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
        with contextlib.suppress(ProcessLookupError):
            os.kill(d.proc.pid, signal.SIGCONT)
    said = log.read_text()
    assert "worker rank 1 (pid" in said and "got SIGTERM: stopping this node's workers" in said
    assert "Traceback" not in said and "could not report the failure" not in said, said


def _failing_pair(
    d: DaemonProcess, job_id: str, tmp_path: Path, log: Path
) -> subprocess.Popen[bytes]:
    """A launcher of two CPU workers that hear SIGTERM (``heard-R``); rank 1 exits 3
    once ``fail`` exists, saying so first (``failing``). No restart."""
    script = tmp_path / "w.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "from rendezvousd.trainer.distributed import init_distributed\n"
        "def heard(signum, frame):\n"
        f"    open('{tmp_path}/heard-' + os.environ['LOCAL_RANK'], 'w').close()\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, heard)\n"
        "with init_distributed() as ctx:\n"
        f"    open('{tmp_path}/ready-' + str(ctx.rank), 'w').close()\n"
        f"    while not (ctx.rank == 1 and os.path.exists('{tmp_path}/fail')):\n"
        "        time.sleep(0.02)\n"
        f"    open('{tmp_path}/failing', 'w').close()\n"
        "    os._exit(3)\n"
    )
    cmd = launcher_cmd(1, 0, 2, endpoint=d.endpoint, token_file=d.token_file, job=job_id)
    cmd += ["--backend", "cpu", "--max-restarts", "0", str(script)]
    with log.open("w") as err, _heard(signal.SIGTERM):
        return subprocess.Popen(cmd, stderr=err)


@pytest.mark.parametrize("fate", [signal.SIGSTOP, signal.SIGKILL], ids=["stopped", "killed"])
def test_a_failure_at_a_silent_daemon_stops_the_other_workers_without_waiting_out_the_report(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path, fate: int
) -> None:
    # A worker fails while the daemon does not answer: its report held the stop of the
    # node's other worker for the SDK's outage window (12 s measured), that worker left
    # in collectives that could not complete. A stopped daemon let go within that window
    # still hears the report first: its record names the failed worker.
    from rendezvousd.client import RendezvousClient

    d = start_daemon("--heartbeat-timeout-s", "10")
    log = tmp_path / "launcher.err"
    launcher = _failing_pair(d, job_id, tmp_path, log)
    try:
        ready = [tmp_path / f"ready-{rank}" for rank in range(2)]
        wait_for("both workers", lambda: all(f.exists() for f in ready), 60)
        os.kill(d.proc.pid, fate)
        (tmp_path / "fail").touch()
        wait_for("rank 1 to fail", (tmp_path / "failing").exists, 10)
        # The bound the report's hold promises (1 s), well under the outage window.
        wait_for("rank 0 to be stopped", (tmp_path / "heard-0").exists, 3)
        if fate == signal.SIGSTOP:
            os.kill(d.proc.pid, signal.SIGCONT)  # back within its window
        assert launcher.wait(60) == 3, log.read_text()  # the worker's status
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
        with contextlib.suppress(ProcessLookupError):
            os.kill(d.proc.pid, signal.SIGCONT)
    said = log.read_text()
    unconfirmed = f"the daemon at {d.endpoint} did not confirm the failure report within 1 s: "
    assert said.count(unconfirmed) == 1, said
    assert said.index(unconfirmed) < said.index("stopping this node's workers: "), said
    assert "Traceback" not in said, said
    if fate == signal.SIGSTOP:
        assert "could not report the failure" not in said, said
        with RendezvousClient(d.endpoint, job_id, token=d.token) as probe:
            failed = probe.get_job().failed
        assert failed[0].rank == 1 and "exit code 3" in failed[0].cause, failed
    else:
        assert "could not report the failure to the daemon" in said, said


def test_a_signal_while_a_failure_report_goes_on_past_the_stop_ends_the_launcher_at_once(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path
) -> None:
    # The workers stopped, the report to the stopped daemon goes on: a SIGTERM then is
    # the signal's stop (128 + N, at once), not the failure's exit once the window ends.
    d = start_daemon("--heartbeat-timeout-s", "10")
    log = tmp_path / "launcher.err"
    launcher = _failing_pair(d, job_id, tmp_path, log)
    try:
        ready = [tmp_path / f"ready-{rank}" for rank in range(2)]
        wait_for("both workers", lambda: all(f.exists() for f in ready), 60)
        os.kill(d.proc.pid, signal.SIGSTOP)
        (tmp_path / "fail").touch()
        wait_for("rank 0 to be stopped", (tmp_path / "heard-0").exists, 10)
        launcher.send_signal(signal.SIGTERM)
        # Its abort and goodbye wait 0.5 s and 1 s at most; the window had 9 s left.
        assert launcher.wait(5) == 128 + signal.SIGTERM, log.read_text()
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
        with contextlib.suppress(ProcessLookupError):
            os.kill(d.proc.pid, signal.SIGCONT)
    said = log.read_text()
    assert "got SIGTERM: stopping this node's workers" in said, said
    assert "Traceback" not in said and "could not report the failure" not in said, said


def test_a_ctrl_c_to_a_standalone_run_ends_its_workers_at_once_and_says_nothing_of_its_daemon(
    tmp_path: Path,
) -> None:
    # A terminal's Ctrl-C goes to the launcher's whole process group. Its private daemon
    # was in that group and died first; the launcher's abort then waited 10 s for it
    # before its workers heard the SIGINT, and it said it "could not tell the daemon".
    script = _hearing_worker(tmp_path)
    with tempfile.TemporaryDirectory(prefix="rdzv-") as name, _heard(signal.SIGINT):
        launcher = subprocess.Popen(
            [*_standalone(2), str(script)],
            env={**os.environ, "TMPDIR": name},
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own group, as a terminal's foreground job
        )
        try:
            ready = [tmp_path / f"ready-{rank}" for rank in range(2)]
            wait_for("both workers", lambda: all(f.exists() for f in ready), 60)
            os.killpg(launcher.pid, signal.SIGINT)
            heard = [tmp_path / f"heard-{rank}" for rank in range(2)]
            wait_for("both workers to hear the Ctrl-C", lambda: all(f.exists() for f in heard), 5)
            _, err = launcher.communicate(timeout=30)
        finally:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait(10)
        left = list(Path(name).iterdir())
    assert launcher.returncode == 128 + signal.SIGINT, err
    assert "got SIGINT: stopping this node's workers" in err, err
    assert "could not tell the daemon" not in err, err
    assert "DEADLINE_EXCEEDED" not in err, err
    assert "Traceback" not in err, err
    assert left == [], err


@pytest.mark.parametrize("flags", [["--standalone"], []])
def test_standalone_is_the_file_transport_hosted_by_the_launcher(
    tmp_path: Path, flags: list[str]
) -> None:
    # One way to run a single node: its daemon listens on a UNIX socket in a private
    # directory (here the one given), never on TCP, and goes when the launcher ends.
    script = tmp_path / "where.py"
    script.write_text(
        "import json\n"
        "from rendezvousd.trainer.distributed import init_distributed\n"
        "with init_distributed() as ctx:\n"
        f"    open('{tmp_path}/seen-' + str(ctx.rank), 'w').write(\n"
        "        json.dumps([ctx.rank, ctx.config.rendezvous.endpoint]))\n"
    )
    directory = tmp_path / "rdzv"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "rendezvousd.trainer.agent.launcher",
            *flags,
            "--rendezvous-path",
            str(directory),
            "--nproc-per-node",
            "2",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    seen = [json.loads((tmp_path / f"seen-{rank}").read_text()) for rank in range(2)]
    socket_path = f"unix:{directory.resolve()}/default.sock"
    assert seen == [[0, socket_path], [1, socket_path]]
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert list(directory.iterdir()) == []  # socket and token removed with the daemon


@pytest.mark.parametrize("max_restarts", [1, 0])
def test_under_the_launcher_a_transient_setup_failure_is_retried_by_the_agents_restart(
    tmp_path: Path, max_restarts: int
) -> None:
    # The one retry model: the agent joined for the node, so its restart (a fresh
    # generation) is the retry; with none left the run fails naming the worker's error.
    run = subprocess.run(
        [
            *_standalone(1, "--max-restarts", str(max_restarts)),
            str(WORKERS / "flaky_setup_worker.py"),
            str(tmp_path / "failed-once"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "PeerConnectionError: injected" in run.stderr, run.stderr
    if max_restarts:
        assert run.returncode == 0, run.stderr
        rank, generation, restarts = json.loads(run.stdout.splitlines()[-1])
        assert (rank, restarts) == (0, 1) and generation >= 2
    else:
        assert run.returncode != 0 and not run.stdout


def test_launcher_sets_torchrun_style_environment(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path
) -> None:
    # Read at import time, as torchrun scripts do, and again after init_distributed.
    script = tmp_path / "env.py"
    out = tmp_path / "env"
    script.write_text(
        "import json, os\n"
        "from rendezvousd.trainer.distributed import init_distributed\n"
        f"NAMES = {TORCHRUN_NAMES!r}\n"
        "at_start = {k: os.environ.get(k) for k in NAMES}\n"
        "ctx = init_distributed()\n"
        "after = {k: os.environ.get(k) for k in NAMES}\n"
        f"open('{out}-' + str(ctx.rank), 'w').write(json.dumps([at_start, after]))\n"
        "ctx.close()\n"
    )
    d = start_daemon()
    nodes = [
        subprocess.Popen(
            [
                *launcher_cmd(2, n, 2, endpoint=d.endpoint, token_file=d.token_file, job=job_id),
                str(script),
            ],
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in range(2)
    ]
    errs = stderr_of_all(nodes)
    assert [n.returncode for n in nodes] == [0, 0], errs
    for rank in range(4):
        at_start, after = json.loads(Path(f"{out}-{rank}").read_text())
        expected = {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank % 2),
            "WORLD_SIZE": "4",
            "LOCAL_WORLD_SIZE": "2",
            "NODE_RANK": str(rank // 2),
        }
        assert at_start == expected and after == expected, (rank, at_start, after)


@pytest.mark.parametrize("stop", ["SIGKILL", "SIGTERM"])
def test_daemon_stop_and_restart_during_training_run_still_succeeds(
    tmp_path: Path, stop: str
) -> None:
    """A daemon killed, or stopped by SIGTERM (a restart, an upgrade: it drains, ends
    its streams and answers late calls "not run"), and started again with its state
    mid-run: the run goes on to its last step with the single-process gradients."""
    port = free_port()
    token_file = tmp_path / "tok"
    token = write_token(token_file)
    # Long enough for the new daemon process to start on a loaded CI machine: the
    # agents give up when the daemon stays silent for a whole heartbeat timeout.
    flags = ("--state-dir", str(tmp_path / "state"), "--heartbeat-timeout-s", "15")
    d = spawn_daemon(tmp_path, *flags, token=token, listen=f"127.0.0.1:{port}")
    results = tmp_path / "results"
    nodes = [
        subprocess.Popen(
            [
                *launcher_cmd(2, n, 2, endpoint=d.endpoint, token_file=token_file),
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
        if stop == "SIGKILL":
            d.kill()  # returns once the process is gone
        else:
            assert d.terminate(30) == 0, d.log()
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
            sys.executable,
            "-m",
            "rendezvousd.trainer.agent.launcher",
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
                *launcher_cmd(2, rank, 1, endpoint=d.endpoint, token_file=d.token_file, job=job_id),
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
                # Node 0's JoinNode created the job (its members exist once it forms).
                with contextlib.suppress(RendezvousError):
                    probe.get_job(job_id)
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
    # Not known when the agent started the worker: init_distributed set it from the
    # daemon's assignment, before the script read it.
    assert auto["env_rank"] == "1"


@pytest.mark.parametrize("chosen", [None, "3"])
def test_several_workers_of_a_node_get_one_thread_each_unless_the_user_chose(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path, chosen: str | None
) -> None:
    d = start_daemon()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if chosen is not None:
        env["OMP_NUM_THREADS"] = chosen
    run = subprocess.run(
        [
            *launcher_cmd(1, 0, 2, endpoint=d.endpoint, token_file=d.token_file, job=job_id),
            str(WORKERS / "trainer_worker.py"),
            str(tmp_path / "stop"),
            "--ready-only",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    ready = [e for e in map(json.loads, run.stdout.splitlines()) if e["event"] == "ready"]
    assert [e["threads"] for e in ready] == [chosen or "1"] * 2
    told = "OMP_NUM_THREADS=1 for each of the 2 workers of this node" in run.stderr
    assert told == (chosen is None), run.stderr


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


def test_a_standalone_launcher_removes_what_a_killed_one_left(tmp_path: Path) -> None:
    # A SIGKILLed --standalone launcher never ran its clean-up: its directory, with
    # its token, stayed in the temp dir. The next one removes it; nothing live or new.
    # A short temp dir: a UNIX socket's path must fit in 107 bytes.
    with tempfile.TemporaryDirectory(dir="/tmp") as short:
        _standalone_sweep(tmp_path, Path(short))


def _standalone_sweep(tmp_path: Path, temp: Path) -> None:
    dead, live, young, other = (
        temp / name
        for name in ("rendezvous-run-dead", "rendezvous-run-live", "rendezvous-run-new", "mine")
    )
    for folder in (dead, live, young, other):
        folder.mkdir(mode=0o700)
    (dead / "default.token").write_text("left behind")
    with socket.socket(socket.AF_UNIX) as gone:
        gone.bind(str(dead / "default.sock"))  # nothing listens on it once closed
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(live / "default.sock"))
        listening.listen()
        hour_ago = time.time() - 3600
        for folder in (dead, live, other):
            os.utime(folder, (hour_ago, hour_ago))
        script = tmp_path / "ok.py"
        script.write_text(
            "from rendezvousd.trainer.distributed import init_distributed\n"
            "with init_distributed():\n    pass\n"
        )
        run = subprocess.run(
            [*_standalone(1), str(script)],
            env={**os.environ, "TMPDIR": str(temp)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in temp.iterdir()) == sorted(p.name for p in (live, young, other))


def test_file_transport_workers_say_what_they_wait_for(tmp_path: Path) -> None:
    """A local_rank 0 started late, then a rank missing: the others said nothing for the
    whole join timeout (600 s by default) where a daemon's joins say what they wait for."""
    # Short: a unix socket's path is at most 107 bytes.
    rdzv = Path(tempfile.mkdtemp(prefix="rdzv-"))
    job_id = "notes"
    env = {k: v for k, v in os.environ.items() if k != "RENDEZVOUSD_CONFIG"}
    env |= {
        "RENDEZVOUSD_RENDEZVOUS_PATH": str(rdzv),
        "RENDEZVOUSD_JOB_ID": job_id,
        "RENDEZVOUSD_NUM_NODES": "1",
        "RENDEZVOUSD_GPUS_PER_NODE": "3",
        "RENDEZVOUSD_NODE_RANK": "0",
    }
    stop = tmp_path / "stop"
    errs = [tmp_path / f"w{i}.err" for i in range(3)]
    procs: dict[int, subprocess.Popen[str]] = {}

    def start(local: int) -> None:
        with errs[local].open("w") as err:
            procs[local] = subprocess.Popen(
                [sys.executable, str(WORKERS / "trainer_worker.py"), str(stop), "--ready-only"],
                env={**env, "RENDEZVOUSD_LOCAL_RANK": str(local)},
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )

    try:
        start(1)
        socket_note = f"local_rank 1 of job '{job_id}' still waiting after 5 s for local_rank 0's"
        wait_for("the socket note", lambda: socket_note in errs[1].read_text(), timeout=30)
        said = errs[1].read_text()
        assert f"rendezvous socket at {rdzv / job_id}.sock" in said, said
        start(0)
        join_note = f"still waiting for job '{job_id}' generation 1 to form after"
        wait_for("the join note", lambda: join_note in errs[0].read_text(), timeout=30)
        said = errs[0].read_text()
        assert "2 of 3 ranks joined, missing rank 2" in said, said
        # The lowest local rank of the host speaks for it: local rank 1 keeps quiet.
        assert join_note not in errs[1].read_text()
        start(2)
        outs = [procs[i].communicate(timeout=60)[0] for i in range(3)]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(10)
        shutil.rmtree(rdzv, ignore_errors=True)
    assert [procs[i].returncode for i in range(3)] == [0, 0, 0], [e.read_text() for e in errs]
    ready = [json.loads(out.splitlines()[0]) for out in outs]
    assert sorted(r["rank"] for r in ready) == [0, 1, 2]
