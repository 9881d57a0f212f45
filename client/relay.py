"""Calls relayed through a node agent: a worker's daemon calls made on its agent's
call stream.

Why: gRPC's cost is per message, ~100 µs of daemon CPU each in Python against
~15 µs per call when 8 calls share one message (docs/benchmarks.md, "Relayed
calls"). A node's workers each on a stream of their own send a burst (a barrier,
a key exchange) as one message per worker; relayed, their calls reach the daemon in
the agent's CallBatches and come back in its ReplyBatches. The relay moves the call
stream's own encoded ``Call`` and ``Reply`` messages over whatever link the two
share (rendezvous-run: the agent channel's socketpair); the daemon sees each call
exactly as if the worker had sent it on its own stream: its member, deadline,
authorization and errors. Nothing here does I/O on the link: its owner carries the
bytes both ways.

- ``RelayEnd``: the agent's end, one per worker. A worker's Call becomes a call on
  the agent's stream; its outcome, a Reply back. A worker's cancel cancels the
  call, and ``close`` (the worker went away) cancels every call it has in flight.
- ``RelayedCalls`` / ``AsyncRelayedCalls``: the worker's end, what a client's call
  stream is (``RendezvousClient.relay_through``). A call the agent cannot make (its
  daemon has no CallBatches, its stream is full), or any call once the link is
  gone, raises ``Unsupported``: the client then makes it unary on its own channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import grpc
from google.rpc import status_pb2

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client._call_stream import settle
from rendezvousd.client._multiplex import (
    Pending,
    Unsupported,
    cancel_message,
    closed_error,
    copy_error,
    rich_status,
    rpc_error,
    status_error,
)
from rendezvousd.common.calls import FIELDS, STATUS_TRAILER

log = logging.getLogger("rendezvousd.client")

#: Sends one encoded message over the link (raises OSError once it is gone).
Send = Callable[[bytes], None]
#: Makes a call on the agent's stream: (method, request, timeout, what to do with its
#: outcome) -> how to cancel it. Raises ``Unsupported`` or the call's error.
Submit = Callable[[str, Any, float, Callable[[Any], None]], Callable[[], None]]

_METHODS = {field: method for method, field in FIELDS.items()}


def _status_of(exc: grpc.RpcError) -> bytes:
    """A call's error as a Reply's ``error``: its rich status where it has one."""
    error = copy_error(exc)  # whatever kind of RpcError: its code, details and trailers
    for key, value in error.trailing_metadata() or ():
        if key == STATUS_TRAILER:
            return bytes(value)
    status = status_pb2.Status(code=error.code().value[0], message=error.details() or "")
    data: bytes = status.SerializeToString()
    return data


def reply_bytes(call_id: int, field: str, outcome: Any) -> bytes:
    """A call's outcome (a response, ``Unsupported`` or a ``grpc.RpcError``) as the
    encoded Reply the worker reads."""
    reply = pb.Reply(id=call_id)
    if isinstance(outcome, Unsupported):
        # The daemon's own "stream full" refusal (``_multiplex.stream_full``), which
        # means "never run": the worker's client makes the call unary.
        reply.error = rich_status(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "LIMIT_EXCEEDED",
            "the node agent could not make this call on its stream",
            {"limit": "max_concurrent_streams"},
        )
    elif isinstance(outcome, grpc.RpcError):
        reply.error = _status_of(outcome)
    elif isinstance(outcome, BaseException):
        reply.error = _status_of(rpc_error(grpc.StatusCode.INTERNAL, repr(outcome)))
    else:
        getattr(reply, field).CopyFrom(outcome)
    data: bytes = reply.SerializeToString()
    return data


class RelayEnd:
    """The agent's end of one worker's relay. Thread-safe: ``forward`` runs on the
    link's reader, outcomes arrive on the stream's reader."""

    def __init__(self, submit: Submit, reply: Send) -> None:
        """``submit``: a call on the agent's stream (``submit_on``); ``reply``:
        sends an encoded Reply to the worker."""
        self._submit = submit
        self._reply = reply
        self._lock = threading.Lock()
        # The worker's call ids in flight -> how to cancel each (None until submitted).
        self._cancels: dict[int, Callable[[], None] | None] = {}
        self._closed = False

    def forward(self, payload: bytes) -> None:
        """One message from the worker: a Call, or a cancel of one. A message that
        does not decode raises ``google.protobuf.message.DecodeError`` (a bad frame)."""
        call = pb.Call.FromString(payload)
        field = call.WhichOneof("request")
        if field == "cancel":
            with self._lock:
                cancel = self._cancels.pop(call.id, None)
            if cancel is not None:
                cancel()
            return
        problem = self._refusal(call, field)
        if problem is not None:
            self._send(call.id, "", rpc_error(grpc.StatusCode.INVALID_ARGUMENT, problem))
            return
        assert field is not None
        try:
            cancel = self._submit(
                _METHODS[field],
                getattr(call, field),
                call.timeout_ms / 1000,
                lambda outcome: self._done(call.id, field, outcome),
            )
        except (Unsupported, grpc.RpcError) as exc:
            self._done(call.id, field, exc)
            return
        with self._lock:
            if call.id in self._cancels:  # not answered yet
                self._cancels[call.id] = cancel
                return
            closed = self._closed
        if closed:  # close() ran while it was being submitted: it took none to cancel
            cancel()

    def _refusal(self, call: pb.Call, field: str | None) -> str | None:
        with self._lock:
            if self._closed:
                return "the worker's relay is closed"
            if field not in _METHODS:
                return f"relayed call {call.id} sets no request field; set exactly one"
            if call.id in self._cancels:
                return f"relayed call id {call.id} is already in flight; use a new id per call"
            if not call.timeout_ms:
                return f"relayed call {call.id} has no deadline (timeout_ms); set one"
            self._cancels[call.id] = None
        return None

    def _done(self, call_id: int, field: str, outcome: Any) -> None:
        with self._lock:
            in_flight = call_id in self._cancels
            self._cancels.pop(call_id, None)
        if in_flight:  # not cancelled by the worker meanwhile
            self._send(call_id, field, outcome)

    def _send(self, call_id: int, field: str, outcome: Any) -> None:
        with contextlib.suppress(OSError):  # the worker went: close() cancels the rest
            self._reply(reply_bytes(call_id, field, outcome))

    def close(self) -> None:
        """The worker went away: cancel its calls in flight (a parked barrier or key
        wait of a dead worker must not hold the daemon's slots)."""
        with self._lock:
            self._closed = True
            cancels, self._cancels = list(self._cancels.values()), {}
        for cancel in cancels:
            if cancel is not None:
                cancel()


def _link_ended() -> grpc.RpcError:
    return rpc_error(
        grpc.StatusCode.UNAVAILABLE,
        "the link to the node agent ended with the call in flight (the agent went away)",
    )


#: Why a relayed call unanswered at its own deadline failed, and why the worker's
#: other calls then fail over to its own channel.
#: The reason of a call no answer came for through the agent: the SDK's own, not a
#: daemon's verdict, so the retry policy re-makes it on the worker's own channel.
RELAY_STALLED = "RELAY_STALLED"
_STALLED = (
    "no answer through the node agent within the call's deadline (the agent, or its "
    "stream to the daemon, is stuck)"
)
_OWN_CHANNEL = "this worker makes its calls on its own channel from now on"


class AgentTookNone(ConnectionError):
    """What a relay's ``Send`` raises when the agent took none of the call in its
    time (its reader stopped or stuck): the relay ends and says so, once, in the words
    of a stalled call (``relay_note``). Its text says why, without a caller."""


def relay_note(method: str, request: Any, call_id: int, why: str) -> str:
    """Why a worker's relayed call gave up on its node agent, naming its job, rank
    and method: one wording for every way the relay ends on a stuck agent."""
    job = getattr(request, "job_id", "")
    fields = request.DESCRIPTOR.fields_by_name if hasattr(request, "DESCRIPTOR") else {}
    rank = f" rank {request.rank}" if "rank" in fields else ""
    who = f"job {job!r}{rank}: " if job else ""
    return f"{who}relayed {method} (call {call_id}): {why}; {_OWN_CHANNEL}"


class _Relayed:
    """What both workers' ends are: the calls in flight over the link, and what a
    client's call stream shows (``unary``, ``opened``, ``sent``: tests, benchmarks)."""

    def __init__(self, send: Send) -> None:
        self.pending: Pending[Any] = Pending()
        self._send = send
        self.unary = False
        self.opened = 1
        self.sent: Counter[str] = Counter()

    def deliver(self, payload: bytes) -> None:
        """A Reply from the agent (the link's reader; an asyncio client's loop)."""
        settle(self, pb.Reply.FromString(payload))

    def end(self, failure: Callable[[], grpc.RpcError] = _link_ended) -> None:
        """The link is gone: calls in flight fail UNAVAILABLE (retried, then made
        unary); later calls are unary."""
        for waiter in self.pending.end(failure()):
            if not waiter.done():
                waiter.set_exception(failure())  # one error object per caller

    def open(self) -> None:
        """Nothing to open: the agent's stream is the agent's."""

    def retire(self) -> None:
        """A draining daemon: the agent's stream retires itself."""

    def _start(self, method: str, request: Any, timeout: float, waiter: Any) -> int:
        """Send a new call over the link: its id. ``Unsupported`` once the link is gone."""
        try:
            call_id, message = self.pending.add(method, request, timeout, waiter)
        except grpc.RpcError:
            raise Unsupported from None  # the link ended: unary from now on
        try:
            self._send(message.SerializeToString())
        except OSError as exc:
            self.pending.drop(call_id)
            if isinstance(exc, AgentTookNone):
                log.warning("%s", relay_note(method, request, call_id, str(exc)))
            self.end()
            raise Unsupported from None
        self.sent[method] += 1
        return call_id

    def _give_up(self, call_id: int) -> bool:
        """The caller gave up on call ``call_id``: True (and the agent told, which
        cancels it on its stream) when it was still in flight."""
        if not self.pending.drop(call_id):
            return False
        with contextlib.suppress(OSError):
            self._send(cancel_message(call_id).SerializeToString())
        return True

    def _timed_out(self, method: str, request: Any, call_id: int) -> grpc.RpcError | None:
        """Call ``call_id``'s own deadline passed: None when its Reply came meanwhile.
        Else the agent answered nothing by the deadline it gave the daemon (the daemon's
        answer, or its stream's error, would have come back): it is stuck. The link
        ends as if the agent had gone (the other calls in flight fail over, retried on
        the worker's own channel, and so are later calls), and the call fails
        DEADLINE_EXCEEDED, which the retry policy re-makes there where the method
        allows: retried through the stuck agent, it would stall again, and the worker
        would hear "is the daemon running?" after twice the deadline."""
        if not self._give_up(call_id):
            return None
        # Said once per worker: the relay is over for it, and an operator should know
        # that a node agent got stuck.
        log.warning("%s", relay_note(method, request, call_id, _STALLED))
        ended = f"{_STALLED}; {_OWN_CHANNEL}"
        self.end(lambda: rpc_error(grpc.StatusCode.UNAVAILABLE, ended))
        # The reason RELAY_STALLED (the SDK's own, never the daemon's): a call the retry
        # policy does not re-make says why, not "the daemon did not answer in time".
        return status_error(rich_status(grpc.StatusCode.DEADLINE_EXCEEDED, RELAY_STALLED, ended))


class RelayedCalls(_Relayed):
    """A blocking client's call stream through its node agent (``relay_through``)."""

    def call(self, method: str, request: Any, timeout: float) -> Any:
        """As ``BlockingCallStream.call``; ``Unsupported`` once the link is gone."""
        waiter: Future[Any] = Future()
        call_id = self._start(method, request, timeout, waiter)
        try:
            return waiter.result(timeout)
        except TimeoutError:
            if (stalled := self._timed_out(method, request, call_id)) is not None:
                raise stalled from None
        except BaseException:  # interrupted: as BlockingCallStream.call
            self._give_up(call_id)
            raise
        return waiter.result()  # answered as its deadline passed

    def close(self) -> None:
        """The client closes: its calls in flight fail CANCELLED, as on its own stream."""
        self.end(closed_error)

    abandon = close


class AsyncRelayedCalls(_Relayed):
    """``RelayedCalls`` for an asyncio client; ``deliver`` runs on its loop."""

    async def call(self, method: str, request: Any, timeout: float) -> Any:
        waiter: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        call_id = self._start(method, request, timeout, waiter)
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.shield(waiter)
        except TimeoutError:
            if (stalled := self._timed_out(method, request, call_id)) is None:
                return await waiter
            raise stalled from None
        except asyncio.CancelledError:
            if not self._give_up(call_id) and waiter.done() and not waiter.cancelled():
                waiter.exception()
            raise

    async def close(self) -> None:
        self.end(closed_error)


def route_of(mux: Any) -> str:
    """How a client with call stream ``mux`` reaches the daemon (``call_route``)."""
    if isinstance(mux, _Relayed):
        return "relayed" if not mux.pending.failure else "unary"
    if mux is None or mux.unary:
        return "unary"
    return "stream"


def submit_on(stream: Any, new_waiter: Callable[[], Any]) -> Submit:
    """``RelayEnd``'s ``submit`` on a client's call stream: ``new_waiter`` makes the
    future its twin's calls wait on (``concurrent.futures.Future`` for the blocking
    client's stream; the running loop's ``create_future`` for the asyncio one's)."""

    def submit(
        method: str, request: Any, timeout: float, done: Callable[[Any], None]
    ) -> Callable[[], None]:
        waiter = new_waiter()
        on, call_id = stream.submit(method, request, timeout, waiter)

        def finished(f: Any) -> None:
            if not f.cancelled():
                error = f.exception()
                done(f.result() if error is None else error)

        waiter.add_done_callback(finished)

        def cancel() -> None:
            if on.pending.drop(call_id):
                on.cancel(call_id)

        return cancel

    return submit
