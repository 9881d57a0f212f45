"""The node's fork server ("zygote"): imports once what every worker imports, then
forks each warm spare on its agent's request.

A cold spare (``_agent_boot``) is a fresh interpreter that imports Python, numpy,
gRPC and the trainer, ~0.36 s of CPU each, and a node's spares and its launcher
all start at once. The launcher starts this server instead, as early as it used
to start its spares; the server imports ``DEFAULT_PRELOAD`` (and ``--preload``'s
modules) once, under the spares' environment (numpy reads its thread settings at
import), and forks a spare per request. The forked child is what ``_agent_boot``
would have been: its own environment (replaced whole: LOCAL_RANK & co from the
first instruction), its channel descriptor in ``RENDEZVOUSD_AGENT_FD``, the
parent-death signal armed, then the user's script or module as ``__main__``
(``run_target``). It leaves the server's frames by returning, so its end is an
ordinary interpreter exit: ``SystemExit``'s code, an uncaught exception's
traceback and status 1, atexit handlers, non-daemon threads joined, stdio flushed.

Design (a) of issue 21: the server is its workers' parent. It learns of a
worker's exit from the worker's pidfd, keeps the zombie (``WNOWAIT``) and tells
the agent ``exited`` with the status; it reaps the zombie only when the agent
answers ``reap``, after it marked the worker exited, so the agent's ``kill`` by
pid never hits a recycled pid. The parent-death signal chains: the agent's death
ends the server (``AGENT_DIED``, once it has killed each worker's process group:
what a worker started goes with it), the server's kills its workers (the agent then
sees every one of them exit: its control socket closes, and it kills their groups).
The server runs in a session of its own, so a SIGKILL to the launcher's group leaves
it to do so. The server is single-threaded (numpy's
OpenBLAS pool, which it starts at import, is stopped after the imports:
``shed_threads``; once anything else started a thread, it starts its spares cold
instead: a forked child would inherit a lock held by a thread that is not there) and
creates no gRPC channel or server.

Protocol: one JSON object per ``SOCK_SEQPACKET`` message on the control socket
the launcher passes (``RENDEZVOUSD_FORK_SERVER_FD``). Agent -> server: ``spawn``
(serial, argv, env; the worker's end of its channel as the one ``SCM_RIGHTS``
descriptor) and ``reap`` (pid). Server -> agent: ``spawned`` (serial, pid, and
``cold``: why the server started that spare as a fresh ``_agent_boot`` instead of
forking it, or null), ``refused`` (serial, reason: a malformed request; the agent
starts that spare itself and no longer uses the server) and ``exited`` (pid, code:
negative for a signal). End of file from the agent: the server kills what is left
of its workers and exits.

Shared by every forked worker, unlike cold ones: the interpreter's hash seed (a
set's order is the same on every worker of the node) and the modules imported
before the fork. numpy's legacy global generator, if imported, is reseeded in
each child, as Python's ``random`` reseeds itself.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import socket
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from rendezvousd.common.log_time import utc_stamp
from rendezvousd.trainer.agent import _trace
from rendezvousd.trainer.agent._agent_boot import (
    ENV_AGENT_FD,
    ENV_AGENT_PID,
    die_with_agent,
    die_with_parent,
    run_target,
    signal_group,
)

#: "0" disables the fork server: every spare starts cold, as before.
ENV_FORK_SERVER = "RENDEZVOUSD_FORK_SERVER"
ENV_CONTROL_FD = "RENDEZVOUSD_FORK_SERVER_FD"
#: Comma-separated modules the server imports besides ``DEFAULT_PRELOAD``.
ENV_PRELOAD = "RENDEZVOUSD_FORK_SERVER_PRELOAD"
#: What every spare imports: numpy, gRPC and the trainer's worker side.
DEFAULT_PRELOAD = (
    "numpy",
    "grpc",
    "rendezvousd.trainer.agent.agent_worker",
    "rendezvousd.trainer.distributed",
    "rendezvousd.trainer.checkpoint",
    "rendezvousd.trainer.data",
)
#: A message's limit (an environment travels whole); a larger one starts cold.
MAX_MESSAGE = 192 * 1024
#: How long a fork server's client waits for its answer to a spawn request: the
#: server's imports come first (a preloaded torch takes seconds on a loaded node),
#: and waiting for them is no slower than a cold start's own. Past it, the client
#: gives the server up and starts its worker cold.
ANSWER_S = 120.0
# Read once at import (by the interpreter, numpy's BLAS, OpenMP): a spare whose
# environment gives one of these another value than the server's starts cold.
IMPORT_TIME_PREFIXES = (
    "PYTHON",
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "GOTO_",
    "BLIS_",
    "VECLIB_",
    "NUMEXPR_",
)
# The server's parent-death signal. Not SIGKILL: the server must outlive its agent
# long enough to kill its workers' process groups (``_Server._stop_all``); its
# workers' own SIGKILL left what they started (DataLoader workers, a helper) running
# under init. Its default action still ends the server while it imports, when it
# has no worker yet; from ``serve`` on it ends the loop (``_agent_died``).
AGENT_DIED = signal.SIGUSR1
# Dispositions a forked worker gets back as the server inherited them (the server
# itself ignores these: a Ctrl-C or a job-wide SIGTERM is its workers' to handle,
# and its death would SIGKILL them mid-exit).
_HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def import_time_env_differs(a: Mapping[str, str], b: Mapping[str, str]) -> list[str]:
    """The names read at import whose values differ between ``a`` and ``b``."""
    names = {k for k in (*a, *b) if k.startswith(IMPORT_TIME_PREFIXES)}
    return sorted(k for k in names if a.get(k) != b.get(k))


def encode(message: Mapping[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode()


def send(sock: socket.socket, message: Mapping[str, Any], fds: Sequence[int] = ()) -> None:
    data = encode(message)
    if len(data) > MAX_MESSAGE:
        raise OSError(f"a fork server message of {len(data)} bytes (limit {MAX_MESSAGE})")
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def recv(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """The next message and its descriptors; (None, []) at end of file. ValueError:
    a message that is not one (truncated, not a JSON object)."""
    data, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE + 1, 4)
    try:
        if not data and not fds:
            return None, []
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(data) > MAX_MESSAGE:
            raise ValueError("a truncated fork server message")
        message = json.loads(data)
        if not isinstance(message, dict):
            raise ValueError("a fork server message that is not an object")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return message, fds


def exit_code(info: os.waitid_result) -> int:
    """Popen's returncode for a ``waitid`` result: negative for a signal."""
    if info.si_code == os.CLD_EXITED:
        return info.si_status
    return -info.si_status


