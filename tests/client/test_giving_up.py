"""A blocking client's caller giving up, against a real daemon: Ctrl-C in a call
waiting at the daemon over unary calls (``call_stream=False``, the fallback for a
daemon without CallBatches and for a full stream) cancels it there, as on the call
stream; and a ``close()`` racing ``start_heartbeat()`` from another thread leaves no
heartbeat running on the closed client."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from rendezvousd.client import (
    AsyncRendezvousClient,
    InvalidRequest,
    LimitExceeded,
    PeerFailed,
    RendezvousClient,
    RendezvousError,
)
from tests.support import DaemonProcess, parallel, scrape, wait_for


class Interrupted(BaseException):
    """What a signal handler raises in the waiting thread (KeyboardInterrupt's kind)."""


def waiters(d: DaemonProcess) -> float:
    return scrape(d.metrics_url)["rendezvousd_waiters"]


@pytest.fixture
def metered(start_daemon: Callable[..., DaemonProcess]) -> DaemonProcess:
    return start_daemon("--metrics-listen", "127.0.0.1:0")


@pytest.fixture
def interrupt() -> Iterator[Callable[[DaemonProcess, Callable[[], Any]], None]]:
    """``interrupt(d, call)``: ``call`` in this (the main) thread, interrupted as Ctrl-C
    would once ``d`` holds one more parked call: the signal goes to the process, and
    Linux hands it to the main thread, waiting in the call."""

    def raise_interrupted(signum: int, frame: object) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGUSR1, raise_interrupted)

    def run(d: DaemonProcess, call: Callable[[], Any]) -> None:
        before = waiters(d)

        def kill() -> None:
            wait_for("the call parked at the daemon", lambda: waiters(d) > before, 10)
            os.kill(os.getpid(), signal.SIGUSR1)

        killer = threading.Thread(target=kill, daemon=True)
        killer.start()
        with pytest.raises(Interrupted):
            call()
        killer.join(10)

    yield run
    signal.signal(signal.SIGUSR1, previous)


def test_ctrl_c_in_a_unary_wait_cancels_it_at_the_daemon(
    metered: DaemonProcess,
    job_id: str,
    interrupt: Callable[[DaemonProcess, Callable[[], Any]], None],
) -> None:
    """It stayed parked to its own deadline (here 600 s): a re-join of the same client
    was refused DuplicateRank meanwhile, a barrier's or a key's waiter slot held."""
    d = metered
    c = RendezvousClient(d.endpoint, job_id, token=d.token, call_stream=False)
    peer = RendezvousClient(d.endpoint, job_id, token=d.token, call_stream=False)
    join = {"num_nodes": 1, "gpus_per_node": 2, "node_rank": 0, "timeout": 600}
    try:
        interrupt(d, lambda: c.join(local_rank=0, **join))
        wait_for("the interrupted join released at the daemon", lambda: waiters(d) == 0, 5)
        ms = parallel(
            [lambda: c.join(local_rank=0, **join), lambda: peer.join(local_rank=1, **join)]
        )
        assert [m.rank for m in ms] == [0, 1]
        for call in (lambda: c.barrier("b", timeout=600), lambda: c.kv_get("k", timeout=600)):
            interrupt(d, call)
            wait_for("the interrupted wait released at the daemon", lambda: waiters(d) == 0, 5)
        assert c.call_route == "unary"
    finally:
        c.close()
        peer.close()


def test_close_racing_start_heartbeat_leaves_no_heartbeat_running(
    metered: DaemonProcess, job_id: str
) -> None:
    """close() from another thread landed between start_heartbeat()'s checks and its
    threads' start (forced here: close() runs to its end there). start_heartbeat()
    returned as if all were well, undid close()'s stop, and its thread died on gRPC's
    uncaught ValueError ("Channel closed!"); its watchdog lived on for the reconnect
    window and told on_failure DaemonUnreachable of a daemon that was fine."""
    d = metered
    c = RendezvousClient(d.endpoint, job_id, token=d.token)
    c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
    uncaught: list[str] = []
    hook, threading.excepthook = threading.excepthook, lambda a: uncaught.append(str(a.exc_value))
    at_gap, closed = threading.Event(), threading.Event()
    interval = c._s.heartbeat_interval

    def between_checks_and_start(requested: float | None) -> float:
        at_gap.set()
        assert closed.wait(10), "close() did not return"
        return interval(requested)

    c._s.heartbeat_interval = between_checks_and_start  # type: ignore[method-assign]
    closer = threading.Thread(target=lambda: (at_gap.wait(10), c.close(), closed.set()))
    closer.start()
    heard: list[object] = []
    try:
        with pytest.raises(InvalidRequest, match="is closed"):
            c.start_heartbeat(on_failure=heard.append)
        closer.join(10)
        running = [t.name for t in threading.enumerate() if t.name.startswith("rendezvous-heart")]
        assert (running, uncaught, heard) == ([], [], [])
    finally:
        threading.excepthook = hook
        c.close()


