"""Wire format and rank 0's server for the file transport (one node, one UNIX socket).

A frame is a 4-byte big-endian length and a UTF-8 JSON object. Requests carry an
integer ``id`` that the reply echoes: ``{"id", "ok": true, ...}`` or ``{"id",
"error": {"kind", "message", "reason", "metadata"}}``. The server also pushes
``{"event": "PEER_FAILED" | "REFUSED", "error": {...}}`` unprompted. Bytes travel base64-encoded and
are decoded straight into memory: nothing here writes to disk but the socket.

The socket code is hand-written on purpose: no library does same-uid (SO_PEERCRED)
UNIX-socket rendezvous, and gRPC over a UNIX socket would still need this peer check.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import logging
import math
import os
import secrets
import selectors
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rendezvousd.client.errors import (
    AuthenticationError,
    DuplicateRank,
    InvalidRequest,
    JobEnded,
    KeyNotFound,
    LimitExceeded,
    PeerFailed,
    ProtocolError,
    RendezvousError,
    RendezvousTimeout,
    TopologyMismatch,
)

log = logging.getLogger("rendezvousd.client.file")

GENERATION = 1
MAX_FRAME_BYTES = 32 * 1024 * 1024
MAX_VALUE_BYTES = 16 * 1024 * 1024
MAX_KEY_BYTES = 512
# Linux sun_path is 108 bytes including the terminating NUL.
MAX_SOCKET_PATH_BYTES = 107
# A stalled reader must not freeze the server for everyone else.
_SEND_TIMEOUT_S = 10.0
_HEADER = struct.Struct(">I")
_UCRED = struct.Struct("3i")

Message = dict[str, Any]

# Errors that may cross the wire, by class name; anything else becomes ProtocolError.
ERRORS: dict[str, type[RendezvousError]] = {
    cls.__name__: cls
    for cls in (
        AuthenticationError,
        DuplicateRank,
        InvalidRequest,
        JobEnded,
        KeyNotFound,
        LimitExceeded,
        PeerFailed,
        ProtocolError,
        RendezvousTimeout,
        TopologyMismatch,
    )
}


# -- framing and fields --------------------------------------------------------


def encode(message: Mapping[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME_BYTES:
        raise LimitExceeded(
            f"file-transport frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}",
            reason="LIMIT_EXCEEDED",
            metadata={"limit": "max_frame_bytes"},
        )
    return _HEADER.pack(len(body)) + body


class FrameReader:
    """Turns a byte stream into messages; raises ProtocolError on garbage."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Message]:
        self._buf += data
        out: list[Message] = []
        while len(self._buf) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self._buf)
            if size > MAX_FRAME_BYTES:
                raise ProtocolError(f"frame of {size} bytes exceeds {MAX_FRAME_BYTES}")
            if len(self._buf) < _HEADER.size + size:
                break
            body = bytes(self._buf[_HEADER.size : _HEADER.size + size])
            del self._buf[: _HEADER.size + size]
            try:
                message = json.loads(body)
            except (UnicodeDecodeError, ValueError):
                # Never echo the body: it may hold the id or a value.
                raise ProtocolError("frame is not valid UTF-8 JSON") from None
            if not isinstance(message, dict):
                raise ProtocolError("frame is not a JSON object")
            out.append(message)
        return out


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def get_int(m: Message, key: str) -> int:
    value = m.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProtocolError(f"field {key!r} must be an integer")
    return value


def get_float(m: Message, key: str) -> float:
    value = m.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ProtocolError(f"field {key!r} must be a number")
    return float(value)


def get_wait(m: Message) -> float:
    """The ``timeout`` field as seconds to wait: finite, positive, at most a day."""
    value = get_float(m, "timeout")
    if not math.isfinite(value) or value <= 0:
        raise InvalidRequest("timeout must be a positive number of seconds")
    return min(value, 86_400.0)


def get_str(m: Message, key: str) -> str:
    value = m.get(key)
    if not isinstance(value, str):
        raise ProtocolError(f"field {key!r} must be a string")
    return value


def get_bool(m: Message, key: str) -> bool:
    value = m.get(key)
    if not isinstance(value, bool):
        raise ProtocolError(f"field {key!r} must be a boolean")
    return value


def get_bytes(m: Message, key: str) -> bytes:
    try:
        return base64.b64decode(get_str(m, key), validate=True)
    except binascii.Error:
        raise ProtocolError(f"field {key!r} must be base64") from None


