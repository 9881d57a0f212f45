"""A call ends by its deadline, the look at why it got no answer included.

The look (a health Check, the TLS probes, a plain connect naming the cause) and the
retry each came after the deadline: connect_timeout=3 ended at 5 s at a host that
drops packets, and kv_get(timeout=3), due at 8 s, at 22 s at a SIGSTOPped daemon.
These are deadlines, not speed: each bound has a generous margin.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator

import pytest

from rendezvousd.client import DaemonUnavailable, RendezvousClient, RendezvousError
from tests.support import DaemonProcess

MARGIN_S = 1.0
CALL_S = 2.0


def ends_within(bound: float, call: Callable[[], object]) -> RendezvousError:
    started = time.monotonic()
    with pytest.raises(RendezvousError) as caught:
        call()
    took = time.monotonic() - started
    assert took <= bound + MARGIN_S, f"took {took:.2f} s, bound {bound} s: {caught.value}"
    return caught.value


def test_calls_at_a_stopped_daemon_end_by_their_deadlines(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    daemon = start_daemon("--heartbeat-timeout-s", "5")
    kw = dict(token=daemon.token, call_timeout=CALL_S, connect_timeout=CALL_S)
    clients = {}
    for name in ("get_job", "kv_get", "kv_get_nowait"):
        c = RendezvousClient(daemon.endpoint, f"dl-{name}", reconnect_window=60, **kw)
        c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        clients[name] = c
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        # A wait's deadline is the wait plus 5 s (docs/sdk.md), its retry included.
        # First: a connection silent for longer is ended by gRPC's keepalive, and a
        # wait cut so waits for the daemon's return within the reconnect window.
        ends_within(0.5 + 5, lambda: clients["kv_get"].kv_get("k", timeout=0.5))
        # Retried, an idempotent call got a whole call_timeout again.
        ends_within(CALL_S, clients["get_job"].get_job)
        ends_within(CALL_S, lambda: clients["kv_get_nowait"].kv_get("k", wait=False))
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
        for c in clients.values():
            c.close()


NS = "h137dl"
HOST_IF, NS_IF = "h137dla", "h137dlb"
HOST_IP, NS_IP = "198.18.137.1", "198.18.137.2"


@pytest.fixture
def black_hole() -> Iterator[str]:
    """An address that never answers: a namespace that drops what it sends back."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and ip(8) for a network namespace")

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, timeout=10, capture_output=True)

    ip("netns", "add", NS)
    try:
        ip("link", "add", HOST_IF, "type", "veth", "peer", "name", NS_IF)
        ip("link", "set", NS_IF, "netns", NS)
        ip("addr", "add", f"{HOST_IP}/30", "dev", HOST_IF)
        ip("link", "set", HOST_IF, "up")
        ip("-n", NS, "addr", "add", f"{NS_IP}/30", "dev", NS_IF)
        ip("-n", NS, "link", "set", NS_IF, "up")
        # Every answer, a SYN-ACK or a reset, is dropped on its way back.
        ip("-n", NS, "route", "add", "blackhole", f"{HOST_IP}/32")
        yield f"{NS_IP}:29537"
    finally:
        subprocess.run(["ip", "link", "del", HOST_IF], timeout=10, capture_output=True)
        subprocess.run(["ip", "netns", "del", NS], timeout=10, capture_output=True)


def test_a_connect_to_a_black_hole_ends_by_its_connect_timeout(black_hole: str) -> None:
    client = RendezvousClient(
        black_hole, "dl-bh", token="x" * 32, connect_timeout=CALL_S, call_timeout=CALL_S
    )
    try:
        error = ends_within(CALL_S, client.connect)
        assert isinstance(error, DaemonUnavailable)
        # The cause is still named.
        assert "a TCP connect gets no answer" in str(error), error
    finally:
        client.close()
    # An inspecting client's first call looks at the daemon first, within its deadline.
    inspecting = RendezvousClient(black_hole, "", token="x" * 32, call_timeout=CALL_S)
    try:
        error = ends_within(CALL_S, inspecting.list_jobs)
        assert "a TCP connect gets no answer" in str(error), error
    finally:
        inspecting.close()
