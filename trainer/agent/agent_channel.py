"""The private channel between ``rendezvous-run`` (the node agent) and one worker.

One end of a ``socketpair`` is inherited by the worker; only its descriptor
number travels in the environment (``RENDEZVOUSD_AGENT_FD``). Everything secret —
the 128-byte unique id and the member instance id — travels over the socket, so
it never appears in argv, the environment, a file, or ``/proc``.

A frame is ``!IQ`` (header length, payload length), a UTF-8 JSON header with a
``kind``, then raw payload bytes. Arrays travel as the payload: the header lists
each array's name, dtype, shape and byte count, the bytes follow in that order.
No pickle: a peer can only make this side decode JSON and copy bytes into
arrays of a plain numeric dtype.

The node agent reads frames from processes that run user code, so a frame is
checked before anything is allocated for it: the header's size (``MAX_HEADER``)
and nesting (``MAX_DEPTH``), and the payload's announced size (``MAX_PAYLOAD``).
The payload's buffer then grows only as its bytes arrive: an announced size
costs nothing until it is sent.
"""

from __future__ import annotations

import contextlib
import json
import re
import select
import socket
import struct
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

from rendezvousd.trainer.agent._agent_boot import ENV_AGENT_FD as ENV_AGENT_FD
from rendezvousd.trainer.errors import AgentChannelError

_PREFIX = struct.Struct("!IQ")
MAX_HEADER = 1 << 20
# Headers are shallow (a state's meta and array list); json's own limit is
# Python's recursion limit, which a 1 MiB header can exceed a thousand times over.
MAX_DEPTH = 32
#: The largest step state a worker may hand its agent (the arrays' bytes): the
#: agent keeps a copy in its own memory and hands it to the next generation.
MAX_STATE_BYTES = 64 << 30
# An assign frame carries the state after the id and the instance id.
MAX_PAYLOAD = MAX_STATE_BYTES + 4096
# The payload's buffer starts at this size and at most doubles per read: memory
# follows what arrived, not what the prefix announced.
_FIRST_CHUNK = 64 << 10
# The JSON tokens that open or close a level, and strings (whose brackets do not count).
_LEVELS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)

if TYPE_CHECKING:
    import numpy.typing as npt

# numpy is imported where arrays are (un)packed: the node agent only relays
# frames, and its start-up on a fresh node competes with its spares' (2 cores).
HostArrays: TypeAlias = dict[str, "npt.NDArray[Any]"]


class FrameError(AgentChannelError):
    """A frame no well-behaved peer sends (too large, too deep, not JSON, a field out
    of range): the channel's position is lost and the sender is at fault."""


class ChannelClosed(AgentChannelError):
    """The peer closed the channel in the middle of a frame: it is going away."""


class SendTimedOut(AgentChannelError):
    """``send(within=)`` ran out of time: another sender held the channel, or the peer
    read too little. ``closed``: part of the frame went out, so the channel was closed
    (its framing is lost); else nothing of it did, and the channel is as it was."""

    def __init__(self, message: str, *, closed: bool) -> None:
        super().__init__(message)
        self.closed = closed


@dataclass(frozen=True)
class Frame:
    kind: str
    header: dict[str, Any]
    payload: bytes = field(default=b"", repr=False)


