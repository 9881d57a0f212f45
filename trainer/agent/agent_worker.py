"""A worker's side of the agent channel: its assignment, progress, state and aborts.

A worker started by ``rendezvous-run`` is a warm spare until assigned: it has
imported everything and blocks in ``wait_assignment``. The agent then sends one
``assign`` frame, the whole hand-off (``Assignment``): rank, topology, generation
and the agent's resolved config in the header; the unique id, the member instance
id and the daemon token in the payload (never in a header that could be logged);
then the newest step state the agent holds, if any. After that the worker sends
``alive`` frames from a thread of its own (a frozen process: stopped, or stuck
in a call that holds the GIL), ``progress`` (a worker alive but making no
progress) and ``state`` frames, and hears ``abort`` when another worker or node
failed. Its daemon calls travel as ``call`` frames, answered by ``reply`` frames:
the agent makes them on its own call stream (``client.relay``, ``relay``), so a
node's burst of calls reaches the daemon as one message.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from rendezvousd.client.membership import Membership
from rendezvousd.common.members import seat_of
from rendezvousd.common.validation import UNIQUE_ID_BYTES
from rendezvousd.trainer.agent._trace import mark
from rendezvousd.trainer.agent.agent_channel import (
    ENV_AGENT_FD,
    MAX_STATE_BYTES,
    Channel,
    SendTimedOut,
    pack_arrays,
)
from rendezvousd.trainer.agent.state_copy import StepState
from rendezvousd.trainer.comm.communicator import in_collective
from rendezvousd.trainer.config import DistributedConfig
from rendezvousd.trainer.errors import AgentChannelError
from rendezvousd.trainer.topology import MultiNodeTopology

if TYPE_CHECKING:
    from rendezvousd.client import RendezvousClient
    from rendezvousd.client.relay import RelayedCalls


# How long a relayed call's frame may wait for the agent to read it. A frame is a few
# hundred bytes and the agent reads every worker's channel all the time, so an agent
# that takes none of one for this long is stuck (stopped, or its reader is); the call
# then goes on the worker's own channel instead of waiting on the agent for ever.
CALL_SEND_S = 5.0
# How long a progress or state frame may go unread. A worker cannot train on without
# its agent (its restarts, aborts and state copy all go through it), and by then the
# daemon has lost the node (the agent's heartbeat stops with it): the training loop
# gets AgentChannelError instead of blocking for ever on the full channel.
STEP_SEND_S = 30.0


def _stopped_reading(why: object) -> str:
    return f"the node agent stopped reading this worker's channel ({why})"


@dataclass(frozen=True)
class Assignment:
    """The one hand-off from the agent to a warm worker: who it is in which
    generation, the config the agent resolved, and the member's credentials.

    The worker reads nothing else: no TOML, no ``RENDEZVOUSD_*`` variable, no
    torchrun variable (it sets those for user code, ``torchrun_env``)."""

    job_id: str
    generation: int
    restart_count: int
    rank: int
    local_rank: int
    node_rank: int
    num_nodes: int
    gpus_per_node: int
    world_size: int
    unique_id: bytes = field(repr=False)
    instance_id: str = field(repr=False)
    config: DistributedConfig = field(repr=False)
    #: The daemon's bearer token, which the agent's own client uses.
    token: str = field(default="", repr=False)
    #: The address the agent advertised for this member's ring ("" for NCCL).
    ring_host: str = ""
    #: Where ``ring_host`` came from (``RingAddress.origin``), which the worker's ring
    #: tells a peer that cannot reach it.
    ring_origin: str = ""
    #: How often the worker tells the agent its process is alive (0: never).
    alive_interval_s: float = 0.0
    #: The NCCL_SOCKET_IFNAME the agent chose for this generation ("": the user's, or
    #: none): chosen again with the node's address before each re-join, where a warm
    #: spare's environment keeps the one of the address it was started at.
    socket_ifname: str = ""

    @property
    def topology(self) -> MultiNodeTopology:
        """This worker's place in the world that formed."""
        return MultiNodeTopology(
            self.num_nodes, self.gpus_per_node, self.node_rank, self.local_rank
        )

    def header(self) -> dict[str, Any]:
        plain = {name: getattr(self, name) for name in _HEADER_FIELDS}
        # Sizes only; the secrets travel in the payload, never in a header.
        instance_id_bytes = len(self.instance_id.encode("utf-8"))
        return {**plain, "config": self.config.handoff(), "instance_id_bytes": instance_id_bytes}

    def secrets_payload(self) -> bytes:
        if len(self.unique_id) != UNIQUE_ID_BYTES:
            raise AgentChannelError(f"unique id must be {UNIQUE_ID_BYTES} bytes")
        return self.unique_id + self.instance_id.encode("utf-8") + self.token.encode("utf-8")

    @classmethod
    def decode(cls, header: Mapping[str, Any], payload: bytes) -> Assignment:
        try:
            plain = {name: kind(header[name]) for name, kind in _HEADER_FIELDS.items()}
            instance_end = UNIQUE_ID_BYTES + int(header["instance_id_bytes"])
            return cls(
                config=DistributedConfig.resolved(header["config"]),
                unique_id=payload[:UNIQUE_ID_BYTES],
                instance_id=payload[UNIQUE_ID_BYTES:instance_end].decode("utf-8"),
                token=payload[instance_end:].decode("utf-8"),
                **plain,
            )
        except UnicodeDecodeError:
            # Its text quotes a byte of the token or the NCCL id: only the size goes out.
            raise AgentChannelError(
                "malformed assignment from the node agent: its secrets payload does not"
                " decode where the instance id/token should be"
                f" ({len(payload)} bytes); the agent and this worker may run different"
                " rendezvousd versions: reinstall one version on this node"
            ) from None
        except (KeyError, TypeError, ValueError) as exc:
            # The exception's text names a field, never a secret's bytes.
            raise AgentChannelError(f"malformed assignment from the node agent: {exc}") from exc

    def membership(self) -> Membership:
        return Membership(**seat_of(self), unique_id=self.unique_id)

    def torchrun_env(self) -> dict[str, str]:
        """torchrun's names, for user scripts (known only once assigned)."""
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.gpus_per_node),
            "NODE_RANK": str(self.node_rank),
            "GROUP_RANK": str(self.node_rank),
            "TORCHELASTIC_RESTART_COUNT": str(self.restart_count),
        }


