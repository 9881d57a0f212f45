"""Calls and CallBatches: every unary method as messages on one stream, answered in
any order; CallBatches carries several calls (replies) per message.

Why it exists: grpcio's Python server spends ~0.5 ms of CPU on each unary call
(HTTP/2 stream, headers, the interceptors' token check, dispatch), about three times
what a message on an open stream costs (benchmarks/rpc_cost.py). gRPC has no
multiplexing of calls inside one stream, so this is ours. Each call runs through the
same guarded handler as its unary form (``RendezvousServicer._guard``): the same
authorization, durability, limits, metrics and faults; only the context differs.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import inspect
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, NoReturn

import grpc
from google.rpc import code_pb2, status_pb2

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.common import validation
from rendezvousd.common.calls import DRAINED_TRAILER, FIELDS, STATUS_TRAILER
from rendezvousd.errors import Code, Reason, RendezvousFault
from rendezvousd.server.fault_status import to_grpc_status
from rendezvousd.server.scope import STREAM_PEER

log = logging.getLogger("rendezvousd")
#: What a call that hit a bug of ours is answered, unary or on a stream (its log has the rest).
DAEMON_BUG = "the daemon failed to handle this call (its log has the traceback); report it"
Handler = Callable[[Any, Any], Awaitable[Any]]
_REPLY_FIELDS = {f.name: f.number for f in pb.Reply.DESCRIPTOR.fields}
_ERROR_FIELD = _REPLY_FIELDS["error"]
_CANCEL = "cancel"
# What a call's task is cancelled with when its caller sent ``cancel``: the caller is
# alive (a dead one's stream ends instead), so a parked join it gave up frees its seat
# as its deadline would, rather than fail the forming generation as a dead joiner's
# (``Servicer._settle``). Before, a blocking client's Ctrl-C, whose cancel reaches the
# daemon alone, moved a lone worker's job one generation on per retry, where the
# asyncio client's, sent with the retry in one batch, kept it (a twins scenario).
GIVEN_UP = "cancelled by its caller on the call stream"
# A ReplyBatch holds the replies ready while they fit in this many bytes (one larger
# reply goes alone): well under a client's default 4 MiB receive limit, and big enough
# that a burst of small replies (KvGet, Barrier: tens of bytes each) goes as one.
REPLY_BATCH_BYTES = 1 << 20
# Replies a stream may hold unsent before its reader stops reading calls: a count alone
# let a caller that reads none make the daemon hold 256 replies of any size (GetJob of
# an 8,192-member job: 155 KB each, 40 MB a stream, growing with every stream opened).
OUTBOX_BYTES = 2 * REPLY_BATCH_BYTES
# The stream's reader gives the event loop a turn once it has run calls inline this
# long while the loop did not go round: the calls of a batch are at hand, so reading
# them never waits, and 256 GetJobs of a big job in one 4 KB message held every other
# caller (health checks included) for 13 s.
INLINE_TURN_S = 0.005
# How long a stream's reader waits for a call it cancelled to end before it reads the
# next: a cancelled call ends in a turn of the loop (its parked wait released); this
# only bounds a handler that goes on after its cancellation.
CANCEL_SETTLE_S = 1.0


def method_fields() -> dict[str, str]:
    """Each Call field's method (``common.calls.FIELDS`` turned round)."""
    return {field: method for method, field in FIELDS.items()}


class _Ended(Exception):
    """A call on the stream ended with a status instead of an answer."""

    def __init__(self, status: bytes) -> None:
        super().__init__("call ended")
        self.status = status


def _status_bytes(code: grpc.StatusCode, message: str) -> bytes:
    status = status_pb2.Status(code=code_pb2.Code.Value(code.name), message=message)
    data: bytes = status.SerializeToString()
    return data


_UNKNOWN = _status_bytes(grpc.StatusCode.UNKNOWN, DAEMON_BUG)

#: How long a draining daemon goes on reading a stream's calls, answering each with
#: ``_DRAINING_NOT_RUN``: its client then half-closes the stream (as it does when its
#: heartbeat hears the drain), and most clients' calls never meet the stream's end.
#: Correctness does not rest on it: a client slower than this (load) writes calls
#: that are never read, and the stream's end says so (``DRAINED``, before the status,
#: which grpc.aio loses when a write races the end: "Internal error from Core").
DRAIN_ANSWER_S = 1.0


