"""``RendezvousClient``: the blocking SDK, with heartbeats on a background thread."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
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
from rendezvousd.client.membership import Membership, NodeMembership, loopback_conflict


class RendezvousClient:
    """The blocking SDK: join a job, then barrier, key-value and leave; heartbeats run
    on a background thread and a peer failure surfaces as ``PeerFailed``.

    ``reconnect_window``: how long the heartbeat stream may hear nothing from the
    daemon before ``DaemonUnreachable`` is reported (default: the heartbeat timeout
    the daemon advertises at join, 10 s for an older daemon); a daemon restarted
    within it is reattached silently. ``leave_timeout``: the one attempt ``leave()``
    makes to tell the daemon.
    """

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
            self._channel = grpc.secure_channel(endpoint, tls.credentials(), options=options)
        else:
            self._channel = grpc.insecure_channel(endpoint, options=options)
        self._stub = pb_grpc.RendezvousStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        # After close() the table of a slim join is still readable: over a channel of its own.
        self._closed = False
        self._after_close = BlockingMembers(self._s, tls)
        self._s.get_members = lambda request: (
            self._after_close(request) if self._closed else self._call("GetMembers", request)
        )
        self._reconnect_window = reconnect_window
        self._leave_timeout = leave_timeout
        self._hb_thread: threading.Thread | None = None
        self._hb_watchdog: threading.Thread | None = None
        self._hb_stop = threading.Event()
        self._hb_call: Any = None

    # -- plumbing -----------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return self._s.endpoint

    @property
    def membership(self) -> Membership | None:
        return self._s.joined

    def _call(
        self, method: str, request: Any, *, timeout: float | None = None, stub: Any = None
    ) -> Any:
        rpc = getattr(stub or self._stub, method)
        rank = self._s.joined.rank if self._s.joined else None
        attempt = 0
        while True:
            attempt += 1
            try:
                return rpc(
                    request, timeout=timeout or self._s.call_timeout, metadata=self._s.metadata
                )
            except grpc.RpcError as exc:
                error = from_rpc_error(
                    exc, endpoint=self._s.endpoint, method=method, job_id=self._s.job_id, rank=rank
                )
                if error.reason == "DRAINING" or not self._s.retry.retryable(method, exc.code()):
                    raise error from None
                if attempt > self._s.retry.attempts:
                    raise self._s.exhausted(method, attempt, error) from None
            time.sleep(self._s.retry.backoff(attempt))

    def check_health(self) -> None:
        """Fail fast, with one clear error, when the daemon is down or draining."""
        request = health_pb2.HealthCheckRequest(service=SERVICE)
        probed = self._probe_tls(request)
        if probed is not None and probed.status == health_pb2.HealthCheckResponse.SERVING:
            return
        attempt = 0
        while True:
            attempt += 1
            response = self._call(
                "Check", request, timeout=self._s.connect_timeout, stub=self._health
            )
            if response.status == health_pb2.HealthCheckResponse.SERVING:
                return
            if attempt > self._s.retry.attempts:
                raise DaemonUnavailable(
                    f"rendezvousd at {self._s.endpoint} is not serving (status "
                    f"{health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)}) after "
                    f"{attempt} health checks; it may be draining or restarting",
                    attempts=attempt,
                    code="UNAVAILABLE",
                    endpoint=self._s.endpoint,
                    method="Check",
                    job_id=self._s.job_id,
                )
            time.sleep(self._s.retry.backoff(attempt))

    def _probe_tls(
        self, request: health_pb2.HealthCheckRequest
    ) -> health_pb2.HealthCheckResponse | None:
        """Raise at once when the daemon refuses our TLS, or speaks TLS to a plaintext
        client; see ``TlsProbe``. The daemon's answer when it gave one."""
        probe = self._tls_probe
        if (known := probe.known_refusal()) is not None:
            raise self._s.tls_refused(known)
        for _ in range(probe.attempts):
            try:
                response: health_pb2.HealthCheckResponse = self._health.Check(
                    request,
                    timeout=TLS_PROBE_TIMEOUT_S,
                    wait_for_ready=False,
                    metadata=self._s.metadata,
                )
                return response
            except grpc.RpcError as exc:
                refusal = probe.refusal(exc)
                if refusal is not None:
                    raise self._s.tls_refused(refusal) from None
                if not probe.again(exc):
                    return None
            time.sleep(0.2)
        return None

    # -- membership -----------------------------------------------------------

    def join(self, **request: Unpack[JoinRequest]) -> Membership:
        """Register and wait for the world; returns rank, id and member table.

        The keywords are ``JoinRequest``'s: the topology and ``local_rank``, and
        optionally ``node_rank``, ``host``, ``address``, ``unique_id``, ``id_factory`` and
        ``timeout`` (600 s). Global rank 0 provides the id: ``unique_id``, else
        ``id_factory()`` (e.g. NCCL's get_unique_id), else 128 random bytes (enough for
        the CPU backend).
        """
        self.check_health()
        plan = self._s.plan_join(**request)
        timeout, address = plan.timeout, plan.request.address
        try:
            response = self._call("Join", plan.request, timeout=timeout + SLACK_S)
        except InvalidRequest as exc:
            if not plan.fresh_id_after(exc):
                raise
            response = self._call("Join", plan.request, timeout=timeout + SLACK_S)
        if response.id_required:
            publish = plan.publish_request(response)
            response = self._call("PublishId", publish, timeout=plan.left() + SLACK_S)
        m = plan.finish(response)
        if (problem := loopback_conflict(m, address)) is not None:
            # Every rank must hear why, not just this one: abort the job with it.
            with contextlib.suppress(RendezvousError):
                self.abort(problem)
            raise InvalidRequest(problem, reason="LOOPBACK_ADDRESS", job_id=m.job_id, rank=m.rank)
        return m

    def join_node(
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
        self.check_health()
        # A re-join (next generation): the last generation's stream must not report
        # into this one.
        self._stop_heartbeat()
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
                response = self._call("JoinNode", request, timeout=left + SLACK_S)
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

    def report_failure(self, local_rank: int, cause: str) -> None:
        """Tell the daemon this node's worker at ``local_rank`` failed: it marks that
        rank lost with ``cause``, fails the generation and tells the other nodes."""
        self._call("ReportFailure", self._s.report_request(local_rank, cause))

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

    def barrier(self, name: str = "default", *, timeout: float | None = None) -> None:
        wait = timeout or self._s.call_timeout
        request = self._s.barrier_request(name, wait)
        try:
            self._call("Barrier", request, timeout=wait + SLACK_S)
        except RendezvousError as exc:
            self._s.barrier_failed(name, exc)
            raise

    def leave(self) -> None:
        """Say goodbye first, then close the stream: otherwise peers see a failure.

        Best effort: one attempt within ``leave_timeout``; if the daemon cannot be
        told, one WARNING is logged and leave() returns, since the work is done.
        """
        request = self._s.leave_request()
        try:
            if request is not None:
                try:
                    self._stub.Leave(
                        request, timeout=self._leave_timeout, metadata=self._s.metadata
                    )
                except grpc.RpcError as exc:
                    self._s.leave_failed(request, exc)
        finally:
            self._stop_heartbeat()
            self._s.joined = self._s.node = None

    def abort(self, reason: str, *, job_id: str | None = None, generation: int = 0) -> int:
        """Abort the job's current generation, or only ``generation`` (a generation
        already replaced is left alone); returns the generation aborted."""
        request = pb.AbortJobRequest(
            job_id=job_id or self._s.job_id, generation=generation, reason=reason
        )
        response = self._call("AbortJob", request)
        aborted: int = response.generation
        return aborted

    def raise_if_failed(self) -> None:
        if self._s.failure is not None:
            raise self._s.failure

    @property
    def failure(self) -> RendezvousError | None:
        return self._s.failure

    # -- key-value store --------------------------------------------------------

    def _kv_scope(self) -> dict[str, Any]:
        return self._s.scope()

    def kv_set(self, key: str, value: bytes) -> None:
        self._call("KvSet", pb.KvSetRequest(key=key, value=value, **self._kv_scope()))

    def kv_get(self, key: str, *, wait: bool = True, timeout: float | None = None) -> bytes:
        limit = timeout or self._s.call_timeout
        request = pb.KvGetRequest(
            key=key, wait=wait, wait_timeout_ms=int(limit * 1000), **self._kv_scope()
        )
        value: bytes = self._call("KvGet", request, timeout=limit + SLACK_S).value
        return value

    def kv_add(self, key: str, delta: int = 1) -> int:
        value: int = self._call(
            "KvAdd", pb.KvAddRequest(key=key, delta=delta, **self._kv_scope())
        ).value
        return value

    def kv_compare_and_set(
        self, key: str, expected: bytes | None, desired: bytes
    ) -> tuple[bool, bytes | None]:
        request = pb.KvCompareAndSetRequest(key=key, desired=desired, **self._kv_scope())
        if expected is not None:
            request.expected = expected
        response = self._call("KvCompareAndSet", request)
        return response.swapped, response.current if response.HasField("current") else None

    def kv_delete(self, key: str) -> bool:
        deleted: bool = self._call(
            "KvDelete", pb.KvDeleteRequest(key=key, **self._kv_scope())
        ).deleted
        return deleted

    # -- inspection ---------------------------------------------------------------

    def list_jobs(self) -> list[pb.JobSummary]:
        return list(self._call("ListJobs", pb.ListJobsRequest()).jobs)

    def get_job(self, job_id: str | None = None) -> pb.GetJobResponse:
        response: pb.GetJobResponse = self._call(
            "GetJob", pb.GetJobRequest(job_id=job_id or self._s.job_id)
        )
        return response

    # -- heartbeat ----------------------------------------------------------------

    def start_heartbeat(
        self,
        interval: float = 1.0,
        on_failure: Callable[[RendezvousError], None] | None = None,
        on_nodes_waiting: Callable[[int], None] | None = None,
    ) -> None:
        """Heartbeat on a daemon thread; ``on_failure`` runs on that thread or the
        watchdog's, once: ``PeerFailed``, ``JobAborted``, ``DaemonUnreachable``...
        After join_node() the stream is the whole node's; ``on_nodes_waiting(count)``
        runs on the heartbeat thread when nodes park for a next generation."""
        m = self._s.stream_member()
        interval = self._s.heartbeat_interval(interval)
        self._s.on_failure = on_failure
        self._s.on_nodes_waiting = on_nodes_waiting
        self._hb_stop.clear()
        watch = StreamWatch(self._s, m, self._reconnect_window)
        name = f"rendezvous-heartbeat-{m.job_id}-{m.rank}"
        self._hb_thread = threading.Thread(
            target=self._heartbeat_loop, args=(watch, interval), daemon=True, name=name
        )
        self._hb_watchdog = threading.Thread(
            target=self._watchdog, args=(watch,), daemon=True, name=f"{name}-watchdog"
        )
        self._hb_thread.start()
        self._hb_watchdog.start()

    def _heartbeat_requests(self, interval: float) -> Iterator[pb.HeartbeatRequest]:
        request = self._s.heartbeat_request()
        yield request
        while not self._hb_stop.wait(interval):
            yield request

    def _heartbeat_loop(self, watch: StreamWatch, interval: float) -> None:
        while not self._hb_stop.is_set() and not watch.done:
            call = self._stub.Heartbeat(
                self._heartbeat_requests(interval),
                metadata=self._s.metadata,
                timeout=3600.0,
            )
            self._hb_call = call
            try:
                for event in call:
                    action = watch.on_event(event)
                    if action == "stop":
                        return
                    if action == "reconnect":
                        break
            except grpc.RpcError as exc:
                if self._hb_stop.is_set() or not watch.on_error(exc):
                    return
            finally:
                call.cancel()
            delay = watch.next_backoff()
            if delay is None:
                return
            self._hb_stop.wait(delay)

    def _watchdog(self, watch: StreamWatch) -> None:
        """Reports silence the stream itself cannot: a blocked read on a dead
        route, or a reconnect waiting for a daemon that is gone."""
        while True:
            deadline = watch.deadline()
            wait = 0.5 if deadline is None else deadline - time.monotonic()
            if self._hb_stop.wait(min(0.5, max(0.01, wait))) or watch.done:
                return
            if deadline is not None and watch.expired():
                call = self._hb_call
                if call is not None:
                    call.cancel()  # ends the heartbeat thread's blocked read
                return

    def _stop_heartbeat(self) -> None:
        self._hb_stop.set()
        if self._hb_call is not None:
            self._hb_call.cancel()
        for attr in ("_hb_thread", "_hb_watchdog"):
            thread = getattr(self, attr)
            setattr(self, attr, None)
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=2.0)

    # -- lifetime -----------------------------------------------------------------

    def close(self) -> None:
        """Close without Leave: a joined worker closing this way counts as lost."""
        self._stop_heartbeat()
        self._closed = True
        self._channel.close()

    def __enter__(self) -> RendezvousClient:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        try:
            joined = self._s.joined is not None or self._s.node is not None
            if exc_type is None and joined and self._s.failure is None:
                self.leave()
        finally:
            self.close()