@dataclass(frozen=True)
class _Child:
    """What a forked child runs, once out of the server's loop."""

    fd: int
    argv: list[str]
    env: dict[str, str]
    agent: int


def spawn_command(message: Mapping[str, Any]) -> tuple[list[str], dict[str, str]]:
    """A spawn request's argv (not empty) and env, both of strings; ValueError if not
    (this server's and ``torchrun.warm``'s)."""
    argv, env = message.get("argv"), message.get("env")
    if (
        not isinstance(argv, list)
        or not argv
        or not all(isinstance(a, str) for a in argv)
        or not isinstance(env, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    ):
        raise ValueError("a malformed spawn request")
    return argv, env


def thread_count() -> int:
    """This process's threads, native ones included."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def fork_refusal(server_env: Mapping[str, str], env: Mapping[str, str], what: str) -> str | None:
    """Why a child with ``env`` must start cold instead of forked from this server."""
    if (threads := thread_count()) > 1:
        # (numpy's OpenBLAS starts its threads at import unless told 1.)
        return f"the fork server runs {threads} threads after its imports"
    if names := import_time_env_differs(server_env, env):
        return f"the {what}'s {', '.join(names)} differ from the fork server's"
    return None


def fork(prepare: Callable[[], None]) -> int:
    """``os.fork()`` with stdio flushed first; in the child the parent-death signal is
    armed and ``prepare`` run, and a failure there ends the child (126) instead of
    returning into the server's loop. The child's pid; 0 in the child."""
    server = os.getpid()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    pid = os.fork()
    if pid == 0:
        try:
            die_with_parent(server)
            prepare()
        except BaseException:
            os._exit(126)  # never back into the server's loop
    return pid


class _AgentGone(Exception):
    """End of file on the control socket: the agent closed it, or died."""


def _agent_died(signum: int, frame: object) -> None:
    # Raised wherever the loop is: a child forked but not yet recorded has armed
    # its own parent-death signal, and dies as the server exits.
    _gone()


def _gone() -> NoReturn:
    """The agent's death, heard once: it comes twice (the socket's end, the parent-death
    signal), and the second, raised inside the stop the first began, cut it short with
    a traceback (5 runs in 8 of a SIGKILLed agent's test)."""
    signal.signal(AGENT_DIED, signal.SIG_IGN)
    raise _AgentGone


class _Server:
    def __init__(self, control: socket.socket, agent: int) -> None:
        self.control = control
        self.agent = agent
        self.env = dict(os.environ)
        self.signals = {s: signal.getsignal(s) for s in (*_HELD_SIGNALS, AGENT_DIED)}
        self.poller = select.poll()
        self.poller.register(control, select.POLLIN)
        self.pids: dict[int, int] = {}  # pidfd -> pid, of every child not yet reaped
        self.pidfds: dict[int, int] = {}  # pid -> pidfd
        self.exited: set[int] = set()  # pids whose exit the agent was told
        self.popens: dict[int, Any] = {}  # pid -> Popen, of spares started cold

    def serve(self) -> _Child | None:
        """Forward exits and fork on request; returns in a forked child only (None:
        the agent is gone or its socket failed, every worker is stopped)."""
        signal.signal(AGENT_DIED, _agent_died)
        try:
            while True:
                for fd, _ in self.poller.poll():
                    child = self._handle(fd)
                    if child is not None:
                        return child
        except _AgentGone:
            pass
        except (OSError, ValueError) as exc:
            print(
                f"{utc_stamp()} rendezvous-run: fork server: {exc!r}; stopping its workers",
                file=sys.stderr,
                flush=True,
            )
        signal.signal(AGENT_DIED, signal.SIG_IGN)  # stopping already: see _gone
        self._stop_all()
        return None

    def _handle(self, fd: int) -> _Child | None:
        if fd != self.control.fileno():
            self._exited(fd)
            return None
        message, fds = recv(self.control)
        if message is None:
            _gone()
        op = message.get("op")
        if op == "spawn":
            return self._spawn(message, fds)
        for extra in fds:
            os.close(extra)
        if op == "reap" and type(pid := message.get("pid")) is int:
            self._reap(pid)
        return None

    def _exited(self, pidfd: int) -> None:
        pid = self.pids[pidfd]
        info = os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOWAIT)
        if info is None:
            return  # spurious: not exited yet
        signal_group(pid, signal.SIGKILL)  # what it started: none may outlive it
        self.poller.unregister(pidfd)
        self.exited.add(pid)
        send(self.control, {"op": "exited", "pid": pid, "code": exit_code(info)})

    def _reap(self, pid: int) -> None:
        if pid not in self.exited:
            return  # only a zombie the agent was told of: never wait for a live one
        self.exited.discard(pid)
        pidfd = self.pidfds.pop(pid)
        del self.pids[pidfd]
        with contextlib.suppress(ChildProcessError):
            info = os.waitid(os.P_PIDFD, pidfd, os.WEXITED)
            if (proc := self.popens.pop(pid, None)) is not None and info is not None:
                proc.returncode = exit_code(info)
        os.close(pidfd)

    def _spawn(self, message: Mapping[str, Any], fds: list[int]) -> _Child | None:
        serial = message.get("serial")
        try:
            argv, env = spawn_command(message)
            if type(serial) is not int:
                raise ValueError("a malformed spawn request")
            if len(fds) != 1:
                raise ValueError(f"a spawn request with {len(fds)} descriptors, not 1")
        except ValueError as exc:
            for fd in fds:
                os.close(fd)
            send(self.control, {"op": "refused", "serial": serial, "reason": str(exc)})
            return None
        cold = fork_refusal(self.env, env, "spare")
        if cold is not None:
            pid = self._start_cold(fds[0], argv, env)
        else:
            pid = fork(self._forked)
            if pid == 0:
                return _Child(fds[0], argv, env, self.agent)
            os.close(fds[0])
        pidfd = os.pidfd_open(pid)
        self.pids[pidfd] = pid
        self.pidfds[pid] = pidfd
        self.poller.register(pidfd, select.POLLIN)
        send(self.control, {"op": "spawned", "serial": serial, "pid": pid, "cold": cold})
        return None

    def _forked(self) -> None:
        """In a forked child: its own session, as a cold spare's (``_agent_boot``), and
        none of the server's descriptors and signal dispositions."""
        os.setsid()
        self.control.close()
        for pidfd in self.pids:
            os.close(pidfd)
        for s, handler in self.signals.items():
            signal.signal(s, handler)

    def _start_cold(self, fd: int, argv: list[str], env: Mapping[str, str]) -> int:
        """Forking is unsafe or would not give the spare its own settings: start it
        as the agent would (``_agent_boot``), still as this server's child, so its
        exit reaches the agent the same way."""
        import subprocess

        child_env = {**env, ENV_AGENT_FD: str(fd), ENV_AGENT_PID: str(os.getpid())}
        cmd = [sys.executable, "-m", "rendezvousd.trainer.agent._agent_boot", *argv]
        # An ignored signal stays ignored across exec: the spare gets the launcher's
        # dispositions back for its start (a few ms without the server's own).
        for s in _HELD_SIGNALS:
            signal.signal(s, self.signals[s])
        try:
            proc = subprocess.Popen(cmd, env=child_env, pass_fds=(fd,))
        finally:
            for s in _HELD_SIGNALS:
                signal.signal(s, signal.SIG_IGN)
            os.close(fd)
        # Kept, so that subprocess never reaps it: the zombie is the agent's to release.
        self.popens[proc.pid] = proc
        return proc.pid

    def _stop_all(self) -> None:
        """The agent closed its end (or died): no worker, nor what it started, may
        run unsupervised. Each pid is still this server's child (a zombie at most),
        so its number, and its group's, cannot have been reused."""
        for pid in self.pidfds:
            signal_group(pid, signal.SIGKILL)
        for pidfd in self.pidfds.values():
            with contextlib.suppress(ChildProcessError):
                os.waitid(os.P_PIDFD, pidfd, os.WEXITED)


