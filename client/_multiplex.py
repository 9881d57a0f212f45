"""The ``Calls`` stream's messages, without I/O: what both clients' call streams share.

Every unary method of the Rendezvous service travels on one stream as a ``Call``
(the caller's id, the deadline, the request in the oneof field named after the
method) and comes back as a ``Reply`` with the same id: the response in the field of
the same name, or ``error``, the google.rpc.Status the unary call would have ended
with. Here: the method <-> field table (read from the descriptor, so a method added
to the proto is carried without an edit here), the calls in flight on one stream
(ids, their waiters), and every outcome as the ``grpc.RpcError`` a unary call would
have raised (code, details, and the ``grpc-status-details-bin`` trailer), so the
call core (``_calls``) reads a stream's errors exactly as it reads a unary call's.
``_call_stream`` performs the I/O, blocking and asyncio.
"""

from __future__ import annotations

import itertools
import math
import threading
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc
import grpc.aio
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client.errors import error_info
from rendezvousd.common.calls import FIELDS, SERVED_METADATA, STATUS_TRAILER

W = TypeVar("W")

#: The call stream method's path on the channel (CallBatches; Calls is the deprecated one).
CALLS_METHOD = "/rendezvous.v1.Rendezvous/CallBatches"

_CODES = {code.value[0]: code for code in grpc.StatusCode}


def timeout_ms(timeout: float) -> int:
    """A call's deadline on the wire: whole milliseconds, rounded up, never 0 (which
    would ask for the daemon's default instead)."""
    return max(1, math.ceil(timeout * 1000))


def call_message(call_id: int, method: str, request: Any, timeout: float) -> pb.Call:
    call = pb.Call(id=call_id, timeout_ms=timeout_ms(timeout))
    getattr(call, FIELDS[method]).CopyFrom(request)
    return call


def cancel_message(call_id: int) -> pb.Call:
    return pb.Call(id=call_id, cancel=pb.CancelCall())


def rpc_error(
    code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, Any], ...] = ()
) -> grpc.RpcError:
    """The error a unary call ending with this status raises (one object per caller:
    an exception raised in several threads must not share its traceback)."""
    return grpc.aio.AioRpcError(
        code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details=details
    )


def status_error(status_bytes: bytes) -> grpc.RpcError:
    """An error Reply as the unary call's error: the status's code and message, and
    the status itself in the trailer the unary call carries it in."""
    status = status_pb2.Status.FromString(status_bytes)
    code = _CODES.get(status.code, grpc.StatusCode.UNKNOWN)
    return rpc_error(code, status.message, ((STATUS_TRAILER, status_bytes),))


def copy_error(exc: grpc.RpcError) -> grpc.RpcError:
    """The stream's own failure, as each call in flight on it sees it: its status."""
    return rpc_error(exc.code(), exc.details() or "", tuple(exc.trailing_metadata() or ()))


def deadline_error() -> grpc.RpcError:
    """A call's own deadline passed before its Reply: what gRPC raises for a unary call."""
    return rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")


def rich_status(
    code: grpc.StatusCode, reason: str, message: str, metadata: dict[str, str] | None = None
) -> bytes:
    """An encoded google.rpc.Status with an ErrorInfo, as the daemon's errors carry."""
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.ErrorInfo(reason=reason, metadata=metadata or {}))
    status = status_pb2.Status(code=code.value[0], message=message, details=[detail])
    data: bytes = status.SerializeToString()
    return data


#: The reason of a call its stream ended before the daemon read it: the SDK's own,
#: never the daemon's. Such a call was not run, so the retry policy re-sends it once
#: a daemon serves again, whatever its method (a KvAdd included).
NOT_RUN = "NOT_RUN"


def not_run_error(why: str) -> grpc.RpcError:
    return status_error(rich_status(grpc.StatusCode.UNAVAILABLE, NOT_RUN, why))


def ended_error(served: bool) -> grpc.RpcError:
    """The daemon ended the stream (status OK) with calls still in flight on it.
    ``served``: this stream carried ``SERVED_METADATA``: such a daemon answers every
    call it read before it ends a stream (it drains), so those were never run. An older
    daemon, without the metadata, may have cancelled calls it had run (a drain once did,
    of a stream its client had half-closed): their outcome stays unknown."""
    if served:
        return not_run_error(
            "the daemon ended the call stream before reading this call (it was shutting "
            "down): the call was not run"
        )
    return rpc_error(
        grpc.StatusCode.UNAVAILABLE, "the daemon ended the call stream (draining or restarting)"
    )


def unserved(exc: grpc.RpcError, initial_metadata: Any, marks: bool) -> grpc.RpcError:
    """``exc``, the stream's end; or, where the daemon refused it without serving it (a
    daemon shutting down ends a new stream CANCELLED, no ``SERVED_METADATA`` before),
    a ``NOT_RUN`` error. ``marks``: whether this daemon was seen to send that metadata,
    which an older daemon never does. Only the daemon's own end of the stream (CANCELLED,
    or a GOAWAY), which comes after anything it sent on it. A connection that broke
    otherwise (UNAVAILABLE) may have lost the metadata of a stream whose calls ran (a
    daemon killed with a reset, a network cut as it answered): those stay unknown."""
    served = SERVED_METADATA in tuple(initial_metadata or ())
    # A daemon shutting down also refuses a stream it takes no more with GOAWAY, which
    # comes after the metadata of every stream it served on that connection.
    refused = exc.code() in _REFUSED or (
        exc.code() is grpc.StatusCode.UNAVAILABLE and "GOAWAY received" in (exc.details() or "")
    )
    if served or not marks or not refused:
        return exc
    return not_run_error(
        f"the daemon refused the call stream before serving it ({exc.code().name}: "
        f"{exc.details() or 'no details'}): no call on it was run"
    )


