"""Starting a worker process: the agent's side of ``_agent_boot``.

A worker starts for one local rank ("slot") with torchrun's names for it in its
environment, one end of a fresh ``socketpair`` inherited as its private channel
(only the descriptor number travels, in ``RENDEZVOUSD_AGENT_FD``) and the
agent's pid. This module imports neither numpy nor gRPC, so that the launcher
can start a node's first spares right after reading its settings: a fresh node
then pays its own start-up and its spares' side by side, instead of one after
the other (docs/benchmarks.md, "Recovery"). ``warm_workers`` wraps what it
starts into a ``WorkerProcess``.

``ForkServer`` is the agent's side of the node's fork server (``_fork_server``):
the launcher starts it where it would start its spares, and a spare is then a
request on its control socket (``ForkedProcess``, answered by the server's reader
thread here); ``start`` falls back to ``boot`` when the server cannot fork it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rendezvousd.common.settings import Bool, Invalid
from rendezvousd.trainer.agent._agent_boot import ENV_AGENT_FD, ENV_AGENT_PID, ENV_SPARE_GPU
from rendezvousd.trainer.agent._fork_server import (
    ANSWER_S,
    ENV_CONTROL_FD,
    ENV_FORK_SERVER,
    ENV_PRELOAD,
    import_time_env_differs,
    recv,
    send,
)
from rendezvousd.trainer.agent._group_watch import kill_group
from rendezvousd.trainer.errors import ConfigError

if TYPE_CHECKING:
    from rendezvousd.trainer.config import DistributedConfig


def fork_server_wanted(env: Mapping[str, str]) -> bool:
    """``RENDEZVOUSD_FORK_SERVER``: unset is on; 1/0, true/false, yes/no, on/off in
    any case (the settings' own spellings); anything else is a ConfigError naming the
    variable, since a value read as "on" after a typo ("flase") kept the server the
    operator meant to turn off."""
    text = env.get(ENV_FORK_SERVER)
    if text is None:
        return True
    try:
        wanted: bool = Bool().from_text(text.strip())
    except Invalid:
        raise ConfigError(
            f"${ENV_FORK_SERVER}={text!r} is not a switch: set it to 0 (or false, no, off) "
            "to start every spare as a fresh interpreter, as --no-fork-server does, or to "
            "1 (true, yes, on), or unset it, to fork them from the node's fork server"
        ) from None
    return wanted


@dataclass(frozen=True)
class Booted:
    """A worker process just started for local rank ``slot``, and this side's
    socket of its channel."""

    slot: int
    proc: subprocess.Popen[bytes] | ForkedProcess
    sock: socket.socket


class ForkedProcess:
    """A worker the fork server forks: what the agent uses of a ``Popen``.

    ``pid`` waits for the server's answer (None: it never ran). ``wait_exited``
    returns once the server said it exited, its zombie kept; ``release`` lets the
    server reap it. ``lost``: the server refused it, or died (and its workers with
    it, by their parent-death signal): not a fault of the worker's script."""

    def __init__(self, server: ForkServer) -> None:
        self._server = server
        self._pid: int | None = None
        self._answered = threading.Event()
        self._exited = threading.Event()
        self._released = False
        self.returncode: int | None = None
        self.lost = False

    @property
    def pid(self) -> int | None:
        # Past ANSWER_S the server is given up: killed, its spares lost (replaced
        # cold, using no restart), so that a server stuck in a ``--preload`` import
        # can never hold up the agent's stop paths, which need each worker's pid.
        if not self._answered.wait(ANSWER_S):
            self._server.give_up(f"no answer to a spare's request within {ANSWER_S:g} s")
            self._answered.wait(10.0)  # its reader marks this spare lost at the EOF
        return self._pid

    def _spawned(self, pid: int) -> None:
        self._pid = pid
        self._answered.set()

    def _exit(self, code: int, *, lost: bool = False) -> None:
        if self._exited.is_set():
            return
        self.lost = lost
        self.returncode = code
        self._answered.set()
        self._exited.set()

    def wait_exited(self) -> int:
        self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def release(self) -> None:
        """The agent knows of the exit: the server may reap the zombie (its pid
        may be reused from then on)."""
        if not self._released and self._pid is not None and not self.lost:
            self._released = True
            self._server.reap(self._pid)

    def kill(self) -> None:
        pid = self.pid
        if pid is not None and not self._exited.is_set():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired("fork server worker", timeout or 0.0)
        self.release()
        return self.wait_exited()


class ForkServer:
    """The agent's side of this node's fork server (``_fork_server``)."""

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        sock: socket.socket,
        env: Mapping[str, str],
        note: Callable[[str], None],
    ) -> None:
        self.proc = proc
        self._sock = sock
        self._env = dict(env)
        self._note = note
        self._lock = threading.Lock()
        self._serial = 0
        self._pending: dict[int, ForkedProcess] = {}  # serial -> not answered yet
        self._running: dict[int, ForkedProcess] = {}  # pid -> not exited yet
        #: Why spares start cold from now on (the server refused one, or died).
        self.unavailable: str | None = None
        self._cold_noted = False
        self._reader = threading.Thread(
            target=self._read, daemon=True, name="rendezvous-fork-server"
        )
        self._reader.start()

    @classmethod
    def start(
        cls,
        env: Mapping[str, str],
        preload: Sequence[str] = (),
        note: Callable[[str], None] = print,
    ) -> ForkServer | None:
        """Start the server under the spares' environment ``env`` (None: disabled
        by ``RENDEZVOUSD_FORK_SERVER=0`` or another "off", or not startable here;
        ConfigError: that variable is neither on nor off). Call from the launcher's
        main thread: its parent-death signal follows the forking thread."""
        if not fork_server_wanted(env) or not hasattr(os, "pidfd_open"):
            return None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        server_env = {
            **env,
            ENV_CONTROL_FD: str(theirs.fileno()),
            ENV_AGENT_PID: str(os.getpid()),
            ENV_PRELOAD: ",".join(preload),
        }
        argv = [sys.executable, "-m", "rendezvousd.trainer.agent._fork_server"]
        try:
            # A session of its own: a SIGKILL to the launcher's whole process group
            # (a `kill -9 -PGID`) must leave it alive to kill its workers' groups.
            proc = subprocess.Popen(
                argv, env=server_env, pass_fds=(theirs.fileno(),), start_new_session=True
            )
        except OSError as exc:
            ours.close()
            note(f"no fork server ({exc}): spares start cold")
            return None
        finally:
            theirs.close()
        return cls(proc, ours, env, note)

    def spawn(self, slot: int, cmd: Sequence[str], env: Mapping[str, str]) -> Booted | None:
        """Ask for a spare (answered later, ``ForkedProcess.pid``); None: start it
        cold (the server is unavailable, or ``env`` differs from the server's in
        what is read at import)."""
        if self.unavailable is not None or import_time_env_differs(self._env, env):
            return None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        proc = ForkedProcess(self)
        with self._lock:
            self._serial += 1
            serial = self._serial
            self._pending[serial] = proc
        request = {"op": "spawn", "serial": serial, "argv": list(cmd), "env": dict(env)}
        try:
            send(self._sock, request, [theirs.fileno()])
        except OSError as exc:
            with self._lock:
                self._pending.pop(serial, None)
            ours.close()
            self._unavailable(f"could not ask it for a spare: {exc}")
            return None
        finally:
            theirs.close()
        return Booted(slot, proc, ours)

    def reap(self, pid: int) -> None:
        with contextlib.suppress(OSError):
            send(self._sock, {"op": "reap", "pid": pid})

    def give_up(self, why: str) -> None:
        """The server stopped answering: kill it (its reader then reports every
        spare it held as lost) and start spares cold from now on."""
        self._unavailable(why)
        with contextlib.suppress(OSError):
            self.proc.kill()

    def _unavailable(self, why: str) -> None:
        if self.unavailable is None:
            self.unavailable = why
            self._note(f"fork server unavailable ({why}): spares start cold from now on")

    def _read(self) -> None:
        why = "it exited"
        try:
            while True:
                message, fds = recv(self._sock)
                for fd in fds:
                    os.close(fd)
                if message is None:
                    break
                op = message.get("op")
                with self._lock:
                    if op == "spawned":
                        if message.get("cold") and not self._cold_noted:
                            self._cold_noted = True
                            self._note(f"fork server: spares start cold ({message['cold']})")
                        proc = self._pending.pop(message["serial"])
                        self._running[message["pid"]] = proc
                        proc._spawned(message["pid"])
                    elif op == "exited":
                        self._running.pop(message["pid"])._exit(message["code"])
                    elif op == "refused":
                        # That spare starts cold; so do later ones (its running ones stay).
                        self._unavailable(f"it refused a spare: {message.get('reason')}")
                        self._pending.pop(message["serial"])._exit(-signal.SIGKILL, lost=True)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            why = f"its control socket failed: {exc!r}"
        self._unavailable(why)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # the server stops what is left
        with self._lock:
            orphans = [*self._pending.values(), *self._running.values()]
            self._pending.clear()
            self._running.clear()
        # Its workers die with it (their parent-death signal), but what each started
        # (a DataLoader's workers, a helper) is in its group, reparented to init: the
        # server that killed those groups is gone. Only the group, never the pid:
        # the worker may already be reaped by init. Its group's number stays taken
        # while any process of the group lives, and pids are handed out in turn, so
        # it is not another's this soon.
        for proc in orphans:
            if proc._pid is not None:
                kill_group(proc._pid)
            proc._exit(-signal.SIGKILL, lost=True)

    def close(self) -> None:
        """End the server (it kills any worker left) and wait for it."""
        if self.unavailable is None:
            self.unavailable = "closed"
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._reader.join(10.0)
        try:
            self.proc.wait(10.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._sock.close()


class GroupWatch:
    """The agent's side of ``_group_watch``: this process's one watcher of its cold
    workers' groups, started with the first. Best effort: a watcher that cannot be
    started (no pidfds) or is gone leaves a worker's children as before, and never
    holds a worker back."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None

    def watch(self, pid: int) -> None:
        """Worker ``pid`` started: its group dies with it, and with this process."""
        with self._lock:
            if self._proc is None:
                if not hasattr(os, "pidfd_open"):
                    return
                argv = [sys.executable, "-m", "rendezvousd.trainer.agent._group_watch"]
                try:
                    # A session of its own, as the fork server's: it must outlive a
                    # SIGKILL to the launcher's whole process group.
                    self._proc = subprocess.Popen(
                        argv, stdin=subprocess.PIPE, start_new_session=True
                    )
                except OSError:
                    return
            assert self._proc.stdin is not None
            with contextlib.suppress(OSError, ValueError):
                self._proc.stdin.write(f"+{pid}\n".encode())
                self._proc.stdin.flush()


GROUP_WATCH = GroupWatch()


def boot(slot: int, cmd: Sequence[str], env: Mapping[str, str]) -> Booted:
    """Start ``cmd`` (a script, or ``-m`` and a module) under ``_agent_boot``.

    Call from the agent's main thread only: the parent-death signal the worker
    arms fires when the *thread* that forked it exits."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    child_env = {**env, ENV_AGENT_FD: str(theirs.fileno()), ENV_AGENT_PID: str(os.getpid())}
    argv = [sys.executable, "-m", "rendezvousd.trainer.agent._agent_boot", *cmd]
    try:
        proc = subprocess.Popen(argv, env=child_env, pass_fds=(theirs.fileno(),))
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    GROUP_WATCH.watch(proc.pid)
    return Booted(slot, proc, ours)


def start(
    slot: int, cmd: Sequence[str], env: Mapping[str, str], server: ForkServer | None
) -> Booted:
    """A spare forked by ``server``, or a cold one (``boot``) when it cannot."""
    forked = server.spawn(slot, cmd, env) if server is not None else None
    return forked if forked is not None else boot(slot, cmd, env)


def fixed_node_rank(config: DistributedConfig) -> int | None:
    """This node's rank in every generation, when the config fixes it: a fixed job
    size (not elastic) and a given node rank (not 'auto')."""
    if not config.is_multi_node:
        return 0
    if config.fewest_nodes != config.num_nodes:
        return None  # a shrunk generation renumbers the nodes
    return config.node_rank


def slot_env(config: DistributedConfig, local_rank: int) -> dict[str, str]:
    """torchrun's names a spare for ``local_rank`` starts with, for user code (the
    worker itself reads its place from the assignment). The global ones
    (``RANK``, ``WORLD_SIZE``, ``NODE_RANK``) only when every generation gives this
    node the same ranks (``fixed_node_rank``); otherwise the assignment sets them
    in ``init_distributed()``."""
    per_node = config.local_world_size
    env = {"LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(per_node)}
    node_rank = fixed_node_rank(config)
    if node_rank is not None:
        env.update(
            RANK=str(node_rank * per_node + local_rank),
            WORLD_SIZE=str(config.num_nodes * per_node),
            NODE_RANK=str(node_rank),
            GROUP_RANK=str(node_rank),
        )
    if config.backend == "nccl" and config.spare_gpu_context:
        env[ENV_SPARE_GPU] = "1"
    return env


def boot_spares(
    config: DistributedConfig,
    cmd: Sequence[str],
    env: Mapping[str, str],
    server: ForkServer | None = None,
) -> list[Booted]:
    """One spare per local rank of this node, each with its slot's names (forked
    by ``server`` when it can, else cold)."""
    booted: list[Booted] = []
    try:
        for slot in range(config.local_world_size):
            booted.append(start(slot, cmd, {**env, **slot_env(config, slot)}, server))
    except BaseException:
        discard(booted)
        raise
    return booted


def discard(booted: Sequence[Booted]) -> None:
    """Stop processes no agent took over (the launcher failed before it had one)."""
    for b in booted:
        with contextlib.suppress(ProcessLookupError):
            b.proc.kill()
    for b in booted:
        with contextlib.suppress(subprocess.TimeoutExpired):
            b.proc.wait(5.0)  # SIGKILL: bounded unless the kernel is stuck
        b.sock.close()
