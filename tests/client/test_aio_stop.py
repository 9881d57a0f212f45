"""The asyncio client's leave() and close() end in bounded time, whatever its
heartbeat task does with its cancellation (Python 3.11's asyncio.wait_for could
swallow one that landed as a read completed, and close() then waited forever)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from rendezvousd.client import AsyncRendezvousClient, InvalidRequest, aio
from tests.support import DaemonProcess


async def test_close_does_not_wait_forever_for_a_task_that_ignores_cancellation(
    daemon: DaemonProcess,
    job_id: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(aio, "STOP_HEARTBEAT_S", 1.0)
    c = AsyncRendezvousClient(daemon.endpoint, job_id, token=daemon.token)
    await c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
    stop = asyncio.Event()

    async def stubborn() -> None:
        # What a swallowed cancellation looks like from outside: the task runs on.
        while not stop.is_set():
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                continue

    c._hb_task = asyncio.get_running_loop().create_task(stubborn())
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="rendezvousd.client"):
        await asyncio.wait_for(c.close(), 10)
    assert time.monotonic() - started < 5
    assert "did not stop within 1 s of its cancellation" in caplog.text
    stop.set()


async def test_leave_right_after_start_heartbeat_ends_the_stream(
    daemon: DaemonProcess, job_id: str
) -> None:
    """The reported shape, repeated: leave() as the stream's first ack arrives."""
    for i in range(20):
        c = AsyncRendezvousClient(daemon.endpoint, f"{job_id}-{i}", token=daemon.token)
        await c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        c.start_heartbeat(0.05)
        await asyncio.sleep(0.001 * (i % 5))
        await asyncio.wait_for(c.leave(), 10)
        await asyncio.wait_for(c.close(), 10)
        assert c._hb_task is None


def test_a_client_made_outside_its_event_loop_says_so(daemon: DaemonProcess, job_id: str) -> None:
    """grpc.aio binds a channel to the loop it is made on: a client made at module
    level and used under asyncio.run() failed every call with asyncio's "attached to
    a different loop" (a RuntimeError naming no job), or hung on the stream."""
    loop = asyncio.new_event_loop()
    try:
        asyncio.set_event_loop(loop)  # where grpc.aio binds a client made outside a loop
        c = AsyncRendezvousClient(daemon.endpoint, job_id, token=daemon.token)
    finally:
        asyncio.set_event_loop(None)

    async def join() -> None:
        await asyncio.wait_for(c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=5), 10)

    with pytest.raises(InvalidRequest, match="made outside the event loop it is used on"):
        asyncio.run(join())
    # On its own loop it works.
    membership = loop.run_until_complete(
        c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=5)
    )
    assert membership.rank == 0
    loop.run_until_complete(c.close())
    loop.close()


async def test_start_heartbeat_off_the_client_s_loop_is_refused_naming_the_job_and_rank(
    daemon: DaemonProcess, job_id: str
) -> None:
    """From a thread with no loop it raised asyncio's bare RuntimeError ("no running
    event loop"); from another loop, its task ran there on a channel bound to this one.
    Refused, nothing changed: the heartbeat then starts on the client's loop."""
    import threading

    async with AsyncRendezvousClient(daemon.endpoint, job_id, token=daemon.token) as c:
        await c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        where = f"the AsyncRendezvousClient of job {job_id!r} rank 0 at {daemon.endpoint}"
        with pytest.raises(InvalidRequest) as refused:
            await asyncio.to_thread(c.start_heartbeat)
        said = str(refused.value)
        assert where in said and "from a thread with no event loop running" in said, said
        assert "call it from a coroutine or callback running on that loop" in said, said

        errors: list[BaseException] = []

        def other_loop() -> None:
            async def start() -> None:
                c.start_heartbeat()

            try:
                asyncio.run(start())
            except BaseException as exc:  # handed to the test
                errors.append(exc)

        thread = threading.Thread(target=other_loop)
        thread.start()
        await asyncio.to_thread(thread.join, 30)
        assert len(errors) == 1 and isinstance(errors[0], InvalidRequest), errors
        assert "on an event loop other than the one the client runs on" in str(errors[0])

        c.start_heartbeat(0.2)
        await asyncio.sleep(0.5)
        assert c.failure is None
        await c.leave()
