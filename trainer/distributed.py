"""Worker bootstrap: one hand-off (or, without an agent, the config) -> joined
rendezvous + communicator.

    ctx = init_distributed()          # in a process started by rendezvous-run
    ...train with ctx.communicator and ctx.reducer(grads)...
    ctx.close()

A worker started by ``rendezvous-run`` reads one thing: the agent's ``Assignment``
(its rank and the formed topology, the generation, the agent's resolved config,
the unique id and the member's credentials). It reads no TOML and no
``RENDEZVOUSD_*`` variable, and sets torchrun's RANK/LOCAL_RANK/... for user
scripts only. A worker started otherwise reads its settings through
``load_config``: the TOML file named by ``RENDEZVOUSD_CONFIG`` (or the argument),
then the ``RENDEZVOUSD_*`` variables; the rank and node rank it uses are the ones
the daemon returns at join.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rendezvousd.client.errors import (
    DuplicateRank,
    JobAborted,
    LimitExceeded,
    PeerFailed,
    RendezvousError,
    StaleGeneration,
    clean_exit,
)
from rendezvousd.client.membership import Membership
from rendezvousd.common.escape import bounded
from rendezvousd.trainer.agent._agent_boot import ENV_SPARE_GPU
from rendezvousd.trainer.agent._trace import mark
from rendezvousd.trainer.agent.agent_worker import AgentLink, Assignment
from rendezvousd.trainer.agent.state_copy import StepState
from rendezvousd.trainer.comm import devices, peer_wait
from rendezvousd.trainer.comm.communicator import Communicator
from rendezvousd.trainer.config import CONFIG_ENV, DistributedConfig, RingAddress, load_config
from rendezvousd.trainer.errors import (
    AgentError,
    CommunicatorAborted,
    CommunicatorError,
    CommunicatorTimeout,
    ConfigError,
    DeviceError,
    PeerConnectionError,
    PeerVersionMismatch,
    RetriesExhausted,
    TrainerError,
)
from rendezvousd.trainer.interfaces import point_socket_ifname
from rendezvousd.trainer.topology import MultiNodeTopology, required_local_devices

if TYPE_CHECKING:
    from collections.abc import Sequence

    from rendezvousd.client.transport import Rendezvous
    from rendezvousd.trainer.bucketing import BucketedAllReducer

log = logging.getLogger("rendezvousd.trainer")


def _say_world(line: str) -> None:
    """Rank 0's one line of the world that formed, at INFO. A program that configured
    no logging (srun's tasks, a plain ``python train.py``) gets it on stderr as
    Python's last resort shows a warning, the bare line: its INFO record was dropped
    there, while the waiting notes (warnings) beside it showed (a review, h140 F2).
    A program with any handler of its own decides itself, by its levels."""
    if log.hasHandlers() or logging.lastResort is None:
        log.info("%s", line)
    elif log.isEnabledFor(logging.WARNING):  # not silenced, as the notes are not
        print(line, file=sys.stderr, flush=True)


@dataclass
class DistributedContext:
    """A joined worker: its config, place in the formed world, rendezvous and
    communicator (``init_distributed`` builds it; ``with`` closes it)."""

    config: DistributedConfig
    topology: MultiNodeTopology
    rendezvous: Rendezvous
    communicator: Communicator
    rendezvous_s: float
    #: Generation of the job this worker trains in, and how many times this
    #: node's agent restarted its workers before (the latter 0 without an agent).
    generation: int = 0
    restart_count: int = 0
    #: The newest step state this node's agent held when it (re)started us.
    restored: StepState | None = field(default=None, repr=False)
    agent: AgentLink | None = field(default=None, repr=False)
    #: The process that joined: a fork of it (a DataLoader worker, a raw os.fork)
    #: shares the ring, the client and the agent's channel, and must end none of them.
    _pid: int = field(default_factory=os.getpid, init=False, repr=False)

    def __post_init__(self) -> None:
        _open_contexts[id(self)] = self

    def save_state(
        self, step: int, arrays: Mapping[str, Any], meta: Mapping[str, Any] | None = None
    ) -> None:
        """Hand the state after ``step`` to the node agent (kept in its memory, so a
        restart loses at most one step) and mark progress; no-op without an agent.
        ``AgentChannelError`` when the agent reads none of it for 30 s (it is stuck)."""
        peer_wait.mark_step(step)
        if self.agent is None:
            return
        self.agent.save_state(step, {k: devices.to_host(v) for k, v in arrays.items()}, meta or {})

    def check_replicas(self, arrays: Mapping[str, Any]) -> None:
        """``ReplicasDiverged`` on every rank, naming the ranks whose ``arrays`` (the
        parameters) are not the same bytes as the others'; every rank must call it,
        outside a reducer's step (``replicas.check_replicas``)."""
        from rendezvousd.trainer.replicas import check_replicas

        xp = devices.array_module(self.config.backend)
        check_replicas(self.communicator, arrays, xp)

    def progress(self, step: int) -> None:
        """Tell the node agent this worker is not hung (no-op without an agent);
        ``AgentChannelError`` when the agent reads none of it for 30 s (it is stuck);
        a slow peer's wait note names the step."""
        peer_wait.mark_step(step)
        if self.agent is not None:
            self.agent.progress(step)

    def reducer(self, grads: Sequence[Any], *, average: bool = True) -> BucketedAllReducer:
        """A bucketed all-reduce of ``grads`` over this context's communicator, with
        the configured ``bucket_cap_mib`` and ``first_bucket_mib`` (every rank has
        the same config, and so the same layout)."""
        from rendezvousd.trainer.bucketing import BucketedAllReducer

        return BucketedAllReducer.from_config(
            grads, self.communicator, self.config, average=average
        )

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def is_rank_zero(self) -> bool:
        return self.topology.is_global_rank_zero

    def close(self, *, clean: bool = True, error: BaseException | None = None) -> None:
        """Leave on success. After a failure (``clean=False``, ``error`` if known), drop
        out so that the daemon blames the right rank: see ``_drop_out``. In a forked
        child, only the child's copies of the descriptors go (``_let_go_in_fork``)."""
        _open_contexts.pop(id(self), None)
        if os.getpid() != self._pid:
            self._let_go_in_fork()
            return
        if self.agent is not None:
            # The agent leaves for the whole node; a worker only lets go.
            try:
                if not clean and (_own_failure(error) or _unexplained(self.agent, error)):
                    # The agent reports it to the daemon before our ring closes: see
                    # ``_drop_out`` for why the order decides the root cause.
                    self.agent.report_failure(
                        _describe(error), PEER_SETTLE_S, witness=_witness(error)
                    )
                self.communicator.close()
                self.rendezvous.close()
            finally:
                self.agent.close()
            return
        if clean:
            try:
                self.rendezvous.leave()
            finally:
                self.communicator.close()
                self.rendezvous.close()
            return
        try:
            _drop_out(self.rendezvous, error, self.topology.local_rank)
        finally:
            self.communicator.close()

    def _let_go_in_fork(self) -> None:
        """A forked child leaving the parent's ``with init_distributed()`` block (by
        ``sys.exit`` or an exception): its close sent a FAIL frame and shut down the
        ring sockets it shares with the parent, and under rendezvous-run the agent's
        channel too, so the parent's job failed and a healthy rank was blamed (a
        review). The parent still trains: no Leave, no failure report, no frame to
        the agent; each part closes only this process's descriptors."""
        from rendezvousd.client.sync import RendezvousClient

        try:
            self.communicator.close()
            if isinstance(self.rendezvous, RendezvousClient):
                # Its own close knows the fork; the file transport's would stop the
                # daemon the parent hosts, so that one is left to the child's exit.
                self.rendezvous.close()
        finally:
            if self.agent is not None:
                self.agent.close()

    def __enter__(self) -> DistributedContext:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        # sys.exit(0) in the block succeeds: as a failure it would fail the job and stop
        # the ranks still finishing (a final checkpoint).
        self.close(clean=exc is None or clean_exit(exc), error=exc)


# Enough for the daemon to see a dead process's heartbeat stream close, or for this
# worker's own watchdog to see the daemon gone; a host that vanished silently takes
# the daemon's heartbeat timeout, which no worker should wait out.
PEER_SETTLE_S = 2.0


def _own_failure(error: BaseException | None) -> bool:
    """Whether this worker failed by itself, not as the victim of a failure
    elsewhere (a peer's death seen on the ring, the daemon's or the agent's word). Its
    own GPU failing (``DeviceError``: out of memory, a CUDA error) is its own. A peer of
    another version is this rank's own finding, told at once: the other rank (an older
    one says only that the handshake was refused) may exit first, and its "exit code 1"
    was the cause every launcher and the daemon named."""
    if isinstance(error, DeviceError | PeerVersionMismatch):
        return True
    return not isinstance(error, CommunicatorError | RendezvousError | AgentError)


def _unexplained(agent: AgentLink, error: BaseException | None) -> bool:
    """Whether this worker's broken communicator stays unexplained: no word of a
    failure elsewhere came through its agent within the settle time. A peer's death is
    reported by that peer's agent at once and reaches every agent in milliseconds; a cut
    between two nodes whose heartbeats go on is reported by no one else, so the ranks
    that saw the link break must name it. Those that heard of it from a neighbour's
    notice wait a little longer, so that a witness's words are the cause of record."""
    if not isinstance(error, CommunicatorError) or isinstance(error, CommunicatorAborted):
        return False
    return not agent.heard_abort(_settle_s(error))


#: How much longer a rank that learned of a broken link from a neighbour waits than
#: one that saw it, before it reports it itself.
HEARSAY_DELAY_S = 0.5


def _settle_s(error: CommunicatorError) -> float:
    """How long a rank whose link broke waits for word of a failure elsewhere: a rank
    that heard of the break from a neighbour waits a little longer than a witness, so
    that a witness's words are the cause of record."""
    return PEER_SETTLE_S if error.reported_by is None else PEER_SETTLE_S + HEARSAY_DELAY_S


def _witness(error: BaseException | None) -> int | None:
    """The rank whose report of ``error`` this worker relays (a ring neighbour's notice
    of a broken link), sent beside its cause as data: the daemon records that rank's
    own report first when it comes soon after."""
    return error.reported_by if isinstance(error, CommunicatorError) else None


def _describe(error: BaseException | None) -> str:
    if error is None:
        return "the worker closed its context after a failure"
    # Whole (a traceback's newlines included) up to what the daemon keeps: the cause
    # of record. It is escaped and shortened only where it is shown.
    return bounded(f"{type(error).__name__}: {error}")


def _drop_out(rdzv: Rendezvous, error: BaseException | None, local_rank: int) -> None:
    """Leave the rendezvous before the ring, and after a broken ring connection wait
    (bounded) for the rendezvous to name the cause.

    The daemon records lost members in the order it loses them, and launchers report
    the first as the job's root cause. A worker that failed by itself must drop out
    of the rendezvous before its ring closes, or a peer failing on the closed ring
    may be lost first; it reports its exception first, as an agent does for its
    workers (without one, every survivor and ``rendezvousd status`` read only "heartbeat
    stream closed", the exception left in this worker's own stderr). A worker whose
    ring connection broke is most likely the victim of a peer's death (or of a daemon
    gone, which its peer saw first): it waits until its rendezvous reports that, so its
    own log names the real cause. When none comes, no one else will name it (a peer that
    left cleanly, finished early: the daemon saw a goodbye; a cut between two hosts whose
    heartbeats go on): it reports its own error, as an agent's worker does
    (``_unexplained``), or its stream's close was recorded as the loss, the victim that
    closed first blamed.
    """
    own = _own_failure(error)
    if own:
        with contextlib.suppress(RendezvousError):
            rdzv.report_failure(
                local_rank, _describe(error), timeout=PEER_SETTLE_S, witness_rank=_witness(error)
            )
    if isinstance(error, CommunicatorError) and not isinstance(
        error, CommunicatorAborted | DeviceError
    ):
        deadline = time.monotonic() + _settle_s(error)
        heard = False
        while time.monotonic() < deadline:
            try:
                rdzv.raise_if_failed()
            except RendezvousError:
                heard = True
                break
            time.sleep(0.02)  # poll interval while the failure report arrives
        if not heard and not own:
            with contextlib.suppress(RendezvousError):
                rdzv.report_failure(
                    local_rank,
                    _describe(error),
                    timeout=PEER_SETTLE_S,
                    witness_rank=_witness(error),
                )
    rdzv.close()


#: The contexts this process opened and has not closed: a second ``init_distributed``
#: of the same job is refused by the daemon as a duplicate rank, in words meant for
#: another run (an srun step) holding it, where this very process holds it.
_open_contexts: dict[int, DistributedContext] = {}  # by id()

#: Whether this process took (or waits for) its node agent's assignment. The agent
#: assigns a worker once: a second call would wait for another forever, and its second
#: socket on the channel's descriptor would close it under the first when collected.
_assigned = False


def init_distributed(
    config_path: str | None = None, *, env: Mapping[str, str] | None = None
) -> DistributedContext:
    """Join the job and build the communicator. Under ``rendezvous-run`` the node
    agent's hand-off is the whole configuration (``config_path`` and ``env`` are
    not read), once per worker; otherwise ``load_config(config_path, env=env)``."""
    global _assigned
    if _assigned:
        raise TrainerError(
            f"init_distributed() was already called in this worker (pid {os.getpid()}): "
            "rendezvous-run assigns each worker once; keep the DistributedContext it returned"
        )
    environ = os.environ if env is None else env
    link = AgentLink.from_env(environ)
    _assigned = link is not None
    if link is not None:
        return _init_from_agent(link, os.environ if env is None else None)
    # Only here: the transports (the file one brings the embedded daemon and its
    # settings) are for workers that join by themselves; an agent's worker attaches.
    from rendezvousd.client.sync import RendezvousClient
    from rendezvousd.client.transport import connect
    from rendezvousd.trainer.agent.recovery import daemon_full, room_wait
    from rendezvousd.trainer.agent.waiting_note import saying_what_its_rank_waits_for

    config = load_config(config_path or environ.get(CONFIG_ENV) or None, env=environ)
    transport = config.rendezvous
    tls = transport.tls()
    # A daemon's name not resolving yet, or no route to it yet, is waited for: said.
    ring = config.ring_choice(lambda note: log.warning("rendezvousd: %s", note))
    ring_host = ring.address
    rdzv = connect(
        transport.kind,
        path=transport.path,
        endpoint=transport.endpoint,
        job_id=config.job_id,
        token_file=transport.token_file,
        retry_attempts=config.retry_attempts,
        tls=tls,
    )
    # None (node_rank 'auto'): the daemon assigns the node; the local rank is still ours.
    placement = config.topology()
    local_rank = placement.local_rank if placement is not None else (config.local_rank or 0)
    id_factory = None
    if config.backend == "nccl":
        from rendezvousd.trainer.comm import nccl

        # Before the join the global rank is unknown (node_rank 'auto'), and local ranks
        # repeat across simulated nodes on one machine: this process's own id.
        devices.prepare_nccl(None)
        # After prepare_nccl, whose loopback (the shared-device mode) this then keeps.
        if (ifname := point_socket_ifname("NCCL_SOCKET_IFNAME", ring_host, os.environ)) is not None:
            log.info(
                "rendezvousd: NCCL_SOCKET_IFNAME=%s (holds %s, this worker's address, %s)",
                ifname,
                ring_host,
                ring.origin,
            )
        # A driver or library problem said as itself first (device_count() is 0 then,
        # which read "found 0 devices"), then the per-node count, not the raw world_size
        # field (unset when the launcher gives only gpus_per_node on a single node), in
        # the words rendezvous-run's workers get; one GPU in the shared-device mode.
        layout = MultiNodeTopology(config.num_nodes, config.local_world_size, 0, 0)
        devices.check_local_devices(local_rank, required_local_devices(layout))
        if devices.shares_one_device() and nccl.device_count() < 1:
            raise ConfigError(f"{devices.SHARED_DEVICE_ENV}=1 needs one GPU, and none is visible")
        id_factory = nccl.create_unique_id
    # The same Join again is how a retry gets a fresh generation and id.
    joining = functools.partial(
        rdzv.join,
        num_nodes=config.num_nodes,
        gpus_per_node=config.local_world_size,
        node_rank=placement.node_rank if placement is not None else None,
        local_rank=local_rank,
        address=ring_host if config.backend == "cpu" else "",
        id_factory=id_factory,
        timeout=config.join_timeout_s,
    )

    def join_with_room() -> Membership:
        """``joining``, waiting out a daemon-wide limit (a daemon holding --max-jobs
        jobs) within the join's timeout, as rendezvous-run's joins do: refused, every
        worker launched while the daemon was full for a moment failed at once."""
        room = room_wait(config.join_timeout_s, time.monotonic())
        timeout = config.join_timeout_s
        while True:
            try:
                return joining(timeout=timeout)
            except LimitExceeded as exc:
                full = daemon_full(exc)
                if full is None:
                    raise
                room.wait_for_room(
                    exc,
                    full,
                    lambda said: log.warning(
                        "rendezvousd: job %r, local rank %d on %s: %s",
                        config.job_id,
                        local_rank,
                        socket.gethostname(),
                        said,
                    ),
                )
                # The wait for room is part of the join's timeout, not added to it.
                timeout = max(0.1, room.limit_s - (time.monotonic() - (room.since or 0.0)))

    def join() -> Membership:
        # Said while it waits, as rendezvous-run's joins say it: a rank started late
        # (or never: two workers given one SLURM_PROCID) left every other worker
        # silent for the whole join timeout, 600 s by default.
        with saying_what_its_rank_waits_for(
            rdzv.get_job,
            lambda note: log.warning("rendezvousd: %s", note),
            config.join_timeout_s,
            time.monotonic(),
            socket.gethostname(),
            local_rank,
        ):
            if not isinstance(rdzv, RendezvousClient):
                return joining()  # the file transport: one node, its daemon this job's own
            return join_with_room()

    def watch(relay: _FailureRelay) -> None:
        rdzv.start_heartbeat(config.heartbeat_interval_s, on_failure=relay.fail)

    def place(m: Membership) -> MultiNodeTopology:
        return MultiNodeTopology.from_global_rank(m.rank, config.num_nodes, config.local_world_size)

    started = time.monotonic()
    try:
        membership = join()
        rendezvous_s = time.monotonic() - started
        membership, communicator = _bring_up(
            config, rdzv, membership, place, ring, watch, rejoin=join, first_setup=True
        )
    except BaseException as error:
        if isinstance(error, PeerVersionMismatch):
            # The cause of record, before the stream closes: its peers, the daemon's
            # log and `status` read "heartbeat stream closed" or a transient retry's
            # abort, the version named only in this worker's traceback.
            with contextlib.suppress(RendezvousError):
                rdzv.report_failure(
                    local_rank,
                    _describe(error),
                    timeout=PEER_SETTLE_S,
                    witness_rank=_witness(error),
                )
        rdzv.close()  # gone without leaving: its peers learn it at once
        if isinstance(error, DuplicateRank) and (held := _held_here(config.job_id)):
            raise error.with_message(held) from error
        raise
    topology = place(membership)
    if topology.is_global_rank_zero:
        _say_world(f"{config.rank0_log_line(topology)} rendezvous={rendezvous_s:.3f}s")
    # The generation it joined, as the daemon and `status` number it (it read 0).
    return DistributedContext(
        config, topology, rdzv, communicator, rendezvous_s, generation=membership.generation
    )


def _held_here(job_id: str) -> str:
    """What a refused duplicate join of ``job_id`` should say where this process (or
    the process it was forked from) holds an open context of that job: the daemon's
    words send the user looking for another run (an srun step). Empty otherwise."""
    for ctx in list(_open_contexts.values()):
        if ctx.config.job_id != job_id:
            continue
        holder = (
            "this process already holds"
            if ctx._pid == os.getpid()
            else f"this process is a fork of process {ctx._pid}, which holds"
        )
        return (
            f"init_distributed() refused: {holder} rank {ctx.rank} of job {job_id!r} (an "
            "open context, from an earlier init_distributed()): keep using that context, "
            "or close it (leave its with block) before joining again"
        )
    return ""


class _FailureRelay:
    """Hands the rendezvous' failure report to the communicator, whenever it exists.

    The heartbeat starts before the communicator is built; a failure reported in
    between is kept and applied the moment the communicator is attached.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._communicator: Communicator | None = None
        self._error: BaseException | None = None
        self._failed = threading.Event()

    def fail(self, error: BaseException) -> None:
        with self._lock:
            self._error = self._error or error
            communicator = self._communicator
        self._failed.set()
        if communicator is not None:
            _abort(communicator, error)

    def heard(self, within: float) -> BaseException | None:
        """The first failure reported, waiting up to ``within`` seconds for one."""
        self._failed.wait(within)
        with self._lock:
            return self._error

    def attach(self, communicator: Communicator) -> None:
        with self._lock:
            self._communicator = communicator
            error = self._error
        if error is not None:
            _abort(communicator, error)


def _abort(communicator: Communicator, error: BaseException) -> None:
    # The error's class is the cause: PeerFailed (a peer died), JobAborted, or
    # DaemonUnreachable (failure detection is gone: this node may be cut off). Under
    # the node agent the abort is an AgentError whose text is the agent's cause,
    # which already starts with the class of what it saw: the relay is not the cause.
    cause = str(error) if isinstance(error, AgentError) else f"{type(error).__name__}: {error}"
    log.error("aborting collectives: %s", cause)
    communicator.abort(cause)


#: The abort reason of a generation whose communicator setup failed transiently on
#: some rank: every rank recognises it by this exact reason (the abort's structured field).
RETRY_REASON = "communicator setup failed transiently; every rank rejoins for a fresh id"
#: Setup failures a fresh generation may cure (a peer not yet listening or lost, a
#: timeout); NCCL's seam raises ``TransientInitError``, a ``PeerConnectionError``.
TRANSIENT = (CommunicatorTimeout, PeerConnectionError)


def _bring_up(
    config: DistributedConfig,
    rdzv: Rendezvous,
    membership: Membership,
    place: Callable[[Membership], MultiNodeTopology],
    ring: RingAddress,
    watch: Callable[[_FailureRelay], None],
    rejoin: Callable[[], Membership] | None,
    first_setup: bool,
) -> tuple[Membership, Communicator]:
    """The one retry model: a transient setup failure ends the generation, and the
    retry is the next generation, with a fresh id, joined by whoever joined this one.
    ``place``: where a membership puts this worker.

    ``rejoin``: this worker's own join (without an agent): up to ``retry_attempts``
    times the failing rank aborts the generation (scoped to it, so a newer one is
    never hit), every rank learns it (its setup fails, or the confirmation barrier
    does), leaves and joins again, and rank 0 of the new generation makes the id (an
    ncclUniqueId serves exactly one init, so it cannot be reused). ``None``: the
    node agent joined for the node, and its restart is the retry, so the error
    fails this worker as it is. ``watch`` starts relaying failures (the heartbeat)
    before setup, so a peer lost meanwhile ends it at once. ``first_setup``: this
    run's first ring (its first attempt only), where a peer without a route to it is
    given up on sooner (``ring_wire.FIRST_NO_ROUTE_S``).
    """
    attempts = config.retry_attempts if rejoin is not None else 0
    for attempt in range(attempts + 1):
        m = membership
        relay = _FailureRelay()
        watch(relay)
        failure: BaseException
        try:
            # An NCCL init hang tells the daemon (watchdog) where this worker joined.
            on_hang = functools.partial(_fail_generation, rdzv, m) if rejoin else None
            first = first_setup and attempt == 0
            communicator = _communicator(
                config, rdzv, place(m), m.unique_id, ring, on_hang, first, m.generation
            )
        except TRANSIENT as exc:
            if rejoin is None or isinstance(exc, PeerVersionMismatch):
                raise  # (a fresh generation meets the same peer of another version)
            # A peer that failed by itself (it reports its own error at once: a ring
            # of another version, found from its side) closed its end, which reads
            # here as a refused handshake: rejoining waited out the join timeout for a
            # rank that was gone (CI, once: the other rank of two versions). Its
            # report reaches this rank's heartbeat within PEER_SETTLE_S.
            if isinstance(heard := relay.heard(PEER_SETTLE_S), PeerFailed):
                raise heard from exc
            failure = exc  # logged below, with the retry it leads to
            _fail_generation(rdzv, m, RETRY_REASON)
        except RendezvousError as exc:
            # The ring's address exchange through the daemon heard the generation end.
            if rejoin is None or not _retried_elsewhere(exc):
                raise
            failure = exc
        else:
            try:
                # Every rank's setup must have worked before any rank trains (a ring's
                # own handshakes confirm it where nothing is retried).
                if config.backend == "nccl" or attempts:
                    rdzv.barrier("comm-init", timeout=config.setup_timeout_s)
                relay.attach(communicator)
                return m, communicator
            except RendezvousError as exc:
                communicator.abort(f"another rank's communicator setup failed: {exc}")
                communicator.close()
                # A failed rank aborts the generation with RETRY_REASON, which the
                # barrier (or the abort pushed before it) reports. When that rank has
                # already rejoined, the barrier hears STALE_GENERATION instead: this
                # generation is over either way and the next one waits for this rank.
                if rejoin is None or not _retried_elsewhere(exc):
                    raise
                failure = exc
        what = f"{config.backend} communicator setup for rank {m.rank}"
        if attempt == attempts:
            raise RetriesExhausted(what, attempt + 1, failure) from failure
        log.warning(
            "%s failed (%s); rejoining for a fresh generation and id (retry %d of %d)",
            what,
            failure,
            attempt + 1,
            attempts,
        )
        rdzv.leave()  # stops this generation's heartbeat; the generation is fenced
        membership = rejoin()
    raise AssertionError("unreachable")  # pragma: no cover


def _retried_elsewhere(error: RendezvousError) -> bool:
    """Whether another rank's transient NCCL init failure ended this generation."""
    if isinstance(error, StaleGeneration):
        return True
    return isinstance(error, JobAborted) and error.abort_reason == RETRY_REASON


def _fail_generation(rdzv: Rendezvous, m: Membership, reason: str) -> None:
    """Abort exactly generation ``m.generation``; one already fenced is left alone
    (another rank may already have opened the next generation)."""
    try:
        rdzv.abort(reason, generation=m.generation)
    except RendezvousError as exc:
        log.warning("rank %d: could not abort generation %d: %s", m.rank, m.generation, exc)


def _communicator(
    config: DistributedConfig,
    rdzv: Rendezvous,
    topology: MultiNodeTopology,
    unique_id: bytes,
    ring: RingAddress,
    on_setup_timeout: Callable[[str], None] | None,
    first_setup: bool = False,
    generation: int | None = None,
) -> Communicator:
    """The configured backend's communicator for this worker's place in the world;
    ``generation``, the one it runs in, is said in a slow peer's wait note."""
    if config.backend == "nccl":
        from rendezvousd.trainer.comm.nccl import NcclCommunicator

        # Under rendezvous-run nothing else compares the node's worker count with its
        # visible GPUs before NCCL init's Device(local_rank).
        devices.check_local_devices(topology.local_rank, topology.gpus_per_node)
        return NcclCommunicator(
            topology.rank,
            topology.world_size,
            unique_id,
            devices.device_for(topology.local_rank),
            timeout=config.collective_timeout_s,
            setup_timeout=config.setup_timeout_s,
            on_setup_timeout=on_setup_timeout,
            check_collectives=config.check_collectives,
        )
    from rendezvousd.trainer.comm.cpu_ring import connect_cpu_ring

    return connect_cpu_ring(
        rdzv,
        rank=topology.rank,
        world_size=topology.world_size,
        secret=unique_id,
        host=ring.address,
        timeout=config.collective_timeout_s,
        setup_timeout=config.setup_timeout_s,
        node_rank=topology.node_rank,
        shared_memory=config.cpu_shared_memory,
        nodes=topology.num_nodes,
        origin=ring.origin,
        first_setup=first_setup,
        slow_peer_warn_s=config.slow_peer_warn_s,
        context=f"generation {generation}" if generation is not None else "",
    )


#: What an agent's worker needs once it is assigned (the client it attaches with,
#: the CPU ring, ``ctx.reducer()``'s buckets), imported while it waits as a spare:
#: a warm spare's start after its assignment then pays no import (a cold one pays
#: the same either way).
_AFTER_ASSIGNMENT = (
    "rendezvousd.client.sync",
    "rendezvousd.trainer.comm.cpu_ring",
    "rendezvousd.trainer.bucketing",
)


def _warm_spare_gpu() -> None:
    """The spare's GPU head start (``devices.warm_spare``); one that fails costs
    nothing but the head start: the assigned worker then meets the same error where
    it is reported today, in its communicator's setup."""
    try:
        why_not = devices.warm_spare(int(os.environ.get("LOCAL_RANK", "0")))
    except Exception as exc:  # CuPy's or CUDA's errors, whatever their class
        why_not = f"{type(exc).__name__}: {exc}"
    if why_not is None:
        mark("spare-gpu-ready")
    else:
        log.debug("spare stays off its GPU until assigned: %s", why_not)


def _in_launchers_words(error: BaseException) -> None:
    """An SDK error of a worker under rendezvous-run in the launcher's words, as its
    agent says its own: the SDK's advice names keywords (``token=``, ``tls=``) its
    user never passed, and a remedy ("restart the job") its agent carries out itself."""
    from rendezvousd.trainer.agent.launcher_words import reword

    reword(error)


def point_nccl_from(assignment: Assignment, environ: MutableMapping[str, str]) -> None:
    """The NCCL_SOCKET_IFNAME of ``assignment`` (the agent's choice for this
    generation) in ``environ``, over the one this warm spare was started with: that
    was the interface of the node's address at launch, and a node re-addressed onto
    another interface since would point NCCL at one that no longer holds it."""
    if assignment.socket_ifname:
        environ["NCCL_SOCKET_IFNAME"] = assignment.socket_ifname


def _init_from_agent(
    link: AgentLink, environ: MutableMapping[str, str] | None
) -> DistributedContext:
    """Wait (warm) for the agent's assignment, attach to that member, build the
    communicator. ``environ``: where the torchrun names go (``os.environ``)."""
    for module in _AFTER_ASSIGNMENT:
        importlib.import_module(module)
    if os.environ.get(ENV_SPARE_GPU) == "1":
        _warm_spare_gpu()
    assignment, restored = link.wait_assignment()
    started = time.monotonic()
    if environ is not None:
        environ.update(assignment.torchrun_env())
    config = assignment.config
    membership = assignment.membership()
    try:
        rdzv = config.rendezvous.client(
            assignment.job_id, config.retry_attempts, token=assignment.token
        )
        rdzv.attach(membership, assignment.instance_id)
        link.relay(rdzv)  # its calls go on the agent's stream (client.relay)
    except BaseException as error:
        _in_launchers_words(error)
        raise
    topology = assignment.topology
    if config.backend == "nccl":
        point_nccl_from(assignment, os.environ)
        # The global rank, not the local one: two simulated nodes on one GPU share
        # local ranks, and NCCL would take their ranks for one GPU used twice.
        devices.prepare_nccl(assignment.rank)

    def watch(relay: _FailureRelay) -> None:
        link.start(lambda cause: relay.fail(AgentError(cause)))

    mark("attached", generation=assignment.generation, rank=assignment.rank)
    try:
        ring = RingAddress(assignment.ring_host, assignment.ring_origin)
        _, communicator = _bring_up(
            config,
            rdzv,
            membership,
            lambda _: topology,
            ring,
            watch,
            rejoin=None,
            first_setup=assignment.restart_count == 0,
        )
    except BaseException as error:
        # Raised to a script run by rendezvous-run, and reported as its agent's cause.
        _in_launchers_words(error)
        # Before any ``with`` block: nothing else reports it, and the launcher's summary
        # and root cause said only "exit code 1" (an NCCL init failure, a ring that
        # cannot listen). Told as the context's close() tells a failure in the block.
        if _own_failure(error) or _unexplained(link, error):
            with contextlib.suppress(Exception):
                link.report_failure(_describe(error), PEER_SETTLE_S, witness=_witness(error))
        raise
    mark("ring-up", generation=assignment.generation, rank=assignment.rank)
    if topology.is_global_rank_zero:
        _say_world(
            f"{config.rank0_log_line(topology)} generation={assignment.generation} "
            f"restart_count={assignment.restart_count}"
        )
    return DistributedContext(
        config,
        topology,
        rdzv,
        communicator,
        time.monotonic() - started,
        generation=assignment.generation,
        restart_count=assignment.restart_count,
        restored=restored,
        agent=link,
    )
