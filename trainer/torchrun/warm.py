"""Warm workers for torchrun: a per-node fork server that imports torch once, and
``rendezvous-python``, the interpreter torchrun starts in its place.

torchrun's agent starts every worker as a fresh ``python -u train.py``: after a
failure each new worker imports torch again (~2.1 s of CPU each, docs/benchmarks.md),
which is most of torchrun's recovery time. With
``PYTHON_EXEC=rendezvous-python torchrun --rdzv-backend rendezvousd ...`` the handler
starts one fork server per node (``start_server``) that imports ``preload`` (torch by
default) once, and each worker torchrun starts is a thin ``rendezvous-python`` that
asks that server to fork the real worker and then stands in for it:

- The forked worker is what ``python -u train.py`` would have been: the shim's argv,
  environment (torchrun's RANK, LOCAL_RANK, MASTER_ADDR... ), working directory, CPU
  affinity (torchrun's NUMA binding is ``numactl --physcpubind`` around the shim) and
  stdin/stdout/stderr (torchrun's redirects), a session of its own (torchrun starts
  each worker in one), a fresh interpreter's signal dispositions, then the script or module as
  ``__main__`` (``run_target``). Its exit is an ordinary interpreter exit.
- torchrun watches and signals the shim, its own child: the shim forwards the signals
  torchrun and a terminal send (``FORWARDED``) to the worker, and exits as the worker
  did (the same code, or killed by the same signal). A shim SIGKILLed (torchrun's
  last resort) closes its connection, and the server kills its worker's process
  group (the worker's session: what it started, DataLoader workers, goes with it).
  The agent's death ends the server once it has killed each worker's group
  (``AGENT_DIED``, a catchable parent-death signal, as ``_fork_server``'s); the
  server runs in a session of its own, so a SIGKILL to torchrun's process group
  leaves it to do so. The server's own death (SIGKILL) kills its workers
  (parent-death signal), but not what they started.
- Whatever cannot be forked starts cold, as plain torchrun would: the shim execs the
  real interpreter in its own place (same pid) when there is no server, it does not
  answer within ``ANSWER_S``, the server runs threads after its imports (a forked
  child would inherit a lock held by a thread that is not there; numpy's OpenBLAS
  pool is stopped after them, ``_fork_server.shed_threads``), the worker's
  import-time settings (``OMP_*``, ``PYTHON*``...) differ from the server's, the
  interpreter flags are more than ``-u``, or the fork fails.

Protocol: one JSON object per ``SOCK_SEQPACKET`` message (``_fork_server``'s framing) on
an abstract Unix socket with a random name (``@rendezvousd-warm-<128 bits>``, in
``RENDEZVOUSD_WARM_SOCKET``): no file, so an agent SIGKILLed with its server leaves
nothing behind. Any local process can reach an abstract socket, so the server serves
only peers of its own uid (``SO_PEERCRED``), who could as well run the worker
themselves. Shim -> server:
``spawn`` (argv, env, cwd, unbuffered, affinity; stdin, stdout, stderr as three ``SCM_RIGHTS``
descriptors), ``signal`` (sig). Server -> shim: ``spawned`` (pid) or ``cold`` (reason),
then ``exited`` (code: negative for a signal).

Shared by every forked worker, unlike cold ones: the interpreter's hash seed and what
the preloaded modules did at import (torch's default generator seed is fixed, so it
is the same as a cold start's).
"""

from __future__ import annotations

import contextlib
import io
import os
import secrets
import select
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from rendezvousd.trainer.agent._agent_boot import die_with_parent, run_target, signal_group
from rendezvousd.trainer.agent._fork_server import (
    AGENT_DIED,
    ANSWER_S,
    exit_code,
    fork,
    fork_refusal,
    preload,
    recv,
    send,
    spawn_command,
)

__all__ = ["ENV_WARM_SOCKET", "WarmServer", "python_main", "start_server"]

#: The fork server's socket, set in the agent's environment for its workers.
ENV_WARM_SOCKET = "RENDEZVOUSD_WARM_SOCKET"
#: Signals a shim forwards to its worker (SIGKILL and SIGSTOP cannot be caught).
FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
# The server ignores these (a terminal's Ctrl-C or a job-wide SIGTERM is its
# workers' to handle, through torchrun); a forked worker gets a fresh interpreter's
# back: SIGINT raises KeyboardInterrupt, the others end the process.
_HELD: dict[signal.Signals, Any] = {
    signal.SIGINT: signal.default_int_handler,
    signal.SIGTERM: signal.SIG_DFL,
    signal.SIGHUP: signal.SIG_DFL,
}


