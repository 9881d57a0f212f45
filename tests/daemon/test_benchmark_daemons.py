"""A benchmark's own daemon ends with the benchmark, however the benchmark ends.

A benchmark killed alone (SIGKILL, an OOM kill, a parent that kills only its child,
not the process group as Ctrl-C would) left its daemon serving: one ran on for 40
minutes beside later measurements (session 34). Each benchmark that starts a daemon
starts it with ``exit_with_parent``, whose stdin pipe the kernel closes even on SIGKILL.
Not run here: pg_bootstrap.py (needs torch) and gpu_check.py (needs a GPU), which start
theirs the same way.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Each benchmark with arguments that keep it running well past its daemon's start.
RUNS = {
    "rpc_cost": ["--calls", "2000000"],
    "soak": ["--duration", "600", "--members", "8"],
    "generation_churn": ["--generations", "10000000", "--modes", "rank"],
    "rendezvous_scale": ["--ranks", "1024", "--no-anchor"],
    "state_write_latency": ["--big-mb", "1", "--sets", "10000000"],
    "preauth_streams": ["--sockets", "1", "--streams", "10", "--hold-s", "600"],
    "status_held": ["--finished", "1000000"],
    "noisy_neighbours": ["--attacks", "", "--seconds", "600"],
}


def _daemon_under(parent: int) -> int | None:
    """The pid of a ``rendezvousd serve`` process whose parent is ``parent``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and b"rendezvousd.cli" in cmdline and b"serve" in cmdline:
            return int(entry.name)
    return None


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has ended; init reaps it


@pytest.mark.parametrize("benchmark", sorted(RUNS))
def test_a_benchmark_killed_alone_takes_its_daemon_with_it(benchmark: str) -> None:
    script = ROOT / "benchmarks" / f"{benchmark}.py"
    run = subprocess.Popen(
        [sys.executable, str(script), *RUNS[benchmark]],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # so that the test can clean up all of it afterwards
    )
    try:
        deadline = time.monotonic() + 60
        daemon = None
        while daemon is None and time.monotonic() < deadline and run.poll() is None:
            time.sleep(0.05)
            daemon = _daemon_under(run.pid)
        assert daemon is not None, f"{benchmark} started no daemon (exit {run.poll()})"
        time.sleep(1)  # the benchmark at work, its daemon serving
        assert run.poll() is None, f"{benchmark} ended on its own (exit {run.returncode})"
        run.kill()  # the benchmark alone, not its process group
        run.wait()
        gone_by = time.monotonic() + 30
        while _alive(daemon) and time.monotonic() < gone_by:
            time.sleep(0.1)
        assert not _alive(daemon), f"{benchmark}'s daemon (pid {daemon}) outlived it"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)
        run.wait()
