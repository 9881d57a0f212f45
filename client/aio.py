"""``AsyncRendezvousClient``: the asyncio SDK, with heartbeats on a background task.

The twin of ``sync``: the same ``_calls.Calls`` steps, awaited on the event loop
(blocking work on a thread)."""

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
from rendezvousd.client import _calls as steps
from rendezvousd.client._call_stream import AsyncCallStream
from rendezvousd.client._multiplex import Unsupported, lost_error
from rendezvousd.client._session import (
    HEARTBEAT_CALL_S,
    WATCH_S,
    ClientOptions,
    JoinRequest,
    NodeJoinRequest,
    StreamWatch,
    check_arg,
    log,
)
from rendezvousd.client._stubs import lazy_stub
from rendezvousd.client._tables import BlockingMembers
from rendezvousd.client.errors import InvalidRequest, RendezvousError
from rendezvousd.client.membership import Member, Membership, NodeMembership
from rendezvousd.client.relay import AsyncRelayedCalls, RelayEnd, Send, submit_on

T = TypeVar("T")
_Requests = AsyncIterator[pb.HeartbeatRequest]
INTERNAL = grpc.StatusCode.INTERNAL
# States from which a channel asked to connect may still become READY.
_CONNECTING = (grpc.ChannelConnectivity.IDLE, grpc.ChannelConnectivity.CONNECTING)
# How long leave()/close() wait for the heartbeat task to end once cancelled.
STOP_HEARTBEAT_S = 5.0


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


async def _held(requests: asyncio.Future[_Requests | None]) -> _Requests:
    """An opened stream's requests: none until start_heartbeat() gives them."""
    given = await requests
    if given is not None:
        async for request in given:
            yield request