class CallContext:
    """What a guarded handler asks of its gRPC context, for one call on the stream:
    its remaining time, and ending it with a status (the Reply's ``error``)."""

    __slots__ = ("_deadline",)

    def __init__(self, deadline: float | None) -> None:
        self._deadline = deadline

    def peer(self) -> str:
        """The stream's caller, as a gRPC context says it (``STREAM_PEER``)."""
        return STREAM_PEER.get()

    def time_remaining(self) -> float | None:
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - time.monotonic())

    async def abort_with_status(self, status: grpc.Status) -> NoReturn:
        raise _Ended(_ended_bytes(status))

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        raise _Ended(_status_bytes(code, details))


# One byte each, looked up: tags, small lengths and call ids, 4 varints in each reply.
_ONE_BYTE = [bytes((v,)) for v in range(0x80)]


def _varint(value: int) -> bytes:
    """``value`` as a protobuf varint. The one- and two-byte cases (every tag, nearly
    every length) skip the loop: it was 6 % of the daemon's CPU serving streamed KvGets
    (py-spy, rpc_cost.py, session 34)."""
    if value < 0x80:
        return _ONE_BYTE[value]
    if value < 0x4000:
        return bytes((value & 0x7F | 0x80, value >> 7))
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def reply(call_id: int, field_number: int, body: bytes) -> bytes:
    """A Reply's bytes around an already-encoded response (or Status).

    Written by hand because the joins' answers are cached encoded (``JoinAnswers``):
    a Reply message would decode and copy them again for every joiner. The layout is
    protobuf's: field 1 (varint) the id, then the response as a length-delimited field.
    """
    head = b"\x08" + _varint(call_id) if call_id else b""
    return head + _varint(field_number << 3 | 2) + _varint(len(body)) + body


