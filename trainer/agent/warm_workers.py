"""The node agent's worker processes: warm spares, assigned workers, and their events.

Every worker starts as a spare: it imports the user's script up to
``init_distributed()`` and blocks there until the agent assigns it a rank, so a
restart hands the new generation to processes that already paid Python, numpy
and gRPC start-up. Each process has a private channel (``agent_channel``), a
reaper thread blocked in ``waitid`` (the agent learns of a death at once, in the
kernel's order; for a spare the node's fork server forked, in the ``exited`` the
server relays, ``worker_boot.ForkedProcess``) and a reader thread for its frames;
both only post events to the agent's queue, where the agent's main thread decides. A frame the worker
should not have sent (``FrameError``, or anything else reading it raised) ends
its reader with a ``Misbehaved`` event: the worker is failed with that cause.

Processes are spawned from the agent's main thread only: the parent-death
signal fires when the *thread* that forked exits, so a spare forked from a
short-lived thread would be killed with it.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rendezvousd.client.relay import RelayEnd, Send
from rendezvousd.trainer.agent._agent_boot import signal_group
from rendezvousd.trainer.agent.agent_channel import Channel, ChannelClosed, Frame
from rendezvousd.trainer.agent.agent_worker import Assignment
from rendezvousd.trainer.agent.state_copy import (
    MAX_STEP,
    MAX_STEP_ADVANCE,
    Offer,
    StateCopy,
    StepState,
)
from rendezvousd.trainer.agent.worker_boot import Booted, ForkedProcess, ForkServer, start
from rendezvousd.trainer.errors import AgentChannelError

#: Makes the agent's end of a worker's relayed calls (``client.relay``): the
#: agent client's ``relay_end``; None when it makes no call stream.
RelayFactory = Callable[[Send], RelayEnd | None]
#: Replies to a worker's relayed calls the agent holds while the worker does not read
#: them; one more and the worker has failed ("stopped reading its agent channel"). A
#: worker's replies are bounded by its own calls in flight: a handful.
MAX_UNSENT_REPLIES = 1024
#: ... and the bytes they may hold together (a GetJob of a large job is ~0.5 MB).
MAX_UNSENT_BYTES = 64 << 20
# How long a best-effort frame (abort, failure-noted) may wait for a worker that reads
# nothing: the agent's main thread sends them, and it must go on to stop the worker.
BEST_EFFORT_S = 1.0


def _step_shown(frame: Frame) -> str:
    step = frame.header.get("step")
    return str(step) if type(step) is int and 0 <= step <= MAX_STEP else "out of range"


def replies_full(unsent: int, unsent_bytes: int, size: int) -> bool:
    """Whether one more reply of ``size`` bytes is past what a worker may leave unread."""
    return unsent >= MAX_UNSENT_REPLIES or unsent_bytes + size > MAX_UNSENT_BYTES


@dataclass(frozen=True)
class Exited:
    worker: WorkerProcess
    code: int

    @property
    def how(self) -> str:
        if self.worker.lost:
            return "signal SIGKILL (its fork server was lost)"
        if self.code < 0:
            try:
                return f"signal {signal.Signals(-self.code).name}"
            except ValueError:
                return f"signal {-self.code}"
        return f"exit code {self.code}"

    @property
    def status(self) -> int:
        """The launcher's exit status for it: the code, 128 + N for signal N, and 1 for
        a clean exit (which, where it is a failure, is a worker that did not train)."""
        return self.code if self.code > 0 else 128 - self.code if self.code < 0 else 1


@dataclass(frozen=True)
class Ready:
    worker: WorkerProcess


@dataclass(frozen=True)
class Reported:
    """The worker failed by itself and is about to exit: the agent tells the daemon
    (and acknowledges) before the worker closes its ring, so that the daemon
    records this rank, not a peer that fails on the closed ring a moment later."""

    worker: WorkerProcess
    cause: str
    # The rank whose report of the failure the worker relays (a ring neighbour's
    # notice), for the daemon's root cause; None: the worker saw it itself.
    witness: int | None = None


@dataclass(frozen=True)
class Said:
    """A line for the agent's log about a worker, which changes nothing else (a
    reader thread does not print: the agent's main thread says it, in order)."""

    line: str


@dataclass(frozen=True)
class Misbehaved:
    """The worker sent a frame its agent cannot take (``cause`` says which and why);
    its reader stopped, since the channel's position is lost with it."""

    worker: WorkerProcess
    cause: str