class AsyncRendezvousClient(steps.ClientBase):
    """Same methods and parameters as ``RendezvousClient``, as coroutines."""

    def __init__(self, endpoint: str, job_id: str = "", **options: Unpack[ClientOptions]) -> None:
        super().__init__(endpoint, job_id, options)
        try:
            self._channel = self._c.channel(grpc.aio.secure_channel, grpc.aio.insecure_channel)
        except RuntimeError as exc:
            # asyncio's bare "There is no current event loop in thread ...", from
            # grpc.aio binding the channel to one (an SDK misuse review).
            raise InvalidRequest(
                f"AsyncRendezvousClient() of job {job_id!r} was made in a thread with no "
                f"event loop ({exc}): make it inside the coroutine that uses it (e.g. under "
                "asyncio.run()), or use RendezvousClient in a thread",
                endpoint=endpoint,
                job_id=job_id,
            ) from None
        # Their methods made on first use: a client uses one or two (_stubs).
        self._stub: pb_grpc.RendezvousAsyncStub = lazy_stub(pb_grpc.RendezvousStub, self._channel)
        self._health = lazy_stub(health_pb2_grpc.HealthStub, self._channel)
        self._mux: AsyncCallStream | AsyncRelayedCalls | None = (
            AsyncCallStream(self._channel, self._s.bearer, self._s.endpoint)
            if self._c.call_stream
            else None
        )
        # A slim join's table is fetched on first use of Membership.members, a plain
        # property: that blocking call goes over a channel of its own, made then.
        self._blocking = BlockingMembers(self._c)
        self._s.get_members = self._blocking
        self._hb_task: asyncio.Task[None] | None = None
        # The heartbeat stream opened before the join (``steps.OpenStream``), and what
        # its requests will be once start_heartbeat() gives them (None: none, ever).
        self._opened: tuple[grpc.aio.StreamStreamCall, asyncio.Future[_Requests | None]] | None
        self._opened = None
        # Wakes the stream's request iterator before its next beat, to say goodbye.
        self._hb_wake = asyncio.Event()
        self._hb_leave = False
        # Channels replaced by one of renewed TLS files (``_renew``), closed with the
        # client (as the blocking client's, ``RendezvousClient._replaced``).
        self._replaced: list[grpc.aio.Channel] = []
        # The TLS files' renewal the channel was made at (``TlsFiles.renewed``).
        self._made = 0

    # -- relayed calls (``relay``) ----------------------------------------------------

    def relay_end(self, reply: Send) -> RelayEnd | None:
        """``RendezvousClient.relay_end``; its ``forward`` runs on this client's loop."""
        if not isinstance(self._mux, AsyncCallStream):
            return None
        return RelayEnd(
            submit_on(self._mux, lambda: asyncio.get_running_loop().create_future()), reply
        )

    def relay_through(self, send: Send) -> AsyncRelayedCalls:
        """``RendezvousClient.relay_through``; ``deliver`` runs on this client's loop.
        Before the client's first call (its own stream, never opened, is dropped)."""
        self._mux = AsyncRelayedCalls(send)
        return self._mux

    async def _run(self, calls: steps.Steps[T]) -> T:
        self._check_process()
        self._check_loop()
        run = steps.Run(calls)
        try:
            for step in run:
                try:
                    run.answer = await self._perform(step)
                except BaseException as exc:  # thrown into the call, which decides
                    run.error = exc
        except BaseException as exc:
            self._s.give_up(getattr(calls, "__name__", ""), exc)
            raise
        return run.value

    def _check_loop(self) -> None:
        """grpc.aio binds a channel to the event loop it was made on (the running one,
        else the thread's current one). Used on another, every call failed with
        asyncio's "attached to a different loop", naming no job: a client made at
        module level, then used inside asyncio.run()."""
        if self._wrong_loop() is not None:
            raise InvalidRequest(
                f"the AsyncRendezvousClient of job {self._s.job_id!r} at {self._s.endpoint} "
                "was made outside the event loop it is used on (grpc.aio binds its channel "
                "to the loop it is made on): make it inside the coroutine that uses it, "
                "e.g. under asyncio.run(), or use RendezvousClient",
                endpoint=self._s.endpoint,
                job_id=self._s.job_id,
            )

    def _wrong_loop(self) -> str | None:
        """Where this thread is, if it cannot use the client: None on the loop the
        client's channel was made on (grpc.aio's own record of it)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return "from a thread with no event loop running"
        made_on = getattr(self._channel, "_loop", None)
        if made_on is None or loop is made_on:
            return None
        return "on an event loop other than the one the client runs on"

    async def _perform(self, step: steps.Step) -> Any:
        if self._s.closed:
            raise self._s.closed_error()
        if isinstance(step, steps.Rpc):
            try:
                if self._mux is not None and step.streamable:
                    with contextlib.suppress(Unsupported):  # an older daemon, a full stream
                        return await self._mux.call(step.method, step.request, step.timeout)
                call = step.invoke(self._stub, self._health, self._s.metadata)
                self._track(call)
                try:
                    return await call
                finally:
                    self._untrack(call)
            except grpc.RpcError:
                if self._ended_by_close():
                    raise self._s.closed_error() from None
                raise
            except asyncio.CancelledError:
                # Unless the caller's task is itself being cancelled: escaping, it was
                # not caught by ``except Exception`` and read as that task's cancellation.
                task = asyncio.current_task()
                if task is None or not task.cancelling():
                    if self._ended_by_close():
                        raise self._s.closed_error() from None
                    if self._lost_with_the_daemon():
                        raise lost_error() from None
                raise
        if isinstance(step, steps.Sleep):
            await asyncio.sleep(step.seconds)
        elif isinstance(step, steps.Blocking):
            return await asyncio.to_thread(step.work)
        elif isinstance(step, steps.StopStream):
            # A stream opened but never heartbeated (connect(), an earlier join) names
            # no member yet: the join that follows takes it.
            await self._stop_heartbeat(keep_opened=True)
        elif isinstance(step, steps.OpenStream):
            self._open_stream()
        elif isinstance(step, steps.Reachable):
            return await self._reachable(step.timeout)
        elif isinstance(step, steps.LeaveOnStream):
            return await self._leave_on_stream(step.timeout)
        elif isinstance(step, steps.Renew):
            return await self._renew(readdressed=step.readdressed)
        elif isinstance(step, steps.Connect):
            try:
                async with asyncio.timeout(step.timeout):
                    await self._channel.channel_ready()
            except TimeoutError:
                return False
            except grpc.aio.UsageError:  # "Channel is closed.": close() meanwhile
                if self._s.closed:
                    raise self._s.closed_error() from None
                raise
            return True
        return None

    async def _renew(self, *, unless_ready: bool = True, readdressed: bool = False) -> bool:
        """``RendezvousClient._renew``: the files read off the loop, the channel made
        on it (grpc.aio binds a channel to the loop it is made on)."""
        files = self._c.files
        renewal = None
        if not readdressed:
            if files is None:
                return False
            if unless_ready and self._channel.get_state() is grpc.ChannelConnectivity.READY:
                return False
            if not files.changed(self._made):  # the common case, on the loop: three stats
                return False
        if files is not None and files.changed(self._made):
            renewal = await asyncio.to_thread(self._c.renewed, self._made)
        if (renewal is None and not readdressed) or self._s.closed:
            return False
        made, credentials = (self._made, None) if renewal is None else renewal
        channel = self._c.channel(grpc.aio.secure_channel, grpc.aio.insecure_channel, credentials)
        self._replaced.append(self._channel)
        self._channel, self._made = channel, made
        self._stub = lazy_stub(pb_grpc.RendezvousStub, channel)
        self._health = lazy_stub(health_pb2_grpc.HealthStub, channel)
        if isinstance(self._mux, AsyncCallStream):
            self._mux.rechannel(channel)
        return True

    async def _reachable(self, timeout: float) -> bool:
        channel = self._channel
        state = channel.get_state(try_to_connect=True)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while state in _CONNECTING:
                    await channel.wait_for_state_change(state)
                    state = channel.get_state(try_to_connect=False)
        return state is grpc.ChannelConnectivity.READY

    async def _leave_on_stream(self, timeout: float) -> bool | None:
        task = self._hb_task
        if task is None or task.done():
            return False
        self._hb_leave = True
        self._hb_wake.set()
        # The task ends with the stream: LEFT read, or the stream over without it.
        await asyncio.wait({task}, timeout=timeout)
        return self._s.left if task.done() else None

    async def check_health(self) -> None:
        """``RendezvousClient.check_health``, awaited."""
        await self._run(self._c.check_health())

    async def connect(self) -> None:
        """``RendezvousClient.connect``, awaited."""
        await self._run(self._c.connect())

    async def join(self, **request: Unpack[JoinRequest]) -> Membership:
        """``RendezvousClient.join``, awaited."""
        return await self._run(self._c.join(request))

    async def join_node(self, **request: Unpack[NodeJoinRequest]) -> NodeMembership:
        """``RendezvousClient.join_node``, awaited."""
        return await self._run(self._c.join_node(request))

    async def report_failure(
        self,
        local_rank: int,
        cause: str,
        *,
        timeout: float | None = None,
        witness_rank: int | None = None,
    ) -> None:
        """``RendezvousClient.report_failure``, awaited."""
        await self._run(self._c.report_failure(local_rank, cause, timeout, witness_rank))

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

    async def abort(
        self, reason: str, *, job_id: str | None = None, generation: int = 0, cause: str = ""
    ) -> int:
        """``RendezvousClient.abort``, awaited."""
        return await self._run(self._c.abort(reason, job_id, generation, cause))

    async def close_run(self, reason: str, *, generation: int = 0, cause: str = "") -> bool:
        """``RendezvousClient.close_run``, awaited."""
        return await self._run(self._c.close_run(reason, generation, cause))

    def _open_stream(self) -> None:
        """``steps.OpenStream``: the heartbeat stream's call, open before the join, its
        requests held back until start_heartbeat() (none while one is running)."""
        if self._heartbeat_running():
            return
        if self._opened is not None:
            if not self._opened[0].done():
                return
            self._release_opened()
        if self._mux is not None:
            # The call stream first: the join goes on it, and the daemon takes new
            # calls in arrival order, so the join does not wait behind this stream.
            self._mux.open()
        requests: asyncio.Future[_Requests | None] = asyncio.get_running_loop().create_future()
        call = self._stub.Heartbeat(
            _held(requests), metadata=self._s.metadata, timeout=HEARTBEAT_CALL_S
        )
        self._opened = (call, requests)

    def _take_opened(self, requests: _Requests) -> grpc.aio.StreamStreamCall | None:
        """The stream opened before the join, now sending ``requests``; None when
        there is none, or it already ended (the stream is then made anew)."""
        opened, self._opened = self._opened, None
        if opened is None:
            return None
        call, held = opened
        if call.done():
            held.set_result(None)
            return None
        held.set_result(requests)
        return call

    async def _end_opened(self) -> None:
        """``_release_opened``, then the call cancelled and waited for (within
        STOP_HEARTBEAT_S), so that close() leaves none of gRPC's tasks behind."""
        call = self._opened[0] if self._opened is not None else None
        self._release_opened()
        if call is not None and not call.done():
            call.cancel()
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, grpc.RpcError):
                await asyncio.wait_for(call.code(), STOP_HEARTBEAT_S)

    def _release_opened(self) -> None:
        """An opened stream that no heartbeat took: ended without a message (the
        daemon's handler sees the end of its requests and returns)."""
        opened, self._opened = self._opened, None
        if opened is not None and not opened[1].done():
            opened[1].set_result(None)

    def _heartbeat_running(self) -> bool:
        return self._hb_task is not None and not self._hb_task.done()

    def start_heartbeat(
        self,
        interval: float | None = None,
        on_failure: Callable[[RendezvousError], None] | None = None,
        on_nodes_waiting: Callable[[int], None] | None = None,
    ) -> None:
        """``RendezvousClient.start_heartbeat``: its heartbeat is a task on the event loop
        the client runs on, so call it from a coroutine or callback on that loop."""
        self._check_heartbeat_loop()
        super().start_heartbeat(interval, on_failure, on_nodes_waiting)

    def _check_heartbeat_loop(self) -> None:
        """Refuse a start_heartbeat() made outside the client's loop, before anything
        changes: with no loop running in this thread it raised asyncio's bare
        RuntimeError ("no running event loop"), naming no job; on another loop, its
        task would have used a channel bound to this one."""
        where = self._wrong_loop()
        if where is None:
            return
        s = self._s
        who = (
            f" rank {s.joined.rank}"
            if s.joined is not None
            else f" node {s.node.node_rank}"
            if s.node is not None
            else ""
        )
        raise InvalidRequest(
            f"start_heartbeat() of the AsyncRendezvousClient of job {s.job_id!r}{who} at "
            f"{s.endpoint} was called {where}: its "
            "heartbeat is a task on the client's loop; call it from a coroutine or callback "
            "running on that loop (from another thread: "
            "loop.call_soon_threadsafe(client.start_heartbeat))",
            endpoint=s.endpoint,
            job_id=s.job_id,
        )

    def _start_stream(self, watch: StreamWatch, interval: float) -> None:
        loop = asyncio.get_running_loop()
        self._hb_wake.clear()
        self._hb_leave = False
        self._hb_task = loop.create_task(self._heartbeat_loop(watch, interval))

    async def _heartbeat_requests(
        self, interval: float, watch: StreamWatch
    ) -> AsyncIterator[pb.HeartbeatRequest]:
        first = watch.first
        request = self._s.heartbeat_request() if first is None else self._s.beat(first)
        while True:
            yield request
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._hb_wake.wait()
            if self._hb_leave:
                yield self._s.leave_beat(request)
                return  # the daemon ends the stream once the goodbye is durable
            request = self._s.beat(request)

    async def _heartbeat_loop(self, watch: StreamWatch, interval: float) -> None:
        while not watch.done:
            requests = self._heartbeat_requests(interval, watch)
            opened = self._take_opened(requests)
            call = opened or self._stub.Heartbeat(
                requests, metadata=self._s.metadata, timeout=HEARTBEAT_CALL_S
            )
            heard = False
            error: grpc.aio.AioRpcError | None = None
            read: asyncio.Future[Any] | None = None
            last = time.monotonic()
            try:
                while True:
                    # Bounded by the unreachable deadline: a dead route or a daemon
                    # that is gone never answers, and silence is the signal. Looked at
                    # in slices, as the sync client's watchdog does: a slice that took
                    # far longer was this process not running (SIGSTOP, a loop
                    # blocked), its silence its own (``StreamWatch.woke``, which counts
                    # a gap over half the window). A quarter window, not the watchdog's
                    # WATCH_S: one loop may hold thousands of members. The read is
                    # waited on, never cancelled, so no event is lost between slices.
                    read = read or asyncio.ensure_future(call.read())
                    deadline = watch.deadline()
                    wait = max(WATCH_S, watch.window_s / 4)
                    if deadline is not None:
                        wait = min(wait, max(0.0, deadline - time.monotonic()))
                    await asyncio.wait({read}, timeout=wait)
                    now = time.monotonic()
                    watch.woke(now - last)
                    last = now
                    if not read.done():
                        if watch.outage_since is not None and await self._renew(unless_ready=False):
                            # A redialled stream waiting for a channel whose certificate
                            # the daemon may refuse: the next opens on the renewed one.
                            break
                        if watch.may_look_back():  # a plain connect: off the loop
                            watch.back_again(await asyncio.to_thread(watch.look.listening))
                        deadline = watch.deadline()
                        if deadline is not None and time.monotonic() >= deadline:
                            # The verdict now, as the blocking client's watchdog gives
                            # it: ended as a broken stream, the silence was counted
                            # again from the break, a hung daemon (SIGSTOP) said after
                            # twice the window and a look's grace (an SDK misuse review).
                            if watch.expired():
                                return
                            break
                        continue
                    event, read = read.result(), None
                    if event is grpc.aio.EOF:
                        break
                    heard = True
                    verdict = watch.on_event(event)
                    if verdict == "reconnect" and self._mux is not None:
                        self._mux.retire()  # the daemon drains: let it go
                    if verdict != "continue":
                        break
            except grpc.aio.AioRpcError as exc:
                # The first beat on the stream opened with the join can find its
                # connection already gone (the daemon died since): gRPC fails such a
                # write INTERNAL, on this side, not UNAVAILABLE. Nothing was heard on
                # that stream: a new one is made, as after any broken stream.
                lost = opened is not None and not heard and exc.code() is INTERNAL
                error = None if lost else exc
                if self._mux is not None:
                    self._mux.retire()  # the daemon may be going: never hold it up
            finally:
                call.cancel()
                if read is not None:
                    read.cancel()
                    # Its end retrieved: the cancelled call fails it, never to be logged.
                    read.add_done_callback(_retrieved)
            delay = watch.ended(error)
            if delay is None:
                return
            # Before the redial: a certificate renewed on disk is shown.
            await self._renew(unless_ready=False)
            await asyncio.sleep(delay)

    async def _stop_heartbeat(self, *, keep_opened: bool = False) -> None:
        """Cancel the stream's task and wait for it, within STOP_HEARTBEAT_S: a task
        that outlives its cancellation (a library swallowing it) is cancelled again
        each round, and after that left behind with a warning, never waited on
        without end. A stream opened for a heartbeat that never started ends."""
        if not keep_opened:
            await self._end_opened()
        task, self._hb_task = self._hb_task, None
        if task is None:
            return
        deadline = time.monotonic() + STOP_HEARTBEAT_S
        while not task.done() and time.monotonic() < deadline:
            task.cancel()
            await asyncio.wait({task}, timeout=0.1)
        if not task.done():
            log.warning(
                "the heartbeat stream of job %r did not stop within %.0f s of its "
                "cancellation; leaving it behind",
                self._s.job_id,
                STOP_HEARTBEAT_S,
            )
            return
        with contextlib.suppress(asyncio.CancelledError):
            task.result()

    async def leave(self, *, final: bool = False) -> None:
        """Best effort, like ``RendezvousClient.leave``: one attempt within
        ``leave_timeout``, then one WARNING instead of an exception."""
        check_arg("leave", "final", final, bool)  # see RendezvousClient.leave
        # Refused on another loop before anything is torn down: the heartbeat stopped
        # and the membership forgotten without a goodbye failed the job (an SDK
        # misuse review).
        self._check_loop()
        try:
            await self._run(self._c.leave(final))
        finally:
            await self._stop_heartbeat()
            self._forget()

    async def fetch_members(self) -> tuple[Member, ...]:
        """The joined (or attached) member's table without blocking the event loop.

        After a slim join, the first read of ``membership.members`` fetches the table
        with a blocking call; in a coroutine, await this first instead (required when
        the daemon runs in this same event loop, as in tests).
        """
        return await self._run(self._c.fetch_members())

    async def close(self) -> None:
        if self._s.unsettled is not None and not self._s.closed and not self._forked():
            # See RendezvousClient.close: before the client is closed to its own calls.
            with contextlib.suppress(RendezvousError):
                await self._run(self._c.leave_given_up(closing=True))
        self._s.closed = True  # first: see RendezvousClient.close
        if self._forked():  # see RendezvousClient.close
            return
        await self._stop_heartbeat()
        self._forget()  # a ``with`` block left after this must not Leave on the closed channel
        if self._mux is not None:
            await self._mux.close()
        replaced, self._replaced = self._replaced, []
        for channel in (*replaced, self._channel):
            await channel.close()
        self._blocking.close()

    async def __aenter__(self) -> AsyncRendezvousClient:
        return self

    async def __aexit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if self._forked():  # see RendezvousClient.__exit__
            await self.close()
            return
        try:
            if (report := self._c.exit_failure(exc)) is not None:
                with contextlib.suppress(RendezvousError):  # its own error goes on
                    await self._run(report)
            elif self._leaves_on_exit(exc):
                await self.leave()
        finally:
            await self.close()