class _Outbox:
    """Encoded replies waiting to go out, and room for ``room`` of them, ``room_bytes``
    together: the reader reads the next call only while there is room, so a caller that
    stops reading its replies stops the reading of its calls (and HTTP/2 flow control
    then its sending) instead of growing the daemon's memory. ``put`` never waits: a
    parked call's reply may overshoot, by at most the calls in flight."""

    def __init__(self, room: int, room_bytes: int = OUTBOX_BYTES) -> None:
        self._items: collections.deque[bytes | None] = collections.deque()
        self._room = room
        self._room_bytes = room_bytes
        self._bytes = 0
        self._ready = asyncio.Event()
        self._space = asyncio.Event()
        self._space.set()

    def put(self, item: bytes | None) -> None:
        self._items.append(item)
        self._bytes += len(item or b"")
        self._ready.set()
        if len(self._items) >= self._room or self._bytes >= self._room_bytes:
            self._space.clear()

    async def take(self, most_bytes: int) -> tuple[list[bytes], bool]:
        """The replies ready, at least one, and more while they fit in ``most_bytes``
        together (0: one at a time); and whether the stream's end came after them."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        taken: list[bytes] = []
        size = 0
        ended = False
        while self._items:
            item = self._items[0]
            if item is not None and taken and size + len(item) > most_bytes:
                break
            self._items.popleft()
            if item is None:
                ended = True
                break
            taken.append(item)
            size += len(item)
        self._bytes -= size
        if len(self._items) < self._room and self._bytes < self._room_bytes:
            self._space.set()
        return taken, ended

    async def room(self) -> None:
        await self._space.wait()


class _Turns:
    """How long a stream's reader has run calls inline since the event loop last went
    round. A probe it schedules says when the loop did. A budget counted from the last
    forced turn alone forced turns on streams whose reader waits for each message
    anyway (benchmarks/rpc_cost.py, the SDK's stream: 3-6 us more daemon CPU per call
    than without turns, in runs alternating with it; with the probe, no difference)."""

    __slots__ = ("_inline_s", "_loop", "_round")

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._round = True
        self._inline_s = 0.0

    def _went_round(self) -> None:
        self._round = True

    def ran(self, seconds: float) -> bool:
        """Count a call run inline for ``seconds``; whether the loop needs a turn now."""
        if self._round:
            self._round, self._inline_s = False, 0.0
            self._loop.call_soon(self._went_round)
        self._inline_s += seconds
        return self._inline_s > INLINE_TURN_S


_CLOCK_RESOLUTION_S = time.get_clock_info("monotonic").resolution


class _Deadlines:
    """The deadlines of a stream's calls that went on as tasks, and one timer, for the
    earliest: a call past its deadline is answered DEADLINE_EXCEEDED and cancelled, as
    gRPC ends a unary call whose deadline passed. A wait is answered before (``_wait_s``,
    naming what is missing); this ends what the handler does not bound itself (a
    commit the storage holds up).

    One timer a stream, not one a call: a timer each (its handle, and a done-callback
    to cancel it) was ~6 % of the daemon's samples in the node soak (py-spy, session
    34), for calls that nearly all end long before their deadline. A stream's calls
    mostly share their timeout and come in order, so a new deadline seldom comes before
    the armed one and the timer is seldom moved."""

    __slots__ = ("_at", "_due", "_loop", "_replies", "_running", "_timer")

    def __init__(self, running: dict[int, asyncio.Task[None]], replies: _Outbox) -> None:
        self._loop = asyncio.get_running_loop()
        self._running = running
        self._replies = replies
        # call id -> (its deadline on the loop's clock, its timeout_ms, its field)
        self._due: dict[int, tuple[float, int, str]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._at = math.inf

    def add(self, call_id: int, timeout_ms: int, field: str) -> None:
        when = self._loop.time() + timeout_ms / 1000
        self._due[call_id] = (when, timeout_ms, field)
        if when < self._at:
            self._arm(when)

    def discard(self, call_id: int) -> None:
        """The call ended (its reply is out: it is put just before its task ends)."""
        self._due.pop(call_id, None)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _arm(self, when: float) -> None:
        self.close()
        self._at = when
        self._timer = self._loop.call_at(when, self._expire)

    def _expire(self) -> None:
        self._timer, self._at = None, math.inf
        # The loop runs a timer up to its clock's resolution early: within it is due.
        now = self._loop.time() + _CLOCK_RESOLUTION_S
        for call_id, (when, timeout_ms, field) in list(self._due.items()):
            if when > now:
                continue
            del self._due[call_id]
            task = self._running.get(call_id)
            if task is None or task.done():
                continue
            message = (
                f"call {call_id} ({field}) was not answered within its timeout_ms="
                f"{timeout_ms}; the daemon may still complete it, as a unary call's"
            )
            status = _status_bytes(grpc.StatusCode.DEADLINE_EXCEEDED, message)
            self._replies.put(reply(call_id, _ERROR_FIELD, status))
            task.cancel()
        if self._due:
            self._arm(min(when for when, _ms, _field in self._due.values()))


class CallStream:
    """Serves one Calls stream: a call that waits goes on as a task of its own (one
    that does not is answered inline, ``_start``), so a parked Barrier never holds up
    the calls behind it; replies leave in the order they finish."""

    def __init__(
        self,
        handlers: dict[str, Handler],
        max_in_flight: int,
        on_batch: Callable[[int], None] = lambda _calls: None,
    ) -> None:
        """``handlers``: the guarded unary handler of each Call field; at most
        ``max_in_flight`` calls of one stream run at once (what one connection may
        have open as unary calls: max_concurrent_streams); ``on_batch``: told the
        number of calls in each CallBatch."""
        self._handlers = handlers
        self._max_in_flight = max_in_flight
        self._on_batch = on_batch
        self._readers: set[asyncio.Task[None]] = set()
        self._draining = False
        self._reading_stopped = False

    async def serve(
        self, calls: AsyncIterator[Any], batched: bool = False, context: Any = None
    ) -> AsyncIterator[bytes]:
        """One stream's replies, encoded, for ``calls``: ``Call`` messages answered by
        ``Reply`` messages (``Calls``), or, when ``batched`` (``CallBatches``),
        ``CallBatch`` messages answered by ``ReplyBatch`` messages of every reply
        ready when the stream writes next. A stream that ends as the daemon drains
        says so (``DRAINED``): in its last ReplyBatch (``_DRAINED_BATCH``) and in a
        trailer set on ``context``, the stream's gRPC context (None: not said there)."""
        replies = _Outbox(self._max_in_flight)
        running: dict[int, asyncio.Task[None]] = {}
        deadlines = _Deadlines(running, replies)
        source = _Unbatched(calls, self._on_batch) if batched else calls
        if context is not None:
            with contextlib.suppress(Exception):  # a context without a transport (a test's)
                # Before the reader: its calls' tasks inherit it (``CallContext.peer``).
                STREAM_PEER.set(str(context.peer()))
        reader = asyncio.create_task(self._read(source, replies, running, deadlines))
        self._readers.add(reader)
        try:
            while True:
                answers, ended = await replies.take(REPLY_BATCH_BYTES if batched else 0)
                if answers:
                    yield b"".join(map(_batch_entry, answers)) if batched else answers[0]
                if ended:
                    break
            await reader  # its error, if any, ends the stream
            # Read to its end, every call read answered, and the daemon drains: no
            # call of this stream is read from now on (``_take`` runs none).
            drained = self._draining
        finally:
            self._readers.discard(reader)
            # The caller went away (or the stream failed): its calls are cancelled,
            # as a unary call's handler is when its caller goes.
            reader.cancel()
            for task in running.values():
                task.cancel()
            deadlines.close()
        if drained:
            # Said in the stream, before its status: a client can lose the status
            # (grpc.aio replaces it when one of its writes races the end), not this.
            if batched:
                yield _DRAINED_BATCH
            if context is not None:
                # The status stays OK: a client from before this trailer reads an OK
                # end after rendezvous-stream-served as "not run" already, and a failed
                # one (UNAVAILABLE) as a broken connection, which the daemon's refusal
                # of its next stream then could not follow.
                context.set_trailing_metadata(((DRAINED_TRAILER, _DRAINED_STATUS),))

    def drain(self, answer_s: float = DRAIN_ANSWER_S) -> None:
        """The daemon is stopping (its parked calls were just released): every stream
        runs no more calls, answering those it reads ``_DRAINING_NOT_RUN`` for
        ``answer_s`` (its client half-closes on that answer), answers those in
        flight and ends; then streams a client keeps open stop being read, so a
        graceful stop need not wait out its grace period for them. Each ends saying
        that it was drained (``DRAINED``): a call it did not answer was not read."""
        self._draining = True
        asyncio.get_running_loop().call_later(answer_s, self._stop_reading)

    def _stop_reading(self) -> None:
        self._reading_stopped = True
        for reader in self._readers:
            reader.cancel()

    async def _read(
        self,
        calls: AsyncIterator[pb.Call],
        replies: _Outbox,
        running: dict[int, asyncio.Task[None]],
        deadlines: _Deadlines,
    ) -> None:
        retry_of = calls.retry_of if isinstance(calls, _Unbatched) else _no_retry
        calls = aiter(calls)
        turns = _Turns()
        # The running joins' identities (``_join_key``), by call id.
        joins: dict[int, tuple[str, str, str]] = {}
        # Cancels held for a retry later in their batch (``_Unbatched.retry_of``): by
        # the retry Call's id(), the retry (kept alive, so that id() stays its) and the
        # tasks to cancel once it ran, by call id (a repeated cancel is one entry).
        held: dict[int, tuple[pb.Call, dict[int, asyncio.Task[None]]]] = {}
        try:
            while not self._reading_stopped:
                # Room first: a drain's cancellation then never lands between a call's
                # arrival and its start.
                await replies.room()
                try:
                    call = await anext(calls)
                except StopAsyncIteration:
                    break
                released = held.pop(id(call), None)
                try:
                    await self._take(
                        call, replies, running, deadlines, turns, retry_of, joins, held
                    )
                finally:
                    if released is not None:
                        # The retry parked (or was answered) first: the cancelled join
                        # ends with its seat held by the retry, not as a dead joiner.
                        for task in released[1].values():
                            await _cancel(task)
        except asyncio.CancelledError:
            if not self._reading_stopped:
                raise
        finally:
            for _retry, tasks in held.values():
                for task in tasks.values():
                    task.cancel()
        try:
            # The caller is done sending (or the daemon drains): its calls in flight
            # are still answered, a drain that comes meanwhile included (it released
            # them with their answers; cancelled, they would go unanswered).
            while running:
                try:
                    await asyncio.wait(list(running.values()))
                except asyncio.CancelledError:
                    if not self._draining:
                        raise
        finally:
            replies.put(None)

    async def _take(
        self,
        call: pb.Call,
        replies: _Outbox,
        running: dict[int, asyncio.Task[None]],
        deadlines: _Deadlines,
        turns: _Turns,
        retry_of: Callable[[tuple[str, str, str] | None], pb.Call | None],
        joins: dict[int, tuple[str, str, str]],
        held: dict[int, tuple[pb.Call, dict[int, asyncio.Task[None]]]],
    ) -> None:
        """Run, refuse or (a cancel) apply one call read from the stream."""
        field = call.WhichOneof("request")
        if field == _CANCEL:
            task = running.get(call.id)
            if task is None or task.done():
                return
            # O(1), not a search of the batch's rest: a held cancel leaves its join
            # running, so each repeat of it searched again, and one 63 KB batch of a
            # join, 9,000 cancels of it and its retry held the event loop (every job's
            # calls) for 7-11 s.
            retry = retry_of(joins.get(call.id))
            if retry is not None:
                # The client gave up on this join and sent it again (same identity: a
                # resume, client/_session.py) in this batch: the retry parks first, so
                # that the cancelled join's end finds its seat's retry waiting and
                # fails nobody (state.joins.join_wait_ended). Cancelled first, it
                # failed the forming generation as a dead joiner's.
                held.setdefault(id(retry), (retry, {}))[1][call.id] = task
                return
            await _cancel(task)
            # Its end before the next call is decided: a cancelled Join frees its seat
            # as it ends, and a client's re-join under a new identity, often in this
            # same batch, was refused DuplicateRank by its own cancelled seat. One turn or two of the loop; bounded, for a
            # handler that outlives its cancel.
            await asyncio.wait((task,), timeout=CANCEL_SETTLE_S)
            return
        if self._draining:
            replies.put(reply(call.id, _ERROR_FIELD, _DRAINING_NOT_RUN))
            return
        refusal = self._refusal(call, field, running)
        if refusal is not None:
            replies.put(reply(call.id, _ERROR_FIELD, refusal))
            return
        assert field is not None  # _refusal answered an empty Call
        deadline = time.monotonic() + call.timeout_ms / 1000 if call.timeout_ms else None
        coro = self._run(call.id, field, getattr(call, field), deadline, replies)
        started = time.monotonic()
        waiting_on = _resume(coro, None, call.id, replies)
        if waiting_on is _DONE:
            if turns.ran(time.monotonic() - started):
                await asyncio.sleep(0)
            return
        task = asyncio.create_task(_finish(coro, waiting_on, call.id, replies))
        running[call.id] = task
        task.add_done_callback(functools.partial(_forget, running, deadlines, call.id))
        if call.timeout_ms:
            deadlines.add(call.id, call.timeout_ms, field)
        key = _join_key(call, field)
        if key is not None:
            joins[call.id] = key
            task.add_done_callback(functools.partial(_forget_join, joins, call.id))

    def _refusal(
        self, call: pb.Call, field: str | None, running: dict[int, asyncio.Task[None]]
    ) -> bytes | None:
        """Why ``call`` is not run (an encoded Status), or None."""
        if field is None:
            return _status_bytes(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"call {call.id} sets no request field; set exactly one (e.g. kv_get)",
            )
        if call.id in running:
            return _status_bytes(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"call id {call.id} is already in flight on this stream; use a new id per call",
            )
        if len(running) >= self._max_in_flight:
            fault = validation.limit_exceeded(
                "max_concurrent_streams",
                f"this Calls stream already has max_concurrent_streams={self._max_in_flight} "
                "calls in flight; wait for one to end, or open another stream",
            )
            return _ended_bytes(to_grpc_status(fault))
        return None

    async def _run(
        self,
        call_id: int,
        field: str,
        request: Any,
        deadline: float | None,
        replies: _Outbox,
    ) -> None:
        try:
            answer = await self._handlers[field](request, CallContext(deadline))
        except _Ended as ended:
            replies.put(reply(call_id, _ERROR_FIELD, ended.status))
            return
        except asyncio.CancelledError:
            return  # cancelled by the caller or the stream's end: no reply
        except Exception:
            # A bug of ours: gRPC would answer a unary call UNKNOWN and log it; so do we,
            # rather than leave the caller waiting for its deadline.
            log.exception("Calls: %s (call %d) failed", field, call_id)
            replies.put(reply(call_id, _ERROR_FIELD, _UNKNOWN))
            return
        body = answer if isinstance(answer, bytes) else answer.SerializeToString()
        replies.put(reply(call_id, _REPLY_FIELDS[field], body))


