"""Both clients' calls as messages on one ``Calls`` stream, against real daemons: every
method, the same errors as unary calls, replies out of order, a call's deadline and
cancellation, a daemon restarted under the stream, an older daemon without the method
(the real servicer with the wire surface it had before), ``connect()``, and no reader
thread or task left behind."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import re
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

import rendezvousd.daemon
from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client import (
    AsyncRendezvousClient,
    DaemonUnavailable,
    RendezvousClient,
    RendezvousError,
    RendezvousTimeout,
)
from rendezvousd.client._multiplex import CALLS_METHOD, FIELDS
from rendezvousd.client._session import page_request
from rendezvousd.config import DaemonConfig
from rendezvousd.server.servicer import RendezvousServicer
from tests.client.test_twins import Twin
from tests.support import DaemonProcess, free_port, scrape, wait_for

KINDS = ("sync", "aio")
READER = "rendezvous-calls-reader"


@pytest.fixture
def made() -> Iterator[Callable[..., Twin]]:
    twins: list[Twin] = []

    def make(kind: str, endpoint: str, job_id: str, **options: Any) -> Twin:
        twin = Twin(kind, endpoint, job_id, **options)
        twins.append(twin)
        return twin

    yield make
    for t in twins:
        t.close()


def error_of(fn: Callable[[], Any]) -> RendezvousError:
    with pytest.raises(RendezvousError) as info:
        fn()
    return info.value


def waiters(d: DaemonProcess) -> float:
    return scrape(d.metrics_url)["rendezvousd_waiters"]


def readers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == READER]


@pytest.mark.parametrize("kind", KINDS)
def test_every_method_travels_on_one_stream(
    kind: str, daemon: DaemonProcess, job_id: str, made: Callable[..., Twin]
) -> None:
    c = made(kind, daemon.endpoint, job_id, token=daemon.token)
    m = c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
    c.barrier("b", timeout=10)
    c.kv_set("k", b"v")
    assert c.kv_get("k", timeout=5) == b"v"
    assert c.kv_add("n", 2) == 2
    assert c.kv_compare_and_set("k", b"v", b"w") == (True, b"w")
    assert c.kv_delete("k") is True
    request = page_request(m.job_id, m.generation, m.rank, c._s.instance_id, 0)
    page = c._run(c._c.call("GetMembers", request))
    assert [x.rank for x in page.members] == [0]
    # The id is rank 0's to publish at its join; published again it is refused, as
    # unary, with the daemon's answer read from the stream.
    again = pb.PublishIdRequest(
        job_id=job_id, generation=m.generation, rank=0, instance_id="other", unique_id=b"x"
    )
    assert error_of(lambda: c._run(c._c.call("PublishId", again))).code != ""
    assert job_id in {j.job_id for j in c.list_jobs()}
    assert c.get_job().summary.job_id == job_id
    c.leave()  # no heartbeat stream: a Leave call
    node = made(kind, daemon.endpoint, job_id + "-node", token=daemon.token)
    node.join_node(min_nodes=1, max_nodes=1, gpus_per_node=1, timeout=10)
    node.report_failure(0, "boom")
    aborted = error_of(lambda: node.abort("over", job_id=job_id + "-absent"))
    assert aborted.reason == "JOB_NOT_FOUND"
    sent = c._mux.sent + node._mux.sent
    assert set(sent) == set(FIELDS)
    assert (c._mux.opened, node._mux.opened, c._mux.unary) == (1, 1, False)


def _errors(make: Callable[..., Twin], kind: str, d: DaemonProcess, job: str, stream: bool) -> Any:
    """What each refused call raised: class, code, reason, metadata and message."""
    c = make(kind, d.endpoint, job, token=d.token, call_stream=stream, call_timeout=5)
    outcomes = [
        error_of(lambda: c.get_job(job + "-absent")),
        error_of(lambda: c.kv_set("k", b"v")),  # not joined: refused by the SDK itself
    ]
    c.join(num_nodes=1, gpus_per_node=1, local_rank=0, node_rank=0, timeout=10)
    outcomes += [
        error_of(lambda: c.kv_get("absent", wait=False)),
        error_of(lambda: c.abort("over", generation=99)),
    ]
    c.abort("over")
    outcomes += [
        error_of(lambda: c.barrier("after", timeout=5)),
        # A parked join the daemon answers at its deadline, naming what is missing.
        error_of(lambda: c.join(num_nodes=2, gpus_per_node=1, local_rank=0, timeout=2)),
    ]
    if stream:
        assert c._mux.opened == 1 and not c._mux.unary and sum(c._mux.sent.values()) >= 6
    # The job's name differs between the two runs, and so may the time a parked
    # join waited ("after 2.0 s" against "after 2.1 s" on a loaded machine).
    return [
        (
            type(e).__name__,
            e.code,
            e.reason,
            repr(e.metadata).replace(job, "JOB"),
            re.sub(r"after \d+\.\d+ s", "after T s", str(e).replace(job, "JOB")),
        )
        for e in outcomes
    ]


@pytest.mark.parametrize("kind", KINDS)
def test_errors_over_the_stream_are_the_unary_calls_errors(
    kind: str, daemon: DaemonProcess, job_id: str, made: Callable[..., Twin]
) -> None:
    unary = _errors(made, kind, daemon, job_id + "-u", stream=False)
    streamed = _errors(made, kind, daemon, job_id + "-s", stream=True)
    assert streamed == unary
    assert [(name, reason) for name, _, reason, _, _ in streamed] == [
        ("NotFound", "JOB_NOT_FOUND"),
        ("InvalidRequest", ""),
        ("KeyNotFound", "KEY_NOT_FOUND"),
        ("StaleGeneration", "STALE_GENERATION"),
        ("JobAborted", "JOB_ABORTED"),
        ("RendezvousTimeout", "WORLD_INCOMPLETE"),
    ]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_a_refused_token_is_an_authentication_error_on_either_transport(
    kind: str, stream: bool, daemon: DaemonProcess, job_id: str, made: Callable[..., Twin]
) -> None:
    c = made(kind, daemon.endpoint, job_id, token="wrong-token-but-long-enough", call_stream=stream)
    # Each refusal ends its stream and the next call opens another: grpc.aio may lose a
    # stream's status when a Call is written as the daemon refuses it (then it is probed).
    for _ in range(5):
        error = error_of(c.list_jobs)
        assert (type(error).__name__, error.code, error.method) == (
            "AuthenticationError",
            "UNAUTHENTICATED",
            "ListJobs",
        )


@pytest.mark.parametrize("kind", KINDS)
def test_a_parked_barrier_does_not_hold_up_a_key_wait_behind_it(
    kind: str, start_daemon: Callable[..., DaemonProcess], job_id: str, made: Callable[..., Twin]
) -> None:
    d = start_daemon("--metrics-listen", "127.0.0.1:0")
    a = made(kind, d.endpoint, job_id, token=d.token)
    b = made(kind, d.endpoint, job_id, token=d.token)
    joins = [
        threading.Thread(
            target=c.join,
            kwargs={"num_nodes": 2, "gpus_per_node": 1, "local_rank": 0, "host": h, "timeout": 20},
        )
        for c, h in ((a, "h0"), (b, "h1"))
    ]
    for t in joins:
        t.start()
    for t in joins:
        t.join(30)
    assert a.membership is not None and b.membership is not None
    done: list[str] = []
    barrier = threading.Thread(target=lambda: (a.barrier("b", timeout=30), done.append("barrier")))
    barrier.start()
    wait_for("a's barrier parked", lambda: waiters(d) == 1)
    got: list[bytes] = []
    key = threading.Thread(
        target=lambda: (got.append(a.kv_get("k", timeout=30)), done.append("kv"))
    )
    key.start()
    wait_for("a's key wait parked", lambda: waiters(d) == 2)
    b.kv_set("k", b"v")
    key.join(30)
    assert done == ["kv"] and got == [b"v"]
    b.barrier("b", timeout=30)
    barrier.join(30)
    assert done == ["kv", "barrier"]
    # All on a's one stream.
    assert a._mux.opened == 1
    assert a._mux.sent["Barrier"] == 1 and a._mux.sent["KvGet"] == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_calls_deadline_ends_its_parked_wait_on_the_daemon(
    kind: str, start_daemon: Callable[..., DaemonProcess], job_id: str, made: Callable[..., Twin]
) -> None:
    d = start_daemon("--metrics-listen", "127.0.0.1:0")
    c = made(kind, d.endpoint, job_id, token=d.token, call_timeout=2)
    c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
    # A wait asked for far longer than the call's own deadline (call_timeout).
    request = pb.KvGetRequest(key="never", wait=True, wait_timeout_ms=600_000, **c._kv_scope())
    error = error_of(lambda: c._run(c._c.call("KvGet", request)))
    # The daemon answers a capped wait 0.2 s before the call's deadline (a timeout);
    # on a loaded machine (load 12, once) that answer came after the client's own
    # deadline, which the SDK retries once and then reports as DaemonUnavailable.
    # Either way the daemon must not keep the wait parked.
    assert isinstance(error, RendezvousTimeout | DaemonUnavailable), error
    wait_for("the parked KvGet gone from the daemon", lambda: waiters(d) == 0)
    # The stream goes on.
    c.kv_set("k", b"v")
    assert c.kv_get("k", timeout=5) == b"v"
    assert c._mux.opened == 1


async def test_a_cancelled_call_is_cancelled_on_the_daemon(
    start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    d = start_daemon("--metrics-listen", "127.0.0.1:0")
    c = AsyncRendezvousClient(d.endpoint, job_id, token=d.token)
    try:
        await c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        wait = asyncio.create_task(c.kv_get("never", timeout=600))
        deadline = time.monotonic() + 10
        while await asyncio.to_thread(waiters, d) != 1:
            assert time.monotonic() < deadline, "the KvGet never parked"
        wait.cancel()
        with pytest.raises(asyncio.CancelledError):
            await wait
        # Released by the cancel, long before its own 600 s.
        while await asyncio.to_thread(waiters, d) != 0:
            assert time.monotonic() < deadline, "the cancelled KvGet stayed parked"
        assert await c.kv_add("n") == 1
    finally:
        await c.close()


class Interrupted(BaseException):
    """What a signal handler raises in the waiting thread (KeyboardInterrupt's kind)."""


def test_an_interrupted_call_is_cancelled_on_the_daemon(
    start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    """Ctrl-C in the sync client's waiting call left its wait parked at the daemon
    until its own deadline (600 s here), holding a waiter slot, where an asyncio
    caller's cancellation released it at once."""
    d = start_daemon("--metrics-listen", "127.0.0.1:0")
    c = RendezvousClient(d.endpoint, job_id, token=d.token)

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        c.start_heartbeat()
        # To the process, as Ctrl-C is: Linux hands it to the main thread, waiting in
        # the call (raise_signal() would go to the timer's own thread, and the main
        # thread's wait would not be woken to run the handler).
        timer = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGUSR1))
        timer.start()
        with pytest.raises(Interrupted):
            c.kv_get("never", timeout=600)
        timer.join()
        wait_for("the interrupted KvGet gone from the daemon", lambda: waiters(d) == 0, 5)
        assert c.kv_add("n") == 1  # the stream goes on
    finally:
        signal.signal(signal.SIGUSR1, previous)
        c.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_call_in_flight_when_the_daemon_dies_is_retried_on_a_new_stream(
    kind: str,
    start_daemon: Callable[..., DaemonProcess],
    tmp_path: Path,
    job_id: str,
    made: Callable[..., Twin],
) -> None:
    state, listen = tmp_path / "state", f"127.0.0.1:{free_port()}"
    args = (
        "--state-dir",
        str(state),
        "--heartbeat-timeout-s",
        "60",
        "--metrics-listen",
        "127.0.0.1:0",
    )
    d = start_daemon(*args, listen=listen)
    c = made(kind, d.endpoint, job_id, token=d.token, retry_attempts=5)
    c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
    got: list[Any] = []

    def wait_for_key() -> None:
        try:
            got.append(c.kv_get("k", timeout=60))
        except RendezvousError as exc:
            got.append(exc)

    waiting = threading.Thread(target=wait_for_key)
    waiting.start()
    wait_for("the KvGet parked", lambda: waiters(d) == 1)
    d.kill()  # the stream breaks under the parked call: UNAVAILABLE, a retryable read
    again = start_daemon(*args, listen=listen, token=d.token)
    wait_for("the retried KvGet parked on the new daemon", lambda: waiters(again) == 1, 30)
    setter = made(kind, again.endpoint, job_id, token=d.token)
    setter.attach(c.membership, c._s.instance_id)
    setter.kv_set("k", b"after")
    waiting.join(30)
    assert got == [b"after"]
    assert c._mux.opened == 2


