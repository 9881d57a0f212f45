"""A cold join skips the health probe when the client's channel connects.

A cold client used to send a Health Check before its first join: about 0.5 ms of the
daemon's CPU per client, a third of a cold per-rank join. gRPC reports a channel READY
only once the daemon accepted our TLS and its HTTP/2 SETTINGS arrived, so READY
already proves what the probe did; every other outcome still runs the probe (and its
clear errors: ``test_tls_plaintext_client.py``, ``test_twins.py``).
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc._channel as grpc_channel
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rendezvousd.client import (
    AsyncRendezvousClient,
    AuthenticationError,
    DaemonUnavailable,
    RendezvousClient,
)
from rendezvousd.client import _calls as steps
from rendezvousd.client.connection import SERVICE, TlsConfig
from tests.support import DaemonProcess, InProcessDaemon, Pki, free_port

REACH_S = 1.0


def count_checks(d: InProcessDaemon, monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Health Checks the daemon serves from now on, one entry each (its auth
    interceptor's gate for them, which each Check enters)."""
    gate = d.server._auth.health_checks
    entered: list[object] = []
    enter = gate.enter

    async def counted(context: Any) -> None:
        entered.append(context)
        await enter(context)

    monkeypatch.setattr(gate, "enter", counted)
    return entered


async def test_a_cold_join_sends_no_health_check(
    inproc_daemon: InProcessDaemon, job_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both clients: the asyncio one on the daemon's loop, the blocking one in a
    thread beside it (so it never stalls the loop that serves it)."""
    checks = count_checks(inproc_daemon, monkeypatch)
    aio = inproc_daemon.client(job_id)
    blocking = RendezvousClient(inproc_daemon.endpoint, job_id, token=inproc_daemon.token)
    try:
        joined = await asyncio.gather(
            aio.join(num_nodes=1, gpus_per_node=2, local_rank=0, timeout=10),
            asyncio.to_thread(
                blocking.join, num_nodes=1, gpus_per_node=2, local_rank=1, timeout=10
            ),
        )
        assert sorted(m.rank for m in joined) == [0, 1]
        assert checks == []
        # The count is live: one Check by hand shows up in it.
        response = await health_pb2_grpc.HealthStub(aio._channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE), timeout=5
        )
        assert response.status == health_pb2.HealthCheckResponse.SERVING
        assert len(checks) == 1
    finally:
        await aio.close()
        await asyncio.to_thread(blocking.close)


@pytest.fixture
def listener() -> Iterator[Callable[[bytes | None], str]]:
    """A TCP port that is not a gRPC server: it accepts, then says ``reply`` (or
    nothing) and holds the connection."""
    sockets: list[socket.socket] = []

    def start(reply: bytes | None) -> str:
        server = socket.create_server(("127.0.0.1", 0))
        sockets.append(server)

        def serve() -> None:
            while True:
                try:
                    conn, _ = server.accept()
                except OSError:
                    return
                sockets.append(conn)
                if reply is not None:
                    conn.recv(4096)
                    conn.sendall(reply)

        threading.Thread(target=serve, daemon=True).start()
        return f"127.0.0.1:{server.getsockname()[1]}"

    yield start
    for s in sockets:
        s.close()


async def _reachable(kind: str, endpoint: str, tls: TlsConfig | None) -> bool:
    """What ``kind``'s client answers a ``Reachable`` step (the blocking one in a
    thread)."""
    step = steps.Reachable(REACH_S)
    if kind == "asyncio":
        client = AsyncRendezvousClient(endpoint, "reach", token="t", tls=tls)
        try:
            answer = await client._perform(step)
        finally:
            await client.close()
    else:
        blocking = RendezvousClient(endpoint, "reach", token="t", tls=tls)
        try:
            answer = await asyncio.to_thread(blocking._perform, step)
        finally:
            blocking.close()
    assert isinstance(answer, bool)
    return answer


KINDS = ["asyncio", "blocking"]


@pytest.mark.parametrize(
    ("daemon_tls", "client_tls"),
    [
        ("tls", None),
        ("mtls", "ca"),
        ("mtls", "rogue"),
        ("tls", "ca"),
        ("mtls", "cert"),
    ],
    ids=[
        "plaintext client, TLS daemon",
        "no client certificate, mutual-TLS daemon",
        "a certificate of another CA, mutual-TLS daemon",
        "TLS client, TLS daemon",
        "client certificate, mutual-TLS daemon",
    ],
)
@pytest.mark.parametrize("kind", KINDS)
async def test_only_a_daemon_that_accepts_the_client_is_reachable(
    pki: Pki,
    start_daemon: Callable[..., DaemonProcess],
    daemon_tls: str,
    client_tls: str | None,
    kind: str,
) -> None:
    d = start_daemon(*pki.serve_args(mtls=daemon_tls == "mtls"))
    tls = {
        None: None,
        "ca": TlsConfig(ca=pki.ca),
        "rogue": TlsConfig(ca=pki.ca, cert=pki.rogue, key=pki.rogue_key),
        "cert": TlsConfig(ca=pki.ca, cert=pki.client, key=pki.client_key),
    }[client_tls]
    accepted = (client_tls == "ca" and daemon_tls == "tls") or client_tls == "cert"
    assert await _reachable(kind, d.endpoint, tls) is accepted


@pytest.mark.parametrize(
    "reply", [None, b"HTTP/1.1 400 Bad Request\r\n\r\n"], ids=["silent", "http/1.1"]
)
@pytest.mark.parametrize("kind", KINDS)
async def test_a_port_that_is_not_a_grpc_server_is_not_reachable(
    listener: Callable[[bytes | None], str], reply: bytes | None, kind: str
) -> None:
    assert await _reachable(kind, listener(reply), None) is False


def test_a_blocking_client_without_the_core_call_health_checks(
    monkeypatch: pytest.MonkeyPatch, daemon: DaemonProcess, job_id: str
) -> None:
    """A grpcio whose channel lacks the core call: not reachable, so the join sends
    its Check and goes on as before."""
    client = RendezvousClient(daemon.endpoint, job_id, token=daemon.token)
    try:
        monkeypatch.setattr(client._channel, "_channel", object())
        assert client._perform(steps.Reachable(REACH_S)) is False
        monkeypatch.undo()
        assert client._perform(steps.Reachable(REACH_S)) is True
        m = client.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        assert m.rank == 0
    finally:
        client.close()


def test_a_blocking_client_connects_and_joins_without_grpcs_polling_thread(
    daemon: DaemonProcess, job_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """connect() used grpc.channel_ready_future, whose polling thread outlived it by up to
    0.2 s holding a lock the channel's finalizer takes: a process exiting then could hang.
    Now neither connect() nor the join's reachability check starts one."""
    started: list[object] = []
    poll = grpc_channel._poll_connectivity

    def recorded(*args: Any) -> None:
        started.append(args)
        poll(*args)

    monkeypatch.setattr(grpc_channel, "_poll_connectivity", recorded)
    with RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as client:
        client.connect()
        assert client.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10).rank == 0
        client.leave()
    with RendezvousClient(daemon.endpoint, job_id + "-cold", token=daemon.token) as client:
        assert client.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10).rank == 0
        client.leave()
    assert started == []
    # The record is live: the public way starts one.
    with RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as client:
        grpc.channel_ready_future(client._channel).result(timeout=10)
    assert len(started) == 1


