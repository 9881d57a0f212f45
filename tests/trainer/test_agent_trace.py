"""RENDEZVOUSD_TRACE_FILE: the milestones benchmarks/recovery.py breaks a recovery
into, written by the launcher, its agent and its workers of a real node (one daemon
on loopback, one worker failing once at step 3), and nothing secret among them."""

from __future__ import annotations

import json
import os
import subprocess
from collections import Counter
from pathlib import Path

from tests.support import ROOT, WORKERS, DaemonProcess, launcher_cmd

LAUNCHER = ("launcher-main", "spares-started", "join-start", "joined", "assigned")
WORKER = ("spare-ready", "assignment-heard", "attached", "ring-up")


def test_a_node_traces_its_milestones_and_its_recovery_when_asked(
    daemon: DaemonProcess, job_id: str, tmp_path: Path
) -> None:
    trace = tmp_path / "trace.jsonl"
    cmd = launcher_cmd(1, 0, 2, endpoint=daemon.endpoint, token_file=daemon.token_file, job=job_id)
    cmd += ["--max-restarts", "1", str(WORKERS / "elastic_worker.py"), "--exit-rank", "1"]
    proc = subprocess.run(
        cmd,
        env={**os.environ, "RENDEZVOUSD_TRACE_FILE": str(trace)},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    launcher = [e for e in lines if e["ppid"] == os.getpid()]
    pid = launcher[0]["pid"]
    workers = [e for e in lines if e["ppid"] == pid]
    assert {e["pid"] for e in launcher} == {pid}
    assert launcher[0]["event"] == "launcher-main"
    mine = Counter(e["event"] for e in launcher)
    # Two generations: the first, failed by rank 1, and the restart.
    assert {k: mine[k] for k in LAUNCHER} == {
        "launcher-main": 1,
        "spares-started": 1,
        "join-start": 2,
        "joined": 2,
        "assigned": 2,
    }
    assert mine["failure-heard"] == 1 and mine["stopped"] == 1
    assert [e["generation"] for e in launcher if e["event"] == "joined"] == [1, 2]
    # Each of the two generations' two workers, from ready to its ring.
    theirs = Counter(e["event"] for e in workers)
    assert {k: theirs[k] for k in WORKER} == dict.fromkeys(WORKER, 4)
    rings = sorted((e["generation"], e["rank"]) for e in workers if e["event"] == "ring-up")
    assert rings == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert all(isinstance(e["t"], float) for e in lines)
    token = daemon.token_file.read_text().strip()
    assert token not in trace.read_text()
