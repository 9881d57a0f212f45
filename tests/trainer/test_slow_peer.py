"""A rank stuck waiting on a slow peer says so (gray failures): two real worker
processes under ``init_distributed`` and a real daemon; one is stopped (SIGSTOP), as a
throttled or frozen node is, alive to the kernel and the daemon but sending nothing.
Its peer names it, with its host, while it waits, and the job goes on once it is let go.
The worker is ``tests/workers/slow_peer_worker.py``."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support import WORKERS, DaemonProcess, rest_of_stdout, wait_for

WORKER = str(WORKERS / "slow_peer_worker.py")


def _env(
    d: DaemonProcess, job: str, local: int, shared_memory: bool, world: int = 2
) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RENDEZVOUSD_", "GRPC_"))}
    return {
        **env,
        "RENDEZVOUSD_ENDPOINT": d.endpoint,
        "RENDEZVOUSD_TOKEN_FILE": str(d.token_file),
        "RENDEZVOUSD_JOB_ID": job,
        "RENDEZVOUSD_NUM_NODES": "1",
        "RENDEZVOUSD_GPUS_PER_NODE": str(world),
        "RENDEZVOUSD_NODE_RANK": "0",
        "RENDEZVOUSD_LOCAL_RANK": str(local),
        "RENDEZVOUSD_BACKEND": "cpu",
        "RENDEZVOUSD_CPU_SHARED_MEMORY": str(shared_memory).lower(),
        "RENDEZVOUSD_SLOW_PEER_WARN_S": "0.5",
        # Far above the stop: the wait must end by the peer going on, not by a timeout.
        "RENDEZVOUSD_COLLECTIVE_TIMEOUT_S": "60",
        "RENDEZVOUSD_JOIN_TIMEOUT_S": "60",
    }


def _says(log: Path, line: re.Pattern[str]) -> Callable[[], bool]:
    return lambda: line.search(log.read_text()) is not None


def _ready(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("{") and (event := json.loads(line))["event"] == "ready":
            return dict(event)
    raise AssertionError(f"the worker ended before its first step (exit {proc.wait(10)})")


@pytest.mark.parametrize("shared_memory", [False, True], ids=["tcp-ring", "shared-memory"])
def test_a_rank_waiting_on_a_stopped_peer_names_it_and_goes_on_when_it_resumes(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path, shared_memory: bool
) -> None:
    # Beats far apart from the stop: the daemon must not call the stopped rank lost.
    d = start_daemon("--heartbeat-timeout-s", "60")
    stop_file = tmp_path / "stop"
    logs = [tmp_path / f"rank{local}.err" for local in (0, 1)]
    procs = []
    for local, log in enumerate(logs):
        with log.open("w") as err:
            procs.append(
                subprocess.Popen(
                    [sys.executable, WORKER, str(stop_file)],
                    env=_env(d, job_id, local, shared_memory),
                    stdout=subprocess.PIPE,
                    stderr=err,
                    text=True,
                )
            )
    try:
        ready = {(e := _ready(p))["rank"]: e for p in procs}
        stopped = ready[1]
        transport = "shared-memory" if shared_memory else "tcp-ring"
        assert ready[0]["transport"] == transport, ready
        os.kill(stopped["pid"], signal.SIGSTOP)
        try:
            peer = rf"pid {stopped['pid']} on this host" if shared_memory else r"host 127\.0\.0\.1"
            said = re.compile(
                r"rank 0: (all_reduce|barrier|broadcast) #\d+ .*of generation \d+, after step "
                rf"\d+ has waited ([\d.]+) s for .*rank 1 \({peer}\).*: rank 1 is stopped, "
                r"throttled or far behind.*collective_timeout_s"
            )

            def waits() -> list[float]:
                return [float(m[2]) for m in said.finditer(logs[0].read_text())]

            # Said once the wait passed 0.5 s, then again as it doubles (1 s, 2 s).
            wait_for("rank 0's second line naming the stopped rank 1", lambda: len(waits()) >= 2)
        finally:
            os.kill(stopped["pid"], signal.SIGCONT)
        first, second = waits()[:2]
        assert first >= 0.5, waits()
        assert second >= 1.0, waits()  # again once the wait doubled
        wait_for(
            "rank 0's line that rank 1 was heard again",
            lambda: (
                re.search(r"rank 0: .* heard from rank 1 .* again", logs[0].read_text()) is not None
            ),
        )
        stop_file.touch()
        outs = [rest_of_stdout(p, 60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
    done = [
        json.loads(line)
        for out in outs
        for line in out.splitlines()
        if line.startswith("{") and json.loads(line)["event"] == "done"
    ]
    assert sorted(e["rank"] for e in done) == [0, 1], (outs, [log.read_text() for log in logs])
    assert len({e["steps"] for e in done}) == 1, done
    assert [p.returncode for p in procs] == [0, 0], [log.read_text() for log in logs]
    # The stopped rank waited on nobody: only its peer says it waited.
    assert "has waited" not in logs[1].read_text()


def test_in_a_ring_of_three_the_stopped_rank_is_the_one_named_that_says_no_wait(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path
) -> None:
    """Ranks downstream of a stalled rank wait too, each on its own left neighbour
    (rank 2 on the stopped rank 1, rank 0 on rank 2 or on rank 1's acknowledgement):
    the stopped rank is the one named that says no wait itself (docs/trainer.md)."""
    d = start_daemon("--heartbeat-timeout-s", "60")
    stop_file = tmp_path / "stop"
    logs = [tmp_path / f"rank{local}.err" for local in range(3)]
    procs = []
    for local, log in enumerate(logs):
        with log.open("w") as err:
            procs.append(
                subprocess.Popen(
                    [sys.executable, WORKER, str(stop_file)],
                    env=_env(d, job_id, local, False, world=3),
                    stdout=subprocess.PIPE,
                    stderr=err,
                    text=True,
                )
            )
    try:
        ready = {(e := _ready(p))["rank"]: e for p in procs}
        os.kill(ready[1]["pid"], signal.SIGSTOP)
        try:
            for rank, left in ((2, 1), (0, 2)):
                said = re.compile(
                    rf"rank {rank}: all_reduce #\d+ .* has waited [\d.]+ s for .*rank "
                    rf"({left}|1) \(host 127\.0\.0\.1\)"
                )
                wait_for(f"rank {rank}'s line naming the rank it waits on", _says(logs[rank], said))
        finally:
            os.kill(ready[1]["pid"], signal.SIGCONT)
        waited_on_1 = re.search(r"rank 2: .* for data from rank 1 ", logs[2].read_text())
        assert waited_on_1 is not None, logs[2].read_text()
        stop_file.touch()
        for p in procs:
            rest_of_stdout(p, 60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
    assert [p.returncode for p in procs] == [0, 0, 0], [log.read_text() for log in logs]
    assert "has waited" not in logs[1].read_text()


def test_a_wait_said_and_then_heard_is_said_ended_though_the_communicator_stops_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The watcher looks every quarter threshold (every 5 s at the defaults): a run that
    ended right after its peer was heard again never said so (helper-175: four lines of
    rank 0 waiting on rank 1, then none that rank 1 came back)."""
    from rendezvousd.trainer.comm.peer_wait import DATA, PeerWaits

    waits = PeerWaits(0, warn_s=2.0, timeout_s=300.0)  # looks every 0.5 s
    waits.hosts[1] = "host 10.0.0.2"
    caplog.set_level(logging.WARNING, logger="rendezvousd.trainer")
    waits.start()
    try:
        waits.begin(1, (0, 0, 0, 1, 16), DATA)
        wait_for("the wait said", lambda: "has waited" in caplog.text, timeout=10)
        time.sleep(0.1)  # the watcher back asleep, its next look 0.4 s away
        waits.current = None  # heard
    finally:
        waits.stop()
    assert "heard from rank 1 (host 10.0.0.2) again after waiting at least" in caplog.text
