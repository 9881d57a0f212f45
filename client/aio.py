"""``AsyncRendezvousClient``: the asyncio SDK, with heartbeats on a background task.

It only performs I/O: every call's decisions are ``_calls.Calls``', shared with
``RendezvousClient``."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar, Unpack

import grpc
from grpc_health.v1 import health_pb2_grpc

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from rendezvousd.client._calls import (
    Blocking,
    Calls,
    Connected,
    Rpc,
    Run,
    Sleep,
    Step,
    Steps,
    StopStream,
)
from rendezvousd.client._session import ClientOptions, JoinRequest, NodeJoinRequest, StreamWatch
from rendezvousd.client._tables import BlockingMembers
from rendezvousd.client.errors import RendezvousError
from rendezvousd.client.membership import Member, Membership, NodeMembership

T = TypeVar("T")


class AsyncRendezvousClient:
    """Same methods and parameters as ``RendezvousClient``, as coroutines."""

    def __init__(self, endpoint: str, job_id: str = "", **options: Unpack[ClientOptions]) -> None:
        self._c = Calls(endpoint, job_id, options)
        self._s = self._c.s
        self._channel = self._c.channel(grpc.aio.secure_channel, grpc.aio.insecure_channel)
        self._stub = pb_grpc.RendezvousStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        # A slim join's table is fetched on first use of Membership.members, a plain
        # property: that blocking call goes over a channel of its own, made then.
        self._blocking = BlockingMembers(self._s, self._c.tls)
        self._s.get_members = self._blocking
        self._hb_task: asyncio.Task[None] | None = None

    @property
    def endpoint(self) -> str:
        return self._s.endpoint

    @property
    def membership(self) -> Membership | None:
        return self._s.joined

    @property
    def failure(self) -> RendezvousError | None:
        return self._s.failure

    async def _run(self, steps: Steps[T]) -> T:
        run = Run(steps)
        answer: Any = None
        error: BaseException | None = None
        while run.advance(answer, error):
            try:
                answer, error = await self._perform(run.step), None
            except BaseException as exc:  # thrown into the call, which decides
                answer, error = None, exc
        return run.value

    async def _perform(self, step: Step) -> Any:
        if isinstance(step, Rpc):
            return await step.invoke(self._stub, self._health, self._s.metadata)
        if isinstance(step, Sleep):
            await asyncio.sleep(step.seconds)
        elif isinstance(step, Blocking):
            return await asyncio.to_thread(step.work)
        elif isinstance(step, StopStream):
            await self._stop_heartbeat()
        elif isinstance(step, Connected):
            return self._channel.get_state(try_to_connect=False) is grpc.ChannelConnectivity.READY
        return None

    async def check_health(self) -> None:
        """``RendezvousClient.check_health``, awaited."""
        await self._run(self._c.check_health())

    async def join(self, **request: Unpack[JoinRequest]) -> Membership:
        """``RendezvousClient.join``, awaited."""
        return await self._run(self._c.join(request))

    async def join_node(self, **request: Unpack[NodeJoinRequest]) -> NodeMembership:
        """``RendezvousClient.join_node``, awaited."""
        return await self._run(self._c.join_node(request))

    async def report_failure(self, local_rank: int, cause: str) -> None:
        """``RendezvousClient.report_failure``, awaited."""
        await self._run(self._c.report_failure(local_rank, cause))

    def attach(self, membership: Membership, instance_id: str) -> None:
        """``RendezvousClient.attach``: act as an agent-registered member."""
        self._s.attach(membership, instance_id)

    def nodes_waiting(self) -> int:
        """Nodes parked for the next generation (NODES_WAITING from the daemon), 0 if none."""
        return self._s.nodes_waiting

    @property
    def node_membership(self) -> NodeMembership | None:
        return self._s.node

    async def barrier(self, name: str = "default", *, timeout: float | None = None) -> None:
        await self._run(self._c.barrier(name, timeout))

    async def kv_set(self, key: str, value: bytes) -> None:
        await self._run(self._c.kv_set(key, value))

    async def kv_get(self, key: str, *, wait: bool = True, timeout: float | None = None) -> bytes:
        return await self._run(self._c.kv_get(key, wait, timeout))

    async def kv_add(self, key: str, delta: int = 1) -> int:
        return await self._run(self._c.kv_add(key, delta))

    async def kv_compare_and_set(
        self, key: str, expected: bytes | None, desired: bytes
    ) -> tuple[bool, bytes | None]:
        return await self._run(self._c.kv_compare_and_set(key, expected, desired))

    async def kv_delete(self, key: str) -> bool:
        return await self._run(self._c.kv_delete(key))

    async def list_jobs(self) -> list[pb.JobSummary]:
        return await self._run(self._c.list_jobs())

    async def get_job(self, job_id: str | None = None) -> pb.GetJobResponse:
        return await self._run(self._c.get_job(job_id))

    async def abort(self, reason: str, *, job_id: str | None = None, generation: int = 0) -> int:
        """``RendezvousClient.abort``, awaited."""
        return await self._run(self._c.abort(reason, job_id, generation))

    def raise_if_failed(self) -> None:
        if self._s.failure is not None:
            raise self._s.failure

    def start_heartbeat(
        self,
        interval: float = 1.0,
        on_failure: Callable[[RendezvousError], None] | None = None,
        on_nodes_waiting: Callable[[int], None] | None = None,
    ) -> None:
        """``RendezvousClient.start_heartbeat`` on a task of the running loop."""
        watch, interval = self._c.stream(interval, on_failure, on_nodes_waiting)
        loop = asyncio.get_running_loop()
        self._hb_task = loop.create_task(self._heartbeat_loop(watch, interval))

    async def _heartbeat_requests(self, interval: float) -> AsyncIterator[pb.HeartbeatRequest]:
        request = self._s.heartbeat_request()
        while True:
            yield request
            await asyncio.sleep(interval)

    async def _heartbeat_loop(self, watch: StreamWatch, interval: float) -> None:
        while not watch.done:
            call = self._stub.Heartbeat(
                self._heartbeat_requests(interval), metadata=self._s.metadata, timeout=3600.0
            )
            try:
                while True:
                    # Bounded by the unreachable deadline: a dead route or a daemon
                    # that is gone never answers, and silence is the signal.
                    deadline = watch.deadline()
                    wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                    try:
                        event = await asyncio.wait_for(call.read(), wait)
                    except TimeoutError:
                        break
                    if event is grpc.aio.EOF:
                        break
                    action = watch.on_event(event)
                    if action == "stop":
                        return
                    if action == "reconnect":
                        break
            except grpc.aio.AioRpcError as exc:
                if not watch.on_error(exc):
                    return
            finally:
                call.cancel()
            delay = watch.next_backoff()
            if delay is None:
                return
            await asyncio.sleep(delay)

    async def _stop_heartbeat(self) -> None:
        task, self._hb_task = self._hb_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def leave(self) -> None:
        """Best effort, like ``RendezvousClient.leave``: one attempt within
        ``leave_timeout``, then one WARNING instead of an exception."""
        try:
            await self._run(self._c.leave())
        finally:
            await self._stop_heartbeat()
            self._c.forget()

    async def fetch_members(self) -> tuple[Member, ...]:
        """The joined (or attached) member's table without blocking the event loop.

        After a slim join, the first read of ``membership.members`` fetches the table
        with a blocking call; in a coroutine, await this first instead (required when
        the daemon runs in this same event loop, as in tests).
        """
        return await self._run(self._c.fetch_members())

    async def close(self) -> None:
        await self._stop_heartbeat()
        await self._channel.close()
        self._blocking.close()

    async def __aenter__(self) -> AsyncRendezvousClient:
        return self

    async def __aexit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        try:
            if self._c.leaves_on_exit(exc_type):
                await self.leave()
        finally:
            await self.close()