async def test_check_health_asks_even_when_the_channel_is_ready(
    inproc_daemon: InProcessDaemon, job_id: str
) -> None:
    """check_health() is the health Check itself: a READY channel says nothing of a
    daemon that stopped serving (its storage failing, its timer dead)."""
    client = AsyncRendezvousClient(
        inproc_daemon.endpoint, job_id, token=inproc_daemon.token, retry_attempts=0
    )
    try:
        await client.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        await client.check_health()
        health = inproc_daemon.server._health
        assert health is not None
        await health.set(SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        with pytest.raises(DaemonUnavailable, match="NOT_SERVING"):
            await client.check_health()
    finally:
        await client.close()


async def _join(
    kind: str,
    endpoint: str,
    tls: TlsConfig | None,
    connect_timeout: float,
    timeout: float = 30,
) -> None:
    """One join with ``connect_timeout`` by ``kind``'s client (the blocking one in a
    thread), its error raised."""
    options: dict[str, Any] = {"token": "t" * 32, "tls": tls, "connect_timeout": connect_timeout}
    keywords: dict[str, Any] = {"num_nodes": 1, "gpus_per_node": 1, "local_rank": 0}
    if kind == "asyncio":
        async with AsyncRendezvousClient(endpoint, "short", **options) as client:
            await client.join(**keywords, timeout=timeout)
        return
    with RendezvousClient(endpoint, "short", **options) as blocking:
        await asyncio.to_thread(blocking.join, **keywords, timeout=timeout)


@pytest.mark.parametrize("client_tls", [False, True], ids=["plaintext", "tls"])
@pytest.mark.parametrize("kind", KINDS)
async def test_a_join_at_a_silent_port_ends_near_its_connect_timeout(
    listener: Callable[[bytes | None], str], pki: Pki, kind: str, client_tls: bool
) -> None:
    """A port that accepts and never answers: the TLS probes before the join waited
    2 s each and a sniff, so connect_timeout=1 took 6 s."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(DaemonUnavailable, match=r"within 1 s \(connect_timeout\): it accepts"):
        await _join(kind, listener(None), TlsConfig(ca=pki.ca) if client_tls else None, 1.0)
    assert loop.time() - started < 3.0


@pytest.mark.parametrize("call", ["join", "check_health"])
@pytest.mark.parametrize("kind", KINDS)
async def test_the_wait_at_a_port_that_never_accepts_keeps_to_connect_timeout(
    kind: str, call: str
) -> None:
    """A socket that listens and never accepts (the kernel completes the TCP handshake,
    nothing answers): each TLS probe waited at least 0.5 s however little time was
    left, so join() took connect_timeout + 0.5 s (1.16 s for 0.3 s), check_health()
    at least 1 s."""
    loop = asyncio.get_running_loop()
    with socket.create_server(("127.0.0.1", 0), backlog=64) as silent:
        endpoint = f"127.0.0.1:{silent.getsockname()[1]}"
        options: dict[str, Any] = {"token": "t" * 32, "connect_timeout": 0.3}
        keywords: dict[str, Any] = {"num_nodes": 1, "gpus_per_node": 1, "local_rank": 0}
        started = loop.time()
        with pytest.raises(DaemonUnavailable, match=r"within 0\.3 s \(connect_timeout\)"):
            if kind == "asyncio":
                async with AsyncRendezvousClient(endpoint, "silent", **options) as client:
                    await (client.join(**keywords) if call == "join" else client.check_health())
            else:
                with RendezvousClient(endpoint, "silent", **options) as blocking:
                    fn = blocking.join if call == "join" else blocking.check_health
                    await asyncio.to_thread(fn, **(keywords if call == "join" else {}))
        elapsed = loop.time() - started
    assert elapsed < 0.6, elapsed


@pytest.mark.parametrize("kind", KINDS)
async def test_a_join_at_a_silent_port_ends_at_its_own_shorter_timeout(
    listener: Callable[[bytes | None], str], kind: str
) -> None:
    """join(timeout=5) at a silent port took the 30 s connect timeout."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(DaemonUnavailable, match=r"within 1 s \(the join's timeout\)"):
        await _join(kind, listener(None), None, 30.0, timeout=1.0)
    assert loop.time() - started < 3.0


@pytest.mark.parametrize("kind", KINDS)
async def test_a_tls_daemon_is_told_to_a_plaintext_join_with_a_short_connect_timeout(
    pki: Pki, start_daemon: Callable[..., DaemonProcess], kind: str
) -> None:
    """The probes share the short connect timeout, and still each get enough time."""
    d = start_daemon(*pki.serve_args())
    with pytest.raises(AuthenticationError, match=r"speaks TLS: pass tls=TlsConfig\(ca=PATH\)"):
        await _join(kind, d.endpoint, None, 0.2)


async def _list_jobs(kind: str, endpoint: str, token: str, **options: Any) -> None:
    """An inspecting client's first call (no join before it), by ``kind``'s client."""
    if kind == "asyncio":
        async with AsyncRendezvousClient(endpoint, token=token, **options) as client:
            await client.list_jobs()
        return
    with RendezvousClient(endpoint, token=token, **options) as blocking:
        await asyncio.to_thread(blocking.list_jobs)


@pytest.mark.parametrize("kind", KINDS)
async def test_an_inspecting_clients_first_call_at_a_refused_port_ends_at_connect_timeout(
    kind: str,
) -> None:
    """It waited its whole call timeout and a retry (60 s), whatever connect_timeout said."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    endpoint = f"127.0.0.1:{free_port()}"
    with pytest.raises(DaemonUnavailable, match=r"within 1 s \(connect_timeout\): nothing listens"):
        await _list_jobs(kind, endpoint, "t" * 32, connect_timeout=1.0)
    assert loop.time() - started < 4.0


@pytest.mark.parametrize("kind", KINDS)
async def test_an_inspecting_clients_first_call_ends_at_its_own_shorter_timeout(
    kind: str,
) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    endpoint = f"127.0.0.1:{free_port()}"
    with pytest.raises(DaemonUnavailable, match=r"within 1 s \(call_timeout\)"):
        await _list_jobs(kind, endpoint, "t" * 32, connect_timeout=30.0, call_timeout=1.0)
    assert loop.time() - started < 4.0


@pytest.mark.parametrize("kind", KINDS)
async def test_an_inspecting_clients_first_call_finds_a_daemon_that_starts_late(
    kind: str, start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    """Waiting for the daemon within connect_timeout, not failing at the first refusal:
    a script may ask before the daemon is up."""
    port = free_port()
    token = "late-daemon-token-" + "x" * 16
    asking = asyncio.ensure_future(
        _list_jobs(kind, f"127.0.0.1:{port}", token, connect_timeout=30.0, retry_attempts=0)
    )
    await asyncio.sleep(2.5)  # past the first look (2 s): refused all along
    assert not asking.done()
    start_daemon(listen=f"127.0.0.1:{port}", token=token)
    await asyncio.wait_for(asking, 25)  # answered: an error would be raised here