# Calls that never wait (a KvGet of a present key, a KvSet without a state dir) run to
# their answer inline in the stream's reader; only one that waits becomes a task.
# Measured with benchmarks/rpc_cost.py's KvGet, 32 in flight on one stream: a task per
# call cost the daemon ~470 us of CPU per call, inline ~320 us (the task's extra loop
# iterations, each with its epoll poll). It is asyncio's eager task start (3.12's
# eager_task_factory), written out because the floor is Python 3.11.
_DONE = object()


def _resume(
    coro: Coroutine[Any, Any, None], error: BaseException | None, call_id: int, replies: _Outbox
) -> Any:
    """Run ``coro`` (a call's ``_run``), sent None or thrown ``error``, until it waits
    next: what it waits on, or ``_DONE`` once it ended. ``_run`` answers what its
    handler raises; what escapes it (a BaseException that is not an Exception) is
    logged and answered UNKNOWN here, as ``_run`` does, rather than end the stream (on
    the reader) or leave the caller to its deadline (in a task)."""
    try:
        return coro.send(None) if error is None else coro.throw(error)
    except StopIteration:
        return _DONE
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:
        log.exception("Calls: call %d failed", call_id)
        replies.put(reply(call_id, _ERROR_FIELD, _UNKNOWN))
        return _DONE


