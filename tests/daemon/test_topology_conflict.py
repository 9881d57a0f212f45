"""A node started with the wrong topology (e.g. a wrong --nnodes): every worker
process, on either side, exits within seconds naming the offending host and both
topologies, instead of waiting for its join timeout (30 s in join_worker.py)."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from tests.support import DaemonProcess, members, wait_for, worker_cmd


def _worker(d: DaemonProcess, job: str, nodes: int, host: str) -> subprocess.Popen[str]:
    cmd = worker_cmd(d, job, nodes, 1, None, 0, "--host", host)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


@pytest.mark.parametrize("wrong_first", [True, False])
def test_every_worker_exits_with_the_topology_conflict(
    daemon: DaemonProcess, job_id: str, wrong_first: bool
) -> None:
    # The right topology is 3 nodes (the third is still starting), the wrong node says 2.
    procs: list[subprocess.Popen[str]] = []
    try:
        if wrong_first:
            procs.append(_worker(daemon, job_id, 2, "wrong-host"))
            wait_for("the wrong node to park", lambda: len(members(daemon, job_id)) == 1)
            started = time.monotonic()
            procs += [_worker(daemon, job_id, 3, h) for h in ("host-a", "host-b")]
        else:
            procs += [_worker(daemon, job_id, 3, h) for h in ("host-a", "host-b")]
            wait_for("both nodes to park", lambda: len(members(daemon, job_id)) == 2)
            started = time.monotonic()
            procs.append(_worker(daemon, job_id, 2, "wrong-host"))
        for p in procs:
            out, _ = p.communicate(timeout=20)
            last = json.loads(out.strip().splitlines()[-1])
            assert p.returncode == 3, out
            assert last["type"] == "TopologyMismatch" and last["reason"] == "TOPOLOGY_MISMATCH"
            assert "'wrong-host'" in last["message"], last
            assert "num_nodes=2" in last["message"] and "num_nodes=3" in last["message"]
        # Process start-up included; the join timeout they would otherwise wait is 30 s.
        assert time.monotonic() - started < 10.0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