class WorkerProcess:
    """One worker process (started by ``worker_boot.boot``) and its channel;
    ``local_rank`` is None while a spare. ``slot``: the local rank it was started
    for (its ``LOCAL_RANK``)."""

    def __init__(
        self,
        serial: int,
        booted: Booted,
        events: queue.Queue[Any],
        state: StateCopy,
        relay: RelayFactory | None = None,
    ) -> None:
        """``relay``: the worker's daemon calls ("call" frames) go on the agent's
        call stream, their Replies back as "reply" frames (``client.relay``)."""
        self.serial = serial
        self.slot = booted.slot
        self.proc = booted.proc
        self.channel = Channel(booted.sock)
        self.local_rank: int | None = None
        self.ready = threading.Event()
        self.exited = threading.Event()
        self.last_progress = time.monotonic()
        self.reported_progress = False
        #: Its last alive beat (when, and whether it said it waits in a collective).
        self.alive_at = 0.0
        self.in_collective = False
        #: The step of the worker's last progress or state frame (what the node's
        #: heartbeat shows the daemon); None before one with a valid step.
        self.last_step: int | None = None
        #: The last frame of any kind from the worker (its ``alive`` beats included).
        self.last_heard = time.monotonic()
        #: What the worker said when it reported its own failure (``Reported``).
        self.reported_cause: str | None = None
        #: The rank whose report of that failure it relays (``Reported.witness``).
        self.reported_witness: int | None = None
        #: Why the agent stopped a spare that sent a bad frame (``Misbehaved``).
        self.fault: str | None = None
        #: The worker's end of the channel closed between frames: its context closed, on
        #: its way out, or its process ended (``NodeAgent._finished``).
        self.released = threading.Event()
        # The step of this worker's last state frame: the next may not be far past it.
        self._state_step: int | None = None
        # Whether the agent's log already said this worker's state was not kept: said
        # once per process, as a worker sends one after every step.
        self._state_refusal_said = False
        self._events = events
        self._state = state
        self._relay = relay(self._send_reply) if relay is not None else None
        # Replies go out from a thread of this worker's, never from the agent's call
        # stream reader, which every worker of the node shares: a worker that stops
        # reading its channel holds up its own replies only.
        self._replies: queue.Queue[bytes | None] = queue.Queue()
        self._unsent_bytes = 0
        self._unsent_lock = threading.Lock()
        self._overflowed = False
        threads = [(self._reap, "reaper"), (self._read, "reader")]
        if self._relay is not None:
            threads.append((self._send_replies, "replies"))
        for target, name in threads:
            threading.Thread(
                target=target, daemon=True, name=f"rendezvous-agent-{name}-{serial}"
            ).start()

    @property
    def pid(self) -> int | None:
        """None: a spare the fork server never forked (``lost``)."""
        return self.proc.pid

    @property
    def lost(self) -> bool:
        """The fork server refused this spare or died (its workers with it): the
        process was never the script's to fail, it is replaced, not counted."""
        return isinstance(self.proc, ForkedProcess) and self.proc.lost

    def _reap(self) -> None:
        # Learn of the exit but keep the zombie (WNOWAIT here, the fork server for
        # its own), so that ``kill`` can never signal a recycled pid before
        # ``exited`` is set.
        proc = self.proc
        if isinstance(proc, ForkedProcess):
            code = proc.wait_exited()
            self.exited.set()
            proc.release()
        else:
            with contextlib.suppress(ChildProcessError):
                os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
            signal_group(proc.pid, signal.SIGKILL)  # what it started: none may outlive it
            self.exited.set()
            code = proc.wait()
        self._events.put(Exited(self, code))

    def _read(self) -> None:
        try:
            while (frame := self.channel.recv()) is not None:
                self.last_heard = time.monotonic()
                if frame.kind == "ready":
                    self.ready.set()
                    self._events.put(Ready(self))
                elif frame.kind == "alive":
                    self.in_collective = frame.header.get("collective") is True
                    self.alive_at = self.last_heard
                elif frame.kind in ("progress", "state"):
                    self.last_progress = time.monotonic()
                    self.reported_progress = True
                    self.in_collective = False  # said from its training loop
                    step = frame.header.get("step")
                    # Only shown, never acted on: a value out of range is not kept.
                    if type(step) is int and 0 <= step <= MAX_STEP:
                        self.last_step = step
                    if frame.kind == "state":
                        self._take_state(frame)
                elif frame.kind == "failed":
                    witness = frame.header.get("witness")
                    # Passed on only as a rank the request can carry; anything else dropped.
                    if type(witness) is not int or not 0 <= witness < 2**32:
                        witness = None
                    cause = str(frame.header.get("cause", ""))
                    self._events.put(Reported(self, cause, witness))
                elif frame.kind == "call" and self._relay is not None:
                    self._relay.forward(frame.payload)
            self.released.set()
        except (ChannelClosed, OSError):
            pass  # the worker is going away (or we closed it): the reaper reports it
        except Exception as exc:
            # Anything a frame provokes (a limit, MemoryError, a bug here) is the
            # sending worker's failure, told with its cause, never a dead thread.
            if not self.channel.closed:
                what = str(exc) if isinstance(exc, AgentChannelError) else repr(exc)
                self._events.put(Misbehaved(self, f"a bad frame on its agent channel: {what}"))
        finally:
            if self._relay is not None:
                self._relay.close()  # a gone worker's parked calls must not hold the daemon

    def _take_state(self, frame: Frame) -> None:
        if self.local_rank != 0:
            # Only local rank 0 sends its state (``AgentLink.save_state``); any other
            # process's would be handed to every rank of every later restart.
            self._refuse_state(
                f"sent a state frame (step {_step_shown(frame)}), but only local rank 0's "
                "worker hands the agent its state: dropped, the copy stays as it was; "
                "call ctx.save_state() on every rank (it sends from local rank 0 only) "
                "instead of writing state frames yourself"
            )
            return
        offered = self._state.offer(frame, self._state_step)
        step = frame.header["step"]
        self._state_step = step
        if offered is Offer.PAST_COPY:
            copy = self._state.latest()
            self._refuse_state(
                f"sent a state for step {step}, more than {MAX_STEP_ADVANCE} steps "
                f"(MAX_STEP_ADVANCE) past this node's copy (step "
                f"{'?' if copy is None else copy.step}): not kept, as a broken step counter "
                "kept would be what every later restart resumes from; its later states "
                "that far ahead are refused too, unsaid. If the step is right (this node "
                f"missed over {MAX_STEP_ADVANCE} steps), restart this node's rendezvous-run "
                "to drop its copy"
            )

    def _refuse_state(self, what: str) -> None:
        if self._state_refusal_said:
            return
        self._state_refusal_said = True
        who = (
            f"worker local rank {self.local_rank}"
            if self.local_rank is not None
            else f"spare worker for local rank {self.slot}"
        )
        self._events.put(Said(f"warning: {who} (pid {self.pid}) {what}"))

    def _send_reply(self, reply: bytes) -> None:
        with self._unsent_lock:
            full = replies_full(self._replies.qsize(), self._unsent_bytes, len(reply))
            if not full:
                self._unsent_bytes += len(reply)
        if full:
            if not self._overflowed:
                self._overflowed = True
                self._events.put(
                    Misbehaved(
                        self,
                        f"it stopped reading its agent channel: {self._replies.qsize()} "
                        "replies to its daemon calls unread",
                    )
                )
            raise ConnectionError("the worker reads no replies")
        self._replies.put(reply)

    def _send_replies(self) -> None:
        while (reply := self._replies.get()) is not None:
            try:
                self.channel.send("reply", None, reply)
            except AgentChannelError:
                return  # the worker went: its reader's end closes the relay
            with self._unsent_lock:
                self._unsent_bytes -= len(reply)

    def assign(self, assignment: Assignment, restored: StepState | None, within: float) -> None:
        """Make this spare the worker of ``assignment``: one frame, which a warm spare
        reads at once. ``AgentChannelError`` when it reads none of it for ``within``
        seconds (stopped, or frozen: a restored state larger than the socket would
        otherwise hold the agent here for ever), or it is gone."""
        self.local_rank = assignment.local_rank
        self.last_progress = self.last_heard = time.monotonic()
        secrets = assignment.secrets_payload()
        header: dict[str, Any] = {**assignment.header(), "secrets_bytes": len(secrets)}
        payload = secrets
        if restored is not None:
            header["state"] = {
                "step": restored.step,
                "meta": restored.meta,
                "arrays": restored.entries,
            }
            payload += restored.payload
        self.channel.send("assign", header, payload, within=within)

    def signal(self, signum: int) -> None:
        if self.exited.is_set():
            return
        pid = self.proc.pid  # a forked spare's: once its fork server answered
        if pid is not None and not self.exited.is_set():
            signal_group(pid, signum)

    def abort(self, cause: str) -> None:
        """Tell the worker why it is about to be stopped (best effort)."""
        with contextlib.suppress(AgentChannelError):
            self.channel.send("abort", {"cause": cause}, within=BEST_EFFORT_S)

    def ack_failure(self) -> None:
        """The reported failure is known to the daemon: the worker may close its ring."""
        with contextlib.suppress(AgentChannelError):
            self.channel.send("failure-noted", within=BEST_EFFORT_S)

    def close(self) -> None:
        if self._relay is not None:
            self._relay.close()
            self._replies.put(None)
        self.channel.close()


