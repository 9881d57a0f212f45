"""The call stream's I/O (``CallBatches``): one multiplexed stream per client,
blocking and asyncio.

gRPC charges the daemon far more per unary call (HTTP/2 stream, headers,
authentication, dispatch) than per message on an open stream, so each client makes
its ``Rpc`` steps as messages on one stream, opened on first use. Each twin here only
moves messages: ids, the Call and Reply forms, outcomes as ``grpc.RpcError`` and the
fallback decision are ``_multiplex``'s, retries are the call core's (``_calls``).

A call waits for its Reply up to its own deadline, then sends ``cancel`` and raises
DEADLINE_EXCEEDED. The stream's end fails every call in flight with its status, and
the next call opens a new stream. A daemon heard draining (the heartbeat stream's
event or end, a DRAINING answer) gets the stream half-closed: it answers what is in
flight and ends the stream; the next call opens a new one (to the daemon that
replaces it). A daemon without the method (UNIMPLEMENTED before any Reply) makes
``call`` raise ``Unsupported`` for every call it held, none of which the daemon saw:
the client then makes them, and every later call, unary. A call the daemon refuses
because the stream is full (as many in flight as one connection may open) is made
unary too, where gRPC queues it for a free slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import grpc
import grpc.aio

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb

if TYPE_CHECKING:
    from rendezvousd.client.connection import Bearer
from rendezvousd.client._multiplex import (
    CALLS_METHOD,
    Pending,
    Retired,
    Unsupported,
    cancel_message,
    closed_error,
    copy_error,
    deadline_error,
    draining,
    ended_error,
    lost_error,
    probed,
    status_error,
    status_lost,
    stream_full,
    unserved,
    unsupported,
)
from rendezvousd.client._stream_threads import RequestFeed, unraise
from rendezvousd.common.calls import SERVED_METADATA

log = logging.getLogger("rendezvousd.client")

# How long close() waits for a stream's threads (its reader, gRPC's request feeder)
# to end once the stream is cancelled.
STOP_READER_S = 5.0
# How long a probe for a lost status waits for the daemon's verdict on a new stream.
PROBE_S = 10.0
# A CallBatch holds queued calls while they fit in this many bytes together: half the
# daemon's 64 KiB request limit, so that any batch of calls that each fit it does.
CALL_BATCH_BYTES = 32 * 1024


def _sends(pending: Pending[Any], message: pb.Call) -> bool:
    """Whether a queued message still goes out: not a call whose caller gave up
    before it left (the daemon, counting its deadline from arrival, would run it)."""
    return message.WhichOneof("request") == "cancel" or pending.waiting(message.id)


def _batches(
    queued: list[pb.Call | None], pending: Pending[Any]
) -> tuple[list[pb.CallBatch], bool]:
    """Everything queued when the stream sends next, as CallBatches: one message for
    as many calls as fit in ``CALL_BATCH_BYTES`` (gRPC's cost is per message: a
    node agent relaying its workers' calls, or a burst of calls, pays it once); and
    whether the queue's end (None, the half-close) was among them."""
    batches: list[pb.CallBatch] = []
    size = 0
    for message in queued:
        if message is None:
            return batches, True
        if not _sends(pending, message):
            continue
        n = message.ByteSize()
        if not batches or size + n > CALL_BATCH_BYTES:
            # A call too big to share a batch goes alone, as it would on Calls.
            batches.append(pb.CallBatch())
            size = 0
        batches[-1].calls.append(message)
        size += n
    return batches, False


class Marks:
    """Whether the daemon was seen to send ``SERVED_METADATA`` on a stream, which an
    older daemon never does: only then does a stream without it mean "never served"."""

    seen = False

    def broke(self, exc: grpc.RpcError) -> None:
        """A stream broke: the daemon behind the channel's next connection may be
        another (rolled back to a release without the metadata), so it is learnt again."""
        if exc.code() is grpc.StatusCode.UNAVAILABLE:
            self.seen = False


class _Stream:
    """What an open CallBatches stream of either twin holds: its calls in flight, the
    queue feeding its requests, and its half-close. Each twin's subclass starts the
    call and reads its Replies."""

    _call: Any

    def __init__(
        self,
        channel: grpc.Channel | grpc.aio.Channel,
        metadata: tuple[tuple[str, str], ...],
        requests: queue.SimpleQueue[pb.Call | None] | asyncio.Queue[pb.Call | None],
        marks: Marks,
    ) -> None:
        self.marks = marks
        self.pending: Pending[Any] = Pending()
        self.unsupported = False
        self.closing = False
        # The daemon said it drained the stream (``ReplyBatch.drained``): every call
        # still in flight on it was not run, whatever ends the stream after.
        self.drained: grpc.RpcError | None = None
        # Half-closed: no new calls (``retire``).
        self.retired = False
        self._lock = threading.Lock()
        self._queue = requests
        self._multi: Any = channel.stream_stream(
            CALLS_METHOD,
            request_serializer=pb.CallBatch.SerializeToString,
            response_deserializer=pb.ReplyBatch.FromString,
        )
        self._metadata = metadata

    @property
    def over(self) -> bool:
        return self.retired or self.pending.failure is not None

    def submit(self, method: str, request: Any, timeout: float, waiter: Any) -> int:
        """Send a new call; its id. ``Retired`` once half-closed, or the stream's end."""
        with self._lock:  # never queued behind the half-close
            if self.retired:
                raise Retired
            call_id, message = self.pending.add(method, request, timeout, waiter)
            self._queue.put_nowait(message)
        return call_id

    def cancel(self, call_id: int) -> None:
        self._queue.put_nowait(cancel_message(call_id))

    def retire(self) -> None:
        """Half-close: the daemon answers the calls in flight, then ends the stream."""
        with self._lock:
            if not self.retired:
                self.retired = True
                self._queue.put_nowait(None)

    def _take(self, batch: pb.ReplyBatch) -> None:
        """One ReplyBatch: each Reply to its caller; a drained end kept for the calls
        left in flight, and no more calls written to a stream the daemon reads no more."""
        for reply in batch.replies:
            settle(self, reply)
        if batch.drained:
            self.drained = status_error(batch.drained)
            self.retire()

    def _ended(self, failure: grpc.RpcError) -> None:
        """The reader's last act: every call in flight fails with ``failure`` (or, for
        a daemon without the method, ``Unsupported``), and the requests end, which
        ends gRPC's feeding of them. After the daemon's drained end, ``failure`` is
        that end's (DRAINING, run: no): the stream's status that followed it may
        be lost (grpc.aio's), or the connection may break, but the daemon had
        already stopped reading, so those calls were not run."""
        if self.drained is not None and not self.closing:
            failure = self.drained
        log.debug("the call stream ended: %s: %s", failure.code().name, failure.details())
        for waiter in self.pending.end(failure):
            if not waiter.done():  # an asyncio caller cancelled as the stream ended
                waiter.set_exception(Unsupported() if self.unsupported else copy_error(failure))
        self._queue.put_nowait(None)

    def close(self) -> None:
        self.closing = True
        self.retire()
        self._call.cancel()

    def lose(self) -> None:
        """The daemon is gone: the stream ends now as if it broke with ``lost_error``
        (the call core then raises the cause the heartbeat found), not when its reader
        hears it; a next call opens a new one."""
        self._ended(lost_error())
        self.close()


class _BlockingStream(_Stream):
    """One open CallBatches stream of a blocking channel: a queue feeds its requests, one
    reader thread hands each Reply to its caller's future."""

    _queue: queue.SimpleQueue[pb.Call | None]

    def __init__(
        self, channel: grpc.Channel, metadata: tuple[tuple[str, str], ...], marks: Marks
    ) -> None:
        super().__init__(channel, metadata, queue.SimpleQueue(), marks)
        self._feed = RequestFeed()
        # wait_for_ready: a call made while the daemon restarts waits for it, within
        # its own deadline, as a unary call does.
        self._call = self._multi(
            self._feed.wrap(self._requests()), metadata=metadata, wait_for_ready=True
        )
        self.reader = threading.Thread(
            target=self._read, daemon=True, name="rendezvous-calls-reader"
        )
        self.reader.start()

    def _requests(self) -> Iterator[pb.CallBatch]:
        while True:
            queued = [self._queue.get()]
            with contextlib.suppress(queue.Empty):
                while True:
                    queued.append(self._queue.get_nowait())
            batches, ended = _batches(queued, self.pending)
            yield from batches
            if ended:
                return

    def _read(self) -> None:
        failure: grpc.RpcError = ended_error(served=False)
        try:
            for batch in self._call:
                if not self.marks.seen:
                    self.marks.seen = SERVED_METADATA in (self._call.initial_metadata() or ())
                self._take(batch)
            failure = ended_error(SERVED_METADATA in (self._call.initial_metadata() or ()))
        except grpc.RpcError as exc:
            # A copy: the error raised is the call itself, which finish() frees.
            failure = (
                closed_error()
                if self.closing
                else copy_error(unserved(exc, self._call.initial_metadata(), self.marks.seen))
            )
            self.unsupported = unsupported(exc, self.pending.replied)
            self.marks.broke(exc)
        finally:
            self._ended(failure)

    def finish(self, deadline: float) -> None:
        """After ``close``: wait, until the monotonic ``deadline``, for the reader and
        gRPC's request feeder to end, then free the call (see ``_stream_threads``)."""
        if self.reader is not threading.current_thread():
            self.reader.join(max(0.0, deadline - time.monotonic()))
        fed = self._feed.join(deadline)
        if self.reader.is_alive() or not fed:
            log.warning(
                "the call stream's threads did not end within %g s of its close", STOP_READER_S
            )
        if not self.reader.is_alive():
            call, self._call = self._call, None
            unraise(call)  # its __del__ runs now, not in the interpreter's exit


def settle(stream: Any, reply: pb.Reply) -> None:
    """Hand ``reply`` to its caller's future: on a stream of either twin, or a relay
    (``relay``): anything with ``pending`` and ``retire``; futures of either kind."""
    settled = stream.pending.settle(reply)
    if settled is None:
        return
    waiter, outcome = settled
    if draining(outcome):
        stream.retire()
    if waiter.done():  # an asyncio caller cancelled as the Reply came
        return
    if stream_full(outcome):
        waiter.set_exception(Unsupported())
    elif isinstance(outcome, grpc.RpcError):
        waiter.set_exception(outcome)
    else:
        waiter.set_result(outcome)


S = TypeVar("S", bound=_Stream)


class _CallStreams(ABC, Generic[S]):
    """What both twins' call streams decide alike: the stream a call goes on (opened on
    first use and again after it broke, or none: unary calls), and what they count."""

    def __init__(self, channel: Any, bearer: Bearer, endpoint: str) -> None:
        self._channel = channel
        # Read at each stream opened: a token re-read after a refusal goes on the next.
        self._bearer = bearer
        self._endpoint = endpoint
        self._lock = threading.Lock()
        self._stream: S | None = None
        self._streams: list[S] = []
        self._closed = False
        self._marks = Marks()
        # The daemon has no CallBatches method: every call is unary.
        self.unary = False
        # Streams opened and calls sent on them (tests, benchmarks).
        self.opened = 0
        self.sent: Counter[str] = Counter()

    @abstractmethod
    def _new_stream(self) -> S:
        """A new stream on the channel; the twin's own error once the client closed."""

    @staticmethod
    @abstractmethod
    def _reading(stream: S) -> bool:
        """Whether ``stream``'s reader still runs."""

    def open(self) -> S | None:
        """The live stream, opened now if there is none; None for a daemon without it.
        An ended stream is replaced, unless it found the daemon has no CallBatches
        method: then every call is unary from now on."""
        with self._lock:
            if self.unary:
                return None
            stream = self._stream
            if stream is not None and stream.over:
                if stream.unsupported:
                    self.unary = True
                    log.debug(
                        "rendezvousd at %s has no CallBatches method (an older daemon): this "
                        "client makes unary calls from now on",
                        self._endpoint,
                    )
                    return None
                stream = None
            if stream is None:
                stream = self._stream = self._new_stream()
                self.opened += 1
                # Streams that broke end their readers on their own: forget them.
                self._streams = [s for s in self._streams if self._reading(s)] + [stream]
            return stream

    def submit(self, method: str, request: Any, timeout: float, waiter: Any) -> tuple[S, int]:
        """Send a call whose outcome ``waiter`` gets: the stream it went on and its id
        there. ``Unsupported`` when the daemon has no CallBatches method (not sent)."""
        while True:
            stream = self.open()
            if stream is None:
                raise Unsupported
            try:
                call_id = stream.submit(method, request, timeout, waiter)
                break
            except Retired:
                continue  # half-closed since open(): a new stream
            except grpc.RpcError:
                # The stream ended since open(): as if it broke under the call.
                if stream.unsupported:
                    raise Unsupported from None
                raise
        self.sent[method] += 1
        return stream, call_id

    def rechannel(self, channel: Any) -> None:
        """The client's channel made anew (its TLS files renewed): the next stream opens
        on it. The live one, on the old channel, is half-closed: its calls in flight
        are answered where that channel still connects, else fail as any broken
        stream's do and are made again on the new one."""
        with self._lock:
            self._channel = channel
            stream, self._stream = self._stream, None
        if stream is not None:
            stream.retire()

    def retire(self) -> None:
        """The daemon drains: half-close the stream; the next call opens a new one."""
        with self._lock:
            stream = self._stream
        if stream is not None:
            stream.retire()

    def lose(self) -> None:
        """The daemon is gone (the heartbeat's verdict): the calls in flight on the
        live stream fail now, not at their deadlines (``_Stream.lose``)."""
        with self._lock:
            stream = self._stream
        if stream is not None:
            stream.lose()


class BlockingCallStream(_CallStreams[_BlockingStream]):
    """A blocking client's CallBatches stream, opened on first use and again after it broke.
    Safe from several threads: the user's, the heartbeat thread's, ``on_failure``'s."""

    def _new_stream(self) -> _BlockingStream:
        if self._closed:
            raise ValueError("Cannot invoke RPC on closed channel!")
        return _BlockingStream(self._channel, self._bearer.metadata, self._marks)

    @staticmethod
    def _reading(stream: _BlockingStream) -> bool:
        return stream.reader.is_alive()

    def call(self, method: str, request: Any, timeout: float) -> Any:
        """``method``'s response, or the ``grpc.RpcError`` its unary call would raise;
        ``Unsupported`` when the daemon has no CallBatches method (the call was not made)."""
        waiter: Future[Any] = Future()
        stream, call_id = self.submit(method, request, timeout, waiter)
        try:
            return waiter.result(timeout)
        except TimeoutError:
            if stream.pending.drop(call_id):
                stream.cancel(call_id)
                raise deadline_error() from None
        except BaseException:
            # Interrupted (Ctrl-C in a waiting call): the daemon releases the parked
            # wait now, as for an asyncio caller's cancellation, not at its deadline.
            if stream.pending.drop(call_id):
                stream.cancel(call_id)
            raise
        return waiter.result()  # answered as its deadline passed

    def close(self) -> None:
        """End the stream (the daemon cancels what is in flight) and its threads."""
        deadline = time.monotonic() + STOP_READER_S
        for stream in self.abandon():
            stream.finish(deadline)

    def abandon(self) -> list[_BlockingStream]:
        """End the streams without waiting for their readers (a client collected
        unclosed: its reader would otherwise keep the connection open); them."""
        with self._lock:
            self._closed = True
            streams, self._streams, self._stream = self._streams, [], None
        for stream in streams:
            stream.close()
        return streams


class _AsyncStream(_Stream):
    """One open CallBatches stream of an asyncio channel: a queue feeds its requests, one
    reader task hands each Reply to its caller's future."""

    _queue: asyncio.Queue[pb.Call | None]

    def __init__(
        self, channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...], marks: Marks
    ) -> None:
        super().__init__(channel, metadata, asyncio.Queue(), marks)
        self._call = self._multi(self._requests(), metadata=metadata, wait_for_ready=True)
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _requests(self) -> AsyncIterator[pb.CallBatch]:
        while True:
            queued = [await self._queue.get()]
            while not self._queue.empty():
                queued.append(self._queue.get_nowait())
            batches, ended = _batches(queued, self.pending)
            for batch in batches:
                yield batch
            if ended:
                return

    async def _read(self) -> None:
        failure: grpc.RpcError = ended_error(served=False)
        try:
            async for batch in self._call:
                if not self.marks.seen:
                    served = await self._call.initial_metadata()
                    self.marks.seen = SERVED_METADATA in tuple(served or ())
                self._take(batch)
            failure = ended_error(
                SERVED_METADATA in tuple(await self._call.initial_metadata() or ())
            )
        except grpc.RpcError as exc:
            if status_lost(exc) and not self.closing and self.drained is None:
                # The probe's end says what the daemon does with a new stream now, not
                # what it did with this one: never read as this stream's (unserved).
                # A drained end read before needs none: it says what became of the
                # calls in flight (the probe of a draining daemon would wait out
                # PROBE_S for the next one, its new streams refused meanwhile).
                exc = await self._probe() if not self.pending.replied else lost_error()
            elif not self.closing:
                exc = unserved(exc, await self._call.initial_metadata(), self.marks.seen)
            self.unsupported = unsupported(exc, self.pending.replied)
            self.marks.broke(exc)
            failure = closed_error() if self.closing else exc
        except asyncio.CancelledError:
            failure = closed_error()
            raise
        finally:
            self._ended(failure)

    async def _probe(self) -> grpc.RpcError:
        """The status this stream lost (``status_lost``), from a new stream that sends
        nothing and half-closes at once, so no write can race the daemon's verdict: an
        older daemon or a refused token ends it as it ended this one."""
        probe = self._multi(metadata=self._metadata, wait_for_ready=True)
        try:
            async with asyncio.timeout(PROBE_S):
                await probe.done_writing()
                code = await probe.code()
                return probed(
                    code, await probe.details() or "", tuple(await probe.trailing_metadata() or ())
                )
        except (TimeoutError, grpc.RpcError):
            return lost_error()
        finally:
            probe.cancel()