def error_to_wire(exc: RendezvousError) -> Message:
    return {
        "kind": type(exc).__name__,
        "message": exc.message,
        "reason": exc.reason,
        "metadata": exc.metadata,
    }


def error_from_wire(raw: object, *, endpoint: str, method: str, job_id: str) -> RendezvousError:
    if not isinstance(raw, dict):
        return ProtocolError("malformed error frame from the file-transport server")
    metadata = raw.get("metadata")
    cls = ERRORS.get(str(raw.get("kind")), ProtocolError)
    return cls(
        str(raw.get("message", "")),
        reason=str(raw.get("reason", "")),
        metadata={str(k): str(v) for k, v in metadata.items()}
        if isinstance(metadata, dict)
        else {},
        endpoint=endpoint,
        method=method,
        job_id=job_id,
    )


def peer_ids(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a connected UNIX socket."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        raise InvalidRequest("the file transport needs SO_PEERCRED (Linux); use the daemon")
    pid, uid, _gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, option, _UCRED.size))
    return pid, uid


def check_socket_path(path: Path) -> None:
    if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES - 16:
        raise InvalidRequest(
            f"rendezvous socket path {path} is too long for a UNIX socket "
            f"(keep it under {MAX_SOCKET_PATH_BYTES - 16} bytes); use a shorter directory"
        )


def unlink_if(path: Path, identity: tuple[int, int]) -> None:
    """Remove ``path`` only if it is still the socket we created."""
    with contextlib.suppress(OSError):
        st = os.lstat(path)
        if (st.st_dev, st.st_ino) == identity:
            os.unlink(path)


# -- rank 0's server -------------------------------------------------------------


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    pid: int
    reader: FrameReader = field(default_factory=FrameReader)
    rank: int | None = None
    left: bool = False


@dataclass(frozen=True)
class _Member:
    host: str
    address: str
    conn: _Conn


@dataclass(eq=False)
class _Waiter:
    conn: _Conn
    req_id: int
    kind: str  # "join", "barrier" or "kv"
    key: Any
    deadline: float


