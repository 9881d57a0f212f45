"""The gRPC adapter: decode requests, ask the state machine, park or answer.

All decisions live in ``RendezvousState``; this module only turns its results
into wire messages, its ``Parked`` answers into awaited futures, and its
effects into woken futures, heartbeat-stream events and log lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

import grpc

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.common import validation
from rendezvousd.common.calls import SERVED_METADATA
from rendezvousd.common.escape import quoted
from rendezvousd.common.log_throttle import LogThrottle
from rendezvousd.common.model import (
    FORGOTTEN,
    AbortCause,
    Effect,
    JobState,
    JobView,
    JoinMode,
    Notify,
    Parked,
    Rejoin,
    Transition,
    Wake,
    Warn,
)
from rendezvousd.common.version import installed_version
from rendezvousd.errors import Code, Reason, RendezvousFault
from rendezvousd.server.answers import JoinAnswers, failed_member, member_message
from rendezvousd.server.auth import peer_host, peer_text
from rendezvousd.server.call_stream import (
    DAEMON_BUG,
    DRAIN_ANSWER_S,
    GIVEN_UP,
    CallStream,
    method_fields,
)
from rendezvousd.server.fault_status import to_grpc_status
from rendezvousd.server.methods import policy
from rendezvousd.server.metrics import LIMIT_NAMES, Metrics
from rendezvousd.server.scope import CALLER, Scope, allowed, denied
from rendezvousd.server.streams import HeartbeatStreams
from rendezvousd.state.machine import JoinArgs, RendezvousState
from rendezvousd.storage import snapshot
from rendezvousd.storage.faults import STORAGE_UNAVAILABLE, kept_goodbye, storage_unavailable
from rendezvousd.storage.persistence import Persister

log = logging.getLogger("rendezvousd")
# A limit's refusals, logged at most once a minute per limit: a client retrying into a
# full daemon repeats them thousands of times a minute.
LIMIT_LOG_S = 60.0
T = TypeVar("T")


class _KeyCall(Protocol):
    """What every key-value change request carries: the caller and the key."""

    job_id: str
    generation: int
    rank: int
    instance_id: str
    key: str


SERVICE = "rendezvous.v1.Rendezvous"
# Methods whose handlers return their answer already encoded (the joins' cached
# tables, the call streams' replies: ``call_stream.reply``).
_PRE_ENCODED = frozenset({"Join", "PublishId", "JoinNode", "GetJob", "Calls", "CallBatches"})
# GetJob of a big job is costly to build (~50-66 ms of the event loop at 8,192 members),
# and a token holder may ask for it in a loop, or many watchers at once (256 in one
# CallBatch took 13 s of the daemon's CPU): a job of at least BIG_JOB_MEMBERS members
# has its encoded answer reused for JOB_ANSWER_TTL_S (heartbeat ages that much old, as
# on the status page), and dropped at once by the job's next transition.
BIG_JOB_MEMBERS = 1024
JOB_ANSWER_TTL_S = 0.5


def _now() -> float:
    return time.monotonic()


def _connection(context: Any) -> str:
    """The gRPC peer a member's call came over, as the state machine matches it against
    the member's heartbeat stream (``seats.own_connection``): "" when unknown."""
    peer = peer_text(context)
    return "" if peer == "unknown" else peer


def _member_of(request: Any) -> tuple[str, int, int]:
    """Who a member's call comes from, as the state machine's methods take it first."""
    return request.job_id, request.generation, request.rank


