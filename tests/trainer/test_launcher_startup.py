"""rendezvous-run's start-up order: a fresh node's spares start before the launcher
imports gRPC (and the node agent never imports numpy), so that on a replacement
node the launcher's start-up and its spares' overlap; what the launcher and a
spare import at all, and that a spare imports before its assignment what it
needs after it (docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rendezvousd.trainer.agent import launcher
from tests.support import WORKERS, DaemonProcess, json_lines, launcher_cmd

# Runs rendezvous-run in this process, noting in $ORDER_FILE, in order, the first
# process it starts and its first imports of grpc and numpy (audit events), then
# how many processes it started itself (not counting git, asked for the start line's
# build id in a checkout), and how many spares (forked or cold).
ORDER_PROBE = r"""
import os, runpy, sys
order = []
spawned = []
def hook(event, args):
    if event == "import" and args[0] in ("grpc", "numpy") and args[0] not in order:
        order.append(args[0])
    elif event == "subprocess.Popen" and os.path.basename(str(args[0])) == "git":
        # The start line's build id, asked of git in a checkout (version.build_id):
        # no worker process, and after the spares.
        order.append("git")
    elif event == "subprocess.Popen":
        spawned.append(1)
        if "spawn" not in order:
            order.append("spawn")
sys.addaudithook(hook)
# Spares, forked by the node's fork server or started cold.
from rendezvousd.trainer.agent import worker_boot
spares = []
def counted(start):
    def wrapper(*args, **kwargs):
        booted = start(*args, **kwargs)
        if booted is not None:
            spares.append(1)
        return booted
    return wrapper
worker_boot.boot = counted(worker_boot.boot)
worker_boot.ForkServer.spawn = counted(worker_boot.ForkServer.spawn)
sys.argv = ["rendezvous-run", *sys.argv[1:]]
try:
    runpy.run_module("rendezvousd.trainer.agent.launcher", run_name="__main__", alter_sys=True)
finally:
    with open(os.environ["ORDER_FILE"], "w") as fh:
        fh.write(" ".join(order) + "\n" + str(len(spawned)) + "\n" + str(len(spares)))
