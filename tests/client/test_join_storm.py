"""A member is not lost because the daemon was slow to take its heartbeat stream
(issue 21). A daemon hands new calls to its handlers one at a time, in arrival order;
in the per-rank soak's join storm (4,096 clients connecting and joining at once) a
heartbeat stream opened after the join's answer waited 6-10 s in that queue, behind
the other jobs' connects, while the member's silence clock ran from the instant its
job formed: 6-9 of 16 jobs were lost, "no heartbeat for 10.0 s", their clients
reporting the daemon "unreachable for 10 s" at the same time.

Here an interceptor holds every Heartbeat call that arrives once the job formed for
longer than the heartbeat timeout: that queue, made deterministic. The SDK now opens
the stream before it sends the join, so the stream is the daemon's while the join
waits, and the first beat is a message on it. Before, the stream arrived with the
hold on, and the tick lost the member at the heartbeat timeout."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
import pytest
import pytest_asyncio

from rendezvousd.client import AsyncRendezvousClient, RendezvousClient
from rendezvousd.common.model import JobState
from rendezvousd.config import DaemonConfig
from rendezvousd.daemon import Daemon
from tests.support import InProcessDaemon

TIMEOUT_S = 3.0  # wide enough for a loaded CI machine: the daemon and blocking clients share a GIL
# Past the heartbeat timeout and its tick: a stream held this long is a lost member.
HOLD_S = 3 * TIMEOUT_S


class _Backlog(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """While ``on``: each Heartbeat call reaches the daemon HOLD_S after it arrived."""

    def __init__(self) -> None:
        self.on = False
        self.held = 0
        self.seen = 0  # Heartbeat calls that reached the daemon, held or not

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        if details.method.endswith("/Heartbeat"):
            self.seen += 1
            if self.on:
                self.held += 1
                await asyncio.sleep(HOLD_S)
        return await continuation(details)


@pytest_asyncio.fixture
async def backlogged(
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[tuple[InProcessDaemon, _Backlog]]:
    backlog = _Backlog()
    real = grpc.aio.server

    def server(*, interceptors: list[Any], **kw: Any) -> Any:
        return real(interceptors=[backlog, *interceptors], **kw)

    monkeypatch.setattr(grpc.aio, "server", server)
    token = secrets.token_urlsafe(32)
    daemon = Daemon(DaemonConfig(listen="127.0.0.1:0", heartbeat_timeout_s=TIMEOUT_S), [token])
    port = await daemon.start()
    try:
        yield InProcessDaemon(daemon, f"127.0.0.1:{port}", token), backlog
    finally:
        await daemon.stop(grace=0)


Client = AsyncRendezvousClient | RendezvousClient


def _client(d: InProcessDaemon, job_id: str, blocking: bool) -> Client:
    if blocking:  # its blocking calls go on threads: the daemon runs on this loop
        return RendezvousClient(d.endpoint, job_id, token=d.token)
    return d.client(job_id)


async def _call(method: Callable[..., Any], **kw: Any) -> Any:
    """``method(**kw)`` of either client, awaited (a blocking one on a thread)."""
    if asyncio.iscoroutinefunction(method):
        return await method(**kw)
    return await asyncio.to_thread(method, **kw)


async def _rank_join(c: Client, rank: int) -> Any:
    return await _call(
        c.join, num_nodes=2, gpus_per_node=1, node_rank=rank, local_rank=0, timeout=30
    )


async def _node_join(c: Client, node: int) -> Any:
    return await _call(
        c.join_node,
        min_nodes=2,
        max_nodes=2,
        gpus_per_node=2,
        node_rank=node,
        host=f"h{node}",
        timeout=30,
    )


async def _storm_after_join(
    d: InProcessDaemon,
    backlog: _Backlog,
    job_id: str,
    blocking: bool,
    join: Callable[[Client, int], Awaitable[Any]],
) -> None:
    """Two clients join; then new Heartbeat calls are held, the heartbeats start, and
    the job must stay RUNNING past its heartbeat timeout."""
    clients = [_client(d, job_id, blocking) for _ in range(2)]
    try:
        await asyncio.gather(*[join(c, i) for i, c in enumerate(clients)])
        # The streams were sent before the joins, but a join on a stream already open
        # can be answered before the daemon has dispatched a new call that arrived
        # ahead of it. The hold is for calls that arrive after the join, so wait for
        # the dispatch; a stream opened only by start_heartbeat() never comes.
        await d.until("both streams at the daemon", lambda: backlog.seen == 2, timeout=10)
        backlog.on = True  # the storm: every Heartbeat call arriving now waits HOLD_S
        for c in clients:
            c.start_heartbeat(0.2)
        job = d.server.state.jobs[job_id]
        formed = job.state_since
        seated = list(job.attendees(job.gen.join_mode).values())

        def decided() -> bool:
            # Heard well past the heartbeat timeout since the job formed, or lost.
            beating = all(s.last_seen > formed + TIMEOUT_S for s in seated)
            return job.state is not JobState.RUNNING or beating

        await d.until("beats past the heartbeat timeout, or a loss", decided, timeout=4 * HOLD_S)
        heard = [round(s.last_seen - formed, 3) for s in seated]
        assert job.state is JobState.RUNNING, ([f.cause for f in job.gen.failed], heard)
        assert all(c.failure is None for c in clients), [c.failure for c in clients]
        assert backlog.held == 0, "a heartbeat stream was opened only after the join"
    finally:
        await asyncio.gather(*[_call(c.close) for c in clients])


@pytest.mark.parametrize("blocking", [False, True], ids=["asyncio", "blocking"])
async def test_a_ranks_stream_is_open_before_its_join_is_answered(
    backlogged: tuple[InProcessDaemon, _Backlog], job_id: str, blocking: bool
) -> None:
    await _storm_after_join(*backlogged, job_id, blocking, _rank_join)


@pytest.mark.parametrize("blocking", [False, True], ids=["asyncio", "blocking"])
async def test_a_node_agents_stream_is_open_before_its_join_node_is_answered(
    backlogged: tuple[InProcessDaemon, _Backlog], job_id: str, blocking: bool
) -> None:
    await _storm_after_join(*backlogged, job_id, blocking, _node_join)


@pytest.mark.parametrize("blocking", [False, True], ids=["asyncio", "blocking"])
async def test_a_stream_opened_for_a_heartbeat_that_never_starts_ends_cleanly(
    backlogged: tuple[InProcessDaemon, _Backlog], job_id: str, blocking: bool
) -> None:
    """A client that joins and leaves without heartbeating: the stream opened for it
    ends without a message, and its end loses no one."""
    d, _ = backlogged
    clients = [_client(d, job_id, blocking) for _ in range(2)]
    await asyncio.gather(*[_rank_join(c, r) for r, c in enumerate(clients)])
    job = d.server.state.jobs[job_id]
    for c in clients:
        await _call(c.leave)
        await _call(c.close)
    assert job.state is JobState.ENDED, [f.cause for f in job.gen.failed]
    assert not job.gen.failed


@pytest.mark.parametrize("kind", ["rank", "node"])
@pytest.mark.parametrize("blocking", [False, True], ids=["asyncio", "blocking"])
async def test_connect_opens_the_stream_the_join_then_uses(
    backlogged: tuple[InProcessDaemon, _Backlog], job_id: str, blocking: bool, kind: str
) -> None:
    """connect() opens everything a join sends on, the heartbeat stream included: a join
    after it opens no stream of its own (so a benchmark's "connected before the clock"
    has no stream start inside the clock), and its heartbeats use that stream."""
    d, backlog = backlogged
    clients = [_client(d, job_id, blocking) for _ in range(2)]
    try:
        await asyncio.gather(*[_call(c.connect) for c in clients])
        await d.until("both streams at the daemon", lambda: backlog.seen == 2, timeout=10)
        backlog.on = True  # any Heartbeat call from here on would be held (and counted)
        join = _rank_join if kind == "rank" else _node_join
        await asyncio.gather(*[join(c, i) for i, c in enumerate(clients)])
        for c in clients:
            c.start_heartbeat(0.2)
        job = d.server.state.jobs[job_id]
        seated = list(job.attendees(job.gen.join_mode).values())
        await d.until(
            "every member's stream attached",
            lambda: all(s.stream_open for s in seated),
            timeout=HOLD_S / 2,
        )
        assert backlog.held == 0, "the join opened a heartbeat stream of its own"
    finally:
        await asyncio.gather(*[_call(c.close) for c in clients])