def module_names(text: str) -> list[str]:
    """The modules of a preload list, separated by ',' or ':' (no module name holds
    either): torchrun's --rdzv-conf separates its own settings by ',', so its
    ``preload`` took ':', and ``--preload`` ',': each read the other's as one name."""
    return [m.strip() for m in text.replace(":", ",").split(",") if m.strip()]


def preload(modules: Sequence[str], who: str = "rendezvous-run: fork server") -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a worker that needs it fails on its own import
            print(
                f"{utc_stamp()} {who}: could not preload {name}: {exc!r}",
                file=sys.stderr,
                flush=True,
            )
    shed_threads()


def shed_threads() -> int:
    """This process's threads once the libraries loaded have stopped those they stop
    at a fork: a first fork, whose child exits at once, runs their at-fork handlers.
    OpenBLAS (numpy's) starts a pool of threads at import, one per core unless
    ``OMP_NUM_THREADS=1`` (so on every node of one worker), and stops it in its
    handler, in the parent too; it starts it again when next used, in the parent or a
    child. Without this the server refused every fork (``fork_refusal``) and a
    one-worker node's spares all started cold. Threads of anything else stay, and
    are refused as before."""
    if thread_count() > 1:
        with warnings.catch_warnings():
            # Python 3.12+ warns of any fork with threads running; this child runs
            # nothing, and the server runs as __main__, where the warning would show.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            os._exit(0)  # touches nothing a vanished thread may have held
        os.waitpid(pid, 0)
    return thread_count()


def _become(child: _Child) -> None:
    """In a forked child: turn into the worker ``_agent_boot`` would have started."""
    os.environ.clear()
    os.environ.update(child.env)
    os.environ[ENV_AGENT_FD] = str(child.fd)
    _trace.set_agent(child.agent)
    if (random := sys.modules.get("numpy.random")) is not None:
        random.seed()  # the legacy global generator: each worker its own, as cold
    run_target(child.argv)


def main() -> None:
    die_with_agent(AGENT_DIED)
    control = socket.socket(fileno=int(os.environ.pop(ENV_CONTROL_FD)))
    extra = [m for m in os.environ.pop(ENV_PRELOAD, "").split(",") if m]
    server = _Server(control, os.getppid())
    for s in _HELD_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    preload([*DEFAULT_PRELOAD, *extra])
    server.env = dict(os.environ)
    _trace.mark("fork-server-ready")
    child = server.serve()
    if child is not None:
        _become(child)


if __name__ == "__main__":
    main()