#: The fields the header carries, with their types: those a repr may show. The
#: config travels in its hand-off form, the secrets (``repr=False``) in the payload.
_HEADER_FIELDS: dict[str, Callable[[Any], Any]] = {
    f.name: {"int": int, "str": str, "float": float}[str(f.type)]
    for f in fields(Assignment)
    if f.repr
}


class AgentLink:
    """The worker's end of its channel to the node agent."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.assignment: Assignment | None = None
        self._reader: threading.Thread | None = None
        self._closing = threading.Event()
        self._noted = threading.Event()
        self._relayed: RelayedCalls | None = None
        # Who hears an abort (``start``), and the first one heard before anyone did.
        self._lock = threading.Lock()
        self._on_abort: Callable[[str], None] | None = None
        self._missed_abort: str | None = None
        self._aborted = threading.Event()
        # The worker process; a fork of it (a DataLoader worker) shares the channel.
        self._pid = os.getpid()

    @classmethod
    def from_env(cls, env: MutableMapping[str, str] | Mapping[str, str]) -> AgentLink | None:
        """The link if this process was started by an agent (``RENDEZVOUSD_AGENT_FD``)."""
        text = env.get(ENV_AGENT_FD)
        if not text:
            return None
        try:
            fd = int(text)
            os.fstat(fd)
        except (ValueError, OSError) as exc:
            raise AgentChannelError(
                f"{ENV_AGENT_FD}={text!r} is not an open descriptor ({exc}); only "
                "rendezvous-run sets it: unset it to run this worker without the agent"
            ) from exc
        return cls(Channel.from_fd(fd))

    def wait_assignment(self) -> tuple[Assignment, StepState | None]:
        """Tell the agent this worker is warm, then block until it is assigned."""
        mark("spare-ready")
        self.channel.send("ready", {"pid": os.getpid()})
        frame = self.channel.recv()
        mark("assignment-heard")
        if frame is None:
            raise AgentChannelError(
                "the node agent closed the channel before assigning this worker"
            )
        if frame.kind != "assign":
            raise AgentChannelError(
                f"expected an assignment from the node agent, got {frame.kind!r}"
            )
        secrets_len = int(frame.header.get("secrets_bytes", 0))
        assignment = Assignment.decode(frame.header, frame.payload[:secrets_len])
        state = frame.header.get("state")
        restored = None
        if isinstance(state, dict):
            restored = StepState(
                int(state["step"]),
                dict(state.get("meta") or {}),
                list(state.get("arrays") or []),
                frame.payload[secrets_len:],
            )
        self.assignment = assignment
        return assignment, restored

    def relay(self, client: RendezvousClient) -> None:
        """Make ``client``'s daemon calls through the agent (``client.relay``)."""
        self._relayed = client.relay_through(self._send_call)
        self._read_frames()

    def _send_call(self, call: bytes) -> None:
        """The relay's ``Send``: a ConnectionError ends the relay, and the call (and
        every later one) is made on the worker's own channel."""
        try:
            self.channel.send("call", None, call, within=CALL_SEND_S)
        except SendTimedOut as exc:
            # Said by the relay, which knows the call's job, rank and method (imported
            # by then: the client made the relay).
            from rendezvousd.client.relay import AgentTookNone

            raise AgentTookNone(
                f"the node agent took none of it within {CALL_SEND_S:g} s ({exc})"
            ) from exc
        except AgentChannelError as exc:
            raise ConnectionError(str(exc)) from exc

    def _send_step(self, kind: str, header: dict[str, Any], payload: bytes = b"") -> None:
        if os.getpid() != self._pid:
            # Its frames would be cut into the parent's on the shared socket.
            raise AgentChannelError(
                f"{kind} refused: this worker's channel to its node agent was made in "
                f"process {self._pid}, and process {os.getpid()} is a fork of it; call "
                "it from the worker process (the one that called init_distributed())"
            )
        try:
            self.channel.send(kind, header, payload, within=STEP_SEND_S)
        except SendTimedOut as exc:
            raise AgentChannelError(
                f"{_stopped_reading(exc)}: it is stopped or stuck, and this worker cannot "
                "go on without it"
            ) from exc

    def _read_frames(self) -> None:
        if self._reader is None:
            self._reader = threading.Thread(
                target=self._read, daemon=True, name="rendezvous-agent-link"
            )
            self._reader.start()

    def _read(self) -> None:
        try:
            while (frame := self.channel.recv()) is not None:
                if frame.kind == "reply" and self._relayed is not None:
                    self._relayed.deliver(frame.payload)
                elif frame.kind == "abort":
                    self._abort(str(frame.header.get("cause", "the node agent aborted")))
                elif frame.kind == "failure-noted":
                    self._noted.set()
            if not self._closing.is_set():
                self._abort(self._gone("the node agent closed the channel"))
        except Exception as exc:  # a broken channel, or a reply that does not decode
            if not self._closing.is_set():
                self._abort(self._gone(f"the channel to the node agent broke: {exc}"))
        finally:
            if self._relayed is not None:
                self._relayed.end()  # calls in flight fail over to the worker's own channel

    def _gone(self, cause: str) -> str:
        """Why the channel ended: ``cause``, unless this side closed it on a frame the
        agent stopped reading midway (the agent did not close it then)."""
        cut = self.channel.cut
        return cause if cut is None else _stopped_reading(cut)

    def _abort(self, cause: str) -> None:
        self._aborted.set()
        with self._lock:
            on_abort = self._on_abort
            if on_abort is None and self._missed_abort is None:
                self._missed_abort = cause
        if on_abort is not None:
            on_abort(cause)

    def start(self, on_abort: Callable[[str], None]) -> None:
        """Relay the agent's ``abort`` (and its disappearance) to ``on_abort``,
        including one heard before this call."""
        with self._lock:
            self._on_abort = on_abort
            missed, self._missed_abort = self._missed_abort, None
        if missed is not None:
            on_abort(missed)
        self._read_frames()
        interval = self.assignment.alive_interval_s if self.assignment else 0.0
        if interval > 0:
            threading.Thread(
                target=self._beat, args=(interval,), daemon=True, name="rendezvous-agent-alive"
            ).start()

    def _beat(self, interval: float) -> None:
        # From a thread, not the training loop: a worker blocked in a collective
        # (waiting for a slow or dead peer) is alive; only a frozen process goes quiet.
        while not self._closing.wait(interval):
            try:
                # Bounded, so that a beat the agent does not read never holds the
                # channel's send lock for the daemon calls and failure reports behind it.
                # Whether it waits in a collective: the agent's hang rule gives it
                # longer (``NodeAgent._stuck``).
                self.channel.send("alive", {"collective": in_collective()}, within=interval)
            except SendTimedOut as exc:
                if exc.closed:
                    return
            except (AgentChannelError, OSError):
                return

    def heard_abort(self, within: float) -> bool:
        """Whether the agent aborted this worker (a failure elsewhere, or the agent
        gone), waiting up to ``within`` seconds for it."""
        self._read_frames()
        return self._aborted.wait(within)

    def report_failure(self, cause: str, timeout: float, *, witness: int | None = None) -> bool:
        """Tell the agent this worker failed by itself, and wait (bounded) until the
        daemon knows: only then may the worker close its ring, or a peer failing
        on the closed ring could be recorded as the job's root cause. ``witness``:
        the rank whose report of the failure this worker relays (the agent passes it
        to the daemon as data). Whether the agent confirmed in time."""
        self._read_frames()
        deadline = time.monotonic() + timeout
        header: dict[str, Any] = {"cause": cause}
        if witness is not None:
            header["witness"] = witness
        try:
            self.channel.send("failed", header, within=timeout)
        except AgentChannelError:
            return False
        return self._noted.wait(max(0.0, deadline - time.monotonic()))

    def progress(self, step: int) -> None:
        self._send_step("progress", {"step": step})

    def save_state(self, step: int, arrays: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
        """Progress from every rank; the state itself from local rank 0 only."""
        if self.assignment is None or self.assignment.local_rank != 0:
            self.progress(step)
            return
        entries, payload = pack_arrays(arrays)
        if len(payload) > MAX_STATE_BYTES:
            raise AgentChannelError(
                f"the state for step {step} is {len(payload)} bytes; the node agent keeps at "
                f"most {MAX_STATE_BYTES} (MAX_STATE_BYTES): save fewer arrays (e.g. the "
                "parameters without optimizer state) and checkpoint the rest"
            )
        self._send_step("state", {"step": step, "meta": dict(meta), "arrays": entries}, payload)

    def close(self) -> None:
        if os.getpid() != self._pid:
            # A forked child leaving the worker's ``with`` block: its shutdown() ended
            # the worker's own channel, the agent aborted the worker and named it as
            # the job's root cause. Only this process's descriptor goes.
            with contextlib.suppress(OSError):
                self.channel.drop()
            return
        self._closing.set()  # our own close is not the agent going away
        with contextlib.suppress(OSError):
            self.channel.close()
