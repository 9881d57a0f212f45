"""rendezvous-run with real workers and a real daemon: the root cause it names, its
workers dying with it, and resume from rank 0's checkpoints on node-local disks."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support import (
    ROOT,
    WORKERS,
    ClosedDoor,
    DaemonProcess,
    free_port,
    launcher_cmd,
    parallel,
    run_launcher,
    run_script_node,
    spawn_daemon,
    stderr_of_all,
    unstamped,
    wait_for,
    with_own_mounts,
    write_token,
)

SMOKE = ROOT / "trainer" / "configs" / "multinode_smoke.toml"


def _launch_node(d: DaemonProcess, job: str, node: int, stop: Path) -> subprocess.Popen[str]:
    """One simulated node of 2 running tests/workers/trainer_worker.py; the
    workers' JSON lines come out on the launcher's stdout (they inherit it)."""
    return subprocess.Popen(
        [
            *launcher_cmd(2, node, 2, endpoint=d.endpoint, token_file=d.token_file, job=job),
            "--config",
            str(SMOKE),
            str(WORKERS / "trainer_worker.py"),
            str(stop),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@contextmanager
def _nodes(
    d: DaemonProcess, job: str, stop: Path, node_ranks: Sequence[int] = (0, 1)
) -> Iterator[list[subprocess.Popen[str]]]:
    """Simulated nodes (``_launch_node``); on the way out their workers are told to stop
    and any launcher still running is killed."""
    nodes = [_launch_node(d, job, n, stop) for n in node_ranks]
    try:
        yield nodes
    finally:
        stop.touch()
        for n in nodes:
            if n.poll() is None:
                n.kill()


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


Running = tuple[list[subprocess.Popen[str]], dict[int, int]]


@pytest.fixture
def running(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path
) -> Iterator[Running]:
    """Two simulated nodes with every worker in its loop, and their pids by global
    rank, under a daemon that loses a silent member after 5 s."""
    d = start_daemon("--heartbeat-timeout-s", "5")
    with _nodes(d, job_id, tmp_path / "stop") as nodes:
        yield nodes, _running_pids(nodes)


def test_every_launcher_names_the_sigkilled_rank_and_its_host_as_root_cause(
    running: Running,
) -> None:
    nodes, pids = running
    os.kill(pids[3], signal.SIGKILL)
    outs = [n.communicate(timeout=30) for n in nodes]
    host = socket.gethostname()
    for i, (n, (_, err)) in enumerate(zip(nodes, outs, strict=True)):
        assert n.returncode != 0, err
        causes = [line for line in err.splitlines() if "root cause:" in line]
        assert len(causes) == 1, err
        # The daemon's record, on both nodes: the killed rank, not a sibling that
        # failed right after it with PeerFailed; node 1 names it as its own.
        here = ", this node," if i == 1 else ""
        assert re.search(
            rf"root cause: rank 3 \(node 1, local rank 1\) on host {re.escape(host)}{here} "
            r"was lost \(.+\)",
            causes[0],
        ), err
    # Node 1 saw the kill itself: its first local failure is rank 3, not rank 2.
    assert "worker rank 3 (pid" in outs[1][1] and "signal SIGKILL" in outs[1][1], outs[1][1]
    assert nodes[1].returncode == 128 + signal.SIGKILL


def test_a_failure_inside_init_distributed_is_the_root_cause_named(
    start_daemon: Callable[..., DaemonProcess],
    job_id: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before the ``with`` block nothing reported it: the summary and the root cause
    said only "exit code 1". NCCL without a visible device fails in its init, here as
    on a GPU machine."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    d = start_daemon()
    source = (
        "from rendezvousd.trainer import init_distributed\n"
        "with init_distributed() as ctx:\n"
        "    pass\n"
    )
    script = tmp_path / "ok.py"
    script.write_text(source)
    cmd = launcher_cmd(1, 0, 1, endpoint=d.endpoint, token_file=d.token_file, job=job_id)
    run = run_launcher([*cmd, "--backend", "nccl", str(script)], timeout=120)
    assert run.returncode != 0, run.stderr
    causes = [line for line in run.stderr.splitlines() if "root cause:" in line]
    assert len(causes) == 1, run.stderr
    assert "was lost (" in causes[0] and "exit code 1)" not in causes[0], run.stderr
    assert re.search(
        r"was lost \((CommunicatorError|DeviceError|ConfigError|ImportError)", causes[0]
    ), causes


def test_a_ring_host_this_host_cannot_listen_on_is_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Each worker died with a raw socket.gaierror, reported as "exit code 1"."""
    from rendezvousd.trainer.agent import launcher

    script = tmp_path / "ok.py"
    script.write_text("pass\n")
    for host in ("bad host", "198.18.255.254"):
        status = launcher.main(
            ["--standalone", "--ring-host", host, "--nproc-per-node", "1", str(script)]
        )
        err = capsys.readouterr().err
        assert status == 2, err
        assert f"ring_host={host!r} cannot be listened on here" in err, err