"""


@pytest.mark.parametrize("fork_server", ["1", "0"], ids=["forked", "cold"])
def test_spares_start_before_the_launcher_imports_grpc_and_the_agent_needs_no_numpy_nor_spares_it_cannot_use(
    daemon: DaemonProcess, job_id: str, tmp_path: Path, fork_server: str
) -> None:
    order_file = tmp_path / "order"
    args = launcher_cmd(1, 0, 2, endpoint=daemon.endpoint, token_file=daemon.token_file, job=job_id)
    args = args[3:]  # the flags, without "python -m rendezvousd.trainer.agent.launcher"
    example = ["-m", "rendezvousd.trainer.example", "--steps", "30", "--log-every", "1000"]
    done = subprocess.run(
        [sys.executable, "-c", ORDER_PROBE, *args, *example],
        env={**os.environ, "ORDER_FILE": str(order_file), "RENDEZVOUSD_FORK_SERVER": fork_server},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    order, spawned, spares = order_file.read_text().splitlines()
    # grpc once the spares (or their fork server) run; numpy never: the agent relays
    # the workers' state frames (three steps of them here) without decoding them.
    # git (a checkout's build id, once) only after both.
    assert [o for o in order.split() if o != "git"] == ["spawn", "grpc"], done.stderr
    assert order.split()[2:] in ([], ["git"]), done.stderr
    # No restarts allowed and a fixed size: no spare beyond the two workers, whose
    # start-up would only take CPU from the training.
    assert spares == "2", done.stderr
    # The launcher itself starts the fork server, or both spares and the watcher of
    # their process groups (``_group_watch``).
    assert spawned == ("1" if fork_server == "1" else "3"), done.stderr


def _children() -> set[int]:
    pids: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        with open(task / "children") as fh:
            pids |= {int(p) for p in fh.read().split()}
    return pids


def test_spares_started_before_the_launcher_fails_are_stopped_and_reaped(
    daemon: DaemonProcess, job_id: str, tmp_path: Path
) -> None:
    before = _children()
    status = launcher.main(
        [
            "--nnodes",
            "1",
            "--nproc-per-node",
            "2",
            "--rdzv-endpoint",
            daemon.endpoint,
            "--token-file",
            str(tmp_path / "no-such-token"),
            "--job-id",
            job_id,
            "-m",
            "rendezvousd.trainer.example",
        ]
    )
    assert status == 2  # the client could not read its token
    assert _children() - before == set()


# Modules that a node's start (the launcher until its spares run, a spare until it
# waits for its assignment) must not load: each costs CPU that the 2 cores of a
# replacement node share, and none is on that path.
NOT_BEFORE_SPARES = ("tomllib", "tempfile", "ctypes", "grpc", "numpy")
NOT_IN_A_SPARE = (
    "rendezvousd.client.transport",  # the file transport, for workers without an agent
    "rendezvousd.cli.embedded",  # the daemon it hosts
    "rendezvousd.config",  # that daemon's settings
    "rendezvousd.daemon",
    "rendezvousd.common.limits",  # the daemon's bounds
    "rendezvousd.client.aio",
    "rendezvousd.trainer.agent.worker_boot",  # the agent's side of a worker's start
    "tomllib",  # a spare is handed a resolved config; no TOML
    "tempfile",  # checkpoints are written later, if ever
    "zipfile",
    "rendezvousd.common.model",  # the daemon's values (~1.5 ms of CPU per dataclass)
)
# The launcher's whole path to its join: the agent, the SDK and its connection.
NOT_IN_A_LAUNCHER = ("numpy", "rendezvousd.common.model", "rendezvousd.config", "tomllib")


@pytest.mark.parametrize(
    ("entry", "unwanted"),
    [
        ("rendezvousd.trainer.agent.launcher", NOT_BEFORE_SPARES),
        ("rendezvousd.trainer.example", NOT_IN_A_SPARE),
        ("rendezvousd.trainer.distributed, rendezvousd.client.sync", NOT_IN_A_SPARE),
        (
            "rendezvousd.trainer.agent.launcher, rendezvousd.trainer.agent.node_agent, "
            "rendezvousd.client.connection",
            NOT_IN_A_LAUNCHER,
        ),
    ],
    ids=["launcher", "spare", "assigned-spare", "joining-launcher"],
)
def test_a_node_start_imports_nothing_it_does_not_use(
    entry: str, unwanted: tuple[str, ...]
) -> None:
    probe = f"import json, sys, {entry}; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    loaded = set(json.loads(done.stdout))
    assert {e.strip() for e in entry.split(",")} <= loaded
    assert sorted(loaded & set(unwanted)) == []


def test_a_spare_imports_before_its_assignment_what_its_start_needs_after_it(
    daemon: DaemonProcess, job_id: str, tmp_path: Path
) -> None:
    args = launcher_cmd(1, 0, 2, endpoint=daemon.endpoint, token_file=daemon.token_file, job=job_id)
    done = subprocess.run(
        [*args, str(WORKERS / "assigned_imports_worker.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    out = tmp_path / "out"
    out.write_text(done.stdout)
    reports = [r for r in json_lines(out) if r.get("event") == "assigned-imports"]
    assert sorted(r["rank"] for r in reports) == [0, 1], done.stdout
    # Nothing of this project is left to import once assigned (the attach's client
    # and the CPU ring were, on the path of every restart); ``waited``: the probe
    # saw the assignment at all.
    assert [(r["waited"], r["late"]) for r in reports] == [(True, [])] * 2, done.stdout


def test_a_fresh_node_starts_no_spare_beside_workers_that_are_still_starting(
    daemon: DaemonProcess, job_id: str, tmp_path: Path
) -> None:
    # Its workers take 4 s to be warm, longer than SPARE_DELAY_S after their
    # assignment; a restart is allowed, so the agent wants spares once they train.
    args = launcher_cmd(1, 0, 2, endpoint=daemon.endpoint, token_file=daemon.token_file, job=job_id)
    out = tmp_path / "out"
    with out.open("w") as fh:
        done = subprocess.run(
            [*args, "--max-restarts", "1", str(WORKERS / "slow_start_worker.py"), "4", "1.5"],
            stdout=fh,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
    assert done.returncode == 0, done.stderr
    events = json_lines(out)
    started = [e for e in events if e["event"] == "started"]
    first = {e["pid"] for e in started[:2]}
    warm = [e["t"] for e in events if e["event"] == "warm" and e["pid"] in first]
    spares = [e["t"] for e in started if e["pid"] not in first]
    assert len(warm) == 2 and spares, events
    # The node's spares start only once both workers were warm (CLOCK_MONOTONIC is
    # one clock for every process of the host).
    assert min(spares) > max(warm), events
