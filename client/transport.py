"""One interface over both rendezvous transports, and a factory that picks one.

``daemon``: ``RendezvousClient`` of a rendezvousd at ``host:port``, any number of nodes.
``file``: ``FileRendezvous``, one node: global rank 0 starts a private rendezvousd on
a UNIX socket in a directory the workers share, and every rank, rank 0 included, is
a ``RendezvousClient`` of it. The id lives in that daemon's memory only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import stat
import struct
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol, Self, TypeVar, Unpack, runtime_checkable

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.cli.embedded import EmbeddedDaemon, spawn
from rendezvousd.client._session import JOIN_TIMEOUT_S, JoinRequest, check_keywords
from rendezvousd.client.connection import TlsConfig
from rendezvousd.client.errors import (
    DaemonUnavailable,
    InvalidRequest,
    PeerFailed,
    ProtocolError,
    RendezvousError,
    RendezvousTimeout,
)
from rendezvousd.client.membership import Membership
from rendezvousd.client.sync import RendezvousClient
from rendezvousd.common import validation
from rendezvousd.errors import DaemonError, RendezvousFault

log = logging.getLogger("rendezvousd.client.file")

#: A worker waiting this long for local_rank 0's socket says so, and again every
#: ``SOCKET_NOTE_EVERY_S``: the pace of the trainer's waiting notes for a join.
SOCKET_NOTE_S = 5.0
SOCKET_NOTE_EVERY_S = 30.0
T = TypeVar("T")

TRANSPORT_KINDS = ("file", "daemon")


@runtime_checkable
class Rendezvous(Protocol):
    """What a worker needs from either transport (and what ``JobStore`` needs)."""

    def join(self, **request: Unpack[JoinRequest]) -> Membership: ...

    def barrier(self, name: str = "default", *, timeout: float | None = None) -> None: ...

    def kv_set(self, key: str, value: bytes) -> None: ...

    def kv_get(self, key: str, *, wait: bool = True, timeout: float | None = None) -> bytes: ...

    def kv_add(self, key: str, delta: int = 1) -> int: ...

    def kv_compare_and_set(
        self, key: str, expected: bytes | None, desired: bytes
    ) -> tuple[bool, bytes | None]: ...

    def kv_delete(self, key: str) -> bool: ...

    def start_heartbeat(
        self,
        interval: float | None = None,
        on_failure: Callable[[RendezvousError], None] | None = None,
    ) -> None: ...

    def raise_if_failed(self) -> None: ...

    def get_job(self) -> pb.GetJobResponse: ...

    @property
    def call_route(self) -> str: ...

    def report_failure(
        self,
        local_rank: int,
        cause: str,
        *,
        timeout: float | None = None,
        witness_rank: int | None = None,
    ) -> None: ...

    def abort(self, reason: str, *, job_id: str | None = None, generation: int = 0) -> int: ...

    def leave(self) -> None: ...

    def close(self) -> None: ...

    def __enter__(self) -> Self: ...

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None: ...


def connect(
    transport_kind: str,
    *,
    path: str | Path | None = None,
    endpoint: str | None = None,
    job_id: str,
    token_file: str | Path | None = None,
    retry_attempts: int = 1,
    tls: TlsConfig | None = None,
) -> Rendezvous:
    """A client for ``transport_kind``; nothing is contacted until ``join``."""
    if transport_kind == "file":
        if endpoint is not None or token_file is not None or tls is not None:
            raise InvalidRequest(
                "the file transport takes path= (a directory the workers share) and no "
                "endpoint/token_file/tls; those are for transport 'daemon'",
                job_id=job_id,
            )
        return FileRendezvous(path, job_id, retry_attempts=retry_attempts)
    if transport_kind == "daemon":
        if endpoint is None or path is not None:
            raise InvalidRequest(
                "the daemon transport takes endpoint='host:port' (and token_file=), not path=",
                job_id=job_id,
            )
        return RendezvousClient(
            endpoint, job_id, token_file=token_file, tls=tls, retry_attempts=retry_attempts
        )
    raise InvalidRequest(
        f"rendezvous transport {transport_kind!r} is unknown; expected one of {TRANSPORT_KINDS}",
        job_id=job_id,
    )


_SUN_PATH_MAX = 107  # sockaddr_un.sun_path holds 108 bytes with the NUL
_MAX_LINKS = 40  # as the kernel's own limit on links followed in one lookup (ELOOP)


class FileRendezvous:
    """The ``file`` transport: ``RendezvousClient`` plus the lifetime of rank 0's daemon.

    ``path`` is a directory every worker of the job is given (mode 0700, created if
    missing); the socket is ``<job_id>.sock`` and its token ``<job_id>.token``
    there. ``path=None`` is a private temporary directory: a world of one only.
    """

    def __init__(
        self,
        path: str | Path | None,
        job_id: str = "",
        *,
        retry_attempts: int = 1,
        leave_timeout: float = 60.0,
    ) -> None:
        job = job_id or "default"
        try:
            validation.job_id(job)  # it names the socket and token files
        except RendezvousFault as fault:
            raise InvalidRequest(fault.message, job_id=job[:40]) from None
        self._path = Path(path) if path is not None else None
        self._job_id = job
        self._retry_attempts = retry_attempts
        self._leave_timeout = leave_timeout
        self._client: RendezvousClient | None = None
        self._temp: Path | None = None
        self._dir: PrivateDirectory | None = None

    def __repr__(self) -> str:
        m = self.membership
        return f"FileRendezvous(path={self._path!s}, job_id={self._job_id!r}, rank={m and m.rank})"

    @property
    def socket_path(self) -> Path | None:
        """The daemon's socket, once ``join`` has chosen the directory."""
        return self._dir.socket if self._dir else None

    @property
    def daemon(self) -> EmbeddedDaemon | None:
        """The daemon this worker started (global rank 0 only)."""
        return self._dir.daemon if self._dir else None

    @property
    def membership(self) -> Membership | None:
        return self._client.membership if self._client else None

    @property
    def failure(self) -> RendezvousError | None:
        return self._client.failure if self._client else None

    @property
    def call_route(self) -> str:
        """How calls reach rank 0's daemon now, as ``RendezvousClient.call_route`` says
        (``"stream"`` or ``"unary"``); ``"none"`` before the first join."""
        return self._client.call_route if self._client else "none"

    def join(self, **request: Unpack[JoinRequest]) -> Membership:
        """Start (local_rank 0) or find (the others) the daemon, then join through it.
        Joined before (and left since): the next generation, through the same daemon."""
        check_keywords("join", JoinRequest, request)
        num_nodes, node_rank = request["num_nodes"], request.get("node_rank")
        if num_nodes != 1 or node_rank not in (None, 0):
            raise InvalidRequest(
                f"the file transport is single-node (num_nodes={num_nodes}, node_rank="
                f"{node_rank}); use the daemon transport for multi-node jobs",
                job_id=self._job_id,
            )
        if self._client is not None:
            # A retry's fresh generation (the trainer's one retry model): the daemon
            # and the directory are the ones this worker already found.
            return self._through_rank0("Join", lambda client: client.join(**request))
        wait = request.get("timeout")
        deadline = time.monotonic() + (JOIN_TIMEOUT_S if wait is None else wait)
        path = self._directory(request["gpus_per_node"] * num_nodes)
        try:
            self._dir = directory = PrivateDirectory(path, self._job_id)
            if request["local_rank"] == 0 and not directory.serving():
                directory.host()
            else:
                # A second local_rank 0 joins the live daemon, which refuses it.
                self._wait_for_daemon(directory, deadline, request["local_rank"])
            # Before the token or anything else goes to it.
            directory.check_owner(request["local_rank"])
            self._client = RendezvousClient(
                directory.endpoint,
                self._job_id,
                token_file=directory.token,
                retry_attempts=self._retry_attempts,
            )
            # Rank 0's daemon ends with it: a call it released as it shut down is rank
            # 0's loss (``_through_rank0``), not a restart to wait for.
            self._client._s.daemon_returns = False
            request["timeout"] = max(0.001, deadline - time.monotonic())
            return self._client.join(**request)
        except BaseException:
            self.close()
            raise

    def _directory(self, world: int) -> Path:
        if self._path is not None:
            return self._path
        if world != 1:
            raise InvalidRequest(
                f"the file transport has no path, so the other {world - 1} workers cannot find "
                "rank 0: give it path= (a directory every worker shares), or start the "
                "workers with rendezvous-run",
                job_id=self._job_id,
            )
        if self._temp is None:
            self._temp = Path(tempfile.mkdtemp(prefix="rendezvous-"))  # mode 0700
        return self._temp

    def _wait_for_daemon(self, directory: PrivateDirectory, deadline: float, local: int) -> None:
        delay = 0.01
        began = time.monotonic()
        note_at = began + SOCKET_NOTE_S
        while not directory.serving():
            now = time.monotonic()
            if now >= note_at:
                # A local rank 0 started late (or never) left the others silent for
                # the whole join timeout, where a daemon's joins say what they wait for.
                note_at = now + SOCKET_NOTE_EVERY_S
                log.warning(
                    "local_rank %d of job %r still waiting after %.0f s for local_rank 0's "
                    "rendezvous socket at %s: check that local_rank 0 is running and was "
                    "given the same path and job id (waiting up to %.0f s in all)",
                    local,
                    self._job_id,
                    now - began,
                    directory.socket,
                    deadline - began,
                )
            left = deadline - now
            if left <= 0:
                raise RendezvousTimeout(
                    f"local_rank {local} of job {self._job_id!r} waited for rank 0's "
                    f"rendezvous socket at {directory.socket}, which never came: check that "
                    "local_rank 0 is running and was given the same path and job id",
                    reason="WORLD_INCOMPLETE",
                    metadata={"ranks": "0"},
                    endpoint=f"unix:{directory.socket}",
                    method="Join",
                    job_id=self._job_id,
                    rank=local,
                )
            time.sleep(min(delay, left))
            delay = min(0.2, delay * 2)

    def _joined(self) -> RendezvousClient:
        if self._client is None:
            raise InvalidRequest(
                f"not joined to job {self._job_id!r}: call join() first", job_id=self._job_id
            )
        return self._client

    def _through_rank0(self, method: str, call: Callable[[RendezvousClient], T]) -> T:
        """``call(client)``, with rank 0's daemon going away reported as losing rank 0.

        It goes away only with rank 0, and a call that reaches it after its
        shutdown began is cancelled (or refused) rather than told PEER_FAILED.
        """
        client = self._joined()
        if self.daemon is None and not self._daemon_there():
            # Nothing brings rank 0's daemon back: the SDK would wait for it (two
            # 30 s waits for a connection) and then not name rank 0.
            raise self._rank0_lost(None, "is gone", method, client)
        try:
            return call(client)
        except (DaemonUnavailable, ProtocolError) as exc:
            if self.daemon is not None:
                raise
            if exc.code in ("UNAVAILABLE", "CANCELLED"):
                said = f"shut down during {exc.method}"
            elif not self._daemon_there():
                said = f"is gone (found during {exc.method})"
            else:
                raise
            raise self._rank0_lost(exc, said, exc.method, client) from exc

    def _daemon_there(self) -> bool:
        """Whether rank 0's daemon's socket is still there (it removes it as it ends)."""
        return self._dir is None or self._dir.socket_there()

    def _rank0_lost(
        self,
        exc: DaemonUnavailable | ProtocolError | None,
        said: str,
        method: str,
        client: RendezvousClient,
    ) -> RendezvousError:
        """Rank 0's daemon ended: the cause the heartbeat already heard, else rank 0's loss."""
        if self.failure is not None:
            return self.failure
        return PeerFailed(
            f"job {self._job_id!r} failed: lost rank 0 (its rendezvous daemon at "
            f"{self.socket_path} {said}: rank 0 exited or closed the rendezvous); restart "
            "the job",
            code="ABORTED",
            reason="PEER_FAILED",
            metadata={"ranks": "0"},
            endpoint=exc.endpoint if exc else f"unix:{self.socket_path}",
            method=method,
            job_id=self._job_id,
            rank=exc.rank if exc else (client.membership.rank if client.membership else None),
        )

    def barrier(self, name: str = "default", *, timeout: float | None = None) -> None:
        self._through_rank0("Barrier", lambda client: client.barrier(name, timeout=timeout))

    def kv_set(self, key: str, value: bytes) -> None:
        self._through_rank0("KvSet", lambda client: client.kv_set(key, value))

    def kv_get(self, key: str, *, wait: bool = True, timeout: float | None = None) -> bytes:
        return self._through_rank0(
            "KvGet", lambda client: client.kv_get(key, wait=wait, timeout=timeout)
        )

    def kv_add(self, key: str, delta: int = 1) -> int:
        return self._through_rank0("KvAdd", lambda client: client.kv_add(key, delta))

    def kv_compare_and_set(
        self, key: str, expected: bytes | None, desired: bytes
    ) -> tuple[bool, bytes | None]:
        return self._through_rank0(
            "KvCompareAndSet", lambda client: client.kv_compare_and_set(key, expected, desired)
        )

    def kv_delete(self, key: str) -> bool:
        return self._through_rank0("KvDelete", lambda client: client.kv_delete(key))

    def start_heartbeat(
        self,
        interval: float | None = None,
        on_failure: Callable[[RendezvousError], None] | None = None,
    ) -> None:
        self._joined().start_heartbeat(interval, on_failure)

    def raise_if_failed(self) -> None:
        self._joined().raise_if_failed()

    def report_failure(
        self,
        local_rank: int,
        cause: str,
        *,
        timeout: float | None = None,
        witness_rank: int | None = None,
    ) -> None:
        self._through_rank0(
            "ReportFailure",
            lambda client: client.report_failure(
                local_rank, cause, timeout=timeout, witness_rank=witness_rank
            ),
        )

    def get_job(self) -> pb.GetJobResponse:
        """This job as rank 0's daemon sees it (``RendezvousClient.get_job``): what a
        waiting join's note reads. Refused (``InvalidRequest``) before ``join`` has
        found the daemon."""
        return self._through_rank0("GetJob", lambda client: client.get_job())

    def abort(self, reason: str, *, job_id: str | None = None, generation: int = 0) -> int:
        return self._through_rank0(
            "AbortJob", lambda client: client.abort(reason, job_id=job_id, generation=generation)
        )

    def leave(self) -> None:
        """Leave; rank 0 then waits (bounded) for the others, whose daemon it hosts."""
        client = self._client
        if client is None:
            return
        client.leave()
        if self.daemon is None:
            return
        deadline = time.monotonic() + self._leave_timeout
        delay = 0.01
        while True:
            job = client.get_job()
            if job.summary.state != pb.JOB_STATE_RUNNING:
                return
            if time.monotonic() + delay >= deadline:
                log.warning(
                    "job %r: stopping the rendezvous daemon at %s while %d member(s) have not "
                    "left after %g s",
                    self._job_id,
                    self.socket_path,
                    job.summary.members_present,
                    self._leave_timeout,
                )
                return
            time.sleep(delay)
            delay = min(0.2, delay * 2)

    def close(self) -> None:
        """Close without leaving (a joined worker counts as lost); rank 0 stops its daemon."""
        client, self._client = self._client, None
        if client is not None:
            client.close()
        directory, self._dir = self._dir, None
        if directory is not None:
            directory.close()
        temp, self._temp = self._temp, None
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        try:
            if exc_type is None and self.membership is not None and self.failure is None:
                self.leave()
        finally:
            self.close()