def stop_all(
    workers: Sequence[WorkerProcess],
    cause: str | None,
    grace_s: float,
    signum: int = signal.SIGTERM,
) -> None:
    """Abort (when ``cause`` is given), ``signum``, and SIGKILL whatever is left after
    ``grace_s``; returns once every one has exited (bounded: a process SIGKILL
    cannot end would be a kernel bug)."""
    for w in workers:
        if cause is not None:
            w.abort(cause)
        w.signal(signum)
    deadline = time.monotonic() + grace_s
    for w in workers:
        w.exited.wait(max(0.0, deadline - time.monotonic()))
    for w in workers:
        w.signal(signal.SIGKILL)
    for w in workers:
        w.exited.wait(5.0)
        w.close()


class SparePool:
    """Warm processes waiting for an assignment, one per local rank ("slot").

    A spare is started for one local rank, with that rank's torchrun variables
    (``slot_env``) in its environment from the first instruction on, so a script
    that reads ``LOCAL_RANK`` at import time works as under torchrun; it is then
    only ever assigned that local rank.
    """

    def __init__(
        self,
        cmd: Sequence[str],
        env: Mapping[str, str],
        events: queue.Queue[Any],
        state: StateCopy,
        slot_env: Callable[[int], Mapping[str, str]] | None = None,
        fork_server: ForkServer | None = None,
        relay: RelayFactory | None = None,
    ) -> None:
        """``fork_server``: forks the spares while it can (else they start cold);
        ``relay``: the workers' daemon calls go on the agent's stream (``WorkerProcess``)."""
        self._fork_server = fork_server
        self._relay = relay
        self._cmd = list(cmd)
        self._env = dict(env)
        self._events = events
        self._state = state
        self._slot_env = slot_env
        self._serial = 0
        self.spares: list[WorkerProcess] = []

    def adopt(self, booted: Sequence[Booted]) -> None:
        """Take over spares started before the agent existed (``worker_boot.boot_spares``)."""
        for b in booted:
            self._serial += 1
            self.spares.append(
                WorkerProcess(self._serial, b, self._events, self._state, self._relay)
            )

    def fill(self, count: int) -> None:
        """One live spare for each of local ranks ``0..count-1``."""
        for slot in range(count):
            if not any(w.slot == slot and not w.exited.is_set() for w in self.spares):
                self._serial += 1
                env = {**self._env, **(self._slot_env(slot) if self._slot_env else {})}
                started = start(slot, self._cmd, env, self._fork_server)
                self.spares.append(
                    WorkerProcess(self._serial, started, self._events, self._state, self._relay)
                )

    def take(self, count: int) -> list[WorkerProcess]:
        """The spare for each local rank ``0..count-1``, the warmest of its slot
        (ready ones, then the oldest)."""
        self.spares = [w for w in self.spares if not w.exited.is_set()]
        self.fill(count)
        taken = []
        for slot in range(count):
            mine = sorted(
                (w for w in self.spares if w.slot == slot),
                key=lambda w: (not w.ready.is_set(), w.serial),
            )
            taken.append(mine[0])
            self.spares.remove(mine[0])
        return taken

    def discard(self, worker: WorkerProcess) -> bool:
        if worker in self.spares:
            self.spares.remove(worker)
            return True
        return False

    def stop(self) -> None:
        stop_all(self.spares, None, 0.0)  # unassigned: nothing to tell them
        self.spares = []