_REFUSED = (grpc.StatusCode.CANCELLED,)


def closed_error() -> grpc.RpcError:
    """The client closed its stream with calls still in flight on it."""
    return rpc_error(grpc.StatusCode.CANCELLED, "the client closed its call stream")


#: What grpc.aio reports when it sent a message on a call the daemon had already ended:
#: the call's real status (an older daemon's UNIMPLEMENTED, a refused token's
#: UNAUTHENTICATED, a daemon's exit) is replaced by this.
LOST_STATUS = "Internal error from Core"


def status_lost(exc: grpc.RpcError) -> bool:
    """Whether the stream's status is grpc.aio's stand-in, not the daemon's."""
    return exc.code() is grpc.StatusCode.INTERNAL and exc.details() == LOST_STATUS


def lost_error() -> grpc.RpcError:
    """A stream that served calls ended with its status lost: what a unary call in
    flight gets when the daemon goes away, so the retry policy treats it alike."""
    return rpc_error(grpc.StatusCode.UNAVAILABLE, "the call stream ended as the daemon went away")


def probed(
    code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, Any], ...]
) -> grpc.RpcError:
    """A stream's lost status, from a probe stream that sent nothing: its own end.
    OK (the daemon serves Calls: the first stream was lost as the daemon went) is
    ``lost_error``; so is a drained end (DRAINING, run: no: a draining daemon ends
    every stream so), which speaks of the probe's own calls, none: the first stream,
    had the daemon drained it, would have said so itself (``ReplyBatch.drained``),
    so its calls may have run. Anything else (UNIMPLEMENTED, UNAUTHENTICATED,
    UNAVAILABLE) is the status the first stream should have ended with."""
    if code is grpc.StatusCode.OK:
        return lost_error()
    status = rpc_error(code, details, trailing)
    if error_info(status)[0] == "DRAINING":
        return lost_error()
    return status


def unsupported(exc: grpc.RpcError, replied: bool) -> bool:
    """Whether the stream's failure means the daemon has no CallBatches method (an older
    daemon): UNIMPLEMENTED before any Reply. A call's own UNIMPLEMENTED is a Reply."""
    return not replied and exc.code() is grpc.StatusCode.UNIMPLEMENTED


def draining(outcome: Any) -> bool:
    """Whether a call's outcome says the daemon is shutting down (DRAINING): its
    stream is then retired, so it does not hold up the daemon's exit."""
    return isinstance(outcome, grpc.RpcError) and error_info(outcome)[0] == "DRAINING"


def stream_full(outcome: Any) -> bool:
    """Whether the daemon refused a call because the stream already had as many calls
    in flight as one connection may open (RESOURCE_EXHAUSTED, limit
    max_concurrent_streams): it never ran, and is made unary, which gRPC queues for a
    free slot as it always has."""
    if not isinstance(outcome, grpc.RpcError):
        return False
    reason, metadata = error_info(outcome)
    return reason == "LIMIT_EXCEEDED" and metadata.get("limit") == "max_concurrent_streams"


class Unsupported(Exception):
    """Make this call unary: it was never run (the daemon has no CallBatches method, or its
    stream was full)."""


class Retired(Exception):
    """The stream takes no new calls (the daemon drains): make the call on a new one."""


@dataclass(frozen=True)
class InFlight(Generic[W]):
    method: str
    waiter: W


class Pending(Generic[W]):
    """The calls in flight on one stream, each with its caller's waiter (a future of
    either kind). Safe from several threads: the sync client's callers and its reader."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._calls: dict[int, InFlight[W]] = {}
        self._lock = threading.Lock()
        # A Reply was read: the daemon has the method (see ``unsupported``).
        self.replied = False
        # The stream's end, once it ended: every later call fails with it at once.
        self.failure: grpc.RpcError | None = None

    def add(self, method: str, request: Any, timeout: float, waiter: W) -> tuple[int, pb.Call]:
        """A new call's id and its message; raises the stream's failure if it ended."""
        with self._lock:
            if self.failure is not None:
                raise copy_error(self.failure)
            call_id = next(self._ids)
            self._calls[call_id] = InFlight(method, waiter)
        return call_id, call_message(call_id, method, request, timeout)

    def settle(self, reply: pb.Reply) -> tuple[W, Any] | None:
        """The waiter of the call ``reply`` answers and its outcome (the response, or
        the error as ``grpc.RpcError``); None for a call no longer waited for."""
        with self._lock:
            self.replied = True
            call = self._calls.pop(reply.id, None)
        if call is None:
            return None
        field = reply.WhichOneof("response")
        if field == "error":
            return call.waiter, status_error(reply.error)
        if field != FIELDS[call.method]:
            return call.waiter, rpc_error(
                grpc.StatusCode.INTERNAL,
                f"the daemon answered {call.method} with a Reply of {field or 'nothing'}",
            )
        return call.waiter, getattr(reply, field)

    def waiting(self, call_id: int) -> bool:
        """Whether call ``call_id``'s caller still waits for it."""
        with self._lock:
            return call_id in self._calls

    def drop(self, call_id: int) -> bool:
        """The caller gave up (its deadline, or its cancellation): True when the call
        was still in flight, and the daemon should be told (``cancel_message``)."""
        with self._lock:
            return self._calls.pop(call_id, None) is not None

    def end(self, failure: grpc.RpcError) -> list[W]:
        """The stream is over with ``failure``: the waiters of every call in flight,
        which each get it (``copy_error``); later calls fail with it too."""
        with self._lock:
            self.failure = failure
            waiters = [c.waiter for c in self._calls.values()]
            self._calls.clear()
        return waiters