class RendezvousServicer:
    def __init__(
        self,
        state: RendezvousState,
        metrics: Metrics,
        persister: Persister,
        calls_per_stream: int = 256,
    ) -> None:
        """``calls_per_stream``: calls one Calls stream may have in flight (the daemon
        passes max_concurrent_streams: what one connection may open as unary calls)."""
        self.state = state
        self.metrics = metrics
        self.persister = persister
        self.persister.on_undo = self._undone
        self._futures: dict[int, asyncio.Future[Any]] = {}
        # Changes whose callers gave up before they were durable (``_durably``).
        self._delivering: set[asyncio.Task[Any]] = set()
        self.streams = HeartbeatStreams(
            state, self.metrics, self.apply, _now, self._durably, self.decided
        )
        self._answers = JoinAnswers(state.timing)
        # job id -> (when made, GetJob's encoded answer): big jobs only (BIG_JOB_MEMBERS).
        self._job_answers: dict[str, tuple[float, bytes]] = {}
        # Set by drain(): heartbeat streams still waiting for their first beat end.
        self._draining = asyncio.Event()
        # The daemon's settings by name (``DaemonConfig``'s fields, set by the daemon):
        # a limit that is none is a fixed bound, whose refusal names no flag.
        self.settings: frozenset[str] = frozenset()
        # Keyed by limit name, a bounded set (an unknown one is one key).
        self._limits_said: LogThrottle[str] = LogThrottle(LIMIT_LOG_S, len(LIMIT_NAMES) + 1)
        self._calls = CallStream(
            {
                field: self._guard(method, getattr(self, method))
                for field, method in method_fields().items()
            },
            calls_per_stream,
            metrics.calls_per_message.observe,
        )

    # -- effects ----------------------------------------------------------

    def apply(self, effects: Sequence[Effect] | None = None) -> None:
        for effect in self.state.take_effects() if effects is None else effects:
            if isinstance(effect, Wake):
                future = self._futures.get(effect.waiter)
                if future is not None and not future.done():
                    if effect.fault is not None:
                        future.set_exception(effect.fault)
                    else:
                        future.set_result(effect.value)
            elif isinstance(effect, Notify):
                self.streams.push(effect)
            elif isinstance(effect, Warn):
                if effect.refused:
                    self.metrics.observe_refused(effect.refused)
                if effect.message:  # "": a refusal the job's rate limit held back
                    log.warning(
                        "job %s generation %d: %s", effect.job_id, effect.generation, effect.message
                    )
            elif isinstance(effect, Transition):
                # Forgotten at its TTL, or early for a new job's max_jobs slot.
                if effect.new is None and effect.detail.startswith(FORGOTTEN):
                    # Unix time, as job tokens carry their minting time, in the frame
                    # the snapshot keeps its times in (the wall clock read once at
                    # start-up, then the monotonic clock): the live wall clock, stepped
                    # ahead for a while, stamped an end in the future that refused every
                    # new token of the job id, restarts included, until real time
                    # caught up with it.
                    self.persister.job_ended(effect.job_id, snapshot.unix(time.monotonic()))
                self.persister.touch(effect.job_id)
                self._transition(effect)
        self.metrics.waiters.set(self.state.waiter_count)

    def _transition(self, t: Transition) -> None:
        old = t.old.name if t.old else "-"
        new = t.new.name if t.new else "GONE"
        # A scale-up's abort is planned, and a restored job no event of this process.
        level = logging.WARNING if t.failure and not t.restored else logging.INFO
        log.log(
            level, "job %s generation %d: %s -> %s (%s)", t.job_id, t.generation, old, new, t.detail
        )
        if t.new is None or t.new is not JobState.RUNNING:
            self._answers.forget(t.job_id, t.generation)
        self._job_answers.pop(t.job_id, None)
        self.metrics.observe_transition(t)
        self.persister.when_durable(functools.partial(self.metrics.count_transition, t))
        self.metrics.observe_jobs(self.state)

    def _undone(self, job_ids: set[str]) -> None:
        """A failed commit put ``job_ids`` back to their durable state: the calls parked on
        them wake (the state queued their faults) and undone members' streams end."""
        self.apply()
        for job_id in job_ids:
            self.streams.end_undone(
                job_id, storage_unavailable(job_id, waiting=True, cause=self.persister.cause)
            )

    def decided(self) -> None:
        """What the state decided on its own (a stream's end, the tick's silence, a node
        agent's cut, the daemon's parent gone): each job's wakes and events go out once
        its change is durable, as a call's do (``_durably``). A survivor told of a loss
        whose commit then failed stopped, and the undone generation then found it silent
        and blamed it. Transitions and warnings (logs, counts) go at once."""
        effects = self.state.take_effects()
        if self.persister.store is None or not self.persister.healthy:
            # While storage fails the state makes no loss (``liveness._pending``): what
            # it decides then is written by the recovery's rewrite of the whole state.
            self.apply(effects)
            return
        # A job's wakes follow its transition (``rounds._lose``: the state, the waiters,
        # then the event); those of no job's change go at once.
        by_job: dict[str, list[Effect]] = {}
        job_id = ""
        for effect in effects:
            if isinstance(effect, Transition | Notify | Warn):
                job_id = effect.job_id
            by_job.setdefault(job_id, []).append(effect)
        for job_id, made in by_job.items():
            told = any(isinstance(e, Wake | Notify) for e in made)
            changed = any(isinstance(e, Transition) for e in made)
            if job_id and told and (changed or not self.persister.is_settled(job_id)):
                task = asyncio.create_task(self._durably_quiet(job_id, made))
                self._delivering.add(task)
                task.add_done_callback(self._delivering.discard)
            else:
                # Nothing of this job to write (NODES_WAITING from the tick): told at
                # once, with no commit of its own.
                self.apply(made)

    async def _durably_quiet(self, job_id: str, effects: list[Effect]) -> None:
        """``_durably`` with no caller to answer: a failed commit is the Persister's to
        log, and the undo ends what it must."""
        with contextlib.suppress(RendezvousFault):
            await self._durably(job_id, effects)

    async def _durably(self, job_id: str, effects: list[Effect]) -> None:
        """A change to ``job_id`` with ``effects`` was just made: its wakes and events go
        out only once it is durable. When its commit fails (the Persister undid the
        change), the calls it woke get STORAGE_UNAVAILABLE instead, and no event is sent."""
        # Transitions are logs and counts (warnings are logs): they may go first, and so
        # precede an undo's.
        self.apply([e for e in effects if isinstance(e, Transition | Warn)])
        held = [e for e in effects if not isinstance(e, Transition | Warn)]
        self.persister.touch(job_id)
        try:
            fault = await self._deliver(job_id, held)
        except asyncio.CancelledError:
            # The caller gave up (its deadline, a cancel, its stream closed) during the
            # commit: the change stands and is committed all the same, so the calls it
            # woke and its events must still go out, or those calls hang and the
            # members never hear of it.
            task = asyncio.create_task(self._deliver(job_id, held))
            self._delivering.add(task)
            task.add_done_callback(self._delivering.discard)
            raise
        if fault is not None:
            raise fault

    async def _deliver(self, job_id: str, held: Sequence[Effect]) -> RendezvousFault | None:
        """``held`` applied once ``job_id``'s change is durable; or its commit's fault,
        which the calls it woke get instead."""
        try:
            await self.persister.durable(job_id)
        except RendezvousFault as fault:
            self.apply([Wake(e.waiter, None, fault) for e in held if isinstance(e, Wake)])
            return fault
        self.apply(held)
        return None

    # -- waiting ----------------------------------------------------------

    def _wait_s(self, wait_timeout_ms: int, context: Any) -> float:
        timing = self.state.timing
        timeout = min(wait_timeout_ms / 1000 or timing.default_wait_s, timing.max_wait_s)
        remaining = context.time_remaining()
        if remaining is not None:
            # Answer just before the caller's deadline, so it gets our message
            # naming the missing ranks rather than a bare DEADLINE_EXCEEDED.
            timeout = min(timeout, max(0.0, remaining - min(0.25, remaining * 0.1)))
        return timeout

    async def _settle(self, outcome: T | Parked, wait_timeout_ms: int, context: Any) -> Any:
        self.apply()
        if not isinstance(outcome, Parked):
            return outcome
        waiter = outcome.waiter
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._futures[waiter] = future
        # The deadline is a timer that settles the future, not wait_for(shield(...)):
        # it never cancels an answer already on its way, and a parked call costs one
        # timer handle, without wait_for's and shield's extra futures and callbacks
        # (~5 % of the daemon's CPU per JoinNode, py-spy, 2,048 agents forming).
        timer = loop.call_later(
            self._wait_s(wait_timeout_ms, context), self._deadline, waiter, future
        )
        try:
            return await future
        except asyncio.CancelledError as cancelled:
            # The caller went away (process death, dropped connection): the future
            # was cancelled with the call. Or it said it gave up (``GIVEN_UP``).
            given_up = GIVEN_UP in cancelled.args
            self.state.cancel_wait(waiter, _now(), timed_out=False, given_up=given_up)
            self.apply()
            raise
        finally:
            timer.cancel()
            self._futures.pop(waiter, None)

    def _deadline(self, waiter: int, future: asyncio.Future[Any]) -> None:
        """A parked call's wait ran out: it gets its fault (naming what was missing)."""
        if future.done():
            return
        fault = self.state.cancel_wait(waiter, _now(), timed_out=True)
        self.apply()
        # None: woken just before its deadline by a change whose wakes are held until
        # it is durable (``_durably``): the answer, or STORAGE_UNAVAILABLE, follows.
        if fault is not None and not future.done():
            future.set_exception(fault)

    # -- join ---------------------------------------------------------------

    async def Join(self, request: pb.JoinRequest, context: Any) -> bytes:
        """A worker's join: the thin form of JoinNode, one rank of its node."""
        args = JoinArgs.worker(
            job_id=request.job_id,
            num_nodes=request.topology.num_nodes,
            gpus_per_node=request.topology.gpus_per_node,
            node_rank=request.node_rank if request.HasField("node_rank") else None,
            local_rank=request.local_rank,
            host=request.host,
            address=request.address,
            unique_id=request.unique_id,
            instance_id=request.instance_id,
            wait_s=self._wait_s(request.wait_timeout_ms, context),
        )
        return await self._join(args, request.slim, context)

    async def JoinNode(self, request: pb.JoinNodeRequest, context: Any) -> bytes:
        args = JoinArgs(
            job_id=request.job_id,
            min_nodes=request.min_nodes,
            max_nodes=request.max_nodes,
            gpus_per_node=request.gpus_per_node,
            node_rank=request.node_rank if request.HasField("node_rank") else None,
            host=request.host,
            addresses=tuple(request.addresses),
            unique_id=request.unique_id,
            instance_id=request.instance_id,
            wait_s=self._wait_s(request.wait_timeout_ms, context),
            last_call_s=min(request.last_call_ms / 1000, self.state.timing.max_wait_s),
            standby=request.standby,
            previous=(
                request.previous_instance_id if request.HasField("previous_instance_id") else None
            ),
            launched_at=(
                _now() - request.launched_ms_ago / 1000
                if request.HasField("launched_ms_ago")
                else None
            ),
            wire_version=request.wire_version,
            agent=request.agent_id,
        )
        return await self._join(args, request.slim, context)

    async def _join(self, args: JoinArgs, slim: bool, context: Any) -> bytes:
        """The one join, answered in its joiner's shape once its generation formed (or
        its wait ended); a scale-up node whose wait ended with the running generation
        joins the next one."""
        deadline = _now() + args.wait_s
        while True:
            left_ms = max(1, int((deadline - _now()) * 1000))
            result = await self._settle(self.state.join(args, _now()), left_ms, context)
            if not isinstance(result, Rejoin):
                break
        if not result.id_required:  # completed by its PublishId, counted there
            self._count_join(args.job_id)
        return self._answers.join(result, slim=slim)

    def _count_join(self, job_id: str) -> None:
        """A completed join counted once its change is committed: one a failed commit
        undid (its caller got STORAGE_UNAVAILABLE) is none."""
        self.persister.touch(job_id)  # the change this join made: what the count waits for
        self.persister.when_durable(self.metrics.joins.inc)

    async def ReportFailure(
        self, request: pb.ReportFailureRequest, context: Any
    ) -> pb.ReportFailureResponse:
        self.state.report_failure(
            request.job_id,
            request.generation,
            request.node_rank,
            request.instance_id,
            request.local_rank,
            request.cause,
            _now(),
            witness=request.witness_rank if request.HasField("witness_rank") else None,
            connection=_connection(context),
        )
        await self._durably(request.job_id, self.state.take_effects())
        return pb.ReportFailureResponse()

    async def PublishId(self, request: pb.PublishIdRequest, context: Any) -> bytes:
        outcome = self.state.publish_id(
            *_member_of(request), request.instance_id, request.unique_id, _now()
        )
        result = await self._settle(outcome, request.wait_timeout_ms, context)
        self._count_join(request.job_id)  # rank 0's (node 0's) join, completed
        return self._answers.join(result, slim=request.slim)

    async def GetMembers(
        self, request: pb.GetMembersRequest, context: Any
    ) -> pb.GetMembersResponse:
        table = self.state.member_table(
            *_member_of(request), request.instance_id, connection=_connection(context)
        )
        if request.start_rank >= len(table):
            raise validation.invalid(
                Reason.RANK_OUT_OF_RANGE,
                f"start_rank={request.start_rank} is beyond job {request.job_id!r}'s world of "
                f"{len(table)} ranks",
                job_id=request.job_id,
            )
        running = self.state.jobs[request.job_id].state is JobState.RUNNING
        return self._answers.members(
            request.job_id,
            request.generation,
            table,
            request.start_rank,
            request.max_members,
            keep=running,  # an ended generation's table is not cached again
        )

    # -- barrier and key-value ---------------------------------------------

    async def _kv_change(
        self, request: _KeyCall, context: Any, change: Callable[..., T], *args: object
    ) -> T:
        """The state's key-value ``change`` for ``request``'s caller (over ``context``) and
        key, with ``args`` after the key; answered and seen by woken readers only once durable; on storage
        failure the Persister undoes it and readers get the fault too."""
        job_id, key = request.job_id, request.key
        self.persister.before_kv(job_id, key)
        result = change(
            job_id,
            request.generation,
            request.rank,
            key,
            *args,
            instance_id=request.instance_id,
            connection=_connection(context),
        )
        self.persister.touch(job_id, key)
        await self._durably(job_id, self.state.take_effects())
        return result

    async def Barrier(self, request: pb.BarrierRequest, context: Any) -> pb.BarrierResponse:
        outcome = self.state.barrier(
            *_member_of(request),
            request.name,
            request.sequence,
            _now(),
            instance_id=request.instance_id,
            connection=_connection(context),
        )
        sequence = await self._settle(outcome, request.wait_timeout_ms, context)
        return pb.BarrierResponse(sequence=sequence)

    async def KvSet(self, request: pb.KvSetRequest, context: Any) -> pb.KvSetResponse:
        await self._kv_change(request, context, self.state.kv_set, request.value)
        return pb.KvSetResponse()

    async def KvGet(self, request: pb.KvGetRequest, context: Any) -> pb.KvGetResponse:
        outcome = self.state.kv_get(
            *_member_of(request),
            request.key,
            request.wait,
            _now(),
            instance_id=request.instance_id,
            connection=_connection(context),
        )
        return pb.KvGetResponse(value=await self._settle(outcome, request.wait_timeout_ms, context))

    async def KvAdd(self, request: pb.KvAddRequest, context: Any) -> pb.KvAddResponse:
        value = await self._kv_change(request, context, self.state.kv_add, request.delta)
        return pb.KvAddResponse(value=value)

    async def KvCompareAndSet(
        self, request: pb.KvCompareAndSetRequest, context: Any
    ) -> pb.KvCompareAndSetResponse:
        expected = request.expected if request.HasField("expected") else None
        swapped, current = await self._kv_change(
            request, context, self.state.kv_compare_and_set, expected, request.desired
        )
        response = pb.KvCompareAndSetResponse(swapped=swapped)
        if current is not None:
            response.current = current
        return response

    async def KvDelete(self, request: pb.KvDeleteRequest, context: Any) -> pb.KvDeleteResponse:
        deleted = await self._kv_change(request, context, self.state.kv_delete)
        return pb.KvDeleteResponse(deleted=deleted)

    # -- liveness -------------------------------------------------------------

    async def Heartbeat(
        self, requests: AsyncIterator[pb.HeartbeatRequest], context: Any
    ) -> AsyncIterator[pb.JobEvent]:
        iterator = requests.__aiter__()
        first = await self._first_beat(iterator)
        if first is None:
            return
        _authorize("Heartbeat", first.job_id)
        connection = _connection(context)
        async for event in self.streams.serve(first, iterator, peer_host(connection), connection):
            yield event

    async def _first_beat(
        self, iterator: AsyncIterator[pb.HeartbeatRequest]
    ) -> pb.HeartbeatRequest | None:
        """A heartbeat stream's first beat; None when the stream ends first, or the
        daemon drains first. The SDK opens its stream ahead of the join (``connect()``,
        and a join answered DRAINING keeps it): such a stream, no member's yet, held a
        drain for its whole grace period (10 s by default). Its client opens another."""
        if self._draining.is_set():
            return None
        beat = asyncio.ensure_future(anext(iterator))
        drained = asyncio.ensure_future(self._draining.wait())
        try:
            await asyncio.wait((beat, drained), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the call cancelled meanwhile: no task of it left behind
            beat.cancel()
            raise
        finally:
            drained.cancel()
        if not beat.done():
            beat.cancel()
            return None
        try:
            return beat.result()
        except StopAsyncIteration:
            return None

    def drain(self, answer_s: float = DRAIN_ANSWER_S) -> None:
        """The daemon is stopping (its ``DAEMON_DRAINING`` events pushed): the Calls
        streams end once their calls are answered (read for ``answer_s`` more), and
        heartbeat streams now."""
        self._draining.set()
        self._calls.drain(answer_s)
        self.streams.end_all()

    async def Calls(self, calls: AsyncIterator[pb.Call], context: Any) -> AsyncIterator[bytes]:
        """Every unary method's calls on one stream (``call_stream``); each call is
        authorized, limited and answered as its unary form would be."""
        await context.send_initial_metadata((SERVED_METADATA,))
        async for reply in self._calls.serve(calls, context=context):
            yield reply

    async def CallBatches(
        self, batches: AsyncIterator[pb.CallBatch], context: Any
    ) -> AsyncIterator[bytes]:
        """``Calls`` with several calls (replies) per message (``call_stream``)."""
        await context.send_initial_metadata((SERVED_METADATA,))
        async for reply_batch in self._calls.serve(batches, batched=True, context=context):
            yield reply_batch

    async def Leave(self, request: pb.LeaveRequest, context: Any) -> pb.LeaveResponse:
        mode = JoinMode.of_caller(request.node)
        kept = False
        if request.given_up:  # a given-up join's seat: by its instance id alone
            self.state.leave_given_up(request.job_id, request.instance_id, _now(), mode=mode)
        else:
            kept = self.state.leave(
                *_member_of(request),
                request.instance_id,
                _now(),
                mode=mode,
                final=request.final,
                connection=_connection(context),
            )
        try:
            await self._durably(request.job_id, self.state.take_effects())
        except RendezvousFault as fault:
            if kept:
                raise kept_goodbye(fault, request.job_id) from None
            raise
        return pb.LeaveResponse()

    async def AbortJob(self, request: pb.AbortJobRequest, context: Any) -> pb.AbortJobResponse:
        generation = self.state.abort(
            request.job_id,
            request.generation,
            request.reason,
            _now(),
            close=request.close,
            cause=AbortCause.of(request.cause),
        )
        closed = request.close and self.state.jobs[request.job_id].closed is not None
        # Any holder of the job's token may abort it (documented); who did is said, as
        # the transition's words are the caller's own (h173: a forged "loopback
        # address" cause ended every node as a setup error, its sender logged nowhere).
        if context is not None:  # None: the status page's Abort, which says who itself
            scope = _caller()
            log.info(
                "job %s generation %d: %s by %s with %s",
                request.job_id,
                generation,
                "closed" if request.close else "aborted",
                peer_text(context),
                "the admin token" if scope.admin else f"a token of job {scope.job}",
            )
        await self._durably(request.job_id, self.state.take_effects())
        return pb.AbortJobResponse(generation=generation, closed=closed)

    # -- inspection -----------------------------------------------------------

    async def ListJobs(self, request: pb.ListJobsRequest, context: Any) -> pb.ListJobsResponse:
        scope = _caller()
        now = _now()
        # Summaries only (a view's member rows cost O(world)); a job token sees its job.
        if scope.job is None:
            views = list(self.state.views(now, with_members=False))
        elif scope.job in self.state.jobs:
            views = [self.state.view(scope.job, now, with_members=False)]
        else:
            views = []
        return pb.ListJobsResponse(
            jobs=[_summary(v) for v in views],
            daemon_version=installed_version(),
            storage_failing_since_ms=self._storage_failing_since_ms(),
        )

    async def GetJob(self, request: pb.GetJobRequest, context: Any) -> bytes:
        now = _now()
        made = self._job_answers.get(request.job_id)
        if made is not None and now - made[0] < JOB_ANSWER_TTL_S:
            return made[1]
        answer = self._job_answer(request.job_id, now)
        job = self.state.jobs.get(request.job_id)
        if job is not None and len(job.gen.members) >= BIG_JOB_MEMBERS:
            if len(self._job_answers) >= 16:  # bounded: the stale ones go
                self._job_answers = {
                    k: v for k, v in self._job_answers.items() if now - v[0] < JOB_ANSWER_TTL_S
                }
            self._job_answers[request.job_id] = (now, answer)
        return answer

    def _job_answer(self, job_id: str, now: float) -> bytes:
        view = self.state.view(job_id, now)
        return pb.GetJobResponse(
            summary=_summary(view),
            members=[
                pb.MemberStatus(
                    member=member_message(m.info),
                    state=pb.MemberState.ValueType(m.state.value),
                    heartbeat_age_ms=int(m.heartbeat_age_s * 1000),
                    heartbeat_stream_open=m.stream_open,
                    step=m.step,
                    loss_pending=m.loss_pending,
                )
                for m in view.members
            ],
            failed=[failed_member(f, now) for f in view.failed],
            id_published=view.id_published,
            kv_keys=view.kv_keys,
            abort_reason=view.abort_reason,
            restarts_used=view.restarts_used,
            restarts_left=view.restarts_left,
            heartbeat_timeout_ms=int(self.state.timing.heartbeat_timeout_s * 1000),
            nodes_waiting=view.nodes_waiting,
            standbys=view.standbys,
            seats_kept=view.seats_kept,
            seats_kept_ms=int(view.seats_kept_s * 1000),
            previous_run_ended_ms=(
                None if view.previous_run_ended_s is None else int(view.previous_run_ended_s * 1000)
            ),
            conflict=view.conflict,
            last_failure=_last_failure(view, now),
            failures=view.failures,
            joining=[
                pb.JoiningNode(
                    node_rank=n.node_rank,
                    host=n.host,
                    instance_tag=n.instance_tag,
                    joined_ms_ago=int(n.joined_s * 1000),
                )
                for n in view.joining
            ],
            missing_node_ranks=view.missing_node_ranks or (),
            nodes_needed=view.nodes_needed,
            min_nodes=view.min_nodes,
            daemon_version=installed_version(),
            storage_failing_since_ms=self._storage_failing_since_ms(),
        ).SerializeToString()

    def _storage_failing_since_ms(self) -> int:
        """Since when storage fails (0: it takes writes): `status` and the page say it,
        where a job's rows alone read as all well while every change is refused."""
        since = self.persister.failing_since
        return 0 if since is None else int(since * 1000)

    # -- registration ---------------------------------------------------------

    def handler(self) -> grpc.GenericRpcHandler:
        """Every method of the service, as its descriptor lists it, with one fault seam;
        the joins' answers come pre-encoded (``JoinAnswers``)."""
        handlers: dict[str, grpc.RpcMethodHandler] = {}
        for method in pb.DESCRIPTOR.services_by_name["Rendezvous"].methods:
            name, fn = method.name, getattr(self, method.name)
            codecs = {
                "request_deserializer": getattr(pb, method.input_type.name).FromString,
                "response_serializer": _raw if name in _PRE_ENCODED else _encode,
            }
            if not method.client_streaming:
                handlers[name] = grpc.unary_unary_rpc_method_handler(
                    self._guard(name, fn), **codecs
                )
            elif name in _PRE_ENCODED:  # Calls, CallBatches: each call on it is guarded
                handlers[name] = grpc.stream_stream_rpc_method_handler(fn, **codecs)
            else:  # Heartbeat
                handlers[name] = grpc.stream_stream_rpc_method_handler(
                    self._guard_stream(fn), **codecs
                )
        return grpc.method_handlers_generic_handler(SERVICE, handlers)

    def _guard(
        self, name: str, fn: Callable[[Any, Any], Awaitable[Any]]
    ) -> Callable[[Any, Any], Awaitable[Any]]:
        rule = policy(name)
        mutating = not rule.read_only

        async def call(request: Any, context: Any) -> Any:
            started = time.perf_counter()
            code = "OK"
            try:
                stale = self._stale_token()
                if stale is not None:
                    code = "UNAUTHENTICATED"
                    await context.abort(grpc.StatusCode.UNAUTHENTICATED, stale)
                if not rule.filtered:
                    _authorize(name, request.job_id)
                if mutating and not rule.goodbye:
                    self.persister.check(request.job_id)  # storage down: apply nothing
                response = await fn(request, context)
                if mutating:
                    if not rule.self_durable:
                        # Answer only once the change is on disk (group-committed).
                        self.persister.touch(request.job_id)
                        await self.persister.durable(request.job_id)
                elif not self.persister.is_settled(
                    job := getattr(request, "job_id", "") or None
                ) and not await self.persister.settled(job):
                    # What was read may have been a change whose commit then failed
                    # and was undone: read again, from what is durable.
                    response = await fn(request, context)
                return response
            except RendezvousFault as refused:
                fault = refused
                effects = self.state.take_effects()
                # A warning alone (a join a running generation refused) changed nothing:
                # a node crash-looping on the refusal must not make a commit each time.
                changed = any(not isinstance(e, Warn) for e in effects) or not (
                    self.persister.unchanged(request.job_id)
                )
                if mutating and changed and fault.reason != STORAGE_UNAVAILABLE:
                    # A refusal can still change state (a conflicting joiner fails the
                    # forming generation): told, like a change, only once durable.
                    try:
                        await self._durably(request.job_id, effects)
                    except RendezvousFault as storage:
                        fault = storage
                else:
                    self.apply(effects)
                if fault.reason is Reason.LIMIT_EXCEEDED:
                    self.limit_refused(fault, getattr(request, "job_id", ""))
                code = fault.code.value
                await context.abort_with_status(to_grpc_status(fault))
            except asyncio.CancelledError:
                code = "CANCELLED"
                raise
            except Exception:
                if code != "OK":
                    raise  # the stale token's abort: grpc.aio's abort is an Exception
                # A bug of ours: grpc.aio would answer UNKNOWN with the exception's own
                # text (maybe the request's fields) and the metric would say OK. Answer
                # as a call on a Calls stream is answered.
                code = "UNKNOWN"
                sent = getattr(request, "job_id", "")  # as sent: unchecked
                log.exception("%s of job %s failed", name, quoted(sent) if sent else "(none)")
                self.apply()  # what the handler changed before failing still wakes its waiters
                await context.abort(grpc.StatusCode.UNKNOWN, DAEMON_BUG)
            finally:
                self.metrics.observe_rpc(name, code, time.perf_counter() - started)

        return call

    def limit_refused(self, fault: RendezvousFault, job_id: str) -> None:
        """A call a limit refused: counted by the limit, and said at WARNING at most once
        a minute per limit (before, only rpc_duration's RESOURCE_EXHAUSTED count told,
        and not which limit: a full daemon looked like one job's oversized key)."""
        limit = fault.metadata.get("limit", "")
        self.metrics.count_limit_refused(limit, fault.metadata.get("share", ""))
        name = limit if limit in LIMIT_NAMES else "unknown"
        if (due := self._limits_said.due(name, time.monotonic())) is None:
            return
        flag = "--" + name.replace("_", "-")
        if name not in self.settings:
            raise_it = f" ({name} is a fixed bound, not a setting)"
        elif flag in fault.message:
            raise_it = ""
        else:
            raise_it = f"; if this load is expected, start the daemon with a larger {flag}"
        more = (
            f" ({due.skipped} more refused by {name} in the {due.since_s:.0f} s since the "
            "last line, not logged)"
            if due.skipped
            else ""
        )
        log.warning(
            "limit %s refused a call of job %s (RESOURCE_EXHAUSTED): %s%s%s",
            name,
            quoted(job_id) if job_id else "(none)",
            fault.message,
            raise_it,
            more,
        )

    def _stale_token(self) -> str | None:
        """Why the caller's job token no longer opens its job (it expired, or the job it
        was minted for ended since), as its unary call's refusal says; None while it
        does. The interceptor checked it when the call opened; a call on a Calls
        stream starts later, on a stream opened with the token maybe hours before."""
        scope = CALLER.get()
        token = None if scope is None else scope.token
        if token is None:
            return None
        return token.refusal(self.persister.ended(token.job), time.time())

    def _guard_stream(
        self, fn: Callable[[Any, Any], AsyncIterator[Any]]
    ) -> Callable[[Any, Any], AsyncIterator[Any]]:
        async def call(requests: Any, context: Any) -> AsyncIterator[Any]:
            try:
                async for item in fn(requests, context):
                    yield item
            except RendezvousFault as fault:
                self.apply()
                await context.abort_with_status(to_grpc_status(fault))

        return call


def _caller() -> Scope:
    scope = CALLER.get()
    if scope is None:
        # Only the auth interceptor sets it: without one, nothing is allowed, and the
        # caller's token is not to blame.
        raise RendezvousFault(
            Code.INTERNAL,
            Reason.SCOPE_DENIED,
            "the daemon ran a call without its auth interceptor's verdict (a daemon bug):"
            " refused; report it",
        )
    return scope


def _authorize(method: str, job_id: str) -> None:
    scope = _caller()
    if not allowed(scope, method, job_id):
        raise denied(scope, method, job_id)


def _raw(data: bytes) -> bytes:
    return data


def _encode(message: Any) -> bytes:
    data: bytes = message.SerializeToString()
    return data


def _last_failure(view: JobView, now: float) -> pb.JobFailure | None:
    failure = view.last_failure
    if failure is None:
        return None
    age_s = max(0.0, now - failure.at)
    return pb.JobFailure(
        generation=failure.generation,
        cause=failure.cause,
        age_ms=int(age_s * 1000),
        failed_unix_ms=int((time.time() - age_s) * 1000),
    )


def _summary(view: JobView) -> pb.JobSummary:
    return pb.JobSummary(
        job_id=view.job_id,
        state=pb.JobState.ValueType(view.state.value),
        generation=view.generation,
        topology=pb.Topology(num_nodes=view.num_nodes, gpus_per_node=view.gpus_per_node),
        world_size=view.world_size,
        members_present=view.members_present,
        state_age_ms=int(view.state_age_s * 1000),
    )