def test_a_worker_raising_a_long_multiline_error_is_every_launchers_root_cause(
    start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    # The documented ``with init_distributed()`` form: rank 3 raises, its peers' ring
    # breaks and they exit too. The daemon must take the raiser's report (any length,
    # newlines included) first, not record the healthy rank 0 that exited after it.
    d = start_daemon()
    nodes = [
        subprocess.Popen(
            [
                *launcher_cmd(2, n, 2, endpoint=d.endpoint, token_file=d.token_file, job=job_id),
                "--config",
                str(SMOKE),
                str(WORKERS / "raising_worker.py"),
                "3",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in range(2)
    ]
    outs = stderr_of_all(nodes)
    host = re.escape(socket.gethostname())
    for i, (n, err) in enumerate(zip(nodes, outs, strict=True)):
        assert n.returncode != 0, err
        causes = [line for line in err.splitlines() if "root cause:" in line]
        assert len(causes) == 1, err
        # Shown on one line, escaped and shortened; the record keeps it whole.
        here = ", this node," if i == 1 else ""
        assert re.search(
            rf"root cause: rank 3 \(node 1, local rank 1\) on host {host}{here} was lost "
            r"\(RuntimeError: line1\\x0aline2x+",
            causes[0],
        ), err
        assert len(causes[0]) < 1000, causes[0]


# Escaped, 103 characters: whole within the 120 shown, and over them with "exit code 1
# after " folded in, as the node of the raising worker showed it.
RAISED = "CUDA-ish failure at step 20\n  line two: details\n  line three: hint <tag>\x1b[31mred"


def test_the_node_whose_worker_raised_words_its_cause_as_every_other_node(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path
) -> None:
    """Node 1's worker raises a multi-line error holding an ESC. Its own launcher said
    "exit code 1 after RuntimeError: ...\\x1b[31mre... (1 more characters)", its exit
    folded into the cause and cut with it, where the daemon, node 0 and both root-cause
    lines said "RuntimeError: ...\\x1b[31mred": now every surface shows the cause alike,
    and only node 1's own lines add the exit it saw, before it."""
    d = start_daemon()
    source = (
        "import numpy as np\n"
        "from rendezvousd.trainer import init_distributed\n"
        "with init_distributed() as ctx:\n"
        "    ctx.communicator.all_reduce(np.ones(4, dtype=np.float32))\n"
        "    if ctx.rank == 1:\n"
        f"        raise RuntimeError({RAISED!r})\n"
        "    while True:\n"
        "        ctx.communicator.all_reduce(np.ones(4, dtype=np.float32))\n"
    )
    script = tmp_path / "raiser.py"
    script.write_text(source)
    nodes = [
        subprocess.Popen(
            [
                *launcher_cmd(2, n, 1, endpoint=d.endpoint, token_file=d.token_file, job=job_id),
                str(script),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in range(2)
    ]
    outs = stderr_of_all(nodes)
    host = socket.gethostname()
    cause = "(RuntimeError: " + RAISED.replace("\n", "\\x0a").replace("\x1b", "\\x1b") + ")"
    lost = f"lost rank 1 on {host} {cause}"
    stopping = (
        f"rendezvous-run: stopping this node's workers: PeerFailed: job {job_id!r} "
        f"generation 1 failed: {lost}"
    )
    for err in outs:
        lines = unstamped(err).splitlines()
        assert stopping in lines, err
        root = [line for line in lines if "root cause:" in line]
        assert len(root) == 1 and root[0].endswith(f" was lost {cause}"), err
        assert "characters cut" not in err and " after RuntimeError" not in err, err
    assert nodes[1].returncode == 1, outs[1]
    for n, err in enumerate(outs):
        # The failures were listed whole just above: the last line says how it ended.
        assert _last_line(err) == (
            f"rendezvous-run: job {job_id!r} node {n} gave up after 0 of 0 restarts "
            "(1 failure, listed above) (exit 1)"
        ), err
    assert re.search(
        rf"^rendezvous-run: worker rank 1 \(pid \d+\) failed first, with exit code 1 "
        rf"{re.escape(cause)}$",
        unstamped(outs[1]),
        re.MULTILINE,
    ), outs[1]
    assert f"  1. generation 1: rank 1 on host {host}: exit code 1 {cause}" in outs[1], outs[1]
    assert f"  1. generation 1: rank 1 on host {host}: {stopping.split(': ', 2)[2]}" in outs[0]
    assert f"RUNNING -> FAILED (rank 1 on {host} {cause})" in d.log(), d.log()


@pytest.mark.parametrize("who", ["every worker", "one worker"])
def test_a_worker_that_exits_0_without_init_distributed_fails_the_run(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path, who: str
) -> None:
    """Its assignment sent, never taken: it did not train. With the job formed before
    it exited, the exit counted as a success: every worker's run passed (rc 0), and one
    worker's left the other waiting --setup-timeout-s for its ring address, then
    blaming itself (rank 0)."""
    d = start_daemon()
    source = (
        "import os, sys, time\n"
        "import numpy as np\n"
        f"if {who == 'every worker'} or os.environ['LOCAL_RANK'] == '1':\n"
        "    time.sleep(2)\n"  # the job has formed: this worker is assigned
        "    sys.exit(0)\n"
        "from rendezvousd.trainer.distributed import init_distributed\n"
        "with init_distributed() as ctx:\n"
        "    ctx.communicator.all_reduce(np.ones(4, dtype=np.float32))\n"
    )
    started = time.monotonic()
    run = run_script_node(d, job_id, tmp_path / "w.py", source, "--setup-timeout-s", "30")
    assert run.returncode == 1, run.stderr
    cause = "exit code 0 without calling init_distributed()"
    assert re.search(rf"root cause: rank [01] \(node 0.*{re.escape(cause)}", run.stderr)
    if who == "one worker":
        assert "root cause: rank 1 (node 0, local rank 1) on host" in run.stderr, run.stderr
        assert time.monotonic() - started < 25, "the others waited out the setup timeout"


@pytest.mark.parametrize(
    ("target", "said"),
    [
        (["no_such_script.py"], "the script 'no_such_script.py' does not exist"),
        (["-m", "no_such_module.main"], "no module named 'no_such_module' to run"),
    ],
)
def test_a_target_no_worker_can_start_is_refused_before_any_starts(
    start_daemon: Callable[..., DaemonProcess],
    job_id: str,
    tmp_path: Path,
    target: list[str],
    said: str,
) -> None:
    """Each worker failed at start with runpy's traceback (FileNotFoundError, or
    ModuleNotFoundError), and each failure used a restart: three tracebacks and
    "gave up after 2 restarts" for --max-restarts 2."""
    d = start_daemon()
    run = run_launcher(
        [*launcher_cmd(1, 0, 1, endpoint=d.endpoint, token_file=d.token_file, job=job_id),
         "--max-restarts", "2", *target],
        timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert f"rendezvous-run: error: {said}" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and "restart" not in run.stderr, run.stderr


def test_sigkilled_launcher_takes_its_workers_down_and_the_other_node_is_told(
    running: Running,
) -> None:
    nodes, pids = running
    nodes[1].kill()
    nodes[1].wait(10)
    wait_for(
        "node 1's workers to die with their launcher",
        lambda: all(_gone(pids[r]) for r in (2, 3)),
        timeout=3,
    )
    _out, err = nodes[0].communicate(timeout=30)
    # Node 0's agent heard it from the daemon (the node's stream was cut), stopped
    # its own workers, and without restarts left names the lost ranks and gives up.
    assert nodes[0].returncode == 1, err
    assert "gave up after 0 restarts" in err and "heartbeat stream was cut" in err, err
    assert re.search(r"root cause: rank [23] .* was lost", err), err


TINY = ("--samples", "128", "--features", "8", "--hidden", "16", "--batch", "8")


def _train(d: DaemonProcess, job: str, run: Path, steps: int, *extra: str) -> list[str]:
    """2 simulated nodes x 2 workers of the example through rendezvous-run, each
    node with its own checkpoint directory (node-local disks); the launchers'
    stderr. Results land in ``run``/results, checkpoints in ``run``/node-N."""
    nodes = [
        subprocess.Popen(
            [
                *launcher_cmd(2, n, 2, endpoint=d.endpoint, token_file=d.token_file, job=job),
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


def _standalone_example(world: int, run: Path, log: Path, steps: int, *extra: str) -> str:
    """``world`` workers of the example under ``rendezvous-run --standalone`` (its own
    daemon), appending to the step log ``log``; the launcher's stderr."""
    done = subprocess.run(
        [
            sys.executable, "-m", "rendezvousd.trainer.agent.launcher", "--standalone",
            "--nproc-per-node", str(world), "--backend", "cpu",
            "-m", "rendezvousd.trainer.example",
            "--samples", "96", "--features", "4", "--hidden", "8", "--batch", "8",
            "--steps", str(steps), "--checkpoint-dir", str(run / "ckpt"),
            "--checkpoint-every", "0", "--step-log", str(log), *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_a_resume_at_another_world_size_sees_every_sample_of_each_epoch_once(
    tmp_path: Path,
) -> None:
    # 96 samples, 8 per rank per step. World 2: 6 steps per epoch; 9 steps end half-way
    # through epoch 1 (48 of its samples taken). World 3 has 4 steps per epoch, so by the
    # step alone it resumed at epoch 2, batch 1: epoch 1's other half was never
    # trained and epoch 2's first batch skipped. By the cursor it trains the 48 left
    # in 2 steps, then epoch 2 in 4.
    log = tmp_path / "steps.jsonl"
    _standalone_example(2, tmp_path, log, 9)
    err = _standalone_example(3, tmp_path, log, 15, "--resume")
    assert "resume: step 9 from rank 0" in err, err
    assert "no data cursor" not in err, err
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted({(line["step"], line["rank"]) for line in lines}) == sorted(
        [(s, r) for s in range(1, 10) for r in range(2)]
        + [(s, r) for s in range(10, 16) for r in range(3)]
    )
    for epoch in range(3):
        taken = sorted(i for line in lines if line["epoch"] == epoch for i in line["samples"])
        assert taken == list(range(96)), (epoch, len(taken), len(set(taken)))


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
            *launcher_cmd(2, 1, 2),
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


def test_a_join_the_daemon_refuses_for_its_token_uses_no_restart(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path
) -> None:
    """A join refused for what the node sent ends the launcher at once: it used to be
    refused again and again within half a second, use up --max-restarts and advise
    raising them. (The worker waits for a rank it never gets: a script ending first
    would be a failure of its own, counted before the refusal.)"""
    d = start_daemon()
    wrong = tmp_path / "wrong-token"
    write_token(wrong)
    script = tmp_path / "w.py"
    script.write_text(
        "from rendezvousd.trainer.distributed import init_distributed\n"
        "with init_distributed():\n    pass\n"  # waits for its rank: it never gets one
    )
    run = run_launcher(
        [*launcher_cmd(1, 0, 1, endpoint=d.endpoint, token_file=str(wrong), job=job_id),
         "--max-restarts", "3", str(script)],
        timeout=60,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr  # the setup's error, as a bad setting: was 1
    assert "gave up after 0 restarts (max_restarts=3); 1 failure" in run.stderr, run.stderr
    assert "joining failed: AuthenticationError" in run.stderr, run.stderr
    assert "no restart can change that" in run.stderr, run.stderr
    assert "raise --max-restarts" not in run.stderr, run.stderr


def test_a_node_rank_another_node_holds_uses_no_restart_and_says_to_give_distinct_ranks(
    daemon: DaemonProcess, job_id: str, tmp_path: Path
) -> None:
    """Two nodes started with the same --node-rank: the second's join was refused
    DuplicateRank again and again within milliseconds, used up --max-restarts, and the
    summary advised raising them, which cannot help."""
    from rendezvousd.client import NotFound, RendezvousClient

    script = tmp_path / "w.py"
    script.write_text(
        "from rendezvousd.trainer.distributed import init_distributed\n"
        "with init_distributed():\n    pass\n"
    )
    node = [*launcher_cmd(2, 0, 1, endpoint=daemon.endpoint, token_file=daemon.token_file,
                          job=job_id), "--join-timeout-s", "60"]  # fmt: skip
    first = subprocess.Popen([*node, str(script)], stderr=subprocess.DEVNULL)
    try:

        def first_joined() -> bool:
            with RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as probe:
                try:
                    return probe.get_job().id_published
                except NotFound:
                    return False

        wait_for("node 0 to join", first_joined, timeout=30)
        # On a host of its own name (a UTS namespace): the same host's holder may be
        # this agent's own predecessor, whose seat a restart can still get.
        other_host = ["unshare", "--uts", "sh", "-c", 'hostname node-b && exec "$@"', "sh"]
        run = run_launcher([*other_host, *node, "--max-restarts", "3", str(script)], timeout=60)
        started = time.monotonic()
        same_host = run_launcher(
            [*node, "--join-timeout-s", "3", "--max-restarts", "1", str(script)], timeout=60
        )
        waited = time.monotonic() - started
    finally:
        first.terminate()
        first.wait(30)
    assert run.returncode == 2, run.stderr
    assert f"already held by the node agent on {socket.gethostname()}" in run.stderr, run.stderr
    assert "gave up after 0 restarts (max_restarts=3); 1 failure" in run.stderr, run.stderr
    assert "joining failed: DuplicateRank" in run.stderr, run.stderr
    assert "give each node a distinct --node-rank (0..1)" in run.stderr, run.stderr
    # Refused while the job forms, with no heartbeat to tell a live twin from a frozen
    # predecessor: a node relaunched off a frozen host is told what to do too.
    assert "If this node instead replaces that one (moved off a host that froze" in run.stderr
    assert "start this node again once the job formed" in run.stderr, run.stderr
    assert "no restart can change that" in run.stderr, run.stderr
    assert "raise --max-restarts" not in run.stderr, run.stderr
    assert daemon.token not in run.stderr
    # A holder on this very host may be the agent's predecessor, which the daemon loses
    # in time: asked again for the join's timeout, with no restart used (restarts went
    # in milliseconds); a live holder at the end is as fatal as another host's.
    assert same_host.returncode == 2, same_host.stderr
    assert "is held by the node agent on this host" in same_host.stderr, same_host.stderr
    assert (
        "DuplicateRank" in same_host.stderr
        and "(still held after 3 s of trying)" in same_host.stderr
    )
    assert "gave up after 0 restarts (max_restarts=1)" in same_host.stderr, same_host.stderr
    assert waited >= 3, waited


def test_a_world_over_the_daemons_member_limit_uses_no_restart_and_says_what_to_change(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path
) -> None:
    """The join was refused LimitExceeded again and again within milliseconds, used up
    --max-restarts, and the summary advised raising them; the daemon's message named
    the limit only."""
    d = start_daemon("--max-members-per-job", "2")
    script = tmp_path / "w.py"
    script.write_text(
        "from rendezvousd.trainer.distributed import init_distributed\n"
        "with init_distributed():\n    pass\n"
    )
    run = run_launcher(
        [*launcher_cmd(3, 0, 1, endpoint=d.endpoint, token_file=d.token_file, job=job_id),
         "--max-restarts", "2", str(script)],
        timeout=60,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert "gave up after 0 restarts (max_restarts=2); 1 failure" in run.stderr, run.stderr
    said = "world size 3 (3 nodes x 1 per node) exceeds the daemon's max_members_per_job=2: "
    assert said in run.stderr, run.stderr
    assert "start the daemon with a larger --max-members-per-job" in run.stderr, run.stderr
    assert "no restart can change that" in run.stderr, run.stderr
    assert "raise --max-restarts" not in run.stderr, run.stderr


def test_nodes_of_two_topologies_exit_2_at_once_using_no_restart(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path
) -> None:
    """A node launched with another --nproc-per-node than the job's: the daemon refuses
    it and fails the forming generation, so both nodes hear TopologyMismatch; no restart
    changes it, and it is the launch's error, exit 2 as a bad setting is (was 1)."""
    d = start_daemon()
    script = tmp_path / "w.py"
    script.write_text(
        "from rendezvousd.trainer.distributed import init_distributed\n"
        "with init_distributed():\n    pass\n"
    )
    from rendezvousd.client import NotFound, RendezvousClient

    def node(per_node: int) -> subprocess.Popen[str]:
        cmd = launcher_cmd(2, per_node - 1, per_node, endpoint=d.endpoint,
                           token_file=d.token_file, job=job_id)  # fmt: skip
        return subprocess.Popen(
            [*cmd, "--max-restarts", "2", str(script)], stderr=subprocess.PIPE, text=True
        )

    def parked() -> bool:
        with RendezvousClient(d.endpoint, job_id, token=d.token) as probe:
            try:
                return probe.get_job().id_published
            except NotFound:
                return False

    nodes = [node(1)]
    try:
        wait_for("node 0 to join", parked, timeout=30)
        nodes.append(node(2))
        said = stderr_of_all(nodes)
    finally:
        for n in nodes:
            if n.poll() is None:
                n.kill()
    assert [n.returncode for n in nodes] == [2, 2], said
    for err in said:
        assert "gave up after 0 restarts (max_restarts=2); 1 failure" in err, err
        assert "joining failed: TopologyMismatch" in err, err
        # The generation the daemon names (it refused the join in generation 1, which it
        # failed, and says so): "no generation" contradicted it.
        assert "1. generation 1: node on host " in err and "no generation" not in err, err
        assert "no restart can change that" in err, err


def test_a_missing_target_is_the_one_argument_named_missing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """argparse said "required: target, args"; the target's arguments are optional."""
    from rendezvousd.trainer.agent.launcher import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--nnodes", "1"])
    assert capsys.readouterr().err.rstrip().endswith("the following arguments are required: target")
    assert build_parser().parse_args(["t.py"]).args == []
    assert build_parser().parse_args(["t.py", "--lr", "1"]).args == ["--lr", "1"]


def test_a_daemon_that_never_comes_ends_the_join_at_its_timeout_using_no_restart(
    tmp_path: Path,
) -> None:
    """Each attempt waited connect_timeout (30 s, no flag to set it) and used a restart:
    61 s to give up with --max-restarts 1, both restarts spent on the same refusal."""
    token = tmp_path / "tok"
    write_token(token)
    script = tmp_path / "w.py"
    script.write_text(
        "from rendezvousd.trainer.distributed import init_distributed\n"
        "with init_distributed():\n    pass\n"
    )
    started = time.monotonic()
    run = run_launcher(
        [*launcher_cmd(1, 0, 1, endpoint=f"127.0.0.1:{free_port()}", token_file=token),
         "--connect-timeout-s", "1", "--join-timeout-s", "3", "--max-restarts", "2",
         str(script)],
        timeout=60,
    )  # fmt: skip
    took = time.monotonic() - started
    assert run.returncode == 1, run.stderr
    assert "trying again every 1 s for up to 3 s in all (no restart used)" in run.stderr
    assert "within 1 s (connect_timeout): nothing listens there (connection refused)" in run.stderr
    assert "still unavailable after 3 s of trying" in run.stderr, run.stderr
    assert "gave up after 0 restarts (max_restarts=2); 1 failure" in run.stderr, run.stderr
    assert "no restart can change that" in run.stderr, run.stderr
    assert took < 20, (took, run.stderr)


def test_a_daemon_started_after_the_node_is_waited_for_within_the_join_timeout(
    tmp_path: Path, job_id: str
) -> None:
    """As a node scheduled late is: the daemon's pod may start minutes after the
    workers'. With --max-restarts 0 the first connect_timeout ended the run. It says
    so after 5 s, once: before, it was silent for connect_timeout (30 s by default)."""
    port = free_port()
    token = tmp_path / "tok"
    secret = write_token(token)
    script = tmp_path / "w.py"
    script.write_text(
        "from rendezvousd.trainer.distributed import init_distributed\n"
        "with init_distributed() as ctx:\n    ctx.communicator.barrier()\n"
    )
    cmd = [*launcher_cmd(1, 0, 2, endpoint=f"127.0.0.1:{port}", token_file=token, job=job_id),
           "--connect-timeout-s", "6", "--join-timeout-s", "60", "--max-restarts", "0",
           str(script)]  # fmt: skip
    node = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(9)  # past the note (5 s), the first connect timeout, and retries
        d = spawn_daemon(tmp_path, token=secret, listen=f"127.0.0.1:{port}")
        try:
            _out, err = node.communicate(timeout=60)
        finally:
            d.kill()
    finally:
        node.kill()
    assert node.returncode == 0, err
    assert "trying again every 1 s for up to 60 s in all (no restart used)" in err, err
    said = f"rendezvous-run: job {job_id!r}: rendezvousd at 127.0.0.1:{port} not reached after "
    assert err.count(said) == 1, err
    assert "s: nothing listens there (connection refused); still trying, for up to 6 s" in err


def test_a_job_launched_again_right_after_it_gave_up_forms_at_once(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path
) -> None:
    """The agent that gave up left the failed generation as a survivor about to re-join
    does, so the daemon kept its seat: the same command run again at once (the bug
    fixed) was refused WORLD_FULL, "1 seat(s) kept for nodes re-joining", for 10 s."""
    d = start_daemon()
    flag = tmp_path / "fail"
    flag.touch()
    source = (
        "import sys\n"
        "from rendezvousd.trainer.distributed import init_distributed\n"
        "with init_distributed() as ctx:\n"
        f"    if ctx.rank == 1 and __import__('os').path.exists({str(flag)!r}):\n"
        "        sys.exit(3)\n"
        "    ctx.communicator.barrier()\n"
    )
    failed = run_script_node(d, job_id, tmp_path / "w.py", source, "--max-restarts", "0")
    assert failed.returncode == 3, failed.stderr
    flag.unlink()
    started = time.monotonic()
    again = run_script_node(d, job_id, tmp_path / "w.py", source, "--max-restarts", "0")
    assert again.returncode == 0, again.stderr
    # Refused at once before (rc 1); the seat hold it waited for was 10 s.
    assert time.monotonic() - started < 30, again.stderr


def test_sigterm_while_joining_ends_the_launcher_promptly(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path
) -> None:
    from rendezvousd.client import RendezvousClient
    from rendezvousd.client.errors import RendezvousError

    d = start_daemon()
    # Node 1 never comes: node 0's join would wait for it until join_timeout_s.
    with _nodes(d, job_id, tmp_path / "stop", [0]) as [node]:
        with RendezvousClient(d.endpoint, token=d.token) as probe:

            def joined() -> bool:
                assert node.poll() is None
                try:
                    probe.get_job(job_id)  # the job exists once a JoinNode arrived
                except RendezvousError:
                    return False
                return True

            wait_for("node 0's JoinNode to reach the daemon", joined, timeout=30)
        started = time.monotonic()
        node.send_signal(signal.SIGTERM)
        _out, err = node.communicate(timeout=30)
    assert node.returncode == 128 + signal.SIGTERM, err
    assert time.monotonic() - started < 5, err
    assert "got SIGTERM: stopping this node's workers" in err, err  # it exited in silence


def test_sigterm_while_forming_is_told_to_the_daemon_and_the_other_node_as_a_stop(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path
) -> None:
    """The daemon said "FORMING -> FAILED (rank 0 on H (its JoinNode was cancelled (node
    agent died or disconnected)))" for a node stopped by SIGTERM while its job formed,
    and so did the other nodes; the same signal while it ran was named: "stopped by
    SIGTERM"."""
    from rendezvousd.client import RendezvousClient
    from rendezvousd.client.errors import RendezvousError

    d = start_daemon()
    worker = [str(WORKERS / "trainer_worker.py"), str(tmp_path / "stop")]
    # Node 2 of 3 never comes: the joins of nodes 0 and 1 wait in the forming generation.
    nodes = [
        subprocess.Popen(
            [
                *launcher_cmd(3, n, 2, endpoint=d.endpoint, token_file=d.token_file, job=job_id),
                *("--config", str(SMOKE), *worker),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in (0, 1)
    ]
    try:
        with RendezvousClient(d.endpoint, token=d.token) as probe:

            def joined() -> bool:
                assert all(n.poll() is None for n in nodes)
                try:
                    return len(probe.get_job(job_id).joining) == 2
                except RendezvousError:
                    return False

            wait_for("both JoinNodes to be counted", joined, timeout=30)
            nodes[1].send_signal(signal.SIGTERM)
            errs = [n.communicate(timeout=60)[1] for n in (nodes[1], nodes[0])]
            reason = probe.get_job(job_id).abort_reason
    finally:
        for n in nodes:
            if n.poll() is None:
                n.kill()
    assert nodes[1].returncode == 128 + signal.SIGTERM, errs[0]
    assert "was stopped by SIGTERM" in reason, (reason, d.log())
    said = [line for line in d.log().splitlines() if "FORMING ->" in line]
    assert any("FORMING -> ABORTED" in line and "stopped by SIGTERM" in line for line in said), said
    assert not any("was cancelled" in line for line in said), said
    assert "was stopped by SIGTERM" in errs[1] and "was cancelled" not in errs[1], errs[1]


def _last_line(err: str) -> str:
    return unstamped(err).rstrip("\n").rsplit("\n", 1)[-1]


def test_a_finished_node_and_a_stopped_one_each_end_their_log_saying_how_and_the_status(
    running: Running, job_id: str, tmp_path: Path
) -> None:
    """A log that ended at its start-up banner (a clean finish) or at "got SIGTERM" read
    as a node still running, or hung."""
    nodes, _pids = running
    nodes[1].send_signal(signal.SIGTERM)
    _out, err = nodes[1].communicate(timeout=60)
    assert nodes[1].returncode == 143, err
    assert _last_line(err) == (
        f"rendezvous-run: job '{job_id}' node 1 stopped by SIGTERM (exit 143)"
    ), err


def test_a_node_that_finished_ends_its_log_saying_every_worker_exited_0(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path
) -> None:
    d = start_daemon()
    worker = [str(WORKERS / "trainer_worker.py"), str(tmp_path / "stop"), "--ready-only"]

    def node(rank: int) -> subprocess.CompletedProcess[str]:
        cmd = launcher_cmd(2, rank, 2, endpoint=d.endpoint, token_file=d.token_file, job=job_id)
        return run_launcher([*cmd, "--config", str(SMOKE), *worker], timeout=60)

    ended = parallel([lambda: node(0), lambda: node(1)], limit=90)
    for rank, done in enumerate(ended):
        assert isinstance(done, subprocess.CompletedProcess), done
        err = done.stderr
        assert done.returncode == 0, err
        assert _last_line(err) == (
            f"rendezvous-run: job '{job_id}' node {rank} finished: all 2 workers exited 0 (exit 0)"
        ), err


def test_the_agent_makes_the_nccl_id_listening_where_shared_device_ranks_look(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Node 0's agent hosts NCCL's bootstrap root for the id it makes: in the one-GPU
    shared-device mode that must be on loopback, like the ranks' own sockets."""
    from rendezvousd.trainer.agent import launcher
    from rendezvousd.trainer.comm import nccl
    from rendezvousd.trainer.config import load_config

    for name in ("NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE", "NCCL_HOSTID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RENDEZVOUSD_NCCL_SHARED_DEVICE", "1")
    seen: dict[str, str | None] = {}

    def fake_id() -> bytes:
        seen.update((k, os.environ.get(k)) for k in ("NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE"))
        return bytes(range(1, 129))

    monkeypatch.setattr(nccl, "create_unique_id", fake_id)
    factory = launcher._id_factory(load_config(None, env={"RENDEZVOUSD_BACKEND": "nccl"}))
    assert factory is not None and factory() == bytes(range(1, 129))
    assert seen == {"NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"}


# ---- refusals at start, before any spare: rendezvous-run's main() in this process


@pytest.mark.parametrize(
    "flags",
    [
        ["--max-restarts", "5000000000"],  # the first progress report: ValueError, mid-job
        ["--stop-grace-s", "1e308"],  # the stop's waits: OverflowError
        ["--setup-timeout-s", "1e300"],  # every worker's kv_get(): InvalidRequest
        ["--join-timeout-s", "1e12"],  # join_node(): InvalidRequest naming timeout=
        ["--last-call-s", "1e300"],
        ["--heartbeat-interval-s", "1e-9"],  # the agent's heartbeat busy-looped
        ["--job-id", "a b"],  # the join failed (exit 1) after the spares started
        ["--nproc-per-node", "5000000000"],  # the join, refused by the SDK (exit 1)
        ["--retries", "5000000000"],  # refused by the SDK's client, after the spares
        # 0 bytes once bucketing truncates: every worker's ConfigError, mid-job.
        ["--bucket-cap-mib", "1e-7"],
        ["--first-bucket-mib", "1e-7"],  # silently no first bucket
        ["--bucket-cap-mib", "1e303"],  # int(inf) bytes: OverflowError in every worker
    ],
    ids=lambda flags: flags[0],
)
def test_a_setting_no_call_could_carry_is_exit_2_naming_its_flag(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, flags: list[str]
) -> None:
    from rendezvousd.trainer.agent import launcher

    monkeypatch.setenv("GRPC_VERBOSITY", "ERROR")
    with pytest.raises(SystemExit) as info:
        launcher.main(["--standalone", "--nproc-per-node", "1", *flags, "ok.py"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    # "argument --retries/--retry-attempts: ..." for a flag with an alias.
    assert re.search(rf"argument {flags[0]}(/[-\w]+)?: {re.escape(repr(flags[1]))} must be", err)


@pytest.mark.parametrize("nnodes", ["5000000000", "2:5000000000"])
def test_a_node_count_the_protocol_cannot_carry_is_exit_2_before_any_spare(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, nnodes: str
) -> None:
    """Refused only at the join (exit 1, after the spares started). (A world whose
    product overflows: test_config's.)"""
    from rendezvousd.trainer.agent import launcher

    token = tmp_path / "tok"
    write_token(token)
    script = tmp_path / "ok.py"
    script.write_text("pass\n")
    status = launcher.main(
        ["--nnodes", nnodes, "--node-rank", "0", "--nproc-per-node", "1", *UNREACHABLE,
         "--token-file", str(token), str(script)]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert status == 2, err
    assert f"--nnodes={nnodes!r} is invalid: its " in err, err
    assert "'5000000000' must be an integer from 1 to 4294967295" in err, err


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        # Were "--min-nodes='' is invalid" and "--num-nodes='' is invalid": flags the
        # user never gave, and not the value they gave.
        (["--nnodes", ":2"], "--nnodes=':2' is invalid: its MIN '' must be an integer from 1"),
        (["--nnodes", "2:"], "--nnodes='2:' is invalid: its MAX '' must be an integer from 1"),
        (["--nnodes", "3:2"], "--nnodes='3:2' is invalid: its MIN 3 exceeds its MAX 2"),
        # --nnodes' MIN silently won over --min-nodes ("the 1 it needs at least").
        (
            ["--nnodes", "1:3", "--min-nodes", "2"],
            "--min-nodes 2 disagrees with --nnodes 1:3 (its MIN is 1): give the elastic "
            "minimum once",
        ),
    ],
    ids=["no MIN", "no MAX", "MIN over MAX", "two minimums"],
)
def test_an_nnodes_range_it_cannot_take_is_exit_2_naming_nnodes_and_its_value(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flags: list[str], said: str
) -> None:
    from rendezvousd.trainer.agent import launcher

    script = tmp_path / "ok.py"
    script.write_text("pass\n")
    status = launcher.main(
        [*flags, "--node-rank", "0", "--nproc-per-node", "1", *UNREACHABLE, str(script)]
    )
    err = capsys.readouterr().err
    assert status == 2, err
    assert said in err, err
    assert "--num-nodes=" not in err and "--min-nodes=" not in err, err


def test_min_nodes_that_agrees_with_the_nnodes_range_is_taken() -> None:
    from rendezvousd.trainer.agent import launcher

    args = launcher.build_parser().parse_args(
        [
            "--nnodes",
            "2:3",
            "--min-nodes",
            "2",
            "--node-rank",
            "0",
            "--nproc-per-node",
            "1",
            *UNREACHABLE,
            "x.py",
        ]
    )
    config = launcher.resolve(args, {})
    assert (config.min_nodes, config.num_nodes) == (2, 3)


@pytest.mark.parametrize("standalone", [[], ["--standalone"]], ids=["path", "standalone"])
@pytest.mark.parametrize("where", ["a-file", "missing-under-proc", "open-to-others"])
def test_a_rendezvous_path_it_cannot_use_is_exit_2_with_no_traceback(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    standalone: list[str],
    where: str,
) -> None:
    """The file transport's refusal came out as a traceback (exit 1)."""
    from rendezvousd.trainer.agent import launcher

    monkeypatch.setenv("GRPC_VERBOSITY", "ERROR")
    script = tmp_path / "ok.py"
    script.write_text("pass\n")
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    path = {"a-file": script, "missing-under-proc": Path("/proc/nope"), "open-to-others": shared}
    status = launcher.main(
        [*standalone, "--rendezvous-path", str(path[where]), "--nproc-per-node", "1", str(script)]
    )
    assert status == 2
    err = capsys.readouterr().err
    assert unstamped(err).startswith("rendezvous-run: error: ") and str(path[where]) in err, err
    assert "Traceback" not in err, err


@pytest.mark.parametrize("standalone", [[], ["--standalone"]], ids=["path", "standalone"])
def test_a_read_only_rendezvous_directory_is_exit_2_with_no_traceback(
    tmp_path: Path, standalone: list[str]
) -> None:
    """An existing directory on a read-only mount passed the walk, then its stale
    socket's unlink raised EROFS as a traceback (a path under it was refused cleanly)."""
    script = tmp_path / "ok.py"
    script.write_text("pass\n")
    ro = tmp_path / "ro"
    ro.mkdir()
    mount = f"mount -t tmpfs -o size=64k tmpfs {ro} && chmod 700 {ro} && mount -o remount,ro {ro}"
    launcher = [sys.executable, "-m", "rendezvousd.trainer.agent.launcher", *standalone,
                "--rendezvous-path", str(ro), "--nproc-per-node", "1", str(script)]  # fmt: skip
    done = run_launcher(with_own_mounts(mount, launcher), timeout=60)
    assert done.returncode == 2, done.stderr
    assert unstamped(done.stderr).startswith(
        f"rendezvous-run: error: cannot use {ro} as the rendezvous directory: "
        f"{ro}/default.sock: Read-only file system;"
    ), done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "flags",
    [
        ["--rdzv-endpoint", "127.0.0.1:1"],
        ["--rdzv-endpoint", "127.0.0.1:1", "--token-file", "tok"],
        ["--rdzv-endpoint", "127.0.0.1:1", "--tls-ca", "ca.pem"],
    ],
    ids=["endpoint", "endpoint-and-token", "endpoint-and-tls"],
)
def test_standalone_with_a_daemon_named_on_the_command_line_is_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flags: list[str]
) -> None:
    """The named daemon was dropped in silence: the job ran on a private one, exit 0,
    and never showed up where it was asked to."""
    from rendezvousd.trainer.agent import launcher

    script = tmp_path / "ok.py"
    script.write_text("pass\n")
    status = launcher.main(["--standalone", *flags, "--nproc-per-node", "1", str(script)])
    err = capsys.readouterr().err
    assert status == 2, err
    assert "--standalone hosts its own daemon, but --rdzv-endpoint" in err, err


@pytest.mark.parametrize("value", ["maybe", "", "nein"])
def test_a_fork_server_switch_that_is_neither_on_nor_off_is_exit_2_naming_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, value: str
) -> None:
    """Only "0" turned the fork server off; any other value, "false" and "off"
    included, kept it on in silence."""
    from rendezvousd.trainer.agent import launcher

    monkeypatch.setenv("GRPC_VERBOSITY", "ERROR")
    monkeypatch.setenv("RENDEZVOUSD_FORK_SERVER", value)
    script = tmp_path / "ok.py"
    script.write_text("pass\n")
    for flags in ([], ["--no-fork-server"]):
        status = launcher.main(["--standalone", *flags, "--nproc-per-node", "1", str(script)])
        err = capsys.readouterr().err
        assert status == 2, err
        assert f"$RENDEZVOUSD_FORK_SERVER={value!r} is not a switch: set it to 0" in err, err
        assert "Traceback" not in err, err


# No daemon: a launcher that went on past the refusals below would fail its join soon.
UNREACHABLE = ["--rdzv-endpoint", "127.0.0.1:1", "--join-timeout-s", "2"]
UNREACHABLE += ["--connect-timeout-s", "1"]


@pytest.mark.parametrize("given", ["flag", "env", "link"])
def test_a_script_that_is_the_token_file_is_refused_without_the_token(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, given: str
) -> None:
    """A forgotten --token-file before the file's path made it the script: each worker
    ran the token as Python, whose traceback printed it."""
    from rendezvousd.trainer.agent import launcher

    monkeypatch.setenv("GRPC_VERBOSITY", "ERROR")
    monkeypatch.delenv("RENDEZVOUSD_TOKEN", raising=False)
    monkeypatch.delenv("RENDEZVOUSD_TOKEN_FILE", raising=False)
    token_file = tmp_path / "tok"
    token = write_token(token_file)
    flags = ["--token-file", str(token_file)]
    target = token_file
    if given == "env":
        monkeypatch.setenv("RENDEZVOUSD_TOKEN_FILE", str(token_file))
        flags = []
    elif given == "link":
        target = tmp_path / "link"
        target.symlink_to(token_file)
    status = launcher.main(["--nproc-per-node", "1", *UNREACHABLE, *flags, str(target), "x.py"])
    assert status == 2
    err = capsys.readouterr().err
    assert f"rendezvous-run: error: the script {str(target)!r} is the token file" in err, err
    assert token not in err


def test_no_token_anywhere_names_the_launchers_flag_and_variables(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The SDK's own error named its keywords (pass token= or token_file=)."""
    from rendezvousd.trainer.agent import launcher

    monkeypatch.setenv("GRPC_VERBOSITY", "ERROR")
    monkeypatch.delenv("RENDEZVOUSD_TOKEN", raising=False)
    monkeypatch.delenv("RENDEZVOUSD_TOKEN_FILE", raising=False)
    script = tmp_path / "ok.py"
    script.write_text("pass\n")
    status = launcher.main(["--nproc-per-node", "1", *UNREACHABLE, str(script)])
    assert status == 2
    err = capsys.readouterr().err
    assert "no token: pass --token-file FILE" in err, err
    assert "$RENDEZVOUSD_TOKEN_FILE" in err and "$RENDEZVOUSD_TOKEN " in err, err
    assert "token=" not in err, err


@pytest.mark.parametrize("nnodes", ["2", "2:3"])
def test_a_node_waiting_for_the_others_says_what_it_waits_for_while_it_waits(
    daemon: DaemonProcess, job_id: str, tmp_path: Path, nnodes: str
) -> None:
    """One node of two started: the launcher said nothing for its whole join timeout
    (600 s by default), the silent rendezvous hang of torchrun. It now says, after 5 s
    and every 30 s, how many nodes joined of those the job needs, and how long the join
    waits in all; then the timeout names what is missing."""
    script = tmp_path / "w.py"
    script.write_text(
        "from rendezvousd.trainer.distributed import init_distributed\n"
        "with init_distributed():\n    pass\n"
    )
    node = launcher_cmd(nnodes, 0, 1, endpoint=daemon.endpoint, token_file=daemon.token_file,
                        job=job_id)  # fmt: skip
    run = run_launcher([*node, "--join-timeout-s", "8", str(script)], timeout=60)
    host = socket.gethostname()
    need, missing = (
        ("2", "node rank 1 (no node agent joined with that node rank)")
        if nnodes == "2"
        else ("2 (up to 3)", "1 more node(s) to reach min_nodes=2")
    )
    # Which node joined, on which host, and what is missing (an operator review: a
    # count alone named no node).
    said = re.compile(
        re.escape(
            f"still waiting for job {job_id!r} generation 1 to form after 5 s: 1 node(s) "
            f"joined (node 0 on {host} ("
        )
        + r"\d+\.\ds ago"
        + re.escape(f")) of the {need} it needs, missing {missing}; waiting up to 8 s in all")
    )
    assert run.returncode == 1, run.stderr
    note = said.search(run.stderr)
    assert note is not None and run.stderr.count("still waiting") == 1, run.stderr
    most = "" if nnodes == "2" else " (up to 3)"
    what = (
        "no node agent joined as node 1: start it (rendezvous-run --node-rank 1)"
        if nnodes == "2"
        else "1 more node(s) never joined: start the missing node agents"
    )
    # The join's wait is what is left of the 8 s when it is sent: 7.9 s on a loaded host.
    timed_out = re.search(
        r"did not form within (7\.\d|8\.0) s: "
        + re.escape(
            f"1 node(s) joined of the min_nodes=2{most} it needs (node 0 on {host}); {what}"
        ),
        run.stderr,
    )
    assert timed_out is not None, run.stderr
    assert note.start() < timed_out.start(), run.stderr


def test_the_waiting_note_names_kept_seats_and_a_running_jobs_next_re_form() -> None:
    """The note's other two cases, from the daemon's answers: a re-forming generation
    that keeps seats for nodes coming back (standbys parked are not nodes joined), and
    a newcomer parked while its elastic job runs."""
    from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
    from rendezvousd.trainer.agent.waiting_note import forming_note

    def job(state: int, num_nodes: int, **fields: int) -> pb.GetJobResponse:
        summary = pb.JobSummary(job_id="j\n", state=state, generation=3)  # type: ignore[arg-type]
        summary.topology.num_nodes = num_nodes
        return pb.GetJobResponse(summary=summary, **fields)

    re_forming = job(pb.JOB_STATE_FORMING, 3, nodes_waiting=2, standbys=1, seats_kept=1)
    assert forming_note(re_forming, 3, 35.4, 60) == (
        "still waiting for job 'j\\x0a' generation 3 to form after 35 s: 1 node(s) joined of "
        "the 3 it needs, 1 seat(s) kept for nodes re-joining; waiting up to 60 s in all, "
        "then this ends naming what is missing"
    )
    after_end = job(pb.JOB_STATE_FORMING, 2, nodes_waiting=1, previous_run_ended_ms=750_000)
    assert forming_note(after_end, 2, 5.0, 600).endswith(
        "then this ends naming what is missing. The job's previous run ended 12 min ago "
        "(every member left), and a join after that starts a new run: a node meant for the "
        "run that ended is not needed and may stop"
    )
    # The job id's next run, parked while the run before finishes: who still holds it.
    finishing = job(pb.JOB_STATE_RUNNING, 2, nodes_waiting=2)
    for node_rank, state in ((0, pb.MEMBER_STATE_LEFT), (1, pb.MEMBER_STATE_ACTIVE)):
        finishing.members.add(state=state).member.MergeFrom(
            pb.Member(rank=node_rank, node_rank=node_rank, host=f"h{node_rank}")
        )
    assert forming_note(finishing, 2, 5.2, 600) == (
        "job 'j\\x0a' generation 3, the job id's previous run, is still finishing after 5 s: "
        "1 of its 2 node(s) have not left (node 1 on 'h1'); this node joins the job's next "
        "run once they have exited (waiting up to 600 s in all)"
    )
    # Elastic with enough nodes: it forms at its last call, not at the timeout.
    enough = job(pb.JOB_STATE_FORMING, 2, nodes_waiting=1)
    assert forming_note(enough, 1, 5.2, 600) == (
        "still waiting for job 'j\\x0a' generation 3 to form after 5 s: 1 node(s) joined, "
        "the 1 it needs at least: it forms with them once no other node joins for its last "
        "call (the daemon's --last-call-s, 30 s unless set), or at once when 2 have (waiting "
        "up to 600 s in all)"
    )
    # The seconds, where the join named its own last call ("within its last call" said
    # not how long: a torchrun user's review).
    assert "once no other node joins for 10 s (its last call), or at once when 2 have" in (
        forming_note(enough, 1, 5.2, 600, 10.0)
    )
    running = job(pb.JOB_STATE_RUNNING, 2, nodes_waiting=1)
    assert forming_note(running, 1, 5.2, 600) == (
        "job 'j\\x0a' generation 3 runs with 2 node(s) after 5 s: this node is taken in when "
        "it next re-forms (waiting up to 600 s in all)"
    )
    # Its own generation (3), still running at the daemon as its join is on its way (a
    # daemon restored it after a restart; a one-node job read "runs with 1 node(s):
    # this node is taken in when it next re-forms", its only node missing from it).
    assert forming_note(running, 1, 11.0, 60, held=3) == (
        "job 'j\\x0a' generation 3, which this node held, still runs at the daemon after 11 s "
        "(the daemon was away, or has not yet heard this node stopped its workers): this "
        "node's join, once it lands, ends that generation and the job re-forms with this node "
        "(waiting up to 60 s in all)"
    )
    assert forming_note(running, 1, 5.2, 600, held=2).startswith(
        "job 'j\\x0a' generation 3 runs with 2 node(s)"
    )


def test_a_node_started_after_its_job_ended_is_told_the_run_it_waits_in_is_a_new_one(
    daemon: DaemonProcess, job_id: str, tmp_path: Path
) -> None:
    """A pod restarted after its job succeeded (or a slow pod of a short job) joins a
    job whose members all left, and so opens a new run of it that nobody else will
    join: it waited out its join timeout (600 s by default) without a word of why."""
    script = tmp_path / "w.py"
    script.write_text(
        "from rendezvousd.trainer.distributed import init_distributed\n"
        "with init_distributed():\n    pass\n"
    )
    node = launcher_cmd(1, 0, 1, endpoint=daemon.endpoint, token_file=daemon.token_file,
                        job=job_id)  # fmt: skip
    done = run_launcher([*node, str(script)], timeout=60)
    assert done.returncode == 0, done.stderr
    late = [*node[:4], "2", *node[5:]]  # --nnodes 2: its run needed a second node
    assert late[3] == "--nnodes", late
    run = run_launcher([*late, "--join-timeout-s", "7", str(script)], timeout=60)
    assert run.returncode == 1, run.stderr
    assert f"still waiting for job '{job_id}' generation 2 to form" in run.stderr, run.stderr
    assert "The job's previous run ended " in run.stderr, run.stderr
    assert "a node meant for the run that ended is not needed and may stop" in run.stderr


def test_a_node_launched_before_its_job_ended_exits_0_when_it_joins_after(
    daemon: DaemonProcess, job_id: str, tmp_path: Path
) -> None:
    """A node launched while its job ran, whose join reaches the daemon only after
    every member left (a slow pod, one rescheduled mid-run; here the daemon is out
    of its reach until then), was launched for the run that ended: it exits 0 at
    once, saying so. Before, it opened the job's next generation: alone (a job of one
    node) it trained the whole job again; else it waited its join timeout there (600 s
    by default) for nodes that were done."""
    ran = tmp_path / "ran"
    script = tmp_path / "w.py"
    script.write_text(
        "from rendezvousd.trainer.distributed import init_distributed\n"
        f"with init_distributed(), open({str(ran)!r}, 'a') as f:\n    f.write('ran\\n')\n"
    )
    door = ClosedDoor(daemon.port)
    node = launcher_cmd(1, 0, 1, token_file=daemon.token_file, job=job_id)
    late = subprocess.Popen(
        [*node, "--rdzv-endpoint", door.endpoint, "--join-timeout-s", "60", str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        run = [*node, "--rdzv-endpoint", daemon.endpoint, str(script)]
        done = run_launcher(run, timeout=60)
        assert done.returncode == 0, done.stderr
        door.open()
        _, err = late.communicate(timeout=60)
    finally:
        late.kill()
        door.close()
    assert late.returncode == 0, err
    assert ran.read_text() == "ran\n", err  # the job's one run, not the late node's
    assert f"job {job_id!r} ended " in err and "after this node was launched (" in err, err
    assert "it was launched for the run that ended, which needs it no more" in err, err
    assert "this node exits without starting its workers" in err, err
    assert "still waiting" not in err, err


#: A resolver's answer within a second (the name never resolves): each lookup's time
#: is glibc's, and a resolver that does not answer would take 5 s an attempt.
QUICK_RESOLVER = {"RES_OPTIONS": "timeout:1 attempts:1"}


def test_a_daemon_name_that_does_not_resolve_yet_is_asked_again_within_its_join_timeout(
    tmp_path: Path,
) -> None:
    """A Kubernetes Service's name may resolve only once its pod is ready: a node
    started before it failed at once ("cannot resolve"), where a port nobody listens
    on yet is waited for within the connect timeout."""
    token = tmp_path / "token"
    write_token(token)
    script = tmp_path / "w.py"
    script.write_text("pass\n")
    node = launcher_cmd(2, 0, 1, endpoint="nowhere.invalid:29400", token_file=token)
    flags = ["--connect-timeout-s", "1", "--join-timeout-s", "3"]
    started = time.monotonic()
    done = subprocess.run(
        [*node, *flags, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **QUICK_RESOLVER},
    )
    took = time.monotonic() - started
    assert done.returncode == 2, done.stderr
    # For the join's timeout, as a daemon not up yet is waited for, not connect_timeout.
    assert "'nowhere.invalid' does not resolve yet" in done.stderr, done.stderr
    assert "asking again every 1 s for up to 3 s" in done.stderr, done.stderr
    assert "cannot resolve 'nowhere.invalid' (asked for 3 s)" in done.stderr, done.stderr
    assert took > 3.0, took


@pytest.mark.parametrize("key", ["rank", "local_rank"])
def test_a_config_files_per_worker_rank_is_not_the_nodes(tmp_path: Path, key: str) -> None:
    """The launcher ignored RENDEZVOUSD_RANK but took the file's rank (the shipped
    single_node.toml's rank = 0) for every worker of the node: node 1 was refused with
    "rank=0 lies on node 0, not the configured node_rank=1"."""
    from rendezvousd.trainer.agent import launcher

    config_file = tmp_path / "rank0.toml"
    config_file.write_text(f"[distributed]\n{key} = 0\n")
    flags = ["--config", str(config_file), "--nnodes", "2", "--node-rank", "1"]
    args = launcher.build_parser().parse_args(
        [*flags, "--nproc-per-node", "2", *UNREACHABLE, "x.py"]
    )
    config = launcher.resolve(args, {})
    assert (config.rank, config.local_rank, config.node_rank) == (None, None, 1)
    # As from the environment, which was already ignored.
    env = {"RENDEZVOUSD_RANK": "0", "RENDEZVOUSD_LOCAL_RANK": "0"}
    assert launcher.resolve(args, env) == config


def test_a_workers_own_init_distributed_errors_are_in_the_launchers_words(
    daemon: DaemonProcess,
) -> None:
    """A worker's call refused for its token raised the SDK's advice from
    ``init_distributed``: "(token= / token_file=, ...)", keywords nobody under
    rendezvous-run passes. Its agent's own refusals say the launcher's flags."""
    cmd = launcher_cmd(1, 0, 2, endpoint=daemon.endpoint, token_file=daemon.token_file)
    cmd += ["--job-id", "words", str(WORKERS / "refused_token_worker.py")]
    done = run_launcher(cmd, timeout=90)
    refused = [json.loads(ln) for ln in done.stdout.splitlines() if '"refused"' in ln]
    assert refused, done.stdout + "\n" + done.stderr[-3000:]
    for worker in refused:
        said = worker["message"]
        assert worker["kind"] == "AuthenticationError", worker
        assert "(--token-file, or $RENDEZVOUSD_TOKEN_FILE / $RENDEZVOUSD_TOKEN)" in said, said
        assert "token=" not in said and "token_file=" not in said, said
    # What a worker reported is the cause its agent names: in the same words.
    assert "token_file=" not in done.stderr, done.stderr[-3000:]


def test_a_job_id_run_again_while_its_last_run_finishes_waits_for_that_end(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path
) -> None:
    """The job id run again right after a run ended on one node while the other still
    finished (a final checkpoint): the new run's node 0 was refused WORLD_FULL and its
    node 1 DUPLICATE_RANK, both exiting non-zero. They wait for the old run's last
    node to exit instead, then run."""
    from rendezvousd.client import RendezvousClient

    d = start_daemon()
    release = tmp_path / "release"
    script = tmp_path / "w.py"
    script.write_text(
        "import os, sys, time\n"
        "from rendezvousd.trainer import init_distributed\n"
        "with init_distributed() as ctx:\n"
        "    print('run', os.environ['RUN'], 'rank', ctx.rank, 'generation',"
        " ctx.generation, flush=True)\n"
        "    hold = os.environ.get('HOLD')\n"
        "    deadline = time.monotonic() + 60\n"
        "    while hold and not os.path.exists(hold) and time.monotonic() < deadline:\n"
        "        time.sleep(0.05)\n"
    )

    def node(run: str, rank: int, hold: str = "") -> subprocess.Popen[str]:
        cmd = launcher_cmd(2, rank, 1, endpoint=d.endpoint, token_file=d.token_file, job=job_id)
        return subprocess.Popen(
            [*cmd, str(script)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "RUN": run, "HOLD": hold},
        )

    old = [node("1", 0), node("1", 1, str(release))]
    new: list[subprocess.Popen[str]] = []
    try:
        assert old[0].wait(60) == 0, old[0].communicate(timeout=10)
        with RendezvousClient(d.endpoint, job_id, token=d.token) as probe:
            new = [node("2", 0), node("2", 1)]
            wait_for("the new run's nodes parked", lambda: probe.get_job().nodes_waiting == 2, 30)
            assert all(p.poll() is None for p in new)
            assert probe.get_job().summary.generation == 1  # the old run still holds it
        release.touch()
        outs = [p.communicate(timeout=60) for p in (old[1], *new)]
        for p, (_, err) in zip((old[1], *new), outs, strict=True):
            assert p.returncode == 0, err
        assert "run 2 rank 0 generation 2" in outs[1][0]
        assert "run 2 rank 1 generation 2" in outs[2][0]
    finally:
        release.touch()
        for p in (*old, *new):
            if p.poll() is None:
                p.kill()
                p.wait(10)


# Inside its running job, each worker writes what its own environment block, and its
# parent's (the fork server's, or the agent's when it started cold), hold of the token.
_ENVIRON_WORKER = r"""
import json, os, sys
import numpy as np
from rendezvousd.trainer.distributed import init_distributed

def holds(pid, token):
    block = open(f"/proc/{pid}/environ", "rb").read()
    names = [v.split(b"=", 1)[0].decode() for v in block.split(b"\0") if v]
    return {"named": "RENDEZVOUSD_TOKEN" in names, "value": token.encode() in block,
            "os_environ": "RENDEZVOUSD_TOKEN" in os.environ}

token = open(sys.argv[1]).read().strip()
with init_distributed() as ctx:
    ctx.communicator.all_reduce(np.ones(4, dtype=np.float32))
    facts = {"self": holds("self", token), "parent": holds(os.getppid(), token)}
    with open(f"{sys.argv[2]}.{ctx.rank}", "w") as fh:
        json.dump(facts, fh)
"""


def test_a_token_given_in_the_environment_reaches_no_worker_s_environment(
    daemon: DaemonProcess, job_id: str, tmp_path: Path
) -> None:
    """$RENDEZVOUSD_TOKEN given to rendezvous-run was in every worker's environment, and
    the fork server's (an audit), for user code and all it starts to read or record,
    though a worker gets its token over the agent channel."""
    script = tmp_path / "w.py"
    script.write_text(_ENVIRON_WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RENDEZVOUSD_TOKEN")}
    env["RENDEZVOUSD_TOKEN"] = daemon.token
    cmd = launcher_cmd(1, 0, 2, endpoint=daemon.endpoint, job=job_id)
    # The token file is the script's to compare with, not the launcher's.
    run = subprocess.run(
        [*cmd, str(script), str(daemon.token_file), str(tmp_path / "facts")],
        env=env, capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    facts = [json.loads((tmp_path / f"facts.{rank}").read_text()) for rank in range(2)]
    for said in facts:
        for whose in ("self", "parent"):
            seen = said[whose]
            assert not (seen["named"] or seen["value"] or seen["os_environ"]), facts
    assert daemon.token not in run.stderr + run.stdout
