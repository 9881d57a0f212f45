"""A call ends by its deadline, the look at why it got no answer included.

The look (a health Check, the TLS probes, a plain connect naming the cause) and the
retry each came after the deadline: connect_timeout=3 ended at 5 s at a host that
drops packets, and kv_get(timeout=3), due at 8 s, at 22 s at a SIGSTOPped daemon.
These are deadlines, not speed: each bound has a generous margin.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rendezvousd.client import (
    DaemonUnavailable,
    RendezvousClient,
    RendezvousError,
    RendezvousTimeout,
)
from tests.support import DaemonProcess, spawn_daemon

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


SILENT_NS = "h141sil"
SILENT_HOST_IF, SILENT_NS_IF = "h141sila", "h141silb"
SILENT_HOST_IP, SILENT_NS_IP = "198.18.141.1", "198.18.141.2"


@pytest.fixture
def silenced_daemon(tmp_path: Path) -> Iterator[tuple[DaemonProcess, Callable[[], None]]]:
    """A daemon on a namespace host, and what makes that host silent: every packet
    this host sends it goes to a MAC no one has (as netns.partition cuts a link)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and ip(8) for a network namespace")

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, timeout=10, capture_output=True)

    ip("netns", "add", SILENT_NS)
    daemon = None
    try:
        ip("link", "add", SILENT_HOST_IF, "type", "veth", "peer", "name", SILENT_NS_IF)
        ip("link", "set", SILENT_NS_IF, "netns", SILENT_NS)
        ip("addr", "add", f"{SILENT_HOST_IP}/30", "dev", SILENT_HOST_IF)
        ip("link", "set", SILENT_HOST_IF, "up")
        ip("-n", SILENT_NS, "addr", "add", f"{SILENT_NS_IP}/30", "dev", SILENT_NS_IF)
        ip("-n", SILENT_NS, "link", "set", SILENT_NS_IF, "up")
        daemon = spawn_daemon(
            tmp_path,
            "--insecure-plaintext",
            listen=f"{SILENT_NS_IP}:0",
            prefix=["ip", "netns", "exec", SILENT_NS],
        )
        silence = functools.partial(
            ip, "neigh", "replace", SILENT_NS_IP, "lladdr", "02:00:00:00:00:01",
            "dev", SILENT_HOST_IF, "nud", "permanent",
        )  # fmt: skip
        yield daemon, silence
    finally:
        if daemon is not None:
            daemon.kill()
        subprocess.run(["ip", "link", "del", SILENT_HOST_IF], timeout=10, capture_output=True)
        subprocess.run(["ip", "netns", "del", SILENT_NS], timeout=10, capture_output=True)


def test_a_daemon_gone_silent_after_the_join_is_unavailable_from_the_first_call(
    silenced_daemon: tuple[DaemonProcess, Callable[[], None]],
) -> None:
    """Its channel still READY, the first call heard "the daemon did not answer in
    time" (RendezvousTimeout, as for a slow call), the second "is the daemon running
    and reachable?" with no cause; only the third named one."""
    daemon, silence = silenced_daemon
    call_s = 3.0
    client = RendezvousClient(
        daemon.endpoint, "dl-silent", token=daemon.token, call_timeout=call_s, reconnect_window=60
    )
    try:
        client.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        client.start_heartbeat()
        silence()
        for call in (lambda: client.kv_set("k", b"v"), lambda: client.kv_get("k", wait=False)):
            error = ends_within(call_s, call)
            assert isinstance(error, DaemonUnavailable), repr(error)
            assert not isinstance(error, RendezvousTimeout), repr(error)
            # What the look found, within the deadline: no answer to a connect.
            assert "a TCP connect gets no answer within" in str(error), error
            assert "is the daemon running and reachable?" not in str(error), error
    finally:
        client.close()


def test_a_leave_at_a_killed_daemon_says_nothing_listens_there(
    start_daemon: Callable[..., DaemonProcess], caplog: pytest.LogCaptureFixture
) -> None:
    daemon = start_daemon()
    client = RendezvousClient(daemon.endpoint, "dl-leave", token=daemon.token, reconnect_window=60)
    try:
        client.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        client.start_heartbeat()
        daemon.kill()
        with caplog.at_level(logging.WARNING, logger="rendezvousd.client"):
            started = time.monotonic()
            client.leave()
            took = time.monotonic() - started
        said = " ".join(r.getMessage() for r in caplog.records)
        assert "nothing listens there (connection refused)" in said, said
        assert "did not answer in time" not in said, said
        # Within the leave timeout (2 s), the look included.
        assert took <= 2.0 + MARGIN_S, took
    finally:
        client.close()