@pytest.mark.parametrize("kind", KINDS)
def test_a_call_beyond_a_full_stream_is_made_unary_not_refused(
    kind: str, start_daemon: Callable[..., DaemonProcess], job_id: str, made: Callable[..., Twin]
) -> None:
    # Three calls in flight per stream, and three HTTP/2 streams per connection: the
    # Calls stream, the heartbeat stream join() opened, and one unary call.
    env = {"RENDEZVOUSD_MAX_CONCURRENT_STREAMS": "3"}
    d = start_daemon("--metrics-listen", "127.0.0.1:0", env=env)
    c = made(kind, d.endpoint, job_id, token=d.token)
    m = c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
    got: dict[str, Any] = {}

    def wait_for_key(key: str) -> None:
        try:
            got[key] = c.kv_get(key, timeout=30)
        except RendezvousError as exc:
            got[key] = exc

    keys = [threading.Thread(target=wait_for_key, args=(k,)) for k in "abcd"]
    for t in keys:
        t.start()
    wait_for("four parked KvGets", lambda: waiters(d) == 4)
    setter = made(kind, d.endpoint, job_id, token=d.token)  # a connection of its own
    setter.attach(m, c._s.instance_id)
    for k in "abcd":
        setter.kv_set(k, k.encode())
    for t in keys:
        t.join(30)
    assert got == {k: k.encode() for k in "abcd"}
    assert c._mux.sent["KvGet"] == 4  # all sent on the stream; one refused there