def test_a_with_block_whose_task_was_cancelled_says_so_to_its_peers(
    metered: DaemonProcess, job_id: str
) -> None:
    """Ctrl-C under asyncio.run() cancels the main task: an ``async with`` block left by
    that cancellation in a barrier told its peers only "CancelledError: "."""
    d = metered
    peer = RendezvousClient(d.endpoint, job_id, token=d.token)
    join = {"num_nodes": 1, "gpus_per_node": 2, "node_rank": 0, "timeout": 20}
    heard: list[RendezvousError] = []

    async def worker() -> None:
        async with AsyncRendezvousClient(d.endpoint, job_id, token=d.token) as c:
            await asyncio.gather(
                c.join(local_rank=0, **join), asyncio.to_thread(peer.join, local_rank=1, **join)
            )
            c.start_heartbeat()
            peer.start_heartbeat(on_failure=heard.append)
            before = waiters(d)
            barrier = asyncio.ensure_future(c.barrier("never", timeout=60))
            await asyncio.to_thread(wait_for, "the barrier parked", lambda: waiters(d) > before, 10)
            barrier.cancel()
            await barrier  # the block is left by the barrier's cancellation

    try:
        with pytest.raises(asyncio.CancelledError):
            asyncio.run(worker())
        wait_for("the peer's failure", lambda: bool(heard), 20)
        failure = heard[0]
        assert isinstance(failure, PeerFailed)
        assert failure.failed[0].cause == (
            "CancelledError: the worker's asyncio task was cancelled while in barrier()"
        )
    finally:
        peer.close()


def test_a_resumed_node_join_sent_afresh_makes_a_new_id() -> None:
    """A node 0 agent's JoinNode goes without an id (it publishes one when told
    id_required), so ``made`` was reset only for a Join's: resumed and then sent afresh
    (the given-up seat's generation is over), it published the failed generation's id
    again, refused ID_REUSED, one more round trip before a new one."""
    from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
    from rendezvousd.client._session import JoinPlan, Session
    from rendezvousd.client.connection import RetryPolicy

    session = Session("127.0.0.1:1", "j", "t", RetryPolicy(), 1.0, 1.0, instance_id="a" * 32)
    old = b"\1" * 128
    plan = JoinPlan(session, None, None, 10.0, 0.0, pb.JoinNodeRequest(job_id="j"))
    plan.made, plan.resumed = old, True
    plan.request.instance_id = "a" * 32
    assert plan.afresh_after(RendezvousError("that generation is over"))
    assert plan.request.instance_id != "a" * 32
    assert not plan.request.unique_id  # still sent without one
    reused = plan.make_id() == old
    assert not reused, "the failed generation's id again"


@pytest.mark.parametrize("twin", ["sync", "asyncio"])
def test_a_with_block_ended_by_its_own_refused_call_reports_that_refusal(
    start_daemon: Callable[..., DaemonProcess], job_id: str, twin: str
) -> None:
    """A ``kv_set`` refused ``LimitExceeded`` (a value over ``max_value_bytes``) that
    ended the block was taken for a victim's error, as every ``RendezvousError`` was:
    nothing reported, and the daemon recorded the member's loss as "heartbeat stream
    closed", while ``raise RuntimeError(...)`` there was reported as its cause."""
    d = start_daemon("--max-value-bytes", "64")
    join = {"num_nodes": 1, "gpus_per_node": 1, "node_rank": 0, "local_rank": 0, "timeout": 20}
    value = b"x" * 65

    async def async_worker() -> None:
        async with AsyncRendezvousClient(d.endpoint, job_id, token=d.token) as c:
            await c.join(**join)
            c.start_heartbeat()
            await c.kv_set("big", value)

    with pytest.raises(LimitExceeded) as refused:
        if twin == "asyncio":
            asyncio.run(async_worker())
        else:
            with RendezvousClient(d.endpoint, job_id, token=d.token) as c:
                c.join(**join)
                c.start_heartbeat()
                c.kv_set("big", value)
    with RendezvousClient(d.endpoint, job_id, token=d.token) as look:
        wait_for("the loss on record", lambda: bool(look.get_job(job_id).failed), 20)
        cause = look.get_job(job_id).failed[0].cause
    assert cause.startswith(f"LimitExceeded: {refused.value}"[:60]), cause
