"""``AsyncRendezvousClient``: the asyncio SDK, with heartbeats on a background task."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, Unpack

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from rendezvousd.client._session import (
    LEAVE_TIMEOUT_S,
    SLACK_S,
    JoinRequest,
    Session,
    StreamWatch,
    rank_zero_id,
)
from rendezvousd.client._tables import BlockingMembers
from rendezvousd.client.connection import (
    SERVICE,
    TLS_PROBE_TIMEOUT_S,
    RetryPolicy,
    TlsConfig,
    TlsProbe,
    channel_options,
    resolve_token,
)
from rendezvousd.client.errors import (
    DaemonUnavailable,
    InvalidRequest,
    RendezvousError,
    from_rpc_error,
)
from rendezvousd.client.membership import (
    LazyTable,
    Member,
    Membership,
    NodeMembership,
    advertises_loopback,
    loopback_conflict,
)


class AsyncRendezvousClient:
    """Same methods and parameters as ``RendezvousClient``, as coroutines."""

    def __init__(
        self,
        endpoint: str,
        job_id: str = "",
        *,
        token: str | None = None,
        token_file: Path | str | None = None,
        tls: TlsConfig | None = None,
        retry_attempts: int = 1,
        call_timeout: float = 30.0,
        connect_timeout: float = 30.0,
        reconnect_window: float | None = None,
        leave_timeout: float = LEAVE_TIMEOUT_S,
    ) -> None:
        self._s = Session(
            endpoint,
            job_id,
            resolve_token(token, token_file),
            RetryPolicy(retry_attempts),
            call_timeout,
            connect_timeout,
        )
        self._tls_probe = TlsProbe(endpoint, tls=tls is not None)
        options = channel_options(self._s.retry, tls.server_name if tls else None)
        if tls is not None:
            self._channel = grpc.aio.secure_channel(endpoint, tls.credentials(), options=options)
        else:
            self._channel = grpc.aio.insecure_channel(endpoint, options=options)
        self._stub = pb_grpc.RendezvousStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        # A slim join's table is fetched on first use of Membership.members, a plain
        # property: that blocking call goes over a channel of its own, made then.
        self._blocking = BlockingMembers(self._s, tls)
        self._s.get_members = self._blocking
        self._reconnect_window = reconnect_window
        self._leave_timeout = leave_timeout
        self._hb_task: asyncio.Task[None] | None = None

    @property
    def membership(self) -> Membership | None:
        return self._s.joined

    @property
    def failure(self) -> RendezvousError | None:
        return self._s.failure

    async def _call(
        self, method: str, request: Any, *, timeout: float | None = None, stub: Any = None
    ) -> Any:
        rpc = getattr(stub or self._stub, method)
        rank = self._s.joined.rank if self._s.joined else None
        attempt = 0
        while True:
            attempt += 1
            try:
                return await rpc(
                    request, timeout=timeout or self._s.call_timeout, metadata=self._s.metadata
                )
            except grpc.aio.AioRpcError as exc:
                error = from_rpc_error(
                    exc, endpoint=self._s.endpoint, method=method, job_id=self._s.job_id, rank=rank
                )
                if error.reason == "DRAINING" or not self._s.retry.retryable(method, exc.code()):
                    raise error from None
                if attempt > self._s.retry.attempts:
                    raise self._s.exhausted(method, attempt, error) from None
            await asyncio.sleep(self._s.retry.backoff(attempt))

    async def check_health(self) -> None:
        request = health_pb2.HealthCheckRequest(service=SERVICE)
        if self._channel.get_state(try_to_connect=False) is grpc.ChannelConnectivity.READY:
            # Connected already: the daemon is reachable, and a draining daemon
            # answers the Join itself with DRAINING, which the SDK raises at once.
            return
        probed = await self._probe_tls(request)
        if probed is not None and probed.status == health_pb2.HealthCheckResponse.SERVING:
            return
        attempt = 0
        while True:
            attempt += 1
            response = await self._call(
                "Check", request, timeout=self._s.connect_timeout, stub=self._health
            )
            if response.status == health_pb2.HealthCheckResponse.SERVING:
                return
            if attempt > self._s.retry.attempts:
                raise DaemonUnavailable(
                    f"rendezvousd at {self._s.endpoint} is not serving after {attempt} health checks; "
                    "it may be draining or restarting",
                    attempts=attempt,
                    code="UNAVAILABLE",
                    endpoint=self._s.endpoint,
                    method="Check",
                    job_id=self._s.job_id,
                )
            await asyncio.sleep(self._s.retry.backoff(attempt))

    async def _probe_tls(
        self, request: health_pb2.HealthCheckRequest
    ) -> health_pb2.HealthCheckResponse | None:
        """Raise at once when the daemon refuses our TLS, or speaks TLS to a plaintext
        client; see ``TlsProbe``. The daemon's answer when it gave one."""
        probe = self._tls_probe
        if probe.seen_tls and (known := await asyncio.to_thread(probe.known_refusal)):
            raise self._s.tls_refused(known)
        for _ in range(probe.attempts):
            try:
                response: health_pb2.HealthCheckResponse = await self._health.Check(
                    request,
                    timeout=TLS_PROBE_TIMEOUT_S,
                    wait_for_ready=False,
                    metadata=self._s.metadata,
                )
                return response
            except grpc.RpcError as exc:
                # A plaintext client's refusal asks the daemon over a socket of its
                # own (blocking, up to TLS_SNIFF_TIMEOUT_S): off the event loop.
                refusal = await asyncio.to_thread(probe.refusal, exc)
                if refusal is not None:
                    raise self._s.tls_refused(refusal) from None
                if not probe.again(exc):
                    return None
            await asyncio.sleep(0.2)
        return None

    async def join(self, **request: Unpack[JoinRequest]) -> Membership:
        """``RendezvousClient.join``, awaited."""
        await self.check_health()
        plan = self._s.plan_join(**request)
        timeout, address = plan.timeout, plan.request.address
        try:
            response = await self._call("Join", plan.request, timeout=timeout + SLACK_S)
        except InvalidRequest as exc:
            if not plan.fresh_id_after(exc):
                raise
            response = await self._call("Join", plan.request, timeout=timeout + SLACK_S)
        if response.id_required:
            publish = plan.publish_request(response)
            response = await self._call("PublishId", publish, timeout=plan.left() + SLACK_S)
        m = plan.finish(response)
        if advertises_loopback(address):
            await self.fetch_members()  # the check reads the table: never block the loop
        if (problem := loopback_conflict(m, address)) is not None:
            # Every rank must hear why, not just this one: abort the job with it.
            with contextlib.suppress(RendezvousError):
                await self.abort(problem)
            raise InvalidRequest(problem, reason="LOOPBACK_ADDRESS", job_id=m.job_id, rank=m.rank)
        return m

    async def join_node(
        self,
        *,
        min_nodes: int,
        max_nodes: int,
        gpus_per_node: int,
        node_rank: int | None = None,
        addresses: Sequence[str] = (),
        id_factory: Callable[[], bytes] | None = None,
        last_call: float | None = None,
        timeout: float | None = None,
        host: str | None = None,
    ) -> NodeMembership:
        """Join once for this whole node (a node agent holding ``gpus_per_node`` local
        ranks) and wait for the generation to form: when ``max_nodes`` nodes joined,
        or when at least ``min_nodes`` joined and ``last_call`` seconds passed since
        the last arrival (the daemon's default when None). ``id_factory`` runs only if
        this node becomes node 0 (else 128 random bytes). Then ``start_heartbeat()``
        heartbeats the node, ``leave()`` leaves all its members, and the workers
        ``attach()`` with ``membership_for(i)`` / ``member_instance_id(i)``.
        """
        await self.check_health()
        # A re-join (next generation): the last generation's stream must not report
        # into this one.
        await self._stop_heartbeat()
        wait = timeout if timeout is not None else 600.0
        started = time.monotonic()
        request = self._s.plan_join_node(
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            gpus_per_node=gpus_per_node,
            node_rank=node_rank,
            host=host,
            addresses=addresses,
            last_call=last_call,
            timeout=wait,
        )
        while True:
            left = max(0.001, wait - (time.monotonic() - started))
            request.wait_timeout_ms = int(left * 1000)
            try:
                response = await self._call("JoinNode", request, timeout=left + SLACK_S)
            except InvalidRequest as exc:
                # A restarted daemon fenced the generation our id was made for.
                if exc.reason != "ID_REUSED" or not request.unique_id:
                    raise
                request.unique_id = rank_zero_id(None, id_factory)
                continue
            if not response.id_required:
                return self._s.finish_node(response)
            # This node is node 0 of the generation: it makes rank 0's id.
            request.unique_id = rank_zero_id(None, id_factory)

    async def report_failure(self, local_rank: int, cause: str) -> None:
        """Tell the daemon this node's worker at ``local_rank`` failed: it marks that
        rank lost with ``cause``, fails the generation and tells the other nodes."""
        await self._call("ReportFailure", self._s.report_request(local_rank, cause))

    def attach(self, membership: Membership, instance_id: str) -> None:
        """Act as ``membership``'s member (registered by a node agent's join_node) for
        barrier(), kv_*() and abort(), without joining and without a heartbeat of our
        own: the agent's node heartbeat covers this worker. A wrong ``instance_id`` is
        refused by the daemon at the first call (DuplicateRank)."""
        self._s.attach(membership, instance_id)

    def nodes_waiting(self) -> int:
        """Nodes parked for the next generation (NODES_WAITING from the daemon), 0 if none."""
        return self._s.nodes_waiting

    @property
    def node_membership(self) -> NodeMembership | None:
        return self._s.node

    async def barrier(self, name: str = "default", *, timeout: float | None = None) -> None:
        wait = timeout or self._s.call_timeout
        request = self._s.barrier_request(name, wait)
        try:
            await self._call("Barrier", request, timeout=wait + SLACK_S)
        except RendezvousError as exc:
            self._s.barrier_failed(name, exc)
            raise

    def _kv_scope(self) -> dict[str, Any]:
        return self._s.scope()

    async def kv_set(self, key: str, value: bytes) -> None:
        await self._call("KvSet", pb.KvSetRequest(key=key, value=value, **self._kv_scope()))

    async def kv_get(self, key: str, *, wait: bool = True, timeout: float | None = None) -> bytes:
        limit = timeout or self._s.call_timeout
        request = pb.KvGetRequest(
            key=key, wait=wait, wait_timeout_ms=int(limit * 1000), **self._kv_scope()
        )
        value: bytes = (await self._call("KvGet", request, timeout=limit + SLACK_S)).value
        return value

    async def kv_add(self, key: str, delta: int = 1) -> int:
        value: int = (
            await self._call("KvAdd", pb.KvAddRequest(key=key, delta=delta, **self._kv_scope()))
        ).value
        return value

    async def kv_compare_and_set(
        self, key: str, expected: bytes | None, desired: bytes
    ) -> tuple[bool, bytes | None]:
        request = pb.KvCompareAndSetRequest(key=key, desired=desired, **self._kv_scope())
        if expected is not None:
            request.expected = expected
        response = await self._call("KvCompareAndSet", request)
        return response.swapped, response.current if response.HasField("current") else None

    async def kv_delete(self, key: str) -> bool:
        deleted: bool = (
            await self._call("KvDelete", pb.KvDeleteRequest(key=key, **self._kv_scope()))
        ).deleted
        return deleted

    async def list_jobs(self) -> list[pb.JobSummary]:
        return list((await self._call("ListJobs", pb.ListJobsRequest())).jobs)

    async def get_job(self, job_id: str | None = None) -> pb.GetJobResponse:
        response: pb.GetJobResponse = await self._call(
            "GetJob", pb.GetJobRequest(job_id=job_id or self._s.job_id)
        )
        return response

    async def abort(self, reason: str, *, job_id: str | None = None, generation: int = 0) -> int:
        """Abort the job's current generation, or only ``generation`` (a generation
        already replaced is left alone); returns the generation aborted."""
        request = pb.AbortJobRequest(
            job_id=job_id or self._s.job_id, generation=generation, reason=reason
        )
        response = await self._call("AbortJob", request)
        aborted: int = response.generation
        return aborted

    def raise_if_failed(self) -> None:
        if self._s.failure is not None:
            raise self._s.failure

    def start_heartbeat(
        self,
        interval: float = 1.0,
        on_failure: Callable[[RendezvousError], None] | None = None,
        on_nodes_waiting: Callable[[int], None] | None = None,
    ) -> None:
        m = self._s.stream_member()
        interval = self._s.heartbeat_interval(interval)
        self._s.on_failure = on_failure
        self._s.on_nodes_waiting = on_nodes_waiting
        self._hb_task = asyncio.get_running_loop().create_task(self._heartbeat_loop(m, interval))

    async def _heartbeat_requests(self, interval: float) -> AsyncIterator[pb.HeartbeatRequest]:
        request = self._s.heartbeat_request()
        while True:
            yield request
            await asyncio.sleep(interval)

    async def _heartbeat_loop(self, m: Membership, interval: float) -> None:
        watch = StreamWatch(self._s, m, self._reconnect_window)
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
        request = self._s.leave_request()
        try:
            if request is not None:
                try:
                    await self._stub.Leave(
                        request, timeout=self._leave_timeout, metadata=self._s.metadata
                    )
                except grpc.aio.AioRpcError as exc:
                    self._s.leave_failed(request, exc)
        finally:
            self._s.joined = self._s.node = None
            await self._stop_heartbeat()

    async def fetch_members(self) -> tuple[Member, ...]:
        """The joined (or attached) member's table without blocking the event loop.

        After a slim join, the first read of ``membership.members`` fetches the table
        with a blocking call; in a coroutine, await this first instead (required when
        the daemon runs in this same event loop, as in tests).
        """
        m = self._s.member()
        table = m._table
        if isinstance(table, LazyTable) and not table.loaded:
            members: list[pb.Member] = []
            digest = b""
            while len(members) < m.world_size:
                request = pb.GetMembersRequest(
                    job_id=m.job_id,
                    generation=m.generation,
                    rank=m.rank,
                    instance_id=self._s.instance_id,
                    start_rank=len(members),
                )
                page = await self._call("GetMembers", request)
                digest = digest or page.table_digest
                if not page.members or page.table_digest != digest:
                    break
                members.extend(page.members)
            table.accept(members, digest)
        return m.members

    async def close(self) -> None:
        await self._stop_heartbeat()
        await self._channel.close()
        self._blocking.close()

    async def __aenter__(self) -> AsyncRendezvousClient:
        return self

    async def __aexit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        try:
            joined = self._s.joined is not None or self._s.node is not None
            if exc_type is None and joined and self._s.failure is None:
                await self.leave()
        finally:
            await self.close()