async def _finish(
    coro: Coroutine[Any, Any, None], waiting_on: Any, call_id: int, replies: _Outbox
) -> None:
    """Go on with ``coro``, run by ``_resume`` and now waiting on ``waiting_on``, as a
    Task would: resume it once what it awaits is done; a cancellation cancels what it
    awaits, so the coroutine sees its await cancelled."""
    while True:
        error: BaseException | None = None
        if waiting_on is None:  # a bare yield (asyncio.sleep(0))
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError as cancelled:
                error = cancelled
        elif not getattr(waiting_on, "_asyncio_future_blocking", False):
            # What a Task throws in for a yield of anything but a future.
            error = RuntimeError(f"call {call_id} awaited {waiting_on!r}, not a future")
        else:
            waiting_on._asyncio_future_blocking = False
            # Awaited bare: asyncio.wait's waiter and set per call were ~4 % of the
            # daemon's samples in the node soak (py-spy, session 34). Its outcome (a
            # result, an error) is the coroutine's to read as it resumes.
            with contextlib.suppress(BaseException):
                try:
                    await waiting_on
                except asyncio.CancelledError:
                    # Cancelled with this task (a Task cancels what it awaits), which
                    # the coroutine reads as it resumes; or this task was cancelled
                    # after it ended, before the coroutine resumed (the call's deadline
                    # passed in between and answered it DEADLINE_EXCEEDED): thrown in,
                    # so that the call is not answered twice.
                    if not waiting_on.cancelled():
                        error = asyncio.CancelledError()
        waiting_on = _resume(coro, error, call_id, replies)
        if waiting_on is _DONE:
            return


