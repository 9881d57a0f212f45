"""The node agent ``rendezvous-run`` runs: one join per node, workers restarted
after a failure, torchrun's elastic agent as the model.

Per generation: ``join_node`` (all local ranks at once) -> hand each warm spare
its rank, the id and the newest step state over its private channel -> watch
(``waitpid`` per worker, progress for hangs, the node's heartbeat stream for
the daemon's pushes) -> on a failure report it (if local), stop the workers
within ``STOP_GRACE_S``, and either re-join the next generation with fresh
spares or give up (``recovery.RestartBudget``). Decisions happen on the main
thread only; reaper, reader and heartbeat threads just post events.
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client._session import DEFAULT_HEARTBEAT_S
from rendezvousd.client.connection import LOCAL_SHORTAGE
from rendezvousd.client.errors import (
    AuthenticationError,
    DaemonUnavailable,
    DuplicateRank,
    FailedMember,
    InvalidRequest,
    JobAborted,
    JobEnded,
    LimitExceeded,
    PeerFailed,
    RendezvousError,
    RendezvousTimeout,
    StaleGeneration,
    TopologyMismatch,
    VersionMismatch,
    failed_members,
)
from rendezvousd.client.membership import (
    LOOPBACK_ADDRESS,
    NODE_STOPPED,
    SETUP_ERROR,
    NodeMembership,
    loopback_conflict,
    loopback_refused,
)
from rendezvousd.client.sync import RendezvousClient
from rendezvousd.common.escape import shortened
from rendezvousd.common.members import (
    WITNESS_WINDOW_S,
    FailedInfo,
    failed_text,
    named_losses,
    seat_of,
)
from rendezvousd.common.validation import longest_beat_s
from rendezvousd.trainer.agent._trace import mark
from rendezvousd.trainer.agent.agent_worker import Assignment
from rendezvousd.trainer.agent.daemon_back import await_daemon, daemon_serves
from rendezvousd.trainer.agent.launcher_words import in_launchers_words, launchers_text
from rendezvousd.trainer.agent.node_links import LINK_SETTLE_S, LinkSilent, NodeLinks
from rendezvousd.trainer.agent.recovery import (
    OUTAGE_RETRY_S,
    SCALE_UP_REASON,
    SETUP_ERROR_EXIT,
    DaemonOutage,
    Failure,
    RestartBudget,
    daemon_full,
    room_note,
    room_wait,
    stray,
)
from rendezvousd.trainer.agent.root_cause import bounded_client
from rendezvousd.trainer.agent.state_copy import StateCopy
from rendezvousd.trainer.agent.waiting_note import saying_what_it_waits_for
from rendezvousd.trainer.agent.warm_workers import (
    Exited,
    Misbehaved,
    Reported,
    Said,
    SparePool,
    WorkerProcess,
    stop_all,
)
from rendezvousd.trainer.agent.worker_boot import Booted, ForkServer, fixed_node_rank, slot_env
from rendezvousd.trainer.comm import ring_wire
from rendezvousd.trainer.config import DistributedConfig, RingAddress
from rendezvousd.trainer.errors import AgentChannelError, ConfigError, RestartsExhausted
from rendezvousd.trainer.interfaces import interface_holding

# Workers' state is already in the agent: a short SIGTERM grace is only for
# their last log line, so every node is stopped well within 100 ms.
STOP_GRACE_S = 0.05
# Fresh spares start once the new generation has stepped, or this long after every
# worker of it was warm (a script that reports no progress): on a small machine
# their start-up would otherwise slow the resumption down.
SPARE_DELAY_S = 1.0
POLL_S = 0.02
# The watch loop wakes every POLL_S: a gap this long was the agent itself not running
# (SIGSTOP, a debugger, a suspended machine), and for RESUMED_S after it no worker is
# blamed for a silence that was the agent's own: their frames sent meanwhile are read
# first, and the daemon's verdict on this node (lost for the agent's silence) comes.
# Nor for a failure meanwhile: the other nodes, told this one was lost, closed their
# workers' links to ours, which then failed and exited while the agent was stopped.
# Their exits, read before the verdict, named a healthy worker "failed first".
PAUSED_S = 2.0
RESUMED_S = 2.0
# How long a stopped node's abort (the daemon telling the other nodes why) goes before
# its workers get the signal: a daemon that answers does within milliseconds.
TELL_STOPPED_FIRST_S = 0.5
# How long a stopped node's goodbye (its Leave) may hold its exit once its workers are
# stopped: a daemon that answers confirms it within milliseconds (``_stopped_goodbye``).
STOPPED_GOODBYE_S = 1.0
# How long a failure's report may hold the stop of the node's other workers: a daemon
# that answers confirms it within milliseconds, and one that does not (stopped, gone,
# cut off) is reached no sooner for the workers' waiting (``_report``).
REPORT_FIRST_S = 1.0
# A worker's silence limit when the daemon advertises no heartbeat timeout (older).
DEFAULT_SILENCE_S = 10.0
STOPPING = "stopping this node's workers: "
# A worker that reported its own failure exits right after; one that does not
# within this long is stopped and its report is the failure.
REPORTED_EXIT_S = 5.0
# A verdict on the generation (a peer lost) heard as every worker of this node was exiting
# (``_exiting``) waits this long for their exits: all 0, this node's work is done.
FINISHED_EXIT_S = 5.0
# A worker's "ready" frame (sent by init_distributed()) is read by its reader thread:
# how long an exit 0 waits for it to be read before it counts as never sent.
READY_READ_S = 0.5
NO_INIT = "a script started by rendezvous-run must call init_distributed()"
# A worker waiting in a collective is hung after this many hang timeouts (``_stuck``).
COLLECTIVE_HANG_FACTOR = 1.5
WITHOUT = "which a script started by rendezvous-run must call"
# A join the daemon refuses for what this node sent (its token or TLS, a request it
# cannot take, a shape other than the job's, a --node-rank another live node agent
# holds): the same join again, restart after restart, is refused the same way within
# milliseconds (four in 0.5 s with --max-restarts 3), so the agent gives up at once,
# as torch's does on a rendezvous error, with the setup's exit status, 2
# (``_setup_refusal``). So does DuplicateRank for a --node-rank a live agent holds
# (``_rank_held``), once its holder was heard from while this node waited, or had the
# join's timeout to go away.
REFUSALS = (AuthenticationError, InvalidRequest, TopologyMismatch)


#: How much later than at this node's first ask the daemon must have heard a holder of
#: its --node-rank for that holder to count as alive: well above the jitter of when an
#: answer is read here (a loaded host), while a live holder beats every few seconds.
HOLDER_ALIVE_S = 2.0


def _holder_heard(answer: RendezvousError) -> float | None:
    """When (on this process's monotonic clock) the daemon last heard the holder of the
    node rank a DuplicateRank names; None when it does not say."""
    heard_ms = answer.metadata.get("holder_heard_ms", "")
    return time.monotonic() - int(heard_ms) / 1000 if heard_ms.isdigit() else None


def _rank_held(answer: BaseException) -> str | None:
    """The host of the live node agent that holds the --node-rank this join named, or
    None (not that refusal: the daemon's other DUPLICATE_RANK answers say "rejoin to
    take part"). It may be this node's predecessor, frozen (a hung host) or partitioned,
    on this host or on the one this node replaces: the daemon frees its seat once it
    loses it. Or a live twin: two nodes given one rank, which no restart changes."""
    if not isinstance(answer, DuplicateRank):
        return None
    return answer.metadata.get("holder_host") or None


def _refused_in(answer: RendezvousError) -> int | None:
    """The generation a refused join was refused by, as the daemon names it (a fault
    about a job's generation carries its number: a topology or version refusal, by the
    generation forming, which it fails, or running); None where the daemon named none
    (the daemon unreachable, a token refused). Said "no generation", a topology refusal
    contradicted the daemon's own words beside it ("job 'J' generation 1 has ...")."""
    said = answer.metadata.get("generation", "")
    return int(said) if said.isdigit() and int(said) > 0 else None


def _setup_refusal(answer: RendezvousError, holder: str | None) -> bool:
    """Whether a join's refusal is the setup's error, which no restart can change: the
    same join again is refused the same way within milliseconds. Exit 2, as a bad
    setting is (``SETUP_ERROR_EXIT``): its token or TLS, a request the daemon cannot
    take, a shape other than the job's (``REFUSALS``); nodes of two versions, or a
    daemon older than JoinNode (``VersionMismatch``: the daemon's words name both hosts
    and versions, or the method the daemon lacks); a --node-rank a live node agent holds (``holder``, once
    waited for: ``_rank_held``); a world over the daemon's --max-members-per-job; a
    job's share of parked joins already full (more standbys than it has room for: each
    restart's join was refused in milliseconds, 3 in 62 ms, helper-175). Other limits,
    such as a daemon holding --max-jobs jobs, may pass. They exited 1, as a worker's
    failure does."""
    return (
        isinstance(answer, (*REFUSALS, VersionMismatch))
        or holder is not None
        or (
            isinstance(answer, LimitExceeded)
            and (
                answer.metadata.get("limit") == "max_members_per_job"
                or answer.metadata.get("share") == "parked_joins"
            )
        )
    )


@dataclass(frozen=True)
class RemoteFailure:
    """The daemon pushed a failure (a lost peer, an abort) for ``generation``."""

    error: RendezvousError
    generation: int


@dataclass(frozen=True)
class Verdict:
    """A ``RemoteFailure`` of the running generation as heard: its ``cause`` worded
    then, and until when this node's exiting workers may overrule it (``_exiting``)."""

    error: RendezvousError
    cause: str
    deadline: float


@dataclass(frozen=True)
class NodesWaiting:
    """``count`` nodes wait to join: the running ``generation`` ends to take them in.
    As a generation's outcome, it re-forms the job without using a restart."""

    count: int
    generation: int


@dataclass(frozen=True)
class Joined:
    """``join_node``'s answer or error, from the thread that waited for it."""

    serial: int
    answer: NodeMembership | RendezvousError


@dataclass(frozen=True)
class Interrupted:
    """The agent got SIGINT or SIGTERM: it stops the workers and exits with 128 + signum."""

    signum: int


@dataclass(frozen=True)
class StrayLost:
    """A node placed in ``generation`` never attached its heartbeat stream (a stray
    JoinNode, or an agent that died at once): the job re-forms without it, and no
    restart is used."""

    generation: int
    cause: str


@dataclass(frozen=True)
class ScaledDown:
    """A node of ``generation`` was stopped by a signal and left the job for good (a
    host drained or preempted), and the nodes left still make min_nodes of an elastic
    job: it re-forms without that node, using no restart, as a scale-up uses none."""

    generation: int
    cause: str
    left: int


Outcome = Failure | NodesWaiting | StrayLost | ScaledDown | Interrupted | None


def describe_remote(error: RendezvousError) -> tuple[str, int | None, str | None]:
    """(cause, rank, host) of a failure the daemon pushed: the first member it lost,
    with that member's own host."""
    cause = f"{type(error).__name__}: {in_launchers_words(error)}"
    if isinstance(error, PeerFailed) and error.failed:
        first = error.failed[0]
        # Its losses only: a call's message goes on with the SDK user's remedy ("restart
        # the job (a new Join opens the next generation)"), which the agent does itself.
        gen = error.generation
        named = f"job {error.job_id!r}" + (f" generation {gen}" if gen else "")
        return f"PeerFailed: {failed_text(named, error.failed)}", first.rank, first.host
    if isinstance(error, PeerFailed) and error.ranks:
        return cause, error.ranks[0], None
    return cause, None, None


def forgotten_run(config: DistributedConfig, had: int, now: int) -> str:
    """Said when this node's join after a failure lands in a generation not past the
    one it held: the daemon no longer knows the job's run. Generations only grow on a
    daemon that kept its state; after an outage longer than the agents' window, its
    re-joins started the job anew unnoticed (the agent said "generation 1" twice),
    the cause nowhere in its log. Only a call of the old run reaching the new daemon
    (one back within the window) heard that the job "does not exist on this daemon"."""
    endpoint = config.rendezvous.endpoint or "its endpoint"
    return (
        f"the daemon at {endpoint} has lost job {config.job_id!r}'s state: this node "
        f"held generation {had}, and its join started the job again at generation {now} "
        "(the daemon was restarted without --state-dir, or its state dir was lost). The "
        "job goes on as a new run, its generations counted from 1 again; give the "
        "daemon a --state-dir on storage that survives its restarts"
    )


class NodeAgent:
    """This node's agent; ``run()`` returns the launcher's exit status."""

    def __init__(
        self,
        config: DistributedConfig,
        cmd: Sequence[str],
        env: Mapping[str, str],
        client: RendezvousClient,
        *,
        ring_host: str = "",
        ring_origin: str = "",
        link_host: str = "",
        ring_again: Callable[[], RingAddress] | None = None,
        socket_ifname: str = "",
        token: str = "",
        note: Callable[[str], None] = print,
        id_factory: Callable[[], bytes] | None = None,
        booted: Sequence[Booted] = (),
        fork_server: ForkServer | None = None,
        launched: float | None = None,
    ) -> None:
        """``booted``: this node's first spares, when the launcher started them
        before it had an agent (``worker_boot.boot_spares``); ``link_host``: the
        address other nodes' agents reach this one at (``node_links``; "" for none);
        ``ring_origin``: where ``ring_host`` (or ``link_host``) came from, in the words
        a refusal of it and a peer that cannot reach it say (``RingAddress.origin``);
        ``ring_again``: that choice made again, before each re-join (``_choose_ring``);
        ``socket_ifname``: the NCCL_SOCKET_IFNAME the launcher chose for the workers
        ("": the user's, or none), chosen again with the address;
        ``token``: the daemon token ``client`` uses, handed to the workers with their
        assignment; ``fork_server``: forks spares while it can (the launcher owns and
        closes it); ``launched``: when this node's launcher started (``time.monotonic()``;
        None: now), which the first join tells the daemon."""
        self.config = config
        self.launched = time.monotonic() if launched is None else launched
        self.client = client
        self.ring_host = ring_host
        self.ring_origin = ring_origin
        self.link_host = link_host
        self._ring_again = ring_again
        self.socket_ifname = socket_ifname
        self._links: NodeLinks | None = None
        self._token = token
        self.note = note
        self.id_factory = id_factory
        self.host = socket.gethostname()
        self.events: queue.Queue[Any] = queue.Queue()
        self.state = StateCopy()
        self.pool = SparePool(
            cmd,
            env,
            self.events,
            self.state,
            functools.partial(slot_env, config),
            fork_server=fork_server,
            relay=client.relay_end,
        )
        self.pool.adopt(booted)
        self.budget = RestartBudget(config.max_restarts)
        #: This node's seat in the last generation it joined: which of the daemon's
        #: losses are its own (``_lost``, and the launcher's root-cause line).
        self.placed: NodeMembership | None = None
        # What _report_progress last gave the heartbeat: steps, restarts, their cap.
        self._progress_sent: tuple[tuple[int | None, ...], int, int] | None = None
        self.active: list[WorkerProcess] = []
        #: The first failure of one of this node's own workers, if any: the root
        #: cause to name when the daemon cannot be asked.
        self.first_local: Failure | None = None
        # How many workers exited 0 in the final generation (0: none started, the node
        # was not needed), for the launcher's last line.
        self.finished_workers = 0
        self._joins = 0
        # A standby waits for a slot until its first seat; it re-joins as any node after.
        self._standing_by = config.standby
        #: Whether this node has held a seat in the job: refused WORLD_FULL later, it
        #: was replaced (lost to the daemon while cut off, its seat given to a standby).
        self._was_member = False
        #: Standing by because it was replaced (``_was_member``), for one wait only.
        self._replaced = False
        #: The generation and node count of the job, running with room, that this
        #: standby found before its first ask (``_room_to_grow``): it joins as a scale-up.
        self._grows: tuple[int, int] | None = None
        self._silence_s = DEFAULT_SILENCE_S
        # The agent's own last pause in this generation's watch (``_watch``), when it
        # ran again, and the workers whose reported failure it has not told the
        # daemon meanwhile (``_resuming``).
        self._paused_s = 0.0
        self._resumed_at = 0.0
        self._unreported: set[WorkerProcess] = set()
        self._interrupt: int | None = None
        self._interrupted = threading.Event()
        # Failure reports still going on past REPORT_FIRST_S; whether that was said.
        self._reports: list[threading.Thread] = []
        self._unconfirmed_said = False

    @property
    def per_node(self) -> int:
        return self.config.local_world_size

    @property
    def _resuming(self) -> bool:
        """Within RESUMED_S of the end of a pause of this agent's own."""
        return self._paused_s > 0 and time.monotonic() - self._resumed_at <= RESUMED_S

    def interrupt(self, signum: int) -> None:
        """From a signal handler: stop this node's workers and end the job."""
        self._interrupt = signum
        self._interrupted.set()

    def run(self) -> int:
        """0 once every worker of the final generation exited 0; 128+N after signal
        N; ``RestartsExhausted`` when a failure finds no restart left."""
        self.pool.fill(self.per_node)
        first = True
        try:
            while True:
                outcome = self._generation(first)
                first = False
                if outcome is None:
                    self.finished_workers = len(self.active)
                    return 0
                if isinstance(outcome, Interrupted):
                    return 128 + outcome.signum
                if isinstance(outcome, NodesWaiting):
                    self.note(f"{outcome.count} node(s) waiting to join: re-forming the job")
                    continue
                if isinstance(outcome, StrayLost):
                    self.note(
                        f"generation {outcome.generation}: {outcome.cause}; re-forming the "
                        "job without it (no restart used)"
                    )
                    continue
                if isinstance(outcome, ScaledDown):
                    self.note(
                        f"generation {outcome.generation}: {outcome.cause}; the "
                        f"{outcome.left} node(s) left make min_nodes="
                        f"{self.config.fewest_nodes}: re-forming the job without it (a "
                        "scale-down: no restart used)"
                    )
                    continue
                if not self.budget.record(outcome):
                    message = self.budget.exhausted_message(self.config.job_id)
                    raise RestartsExhausted(message, outcome.exit_status)
                self.note(
                    f"{outcome.describe()}; restart {self.budget.restarts} of "
                    f"{self.budget.max_restarts}"
                )
        finally:
            self._close_links()
            stop_all(self.active, "the node agent is exiting", 0.0)
            self.active = []
            self.pool.stop()

    # -- one generation ---------------------------------------------------------

    def _generation(self, first: bool) -> Outcome:
        config = self.config
        if not first and (refused := self._choose_ring()) is not None:
            return refused
        joined = self._join(config.join_timeout_s if first else config.rejoin_timeout_s)
        if not isinstance(joined, NodeMembership):
            return joined
        m = joined
        if (before := self.placed) is not None and m.generation <= before.generation:
            self.note(forgotten_run(self.config, before.generation, m.generation))
        self.placed = m
        self._was_member = True
        mark("joined", generation=m.generation, node_rank=m.node_rank)
        if (conflict := loopback_conflict(m.membership_for(0), self.ring_host)) is not None:
            # The workers would dial themselves until their timeout: every node hears why
            # (``loopback_refused``), before any worker is assigned. The setup's error,
            # exit 2 as a bad setting: it exited 1, as a worker's failure does.
            problem = launchers_text(conflict)
            if self.ring_origin:
                # Which setting, or which line of /etc/hosts, made it loopback.
                problem += f". This node's address {self.ring_host} was {self.ring_origin}"
            with contextlib.suppress(RendezvousError):
                self.client.abort(problem, generation=m.generation, cause=LOOPBACK_ADDRESS)
            self._end_generation(final=True)
            self.note(f"error: {problem}")
            return Failure(
                m.generation, problem, host=self.host, exit_status=SETUP_ERROR_EXIT, fatal=True
            )
        self.active = self.pool.take(self.per_node)
        restored = self.state.latest()
        # A worker's process is held to the daemon's own liveness rule for ranks: one
        # silent for the heartbeat timeout is lost (stopped, or frozen holding the GIL).
        self._silence_s = m.heartbeat_timeout_ms / 1000 or DEFAULT_SILENCE_S
        alive_interval = min(
            config.heartbeat_interval_s or DEFAULT_HEARTBEAT_S, longest_beat_s(self._silence_s)
        )
        for i, worker in enumerate(self.active):
            assignment = Assignment(
                **seat_of(m, local_rank=i),
                restart_count=self.budget.restarts,
                rank=m.first_rank + i,
                world_size=m.world_size,
                unique_id=m.unique_id,
                instance_id=m.member_instance_id(i),
                config=config,
                token=self.client.current_token() or self._token,
                ring_host=self.ring_host,
                ring_origin=self.ring_origin,
                alive_interval_s=alive_interval,
                socket_ifname=self.socket_ifname,
            )
            try:
                # Held to the liveness rule as a running worker is: a spare that reads
                # none of its assignment for the heartbeat timeout is lost.
                worker.assign(assignment, restored, within=self._silence_s)
            except AgentChannelError as exc:
                cause = (
                    f"its assignment went unread for {self._silence_s:g} s (the process is "
                    f"stopped, frozen, or still starting): {exc}"
                )
                return self._local_failure(m.generation, m.first_rank, worker, cause, 1)
        gen = m.generation
        mark("assigned", generation=gen)
        self.client.start_heartbeat(
            config.heartbeat_interval_s,
            on_failure=lambda e: self.events.put(RemoteFailure(e, gen)),
            on_nodes_waiting=lambda n: self.events.put(NodesWaiting(n, gen)),
        )
        self._watch_links(m)
        return self._watch(gen, m.first_rank)

    def _choose_ring(self) -> Failure | None:
        """This node's ring (and link) address chosen again before a re-join, the way
        the launcher chose it: a host re-addressed under a running agent (a DHCP
        renewal, a migrated VM) advertised its old address to every generation after,
        whose workers each failed to bind it within milliseconds, every restart spent
        in 0.4 s (h170). An address not given (the route to the daemon) follows the
        host; a ``ring_host`` given that this host no longer has is the setup's error,
        said before the join (exit 2, no restart burned on it). None: join."""
        if self._ring_again is None:
            return None
        before = self.link_host or self.ring_host
        try:
            ring = self._ring_again()
        except ConfigError as exc:
            if not self.config.ring_host:
                # No route to the daemon's address now (a name not resolving, a daemon
                # moving): the join waits for the daemon, and the address chosen last
                # stands meanwhile, as its workers will say should it be gone.
                self.note(f"warning: this node's ring address stays {before}: {exc}")
                return None
            # Said once, by the launcher's "gave up" that lists it: no restart follows.
            problem = (
                f"this node's ring address {before} ({self.ring_origin}) cannot be used on "
                f"host {self.host} any more, its address changed since this node started: "
                f"{exc}; then start this node's rendezvous-run again (no restart changes "
                "a setting)"
            )
            self._tell_readdressed(before)
            return Failure(None, problem, host=self.host, exit_status=SETUP_ERROR_EXIT, fatal=True)
        if ring.address != before:
            self.note(
                f"this node's address changed: its ring now listens on and advertises "
                f"{ring.address}, {ring.origin} (it was {before})"
            )
        self.ring_origin = ring.origin
        if ring.address != before:
            self._repoint_nccl(ring.address)
        if self.ring_host:
            self.ring_host = ring.address
        if self.link_host:
            self.link_host = ring.address
        return None

    def _repoint_nccl(self, address: str) -> None:
        """The NCCL_SOCKET_IFNAME this agent chose, chosen again for this node's new
        ``address``: the warm spares' environment, made at launch, kept the interface
        of the old one, stale where the new address is on another interface. Handed
        to each worker with its assignment, and set here for node 0's bootstrap root
        (``_id_factory`` runs in this process). Not one the user set."""
        if not self.socket_ifname:
            return
        name = interface_holding(address)
        if name is None or name == self.socket_ifname:
            return
        self.note(
            f"NCCL_SOCKET_IFNAME={name} for this node's workers from now on (holds "
            f"{address}, this node's new address; it was {self.socket_ifname})"
        )
        self.socket_ifname = name
        os.environ["NCCL_SOCKET_IFNAME"] = name

    def _tell_readdressed(self, before: str) -> None:
        """The other nodes told why this one leaves (``_choose_ring``'s refusal), as
        data (``SETUP_ERROR``): told nothing, they waited their whole re-join timeout
        (60 s) for it, then said only that the job did not form. The run is closed
        with it, so a node that re-joins after this (the failed generation still the
        job's) is refused at once too. Not an elastic job that can go on without this
        node: closed, it would end; its nodes re-form without it once its kept seat
        lapses."""
        config, placed = self.config, self.placed
        left = placed.num_nodes - 1 if placed is not None else None
        if (
            config.fewest_nodes < config.num_nodes
            and left is not None
            and left >= config.fewest_nodes
        ):
            return
        node = f"node {placed.node_rank} " if placed is not None else "a node "
        words = (
            f"{node}(host {self.host}) left job {config.job_id!r}: its ring address "
            f"{before} ({self.ring_origin}) is no longer an address of that host, which "
            "was re-addressed since it started; fix that setting and start it again"
        )
        with contextlib.suppress(RendezvousError):
            self.client.close_run(words, cause=SETUP_ERROR)

    def _watch_links(self, m: NodeMembership) -> None:
        """Links to the neighbouring nodes' agents, for a backend whose own traffic we
        cannot watch (``node_links``); the CPU ring watches its own links."""
        config = self.config
        if config.backend != "nccl" or not config.node_link_watch or not self.link_host:
            return
        if m.num_nodes < 2:  # nothing to watch; no client made for nothing
            return
        try:
            store = config.rendezvous.client(
                config.job_id,
                config.retry_attempts,
                token=self.client.current_token() or self._token,
            )
            self._links = NodeLinks(
                store,
                m,
                host=self.link_host,
                name=self.host,
                on_silent=self.events.put,
                note=self.note,
                setup_timeout=config.setup_timeout_s,
            )
        except (ConfigError, RendezvousError) as exc:
            self.note(f"warning: the links to the other nodes are not watched: {exc}")
            return
        self._links.start()

    def _close_links(self) -> None:
        if self._links is not None:
            self._links.close()
            self._links = None

    def _join(self, timeout: float) -> NodeMembership | Outcome:
        """``join_node`` on a helper thread while this thread keeps watching: a spare
        that dies meanwhile (a script failing at import) or a signal must not wait
        for the other nodes, which may never come. Given up on, the join is
        cancelled when the launcher closes its client (the daemon then fails the
        forming generation for the other nodes)."""
        config = self.config
        mark("join-start")
        if self._standing_by:
            self._grows = self._room_to_grow()
            if self._grows is not None:
                self.note(
                    f"job {config.job_id!r} runs {self._grows[1]} of its at most "
                    f"{config.num_nodes} nodes: this standby node joins it now as a "
                    f"scale-up, {self.per_node} spare(s) warm (should another node take "
                    "the room first, it stands by for the first node the job loses)"
                )
            else:
                self.note(
                    f"standing by for job {config.job_id!r}, {self.per_node} spare(s) warm: "
                    "this node takes the place of the first node the job loses"
                )

        began = time.monotonic()

        def join(serial: int) -> None:
            standby = self._standing_by  # a standby said once that it stands by
            noting = (
                contextlib.nullcontext()
                if standby
                else saying_what_it_waits_for(
                    self.client.get_job,
                    self.note,
                    config.fewest_nodes,
                    timeout,
                    began,
                    config.last_call_s,
                    None if self.placed is None else self.placed.generation,
                )
            )
            try:
                with noting:
                    m = self.client.join_node(
                        min_nodes=config.fewest_nodes,
                        max_nodes=config.num_nodes,
                        gpus_per_node=self.per_node,
                        node_rank=config.node_rank if config.is_multi_node else 0,
                        addresses=[self.ring_host] * self.per_node if self.ring_host else (),
                        id_factory=self.id_factory,
                        last_call=config.last_call_s or None,
                        timeout=timeout,
                        standby=standby,
                        launched=self.launched,
                        # What must match across the job's nodes: the daemon refuses a
                        # node of another version at once (VersionMismatch), where the
                        # job formed and every restart failed in the ring's handshake.
                        wire_version=ring_wire.WIRE_VERSION,
                    )
            except RendezvousError as exc:
                self.events.put(Joined(serial, exc))
            else:
                self.events.put(Joined(serial, m))

        def start() -> int:
            self._joins += 1
            threading.Thread(
                target=join, args=(self._joins,), daemon=True, name="rendezvous-agent-join"
            ).start()
            return self._joins

        serial = start()
        # A daemon that is not up yet (started after the nodes, restarting) is waited
        # for as a late node is, for the join's own timeout, with no restart used: a
        # restart would only join the same unreachable daemon again, and used them up
        # at connect_timeout each. A standby waits for it as long as for its slot.
        retry_at: float | None = None
        outage = DaemonOutage(
            config.join_timeout_s if self._standing_by else timeout, time.monotonic()
        )
        held_for = DaemonOutage(timeout)  # this node's --node-rank held by another (below)
        # A daemon at a daemon-wide limit (--max-jobs held by other jobs): waited for
        # within the join's timeout, backing off, with no restart used: each restart's
        # join was refused the same way, and 1000 restarts went in 2.4 s.
        room = room_wait(timeout)
        holder_heard: float | None = None  # when the daemon last heard that holder
        while True:
            if self._interrupted.is_set():
                return self._interrupted_outcome(None)
            if retry_at is not None and time.monotonic() >= retry_at:
                retry_at = None
                serial = start()
            event = self._next_event()
            if isinstance(event, Joined) and event.serial == serial:
                answer = event.answer
                if not isinstance(answer, RendezvousError):
                    grown = self._grows
                    if (
                        self._standing_by
                        and grown is not None
                        and answer.generation == grown[0] + 1
                        and answer.num_nodes > grown[1]
                    ):
                        # The room it found, not a lost node's slot (the generation
                        # after the one it saw, with more nodes): "called" read as a
                        # failure where nothing was lost (h122 D4).
                        self.note(
                            f"joined as a scale-up: this node is node {answer.node_rank} of "
                            f"generation {answer.generation} (the job grew from {grown[1]} "
                            f"to {answer.num_nodes} nodes)"
                        )
                    elif self._standing_by:
                        self.note(
                            f"standby called: this node is node {answer.node_rank} of "
                            f"generation {answer.generation} ({answer.num_nodes} nodes)"
                        )
                    self._standing_by = self._replaced = False
                    return answer
                if (
                    (config.standby_if_full or self._was_member)
                    and not self._standing_by
                    and isinstance(answer, LimitExceeded)
                    and answer.reason == "WORLD_FULL"
                ):
                    # As torch's c10d keeps a node beyond max_nodes: every node of a job
                    # (a Kubernetes Job's pods, say) runs one command, the extra ones wait.
                    # A node of the job that was replaced while cut off (lost to the
                    # daemon, its seat given to a standby) stands by too: asked again at
                    # once, it used up every restart within milliseconds and exited 1
                    # (a chaos review, the daemon stopped past its heartbeat timeout).
                    self._standing_by = True
                    outage = DaemonOutage(config.join_timeout_s)
                    full = (
                        f"is re-forming after a failure, its {config.num_nodes} seats taken or "
                        "kept for the nodes re-joining"
                        if answer.metadata.get("seats_kept")
                        else f"has all its {config.num_nodes} nodes"
                    )
                    if self._was_member and not config.standby_if_full:
                        full += " (another node took this one's seat while it was cut off)"
                        self._replaced = True
                    self.note(
                        f"job {config.job_id!r} {full}: standing by, {self.per_node} spare(s) "
                        "warm, for the first node it loses"
                    )
                    serial = start()
                    continue
                if isinstance(answer, JobEnded):
                    # A standby not needed, or a node launched for the run that ended (one
                    # that could not join before it ended): its work is done, exit 0.
                    self.note(
                        f"job {config.job_id!r} ended (every member left); this standby node "
                        "was not needed"
                        if self._standing_by
                        else f"{answer}; this node exits without starting its workers"
                    )
                    return None
                if self._standing_by and isinstance(answer, JobAborted) and answer.closed:
                    # The run ended for good (``close_run``: a torchrun agent out of
                    # restarts, say): a standby is not needed, as one told of a normal
                    # end, and c10d ends a standby of a closed rendezvous without error.
                    self.note(
                        f"job {config.job_id!r} was closed ({answer.abort_reason}); this "
                        "standby node was not needed and exits"
                    )
                    return None
                if self._standing_by and isinstance(answer, RendezvousTimeout):
                    if self._replaced:
                        # Bounded, unlike a standby started as one: a job that failed
                        # for good never ends, and this node would wait forever.
                        cause = (
                            "this node was replaced while it was cut off, and no seat "
                            f"freed up within its join's timeout ({timeout:g} s)"
                        )
                        return Failure(None, cause, host=self.host, fatal=True)
                    outage.reset()
                    serial = start()  # no slot was freed within the wait: stand by again
                    continue
                if isinstance(answer, JobAborted) and answer.abort_cause == SETUP_ERROR:
                    # Another node left on a setting of its own (``_tell_readdressed``):
                    # every re-join is refused as closed, and no restart changes it.
                    return Failure(
                        _refused_in(answer),
                        f"job {config.job_id!r} cannot re-form: {answer.abort_reason}",
                        host=self.host,
                        exit_status=SETUP_ERROR_EXIT,
                        fatal=True,
                    )
                cause = f"joining failed: {type(answer).__name__}: {in_launchers_words(answer)}"
                # Asked again every OUTAGE_RETRY_S for the join's timeout, no restart used:
                # a daemon not up yet (a restart would only join it again, unreachable),
                # and a --node-rank held by another agent, maybe this node's predecessor,
                # frozen or cut off, here or on the host this node replaces, whom the
                # daemon loses within its heartbeat timeout (restarts went in
                # milliseconds; a live twin is heard beating on, and is fatal then).
                holder = _rank_held(answer)
                held = holder is not None
                here = held and holder == answer.metadata.get("offending_host")
                heard = _holder_heard(answer) if held else None
                if held and heard is None and not here:
                    # A daemon that does not say when it last heard the holder: one on
                    # another host cannot be told from a live twin, so it is not waited for.
                    held = False
                if held and heard is not None:
                    if holder_heard is not None and heard - holder_heard > HOLDER_ALIVE_S:
                        # Heard again since this node's first ask: a live twin (two
                        # agents given one rank), not a frozen or lost predecessor.
                        held = False
                        cause += " (its holder's heartbeat went on while this node waited)"
                    holder_heard = heard if holder_heard is None else holder_heard
                limit_hit = daemon_full(answer)
                # Out of descriptors or local ports on this host: no daemon coming up
                # fixes that, so it is said now, not after the join's timeout.
                outage_of = isinstance(answer, DaemonUnavailable) and (
                    LOCAL_SHORTAGE not in answer.metadata
                )
                wait = outage if outage_of else room if limit_hit else held_for if held else None
                if wait is not None:
                    if not wait.told and limit_hit:
                        wait.told = True
                        self.note(
                            f"{'standing by: ' if self._standing_by else ''}{cause}; "
                            f"{room_note(limit_hit, wait.limit_s)}"
                        )
                    if not wait.told:
                        wait.told = True
                        said = cause
                        if held:
                            said = (
                                f"node rank {answer.metadata.get('node_rank')} is held by the "
                                + (
                                    f"node agent on this host ({self.host}), this node's "
                                    "predecessor maybe"
                                    if here
                                    else f"node agent on {holder}, a node this one replaces "
                                    "maybe (frozen or cut off)"
                                )
                                + ", until the daemon loses it or hears it beat on"
                            )
                        self.note(
                            f"{'standing by: ' if self._standing_by else ''}{said}; trying "
                            f"again every {OUTAGE_RETRY_S:g} s for up to {wait.limit_s:g} s "
                            "in all (no restart used)"
                        )
                    retry_at = wait.retry_at(time.monotonic())
                    if retry_at is not None:
                        continue
                    # Waited for the whole join: a restart would wait the same way again.
                    still = "full" if limit_hit else "held" if held else "unavailable"
                    cause += f" (still {still} after {wait.limit_s:g} s of trying)"
                # A daemon still unavailable, or still full, after the whole join: fatal,
                # as a restart would wait the same way again, but no setup error (exit 1).
                setup = _setup_refusal(answer, holder)
                return Failure(
                    _refused_in(answer),
                    cause,
                    host=self.host,
                    exit_status=SETUP_ERROR_EXIT if setup else 1,
                    fatal=setup or isinstance(answer, DaemonUnavailable) or limit_hit is not None,
                )
            if isinstance(event, Exited) and self.pool.discard(event.worker):
                if event.worker.lost:
                    self.pool.fill(self.per_node)  # cold now: not the script's failure
                    continue
                failure = self._spare_died(None, event, replaced=True)
                if failure is not None:
                    return failure
                self.pool.fill(self.per_node)
            elif isinstance(event, Reported):
                event.worker.ack_failure()  # a spare has no rank to report
            elif isinstance(event, Misbehaved):
                self._misbehaved_spare(event)

    def _room_to_grow(self) -> tuple[int, int] | None:
        """(generation, nodes) of this standby's job when it runs below MAX with nobody
        parked for the room: the standby joins it at once as a scale-up (the daemon
        parks it as one and the running nodes re-form with it), not in a lost node's
        place. None otherwise, or when the daemon cannot say (not up yet, the job not
        started): the standby's words then are those of a standby."""
        try:
            job = self.client.get_job()
        except RendezvousError:
            return None
        s = job.summary
        nodes = s.topology.num_nodes
        if s.state != pb.JOB_STATE_RUNNING or nodes + job.nodes_waiting >= self.config.num_nodes:
            return None
        return s.generation, nodes

    def _report_progress(self) -> None:
        """Give the node's heartbeat its workers' last steps and the restart budget
        (the daemon's GetJob and status page show them), when they changed."""
        # The generation's workers, taken one per local rank in order (``SparePool.take``).
        steps = [w.last_step for w in self.active]
        now = (tuple(steps), self.budget.restarts, self.budget.max_restarts)
        if now != self._progress_sent:
            self._progress_sent = now
            self.client.report_progress(
                steps, restarts_used=self.budget.restarts, max_restarts=self.budget.max_restarts
            )

    def _next_event(self) -> Any:
        """The next event, or None when POLL_S passed without one (the callers'
        loops look at their interrupt flag and clocks between events)."""
        try:
            event = self.events.get(timeout=POLL_S)
        except queue.Empty:
            return None
        if isinstance(event, Said):
            self.note(event.line)
            return None
        return event

    def _spare_died(self, gen: int | None, event: Exited, *, replaced: bool) -> Failure | None:
        """Count a spare's death; the failure to give up with when none is left.

        A spare exits only if its script failed before ``init_distributed()`` took
        an assignment (or never called it): a fault of this node's worker, so the
        launcher ends with that worker's exit status (1 for a clean exit, which
        is still a worker that did not train). ``replaced``: whether the caller
        starts a new spare in its place at once (while joining), or leaves it to the
        next generation's workers (while one runs)."""
        w = event.worker
        node_rank = fixed_node_rank(self.config)
        rank = None if node_rank is None else node_rank * self.per_node + w.slot
        status = event.status
        cause = f"{event.how} before it was assigned a rank"
        if w.fault is not None:
            cause = f"{w.fault} (stopped before it was assigned a rank)"
            status = 1
        elif event.code == 0:
            cause += f" ({NO_INIT})"
        failure = Failure(gen, cause, rank, self.host, status, local_rank=w.slot)
        self.first_local = self.first_local or failure
        if not self.budget.allows(failure):
            # The failure this node gives up with: its worker's script failed.
            who = f"rank {rank}" if rank is not None else f"local rank {w.slot}"
            self.note(f"worker {who} (pid {w.pid}) failed first, with {cause}")
            # Recorded once, by ``run`` as the failure the agent gives up with (recorded
            # here too, the final error listed it twice).
            return failure
        self.budget.record(failure)
        # Not "worker rank 3 failed first": it held no rank, no rank was lost, and the
        # job went on (an audit read a killed spare as the job's failure).
        died = f"stopped for {w.fault}" if w.fault is not None else event.how
        if w.fault is None and event.code == 0:
            died += f" ({NO_INIT})"
        instead = (
            "a new spare was started in its place"
            if replaced
            else "no new spare is started now: the next generation starts its workers"
        )
        self.note(
            f"spare worker for local rank {w.slot} (pid {w.pid}), not yet given a rank, "
            f"died: {died}; no rank was lost and the job goes on; {instead}; restart "
            f"{self.budget.restarts} of {self.budget.max_restarts} used (a script that "
            "fails before init_distributed() fails every spare)"
        )
        return None

    def _watch(self, gen: int, first_rank: int) -> Outcome:
        # Counted from when every worker is warm, not from the assignment: a fresh
        # node's workers are still starting then, and spares started beside them
        # would take their CPU (a replacement node at load 20 stepped 5 s later).
        warm_at: float | None = None
        refilled = False
        succeeded: set[WorkerProcess] = set()
        silent: tuple[float, str] | None = None  # when a link went silent, and its cause
        looked = self._resumed_at = time.monotonic()
        self._paused_s = 0.0
        self._unreported.clear()
        held: list[Exited] = []  # workers' failures while the agent was stopped
        # A verdict heard as this node's workers were exiting (``_exiting``): until
        # ``deadline`` their exits, all 0, overrule it.
        verdict: Verdict | None = None
        # The exit of a worker that relayed another rank's report, held until the
        # daemon's record of which came first is settled (``_relay_settled``).
        relayed: Exited | None = None
        while True:
            if self._interrupted.is_set():
                return self._interrupted_outcome(gen)
            if verdict is not None and time.monotonic() >= verdict.deadline:
                return self._verdict(gen, verdict)
            if relayed is not None and self._relay_settled(first_rank, relayed.worker):
                return self._relayed_failure(gen, first_rank, relayed)
            event = self._next_event()
            self._report_progress()
            now = time.monotonic()
            if now - looked > PAUSED_S:
                # A worker was blamed, "no heartbeat from its process for 8.1 s", for
                # the 8 s this agent was stopped, before the daemon's verdict came.
                self._resumed_at, self._paused_s = now, now - looked
            looked = now
            resuming = self._resuming
            if held and not resuming:
                # No verdict came: the workers' own failures, read after what came
                # meanwhile (none of it dropped).
                for exited in held:
                    self.events.put(exited)
                held = []
            if (
                resuming
                and isinstance(event, Exited)
                and event.code != 0
                and event.worker in self.active
            ):
                held.append(event)
                continue
            if warm_at is None and all(w.ready.is_set() for w in self.active):
                warm_at = now
            if not refilled and (
                (warm_at is not None and now - warm_at > SPARE_DELAY_S)
                or any(w.reported_progress for w in self.active)
            ):
                # Only a restart or a re-form could use spares; without either
                # their start-up would only take CPU from the training.
                if self.budget.can_restart or self.config.fewest_nodes < self.config.num_nodes:
                    self.pool.fill(self.per_node)
                refilled = True
            for w in self.active if now - self._resumed_at > RESUMED_S else ():
                if (cause := self._stuck(w, now)) is not None:
                    return self._local_failure(gen, first_rank, w, cause, 1)
            if silent is not None and now - silent[0] >= LINK_SETTLE_S:
                return self._link_failure(gen, first_rank, silent[1])
            if isinstance(event, Exited):
                if event.worker in self.active:
                    if event.code == 0 and not event.worker.ready.wait(READY_READ_S):
                        # Its assignment sent, never taken: it did not train. Counted a
                        # success, the run passed, or (one worker of several) the
                        # others waited for its ring address to the setup timeout and
                        # blamed themselves.
                        cause = f"{event.how} without calling init_distributed(), {WITHOUT}"
                        return self._local_failure(gen, first_rank, event.worker, cause, 1)
                    if event.code == 0:
                        succeeded.add(event.worker)
                        if len(succeeded) == len(self.active):
                            if verdict is not None:
                                self.note(
                                    "every worker of this node exited 0: its work is done, "
                                    f"whatever generation {gen}'s verdict says of the others"
                                )
                            # Final: this node is done and will not re-join. After a
                            # verdict (the generation FAILED) a plain goodbye kept its
                            # seat in the next one, which the nodes that go on waited
                            # for (the seat hold, or their join timeout).
                            self._end_generation(final=True, done=True)
                            return None
                        continue
                    if verdict is not None:
                        return self._verdict(gen, verdict)  # heard first: the cause
                    w = event.worker
                    if w.reported_witness is not None and w not in self._unreported:
                        # Its witness's own report may still come (its exit was read
                        # first, and named it "failed first" where the daemon named the
                        # witness): the others' reports are passed on meanwhile.
                        relayed = relayed or event
                        continue
                    if w.reported_cause is not None:
                        # Its cause is what it reported (the daemon's record, every
                        # other node's words); its exit only this node saw.
                        return self._local_failure(
                            gen, first_rank, w, w.reported_cause, event.status, exited=event.how
                        )
                    return self._local_failure(gen, first_rank, w, event.how, event.status)
                if self.pool.discard(event.worker) and not event.worker.lost:
                    # (A lost spare is not counted: ``take`` starts another, cold.)
                    spare = self._spare_died(gen, event, replaced=False)
                    if spare is not None:
                        return self._stop(gen, spare, f"restarts exhausted: {spare.cause}")
            elif isinstance(event, Reported):
                self._reported(event)
            elif isinstance(event, Misbehaved):
                if event.worker in self.active:
                    return self._local_failure(gen, first_rank, event.worker, event.cause, 1)
                self._misbehaved_spare(event)
            elif isinstance(event, RemoteFailure) and event.generation == gen:
                reporter = None if verdict is not None else self._reported_first(first_rank, event)
                if reporter is not None and reporter.reported_cause is not None:
                    cause = reporter.reported_cause
                    return self._local_failure(gen, first_rank, reporter, cause, 1)
                if verdict is None:
                    verdict = self._heard(gen, event)
                    if not self._exiting(succeeded):
                        return self._verdict(gen, verdict)
                    self.note(
                        f"heard as every worker of this node was exiting: {verdict.cause}; "
                        f"if they all exit 0 (within {FINISHED_EXIT_S:g} s) this node's work "
                        "is done, else that failure stands"
                    )
            elif isinstance(event, LinkSilent) and event.generation == gen:
                silent = silent or (now, event.cause)
            elif isinstance(event, NodesWaiting) and event.generation == gen:
                with contextlib.suppress(RendezvousError):
                    self.client.abort(SCALE_UP_REASON, generation=gen)
                stop_all(self.active, "scale-up: the job re-forms with the waiting nodes", 0.0)
                self._end_generation()
                return event

    def _relay_settled(self, first_rank: int, relay: WorkerProcess) -> bool:
        """Whether the daemon's record of ``relay``'s failure is settled: its witness,
        if one of this node's workers, reported (and was passed on), or the witness
        window since the relay's own report is over (``rounds._witness_first``)."""
        if time.monotonic() - relay.last_progress >= WITNESS_WINDOW_S:
            return True
        return self._reported_worker(first_rank, relay.reported_witness) is not None

    def _reported_worker(self, first_rank: int, rank: int | None) -> WorkerProcess | None:
        """This node's worker at global ``rank`` that reported its failure, if any."""
        for w in self.active:
            if (
                w.local_rank is not None
                and first_rank + w.local_rank == rank
                and w.reported_cause is not None
            ):
                return w
        return None

    def _relayed_failure(self, gen: int, first_rank: int, event: Exited) -> Failure | Interrupted:
        """The failure of a worker that relayed another rank's report, as the daemon
        recorded it: where its first loss is another worker of this node that reported
        (the witness), that worker failed first; else the relay, with the daemon's
        first named beside it when another node's."""
        w = event.worker
        rank = first_rank + (w.local_rank or 0)
        recorded = self._recorded_first(gen)
        # Where the daemon cannot be asked (down with the lost node), its rule: the
        # witness's report within the window takes the relay's place.
        named = recorded.rank if recorded is not None else w.reported_witness
        other = self._reported_worker(first_rank, named) if named != rank else None
        if other is not None and other.reported_cause is not None:
            return self._local_failure(gen, first_rank, other, other.reported_cause, 1)
        assert w.reported_cause is not None  # held only after its report (``_watch``)
        first = None if recorded is None or recorded.rank == rank else recorded
        return self._local_failure(
            gen, first_rank, w, w.reported_cause, event.status, exited=event.how, recorded=first
        )

    def _recorded_first(self, gen: int) -> FailedMember | None:
        """The daemon's first loss of ``gen``; None where it cannot say (gone, moved on).
        Asked by a client of its own, bounded (``root_cause.bounded_client``): through
        the node's, a daemon down with the lost node (rank 0's node hosting it) held
        this failure's words 28 s, its call's retries in the outage."""
        transport = self.config.rendezvous
        if transport.endpoint is None:
            return None
        token = self.client.current_token() or self._token
        try:
            with bounded_client(
                transport.endpoint, self.config.job_id, token=token, tls=transport.tls()
            ) as probe:
                job = probe.get_job()
        except (RendezvousError, OSError, ValueError):
            return None
        if job.summary.generation != gen or not job.failed:
            return None
        return failed_members(job.failed[:1])[0]

    def _exiting(self, succeeded: set[WorkerProcess]) -> bool:
        """Whether every worker of this node is done with the job: exited 0, or closed
        its channel on its way out (``released``) without reporting a failure. A verdict
        that comes then (a peer lost as the job ends: killed, or its host gone) is no
        failure of this node's if their exits are all 0, as torchrun's agent reports a
        node whose workers all succeeded: it stopped workers that were exiting 0 and
        exited 1 (or restarted a job that was done). A worker closes its channel on a
        failure too (a peer's, which it does not report), so only its exit tells."""
        return all(
            w in succeeded or (w.released.is_set() and w.reported_cause is None)
            for w in self.active
        )

    def _heard(self, gen: int, event: RemoteFailure) -> Verdict:
        """The daemon's verdict on ``gen``, worded as it is heard (``_dropped`` says
        whether this agent had just been stopped)."""
        mark("failure-heard", generation=gen)
        error = event.error
        cause = describe_remote(error)[0]
        if isinstance(error, StaleGeneration):
            cause = self._dropped(gen, error)
        elif isinstance(error, PeerFailed) and error.failed and self._ours(gen, error):
            cause = self._lost(gen, error)
        return Verdict(error, cause, time.monotonic() + FINISHED_EXIT_S)

    def _reported_first(self, first_rank: int, event: RemoteFailure) -> WorkerProcess | None:
        """This node's worker whose own report the daemon lists as the generation's first
        loss, if it does: the daemon answers this node's own calls (its heartbeat) with
        the whole list, so a verdict can come back before that worker exits. It is then
        this node's failure as its worker reported it, not the daemon's loss of the node."""
        error = event.error
        if isinstance(error, DaemonUnavailable):
            # The daemon cannot say (down with the node that failed, as when it runs on
            # rank 0's node): this node's own reported failure is the cause it knows.
            # It was worded "DaemonUnreachable ... no peer is known to have failed",
            # the worker's "lost rank 1" dropped, once the report's 10 s had passed.
            return self._first_own_report(first_rank)
        if not isinstance(error, PeerFailed) or not error.failed:
            return None
        w = self._reported_worker(first_rank, error.failed[0].rank)
        return w if w is not None and w not in self._unreported else None

    def _first_own_report(self, first_rank: int) -> WorkerProcess | None:
        """This node's worker whose report came first, by the daemon's rule: a relay's
        witness among them takes its place (``rounds._witness_first``)."""
        reported = [w for w in self.active if w.local_rank is not None and w.reported_cause]
        ranks = {first_rank + (w.local_rank or 0) for w in reported}
        own = [w for w in reported if w.reported_witness not in ranks]
        return min(own or reported, key=lambda w: w.last_progress, default=None)

    def _ours(self, gen: int, error: PeerFailed) -> bool:
        """Whether the first member the daemon lost in ``gen`` is one of this node's
        ranks. One its workers reported is told apart first (``_reported_first``): this is
        the daemon's loss of the node (its agent stopped or cut off past the heartbeat
        timeout)."""
        return self.placed is not None and self.placed.holds(gen, error.failed[0].rank)

    def _stopped_for(self) -> str:
        """Why the daemon lost this node, when this agent had just been stopped."""
        # The daemon counts its timeout from the last beat before the stop, up to a
        # beat's interval earlier: the stop itself may be shorter than the timeout
        # ("stopped for 2.7 s, past the daemon's heartbeat timeout (3 s)", once).
        return (
            f" while this agent was stopped for {self._paused_s:.1f} s, its last heartbeat "
            f"then older than the daemon's heartbeat timeout ({self._silence_s:g} s)"
            if self._resuming
            else ""
        )

    def _lost(self, gen: int, error: PeerFailed) -> str:
        """The daemon's verdict on ``gen`` when the member it lost first is this node's
        (``_ours``): said as this node's loss, with the daemon's facts. Worded as the
        other nodes hear it, "PeerFailed: ... lost rank 2 on HOST", it read as a peer's
        loss, and the root cause as another node's, naming this node's own rank."""
        return (
            f"this node was lost from job {self.config.job_id!r} generation {gen}"
            f"{self._stopped_for()}: the other nodes were told the daemon lost "
            f"{named_losses(error.failed)}"
        )

    def _verdict(self, gen: int, verdict: Verdict) -> Outcome:
        """The daemon's verdict on ``gen`` (a peer lost, an abort, the daemon gone) ends
        this node's part in it: its workers stopped, the failure to restart after."""
        error, cause = verdict.error, verdict.cause
        _, rank, host = describe_remote(error)
        lost = error.failed if isinstance(error, PeerFailed) else ()
        if stray([f.cause for f in lost]):
            self._stop(gen, Failure(gen, cause, rank, host), cause, rejoins=True)
            # Its host and cause are the stray's own text: shown escaped.
            return StrayLost(gen, shortened(f"rank {rank} on {host}: {lost[0].cause}"))
        if isinstance(error, JobAborted) and (
            loopback_refused(error) or error.abort_cause == SETUP_ERROR
        ):
            # Another node's loopback ring address, or a node that left on a setting
            # of its own (``_tell_readdressed``): its setup's error, which it exits 2
            # on. A restart here would wait out the join's timeout for that node (or
            # be refused as closed).
            setup = Failure(gen, cause, rank, host, exit_status=SETUP_ERROR_EXIT, fatal=True)
            return self._stop(gen, setup, cause)
        if isinstance(error, JobAborted) and error.abort_cause == NODE_STOPPED:
            placed = self.placed
            left = placed.num_nodes - 1 if placed and placed.generation == gen else None
            why = self._cannot_go_on(left)
            if why is None and left is not None:
                self._stop(gen, Failure(gen, cause, rank, host), cause, rejoins=True)
                return ScaledDown(gen, cause, left)
            cause += why or ""
        failure = Failure(gen, cause, rank, host)
        # No goodbye to a daemon this node found gone: said while it is down,
        # it reached the daemon restarted with its state as a clean leave of
        # the restored generation, which then ended "every member left", and
        # held the seat against this node's re-join (WORLD_FULL). Unsaid, the
        # re-join ends that generation (its node agent joined again).
        gone = isinstance(error, DaemonUnavailable)
        return self._stop(gen, failure, cause, goodbye=not gone)

    def _cannot_go_on(self, left: int | None) -> str | None:
        """A node was stopped by a signal and left for good, ``left`` nodes staying
        (None: not known): None where they still make min_nodes of an elastic job (a
        scale-down, no restart used), else why the job cannot go on without it, for
        its failure's words (a restart of the nodes left waits for a node to take its
        place)."""
        config = self.config
        if config.fewest_nodes == config.num_nodes:
            return (
                f" (a job of a fixed size, --nnodes {config.num_nodes}, cannot go on "
                "without a node: a restart waits for one to take its place, and with no "
                "restart left the job ends; --nnodes MIN:MAX lets it go on smaller)"
            )
        if left is None or left >= config.fewest_nodes:
            return None
        return (
            f" (the {left} node(s) left are below min_nodes={config.fewest_nodes}: a "
            "restart waits for a node to take its place, and with no restart left the "
            "job ends)"
        )

    def _dropped(self, gen: int, error: StaleGeneration) -> str:
        """Why the job moved on from this node, for a heartbeat the daemon refused as
        stale: the other nodes re-formed, or opened the next generation to re-form in,
        while this one could not hear the verdict (SIGSTOP, a partition), and what is
        left to hear is that the job moved on. Said so; the SDK's own words were "rejoin
        to take part in the current generation"."""
        then = error.current_generation or "a later one"
        # Not "without it": the stale refusal comes as soon as the other nodes open the
        # next generation, which a fixed size forms only with this node (its restart).
        why = self._stopped_for()
        if why:
            why += ": the other nodes were told this node was unreachable"
        elif failed := error.metadata.get("failed"):
            # The daemon's verdict on it, which it could not hear (its stream cut).
            why = f" (it failed: {shortened(failed)})"
        return (
            f"this node was dropped from generation {gen}{why}; the job moved on to "
            f"generation {then}"
        )

    def _stuck(self, w: WorkerProcess, now: float) -> str | None:
        """Why a worker that has not exited counts as failed, if it does: it reported
        its own failure and did not exit, its process went silent, or it stopped
        making progress."""
        if w.exited.is_set():
            return None
        quiet, silent = now - w.last_heard, now - w.last_progress
        if w.reported_cause is not None and silent > REPORTED_EXIT_S:
            return w.reported_cause
        if w.ready.is_set() and quiet > self._silence_s:
            return (
                f"no heartbeat from its process for {quiet:.1f} s (stopped, or frozen "
                "without releasing the GIL)"
            )
        hang = self.config.hang_timeout_s
        if w.reported_progress and silent > hang:
            # Its last alive beat, if it came after its last progress, says whether it
            # waits in a collective, maybe only for a peer that stopped: that peer's
            # own agent names it first (either agent was first, so a healthy rank
            # was blamed about half the time). Every rank waiting in one (a
            # deadlock), or not telling, is still named, this much later.
            told = w.alive_at > w.last_progress
            if told and not w.in_collective:
                return f"hung: no progress for {silent:.1f} s"
            if silent > hang * COLLECTIVE_HANG_FACTOR:
                waiting = ", waiting in a collective" if told else ""
                return f"hung: no progress for {silent:.1f} s{waiting}"
        return None

    def _misbehaved_spare(self, event: Misbehaved) -> None:
        """A spare sent a bad frame: stopped, its exit is counted as its failure
        (``_spare_died`` names the frame)."""
        w = event.worker
        if w in self.pool.spares and w.fault is None:
            w.fault = event.cause
            w.signal(signal.SIGKILL)

    def _reported(self, event: Reported) -> None:
        w = event.worker
        if w in self.active and w.local_rank is not None and w.reported_cause is None:
            w.reported_cause = event.cause or "a failure it did not describe"
            w.reported_witness = event.witness
            w.last_progress = time.monotonic()  # REPORTED_EXIT_S counts from here
            if self._resuming:
                # Told later, if it is still the failure (``_local_failure``): reported
                # now, it would read as this node's first (see RESUMED_S).
                self._unreported.add(w)
            else:
                self._report(w.local_rank, w.reported_cause, w.reported_witness)
        w.ack_failure()

    def _local_failure(
        self,
        gen: int,
        first_rank: int,
        w: WorkerProcess,
        cause: str,
        status: int,
        *,
        exited: str | None = None,
        recorded: FailedMember | None = None,
    ) -> Failure | Interrupted:
        """``cause``: any text (a worker's exception), reported whole and shown shortened;
        ``exited``: how the worker that reported ``cause`` then exited ("exit code 1"),
        which this node's own lines add before it, as the others add a rank and host:
        "exit code 1 (RuntimeError: ...)". Folded into the cause ("exit code 1 after
        RuntimeError: ...") and cut as one, it was worded and cut unlike the same
        failure on every other surface (the daemon's log, the other nodes, status).
        ``recorded``: another node's loss the daemon recorded first (this worker relayed
        its report), named as the first in its place."""
        local = w.local_rank if w.local_rank is not None else 0
        rank = first_rank + local
        shown = shortened(cause) if exited is None else f"{exited} ({shortened(cause)})"
        said = f"worker rank {rank} (pid {w.pid}) failed first, with {shown}"
        if recorded is not None:
            said = (
                f"worker rank {rank} (pid {w.pid}) failed, with {shown}, relaying the report "
                f"of rank {w.reported_witness}; the daemon recorded {recorded.describe()} first"
            )
        report = w.reported_cause is None or w in self._unreported
        return self._own_failure(
            gen, rank, local, cause, status, said, report, shown, witness=w.reported_witness
        )

    def _link_failure(self, gen: int, first_rank: int, cause: str) -> Failure | Interrupted:
        """A link to another node went silent and the daemon told of nothing meanwhile:
        a cut between nodes that both reach the daemon. Reported as this node's own
        failure (its first rank's), as the CPU ring's ranks report a silent link."""
        said = f"this node {cause}"
        return self._own_failure(gen, first_rank, 0, cause, 1, said, True, shortened(cause))

    def _own_failure(
        self,
        gen: int,
        rank: int,
        local: int,
        cause: str,
        status: int,
        said: str,
        report: bool,
        shown: str,
        *,
        witness: int | None = None,
    ) -> Failure | Interrupted:
        """A failure of this node's own, at ``local`` (global ``rank``): ``said`` here,
        reported to the daemon unless it already was (``report``), every worker stopped;
        ``shown``: ``cause`` as this node's summary lists it; ``witness``: the rank whose
        report of it the worker relays."""
        mark("failure-heard", generation=gen)
        self.note(said)
        failure = Failure(gen, shown, rank, self.host, status, local_rank=local)
        self.first_local = self.first_local or failure
        if report:
            # Before stopping our other workers: the other nodes hear of it sooner.
            self._report(local, cause, witness)
        if self._interrupted.is_set():
            # Stopped while the report waited: the signal's stop, as torchrun's agent
            # acts on it at once (its workers get their grace, the launcher 128 + N).
            return self._interrupted_outcome(gen)
        # Worded as the daemon words it to the other nodes: every node's workers log
        # the same cause for the same failure.
        named = f"job {self.config.job_id!r} generation {gen}"
        lost = FailedInfo(rank, self.host, cause, local_rank=local)
        return self._stop(gen, failure, f"PeerFailed: {failed_text(named, [lost])}")

    def _report(self, local: int, cause: str, witness: int | None = None) -> None:
        """Sent on a thread of its own and waited for (the other nodes hear of the
        failure before this node's other workers are stopped) while a daemon that
        answers would have: ``REPORT_FIRST_S``, or until a signal. A daemon that did not
        answer held the workers' stop for its whole outage window (12 s measured), the
        others in collectives that could not complete. The report then goes on while
        the workers stop, and the node's goodbye or next join waits for it
        (``_await_reports``): a daemon back within its window still records the cause
        first. Stopped by a signal, it ends with the launcher."""
        sent = threading.Event()

        def send() -> None:
            try:
                self.client.report_failure(local, cause, witness_rank=witness)
            except RendezvousError as exc:
                if not self._interrupted.is_set():  # else the stop says the daemon went untold
                    said = in_launchers_words(exc)
                    self.note(f"could not report the failure to the daemon: {said}")
            finally:
                sent.set()

        report = threading.Thread(target=send, daemon=True, name="rendezvous-agent-report")
        report.start()
        self._reports.append(report)
        until = time.monotonic() + REPORT_FIRST_S
        while not sent.wait(POLL_S):
            if self._interrupted.is_set():
                return
            if time.monotonic() >= until:
                if not self._unconfirmed_said:
                    self._unconfirmed_said = True
                    endpoint = self.config.rendezvous.endpoint or "its endpoint"
                    self.note(
                        f"the daemon at {endpoint} did not confirm the failure report within "
                        f"{REPORT_FIRST_S:g} s: stopping this node's workers meanwhile (the "
                        "report goes on, and this node re-joins or exits once it is answered "
                        "or the daemon's outage window ends)"
                    )
                return

    def _await_reports(self) -> None:
        """Before this node's goodbye or next join: its failure reports still going on
        (``_report``) are waited for, within the SDK's outage window, but not past a
        signal. Sent after them, a Leave or join that a daemon back from its outage
        read first recorded this node's leaving, not the failure, as the cause."""
        if self._interrupted.is_set():
            return
        for report in self._reports:
            while report.is_alive() and not self._interrupted.is_set():
                report.join(POLL_S)
        self._reports = [r for r in self._reports if r.is_alive()]
        self._unconfirmed_said = False

    def _stop(
        self,
        gen: int,
        failure: Failure,
        cause: str,
        *,
        rejoins: bool = False,
        goodbye: bool = True,
    ) -> Failure | Interrupted:
        """``rejoins``: the job re-forms whatever the restart budget says (a stray);
        ``goodbye``: whether to Leave (``_end_generation``). Interrupted: a signal came
        while a failure report still went on (``_report``)."""
        # Said here, at once, on every node: the workers may be gone before they log it.
        self.note(f"{STOPPING}{cause}")
        stop_all(self.active, cause, STOP_GRACE_S)
        self.active = []
        self._await_reports()
        if self._interrupted.is_set():
            # Stopped while a report it did not hold the workers for waited: the
            # signal's stop still (128 + N), as while it held them (``_own_failure``).
            return self._interrupted_outcome(gen)
        final = not rejoins and not self.budget.allows(failure)
        self._end_generation(final=final, goodbye=goodbye)
        mark("stopped", generation=gen)
        return failure

    def _end_generation(
        self, *, final: bool = False, goodbye: bool = True, done: bool = False
    ) -> None:
        """``final``: this agent will not re-join (it gives up, or is stopped), so the
        next generation keeps no seat for it: the job id launched again at once, or
        the nodes that go on, would otherwise wait out the seat hold for it. ``done``:
        this node's work is done, and its goodbye waits for a daemon restarting now
        (``_daemon_back``). Not a node giving up or stopped: its failure is said
        either way, and a stopped node's scheduler waits only so long."""
        self._await_reports()  # first: the report, not its links' close, tells the others
        self._close_links()
        if not goodbye:
            return  # the heartbeat ended with the failure; the next join starts afresh
        if done and self._daemon_back():
            # Its own channel may still be in its reconnect backoff (up to 2.4 s) after
            # an outage, past the Leave's own deadline: under load the goodbye then
            # failed although a daemon served. Connected first (connect_timeout).
            with contextlib.suppress(RendezvousError):
                self.client.connect()
        # Stops the node's heartbeat; a failed generation is over either way.
        with contextlib.suppress(RendezvousError):
            self.client.leave(final=final)

    def _daemon_back(self) -> bool:
        """Before the final goodbye: a daemon restarting now (within its heartbeat
        timeout) is waited for, as joins and barriers wait for it. Told nothing, the
        restored daemon lost this node at that timeout, and a job that finished was
        recorded FAILED ("node unreachable")."""
        transport = self.config.rendezvous
        if transport.endpoint is None:
            return False
        endpoint, job_id = transport.endpoint, self.config.job_id
        node = "" if self.placed is None else f"node {self.placed.node_rank} of "

        def serves(within: float) -> bool:
            token = self.client.current_token() or self._token
            tls = transport.tls()
            return daemon_serves(
                endpoint, job_id, within, token=token, token_file=transport.token_file, tls=tls
            )

        waiting = (
            f"no daemon answers at {endpoint} to hear that {node}job {job_id!r} left: "
            "waiting for it to come back (a restart) before this node exits"
        )
        return await_daemon(serves, self._silence_s, self.note, waiting)

    def _tell_stopped(self, gen: int, signum: int) -> None:
        """Best effort, on a thread of its own: the workers' stop never waits for it
        past ``TELL_STOPPED_FIRST_S``, and the process exits without it."""
        with contextlib.suppress(RendezvousError):
            # As data (NODE_STOPPED): this node leaves for good, and the others
            # re-form without it, an elastic job's without using a restart.
            self.client.abort(
                f"rendezvous-run on host {self.host} was stopped by {signal.Signals(signum).name}",
                generation=gen,
                cause=NODE_STOPPED,
            )

    def _tell_stopped_forming(self, signum: int) -> None:
        """Stopped while its join waits in a forming generation: that generation told
        it was stopped (``_tell_stopped``), as a running one is. Its join's cancel alone
        failed it as a death, "its JoinNode was cancelled (node agent died or
        disconnected)". Only where this join is one the generation counts, found by its
        host and node rank (a standby's, or one with no rank beside another node of its
        host, is left to its cancel): the abort of a running job's generation by its
        standby stopped ended the job. Pinned to that generation: formed since, this
        node is of it; re-opened since, the abort is refused as stale."""
        with contextlib.suppress(RendezvousError):
            job = self.client.get_job()
            rank = self.config.node_rank if self.config.is_multi_node else 0
            here = [n for n in job.joining if n.host == self.host]
            named = [n for n in here if n.HasField("node_rank") and n.node_rank == rank]
            if (
                not self._standing_by
                and job.summary.state == pb.JOB_STATE_FORMING
                and (named if rank is not None else len(here) == 1)
            ):
                self._tell_stopped(job.summary.generation, signum)

    def _interrupted_outcome(self, gen: int | None) -> Interrupted:
        """``gen`` None: interrupted while joining (``_tell_stopped_forming``)."""
        signum = self._interrupt or 15
        # Said, as torchrun does: a launcher stopped by a signal exited 143 in silence.
        self.note(
            f"got {signal.Signals(signum).name}: stopping this node's workers (they get "
            f"{self.config.stop_grace_s:g} s to finish) and ending its part in job "
            f"{self.config.job_id!r}"
        )
        if gen is None:
            forming = threading.Thread(
                target=self._tell_stopped_forming,
                args=(signum,),
                daemon=True,
                name="rendezvous-agent-stopped",
            )
            forming.start()
            forming.join(TELL_STOPPED_FIRST_S * 2)  # two calls: GetJob, then Abort
        if gen is not None:
            # First: the other nodes hear the cause now, not once this node's workers
            # are done with their handlers (meanwhile theirs would block in collectives
            # with ours, then blame the broken connections). But only for as long as a
            # daemon that answers takes: one that does not (down, stopped, this node
            # cut off) held the workers' signal for its whole outage window (10-28 s
            # measured), the scheduler's grace (Kubernetes' 30 s) gone before it came.
            told = threading.Thread(
                target=self._tell_stopped,
                args=(gen, signum),
                daemon=True,
                name="rendezvous-agent-stopped",
            )
            told.start()
            told.join(TELL_STOPPED_FIRST_S)
        # Passed on, as torchrun does: in sessions of their own, the workers get no
        # Ctrl-C from the terminal (a SIGINT then raises KeyboardInterrupt there). As
        # torchrun, they get time to act on it (a preemption's checkpoint), where a
        # failure's stop (STOP_GRACE_S) gives none: their state is in the agent.
        cause = f"rendezvous-run on {self.host} got {signal.Signals(signum).name}"
        stop_all(self.active, cause, self.config.stop_grace_s, signum)
        self.active = []
        if gen is not None:
            self._stopped_goodbye()
        return Interrupted(signum)

    def _stopped_goodbye(self) -> None:
        """A stopped node's goodbye (``_end_generation``), on a thread of its own and
        waited for ``STOPPED_GOODBYE_S`` at most: a daemon that answers confirms it
        within milliseconds, one that does not (stopped, hung, cut off) held the exit
        for the stream goodbye's wait and the final Leave's (6.5 s measured). Its
        abort (NODE_STOPPED) already told the daemon, if it could be told, that this
        node leaves for good; untold, the daemon loses it at its heartbeat timeout."""
        self._close_links()  # here, not on the goodbye's thread: run() closes them too
        goodbye = threading.Thread(
            target=self._end_generation,
            kwargs={"final": True},
            daemon=True,
            name="rendezvous-agent-goodbye",
        )
        goodbye.start()
        goodbye.join(STOPPED_GOODBYE_S)
        if goodbye.is_alive():
            endpoint = self.config.rendezvous.endpoint or "its endpoint"
            node = "" if self.placed is None else f"node {self.placed.node_rank} of "
            self.note(
                f"could not tell the daemon at {endpoint} that {node}job "
                f"{self.config.job_id!r} left: no answer within {STOPPED_GOODBYE_S:g} s; "
                "exiting without it (the daemon loses this node at its heartbeat timeout)"
            )
