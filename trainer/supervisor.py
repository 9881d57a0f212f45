"""The launcher's worker processes: started so that they die with the launcher,
reaped in the order they exited, stopped together.

**Dying with the launcher.** Each worker gets ``prctl(PR_SET_PDEATHSIG, SIGTERM)``
between fork and exec. The alternative, a pipe the worker watches for EOF, needs
the worker's cooperation (a thread in every user script), and a worker stuck in a
C call or with its watcher thread dead would outlive the launcher; the kernel's
parent-death signal needs nothing from the script and fires even when the
launcher is SIGKILLed. SIGTERM rather than SIGKILL: a Python worker without a
handler dies at once, and one that installed a handler may still save what it
can. The signal fires when the *thread* that forked exits, so workers are forked
from the launcher's main thread only, and before any other thread exists (a
``preexec_fn`` is unsafe once threads run).

**Exit order.** After one worker dies, its siblings fail a few milliseconds later
with ``PeerFailed``; the worker to blame is the one that died first. A thread per
worker blocks in ``waitpid`` and stamps the exit time when the kernel wakes it, so
the order is the kernel's, not the order a poll loop happens to visit workers in.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

PR_SET_PDEATHSIG = 1
# Failures reported within this window after the first are treated as
# simultaneous: both were reaped in the same instant, so exit order says nothing.
SIMULTANEOUS_S = 0.05


@dataclass(frozen=True)
class WorkerExit:
    """One worker's end: ``code`` as ``Popen.returncode`` (negative: killed by a signal)."""

    index: int
    name: str
    pid: int
    code: int
    at: float

    @property
    def failed(self) -> bool:
        return self.code != 0

    @property
    def how(self) -> str:
        if self.code < 0:
            try:
                return f"signal {signal.Signals(-self.code).name}"
            except ValueError:
                return f"signal {-self.code}"
        return f"exit code {self.code}"

    @property
    def exit_status(self) -> int:
        """The launcher's own exit status for this failure, shell-style for signals."""
        return self.code if self.code > 0 else 128 - self.code


def _die_with_parent_hook() -> Callable[[], None] | None:
    """A ``preexec_fn`` arming the parent-death signal, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)  # the running process: libc is loaded
    prctl = libc.prctl
    launcher = os.getpid()

    def arm() -> None:
        if prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            os._exit(126)
        # The launcher may have died between fork and prctl: then no signal will
        # ever come, and the worker must not start unsupervised.
        if os.getppid() != launcher:
            os._exit(126)

    return arm


def first_failure(failures: Sequence[WorkerExit]) -> WorkerExit:
    """The root cause among failures: killed by a signal beats an exit code when
    both were seen together (a killed worker's siblings exit with an error), then
    the earliest exit."""
    first = min(f.at for f in failures)
    together = [f for f in failures if f.at - first <= SIMULTANEOUS_S]
    return min(together, key=lambda f: (f.code >= 0, f.at, f.index))


class Workers:
    """This node's worker processes, each watched by a reaper thread."""

    def __init__(
        self, cmd: Sequence[str], envs: Sequence[Mapping[str, str]], names: Sequence[str]
    ) -> None:
        hook = _die_with_parent_hook()
        # Every fork happens here, before the first reaper thread starts.
        self.procs = [subprocess.Popen(list(cmd), env=dict(env), preexec_fn=hook) for env in envs]
        self.names = list(names)
        self._exits: queue.Queue[WorkerExit] = queue.Queue()
        self._done = [threading.Event() for _ in self.procs]
        for i, proc in enumerate(self.procs):
            threading.Thread(target=self._reap, args=(i, proc), daemon=True).start()

    def _reap(self, index: int, proc: subprocess.Popen[bytes]) -> None:
        # WNOWAIT: learn of the exit but leave the zombie, so its pid cannot be
        # reused while ``send`` may still signal it; ``wait`` reaps after ``done``.
        with contextlib.suppress(ChildProcessError):
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        at = time.monotonic()
        self._done[index].set()
        code = proc.wait()
        self._exits.put(WorkerExit(index, self.names[index], proc.pid, code, at))

    def wait(self) -> WorkerExit | None:
        """Block until every worker succeeded (None) or one failed (the root cause)."""
        succeeded = 0
        while succeeded < len(self.procs):
            # A timeout keeps the main thread responsive to forwarded signals.
            with contextlib.suppress(queue.Empty):
                ended = self._exits.get(timeout=0.5)
                if not ended.failed:
                    succeeded += 1
                    continue
                failures = [ended]
                deadline = ended.at + SIMULTANEOUS_S
                while (left := deadline - time.monotonic()) > 0:
                    try:
                        more = self._exits.get(timeout=left)
                    except queue.Empty:
                        break
                    if more.failed:
                        failures.append(more)
                return first_failure(failures)
        return None

    def send(self, signum: int) -> None:
        for proc, done in zip(self.procs, self._done, strict=True):
            if not done.is_set():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signum)

    def stop(self, grace_s: float) -> None:
        """SIGTERM the workers still running, SIGKILL those left after ``grace_s``."""
        self.send(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for done in self._done:
            done.wait(max(0.0, deadline - time.monotonic()))
        self.send(signal.SIGKILL)
        for done in self._done:
            done.wait(5.0)