class _Unbatched:
    """A CallBatches stream's calls, one by one, as a Calls stream has them: the rest
    of a batch is at hand (``rest``), so reading it never waits on the connection."""

    def __init__(
        self, batches: AsyncIterator[pb.CallBatch], on_batch: Callable[[int], None]
    ) -> None:
        self._batches = aiter(batches)
        self._on_batch = on_batch
        self.rest: collections.deque[pb.Call] = collections.deque()
        # The position in its batch of ``rest``'s first call.
        self._read = 0
        # The joins of the batch being read, by identity (``_join_key``): each with
        # its position in the batch, in order. Built at the batch's first cancel of a
        # running join (most batches have none), once: each cancel then finds its
        # retry without searching the batch again.
        self._joins: dict[tuple[str, str, str], collections.deque[tuple[int, pb.Call]]] | None
        self._joins = None

    def __aiter__(self) -> _Unbatched:
        return self

    async def __anext__(self) -> pb.Call:
        while not self.rest:
            batch = await anext(self._batches)
            self._on_batch(len(batch.calls))
            self.rest.extend(batch.calls)
            self._read = 0
            self._joins = None
        self._read += 1
        return self.rest.popleft()

    def retry_of(self, key: tuple[str, str, str] | None) -> pb.Call | None:
        """The first call of its batch not read yet that is a retry of the join ``key``
        names (the same identity), if any. Amortized O(1) a call: the batch's joins are
        indexed once, and each entry is passed over at most once."""
        if key is None or not self.rest:
            return None
        if self._joins is None:
            self._joins = {}
            for position, call in enumerate(self.rest, self._read):
                field = call.WhichOneof("request")
                found = _join_key(call, field) if field is not None else None
                if found is not None:
                    self._joins.setdefault(found, collections.deque()).append((position, call))
        retries = self._joins.get(key)
        while retries and retries[0][0] < self._read:
            retries.popleft()  # read already
        return retries[0][1] if retries else None