class FileServer:
    """Serves one job on a background thread; state is touched only by that thread."""

    def __init__(self, path: Path, job_id: str, gpus_per_node: int, unique_id: bytes) -> None:
        self.path = path
        self.job_id = job_id
        self.world_size = gpus_per_node
        self._id = unique_id
        self._members: dict[int, _Member] = {}
        self._conns: dict[socket.socket, _Conn] = {}
        self._waiters: list[_Waiter] = []
        self._arrived: dict[tuple[str, int], set[int]] = {}
        self._kv: dict[str, bytes] = {}
        self._complete = False
        self._failure: Message | None = None
        self._doomed: list[_Conn] = []
        self._present: frozenset[int] = frozenset()
        self._all_left = threading.Event()
        self._stopping = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._listener: socket.socket | None = None
        self._identity = (0, 0)
        self._sel = selectors.DefaultSelector()
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"FileServer(path={str(self.path)!r}, job_id={self.job_id!r}, world_size={self.world_size})"

    # -- lifetime (called from the owner's thread) ----------------------------

    def start(self) -> bool:
        """Publish the socket; False when a live server already holds the path."""
        check_socket_path(self.path)
        if not self.path.parent.is_dir():
            raise InvalidRequest(
                f"directory {self.path.parent} for the rendezvous socket does not exist"
            )
        # Listen on a private name first, then hard-link it into place: link() fails
        # if the path exists, so the published socket is always already listening
        # and a refused connection reliably means a stale socket.
        tmp = self.path.with_name(f".{self.path.name}.{secrets.token_hex(4)}.tmp")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # process-wide, but only for the instant of bind()
        try:
            listener.bind(str(tmp))
        except OSError as exc:
            listener.close()
            self._discard()
            raise InvalidRequest(
                f"cannot create a socket in {self.path.parent}: {exc.strerror}"
            ) from exc
        finally:
            os.umask(old)
        try:
            listener.listen(max(16, 2 * self.world_size))
            st = os.lstat(tmp)
            if stat.S_IMODE(st.st_mode) & 0o077:
                raise InvalidRequest(f"socket {tmp} came out group/other accessible; refusing")
            for _ in range(3):
                try:
                    os.link(tmp, self.path)
                    break
                except FileExistsError:
                    if not self._clear_stale():
                        listener.close()
                        self._discard()
                        return False
                except OSError as exc:
                    raise InvalidRequest(
                        f"cannot publish the rendezvous socket at {self.path}: {exc.strerror}"
                    ) from exc
            else:
                raise InvalidRequest(f"{self.path} keeps reappearing; is another rank 0 starting?")
        except BaseException:
            listener.close()
            self._discard()
            raise
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        self._identity = (st.st_dev, st.st_ino)
        self._listener = listener
        listener.setblocking(False)
        self._sel.register(listener, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(
            target=self._run, daemon=True, name=f"file-rendezvous-{self.job_id}"
        )
        self._thread.start()
        return True

    def _discard(self) -> None:
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()

    def _clear_stale(self) -> bool:
        """Remove a dead socket at the path; False if a live one answers there."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return True
        if not stat.S_ISSOCK(st.st_mode):
            raise InvalidRequest(
                f"{self.path} exists and is not a socket; refusing to replace it "
                "(give the file transport an unused path or a directory)"
            )
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(2.0)
        try:
            probe.connect(str(self.path))
        except ConnectionRefusedError:
            log.info("removing stale rendezvous socket %s", self.path)
            unlink_if(self.path, (st.st_dev, st.st_ino))
            return True
        except FileNotFoundError:
            return True
        except OSError:
            return False
        finally:
            probe.close()
        return False

    def stop(self) -> None:
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10.0)

    def wait_all_left(self, timeout: float) -> list[int]:
        """Wait until every member has left or the job failed; the ranks still in."""
        self._all_left.wait(timeout)
        return sorted(self._present)

    # -- the loop -------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                for key, _ in self._sel.select(self._next_timeout()):
                    if isinstance(key.data, _Conn):
                        self._readable(key.data)
                    elif key.fileobj is self._listener:
                        self._accept()
                    else:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(64)
                    self._reap()
                self._expire(time.monotonic())
                self._reap()
        except Exception:
            log.exception("file-transport server for job %r crashed", self.job_id)
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        for conn in list(self._conns.values()):
            conn.sock.close()
        self._conns.clear()
        if self._listener is not None:
            self._listener.close()
            unlink_if(self.path, self._identity)
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()
        self._all_left.set()

    def _next_timeout(self) -> float | None:
        if not self._waiters:
            return None
        return max(0.0, min(w.deadline for w in self._waiters) - time.monotonic())

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        try:
            pid, uid = peer_ids(sock)
        except (OSError, RendezvousError):
            sock.close()
            return
        if uid != os.getuid():
            log.warning("refused a rendezvous connection from uid %d (pid %d)", uid, pid)
            refusal = AuthenticationError(
                f"the rendezvous server at {self.path} accepts only its own user's processes "
                f"(uid {os.getuid()}), not uid {uid}",
                reason="PEER_UID",
            )
            with contextlib.suppress(OSError):
                sock.settimeout(1.0)
                sock.sendall(encode({"event": "REFUSED", "error": error_to_wire(refusal)}))
            sock.close()
            return
        sock.settimeout(_SEND_TIMEOUT_S)
        conn = _Conn(sock, pid)
        self._conns[sock] = conn
        self._sel.register(sock, selectors.EVENT_READ, conn)

    def _readable(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(1 << 16)
        except OSError:
            data = b""
        if not data:
            self._doomed.append(conn)
            return
        try:
            messages = conn.reader.feed(data)
        except ProtocolError as exc:
            log.warning("dropping rendezvous connection from pid %d: %s", conn.pid, exc.message)
            self._doomed.append(conn)
            return
        for message in messages:
            self._handle(conn, message)

    def _send(self, conn: _Conn, message: Message) -> None:
        if conn.sock.fileno() < 0:
            return
        try:
            conn.sock.sendall(encode(message))
        except OSError:
            self._doomed.append(conn)

    def _reply(self, conn: _Conn, req_id: int, **fields: Any) -> None:
        self._send(conn, {"id": req_id, "ok": True, **fields})

    def _error(self, conn: _Conn, req_id: int, exc: RendezvousError) -> None:
        self._send(conn, {"id": req_id, "error": error_to_wire(exc)})

    def _reap(self) -> None:
        while self._doomed:
            conn = self._doomed.pop()
            if self._conns.pop(conn.sock, None) is None:
                continue
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(conn.sock)
            conn.sock.close()
            self._waiters = [w for w in self._waiters if w.conn is not conn]
            if conn.rank is not None and not conn.left:
                cause = "connection closed before leave"
                self._fail(conn.rank, self._members[conn.rank].host, cause)
            self._update_present()

    def _update_present(self) -> None:
        self._present = frozenset(r for r, m in self._members.items() if not m.conn.left)
        if self._failure is not None or (self._complete and not self._present):
            self._all_left.set()

    # -- requests -------------------------------------------------------------

    def _handle(self, conn: _Conn, message: Message) -> None:
        req_id = message.get("id")
        if not isinstance(req_id, int) or isinstance(req_id, bool):
            self._doomed.append(conn)
            return
        op = message.get("op")
        handler = {
            "JOIN": self._join,
            "BARRIER": self._barrier,
            "KV_SET": self._kv_set,
            "KV_GET": self._kv_get,
            "LEAVE": self._leave,
        }.get(op if isinstance(op, str) else "")
        try:
            if handler is None:
                raise ProtocolError(f"unknown file-transport operation {str(op)[:32]!r}")
            handler(conn, req_id, message)
        except RendezvousError as exc:
            self._error(conn, req_id, exc)
        except Exception:
            # One bad request must not take the whole job down with the server.
            log.exception("file-transport server failed on a %s request", str(op)[:32])
            self._error(
                conn, req_id, ProtocolError("the file-transport server hit an internal error")
            )

    def _peer_failed(self) -> PeerFailed:
        assert self._failure is not None
        f = self._failure
        return PeerFailed(
            f"job {self.job_id!r} generation {GENERATION} failed: lost rank {f['ranks'][0]} "
            f"on {f['hosts'][0]} ({f['cause']})",
            reason="PEER_FAILED",
            metadata={
                "ranks": ",".join(map(str, f["ranks"])),
                "hosts": ",".join(f["hosts"]),
                "generation": str(GENERATION),
            },
        )

    def _member_rank(self, conn: _Conn) -> int:
        if self._failure is not None:
            raise self._peer_failed()
        if conn.rank is None or not self._complete:
            raise InvalidRequest(f"not joined to job {self.job_id!r}: call join() first")
        if conn.left:
            raise JobEnded(f"rank {conn.rank} already left job {self.job_id!r}")
        return conn.rank

    def _join(self, conn: _Conn, req_id: int, m: Message) -> None:
        job_id, local_rank = get_str(m, "job_id"), get_int(m, "local_rank")
        num_nodes, gpus = get_int(m, "num_nodes"), get_int(m, "gpus_per_node")
        host, address = _clean(get_str(m, "host"), 255), _clean(get_str(m, "address"), 1024)
        wait = get_wait(m)
        if job_id != self.job_id:
            raise InvalidRequest(
                f"the rendezvous socket at {self.path} serves job {self.job_id!r}, not {job_id!r}"
            )
        if self._failure is not None:
            raise self._peer_failed()
        if conn.rank is not None:
            raise InvalidRequest(f"this connection already joined as rank {conn.rank}")
        if (num_nodes, gpus) != (1, self.world_size):
            raise TopologyMismatch(
                f"job {self.job_id!r} has topology num_nodes=1 gpus_per_node={self.world_size}; "
                f"this worker asked for num_nodes={num_nodes} gpus_per_node={gpus}",
                reason="TOPOLOGY_MISMATCH",
            )
        if not 0 <= local_rank < self.world_size:
            raise InvalidRequest(
                f"local_rank={local_rank} is out of range for gpus_per_node={self.world_size}"
            )
        holder = self._members.get(local_rank)
        if holder is not None or (local_rank == 0 and conn.pid != os.getpid()):
            by = f"pid {holder.conn.pid}" if holder else f"the process that created {self.path}"
            raise DuplicateRank(
                f"local_rank {local_rank} of job {self.job_id!r} is already held by {by}",
                reason="DUPLICATE_RANK",
            )
        conn.rank = local_rank
        self._members[local_rank] = _Member(host, address, conn)
        self._update_present()
        self._waiters.append(_Waiter(conn, req_id, "join", None, time.monotonic() + wait))
        if len(self._members) == self.world_size:
            self._complete = True
            table = [
                {"rank": r, "local_rank": r, "host": mm.host, "address": mm.address}
                for r, mm in sorted(self._members.items())
            ]
            for w in self._take(lambda w: w.kind == "join"):
                self._reply(
                    w.conn,
                    w.req_id,
                    rank=w.conn.rank,
                    world_size=self.world_size,
                    generation=GENERATION,
                    unique_id=b64(self._id),
                    members=table,
                )

    def _barrier(self, conn: _Conn, req_id: int, m: Message) -> None:
        rank = self._member_rank(conn)
        key = (_clean(get_str(m, "name"), 256), get_int(m, "sequence"))
        wait = get_wait(m)
        arrived = self._arrived.setdefault(key, set())
        arrived.add(rank)
        self._waiters.append(_Waiter(conn, req_id, "barrier", key, time.monotonic() + wait))
        if len(arrived) == self.world_size:
            del self._arrived[key]
            for w in self._take(lambda w: w.kind == "barrier" and w.key == key):
                self._reply(w.conn, w.req_id)

    def _kv_set(self, conn: _Conn, req_id: int, m: Message) -> None:
        self._member_rank(conn)
        key, value = _key(get_str(m, "key")), get_bytes(m, "value")
        if len(value) > MAX_VALUE_BYTES:
            raise LimitExceeded(
                f"value of {len(value)} bytes exceeds max_value_bytes={MAX_VALUE_BYTES}",
                reason="LIMIT_EXCEEDED",
                metadata={"limit": "max_value_bytes"},
            )
        self._kv[key] = value
        self._reply(conn, req_id)
        for w in self._take(lambda w: w.kind == "kv" and w.key == key):
            self._reply(w.conn, w.req_id, value=b64(value))

    def _kv_get(self, conn: _Conn, req_id: int, m: Message) -> None:
        self._member_rank(conn)
        key, wait = _key(get_str(m, "key")), get_bool(m, "wait")
        if key in self._kv:
            self._reply(conn, req_id, value=b64(self._kv[key]))
        elif not wait:
            raise KeyNotFound(
                f"key {key!r} is not set in job {self.job_id!r}", reason="KEY_NOT_FOUND"
            )
        else:
            deadline = time.monotonic() + get_wait(m)
            self._waiters.append(_Waiter(conn, req_id, "kv", key, deadline))

    def _leave(self, conn: _Conn, req_id: int, m: Message) -> None:
        if conn.rank is None:
            raise InvalidRequest(f"not joined to job {self.job_id!r}")
        conn.left = True
        self._waiters = [w for w in self._waiters if w.conn is not conn]
        self._reply(conn, req_id)
        self._update_present()

    # -- waits and failure ------------------------------------------------------

    def _take(self, match: Callable[[_Waiter], bool]) -> list[_Waiter]:
        taken = [w for w in self._waiters if match(w)]
        self._waiters = [w for w in self._waiters if not match(w)]
        return taken

    def _expire(self, now: float) -> None:
        for w in self._take(lambda w: w.deadline <= now):
            if w.kind == "join":
                missing = sorted(set(range(self.world_size)) - set(self._members))
                # Free the slot: the worker's join() failed, so it may try again.
                if w.conn.rank is not None:
                    self._members.pop(w.conn.rank, None)
                    w.conn.rank = None
                    self._update_present()
                what, reason = (
                    f"the world (missing local ranks {_ranks(missing)})",
                    "WORLD_INCOMPLETE",
                )
            elif w.kind == "barrier":
                missing = sorted(set(range(self.world_size)) - self._arrived.get(w.key, set()))
                what, reason = (
                    f"barrier {w.key[0]!r} (missing ranks {_ranks(missing)})",
                    "BARRIER_TIMEOUT",
                )
            else:
                missing = []
                what, reason = f"key {w.key!r}", "KEY_WAIT_TIMEOUT"
            self._error(
                w.conn,
                w.req_id,
                RendezvousTimeout(
                    f"timed out waiting for {what} in job {self.job_id!r}",
                    reason=reason,
                    metadata={"ranks": ",".join(map(str, missing))} if missing else {},
                ),
            )

    def _fail(self, rank: int, host: str, cause: str) -> None:
        if self._failure is not None:
            return
        log.warning("job %r: lost rank %d on %s (%s)", self.job_id, rank, host, cause)
        self._failure = {"ranks": [rank], "hosts": [host], "cause": cause}
        error = self._peer_failed()
        for w in self._take(lambda w: True):
            self._error(w.conn, w.req_id, error)
        event = {"event": "PEER_FAILED", "error": error_to_wire(error)}
        for conn in list(self._conns.values()):
            if conn.rank is not None and not conn.left:
                self._send(conn, event)
        self._all_left.set()


def _key(key: str) -> str:
    if not key or len(key.encode()) > MAX_KEY_BYTES or any(ord(c) < 32 or c == "\x7f" for c in key):
        raise InvalidRequest(f"key must be 1-{MAX_KEY_BYTES} bytes without control characters")
    return key


def _clean(text: str, limit: int) -> str:
    """Peer-supplied text ends up in logs and messages: no control characters."""
    return "".join(c if c.isprintable() else "?" for c in text[:limit])


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:16]))
    return shown + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")
