"""The retry policy: waitForReady while the daemon starts, exactly one retry on a
transient failure, exactly one attempt on a permanent one."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from rendezvousd.client import DaemonUnavailable, RendezvousClient, TopologyMismatch
from tests.support import DaemonProcess, free_port, members, spawn_daemon, wait_for, write_token


def test_daemon_started_late_still_lets_join_succeed(tmp_path: Path) -> None:
    port = free_port()
    token = write_token(tmp_path / "t")
    result: dict[str, object] = {}

    def join() -> None:
        with RendezvousClient(f"127.0.0.1:{port}", "late", token=token, connect_timeout=20) as c:
            result["m"] = c.join(
                num_nodes=1, gpus_per_node=1, node_rank=0, local_rank=0, timeout=20
            )
            c.leave()

    # Hold the port with a listener that never answers, so the worker's first
    # connection attempt is visible: then it is certainly waiting for the daemon.
    with socket.create_server(("127.0.0.1", port)) as blocker:
        t = threading.Thread(target=join)
        t.start()
        blocker.settimeout(20)
        attempt, _ = blocker.accept()
        attempt.close()
    daemon = spawn_daemon(tmp_path, token=token, listen=f"127.0.0.1:{port}")
    try:
        t.join(30)
        assert not t.is_alive()
        assert result["m"].rank == 0  # type: ignore[attr-defined]
    finally:
        daemon.kill()


@pytest.mark.parametrize("attempts", [0, 1, 2])
def test_daemon_gone_retries_exactly_as_configured_then_fails_loudly(attempts: int) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with (
        RendezvousClient(
            endpoint, "gone", token="x" * 32, connect_timeout=0.6, retry_attempts=attempts
        ) as c,
        pytest.raises(DaemonUnavailable) as info,
    ):
        c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=5)
    elapsed = time.monotonic() - started
    err = info.value
    assert err.attempts == attempts + 1
    assert endpoint in str(err) and "Check" in str(err) and f"{attempts + 1} attempt" in str(err)
    # Each attempt waits for the daemon up to connect_timeout: the retries really happened.
    assert elapsed >= 0.6 * (attempts + 1) - 0.05
    assert elapsed < 0.6 * (attempts + 1) + 5


def _count(metrics_url: str, method: str, code: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    needle = f'rendezvousd_rpc_duration_seconds_count{{code="{code}",method="{method}"}}'
    for line in text.splitlines():
        if line.startswith(needle):
            return float(line.split()[-1])
    return 0.0


def test_permanent_error_is_tried_exactly_once(
    start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    d = start_daemon("--metrics-listen", "127.0.0.1:0")
    holder = RendezvousClient(d.endpoint, job_id, token=d.token, retry_attempts=3)

    def hold_rank_zero() -> None:
        with pytest.raises(TopologyMismatch):
            holder.join(num_nodes=1, gpus_per_node=2, node_rank=0, local_rank=0, timeout=3)

    t = threading.Thread(target=hold_rank_zero)
    t.start()
    wait_for("rank 0 to park in Join", lambda: len(members(d, job_id)) == 1)
    with (
        RendezvousClient(d.endpoint, job_id, token=d.token, retry_attempts=3) as c,
        pytest.raises(TopologyMismatch),
    ):
        c.join(num_nodes=1, gpus_per_node=4, node_rank=0, local_rank=1, timeout=3)
    # The daemon records a call just after sending its status: allow it a moment,
    # then check that no second attempt follows.
    wait_for(
        "the refused Join in the metrics",
        lambda: _count(d.metrics_url, "Join", "FAILED_PRECONDITION") >= 2,
    )
    # A retry would follow within the first backoff (0.2 s): give it twice that to show up.
    time.sleep(0.5)
    # Two: the refused Join, and the parked rank 0 the conflict failed with it.
    assert _count(d.metrics_url, "Join", "FAILED_PRECONDITION") == 2
    t.join(15)
    holder.close()
