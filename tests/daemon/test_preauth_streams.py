"""Half-open HTTP/2 streams before authentication (HEADERS, never a body) cost the
daemon a bounded amount: streams beyond the per-connection cap are refused by gRPC
core, token-less calls end at once or after the body timeout, and legitimate
clients still join, meet in barriers and heartbeat under the same options.

The raw client is benchmarks/preauth_streams.py (its full 50,000-stream run is the
measurement); here it runs small.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client import RendezvousClient
from tests.support import ROOT, DaemonProcess, parallel, wait_for

MIB = 1024  # in KiB, as RSS is reported
ENHANCE_YOUR_CALM = 0xB  # an HTTP/2 error code (RFC 9113, section 7)


def _flood(*flags: str) -> dict[str, Any]:
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "preauth_streams.py"), *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    report: dict[str, Any] = json.loads(run.stdout)
    return report


def test_half_open_token_less_streams_are_refused_or_answered_and_memory_stays_bounded() -> None:
    report = _flood(
        "--sockets=3",
        "--streams=1500",
        "--method=join",
        "--until-ended-s=30",
        "--hold-s=0.5",
        "--after-s=0.5",
        "--daemon-flag=--max-concurrent-streams=50",
    )
    assert report["daemon_alive"], report
    # Beyond 50 open streams a connection's HEADERS are refused by gRPC core ...
    assert report["refused"] > 0, report
    # ... and the token-less Joins it took are answered UNAUTHENTICATED without
    # waiting for a body: none is left holding memory.
    assert report["held_open"] == 0, report
    # gRPC core turns a stream away with REFUSED_STREAM at the cap or, when the
    # machine is busy (2 of 13 runs beside six busy loops), with ENHANCE_YOUR_CALM
    # (11): ended before any handler all the same. Nothing else may end them.
    assert set(report["reset_codes"]) <= {str(ENHANCE_YOUR_CALM)}, report
    assert report["refused"] + report["answered"] + report["reset"] == 3 * 1500, report
    # Today's cost was ~20 KiB per held stream: 4,500 of them were ~90 MiB.
    assert report["rss_kib"]["growth_held"] < 40 * MIB, report


def test_half_open_health_checks_are_counted_and_end_after_the_body_timeout() -> None:
    report = _flood(
        "--sockets=2",
        "--streams=300",
        "--method=health",
        "--until-ended-s=30",
        "--hold-s=0",
        "--after-s=0.5",
        "--daemon-flag=--request-body-timeout-s=0.5",
    )
    assert report["daemon_alive"], report
    # Health calls carry no token by design: their handlers wait for a body, so the
    # daemon counts them from their headers (max_health_checks) and ends those
    # whose body never comes.
    assert report["held_open"] == 0, report
    assert report["answered"] >= 1, report


# The client preface and an empty SETTINGS frame: enough for gRPC to answer.
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000")


def _connection(d: DaemonProcess) -> tuple[socket.socket, bool]:
    """A raw connection, and whether the daemon answered it (False: it closed it)."""
    host, port = d.endpoint.rsplit(":", 1)
    conn = socket.create_connection((host, int(port)), timeout=10)
    conn.sendall(_PREFACE)
    try:
        return conn, bool(conn.recv(64))
    except ConnectionResetError:
        return conn, False


def test_connections_beyond_max_connections_are_closed_at_once(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon("--max-connections", "2")
    held = [_connection(d) for _ in range(2)]
    assert [answered for _, answered in held] == [True, True]
    extra, answered = _connection(d)
    extra.close()
    assert not answered, "a third connection was served"
    held[0][0].close()

    def one_more() -> bool:
        conn, answered = _connection(d)
        conn.close()
        return answered

    wait_for("a freed connection slot", one_more)
    held[1][0].close()


def test_a_connection_without_calls_is_closed_after_connection_idle_s(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon("--connection-idle-s", "0.3")
    conn, answered = _connection(d)
    with conn:
        assert answered
        started = time.monotonic()
        while conn.recv(4096):  # SETTINGS, its ACK, then GOAWAY
            pass
        assert time.monotonic() - started < 8


def test_clients_join_meet_and_heartbeat_under_tight_connection_limits(
    start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    d = start_daemon(
        "--max-concurrent-streams",
        "4",
        "--connection-idle-s",
        "0.3",
        "--heartbeat-timeout-s",
        "1",
    )
    clients = [RendezvousClient(d.endpoint, job_id, token=d.token) for _ in range(3)]
    try:
        joined = parallel(
            [
                lambda c=c, r=r: c.join(num_nodes=1, gpus_per_node=3, local_rank=r, timeout=20)  # type: ignore[misc]
                for r, c in enumerate(clients)
            ]
        )
        assert sorted(m.rank for m in joined) == [0, 1, 2]
        for c in clients:
            c.start_heartbeat(0.2)
        parallel([lambda c=c: c.barrier("one", timeout=20) for c in clients])  # type: ignore[misc]
        # Not a synchronisation: time passing, longer than the idle limit and the
        # heartbeat timeout. An open heartbeat stream is a call, so no member's
        # connection is closed as idle, and no member is lost.
        time.sleep(1.5)
        parallel([lambda c=c: c.barrier("two", timeout=20) for c in clients])  # type: ignore[misc]
        job = clients[0].get_job()
        assert job.summary.state == pb.JOB_STATE_RUNNING and not job.failed, job
        assert all(c.failure is None for c in clients)
        # A client with no call open loses its connection to the idle limit; its
        # next call reconnects.
        with RendezvousClient(d.endpoint, job_id, token=d.token) as idle:
            assert idle.get_job().summary.state == pb.JOB_STATE_RUNNING
            time.sleep(1.0)
            assert idle.get_job().summary.state == pb.JOB_STATE_RUNNING
    finally:
        for c in clients:
            c.close()
