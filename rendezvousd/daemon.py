"""Assembles and runs the daemon: gRPC server, auth, health, reflection, timers.

Start-up order matters: bind (fails fast when the port is taken), start, then
health SERVING and the ready callback. Shutdown is the reverse: health
NOT_SERVING at once, release parked calls, drain within the grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import gc
import inspect
import logging
import os
import socket
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.common.model import MemberState
from rendezvousd.common.open_files import Watch
from rendezvousd.common.version import installed_version
from rendezvousd.config import DaemonConfig
from rendezvousd.errors import ConfigError, DaemonError, RendezvousFault
from rendezvousd.server.auth import TokenAuthInterceptor, read_token_file
from rendezvousd.server.budget import handler_shape
from rendezvousd.server.call_stream import DRAIN_ANSWER_S
from rendezvousd.server.grpc_log import quiet_gone_clients
from rendezvousd.server.metrics import Metrics
from rendezvousd.server.servicer import SERVICE, RendezvousServicer
from rendezvousd.server.tls import ServerTls
from rendezvousd.state.machine import RendezvousState
from rendezvousd.state.over_limits import over_limits
from rendezvousd.storage.persistence import Persister
from rendezvousd.web.http_server import HttpServer
from rendezvousd.web.status_page import StatusPage
from rendezvousd.web.timeline import Timeline

log = logging.getLogger("rendezvousd")

# The largest answer is a Join with a whole member table (8192 members by default,
# ~0.5 MiB; 16 MiB leaves room for larger --max-members-per-job); requests stay small.
MAX_SEND_BYTES = 16 * 1024 * 1024
# A timer tick this late means the daemon itself did not run (``Daemon._tick``).
STALL_S = 0.25
#: A draining daemon's wait, once every call of its own returned, for their last
#: messages to reach the clients that are there to take them (milliseconds on a live
#: connection; seconds are margin for a loaded host); one that has not taken them by
#: then is frozen or cut off.
STOP_SETTLE_S = 2.0
ANSWERED_POLL_S = 0.01
# How often the daemon pings each connection (HTTP/2 keepalive).
KEEPALIVE_MS = 5_000
# How long a call may wait to be handed to its handler before gRPC core cancels it
# (its default: 30 s). Calls are handed over one at a time, in arrival order: in a
# per-rank join storm (4,096 clients, each a health check, a Calls stream and a
# heartbeat stream) the last ones waited longer than 30 s, and gRPC cancelled them
# (the Join failed with CANCELLED; with the default, 488 of 4,096 in one soak run).
# The queue's length is bounded by max_pending_requests, and a caller that gives up
# cancels its own call: the age bound only failed calls that were about to be served.
UNREQUESTED_S = 600
_MALFORMED = "request body is not a valid protobuf message for this method"


# The cyclic GC's young threshold in a serving daemon (CPython's default: 700);
# see ``serving_gc``.
GC_YOUNG_THRESHOLD = 10_000


def serving_gc() -> None:
    """The cyclic GC as a daemon process needs it, once started (``rendezvousd serve``
    calls this; an application embedding ``Daemon`` keeps its own settings).

    Why: almost all the daemon holds lives long, and CPython's full collections scan
    all of it every time: its start-up (modules, the server: ~45,000 objects), ~85
    objects per connection (grpc.aio's call and our call stream: tasks, coroutines,
    contexts), ~25 per parked join, three per member of a formed generation. At
    12,500 node agents that is 1.1 million objects connected, 1.5 million formed, and
    each full collection held the event loop ~1 s; with the default thresholds three
    fell inside forming 100,000 ranks: 2.6-3.4 s of that formation's 10-13 s of daemon
    CPU, ~0.25 ms per JoinNode (benchmarks/rendezvous_scale.py, docs/benchmarks.md).

    - Start-up's objects are frozen: no collection scans them again. They are never
      garbage (modules, classes, the server), so freezing them keeps nothing alive.
    - A young collection every GC_YOUNG_THRESHOLD net allocations instead of 700: the
      objects of a call in flight mostly die by reference count before one sees them;
      and a full collection is considered only every GC_YOUNG_THRESHOLD x 10 x 10 =
      1 million net allocations instead of 70,000 (CPython still runs it only once a
      quarter more objects survived since the last): forming 100,000 ranks
      allocates ~0.7 million, and 0 or 1 full collection fell inside it, not 3.

    Memory stays bounded: cyclic garbage is still collected, at most ~1 million net
    allocations later (``benchmarks/soak.py`` holds the daemon's RSS flat).

    Not higher: in a 10-minute node soak (512 agents x 8 workers) the 416 young
    collections at 10,000 (2.3 ms median, each freeing nothing: the calls in flight)
    and 34 middle ones (~9 ms) paused the daemon 1.4 s in all; at 50,000 only one ran,
    yet that sitting's p99 was no better (docs/benchmarks.md, "Young collections under
    steady load"). /metrics shows the collections (python_gc_*)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, 10, 10)


class DecodeGuardInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """A garbled request body is the caller's error: INVALID_ARGUMENT, not UNKNOWN.

    grpcio answers a body its deserializer cannot parse with UNKNOWN ("Unexpected
    DecodeError") and logs a traceback per call, which lets any token holder flood
    the log. Handlers are wrapped to take raw bytes and decode them here instead.
    """

    def __init__(self) -> None:
        # Known methods only (unknown ones have no handler): bounded.
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        cached = self._wrapped.get(details.method)
        if cached is None or cached[0] is not handler:
            cached = (handler, _decode_guarded(handler))
            self._wrapped[details.method] = cached
        return cached[1]


def _decode_guarded(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    decode = handler.request_deserializer
    inner, make = handler_shape(handler)

    class Stream:
        """Decodes a request stream; a garbled message ends it and marks it failed."""

        def __init__(self, raw: AsyncIterator[bytes]) -> None:
            self.raw, self.failed = raw, False

        async def messages(self) -> AsyncIterator[Any]:
            async for data in self.raw:
                try:
                    message = decode(data)
                except DecodeError:
                    self.failed = True
                    return
                yield message

    async def request_of(raw: Any, context: Any) -> Any:
        """The decoded request, or (request streaming) the stream that decodes them."""
        if handler.request_streaming:
            return Stream(raw)
        try:
            return decode(raw)
        except DecodeError:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _MALFORMED)

    def given(request: Any) -> Any:
        return request.messages() if isinstance(request, Stream) else request

    async def check(request: Any, context: Any) -> None:
        if isinstance(request, Stream) and request.failed:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _MALFORMED)

    if inspect.isasyncgenfunction(inner):

        async def generate(raw: Any, context: Any) -> AsyncIterator[Any]:
            request = await request_of(raw, context)
            async for item in inner(given(request), context):
                yield item
            await check(request, context)

        return make(generate, response_serializer=handler.response_serializer)

    # A unary answer, or a streamed one written with ``context.write``.
    async def call(raw: Any, context: Any) -> Any:
        request = await request_of(raw, context)
        result = await inner(given(request), context)
        await check(request, context)
        return result

    return make(call, response_serializer=handler.response_serializer)


