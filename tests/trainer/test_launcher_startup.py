"""rendezvous-run's start-up order: a fresh node's spares start before the launcher
imports gRPC (and the node agent never imports numpy), so that on a replacement
node the launcher's start-up and its spares' overlap (docs/benchmarks.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rendezvousd.trainer.agent import launcher
from tests.support import DaemonProcess, launcher_cmd

# Runs rendezvous-run in this process, noting in $ORDER_FILE, in order, the first
# process it starts and its first imports of grpc and numpy (audit events), then
# how many processes it started in all.
ORDER_PROBE = r"""
import os, runpy, sys
order = []
spawned = []
def hook(event, args):
    if event == "import" and args[0] in ("grpc", "numpy") and args[0] not in order:
        order.append(args[0])
    elif event == "subprocess.Popen":
        spawned.append(1)
        if "spawn" not in order:
            order.append("spawn")
sys.addaudithook(hook)
sys.argv = ["rendezvous-run", *sys.argv[1:]]
try:
    runpy.run_module("rendezvousd.trainer.agent.launcher", run_name="__main__", alter_sys=True)
finally:
    with open(os.environ["ORDER_FILE"], "w") as fh:
        fh.write(" ".join(order) + "\n" + str(len(spawned)))
"""


def test_spares_start_before_the_launcher_imports_grpc_and_the_agent_needs_no_numpy_nor_spares_it_cannot_use(
    daemon: DaemonProcess, job_id: str, tmp_path: Path
) -> None:
    order_file = tmp_path / "order"
    args = launcher_cmd(1, 0, 2, endpoint=daemon.endpoint, token_file=daemon.token_file, job=job_id)
    args = args[3:]  # the flags, without "python -m rendezvousd.trainer.agent.launcher"
    example = ["-m", "rendezvousd.trainer.example", "--steps", "30", "--log-every", "1000"]
    done = subprocess.run(
        [sys.executable, "-c", ORDER_PROBE, *args, *example],
        env={**os.environ, "ORDER_FILE": str(order_file)},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    order, spawned = order_file.read_text().splitlines()
    # grpc once the spares run; numpy never: the agent relays the workers' state
    # frames (three steps of them here) without decoding them.
    assert order.split() == ["spawn", "grpc"], done.stderr
    # No restarts allowed and a fixed size: no spare beyond the two workers, whose
    # start-up would only take CPU from the training.
    assert spawned == "2", done.stderr


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
