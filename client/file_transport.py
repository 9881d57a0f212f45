"""``FileRendezvous``: the seed's single-node "file" transport, without a file.

The seed wrote the 128-byte unique id into a shared directory. That id is a
bearer credential for the NCCL world, so here global rank 0 instead serves it
from memory over a UNIX socket at the shared path (mode 0600, same-uid peers
only, checked with SO_PEERCRED in both directions). Everything a worker sees
(rank, id, member table, barriers, keys) matches ``RendezvousClient``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from rendezvousd.client._file_wire import (
    GENERATION,
    FileServer,
    FrameReader,
    Message,
    b64,
    check_socket_path,
    encode,
    error_from_wire,
    get_bytes,
    get_int,
    get_str,
    peer_ids,
)
from rendezvousd.client._session import UNIQUE_ID_BYTES, rank_zero_id
from rendezvousd.client.errors import (
    AuthenticationError,
    InvalidRequest,
    PeerFailed,
    ProtocolError,
    RendezvousError,
    RendezvousTimeout,
)
from rendezvousd.client.membership import Member, Membership

log = logging.getLogger("rendezvousd.client.file")

DEFAULT_JOB_ID = "default"
_JOB_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
# Extra wait beyond a call's own timeout so the server's answer (naming the
# missing ranks) arrives before the client gives up on it.
_SLACK_S = 2.0


@dataclass(eq=False)
class _Pending:
    op: str
    done: threading.Event = field(default_factory=threading.Event)
    reply: Message | None = field(default=None, repr=False)  # may hold the id
    error: RendezvousError | None = None


class FileRendezvous:
    """Single-node rendezvous over a UNIX socket that global rank 0 serves.

    ``path`` is the socket path, or an existing directory in which the socket is
    named ``<job_id>.sock``. Every worker of the job must be given the same one.
    """

    def __init__(
        self,
        path: str | Path,
        job_id: str = "",
        *,
        call_timeout: float = 30.0,
        leave_timeout: float = 60.0,
    ) -> None:
        job = job_id or DEFAULT_JOB_ID
        if not _JOB_ID.fullmatch(job) or job in (".", ".."):
            raise InvalidRequest(
                "job id is invalid: use 1-128 characters from [A-Za-z0-9._-]", job_id=job[:40]
            )
        base = Path(path)
        self._path = base / f"{job}.sock" if base.is_dir() else base
        check_socket_path(self._path)
        self._job_id = job
        self._call_timeout = call_timeout
        self._leave_timeout = leave_timeout
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._next_id = 0
        self._sock: socket.socket | None = None
        self._reader: threading.Thread | None = None
        self._server: FileServer | None = None
        self._joined: Membership | None = None
        self._leaving = False
        self._closing = False
        self._closed = False
        self._failure: RendezvousError | None = None
        self._conn_error: RendezvousError | None = None
        self._failed = threading.Event()
        self._barrier_counts: dict[str, int] = {}
        self._on_failure: Callable[[RendezvousError], None] | None = None
        self._hb_stop = threading.Event()
        self._hb_thread: threading.Thread | None = None

    def __repr__(self) -> str:
        rank = self._joined.rank if self._joined else None
        return f"FileRendezvous(path={str(self._path)!r}, job_id={self._job_id!r}, rank={rank})"

    @property
    def path(self) -> Path:
        return self._path

    @property
    def endpoint(self) -> str:
        return f"unix:{self._path}"

    @property
    def membership(self) -> Membership | None:
        return self._joined

    @property
    def failure(self) -> RendezvousError | None:
        return self._failure

    # -- membership -------------------------------------------------------------

    def join(
        self,
        *,
        num_nodes: int,
        gpus_per_node: int,
        local_rank: int,
        node_rank: int | None = None,
        host: str | None = None,
        address: str = "",
        unique_id: bytes | None = None,
        id_factory: Callable[[], bytes] | None = None,
        timeout: float = 600.0,
    ) -> Membership:
        """Connect to rank 0's socket (rank 0 creates it) and wait for the world.

        Global rank 0 provides the id: ``unique_id``, else ``id_factory()``, else
        128 random bytes. It stays in rank 0's memory and on the socket only.
        """
        if num_nodes != 1 or node_rank not in (None, 0):
            raise InvalidRequest(
                f"the file transport is single-node (num_nodes={num_nodes}, node_rank="
                f"{node_rank}); use the daemon transport (RendezvousClient) for multi-node jobs",
                job_id=self._job_id,
            )
        if gpus_per_node < 1 or not 0 <= local_rank < gpus_per_node:
            raise InvalidRequest(
                f"local_rank={local_rank} is out of range for gpus_per_node={gpus_per_node}",
                job_id=self._job_id,
            )
        if not timeout > 0:
            raise InvalidRequest(f"join timeout={timeout} must be positive", job_id=self._job_id)
        if self._sock is not None or self._closed:
            raise InvalidRequest(
                "this FileRendezvous is already joined (or was closed); make a new one",
                job_id=self._job_id,
            )
        self._failure, self._conn_error = None, None
        self._leaving, self._closing, self._barrier_counts = False, False, {}
        self._failed.clear()
        deadline = time.monotonic() + timeout
        if local_rank == 0:
            uid = rank_zero_id(unique_id, id_factory)
            _check_id(uid)
            server = FileServer(self._path, self._job_id, gpus_per_node, uid)
            if server.start():
                self._server = server
            # else a live server holds the path: join it and let it refuse a second rank 0.
        try:
            self._sock = self._connect(deadline, local_rank)
            self._reader = threading.Thread(
                target=self._read_loop,
                args=(self._sock,),
                daemon=True,
                name=f"file-rendezvous-reader-{self._job_id}-{local_rank}",
            )
            self._reader.start()
            reply = self._request(
                "JOIN",
                {
                    "job_id": self._job_id,
                    "num_nodes": num_nodes,
                    "gpus_per_node": gpus_per_node,
                    "local_rank": local_rank,
                    "host": host or socket.gethostname(),
                    "address": address,
                    "timeout": max(0.001, deadline - time.monotonic()),
                },
                wait=max(0.001, deadline - time.monotonic()),
            )
            self._joined = self._membership(reply)
        except BaseException:
            self._disconnect()
            self._stop_server()
            raise
        return self._joined

    def _membership(self, reply: Message) -> Membership:
        unique_id = get_bytes(reply, "unique_id")
        _check_id(unique_id)
        rank = get_int(reply, "rank")
        raw = reply.get("members")
        if not isinstance(raw, list) or not all(isinstance(m, dict) for m in raw):
            raise ProtocolError("JOIN reply has no member table")
        members = tuple(
            Member(
                get_int(m, "rank"),
                0,
                get_int(m, "local_rank"),
                get_str(m, "host"),
                get_str(m, "address"),
            )
            for m in raw
        )
        return Membership(
            job_id=self._job_id,
            generation=get_int(reply, "generation"),
            rank=rank,
            world_size=get_int(reply, "world_size"),
            node_rank=0,
            local_rank=rank,
            unique_id=unique_id,
            _table=members,
        )

    def _connect(self, deadline: float, local_rank: int) -> socket.socket:
        delay = 0.01
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(max(0.05, min(5.0, deadline - time.monotonic())))
            try:
                sock.connect(str(self._path))
            except (FileNotFoundError, ConnectionRefusedError, TimeoutError):
                sock.close()  # not published yet, or a stale socket rank 0 will replace
            except OSError as exc:
                sock.close()
                raise InvalidRequest(
                    f"cannot connect to the rendezvous socket at {self._path}: {exc.strerror}",
                    job_id=self._job_id,
                ) from exc
            else:
                pid, uid = peer_ids(sock)
                if uid != os.getuid():
                    sock.close()
                    raise AuthenticationError(
                        f"the rendezvous socket at {self._path} is served by uid {uid} (pid "
                        f"{pid}), not by this user; refusing to trust it",
                        endpoint=self.endpoint,
                        job_id=self._job_id,
                    )
                sock.settimeout(self._call_timeout)
                return sock
            if time.monotonic() + delay >= deadline:
                raise RendezvousTimeout(
                    f"rank 0 never published the rendezvous socket at {self._path} for job "
                    f"{self._job_id!r} (local_rank {local_rank} waited); check that local_rank 0 "
                    "is running with the same path",
                    reason="WORLD_INCOMPLETE",
                    metadata={"ranks": "0"},
                    endpoint=self.endpoint,
                    method="Join",
                    job_id=self._job_id,
                )
            time.sleep(delay)
            delay = min(0.2, delay * 2)

    def barrier(self, name: str = "default", *, timeout: float | None = None) -> None:
        self._member()
        wait = timeout or self._call_timeout
        self._barrier_counts[name] = sequence = self._barrier_counts.get(name, 0) + 1
        self._request("BARRIER", {"name": name, "sequence": sequence, "timeout": wait}, wait=wait)

    def leave(self) -> None:
        """Say goodbye; rank 0 then waits (bounded) for the others before closing."""
        m = self._joined
        said_goodbye = False
        try:
            if m is not None and self._failure is None:
                # Set first: rank 0 may close the socket right after our last goodbye.
                self._leaving = True
                self._request("LEAVE", {}, wait=self._call_timeout)
                said_goodbye = True
        finally:
            self._leaving = True
            self._joined = None
            self._stop_heartbeat()
            try:
                if said_goodbye and self._server is not None and self._failure is None:
                    still = self._server.wait_all_left(self._leave_timeout)
                    if still:
                        log.warning(
                            "job %r: closing the rendezvous socket %s while ranks %s have not "
                            "left after %g s",
                            self._job_id,
                            self._path,
                            still,
                            self._leave_timeout,
                        )
            finally:
                self._stop_server()
                self._disconnect()

    def raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure

    # -- key-value store ----------------------------------------------------------

    def kv_set(self, key: str, value: bytes) -> None:
        self._member()
        self._request("KV_SET", {"key": key, "value": b64(bytes(value))}, wait=self._call_timeout)

    def kv_get(self, key: str, *, wait: bool = True, timeout: float | None = None) -> bytes:
        self._member()
        limit = timeout or self._call_timeout
        reply = self._request("KV_GET", {"key": key, "wait": wait, "timeout": limit}, wait=limit)
        return get_bytes(reply, "value")

    # -- failure watch ----------------------------------------------------------------

    def start_heartbeat(
        self, interval: float = 1.0, on_failure: Callable[[RendezvousError], None] | None = None
    ) -> None:
        """Watch for failure on a daemon thread; ``on_failure`` runs on that thread.

        Nothing is sent: the reader thread sees a lost peer (the server's event)
        or a dead rank 0 (end of stream) at once. ``interval`` bounds how long
        stopping the watcher takes.
        """
        m = self._member()
        self._stop_heartbeat()
        self._on_failure = on_failure
        self._hb_stop.clear()
        self._hb_thread = threading.Thread(
            target=self._watch,
            args=(max(0.01, interval),),
            daemon=True,
            name=f"file-rendezvous-watch-{m.job_id}-{m.rank}",
        )
        self._hb_thread.start()

    def _watch(self, interval: float) -> None:
        while not self._hb_stop.is_set():
            if self._failed.wait(interval):
                callback, failure = self._on_failure, self._failure
                if callback is not None and failure is not None and not self._hb_stop.is_set():
                    callback(failure)
                return

    def _stop_heartbeat(self) -> None:
        self._hb_stop.set()
        thread, self._hb_thread = self._hb_thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)

    # -- plumbing -----------------------------------------------------------------------

    def _member(self) -> Membership:
        if self._failure is not None:
            raise self._failure
        if self._joined is None:
            raise InvalidRequest(
                f"not joined to job {self._job_id!r}: call join() first", job_id=self._job_id
            )
        return self._joined

    def _request(self, op: str, fields: dict[str, Any], *, wait: float) -> Message:
        sock = self._sock
        if sock is None:
            raise InvalidRequest(f"not connected to job {self._job_id!r}", job_id=self._job_id)
        pending = _Pending(op)
        with self._lock:
            # Checked under the lock: the reader may have just finished everyone off.
            dead = self._failure or self._conn_error
            if dead is not None:
                raise dead
            self._next_id += 1
            req_id = self._next_id
            self._pending[req_id] = pending
        try:
            frame = encode({"id": req_id, "op": op, **fields})
            try:
                with self._send_lock:
                    sock.sendall(frame)
            except OSError:
                pass  # the reader thread reports why the connection went away
            if not pending.done.wait(wait + _SLACK_S):
                raise RendezvousTimeout(
                    f"{op} got no answer from rank 0's rendezvous server at {self._path} within "
                    f"{wait + _SLACK_S:g} s (job {self._job_id!r})",
                    endpoint=self.endpoint,
                    method=op,
                    job_id=self._job_id,
                    rank=self._rank(),
                )
        finally:
            with self._lock:
                self._pending.pop(req_id, None)
        if pending.error is not None:
            raise pending.error
        assert pending.reply is not None
        return pending.reply

    def _rank(self) -> int | None:
        return self._joined.rank if self._joined else None

    def _read_loop(self, sock: socket.socket) -> None:
        reader = FrameReader()
        while True:
            try:
                data = sock.recv(1 << 16)
            except TimeoutError:
                continue
            except OSError:
                data = b""
            if not data:
                break
            try:
                messages = reader.feed(data)
            except ProtocolError as exc:
                self._fail(exc)
                return
            for message in messages:
                self._dispatch(message)
        if self._closing or self._leaving:
            self._finish_all(ProtocolError("the rendezvous connection was closed"))
        else:
            self._fail(
                PeerFailed(
                    f"job {self._job_id!r} generation {GENERATION} failed: lost rank 0 "
                    f"(its rendezvous server at {self._path} closed the connection: rank 0 exited "
                    "or closed the rendezvous)",
                    reason="PEER_FAILED",
                    metadata={
                        "ranks": "0",
                        "hosts": self._host_of(0),
                        "generation": str(GENERATION),
                    },
                    endpoint=self.endpoint,
                    method="Heartbeat",
                    job_id=self._job_id,
                    rank=self._rank(),
                )
            )

    def _host_of(self, rank: int) -> str:
        m = self._joined
        return next((p.host for p in m.members if p.rank == rank), "") if m else ""

    def _dispatch(self, message: Message) -> None:
        if "event" in message:  # PEER_FAILED, or REFUSED for a foreign uid
            self._fail(self._wire_error(message.get("error"), "Heartbeat"))
            return
        req_id = message.get("id")
        with self._lock:
            pending = self._pending.get(req_id) if isinstance(req_id, int) else None
        if pending is None:
            return
        if "error" in message:
            pending.error = self._wire_error(message["error"], pending.op)
        else:
            pending.reply = message
        pending.done.set()

    def _wire_error(self, raw: object, method: str) -> RendezvousError:
        error = error_from_wire(raw, endpoint=self.endpoint, method=method, job_id=self._job_id)
        error.rank = self._rank()
        return error

    def _fail(self, error: RendezvousError) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = error
        self._failed.set()
        self._finish_all(self._failure or error)

    def _finish_all(self, error: RendezvousError) -> None:
        with self._lock:
            self._conn_error = self._conn_error or error
            waiting = list(self._pending.values())
        for pending in waiting:
            if not pending.done.is_set():
                pending.error = error
                pending.done.set()

    def _disconnect(self) -> None:
        self._closing = True
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        reader, self._reader = self._reader, None
        if reader is not None and reader is not threading.current_thread():
            reader.join(timeout=5.0)

    def _stop_server(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.stop()

    # -- lifetime ----------------------------------------------------------------------

    def close(self) -> None:
        """Close without leaving: a joined worker closing this way counts as lost."""
        self._closed = True
        self._stop_heartbeat()
        self._disconnect()
        self._stop_server()

    def __enter__(self) -> FileRendezvous:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if exc_type is None and self._joined is not None and self._failure is None:
                self.leave()
        finally:
            self.close()


def _check_id(value: bytes) -> None:
    # Never echo the bytes: the id is a bearer credential for the NCCL world.
    if not isinstance(value, bytes) or len(value) != UNIQUE_ID_BYTES:
        size = len(value) if isinstance(value, (bytes, bytearray)) else type(value).__name__
        raise InvalidRequest(f"unique id must be exactly {UNIQUE_ID_BYTES} bytes, got {size}")
    if not any(value):
        raise InvalidRequest("unique id is all zero bytes; generate a fresh one")