# --- the agent's side: start the server ------------------------------------------------


@dataclass
class WarmServer:
    """A running fork server: its process and its socket's address."""

    proc: subprocess.Popen[bytes]
    socket_path: str

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)


def _address(path: str) -> str:
    """A socket address from its text form: ``@NAME`` is Linux's abstract ``\0NAME``."""
    return "\0" + path[1:] if path.startswith("@") else path


def start_server(modules: Sequence[str], env: Mapping[str, str]) -> WarmServer:
    """Start this node's fork server as a child of the calling (agent) process; it
    listens at once and imports ``modules`` while the round forms. The caller puts
    ``ENV_WARM_SOCKET`` in its workers' environment."""
    path = f"@rendezvousd-warm-{secrets.token_hex(16)}"
    cmd = [sys.executable, "-m", __name__, "--serve", path, str(os.getpid()), *modules]
    # A session of its own: a SIGKILL to torchrun's process group (a terminal's, a
    # scheduler's) leaves the server to kill its workers' groups (``AGENT_DIED``).
    proc = subprocess.Popen(
        cmd,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    server = WarmServer(proc, path)
    # Returns once the server listens (~0.1 s, before its imports): a worker started
    # earlier would find no socket and start cold.
    assert proc.stdout is not None
    with proc.stdout:
        if proc.stdout.readline() != b"listening\n":
            server.stop()
            raise OSError(f"the warm fork server did not start (exit {proc.wait()})")
    return server


# --- the server ------------------------------------------------------------------------


class _AgentGone(Exception):
    """The agent died (``AGENT_DIED``): the server stops its workers and exits."""


def _agent_died(signum: int, frame: object) -> None:
    # Raised wherever the loop is: a child forked but not yet recorded has armed its
    # own parent-death signal, and dies as the server exits.
    raise _AgentGone


@dataclass(frozen=True)
class _Child:
    """What a forked child runs, once out of the server's loop."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    unbuffered: bool
    affinity: list[int]
    stdio: list[int]


def _spawn_request(
    message: Mapping[str, Any],
) -> tuple[list[str], dict[str, str], str, bool, list[int]]:
    argv, env = spawn_command(message)
    cwd, affinity = message.get("cwd"), message.get("affinity")
    if (
        not isinstance(cwd, str)
        or not isinstance(affinity, list)
        or not affinity
        or not all(type(c) is int for c in affinity)
    ):
        raise ValueError("a malformed spawn request")
    return argv, env, cwd, message.get("unbuffered") is True, affinity


def _hung_up(conn: socket.socket) -> bool:
    """The shim closed its end (a message still unread would be data, not the end)."""
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


class _Server:
    def __init__(self, listener: socket.socket) -> None:
        self.listener = listener
        self.env = dict(os.environ)
        self.poller = select.poll()
        self.poller.register(listener, select.POLLIN)
        self.conns: dict[int, socket.socket] = {}  # fd -> a shim's connection
        self.worker_of: dict[int, int] = {}  # connection fd -> its worker's pidfd
        self.conn_of: dict[int, int] = {}  # pidfd -> its shim's connection fd
        # pidfd -> its worker's pid: unreaped until ``_exited`` waits on the pidfd, so
        # neither the pid nor its group's number (the worker's session) is reused.
        self.pid_of: dict[int, int] = {}

    def serve(self) -> _Child:
        """Fork on request and tell each shim its worker's end; returns in a forked
        child only (the server itself runs until its agent dies, then kills each
        worker's group and exits)."""
        signal.signal(AGENT_DIED, _agent_died)
        try:
            return self._serve()
        except _AgentGone:
            for pid in self.pid_of.values():
                signal_group(pid, signal.SIGKILL)
            os._exit(0)

    def _serve(self) -> _Child:
        while True:
            for fd, _ in self.poller.poll():
                try:
                    if fd == self.listener.fileno():
                        self._accept()
                    elif fd in self.conn_of:
                        self._exited(fd)
                    elif fd in self.conns:
                        child = self._message(fd)
                        if child is not None:
                            return child
                except OSError as exc:
                    # One accept's or one worker's trouble (out of descriptors, of
                    # processes): the server's death would take every worker with it.
                    print(f"rendezvous-python: warm server: {exc!r}", file=sys.stderr, flush=True)

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        if _peer_uid(conn) != os.getuid():
            conn.close()  # another user: the worker would run as this one
            return
        self.conns[conn.fileno()] = conn
        self.poller.register(conn, select.POLLIN)

    def _drop(self, fd: int) -> None:
        conn = self.conns.pop(fd)
        self.poller.unregister(fd)
        conn.close()

    def _message(self, fd: int) -> _Child | None:
        conn = self.conns[fd]
        try:
            message, fds = recv(conn)
        except (OSError, ValueError):
            message, fds = None, []
        if message is None:  # the shim is gone (SIGKILLed): so must its worker be,
            # and what it started (its session's group)
            if (pidfd := self.worker_of.pop(fd, None)) is not None:
                signal_group(self.pid_of[pidfd], signal.SIGKILL)
            self._drop(fd)
            return None
        op = message.get("op")
        if op == "spawn" and fd not in self.worker_of:
            return self._spawn(fd, message, fds)
        for extra in fds:
            os.close(extra)
        if op == "signal" and (pidfd := self.worker_of.get(fd)) is not None:
            sig = message.get("sig")
            if type(sig) is int and sig in {int(s) for s in FORWARDED}:
                with contextlib.suppress(OSError):
                    signal.pidfd_send_signal(pidfd, sig)
        return None

    def _spawn(self, fd: int, message: Mapping[str, Any], fds: list[int]) -> _Child | None:
        conn = self.conns[fd]
        try:
            argv, env, cwd, unbuffered, affinity = _spawn_request(message)
            if len(fds) != 3:
                raise ValueError(f"a spawn request with {len(fds)} descriptors, not 3")
        except ValueError as exc:
            reason: str | None = str(exc)
        else:
            reason = fork_refusal(self.env, env, "worker")
        pid = -1
        # A shim hung up is gone while it waited (the imports): its worker would be too.
        if reason is None and not _hung_up(conn):
            try:
                pid = fork(self._forked)
            except OSError as exc:  # (EAGAIN: the user's process limit)
                reason = f"fork failed: {exc}"
            if pid == 0:
                return _Child(argv, env, cwd, unbuffered, affinity, fds)
        for extra in fds:
            os.close(extra)
        if pid < 0:
            if reason is not None:
                with contextlib.suppress(OSError):
                    send(conn, {"op": "cold", "reason": reason})
            self._drop(fd)
            return None
        pidfd = os.pidfd_open(pid)
        self.worker_of[fd], self.conn_of[pidfd], self.pid_of[pidfd] = pidfd, fd, pid
        self.poller.register(pidfd, select.POLLIN)
        with contextlib.suppress(OSError):
            send(conn, {"op": "spawned", "pid": pid})
        return None

    def _forked(self) -> None:
        """In a forked child: its own session, as torchrun starts each worker (not in
        the agent's process group), without the server's descriptors and dispositions."""
        os.setsid()
        self.listener.close()
        for other in self.conns.values():
            other.close()
        for pidfd in self.conn_of:
            os.close(pidfd)
        for s, handler in _HELD.items():
            signal.signal(s, handler)
        signal.signal(AGENT_DIED, signal.SIG_DFL)  # the worker's own (torchrun forwards it)

    def _exited(self, pidfd: int) -> None:
        info = os.waitid(os.P_PIDFD, pidfd, os.WEXITED)
        if info is None:
            return  # spurious: not exited yet
        self.poller.unregister(pidfd)
        os.close(pidfd)
        del self.pid_of[pidfd]
        fd = self.conn_of.pop(pidfd)
        if self.worker_of.pop(fd, None) is not None:
            with contextlib.suppress(OSError):
                send(self.conns[fd], {"op": "exited", "code": exit_code(info)})
            self._drop(fd)


def _become(child: _Child) -> None:
    """In a forked child: turn into the worker ``python [-u] ARGV`` would have started."""
    for target, fd in enumerate(child.stdio):
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)
    os.chdir(child.cwd)
    # The shim's CPUs: torchrun's NUMA binding is a numactl --physcpubind around it.
    os.sched_setaffinity(0, child.affinity)
    os.environ.clear()
    os.environ.update(child.env)
    # New text streams over the new descriptors, buffered as a fresh interpreter's
    # would be (-u: unbuffered; a terminal: line by line; else in blocks).
    for name, fd in (("stdout", 1), ("stderr", 2)):
        binary = io.FileIO(fd, "w", closefd=False)
        raw = binary if child.unbuffered else io.BufferedWriter(binary)
        line = not child.unbuffered and (name == "stderr" or os.isatty(fd))
        setattr(
            sys,
            name,
            io.TextIOWrapper(
                raw,
                encoding=getattr(sys, name).encoding,
                errors="backslashreplace" if name == "stderr" else "strict",
                line_buffering=line,
                write_through=child.unbuffered,
            ),
        )
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
    if (random := sys.modules.get("numpy.random")) is not None:
        random.seed()  # the legacy global generator: each worker its own, as cold
    run_target(child.argv)


def serve_main(path: str, agent: int, modules: Sequence[str]) -> None:
    # Its default action ends the server while it imports (no worker yet); ``serve``
    # catches it.
    die_with_parent(agent, AGENT_DIED)
    for s in _HELD:
        signal.signal(s, signal.SIG_IGN)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(_address(path))
    # Listening before the imports: a shim that comes meanwhile waits in the backlog
    # for the one import instead of making its own.
    listener.listen(socket.SOMAXCONN)
    with os.fdopen(1, "w", closefd=False) as ready:  # the agent's pipe: its only use
        ready.write("listening\n")
    os.dup2(2, 1)  # the server's own output (a preload's warnings) goes with its errors
    preload(modules, "rendezvous-python: warm server")
    child = _Server(listener).serve()
    _become(child)


# --- the shim: rendezvous-python --------------------------------------------------------


class _Cold(Exception):
    """This worker starts as a fresh interpreter; the message says why."""


def _python_args(args: list[str]) -> tuple[bool, list[str]]:
    """(-u given, the target: ``SCRIPT ARGS...`` or ``-m MODULE ARGS...``) of python's
    command line; _Cold for any other interpreter flag."""
    unbuffered = False
    while args and args[0].startswith("-") and args[0] not in ("-", "-m"):
        if args[0] != "-u":
            raise _Cold(f"interpreter flag {args[0]!r} (only -u starts warm)")
        unbuffered, args = True, args[1:]
    if not args or args[0] == "-" or (args[0] == "-m" and len(args) < 2):
        raise _Cold("no script or module to run")
    return unbuffered, args


def _exit_as(code: int) -> NoReturn:
    if code >= 0:
        os._exit(code)
    sig = -code
    if sig not in (signal.SIGKILL, signal.SIGSTOP):  # (their disposition is fixed)
        with contextlib.suppress(OSError, ValueError):
            signal.signal(sig, signal.SIG_DFL)
    with contextlib.suppress(OSError, ValueError):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
    os._exit(128 + sig)  # a signal whose default is not to end the process


def _run_warm(path: str, args: list[str]) -> NoReturn:
    unbuffered, target = _python_args(args)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(_address(path))
        env = dict(os.environ)
        if unbuffered:
            env["PYTHONUNBUFFERED"] = "1"
        request = {"op": "spawn", "argv": target, "env": env, "cwd": os.getcwd()}
        cpus = sorted(os.sched_getaffinity(0))
        send(conn, {**request, "unbuffered": unbuffered, "affinity": cpus}, [0, 1, 2])
        conn.settimeout(ANSWER_S)
        answer, _ = recv(conn)
    except (OSError, ValueError) as exc:
        raise _Cold(f"the fork server at {path} did not answer: {exc}") from None
    if answer is None or answer.get("op") != "spawned":
        reason = answer.get("reason") if answer else "it closed the connection"
        raise _Cold(f"the fork server starts it cold: {reason}")
    conn.settimeout(None)
    for sig in FORWARDED:
        signal.signal(sig, lambda s, _f: send(conn, {"op": "signal", "sig": s}))
    while True:
        try:
            message, _ = recv(conn)
        except (OSError, ValueError) as exc:
            message = None
            why = repr(exc)
        else:
            why = "it closed the connection"
        if message is None:
            print(
                f"rendezvous-python: lost the fork server ({why}); its worker died with it",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)
        if message.get("op") == "exited" and type(code := message.get("code")) is int:
            _exit_as(code)


def python_main() -> NoReturn:
    """``rendezvous-python [-u] SCRIPT|-m MODULE [ARGS...]``: the worker forked by this
    node's warm server, else (no server, or it cannot fork this one) ``python`` itself."""
    args = sys.argv[1:]
    path = os.environ.get(ENV_WARM_SOCKET)
    try:
        if not path:
            raise _Cold(f"{ENV_WARM_SOCKET} is not set (no warm server on this node)")
        _run_warm(path, args)
    except _Cold as exc:
        if path:  # without a server, starting cold is the plan, not news
            print(f"rendezvous-python: starting cold: {exc}", file=sys.stderr, flush=True)
    # The interpreter this shim runs on, with the arguments torchrun gave it: python
    # itself, in this process's place (torchrun's child keeps its pid).
    os.execv(sys.executable, [sys.executable, *args])  # noqa: S606


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve_main(sys.argv[2], int(sys.argv[3]), sys.argv[4:])
    else:
        python_main()