class AsyncCallStream(_CallStreams[_AsyncStream]):
    """``BlockingCallStream``'s twin on the event loop."""

    def _new_stream(self) -> _AsyncStream:
        if self._closed:
            raise grpc.aio.UsageError("the client is closed")
        return _AsyncStream(self._channel, self._bearer.metadata, self._marks)

    @staticmethod
    def _reading(stream: _AsyncStream) -> bool:
        return not stream.reader.done()

    async def call(self, method: str, request: Any, timeout: float) -> Any:
        waiter: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        stream, call_id = self.submit(method, request, timeout, waiter)
        try:
            async with asyncio.timeout(timeout):
                # shield: the deadline or a cancellation leaves the future to the reader.
                return await asyncio.shield(waiter)
        except TimeoutError:
            if not stream.pending.drop(call_id):
                return await waiter  # answered as its deadline passed
            stream.cancel(call_id)
            raise deadline_error() from None
        except asyncio.CancelledError:
            if stream.pending.drop(call_id):
                stream.cancel(call_id)
            elif waiter.done() and not waiter.cancelled():
                waiter.exception()  # answered as it was cancelled: nobody reads it now
            raise

    async def close(self) -> None:
        self._closed = True
        streams, self._streams, self._stream = self._streams, [], None
        for stream in streams:
            stream.close()
        readers = {s.reader for s in streams if not s.reader.done()}
        if readers:
            await asyncio.wait(readers, timeout=STOP_READER_S)
        for reader in readers:
            if reader.done():
                with contextlib.suppress(asyncio.CancelledError):
                    reader.result()
            else:
                reader.cancel()