class WithoutCalls(RendezvousServicer):
    """The real servicer with the wire surface of a daemon older than CallBatches (and
    than Calls: neither is served)."""

    def handler(self) -> grpc.GenericRpcHandler:
        every = super().handler()
        older = {CALLS_METHOD, CALLS_METHOD.replace("/CallBatches", "/Calls")}

        class Older(grpc.GenericRpcHandler):  # type: ignore[misc]
            def service(self, details: grpc.HandlerCallDetails) -> Any:
                return None if details.method in older else every.service(details)

        return Older()


@pytest.fixture
def older_daemon(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str]]:
    """(endpoint, token) of the real daemon on a loop of its own thread, serving
    ``WithoutCalls``: both kinds of client can call it."""
    monkeypatch.setattr(rendezvousd.daemon, "RendezvousServicer", WithoutCalls)
    token = secrets.token_urlsafe(32)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> tuple[rendezvousd.daemon.Daemon, int]:
        server = rendezvousd.daemon.Daemon(DaemonConfig(listen="127.0.0.1:0"), [token])
        return server, await server.start()

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield f"127.0.0.1:{port}", token
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(grace=0), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.mark.parametrize("kind", KINDS)
def test_an_older_daemon_gets_unary_calls_and_no_error(
    kind: str,
    older_daemon: tuple[str, str],
    job_id: str,
    made: Callable[..., Twin],
    caplog: pytest.LogCaptureFixture,
) -> None:
    endpoint, token = older_daemon
    caplog.set_level(logging.DEBUG, logger="rendezvousd.client")
    c = made(kind, endpoint, job_id, token=token)
    m = c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
    c.kv_set("k", b"v")
    assert c.kv_get("k", timeout=5) == b"v"
    assert c.get_job().summary.generation == m.generation
    c.leave()
    assert c._mux.unary and c._mux.opened == 1
    said = [r for r in caplog.records if "no CallBatches method" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.DEBUG


@pytest.mark.parametrize("kind", KINDS)
def test_connect_opens_the_stream_without_a_call(
    kind: str, daemon: DaemonProcess, job_id: str, made: Callable[..., Twin]
) -> None:
    c = made(kind, daemon.endpoint, job_id, token=daemon.token)
    c.connect()
    assert (c._mux.opened, sum(c._mux.sent.values())) == (1, 0)
    assert c.list_jobs() is not None
    assert c._mux.opened == 1


@pytest.mark.parametrize("kind", KINDS)
def test_connect_to_a_dead_endpoint_is_unavailable_within_the_connect_timeout(
    kind: str, job_id: str, made: Callable[..., Twin]
) -> None:
    c = made(kind, f"127.0.0.1:{free_port()}", job_id, token="t", connect_timeout=1)
    started = time.monotonic()
    error = error_of(c.connect)
    # Bounded by connect_timeout (with room for a loaded machine), not gRPC's backoff.
    assert time.monotonic() - started < 1 + 10
    assert isinstance(error, DaemonUnavailable)
    assert (error.method, error.code) == ("connect", "UNAVAILABLE")
    assert "within 1 s (connect_timeout): nothing listens there (connection refused)" in str(error)


def test_an_inspecting_clients_first_look_is_within_its_call(job_id: str) -> None:
    """The first call of a client that never joined looks at the daemon first (a
    refused TLS handshake is said at once): at a silent port that look (2 s) and a TLS
    probe (2 s and a sniff) came on top of the call's own 3 s and its diagnosis: 13 s.
    The look's wait is now the call's, and a channel still connecting is not probed."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        endpoint = f"127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        with (
            RendezvousClient(endpoint, job_id, token="t", call_timeout=3, retry_attempts=0) as c,
            pytest.raises(DaemonUnavailable, match="no gRPC server answered"),
        ):
            c.list_jobs()
        elapsed = time.monotonic() - started
    assert elapsed < 10.5, elapsed  # the call's 3 s and the diagnosis' (probe, dial) 6 s


@pytest.mark.parametrize(
    ("where", "why"),
    [
        ("name", "the host name 'no-such-host.invalid' does not resolve"),
        ("socket", "there is no socket at "),
        ("silent", "it accepts connections, but no gRPC server answered on them"),
    ],
)
def test_a_join_that_cannot_connect_says_what_a_connect_there_found(
    where: str, why: str, job_id: str, tmp_path: Path
) -> None:
    """It said only "could not be connected to within 30 s", leaving the user to guess
    between a daemon not started, a wrong port or name and a firewall. Within
    connect_timeout in all: at a silent port the TLS probes (2 s each) came on top."""
    timeout = 5 if where == "silent" else 1
    with contextlib.ExitStack() as stack:
        if where == "name":
            endpoint = "no-such-host.invalid:29400"
        elif where == "socket":
            endpoint = f"unix:{tmp_path / 'rendezvousd.sock'}"
        else:
            silent = stack.enter_context(socket.create_server(("127.0.0.1", 0)))
            endpoint = f"127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        with (
            RendezvousClient(endpoint, job_id, token="t", connect_timeout=timeout) as c,
            pytest.raises(DaemonUnavailable) as info,
        ):
            c.join(num_nodes=1, gpus_per_node=1, local_rank=0)
        elapsed = time.monotonic() - started
    assert f"within {timeout} s (connect_timeout): " + why in str(info.value), info.value
    assert elapsed < timeout + 3.5, elapsed  # the probes' 6 s came on top of the 5 s


def test_close_ends_the_reader_thread_and_a_closed_stream_fails_no_one(
    daemon: DaemonProcess, job_id: str
) -> None:
    before = len(readers())
    clients = [
        RendezvousClient(daemon.endpoint, f"{job_id}-{i}", token=daemon.token) for i in range(3)
    ]
    for c in clients:
        c.connect()
    assert len(readers()) == before + 3
    for c in clients:
        c.close()
    assert len(readers()) == before


def test_a_client_dropped_without_close_leaves_no_reader_behind(
    daemon: DaemonProcess, job_id: str
) -> None:
    before = len(readers())
    c = RendezvousClient(daemon.endpoint, job_id, token=daemon.token)
    c.connect()
    assert len(readers()) == before + 1
    del c
    gc.collect()
    wait_for("the dropped client's reader to end", lambda: len(readers()) == before)


async def test_close_ends_the_reader_task(daemon: DaemonProcess, job_id: str) -> None:
    c = AsyncRendezvousClient(daemon.endpoint, job_id, token=daemon.token)
    before = asyncio.all_tasks()
    await c.connect()
    assert len(asyncio.all_tasks() - before) >= 1
    await c.close()
    assert asyncio.all_tasks() - before == set()


@pytest.mark.parametrize("kind", KINDS)
def test_leave_and_close_work_after_the_stream_broke(
    kind: str, start_daemon: Callable[..., DaemonProcess], job_id: str, made: Callable[..., Twin]
) -> None:
    d = start_daemon()
    c = made(kind, d.endpoint, job_id, token=d.token, leave_timeout=1)
    c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
    c.start_heartbeat(0.2)
    d.kill()
    with contextlib.suppress(RendezvousError):
        c.kv_set("k", b"v")  # the broken stream, seen
    c.leave()  # best effort: a warning, no error
    assert c.membership is None
    never = Twin(kind, d.endpoint, job_id, token=d.token)
    never.close()  # its stream never opened
    assert never.client._mux.opened == 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_draining_daemon_is_not_held_up_by_the_call_stream(
    kind: str, start_daemon: Callable[..., DaemonProcess], job_id: str, made: Callable[..., Twin]
) -> None:
    # A grace far beyond the wait below: an open stream would hold the daemon up that long.
    d = start_daemon("--drain-grace-s", "120")
    c = made(kind, d.endpoint, job_id, token=d.token)
    c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
    c.start_heartbeat(0.2)
    # The drain is heard on the heartbeat stream: attached first.
    wait_for("the heartbeat stream", lambda: c.get_job().members[0].heartbeat_stream_open)
    stream = c._mux._stream
    d.proc.send_signal(signal.SIGTERM)
    wait_for("the call stream half-closed on the drain event", lambda: stream.retired)
    assert d.proc.wait(60) == 0


def test_a_with_block_after_close_leaves_nothing_to_raise(
    daemon: DaemonProcess, job_id: str
) -> None:
    """close() inside the ``with`` block (a node agent dying on purpose in a test, or a
    worker giving up): leaving the block must not call Leave on the closed channel,
    which raised a bare ValueError out of the SDK."""
    with RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as c:
        c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        c.start_heartbeat(0.2)
        c.close()
    assert c.membership is None

    async def aio() -> None:
        async with AsyncRendezvousClient(daemon.endpoint, job_id + "-aio", token=daemon.token) as a:
            await a.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
            a.start_heartbeat(0.2)
            await a.close()
        assert a.membership is None

    asyncio.run(aio())