class PrivateDirectory:
    """Where a single node's daemon lives: ``<job_id>.sock`` and ``<job_id>.token`` in
    a directory only this user may use, opened once (``_open_private_directory``).

    Every use goes through that descriptor (``/proc/self/fd/N``; a daemon started
    here inherits it under the same number), so swapping a link on the path later
    changes nothing. The node's first process hosts the daemon: local_rank 0 of a
    ``FileRendezvous``, or ``rendezvous-run --standalone`` (``host_single_node``).
    """

    def __init__(self, path: Path, job_id: str) -> None:
        self.job_id = job_id
        self.socket = path / f"{job_id}.sock"  # as shown in messages
        self.fd = _open_private_directory(path, job_id)
        self.daemon: EmbeddedDaemon | None = None
        self._via = Path(f"/proc/self/fd/{self.fd}")
        self._sock = self._via / self.socket.name
        if len(os.fsencode(self.socket)) > _SUN_PATH_MAX:
            self.close()
            raise InvalidRequest(
                f"rendezvous socket path {self.socket} is longer than {_SUN_PATH_MAX} bytes; "
                "give the file transport a shorter directory",
                job_id=job_id,
            )

    @property
    def endpoint(self) -> str:
        """The daemon's endpoint for this process (through the descriptor)."""
        return f"unix:{self._sock}"

    @property
    def token(self) -> Path:
        return self._via / f"{self.job_id}.token"

    def socket_there(self) -> bool:
        """Whether the daemon's socket is still in the directory (it removes it as it
        ends), looked up through the descriptor, not by its name."""
        return os.path.lexists(self._sock)

    def serving(self) -> bool:
        """Whether a process accepts connections on the socket (a stale file does not)."""
        return self._listener() is not None

    def _listener(self) -> tuple[int, int] | None:
        """(pid, uid) of the process listening on the socket (SO_PEERCRED), if any."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(self._sock))
            except OSError:
                return None
            ucred = struct.Struct("iII")  # struct ucred: pid, uid, gid
            pid, uid, _gid = ucred.unpack(
                probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, ucred.size)
            )
        return pid, uid

    def host(self) -> EmbeddedDaemon:
        """Start the daemon here with a fresh token; it exits with this process."""
        try:
            self._sock.unlink(missing_ok=True)  # left by a killed host
        except OSError as exc:
            # The first write there: a read-only mount that the walk could open fails
            # here, and says so as a path under it does.
            raise _unusable(
                self.socket.parent, f"{self.socket}: {exc.strerror}", self.job_id
            ) from exc
        try:
            self.daemon = spawn(
                self._via,
                "--log-level",
                "WARNING",
                "--drain-grace-s",
                "5",
                listen=self.endpoint,
                token_file=self.token,
                exit_with_parent=True,
                pass_fds=(self.fd,),
            )
        except (DaemonError, OSError) as exc:
            raise DaemonUnavailable(
                f"rank 0 could not start the file transport's rendezvousd at {self.socket}: {exc}",
                endpoint=f"unix:{self.socket}",
                method="Join",
                job_id=self.job_id,
                rank=0,
            ) from exc
        return self.daemon

    def check_owner(self, local_rank: int) -> None:
        """Refuses a daemon run by another user, before the token goes to it.

        The directory is this user's alone, so only this user or root could have put
        a socket there; the peer's credentials (SO_PEERCRED, the listening process's)
        say so without trusting that. gRPC opens its own connection afterwards, through
        the same directory descriptor.
        """
        listener = self._listener()
        if listener is None:
            return  # nobody listens: the join reports the daemon unreachable
        pid, uid = listener
        if uid != os.getuid():
            raise InvalidRequest(
                f"the rendezvous socket {self.socket} is served by process {pid} of uid {uid}, "
                f"not by this user (uid {os.getuid()}): local_rank {local_rank} of job "
                f"{self.job_id!r} refuses to send it the token or to join through it; find out "
                "who runs that process, and give the file transport a directory of your own",
                job_id=self.job_id,
            )

    def close(self) -> None:
        """Stop the daemon hosted here (its socket and token go with it)."""
        daemon, self.daemon = self.daemon, None
        if daemon is not None:
            daemon.stop()
            self._sock.unlink(missing_ok=True)
            daemon.token_file.unlink(missing_ok=True)
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


@contextlib.contextmanager
def host_single_node(path: Path, job_id: str) -> Iterator[tuple[str, Path]]:
    """``rendezvous-run --standalone``: host the node's daemon as the file transport's
    rank 0 does, and yield its endpoint and token file for the node's other processes
    (the agent's workers), named by the directory's real path: nothing listens on TCP."""
    directory = PrivateDirectory(path, job_id)
    try:
        directory.host()
        real = Path(os.readlink(f"/proc/self/fd/{directory.fd}"))
        yield f"unix:{real / directory.socket.name}", real / f"{job_id}.token"
    finally:
        directory.close()


def _open_private_directory(path: Path, job_id: str) -> int:
    """A descriptor of ``path``, created 0700 if missing; refused unless this user
    alone can use it, or when the path goes through a link another user owns.

    The path is walked one name at a time (openat, O_NOFOLLOW): a symbolic link is
    followed only when root or this user owns it, since another user could point
    theirs elsewhere at any moment (in a sticky /tmp, they may replace their own).
    The checks apply to what the descriptor holds, and every later use goes
    through it: nothing is looked up by name again. (The standard library has no
    openat2(RESOLVE_NO_SYMLINKS) nor a walk that vets links: hence by hand.)
    """
    uid = os.getuid()

    def refuse(why: str) -> InvalidRequest:
        return _unusable(path, why, job_id)

    names = deque(path.absolute().parts[1:])
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    links = 0
    walked = Path("/")
    try:
        while names:
            name = names.popleft()
            if name in ("", "."):
                continue
            try:
                try:
                    step = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                except FileNotFoundError:
                    # As mkdir -p: parents by the umask, the directory itself 0700.
                    mode = 0o777 if names else 0o700
                    with contextlib.suppress(FileExistsError):  # made meanwhile: same checks
                        os.mkdir(name, mode, dir_fd=fd)
                    step = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                info = os.fstat(step)
            except OSError as exc:
                raise refuse(f"{walked / name}: {exc.strerror}") from exc
            if stat.S_ISLNK(info.st_mode):
                try:
                    target = os.readlink("", dir_fd=step)
                finally:
                    os.close(step)
                if info.st_uid not in (0, uid):
                    raise refuse(
                        f"{walked / name} is a symbolic link owned by uid {info.st_uid}, not by "
                        f"root or this user (uid {uid}), who could point it elsewhere"
                    )
                links += 1
                if links > _MAX_LINKS:
                    raise refuse(f"more than {_MAX_LINKS} symbolic links on the path")
                parts = Path(target).parts
                if parts and parts[0] == "/":
                    os.close(fd)
                    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                    walked, parts = Path("/"), parts[1:]
                names.extendleft(reversed(parts))
                continue
            os.close(fd)
            fd = step
            if not stat.S_ISDIR(info.st_mode):
                raise refuse(f"{walked / name} is not a directory")
            walked = walked.parent if name == ".." else walked / name
        _check_private(path, os.fstat(fd), job_id)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _unusable(path: Path, why: str, job_id: str) -> InvalidRequest:
    return InvalidRequest(
        f"cannot use {path} as the rendezvous directory: {why}; give the file transport "
        "a directory of your own",
        job_id=job_id,
    )


def _check_private(path: Path, info: os.stat_result, job_id: str) -> None:
    """Refuses a directory that is not this user's alone."""
    uid = os.getuid()
    if info.st_uid != uid:
        raise InvalidRequest(
            f"rendezvous directory {path} belongs to uid {info.st_uid}, not to this user (uid "
            f"{uid}); give the file transport a directory of your own",
            job_id=job_id,
        )
    if info.st_mode & stat.S_ISVTX and info.st_mode & stat.S_IWOTH:
        # /tmp or /dev/shm itself (root's, for root): a place for everyone's files,
        # which no chmod should close.
        raise InvalidRequest(
            f"rendezvous directory {path} is a shared directory every user may write to "
            f"(mode {stat.S_IMODE(info.st_mode):o}); give a directory of your own inside "
            f"it, e.g. {path / ('rendezvous-' + job_id)}",
            job_id=job_id,
        )
    if info.st_mode & 0o077:
        raise InvalidRequest(
            f"rendezvous directory {path} is open to group or others (mode "
            f"{stat.S_IMODE(info.st_mode):o}); run 'chmod 700 {path}' or give another directory",
            job_id=job_id,
        )