#: sun_path's size less its terminating NUL (Linux).
_UNIX_PATH_MAX = 107


def _bind_problem(listen: str, metrics_port: int | None) -> str | None:
    """Why binding ``listen`` failed, where it can be told; None leaves gRPC's words
    (and the guess of another daemon). Each cause here had been reported as another
    rendezvousd using the address."""
    from rendezvousd.config import split_listen

    host, port = split_listen(listen)
    if host is None:
        return _unix_bind_problem(Path(listen.partition(":")[2]))
    if metrics_port is not None and port == metrics_port:
        return (
            f"port {port} is the one --metrics-listen took a moment before (this daemon's "
            "/metrics and status page): give --listen and --metrics-listen different ports"
        )
    try:
        family, kind, proto, _, where = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as probe:
            # As gRPC binds: a port left in TIME_WAIT is not in use.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(where)
    except OSError as exc:
        return _bind_errno_problem(exc, host, port)
    return None


def _bind_errno_problem(exc: OSError, host: str, port: int) -> str | None:
    """A failed TCP bind's cause in words, for ``--listen`` and ``--metrics-listen``
    alike; None for an errno without a known cause."""
    if exc.errno == errno.EADDRINUSE:
        return (
            f"port {port} is in use by another process (is another rendezvousd already "
            f"using it? `ss -ltnp 'sport = :{port}'` names it)"
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"{host} is not an address of this host: listen on one of its own"
    if exc.errno == errno.EACCES:
        # Below 1024 usually, but net.ipv4.ip_unprivileged_port_start or a security
        # policy (SELinux, AppArmor) can deny others: said as what it is (a review).
        return (
            f"this user may not listen on port {port} (a privileged port here, or "
            "denied by a security policy); use a higher port or check the policy"
        )
    return None


def _unix_bind_problem(path: Path) -> str | None:
    if len(os.fsencode(path)) > _UNIX_PATH_MAX:
        return f"a UNIX socket path is at most {_UNIX_PATH_MAX} bytes: give a shorter one"
    directory = path.parent
    try:
        info = directory.stat()
    except FileNotFoundError:
        return f"directory {directory} does not exist: create it first, or give another path"
    except OSError as exc:
        return f"cannot look at directory {directory}: {exc.strerror}"
    if not stat.S_ISDIR(info.st_mode):
        return f"{directory} is not a directory: give a path in a directory"
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        return f"cannot look at {path}: {exc.strerror}"
    if mode is not None and not stat.S_ISSOCK(mode):
        # gRPC removes only a stale socket before binding; anything else stays.
        return (
            f"{path} exists and is {_kind(mode)}, not a socket: move it aside, or give another path"
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"this user may not create files in {directory}: give a directory it may write"
    return None


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    return "another kind of file"


@dataclass
class Daemon:
    config: DaemonConfig
    tokens: list[str]
    on_ready: Callable[[int], None] | None = None
    on_stopping: Callable[[], None] | None = None
    state: RendezvousState = field(init=False)
    metrics: Metrics = field(init=False)
    timeline: Timeline = field(init=False)
    port: int = field(init=False, default=0)
    _server: grpc.aio.Server | None = field(init=False, default=None)
    _health: health_aio.HealthServicer | None = field(init=False, default=None)
    _ticker: asyncio.Task[None] | None = field(init=False, default=None)
    _metrics_server: HttpServer | None = field(init=False, default=None)
    metrics_port: int | None = field(init=False, default=None)
    _health_updates: set[asyncio.Future[None]] = field(init=False, default_factory=set)
    _ticker_died: bool = field(init=False, default=False)
    _auth: TokenAuthInterceptor | None = field(init=False, default=None)
    _tls: ServerTls | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.state = RendezvousState(self.config.limits(), self.config.timing())
        self.metrics = Metrics()
        self.metrics.set_limits(self.state.limits)
        self.timeline = Timeline()
        self.metrics.transition_listeners.append(self.timeline.record)
        self.open_files = Watch(self.config.max_connections)

    def _refused_token(self, method: str, host: str) -> None:
        """A call from ``host`` refused for its token: counted, and kept by the state
        machine, which words a member of that host silent since by it. On the servicer's
        clock (``time.monotonic``), as every ``now`` the state machine is given."""
        self.metrics.count_auth_refused(method)
        self.state.refused_token(host, time.monotonic())

    def reload(self) -> None:
        """SIGHUP (``systemctl reload``): the token file and the TLS files read again,
        each on its own: one that fails its checks keeps what it served."""
        if self.config.token_file is not None or self.config.tls_cert is None:
            self.reload_tokens()
        else:
            log.info(
                "SIGHUP: the token comes from $RENDEZVOUSD_TOKEN, which a running process "
                "cannot re-read: only the TLS files are read again"
            )
        if self._tls is not None:
            self._tls.reload()

    def reload_tokens(self) -> bool:
        """SIGHUP: read ``--token-file`` again, checked as at start-up, and accept its
        tokens from now on; an invalid file keeps the tokens accepted so far (a bad
        reload must not lock every client out) and says why at ERROR. Calls and streams
        are checked when they open: a stream opened before stays open (its token is not
        checked again). Never logs a token. True when the new set is in force."""
        path = self.config.token_file
        if path is None:
            log.error(
                "SIGHUP: the token comes from $RENDEZVOUSD_TOKEN, which a running process "
                "cannot re-read; nothing reloaded. Give the daemon --token-file FILE to "
                "rotate tokens without a restart"
            )
            return False
        try:
            tokens = read_token_file(path)
        except ConfigError as exc:
            log.error(
                "SIGHUP: token file not reloaded, still accepting the %d token(s) loaded "
                "before: %s; put the file back (or fix it) and send SIGHUP again",
                len(self.tokens),
                exc,
            )
            return False
        if self._auth is None:
            # Before start() built the interceptor: it is built from these.
            removed, first_changed = 0, False
        else:
            removed, first_changed = self._auth.replace_tokens(tokens)
        self.tokens = tokens
        log.info(
            "SIGHUP: token file %s reloaded: %d token(s) accepted, %d removed%s%s; calls "
            "and streams opened from now on are checked against them (open ones stay open)",
            path,
            len(tokens),
            removed,
            "; job tokens derived from a removed token are refused from now on" if removed else "",
            "; its first line changed: job tokens minted from now on derive from the new one"
            if first_changed
            else "",
        )
        return True

    def _options(self) -> list[tuple[str, int]]:
        limits, timing, c = self.state.limits, self.state.timing, self.config
        pending = min(limits.max_concurrent_rpcs, max(3000, limits.max_members_per_job + 1024))
        return [
            # A second daemon on the same port must fail, not share the port.
            ("grpc.so_reuseport", 0),
            ("grpc.max_receive_message_length", limits.request_bytes),
            ("grpc.max_send_message_length", MAX_SEND_BYTES),
            ("grpc.max_metadata_size", 16 * 1024),
            # Detect dead TCP peers (power loss, cable) under parked calls. gRPC also
            # makes the keepalive timeout the socket's TCP_USER_TIMEOUT: a connection
            # whose packets go unacknowledged that long is ended by the kernel. At 5 s
            # a cut cable ended a node's stream before the heartbeat timeout, and the
            # survivors heard "heartbeat stream closed", as for a process that died.
            # Past the timeout (plus one ping interval, as the first unacknowledged
            # packet may precede the last heartbeat), the tick names the silence first
            # ("no heartbeat for T s (node unreachable)"). Accept clients' pings as often.
            ("grpc.keepalive_time_ms", KEEPALIVE_MS),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_MS + round(timing.heartbeat_timeout_s * 1000)),
            ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_ping_strikes", 0),
            # gRPC core cancels calls that wait to be handed to the application
            # once more than 1000 are pending (3000 hard). A join storm of a whole
            # world is exactly that: allow one world (plus slack), no more, since
            # pending calls are queued before authentication.
            ("grpc.server.max_pending_requests", pending),
            ("grpc.server.max_pending_requests_hard_limit", pending),
            ("grpc.server_max_unrequested_time_in_server", UNREQUESTED_S),
            # Before any handler or token check: a connection's streams beyond the cap
            # are refused by gRPC core (RST_STREAM REFUSED_STREAM), so a client that
            # opens calls and never sends a body holds at most this many per
            # connection. gRPC core has no per-peer connection cap, only this total.
            ("grpc.max_concurrent_streams", c.max_concurrent_streams),
            ("grpc.max_allowed_incoming_connections", c.max_connections),
            # Idle means no call open: a member's heartbeat stream or a parked Join
            # keeps its connection, and an idle client's channel reconnects on its next
            # call. There is deliberately no grpc.max_connection_age_ms: ending a
            # connection ends its heartbeat streams, and the daemon takes a closed
            # stream as the member lost (the job FAILED) before the SDK's StreamWatch
            # could reattach; parked calls would end too.
            ("grpc.max_connection_idle_ms", round(c.connection_idle_s * 1000)),
        ]

    async def start(self) -> int:
        quiet_gone_clients()
        self.persister = Persister(self.config.state_dir, self.state)
        self.persister.on_health = self._storage_health
        self.persister.on_commit = self.metrics.observe_commit
        restoring = time.monotonic()
        restored = self.persister.restore()
        if self.config.state_dir is None:
            # What it forgot, it can say: a job's callers from before this start
            # hear that a restart forgot their run (``seats.forgotten``).
            self.state.stateless_since = time.time()
        if restored:
            down = self.persister.down_s
            log.info(
                "restored %d job(s) from %s%s",
                restored,
                self.config.state_dir,
                "" if down is None else f" (the daemon was down {down:.1f} s)",
            )
        # Restored as it was (a limit added by a release, or lowered since): said now,
        # not first at the call a limit refuses.
        for line in over_limits(self.state.jobs, self.state.limits):
            log.warning("%s", line)
        servicer = RendezvousServicer(
            self.state, self.metrics, self.persister, self.config.max_concurrent_streams
        )
        # The restored jobs' transitions: logged, and the job gauges set, before the
        # daemon serves (they waited for the first tick, and /metrics read no jobs).
        servicer.apply()
        interceptor = TokenAuthInterceptor(
            self.tokens,
            on_reject=lambda m: self.metrics.observe_rpc(
                m.rsplit("/", 1)[-1], "UNAUTHENTICATED", 0.0
            ),
            limits=self.state.limits,
            body_timeout_s=self.config.request_body_timeout_s,
            job_ended=self.persister.ended,
            on_refused=self._refused_token,
            observe=self.metrics.observe_rpc,
        )
        servicer.settings = frozenset(f.name for f in dataclasses.fields(self.config))
        for gate in (interceptor.calls, interceptor.health_checks, interceptor.health_watches):
            gate.on_refused = servicer.limit_refused
        # At once: a reload (SIGHUP) during the rest of start-up swaps its tokens.
        self._auth = interceptor
        server = grpc.aio.server(
            interceptors=[interceptor, DecodeGuardInterceptor()],
            options=self._options(),
            # No server-wide cap: gRPC's one pool is counted before authentication,
            # so token-less health streams could fill it and starve every call and
            # the health check itself. The interceptor caps each class instead
            # (max_concurrent_rpcs for authenticated calls); calls it refuses for a
            # bad token end at once, and pending calls stay bounded by the options.
            maximum_concurrent_rpcs=None,
        )
        server.add_generic_rpc_handlers((servicer.handler(),))
        self._health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        if self.config.reflection:
            reflection.enable_server_reflection(
                (
                    pb.DESCRIPTOR.services_by_name["Rendezvous"].full_name,
                    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                    reflection.SERVICE_NAME,
                ),
                server,
            )
        c = self.config
        if c.tls_cert is not None and c.tls_key is not None:
            self._tls = ServerTls(c.tls_cert, c.tls_key, c.tls_client_ca)
        credentials = None if self._tls is None else self._tls.credentials()
        if self.config.metrics_listen:
            await self._start_http(self.config.metrics_listen)
        try:
            if credentials is None:
                port: int = server.add_insecure_port(self.config.listen)
            else:
                port = server.add_secure_port(self.config.listen, credentials)
        except RuntimeError as exc:
            # gRPC says only "Failed to bind": look for the cause once it failed, so
            # nothing that would have worked is refused on a guess.
            why = _bind_problem(self.config.listen, self.metrics_port)
            raise DaemonError(
                f"cannot bind {self.config.listen}: "
                + (why or f"{exc}; is another rendezvousd already using it?")
            ) from exc
        await server.start()
        if restored:
            # The restore and the start-up after it are no restored member's silence:
            # its time to reattach (snapshot.REATTACH_S at least) counts from here.
            self.state.stalled(time.monotonic() - restoring)
        self._server = server
        self.port = port
        self._servicer = servicer
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self._health.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
        self.metrics.serving.set(1)
        self._ticker = asyncio.create_task(self._tick())
        self._ticker.add_done_callback(self._tick_ended)
        log.info(
            "rendezvousd %s serving on %s (port %d, tls=%s, event loop %s)",
            installed_version(),
            self.config.listen,
            port,
            credentials is not None,
            type(asyncio.get_running_loop()).__module__.partition(".")[0],
        )
        if self.on_ready is not None:
            self.on_ready(port)
        return self.port

    async def _start_http(self, listen: str) -> None:
        """/metrics and the status page, on the event loop (``http_server``)."""

        from rendezvousd.config import split_listen

        host, port = split_listen(listen)
        # With the daemon's certificate, /metrics and the page are served over TLS
        # too: only then may they listen beyond loopback without --insecure-metrics.
        context = None if self._tls is None else self._tls.http_context()
        assert self._auth is not None  # start() built it before serving HTTP
        page = StatusPage(
            self.state,
            self.metrics,
            self.timeline,
            self._auth.token_scope,
            self._abort_from_page,
            secure_cookie=context is not None,
            storage_failing_since=lambda: self.persister.failing_since,
        )
        server = HttpServer(page.handle, ssl_context=context)
        try:
            self.metrics_port = await server.start(host or "127.0.0.1", port)
        except OSError as exc:
            why = _bind_errno_problem(exc, host or "127.0.0.1", port)
            raise DaemonError(
                f"cannot serve metrics on --metrics-listen {listen}: "
                + (why or f"{exc.strerror}")
                + "; give --metrics-listen another address (port 0: any free one), or leave "
                "it out to serve no /metrics or status page"
            ) from exc
        self._metrics_server = server

    async def _abort_from_page(self, job_id: str, reason: str) -> int:
        """The status page's Abort button: AbortJob's own path, durable before it answers
        (AbortJob makes its change durable itself)."""
        self.persister.check(job_id)
        response = await self._servicer.AbortJob(
            pb.AbortJobRequest(job_id=job_id, reason=reason), None
        )
        return int(response.generation)

    async def _tick(self) -> None:
        interval = min(1.0, self.state.timing.heartbeat_timeout_s / 4)
        while True:
            slept = time.monotonic()  # after the tick's own work: only the sleep counts
            await asyncio.sleep(interval)
            now = time.monotonic()
            # Woken late: the daemon did not run meanwhile (SIGSTOP, a VM paused, CPU
            # starvation). Its members' beats are still queued; without this, this
            # tick would lose every one of them as silent. Not the tick's own commit
            # (a slow fsync, a locked database): the loop read beats meanwhile.
            late = now - slept - interval
            if late > STALL_S:
                self.state.stalled(late)
                if late > self.state.timing.heartbeat_timeout_s / 2:
                    log.warning(
                        "the daemon did not run for %.1f s (stopped, or starved of CPU): "
                        "that time is not counted as its members' silence",
                        late,
                    )
            self.state.tick(now)
            self.open_files.check(now)
            if self.persister.lock is not None:
                self.persister.lock.mark_alive()
            self._servicer.decided()
            self.metrics.observe_tick(self.state, now)
            if not self.persister.healthy:
                await self.persister.recover()
                continue
            with contextlib.suppress(RendezvousFault):  # logged; health says NOT_SERVING
                await self.persister.durable()

    def _tick_ended(self, task: asyncio.Task[None]) -> None:
        """The timer ends only when stop() cancels it. Dead otherwise, no member is
        ever marked lost, no job expires and storage is never retried, while health
        would go on saying SERVING: say it, and stop serving."""
        if task.cancelled():
            return
        exc = task.exception()
        self._ticker_died = True
        log.error(
            "the daemon's timer task died (%s); members are no longer marked lost and "
            "jobs no longer expire: health is NOT_SERVING until the daemon is restarted "
            "(with --state-dir its jobs survive the restart)",
            f"{type(exc).__name__}: {exc}" if exc is not None else "it returned",
            exc_info=exc,
        )
        self._storage_health(False)

    def _storage_health(self, healthy: bool) -> None:
        """Storage failing: NOT_SERVING (a probe can route traffic elsewhere) until
        a rewrite of the whole state succeeds again."""
        if self._health is None or self.state.draining:
            return
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if healthy and not self._ticker_died
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        self.metrics.serving.set(status == health_pb2.HealthCheckResponse.SERVING)
        for service in ("", SERVICE):
            task = asyncio.ensure_future(self._health.set(service, status))
            self._health_updates.add(task)
            task.add_done_callback(self._health_updates.discard)

    def parent_exited(self) -> None:
        """The process that started this daemon (rank 0 of its jobs) is gone.

        Its connections closed together with our stdin, in no set order. Closing
        rank 0's stream here, before the drain, gives survivors the same
        PEER_FAILED whichever the daemon noticed first, not DAEMON_DRAINING.
        """
        now = time.monotonic()
        for job in list(self.state.jobs.values()):
            member = job.gen.members.get(0)
            if member is not None:
                self.state.detach_stream(job.job_id, job.generation, 0, member.stream_token, now)
        self._servicer.decided()

    def has_active_members(self) -> bool:
        """Whether a member may still call or hear here: active, with its heartbeat
        stream open or never attached (it may yet call, and must find the daemon to be
        told why). One whose stream ended is gone: a failed generation's survivors stay
        active once they heard and closed theirs, and rank 0's daemon (the file
        transport's) waited its whole heartbeat timeout for them after every failure."""
        return any(
            m.state is MemberState.ACTIVE and (m.stream_open or m.stream_token == 0)
            for job in self.state.jobs.values()
            for m in job.gen.members.values()
        )

    async def _answered(self, deadline: float) -> None:
        """Until every call of ours has returned (or ``deadline``). gRPC's stop waits
        for more: for each client to take its calls' end, which a frozen one (SIGSTOP,
        a host cut off) never does. It held every SIGTERM restart for the whole grace,
        as long as the SDK's reconnect window, so the daemon's other jobs gave up on it.
        gRPC has no wait for the handlers alone; the calls gate counts them."""
        while self._auth is not None and self._auth.calls.active and time.monotonic() < deadline:
            await asyncio.sleep(ANSWERED_POLL_S)

    async def stop(self, grace: float | None = None) -> None:
        """Graceful: NOT_SERVING first, release waiters, then drain."""
        if self._server is None:
            return
        grace = self.config.drain_grace_s if grace is None else grace
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        self.metrics.serving.set(0)
        if self.on_stopping is not None:
            self.on_stopping()
        self.state.drain(time.monotonic())
        for job in self.state.jobs.values():
            # Every job's row: its state's age (and a running one's attendees' last
            # beats), which a restart goes on from whatever its wall clock reads.
            self.persister.touch(job.job_id)
        self._servicer.apply()
        # Within half a short grace, so that our streams' handlers end before gRPC's
        # stop cancels them (a traceback per stream in the log).
        self._servicer.drain(min(DRAIN_ANSWER_S, grace / 2))
        with contextlib.suppress(RendezvousFault):  # logged by the Persister
            await self.persister.durable()
        if self._ticker is not None and not self._ticker.done():  # a dead one was logged
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        deadline = time.monotonic() + grace
        await self._answered(deadline)
        await self._server.stop(max(0.0, min(deadline - time.monotonic(), STOP_SETTLE_S)))
        if self._metrics_server is not None:
            await self._metrics_server.stop()
        self._server = None
        self.persister.close()
        log.info("rendezvousd stopped")