def _no_retry(_key: tuple[str, str, str] | None) -> pb.Call | None:
    """A Calls stream's: its calls come one a message, so none is at hand to be a retry."""
    return None


_JOINS = ("join", "join_node")


def _join_key(call: pb.Call, field: str) -> tuple[str, str, str] | None:
    """A Join's (JoinNode's) identity: what a retry of it sends the same."""
    if field not in _JOINS:
        return None
    request = getattr(call, field)
    if not request.instance_id:
        return None
    return (field, request.job_id, request.instance_id)


async def _cancel(task: asyncio.Task[None]) -> None:
    """Cancel a call's task as its caller's ``cancel`` (``GIVEN_UP``), once it started.

    A task cancelled before its first step never runs ``_finish``, so its handler,
    suspended where ``_resume`` left it, never saw the cancellation (closed later,
    ``GeneratorExit``): a Join cancelled in its own batch kept its seat parked, and a
    re-join in that batch was refused DUPLICATE_RANK. Its first step is queued, so
    one turn of the loop runs it."""
    coro = task.get_coro()
    if isinstance(coro, Coroutine) and inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
        await asyncio.sleep(0)
    task.cancel(GIVEN_UP)


def _batch_entry(reply_bytes: bytes) -> bytes:
    """One encoded Reply as an entry of ReplyBatch.replies (field 1, length-delimited):
    written by hand for the reason ``reply`` is."""
    return b"\x0a" + _varint(len(reply_bytes)) + reply_bytes


def _forget(
    running: dict[int, asyncio.Task[None]], deadlines: _Deadlines, call_id: int, _task: object
) -> None:
    running.pop(call_id, None)
    deadlines.discard(call_id)


def _forget_join(joins: dict[int, tuple[str, str, str]], call_id: int, _task: object) -> None:
    joins.pop(call_id, None)


def _ended_bytes(status: grpc.Status) -> bytes:
    trailers = dict(status.trailing_metadata or ())
    data: bytes = trailers[STATUS_TRAILER]
    return data


#: What a call stream that the daemon ends as it drains says of its calls: those the
#: daemon read were all answered, and it reads no more, so one without a Reply was not
#: run (``DRAINED_TRAILER``, ``ReplyBatch.drained``).
DRAINED = to_grpc_status(
    RendezvousFault(
        Code.UNAVAILABLE,
        Reason.DRAINING,
        "the daemon is shutting down and ended this call stream: it read none of the "
        "stream's calls it did not answer, so ran none of them; they are re-sent once a "
        "daemon serves here again",
        {"run": "no"},
    )
)
_DRAINED_STATUS = _ended_bytes(DRAINED)
#: The last ReplyBatch of such a stream: ``ReplyBatch.drained``, the status above.
_DRAINED_BATCH = pb.ReplyBatch(drained=_DRAINED_STATUS).SerializeToString()

#: What a call read after the drain began is answered (``DRAIN_ANSWER_S``).
_DRAINING_NOT_RUN = _ended_bytes(
    to_grpc_status(
        RendezvousFault(
            Code.UNAVAILABLE,
            Reason.DRAINING,
            "the daemon is shutting down and did not run this call; it is re-sent once a "
            "daemon serves here again",
            {"run": "no"},
        )
    )
)
