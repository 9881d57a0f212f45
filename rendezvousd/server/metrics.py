"""Prometheus metrics (prometheus-client), one private registry per daemon.

A private registry keeps several daemons in one process (tests, the launcher's
embedded daemon) from colliding in the global one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    Info,
    ProcessCollector,
)

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.common.limits import Limits
from rendezvousd.common.model import JobState, Transition
from rendezvousd.common.version import UNKNOWN, build_id, installed_version
from rendezvousd.errors import Reason
from rendezvousd.server.budget import handler_shape
from rendezvousd.state.rounds import idle
from rendezvousd.storage.store_sqlite import SCHEMA_VERSION

if TYPE_CHECKING:
    from rendezvousd.state.machine import RendezvousState

# Method labels come from the request path, which an unauthenticated caller
# chooses: only the methods the daemon serves become labels, so a flood of made-up
# paths cannot grow the registry (and the /metrics page) without bound.
_KNOWN_METHODS = frozenset(
    [
        *pb.DESCRIPTOR.services_by_name["Rendezvous"].methods_by_name,
        *health_pb2.DESCRIPTOR.services_by_name["Health"].methods_by_name,
        "ServerReflectionInfo",
    ]
)
_CODES = frozenset(code.name for code in grpc.StatusCode)
# grpc.aio's ``context.code()`` gives the code an abort set as the enum or its number.
_CODE_NAMES: dict[int, str] = {code.value[0]: code.name for code in grpc.StatusCode}
# The refusals a running generation makes of a joiner (``rounds.refused``): a bounded
# label, never the job or host.
REFUSALS = (Reason.TOPOLOGY_MISMATCH, Reason.VERSION_MISMATCH, Reason.JOIN_MODE_MISMATCH)
# The limits a refusal may name (``validation.limit_exceeded``'s first argument: a
# setting's name): a bounded label; any other name is counted as ``unknown``.
# The node joins one job may park for a later generation (standbys, scale-ups): a share
# of its own (``Limits.parked_joins_per_job``, half of max_waiters_per_job, no setting),
# refused under max_waiters_per_job's name, watched and counted under its own: counted
# as max_waiters_per_job's, the standbys used 0 of it until the refusal.
PARKED_JOINS = "parked_joins_per_job"
LIMIT_NAMES = frozenset(
    [*(f.name for f in dataclasses.fields(Limits)), "max_concurrent_streams", PARKED_JOINS]
)
# The limits an operator alerts on before they refuse (``rendezvousd_limit`` and
# ``rendezvousd_limit_used``): daemon-wide totals, and the per-job ones as the
# largest job's use. Their refusal series exist from start, at 0, as alerts need.
WATCHED_LIMITS = (
    "max_jobs",
    "max_waiters",
    "max_waiters_per_job",
    PARKED_JOINS,
    "max_kv_bytes",
    "max_kv_bytes_per_job",
)
# The method label of a bad token on the HTTP port (/api/*, the login form): not a
# gRPC method, so it is no rpc_duration label, only auth_refused's.
HTTP_METHOD = "http"
UNKNOWN_LABEL = "unknown"

# Up to --max-wait-s's bound (600 s): a Join or Barrier waits that long, and a top
# finite bucket of 60 s put every longer wait in +Inf, where no quantile reads it.
_LATENCY_BUCKETS = (
    *(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 60),
    *(120, 300, 600),
)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        # The daemon process as an operator sees it: its memory, CPU and descriptors
        # (process_*), and its cyclic GC's collections by generation (python_gc_*),
        # whose pauses hold every answer in flight (``daemon.serving_gc``).
        ProcessCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        # Every metric goes into this daemon's registry, never the global one.
        gauge = functools.partial(Gauge, registry=self.registry)
        counter = functools.partial(Counter, registry=self.registry)
        histogram = functools.partial(Histogram, registry=self.registry)
        self.jobs = gauge("rendezvousd_jobs", "Jobs by state", ["state"])
        self.members = gauge(
            "rendezvousd_members", "Members present in generations forming or running"
        )
        self.joins = counter("rendezvousd_joins", "Completed joins")
        self.failures = counter(
            "rendezvousd_failures_detected", "Generations failed by a lost member"
        )
        self.refused = counter(
            "rendezvousd_joins_refused",
            "Joins refused for another topology, version or join mode than their job's "
            "(a running generation's, or a forming one's version or join mode)",
            ["reason"],
        )
        # A rotation that removed a token its clients still send read as a network
        # fault (members lost as unreachable); counted apart, by method.
        self.auth_refused = counter(
            "rendezvousd_auth_refused",
            "Calls refused for their bearer token (UNAUTHENTICATED), by method; the "
            'status/metrics port\'s (/api, the login form) as method="http"',
            ["method"],
        )
        # RESOURCE_EXHAUSTED alone cannot tell a full daemon (max_jobs) from a job
        # over its key-value share: by the limit's setting name, a bounded set.
        self.limit_refused = counter(
            "rendezvousd_limit_refused",
            "Calls refused by a limit (RESOURCE_EXHAUSTED), by the limit's setting name",
            ["limit"],
        )
        self.limit = gauge(
            "rendezvousd_limit",
            "A limit's configured value (the per-job key-value bytes as enforced: at "
            "most half of max_kv_bytes)",
            ["limit"],
        )
        self.limit_used = gauge(
            "rendezvousd_limit_used",
            "What is held against a limit now: jobs, parked calls and key-value bytes "
            "daemon-wide; for a per-job limit, the largest job's",
            ["limit"],
        )
        self.rpc = histogram(
            "rendezvousd_rpc_duration_seconds",
            "RPC handling time including waiting",
            ["method", "code"],
            buckets=_LATENCY_BUCKETS,
        )
        self._rpc_children: dict[tuple[str, str], Histogram] = {}
        # What batching buys (gRPC's cost is per message): a node agent relaying its
        # workers' burst shows 8 or more; clients each on a stream of their own, 1.
        self.calls_per_message = histogram(
            "rendezvousd_calls_per_message",
            "Calls carried by each CallBatches message",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
        )
        self.streams = gauge("rendezvousd_heartbeat_streams", "Open heartbeat streams")
        self.waiters = gauge("rendezvousd_waiters", "Parked calls (join, barrier, kv wait)")
        self.standbys = gauge(
            "rendezvousd_standby_nodes", "Standby node agents parked beyond max_nodes"
        )
        self.commits = histogram(
            "rendezvousd_storage_commit_seconds",
            "State-database commits (--state-dir), by outcome; while storage is failing, "
            "each once-a-tick retry that rewrites the whole state is one",
            ["outcome"],
            buckets=_LATENCY_BUCKETS,
        )
        self.transitions = counter(
            "rendezvousd_job_transitions",
            "Jobs entering a state (forming, running, failed, aborted, ended)",
            ["state"],
        )
        # Every labelled series an alert keys on exists from start, at 0: increase()
        # sees no rise in a series' first sample, so one born at its first event (at 1)
        # would need one event more than the alert says (deploy/prometheus/alerts.yml).
        for outcome in ("ok", "failed"):
            self.commits.labels(outcome)
        for job_state in JobState:
            self.transitions.labels(job_state.name.lower())
            # And every state's gauge, at 0: a fresh daemon's panels read "no data".
            self.jobs.labels(job_state.name.lower()).set(0)
        for reason in REFUSALS:
            self.refused.labels(reason.lower())
        for method in ("Heartbeat", "CallBatches", "JoinNode", HTTP_METHOD):
            self.auth_refused.labels(method)  # what node agents call, and the HTTP port
        for name in WATCHED_LIMITS:
            self.limit_refused.labels(name)
            self.limit_used.labels(name).set(0)
        # Who else hears of each transition (the status page's generation timeline).
        self.transition_listeners: list[Callable[[Transition], None]] = []
        self.serving = gauge(
            "rendezvousd_serving", "1 while health says SERVING, 0 when NOT_SERVING"
        )
        # Which build runs, for a query across daemons (``count by (version)``) and a
        # dashboard's legend: every part two hosts may differ in that changes behaviour.
        Info(
            "rendezvousd_build",
            "The daemon's build: rendezvousd's version and build (commit), Python, grpcio "
            "and protobuf versions, the gRPC protocol package and the --state-dir schema "
            "it reads",
            registry=self.registry,
        ).info(build_labels())
        self.heartbeat_lag = gauge(
            "rendezvousd_heartbeat_age_max_seconds",
            "Largest time since an active member's last heartbeat",
        )

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        key = (method, code)
        child = self._rpc_children.get(key)
        if child is None:
            # labels() takes a lock and builds its key on every call: once per pair.
            child = self.rpc.labels(
                method if method in _KNOWN_METHODS else UNKNOWN_LABEL,
                code if code in _CODES else UNKNOWN_LABEL,
            )
            if method in _KNOWN_METHODS and code in _CODES:  # bounded: known pairs only
                self._rpc_children[key] = child
        child.observe(seconds)

    def count_auth_refused(self, method: str) -> None:
        known = method in _KNOWN_METHODS or method == HTTP_METHOD
        self.auth_refused.labels(method if known else UNKNOWN_LABEL).inc()

    def count_limit_refused(self, limit: str, share: str = "") -> None:
        """A refusal by ``limit`` (its fault's ``limit``), by the share of it that refused
        (its fault's ``share``): a parked node join's as ``parked_joins_per_job``."""
        if share == "parked_joins":
            limit = PARKED_JOINS
        self.limit_refused.labels(limit if limit in LIMIT_NAMES else UNKNOWN_LABEL).inc()

    def set_limits(self, limits: Limits) -> None:
        """The watched limits' configured values, set once (they change only by restart)."""
        for name in WATCHED_LIMITS:
            value = limits.kv_bytes_per_job if name == "max_kv_bytes_per_job" else None
            self.limit.labels(name).set(getattr(limits, name) if value is None else value)

    def observe_commit(self, seconds: float, ok: bool) -> None:
        self.commits.labels("ok" if ok else "failed").observe(seconds)

    def observe_transition(self, t: Transition) -> None:
        """``t`` told to its listeners (the timeline) at once; counted by
        ``count_transition``, once it is durable."""
        for listener in self.transition_listeners:
            listener(t)

    def count_transition(self, t: Transition) -> None:
        """``t`` counted: called once its change is committed (``Persister.when_durable``),
        so that one a failed commit undid is no event (it was counted, and
        RendezvousdJobsFailingRepeatedly saw failures that never stood)."""
        # A restored job is no event of this process: counted, a restart read as a
        # jump of every restored job's state (RendezvousdJobsFailingRepeatedly fired).
        # Nor is a job an undo put back to its durable state (``restored`` too).
        if t.new is not None and t.new is not t.old and not t.restored:
            self.transitions.labels(t.new.name.lower()).inc()
        if t.lost and not t.restored:
            # Where the state machine decided it, not where survivors are told: a
            # single-rank job, or one whose survivors had no stream, counts too.
            self.failures.inc()

    def observe_refused(self, reason: str) -> None:
        self.refused.labels(reason.lower() if reason in REFUSALS else UNKNOWN_LABEL).inc()

    def observe_jobs(self, state: RendezvousState) -> None:
        counts = dict.fromkeys(JobState, 0)
        for job in state.jobs.values():
            counts[job.state] += 1
        for job_state, n in counts.items():
            self.jobs.labels(job_state.name.lower()).set(n)
        self.members.set(state.live_members())

    def observe_tick(self, state: RendezvousState, now: float) -> None:
        """The gauges read from the whole state, once per tick (not per call): the
        heartbeat lag, the standbys parked, and the members present (members come and
        go without a transition: a member leaving a failed generation)."""
        # The state machine's own rule of whose silence counts (``liveness.watched``).
        self.heartbeat_lag.set(state.oldest_silence(now))
        self.members.set(state.live_members())
        # On the tick, not per call: a count over every job. One that falls to 0 says
        # a job used its spare (an operator may start another).
        self.standbys.set(sum(job.standby_count for job in state.jobs.values()))
        self.observe_limits_used(state)

    def observe_limits_used(self, state: RendezvousState) -> None:
        """What is held against each watched limit, counted as the state machine counts
        it when it admits (``rounds.make_room``: live jobs, a finished one gives its slot
        to a new job; ``calls.park``; ``kv.put``)."""
        used = self.limit_used
        used.labels("max_jobs").set(sum(1 for job in state.jobs.values() if not idle(job)))
        used.labels("max_waiters").set(state.waiter_count)
        calls = state.calls
        used.labels("max_waiters_per_job").set(
            max(map(calls.members_held, calls.per_job), default=0)
        )
        used.labels(PARKED_JOINS).set(max(calls.joins_per_job.values(), default=0))
        kv = [job.gen.kv_bytes for job in state.jobs.values()]
        used.labels("max_kv_bytes").set(sum(kv))
        used.labels("max_kv_bytes_per_job").set(max(kv, default=0))


def observed(
    handler: grpc.RpcMethodHandler, method: str, observe: Callable[[str, str, float], None]
) -> grpc.RpcMethodHandler:
    """``handler`` of the same shape, observed once when its call ends (``observe(method,
    code, seconds)``): a stream's whole life, never each of its messages (a heartbeat
    stream carries one beat a second per member). For the calls the servicer does not
    observe itself: the streams (Heartbeat, Calls, CallBatches), whose refusal (another
    job's token, a job that does not exist, a budget) was counted nowhere, and the
    health and reflection services."""
    kw = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    inner, make = handler_shape(handler)

    def report(context: Any, started: float, error: BaseException | None) -> None:
        observe(method, code_of(context, error), time.perf_counter() - started)

    if inspect.isasyncgenfunction(inner):

        async def stream_gen(request: Any, context: Any) -> AsyncIterator[Any]:
            started, error = time.perf_counter(), None
            try:
                # aclosing: the inner generator's own ``finally`` (a heartbeat stream's
                # detach) must run when this one is closed, not when it is collected.
                async with contextlib.aclosing(inner(request, context)) as items:
                    async for item in items:
                        yield item
            except BaseException as e:
                error = e
                raise
            finally:
                report(context, started, error)

        return make(stream_gen, **kw)

    async def call(request: Any, context: Any) -> Any:
        started, error = time.perf_counter(), None
        try:
            return await inner(request, context)
        except BaseException as e:
            error = e
            raise
        finally:
            report(context, started, error)

    return make(call, **kw)


def code_of(context: Any, error: BaseException | None) -> str:
    """The status a call ended with: the one its handler set (an abort), else what its
    exception makes of it (gRPC answers an uncaught one UNKNOWN), else OK."""
    code: object
    try:
        code = context.code()
    except Exception:  # a context without a call state
        code = None
    if isinstance(code, grpc.StatusCode):
        return str(code.name)
    if isinstance(code, int) and code:
        return _CODE_NAMES.get(code, UNKNOWN_LABEL)
    if isinstance(error, asyncio.CancelledError):
        return "CANCELLED"
    if error is not None and not isinstance(error, GeneratorExit):
        return "UNKNOWN"
    return "OK"


def build_labels() -> dict[str, str]:
    """``rendezvousd_build_info``'s labels (the status page's JSON says the same)."""
    import platform

    import google.protobuf

    return {
        "version": installed_version(),
        # The version's build part alone, to group by (``count by (build)``): two builds
        # of one release told apart (h139 F3); ``unknown`` from a wheel built without git.
        "build": build_id() or UNKNOWN,
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
        "protobuf": google.protobuf.__version__,
        "protocol": pb.DESCRIPTOR.package,
        "state_schema": str(SCHEMA_VERSION),
    }
