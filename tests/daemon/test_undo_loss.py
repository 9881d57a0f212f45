"""A worker dies as storage fails: the loss its stream's end made cannot be committed
and is undone, yet the worker is still dead, and its survivor alive.

The daemon pushed PEER_FAILED as it decided the loss, before the commit that then
failed: the survivor heard of a failure that was undone, stopped heartbeating, and
the undone generation, RUNNING again, failed later blaming the survivor ("no
heartbeat ... (worker unreachable)"), the killed rank's death recorded nowhere. A
loss's push now waits for its commit, and an undone loss waits in memory for storage.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client import RendezvousClient
from tests.daemon.test_storage import NOT_SERVING, SERVING, _health, _start
from tests.support import members, wait_for, worker_cmd

TIMEOUT_S = 4


def _stored_failed(state: Path, job_id: str) -> list[dict[str, Any]]:
    db = sqlite3.connect(state / "state.db")
    try:
        row = db.execute("SELECT detail FROM jobs WHERE job_id=?", (job_id,)).fetchone()
    finally:
        db.close()
    failed: list[dict[str, Any]] = json.loads(row[0])["failed"]
    return failed


def test_a_killed_worker_whose_loss_was_undone_is_the_root_cause_not_its_survivor(
    tmp_path: Path,
) -> None:
    d, state = _start(tmp_path, TIMEOUT_S)
    job_id = "undone-loss"
    procs = [
        subprocess.Popen(
            worker_cmd(d, job_id, 1, 2, 0, rank, "--hold-s", "120"),
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            assert json.loads(p.stdout.readline())["event"] == "joined"
        wait_for(
            "both heartbeat streams",
            lambda: sum(m.heartbeat_stream_open for m in members(d, job_id)) == 2,
        )
        shutil.rmtree(state)  # every commit fails from here
        procs[1].send_signal(signal.SIGKILL)
        wait_for("the loss's commit to fail", lambda: _health(d) == NOT_SERVING)
        # Down for longer than the heartbeat timeout: the undone generation runs on.
        time.sleep(TIMEOUT_S + 1.5)
        assert procs[0].poll() is None, procs[0].communicate(timeout=5)[0]
        with RendezvousClient(d.endpoint, job_id, token=d.token) as probe:
            during = probe.get_job()
        assert during.summary.state == pb.JOB_STATE_RUNNING, during

        state.mkdir(mode=0o700)
        wait_for("health SERVING once storage is back", lambda: _health(d) == SERVING)
        out, _ = procs[0].communicate(timeout=20)
        heard = json.loads(out.strip().splitlines()[-1])
        assert heard["type"] == "PeerFailed", heard
        lost = f"lost rank 1 on {socket.gethostname()} (heartbeat stream closed)"
        assert lost in str(heard["message"]), heard

        with RendezvousClient(d.endpoint, job_id, token=d.token) as probe:
            job = probe.get_job()
        assert job.summary.state == pb.JOB_STATE_FAILED, job
        assert [(f.rank, f.cause) for f in job.failed] == [(1, "heartbeat stream closed")]
        assert job.last_failure.cause.startswith("rank 1 on "), job.last_failure
        assert "heartbeat stream closed" in job.last_failure.cause, job.last_failure
        wait_for("the failure written", lambda: bool(_stored_failed(state, job_id)))
        assert [(f["rank"], f["cause"]) for f in _stored_failed(state, job_id)] == [
            (1, "heartbeat stream closed")
        ]
        failed_lines = [line for line in d.log().splitlines() if "-> FAILED" in line]
        assert not any("rank 0 on" in line for line in failed_lines), failed_lines
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
        d.kill()