class Channel:
    """Frames over a connected stream socket; ``send`` may be called from any thread."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()
        self._closed = False
        # Why a send closed the channel, set before it did: the reader that wakes up to
        # the closed socket says why, instead of blaming the peer.
        self.cut: str | None = None

    @classmethod
    def from_fd(cls, fd: int) -> Channel:
        sock = socket.socket(fileno=fd)
        sock.set_inheritable(False)  # the worker's own children must not hold it
        return cls(sock)

    def send(
        self,
        kind: str,
        header: Mapping[str, Any] | None = None,
        payload: bytes = b"",
        *,
        within: float | None = None,
    ) -> None:
        """Send one frame. ``within``: give up, with ``SendTimedOut``, once the peer
        has read none of it for that many seconds (a large frame that it keeps reading
        takes as long as it takes), or another sender held the channel that long. When
        part of the frame went out, the channel is then closed, since a frame cut short
        loses its framing. None: wait as long as the peer takes."""
        body = json.dumps({"kind": kind, **(header or {})}).encode("utf-8")
        if len(body) > MAX_HEADER:
            raise AgentChannelError(
                f"channel frame {kind!r}: its header of {len(body)} bytes exceeds "
                f"{MAX_HEADER} bytes (the state's meta and array list must fit)"
            )
        if len(payload) > MAX_PAYLOAD:
            raise AgentChannelError(
                f"channel frame {kind!r}: its payload of {len(payload)} bytes exceeds "
                f"{MAX_PAYLOAD} bytes"
            )
        data = _PREFIX.pack(len(body), len(payload))
        if within is not None:
            self._send_within(kind, data + body + payload, within)
            return
        try:
            with self._send_lock:
                self.sock.sendall(data + body)
                if payload:
                    self.sock.sendall(payload)
        except OSError as exc:
            raise AgentChannelError(f"channel send of {kind!r} failed: {exc}") from exc

    def _send_within(self, kind: str, frame: bytes, within: float) -> None:
        # Without a deadline, a sender blocked on a full socket holds the send lock, and
        # every other sender waits behind it (the agent's main thread, with its abort).
        if not self._send_lock.acquire(timeout=within):
            raise SendTimedOut(
                f"channel send of {kind!r}: another send held the channel for {within:g} s",
                closed=False,
            )
        try:
            view = memoryview(frame)
            deadline = time.monotonic() + within
            while view:
                try:
                    sent = self.sock.send(view, socket.MSG_DONTWAIT)
                    view = view[sent:]
                    deadline = time.monotonic() + within  # the peer reads: it is not stuck
                except BlockingIOError:
                    left = deadline - time.monotonic()
                    if left > 0:
                        select.select([], [self.sock], [], left)
                        continue
                    if len(view) == len(frame):  # the framing is intact: keep the channel
                        raise SendTimedOut(
                            f"channel send of {kind!r}: the peer read nothing for {within:g} s, "
                            "so the frame was not sent",
                            closed=False,
                        ) from None
                    self.cut = (
                        f"channel send of {kind!r}: the peer stopped reading in the middle "
                        f"of the frame for {within:g} s; the channel is closed"
                    )
                    self.close()
                    raise SendTimedOut(self.cut, closed=True) from None
        except OSError as exc:
            raise AgentChannelError(f"channel send of {kind!r} failed: {exc}") from exc
        finally:
            self._send_lock.release()

    def recv(self, timeout: float | None = None) -> Frame | None:
        """The next frame; None at a clean end of stream. ``timeout`` bounds the wait
        for the frame to start (``TimeoutError``); one frame is read from one sender.
        ``FrameError`` for a frame the peer should not have sent, ``ChannelClosed``
        when the peer closed the channel in the middle of one."""
        self.sock.settimeout(timeout)
        try:
            first = self.sock.recv(_PREFIX.size, socket.MSG_PEEK)
        finally:
            self.sock.settimeout(None)
        if not first:
            return None
        head_len, pay_len = _PREFIX.unpack(self._exactly(_PREFIX.size))
        if head_len > MAX_HEADER:
            raise FrameError(f"frame announces a {head_len}-byte header; the limit is {MAX_HEADER}")
        if pay_len > MAX_PAYLOAD:
            raise FrameError(
                f"frame announces a {pay_len}-byte payload; the limit is {MAX_PAYLOAD}"
            )
        header = _decode_header(self._exactly(head_len))
        payload = self._exactly(pay_len) if pay_len else b""
        return Frame(header.pop("kind"), header, payload)

    def _exactly(self, n: int) -> bytes:
        # Grown as bytes arrive (at most doubling), so that a peer announcing more
        # than it sends costs what it sent.
        buf = bytearray(min(n, _FIRST_CHUNK))
        got = 0
        while got < n:
            if got == len(buf):
                buf.extend(bytes(min(n, 2 * got) - got))
            read = self.sock.recv_into(memoryview(buf)[got:], len(buf) - got)
            if read == 0:
                raise ChannelClosed(f"channel closed in the middle of a frame ({got}/{n} bytes)")
            got += read
        return bytes(buf)

    @property
    def closed(self) -> bool:
        """Whether this side closed the channel (a reader's error is then our own doing)."""
        return self._closed

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def drop(self) -> None:
        """Close this process's descriptor only, as a forked child must: a shutdown()
        ends the channel for the process it shares the socket with, too."""
        if self._closed:
            return
        self._closed = True
        self.sock.close()


def _decode_header(body: bytes) -> dict[str, Any]:
    """A frame's JSON header, checked for depth before json sees it."""
    depth = 0
    for token in _LEVELS.finditer(body):
        level = token.group()
        if level in (b"[", b"{"):
            depth += 1
            if depth > MAX_DEPTH:
                raise FrameError(f"frame header nests deeper than {MAX_DEPTH} levels")
        elif level in (b"]", b"}"):
            depth -= 1
    try:
        header = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FrameError(f"frame header is not JSON: {exc}") from exc
    if not isinstance(header, dict) or not isinstance(header.get("kind"), str):
        raise FrameError("frame header has no 'kind'")
    return header


def pack_arrays(arrays: Mapping[str, npt.ArrayLike]) -> tuple[list[dict[str, Any]], bytes]:
    """Host arrays as (header entries, payload)."""
    import numpy as np

    # Here: the node agent imports this module and needs no numpy.
    from rendezvousd.trainer import raw_dtypes

    entries: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for name, value in arrays.items():
        array = np.ascontiguousarray(value)
        if array.dtype.hasobject or array.dtype.fields is not None:
            raise AgentChannelError(
                f"state array {name!r} has dtype {array.dtype}; only plain numeric dtypes travel"
            )
        if not raw_dtypes.known(array.dtype):
            raise AgentChannelError(
                f"state array {name!r} has dtype {array.dtype.name}, which travels as raw "
                "bytes and could not be restored as that type (not an ml_dtypes type); "
                "hand it over as a numpy dtype (e.g. float32)"
            )
        data = array.tobytes()
        entry: dict[str, Any] = {"name": name, "dtype": array.dtype.str}
        entry.update(shape=list(array.shape), nbytes=len(data))
        if raw_dtypes.is_raw(array.dtype):
            # dtype.str says only "<V2": the name is what gives bfloat16 back.
            entry["type"] = array.dtype.name
        entries.append(entry)
        chunks.append(data)
    return entries, b"".join(chunks)


def unpack_arrays(entries: Any, payload: bytes) -> HostArrays:
    """The arrays ``pack_arrays`` described; AgentChannelError if the two disagree."""
    import numpy as np

    from rendezvousd.trainer import raw_dtypes  # see pack_arrays

    if not isinstance(entries, list):
        raise AgentChannelError("state frame has no array list")
    out: HostArrays = {}
    offset = 0
    try:
        for entry in entries:
            dtype = np.dtype(str(entry["dtype"]))
            if dtype.hasobject or dtype.fields is not None:
                raise AgentChannelError(f"state array dtype {dtype} is not a plain numeric dtype")
            shape = tuple(int(d) for d in entry["shape"])
            nbytes = int(entry["nbytes"])
            chunk = payload[offset : offset + nbytes]
            if len(chunk) != nbytes:
                raise AgentChannelError("state frame payload is shorter than its array list")
            array = np.frombuffer(chunk, dtype=dtype).reshape(shape).copy()
            if "type" in entry:
                restored = raw_dtypes.typed(array, str(entry["type"]))
                if restored is None:
                    raise AgentChannelError(
                        f"state array {str(entry['name'])[:40]!r} is of type "
                        f"{str(entry['type'])[:40]}, which this worker cannot restore; "
                        "install ml_dtypes in its environment"
                    )
                array = restored
            out[str(entry["name"])] = array
            offset += nbytes
    except (KeyError, TypeError, ValueError) as exc:
        raise AgentChannelError(f"state frame array list is malformed: {exc}") from exc
    if offset != len(payload):
        raise AgentChannelError("state frame payload is longer than its array list")
    return out
