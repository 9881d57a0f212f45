"""torchrun's rendezvous through rendezvousd: ``torchrun --rdzv-backend rendezvousd``.

torch finds this handler through the ``torchrun.handlers`` entry point (a zero-argument
factory returning ``RendezvousParameters -> RendezvousHandler``; torch's
``elastic/rendezvous/registry.py``). Training scripts stay as they are:
``init_process_group("nccl" | "gloo")`` from the environment torchrun sets.

What each torchrun agent does here:

- ``next_rendezvous()`` is **one JoinNode** (node 0 repeats it once with the id the
  protocol asks for), then the node's heartbeat stream. The daemon answers every agent
  when the round forms; nobody polls. Each agent is one member of the round (a node of
  one rank): torchrun numbers its workers itself, from ``--nproc-per-node``, which a
  handler is not told.
- **Peer failure.** The daemon pushes a peer's loss (a node's agent killed or cut off,
  or a worker failure another agent reported) over the heartbeat stream within
  milliseconds. ``num_nodes_waiting()`` then answers at least 1: torchrun's agent polls
  it every ``--monitor-interval`` (0.1 s) while its workers look healthy and restarts
  them into the next round — the hook torch itself uses for scale-up, so survivors stuck
  in a collective do not wait for the NCCL/gloo timeout (pytorch/pytorch#111646). It
  costs no restart on the survivors: torch counts only local failures. An agent with no
  restarts left (``--max-restarts 0``, or all used) stops instead, as c10d's survivors
  do once their collectives break: its ``next_rendezvous()`` raises, naming the lost
  node (``_no_restarts_left``); and, as an agent that gives up does, it closes the
  rendezvous when the nodes left cannot form the next round without it
  (``_stopping``: closed at the daemon, which refuses a survivor's later re-join), so a
  survivor waiting there, or re-joining late, ends now, not at join_timeout.
  A survivor whose next round fails before it forms (a replacement or another
  survivor lost, its JoinNode cancelled) joins the one after for what is left of
  join_timeout, and while it waits its note names the nodes lost since the job last
  formed (``_join``).
- A local restart (torchrun calls ``next_rendezvous()`` while our round still runs)
  reports the failure first, so every other agent hears it at once and re-joins too; a
  restart for waiting nodes ends the round with the ``scale-up`` reason instead.
- **The store.** torch's agent makes a few store calls per round (the worker rank
  table, the master address, the exit barrier): they go to :class:`DaemonStore`, the
  daemon's authenticated, per-round key-value store. The *workers'* process-group
  bootstrap does not: gloo's full mesh makes O(N²) store reads, and an RPC through the
  daemon costs ~0.5 ms of its CPU, so the workers use torch's own TCPStore on node 0's
  worker rank 0 at ``MASTER_ADDR:MASTER_PORT`` (``use_agent_store`` is False), as stock
  torchrun does with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``. That store is torch's and,
  as in stock torch, unauthenticated: docs/trainer.md ("From torchrun") says so.
- **Addresses.** Like ``rendezvous-run``'s workers, torchrun's advertise the address
  this host routes towards the daemon (``--local-addr`` overrides): it is node 0's
  MASTER_ADDR, and, unless ``GLOO_SOCKET_IFNAME`` is set, the handler points gloo at
  the interface that holds it. gloo otherwise resolves the hostname, which on many
  machines (and network namespaces) is 127.0.0.1 or nothing, and its full mesh then
  fails with "connection refused" across hosts.
  People read the hostname, as under ``rendezvous-run``: the daemon records it as
  the node's host (every loss and cause names it), the address beside it.
- **Warm workers.** With ``PYTHON_EXEC=rendezvous-python``, torchrun starts each worker
  through our shim, and the handler starts the node's fork server (``warm``) when the
  agent starts: it imports torch once, and every worker after a failure is forked warm
  instead of importing torch again (~2.1 s of CPU each).
- **Errors** are torch's own rendezvous exceptions carrying our message: an unreachable
  daemon or a refused token → ``RendezvousConnectionError``, a join that timed out →
  ``RendezvousTimeoutError``, anything else the daemon refused (topology mismatch...)
  → ``RendezvousError``. Where the SDK's words fit our CLI, not torchrun (its
  ``--tls-ca``; a topology's ``--nproc-per-node``, which may differ between torchrun's
  nodes), torchrun's user reads torchrun's (``_in_torchruns_words``).
- **A signalled agent** (SIGTERM, SIGINT...) tells the others why before torch stops its
  workers: the handler wraps the signal handler torch installs (``_watch_signals``),
  since torch's launcher skips ``shutdown()`` then.
- **A cut between two nodes** that both still reach the daemon (their heartbeats go
  on) is seen by the agents' own links (``node_links``, ``node_link_watch``): a link
  silent for 10 s, and no word from the daemon for 2 s more, and the agent reports it
  as its node's failure, so every agent restarts its workers into the next round (the
  workers' NCCL or gloo would wait out their own timeouts, minutes). When the next
  round's link cannot even connect, the cut is still there: that agent gives up (its
  next ``next_rendezvous()`` raises, naming the link) instead of re-forming across it
  again and again.
- **A node beyond max_nodes** stands by instead of failing, as torch's redundancy list
  does: its JoinNode parks as a standby, is not counted in ``num_nodes_waiting()``,
  takes the place of the first node the job loses, outlives a daemon restart (it asks
  again for up to ``join_timeout``), and exits 0 when the job ends without it (torch's
  ``RendezvousGracefulExitError`` would crash torch 2.13's launcher).

Settings: ``--rdzv-conf key=value,...`` over ``RENDEZVOUSD_*`` variables; the keys are
:class:`~rendezvousd.trainer.torchrun.config.TorchrunSettings`' fields.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous.api import RendezvousParameters


# The entry point comes before torch's imports: importing torch's rendezvous package
# registers every out-of-tree handler, so a program that imports this module first
# makes torch load this entry point while the module is still half-initialised.
def handler_factory() -> Callable[[RendezvousParameters], RendezvousdHandler]:
    """The ``torchrun.handlers`` entry point: torch calls it with no argument."""
    return create_handler


def create_handler(params: RendezvousParameters) -> RendezvousdHandler:
    return RendezvousdHandler.from_parameters(params)


import os

# gRPC core logs each failed TLS handshake at INFO ("Handshake failed ...
# WRONG_VERSION_NUMBER" for tls_ca against a plaintext daemon) around the agent's own
# error, which names the failure and what to do. Only a process-wide threshold exists,
# read when grpc is first imported: by the SDK's imports below (torch imports no grpc,
# and torchrun loads this module as it starts). As rendezvous-run does; torchrun's
# workers inherit it; a GRPC_VERBOSITY the user set is kept.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import atexit
import contextlib
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping, MutableMapping, Sequence
from datetime import timedelta
from types import FrameType
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous import api as torch_rdzv

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client import (
    AuthenticationError,
    DaemonUnavailable,
    DaemonUnreachable,
    InvalidRequest,
    JobAborted,
    JobEnded,
    LimitExceeded,
    PeerFailed,
    RendezvousClient,
    RendezvousError,
    RendezvousTimeout,
    StaleGeneration,
    TopologyMismatch,
)
from rendezvousd.client._session import DAEMON_LOST_ADVICE
from rendezvousd.client.connection import (
    NO_TOKEN_ADVICE,
    TLS_CA_ADVICE,
    TLS_CHECK_ADVICE,
    TLS_DROP_ADVICE,
    TLS_PAIR_ADVICE,
    TLS_SWAP_ADVICE,
)
from rendezvousd.client.errors import TOKEN_ADVICE
from rendezvousd.client.membership import LOOPBACK_ADDRESS, NodeMembership
from rendezvousd.client.warnings_said import say_client_warnings
from rendezvousd.common.address import AddressError, UnresolvedHost, is_loopback, route_source
from rendezvousd.common.env_names import unknown_names
from rendezvousd.common.escape import bounded, escape
from rendezvousd.common.limits import Limits
from rendezvousd.common.members import named_losses
from rendezvousd.common.validation import LONGEST_WAIT_S
from rendezvousd.trainer.agent.node_links import LINK_SETTLE_S, LinkSilent, NodeLinks
from rendezvousd.trainer.agent.recovery import (
    OUTAGE_RETRY_S,
    SCALE_UP_REASON,
    DaemonOutage,
    daemon_full,
    room_wait,
)
from rendezvousd.trainer.agent.waiting_note import saying_what_it_waits_for
from rendezvousd.trainer.errors import ConfigError
from rendezvousd.trainer.interfaces import point_socket_ifname
from rendezvousd.trainer.torchrun import warm
from rendezvousd.trainer.torchrun.config import (
    TORCHRUN_TLS_ADVICE,
    TorchrunSettings,
    ignored_torch_keys,
    load_settings,
)
from rendezvousd.trainer.torchrun.store_port import store_port

__all__ = ["BACKEND", "DaemonStore", "RendezvousdHandler", "handler_factory"]

log = logging.getLogger(__name__)


#: The ``--rdzv-backend`` name; torch requires ``get_backend()`` to return it.
BACKEND = "rendezvousd"
#: The daemon's port when ``--rdzv-endpoint`` names only a host.
DEFAULT_PORT = 29420
#: The head of every close reason this handler gives. Other agents tell a close by
#: data (``closes_run``); these words only for a daemon from before that data.
CLOSED = "rendezvous closed by torchrun"


def closes_run(exc: BaseException | None) -> bool:
    """Whether ``exc`` is the close of the job's run (``close_run``: an agent's
    ``set_closed()``, or one out of restarts that the others cannot go on without),
    as the daemon says it (``JobAborted.closed``, its metadata ``closed``). Not by the
    reason's words, which any caller of abort() chooses: an abort that merely said
    them closed every agent's rendezvous. A daemon from before that data (no
    ``closed`` said) closed by an abort whose reason starts with ``CLOSED``: for it
    alone, the words are read, as before."""
    if not isinstance(exc, JobAborted):
        return False
    if "closed" in exc.metadata:
        return exc.closed
    return CLOSED in str(exc)


def point_gloo_at(address: str, env: MutableMapping[str, str]) -> str | None:
    """Set ``GLOO_SOCKET_IFNAME`` in ``env`` (the agent's, which its workers inherit) to
    the interface holding ``address``, unless the user chose one; returns what was set."""
    return point_socket_ifname("GLOO_SOCKET_IFNAME", address, env)


def start_warm_server(
    settings: TorchrunSettings, env: MutableMapping[str, str]
) -> warm.WarmServer | None:
    """The node's warm fork server, when torchrun starts its workers through
    ``rendezvous-python`` (its ``PYTHON_EXEC``); the workers find it through ``env``,
    which torchrun copies into theirs."""
    if os.path.basename(env.get("PYTHON_EXEC", "")) != "rendezvous-python":
        return None
    try:
        server = warm.start_server(settings.preload_modules(), env)
    except OSError as exc:
        log.warning("rendezvousd: warm workers: %s; workers start cold", exc)
        return None
    env[warm.ENV_WARM_SOCKET] = server.socket_path
    # torchrun may end without shutdown() (an exception): stopped at exit, and in any
    # case killed with this process (its parent-death signal).
    atexit.register(server.stop)
    log.info(
        "rendezvousd: warm workers: fork server pid %d preloading %s",
        server.proc.pid,
        settings.preload,
    )
    return server


#: The SDK's advice to a plaintext client of a TLS daemon (``TLS_CA_ADVICE``) names its
#: keyword, which torchrun's user cannot pass; ``_in_torchruns_words`` gives torchrun's
#: (``TORCHRUN_TLS_ADVICE``, the settings' own).
#: And its advice on the token (``TOKEN_ADVICE``, ``NO_TOKEN_ADVICE``): torchrun has no
#: --token-file, and --rdzv-conf takes no token itself (it would show in `ps`).
TORCHRUN_TOKEN_ADVICE = "--rdzv-conf token_file=PATH, or RENDEZVOUSD_TOKEN_FILE / RENDEZVOUSD_TOKEN"


#: The SDK's TLS and token advice (its keywords: ``tls=TlsConfig(...)``, ``token=``),
#: as torchrun's user sets them: --rdzv-conf keys and the settings' variables.
_TORCHRUN_AUTH_WORDS = (
    (TLS_CA_ADVICE, TORCHRUN_TLS_ADVICE),
    (TLS_DROP_ADVICE, "drop tls_ca from --rdzv-conf (and RENDEZVOUSD_TLS_CA)"),
    (
        TLS_CHECK_ADVICE,
        "Check --rdzv-conf tls_ca (it must have signed the daemon's certificate) and "
        "tls_server_name",
    ),
    (TLS_PAIR_ADVICE, "--rdzv-conf tls_cert and tls_key"),
    (
        TLS_SWAP_ADVICE,
        "give the client certificate as --rdzv-conf tls_cert (or RENDEZVOUSD_TLS_CERT) and "
        "its private key as tls_key (or RENDEZVOUSD_TLS_KEY)",
    ),
    (TOKEN_ADVICE, f"({TORCHRUN_TOKEN_ADVICE})"),
)


def _nnodes(topology: str) -> str | None:
    """A torchrun agent's ``--nnodes`` from a JoinNode topology's compact form
    (``MIN:MAXxGPUS``; torchrun's agents join as nodes of one rank); None for any other
    form (a job of per-rank workers, or of rendezvous-run's node agents)."""
    nodes, _, gpus = topology.partition("x")
    low, colon, high = nodes.partition(":")
    if gpus != "1" or not colon or not (low.isdigit() and high.isdigit()):
        return None
    return low if low == high else nodes


def _in_torchruns_words(exc: RendezvousError) -> str | None:
    """The SDK's message where torchrun's user must read other words; None where the
    SDK's stand. The SDK speaks of our CLI's flags and of ``rendezvous-run``'s
    topology (``--nproc-per-node`` GPUs per node), neither of which torchrun has."""
    # TLS files refused before anything is sent are InvalidRequest (``_swapped``).
    if isinstance(exc, AuthenticationError | InvalidRequest) and any(
        sdk in exc.message for sdk, _ in _TORCHRUN_AUTH_WORDS
    ):
        said = exc.message
        for sdk, torchruns in _TORCHRUN_AUTH_WORDS:
            said = said.replace(sdk, torchruns)
        return said
    if isinstance(exc, DaemonUnreachable) and DAEMON_LOST_ADVICE in exc.message:
        # The SDK's reader may go on; torch's agent stops its workers now.
        return exc.message.replace(
            DAEMON_LOST_ADVICE,
            "This agent stops its workers and exits, as torch's does when c10d's store is "
            "gone. Check that the daemon is running and that this host can reach it, then "
            "restart the job (a daemon restarted with --state-dir within that window keeps "
            "its jobs running)",
        )
    if isinstance(exc, InvalidRequest) and NO_TOKEN_ADVICE in exc.message:
        return exc.message.replace(NO_TOKEN_ADVICE, f"pass {TORCHRUN_TOKEN_ADVICE}")
    if isinstance(exc, TopologyMismatch):
        meta = exc.metadata
        have, asked = _nnodes(meta.get("topology", "")), _nnodes(meta.get("requested_topology", ""))
        if have is None or asked is None:
            return None
        hosts = meta.get("hosts", "")
        joined = f" (hosts so far: {escape(hosts.replace(',', ', '))})" if hosts else ""
        # Each agent is a node of one rank to the daemon: torchrun numbers its workers
        # itself, so --nproc-per-node may differ from node to node; --nnodes may not.
        return (
            f"job {exc.job_id or meta.get('job_id', '')!r} has torchrun agents that gave "
            f"--nnodes {have}{joined}, but the agent on host "
            f"{meta.get('offending_host', '?')!a} gave --nnodes {asked}; every agent "
            "of a job must give the same --nnodes (MIN:MAX; --nproc-per-node may differ "
            "between nodes): fix it and relaunch"
        )
    return None


def _cause(exc: RendezvousError) -> RendezvousError | None:
    """What torch's error is chained to: the SDK's, unless torchrun's words replaced
    its message (its advice, shown above torch's, would then mislead)."""
    return None if _in_torchruns_words(exc) is not None else exc


def _torch_error(exc: RendezvousError, what: str) -> torch_rdzv.RendezvousError:
    """The one seam where our SDK's errors become torch's, keeping our message (in
    torchrun's words where the SDK's would mislead: ``_in_torchruns_words``)."""
    message = f"{what}: {_in_torchruns_words(exc) or exc}"
    if isinstance(exc, DaemonUnavailable | AuthenticationError):
        return torch_rdzv.RendezvousConnectionError(message)
    if isinstance(exc, RendezvousTimeout):
        return torch_rdzv.RendezvousTimeoutError(message)
    if closes_run(exc):
        return torch_rdzv.RendezvousClosedError(message)
    return torch_rdzv.RendezvousError(message)


def _no_restarts(max_restarts: int) -> str:
    used = f"{max_restarts}, all used" if max_restarts else "0"
    return f"no restarts left (--max-restarts {used})"


#: How many callers up from the handler's methods torch's agent is looked for: torch
#: 2.13 calls ``next_rendezvous()`` and ``num_nodes_waiting()`` straight from the
#: agent's own methods (the first caller); the rest leaves room for a wrapper (its
#: ``@prof`` is one frame) that a later torch may put between.
AGENT_FRAMES = 8


def torch_agent_of(handler: object, frame: FrameType | None) -> Any | None:
    """torch's agent (a ``SimpleElasticAgent``) whose worker spec holds ``handler``, as
    ``self`` of ``frame`` or one of its callers; None where there is none.

    Why the call stack: the handler must know whether the agent has restarts left, and
    only the agent knows (``_remaining_restarts``, which its local failures spend).
    torch hands a handler nothing of it: RendezvousParameters carries no max_restarts,
    and torch sets TORCHELASTIC_MAX_RESTARTS and TORCHELASTIC_RESTART_COUNT in the
    workers' environment only. Parsing torchrun's argv (``--max-restarts``) would miss
    the restarts already used, and any launcher other than torchrun's command line
    (``elastic_launch``). The agent found here is the one that calls the handler, so its
    count is the live one; where a torch changes its shape, nothing is found and the
    handler says so once and keeps the behaviour from before it looked
    (``RendezvousdHandler._restarts``); tests/torchrun pins it."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    for _ in range(AGENT_FRAMES):
        if frame is None:
            return None
        agent = frame.f_locals.get("self")
        if isinstance(agent, SimpleElasticAgent):
            spec = getattr(agent.get_worker_group(), "spec", None)
            if getattr(spec, "rdzv_handler", None) is handler:
                return agent
        frame = frame.f_back
    return None


#: The least of join_timeout left for which a node whose forming generation failed
#: joins the next one (``RendezvousdHandler._join``); with less, the failure is raised.
MIN_REJOIN_S = 1.0

#: How long an agent that stops with no restarts left waits for a survivor of its
#: round to re-join, to close that next round if it cannot form (``_stopping``): torch
#: stops the survivor's workers first, within its 30 s grace (SIGTERM, then SIGKILL);
#: and how often it looks.
CLOSE_WAIT_S = 35.0
CLOSE_POLL_S = 0.2
#: The longest close reason sent: the daemon's own bound on a reason, in UTF-8 bytes.
#: Counted in characters (900), a cause in non-ASCII text (kept by ``escape``) went over
#: it, the daemon refused the Abort and the rendezvous stayed open.
CLOSE_REASON_BYTES = Limits().max_reason_bytes

#: How long a signalled agent waits for the other nodes to be told, before torch's
#: own handler stops its workers (whose deaths would otherwise speak first).
STOP_TELL_S = 2.0


def torch_signals(env: Mapping[str, str]) -> list[signal.Signals]:
    """The signals torch's agent turns into its ``SignalException`` (torch's
    ``TORCHELASTIC_SIGNALS_TO_HANDLE``, with torch's default)."""
    names = env.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    found = (getattr(signal, name.strip(), None) for name in names.split(","))
    return [sig for sig in found if isinstance(sig, signal.Signals)]


def close_reason(host: str, cause: str, least: int, most: int, coming: int) -> str:
    """The Abort reason that closes the rendezvous for good: one line (escaped), within
    the daemon's bound in bytes (``CLOSE_REASON_BYTES``), its head (``CLOSED``) kept."""
    reason = (
        f"{CLOSED}: torchrun's agent on {host} stopped: {cause}; the job cannot go on "
        f"without it (--nnodes {least}:{most}, {coming} node(s) joining)"
    )
    return bounded(escape(reason), CLOSE_REASON_BYTES)


class _TellFirst:
    """A signal handler that runs ``tell(signum)``, then the one it replaced (torch's,
    which raises ``SignalException``: its agent then stops its workers and exits)."""

    def __init__(
        self, tell: Callable[[int], None], then: Callable[[int, FrameType | None], Any]
    ) -> None:
        self.tell, self.then = tell, then

    def __call__(self, signum: int, frame: FrameType | None) -> Any:
        self.tell(signum)
        return self.then(signum, frame)


def _store_errors(method: Callable[..., Any]) -> Callable[..., Any]:
    """A store call's failure is torch's ``DistStoreError`` (what TCPStore raises, and
    what torch's store helpers catch), with our message."""

    def call(self: DaemonStore, *args: Any) -> Any:
        try:
            return method(self, *args)
        except RendezvousError as exc:
            raise dist.DistStoreError(f"rendezvousd store, {method.__name__}: {exc}") from exc

    call.__name__ = method.__name__
    return call


class DaemonStore(dist.Store):
    """torch's Store over the daemon's key-value store, as one member of one round.

    The KV store is per round (a new generation starts empty), like the c10d backend's
    per-round prefix. Waits use the store's ``timeout`` (torch's ``set_timeout``).
    """

    def __init__(self, client: RendezvousClient, timeout: timedelta) -> None:
        # Here, not at the top: torch's agent module imports its rendezvous package,
        # which loads this module's entry point (see handler_factory).
        from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID

        super().__init__()
        self._terminal_key = _TERMINAL_STATE_SYNC_ID
        self._client = client
        self.set_timeout(timeout)
        #: Set when torch's agent enters its exit barrier: its workers succeeded.
        self.workers_succeeded = False

    @staticmethod
    def _bytes(value: str | bytes | Sequence[int]) -> bytes:
        if isinstance(value, str):
            return value.encode()
        return bytes(value)

    def _wait_s(self, timeout: timedelta | None = None) -> float:
        # torch takes any timedelta (a year for "forever"); the SDK refuses waits past
        # LONGEST_WAIT_S (30 days), and the daemon ends any wait at its --max-wait-s
        # (600 s by default) anyway, so a longer one is sent as that.
        seconds = (self.timeout if timeout is None else timeout).total_seconds()
        return min(max(0.001, float(seconds)), LONGEST_WAIT_S)

    @_store_errors
    def set(self, key: str, value: str | bytes) -> None:
        self._client.kv_set(key, self._bytes(value))

    @_store_errors
    def get(self, key: str) -> bytes:
        return self._client.kv_get(key, wait=True, timeout=self._wait_s())

    @_store_errors
    def add(self, key: str, value: int) -> int:
        if key.startswith(self._terminal_key):
            self.workers_succeeded = True
        return self._client.kv_add(key, value)

    @_store_errors
    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """torch's semantics: an empty ``expected`` matches an absent key or an empty
        value; the answer is the value after the call (``expected`` when an absent key
        stays so)."""
        want = self._bytes(expected)
        new = self._bytes(desired)
        swapped, current = self._client.kv_compare_and_set(key, want or None, new)
        if not swapped and current == b"" == want:
            # The daemon's absent-only form missed a key holding b"": compare with it.
            swapped, current = self._client.kv_compare_and_set(key, want, new)
        if swapped:
            return new
        return current if current is not None else want

    @_store_errors
    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        limit = self._wait_s(timeout)
        for key in keys:
            self._client.kv_get(key, wait=True, timeout=limit)

    @_store_errors
    def check(self, keys: Sequence[str]) -> bool:
        from rendezvousd.client import KeyNotFound

        try:
            for key in keys:
                self._client.kv_get(key, wait=False)
        except KeyNotFound:
            return False
        return True

    @_store_errors
    def delete_key(self, key: str) -> bool:
        return self._client.kv_delete(key)

    def num_keys(self) -> int:
        raise NotImplementedError("the daemon's key-value store does not count keys")


def loopback_problem(host: str, endpoint: str, hosts: set[str]) -> str | None:
    """Why this node's address ``host`` cannot serve a round whose nodes gave
    ``hosts``, or None: a loopback address (the route to a daemon named ``localhost``)
    beside an address of another host. Nodes simulated on one host all give loopback
    ones."""
    far = sorted(h for h in hosts if not is_loopback(h))
    if not is_loopback(host) or not far:
        return None
    return (
        f"this node's address {host} (its route to the daemon at {endpoint}) is loopback, "
        f"but the round also has nodes at {', '.join(far[:3])}{' ...' if len(far) > 3 else ''}, "
        "which cannot reach it (node 0's address is every worker's MASTER_ADDR): give "
        "--local-addr with an address of this host the others reach, or name the daemon by "
        "an address the other hosts use too"
    )


#: What torchrun sends as the run id when --rdzv-id is left out.
TORCHRUN_DEFAULT_ID = "none"


class RendezvousdHandler(torch_rdzv.RendezvousHandler):
    """One torchrun agent's rendezvous: a node of one member per round."""

    def __init__(
        self,
        endpoint: str,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        settings: TorchrunSettings,
        local_addr: str | None = None,
    ) -> None:
        if not 1 <= min_nodes <= max_nodes:
            raise ConfigError(
                f"--nnodes {min_nodes}:{max_nodes}: need 1 <= MIN <= MAX for job {run_id!r}"
            )
        if run_id == TORCHRUN_DEFAULT_ID:
            # One daemon serves many jobs, and jobs of one id are one job: two launches
            # left at torchrun's default were merged (an elastic one scaled into the
            # other's world, and a fixed-size one stood by as its spare and exited 0
            # without running its script). c10d's store, one per job, never shared it.
            raise ConfigError(
                f"--rdzv-id is torchrun's default {run_id!r}: give each job its own id "
                "(e.g. --rdzv-id $SLURM_JOB_ID), the same on each of its nodes; rendezvousd "
                "serves many jobs, and launches of one id are one job"
            )
        self._endpoint, self._run_id = endpoint, run_id
        self._min, self._max = min_nodes, max_nodes
        self._settings = settings
        # torch's launcher makes its handler as it starts: the first join says how long
        # ago, so that a job whose run ended since refuses this agent (JobEnded).
        self._launched = time.monotonic()
        say_client_warnings(lambda message: log.warning("rendezvousd: %s", message))
        # Two names for this host: the address the others reach it at (node 0's is
        # every worker's MASTER_ADDR; the links listen on it), and the hostname, which
        # is what people read: the daemon records it for this node (every loss names
        # it: "lost node 2 on n3"), as rendezvous-run's does, and torch's own summary
        # says "host : n3". Named by the address, a job whose hosts all have names read
        # "lost node 2 on 198.18.1.4" (a torchrun user's review).
        self._name = socket.gethostname()
        try:
            self._address = local_addr or route_source(
                endpoint,
                settings.connect_timeout,
                lambda note: log.warning("rendezvousd: job %r: %s", run_id, note),
            )
        except UnresolvedHost as exc:
            # A name that never resolved within connect_timeout is a daemon torch's
            # agent cannot reach, as a port nobody listens on is (not our ValueError).
            raise torch_rdzv.RendezvousConnectionError(
                f"rendezvousd at {endpoint} for job {run_id!r}: {exc}"
            ) from None
        except AddressError as exc:
            raise ConfigError(f"--rdzv-endpoint: {exc}") from None
        try:
            self._client = self._new_client()
            # The store speaks as this node's member; the node client heartbeats.
            self._store_client = self._new_client()
        except RendezvousError as exc:
            what = f"rendezvousd at {endpoint} for job {run_id!r}"
            raise _torch_error(exc, what) from _cause(exc)
        if (ifname := point_gloo_at(self._address, os.environ)) is not None:
            log.info(
                "rendezvousd: GLOO_SOCKET_IFNAME=%s (holds %s, this host's address "
                "towards the daemon)",
                ifname,
                self._address,
            )
        self._node: NodeMembership | None = None
        # The generation this agent last held a seat in (its waiting note tells its own
        # generation, still running at the daemon, from another node's).
        self._held: int | None = None
        self._store: DaemonStore | None = None
        self._links: NodeLinks | None = None
        #: The generation whose link to another node this agent reported lost, and why.
        self._link_lost: int | None = None
        self._link_lost_cause = ""
        #: Why this agent gives up at its next round: a link that could not connect.
        self._unreachable: str | None = None
        #: Whether a link of this agent to another node ever connected: one that never
        #: did points at an address the others cannot reach rather than at a cut.
        self._linked_once = False
        self._closed = threading.Event()
        #: The generation whose other nodes this agent told it was stopped by a signal,
        #: and the thread telling them (``_stopped_by``).
        self._signalled: int | None = None
        self._teller: threading.Thread | None = None
        self._signals = torch_signals(os.environ)
        #: torch's agent calling this handler (``torch_agent_of``), once found; whether
        #: the handler said it could not read the agent's restarts.
        self._agent: Any | None = None
        self._restarts_unread_said = False
        #: Why the next ``next_rendezvous()`` stops this agent: a failure ended its
        #: round, and it has no restarts left (``_no_restarts_left``).
        self._stop: str | None = None
        self._stop_cause = ""
        #: The nodes lost since this agent's job last formed (``_lost_in``), which a
        #: waiting join names in its note.
        self._missing: list[str] = []
        self._warm = start_warm_server(settings, os.environ)
        atexit.register(self._exit_goodbye)

    @classmethod
    def from_parameters(cls, params: torch_rdzv.RendezvousParameters) -> RendezvousdHandler:
        endpoint = params.endpoint or ""
        if not endpoint:
            raise ConfigError("--rdzv-endpoint HOST[:PORT] of the rendezvousd daemon is required")
        if ":" not in endpoint.rsplit("]", 1)[-1]:
            endpoint = f"{endpoint}:{DEFAULT_PORT}"
        settings = load_settings(params.config, os.environ)
        if (ignored := ignored_torch_keys(params.config)) is not None:
            log.warning("rendezvousd: %s", ignored)
        for unread in unknown_names(os.environ):
            log.warning("rendezvousd: %s", unread)
        return cls(
            endpoint,
            params.run_id,
            params.min_nodes,
            params.max_nodes,
            settings,
            params.local_addr,
        )

    def _new_client(self) -> RendezvousClient:
        return RendezvousClient(
            self._endpoint,
            self._run_id,
            token_file=self._settings.token_file,
            tls=self._settings.tls(),
            retry_attempts=self._settings.retries,
            connect_timeout=self._settings.connect_timeout,
        )

    def _what(self) -> str:
        return f"rendezvousd at {self._endpoint}, job {self._run_id!r}, host {self._name}"

    # -- torch's interface ---------------------------------------------------------

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return False

    def get_run_id(self) -> str:
        return self._run_id

    def next_rendezvous(self) -> torch_rdzv.RendezvousInfo:
        self._find_agent(sys._getframe(1))
        if self.is_closed():
            failure = self._client.failure
            why = f" ({failure})" if isinstance(failure, JobAborted) else ""
            raise torch_rdzv.RendezvousClosedError(f"{self._what()}: the rendezvous is closed{why}")
        self._close_links()
        if self._unreachable is not None:
            raise torch_rdzv.RendezvousError(f"{self._what()}: {self._unreachable}")
        if self._stop is not None:
            # Here, not in num_nodes_waiting(): torch has stopped the workers by now,
            # through its own path (SIGTERM, then SIGKILL after its grace). torch's
            # launcher ends on any rendezvous error as on a timeout (shutdown(), which
            # says this node will not re-join, then a non-zero exit), so the type says
            # what happened: not a close, not a timeout. Re-raising it every call keeps
            # any later caller from re-joining.
            self._stopping()
            raise torch_rdzv.RendezvousError(f"{self._what()}: {self._stop}")
        try:
            if self._node is not None:
                self._end_round(self._node)
            # Until the join succeeds this agent holds no round: a shutdown() after a
            # failed join has nothing to leave or report.
            self._node = None
            node = self._join()
            self._node = node
            self._held = node.generation
            self._missing = []
            if (problem := self._loopback_problem(node)) is not None:
                # Node 0's address is every worker's MASTER_ADDR: the other hosts'
                # workers dialled themselves until the process group's timeout (30 min
                # by default), nothing naming why. Every node hears it, as under
                # rendezvous-run (a torchrun user's review).
                with contextlib.suppress(RendezvousError):
                    self._client.abort(problem, generation=node.generation, cause=LOOPBACK_ADDRESS)
                raise torch_rdzv.RendezvousError(f"{self._what()}: {problem}")
            self._client.start_heartbeat(on_failure=self._heard_failure)
            self._store_client.attach(node.membership_for(0), node.member_instance_id(0))
            store = DaemonStore(self._store_client, timedelta(seconds=300))
            self._store = store
            # Node 0 picks a free port for the workers' TCPStore, outside the ephemeral
            # range (store_port: torch's own choice can be taken before the store
            # listens); everyone reads it.
            bootstrap = torch_rdzv.RendezvousStoreInfo.build(
                node.node_rank,
                store,
                local_addr=self._address,
                server_port=store_port() if node.node_rank == 0 else None,
            )
        except RendezvousError as exc:
            raise _torch_error(exc, self._what()) from _cause(exc)
        except dist.DistStoreError as exc:
            # The bootstrap's reads are store calls (DistStoreError for torch's store
            # helpers): a round closed or aborted meanwhile (another agent gave up)
            # is still the round's error, a close read as a close.
            if not isinstance(exc.__cause__, RendezvousError):
                raise
            raise _torch_error(exc.__cause__, self._what()) from _cause(exc.__cause__)
        log.info(
            "rendezvousd: job %r generation %d formed: node %d of %d (host %s, address %s)",
            self._run_id,
            node.generation,
            node.node_rank,
            node.num_nodes,
            self._name,
            self._address,
        )
        self._watch_links(node)
        return torch_rdzv.RendezvousInfo(store, node.node_rank, node.num_nodes, bootstrap)

    def _loopback_problem(self, node: NodeMembership) -> str | None:
        if node.num_nodes < 2 or not is_loopback(self._address):
            return None
        # Each node's address (its join's addresses=), else, from an agent before it
        # gave one, its host: then its address too.
        hosts = {m.address or m.host for m in node.membership_for(0).members}
        return loopback_problem(self._address, self._endpoint, hosts)

    def _watch_links(self, node: NodeMembership) -> None:
        """This round's links to the neighbouring agents (``node_links``)."""
        if not self._settings.node_link_watch or node.num_nodes < 2:
            return
        try:
            self._links = NodeLinks(
                self._new_client(),
                node,
                host=self._address,
                name=self._name,
                on_silent=self._link_silent,
                note=lambda text: log.warning("rendezvousd: job %r: %s", self._run_id, text),
                setup_timeout=self._settings.join_timeout,
            )
        except RendezvousError as exc:
            log.warning(
                "rendezvousd: job %r: the links to the other nodes are not watched: %s",
                self._run_id,
                exc,
            )
            return
        self._links.start()

    def _close_links(self) -> None:
        links, self._links = self._links, None
        if links is not None:
            self._linked_once = self._linked_once or bool(links.linked)
            links.close()

    def _link_silent(self, event: LinkSilent) -> None:
        """From a link's thread. A link that could not even connect gives up at the
        next round, whoever reports first (the other agent's report may restart this
        one's workers before the settle below ends)."""
        links = self._links
        if not event.connected and (self._linked_once or (links is not None and links.linked)):
            self._unreachable = (
                f"this node {event.cause} in generation {event.generation}: the network "
                "between the nodes is cut; giving up rather than forming the job across it again"
            )
        elif not event.connected:
            # Never linked: each agent advertises its route to the daemon, which on a
            # host with a management network beside the nodes' own is not an address
            # the others reach (a multi-homed review); "cut" sent users to the cables.
            self._unreachable = (
                f"this node {event.cause} in generation {event.generation}, and no link "
                "between the nodes ever connected: the address that node advertised is "
                "not reachable from this host. Each agent advertises its host's route to "
                "the daemon (or --local-addr); on hosts with several networks give each "
                "agent --local-addr set to its address on the network the nodes share "
                "(and GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to that interface), or name "
                "the daemon by its address on that network; giving up"
            )
        # The daemon's own word, should it come meanwhile, wins.
        timer = threading.Timer(LINK_SETTLE_S, self._report_link, (event,))
        timer.daemon = True
        timer.start()

    def _report_link(self, event: LinkSilent) -> None:
        node = self._node
        if node is None or node.generation != event.generation or self._round_ended(node):
            return
        log.error("rendezvousd: job %r: this node %s", self._run_id, event.cause)
        self._link_lost, self._link_lost_cause = event.generation, event.cause
        try:
            # num_nodes_waiting() answers 1 from now on: torch restarts the workers.
            self._client.report_failure(0, event.cause)
        except RendezvousError as exc:
            log.warning(
                "rendezvousd: job %r: could not report the lost link: %s", self._run_id, exc
            )

    def _saying_what_it_waits_for(self, began: float) -> contextlib.AbstractContextManager[None]:
        """The note rendezvous-run's joins give while they wait, logged: torch's own
        rendezvous logs nothing between its start and its timeout. A forming round's
        note also names the nodes lost since the job last formed (``_missing``): the
        daemon counts the nodes joined, and only this agent heard which ones were lost,
        the ones a replacement must be started for."""
        short = False

        def get_job() -> pb.GetJobResponse:
            nonlocal short
            job = self._client.get_job()
            joined = job.nodes_waiting - job.standbys
            short = job.summary.state != pb.JOB_STATE_RUNNING and joined < self._min
            return job

        def say(note: str) -> None:
            # A failure pushed twice (a stream reconnected) names its nodes once.
            missing = list(dict.fromkeys(self._missing))
            if short and missing:
                # Said with the note, at its pace (after 5 s, then every 30 s).
                their = "its place" if len(missing) == 1 else "their places"
                note += (
                    f". Lost since the job last formed: {'; '.join(missing)}: start torchrun "
                    f"agents of this --rdzv-id in {their}, or the job ends at join_timeout"
                )
            log.warning("rendezvousd: %s", note)

        return saying_what_it_waits_for(
            get_job,
            say,
            self._min,
            self._settings.join_timeout,
            began,
            self._settings.last_call_timeout,
            self._held,
        )

    def _join(self) -> NodeMembership:
        """One JoinNode. A node that finds the world full stands by (``standby``), as a
        node of torch's redundancy list does: it waits, not counted as waiting, until a
        lost node frees a slot, and leaves gracefully when the job ends without it.

        A generation that fails while it forms (another joiner lost: a replacement or a
        survivor killed, its JoinNode cancelled) placed this node nowhere and started no
        worker: it joins the next one, for what is left of join_timeout, as
        rendezvous-run's join does and as c10d's rendezvous drops a dead participant
        and keeps waiting. Raised, it ended a fixed-size job's survivor that the docs
        say waits join_timeout for a replacement (a torchrun chaos review)."""
        standby = False
        began = time.monotonic()
        timeout = self._settings.join_timeout
        outage = DaemonOutage(self._settings.join_timeout)
        # A daemon at a daemon-wide limit (--max-jobs held by other jobs) is waited for
        # within join_timeout, backing off: raised, a moment's full daemon ended every
        # agent launched during it.
        room = room_wait(self._settings.join_timeout, began)
        while True:
            try:
                # A standby said once that it stands by.
                noting = (
                    contextlib.nullcontext() if standby else self._saying_what_it_waits_for(began)
                )
                with noting:
                    return self._client.join_node(
                        min_nodes=self._min,
                        max_nodes=self._max,
                        gpus_per_node=1,
                        host=self._name,
                        addresses=[self._address],
                        last_call=self._settings.last_call_timeout or None,
                        timeout=timeout,
                        standby=standby,
                        launched=self._launched,
                    )
            except PeerFailed as exc:
                if standby:
                    # Called into a round that failed before it formed: it joins as any
                    # node from here, for one join_timeout, as when that round does not
                    # form within the call's deadline (below).
                    began = time.monotonic()
                left = self._settings.join_timeout - (time.monotonic() - began)
                if left < MIN_REJOIN_S:
                    raise
                lost = self._lost_in(exc, forming=True)
                log.warning(
                    "rendezvousd: job %r generation %d failed while it formed: lost %s. This "
                    "node was not placed in it (no worker started): it joins the next "
                    "generation, waiting the %.0f s left of join_timeout (%g s)",
                    self._run_id,
                    exc.generation,
                    "; ".join(lost) or exc,
                    left,
                    self._settings.join_timeout,
                )
                # From here it joins as any node; a full world stands it by again.
                standby, timeout = False, left
                outage.reset()
            except LimitExceeded as exc:
                if (full := daemon_full(exc)) is not None:
                    room.wait_for_room(
                        exc,
                        full,
                        lambda said: log.warning("rendezvousd: job %r: %s", self._run_id, said),
                    )
                    if not standby:
                        # The wait for room is part of the join's, not added to it.
                        timeout = max(MIN_REJOIN_S, room.limit_s - (time.monotonic() - began))
                    continue
                if standby or exc.reason != "WORLD_FULL":
                    raise
                full = (
                    "is re-forming after a failure, its max_nodes=%d seats taken or kept for "
                    "the nodes re-joining"
                    if exc.metadata.get("seats_kept")
                    else "already has max_nodes=%d nodes"
                )
                log.warning(
                    "rendezvousd: job %r " + full + ": standing by for the slot of a node it loses",
                    self._run_id,
                    self._max,
                )
                standby = True
            except RendezvousTimeout as exc:
                if not standby:
                    raise
                if "hosts" in exc.metadata:
                    # Called into a generation (a lost node freed its slot), which did not
                    # form within the call's deadline: from here it joins as any node,
                    # for one more join_timeout, and then its timeout ends it. It stood by
                    # again for good, and with the job unable to go on (its survivor
                    # stopped, no restarts left) it never exited (a torchrun chaos run).
                    log.warning(
                        "rendezvousd: job %r: this standby node was called into the job, "
                        "which has not formed yet (%s); it waits one more join_timeout (%g s) "
                        "for the other nodes",
                        self._run_id,
                        exc,
                        self._settings.join_timeout,
                    )
                    standby, began = False, time.monotonic()
                    timeout = self._settings.join_timeout
                # else: a standby's wait ended with no slot freed: it stands by again
                outage.reset()
            except DaemonUnavailable as exc:
                # A standby outlives a daemon restart (rendezvous-run's does too): it
                # asks again every OUTAGE_RETRY_S for up to join_timeout.
                if not standby:
                    raise
                if not outage.told:
                    outage.told = True
                    log.warning(
                        "rendezvousd: job %r: standing by: %s; trying again every %g s for up "
                        "to %g s",
                        self._run_id,
                        exc,
                        OUTAGE_RETRY_S,
                        self._settings.join_timeout,
                    )
                if outage.retry_at(time.monotonic()) is None:
                    raise
                time.sleep(OUTAGE_RETRY_S)
            except JobAborted as exc:
                # "placed": it was called into the round that was closed, as a member
                # of it: torch's RendezvousClosedError, as for the other nodes.
                if not (standby and exc.closed) or exc.metadata.get("placed") == "true":
                    raise
                # The run was closed for good while this node stood by (another agent
                # out of restarts): c10d ends a node of its redundancy list then with
                # RendezvousGracefulExitError, "terminating pending rendezvous", which
                # torch 2.13 cannot take (below): status 0 here too, as for an end.
                log.warning(
                    "rendezvousd: job %r was closed (%s); this standby node was not needed "
                    "and exits",
                    self._run_id,
                    exc.abort_reason,
                )
                raise SystemExit(0) from None
            except JobEnded as exc:
                # A standby not needed, or an agent launched for the run that ended (one
                # that could not join before it ended: a slow pod, a scale-up).
                if standby:
                    log.warning(
                        "rendezvousd: job %r ended without needing this standby node", self._run_id
                    )
                else:
                    log.warning("rendezvousd: %s; this agent exits without starting workers", exc)
                # torch's own answer, RendezvousGracefulExitError, makes torch 2.13's
                # launch_agent crash on the None its agent then returns
                # (pytorch/pytorch#194710): this node has nothing to clean up, so it
                # ends here, with status 0, through torch's shutdown path.
                raise SystemExit(0) from None

    def _lost_in(
        self, exc: PeerFailed, me: NodeMembership | None = None, *, forming: bool = False
    ) -> list[str]:
        """Keep the nodes ``exc`` lost (not this one, seated at ``me``) for the waiting note,
        and return them; ``forming``: a round that never formed, whose node ranks were
        not yet given (named by host, not by a rank the user never saw)."""
        lost = [
            f.describe(as_node=True, in_round=exc.generation, joining=forming)
            for f in exc.failed
            if me is None or not me.holds(exc.generation, f.rank)
        ]
        self._missing += lost
        return lost

    def _heard_failure(self, exc: RendezvousError) -> None:
        # The SDK keeps the failure (client.failure); num_nodes_waiting() reads it.
        if self._signalled is not None:
            # This agent is stopping (a signal: torch stops its workers and exits), and
            # told the others so. Its heartbeat still beats for the round it left until
            # the agent is gone, and once the others re-formed the daemon answers it
            # "is at generation 2 ...; rejoin to take part": advice to a process that
            # exits, which it printed (a torchrun user's review). Nothing here is news,
            # its own stop pushed back to it included, which it said already.
            log.debug("rendezvousd: job %r: stopping; its heartbeat heard: %s", self._run_id, exc)
            return
        if not isinstance(exc, PeerFailed) or not exc.failed:
            # The daemon's own words name the job already ("job 'J' generation 1 was
            # aborted: ..."): said twice, it read "job 'J': job 'J' ...".
            said = str(exc)
            if f"job {self._run_id!r}" in said:
                log.warning("rendezvousd: %s", said)
            else:
                log.warning("rendezvousd: job %r: %s", self._run_id, said)
            return
        self._lost_in(exc, self._node)
        # Each agent is a node of one rank: named as a node, its "rank" read as a
        # worker's global rank.
        lost = named_losses(exc.failed, as_nodes=True)
        restarts = self._restarts()
        if restarts is not None and restarts[0] == 0:
            log.warning(
                "rendezvousd: job %r round %d failed: lost %s. This agent has %s: torch "
                "stops this node's workers and the agent exits",
                self._run_id,
                exc.generation,
                lost,
                _no_restarts(restarts[1]),
            )
            return
        # Elastic, the next round forms with the nodes left; a fixed size waits for a
        # node to take the lost one's place.
        waits_for = (
            "the nodes left re-join (at least %d), not for the lost one"
            if self._min < self._max
            else "a lost node's replacement, or a standby, takes its place (%d nodes)"
        ) % self._min
        log.warning(
            "rendezvousd: job %r round %d failed: lost %s. torch restarts this node's "
            "workers into the next round, which forms (--nnodes %d:%d) once %s; it waits "
            "up to %g s (join_timeout)",
            self._run_id,
            exc.generation,
            lost,
            self._min,
            self._max,
            waits_for,
            self._settings.join_timeout,
        )

    def _end_round(self, node: NodeMembership) -> None:
        """torchrun asks for a new round while ours runs: tell every other agent why,
        unless the daemon already ended the round (and so told them)."""
        if self._round_ended(node):
            return
        try:
            if self._client.nodes_waiting():
                self._client.abort(SCALE_UP_REASON, generation=node.generation)
            else:
                self._client.report_failure(
                    0,
                    f"torchrun's agent on {self._name} restarted its workers "
                    "(a local worker failed; its log says which)",
                )
        except RendezvousError as exc:
            # The round ended meanwhile (a peer's failure crossed ours): the join finds
            # the next one either way.
            log.info("rendezvousd: job %r: ending round %d: %s", self._run_id, node.generation, exc)

    def num_nodes_waiting(self) -> int:
        """Nodes waiting to join, or at least 1 once our round ended (``_round_ended``): torch
        restarts its workers into the next round when this is above 0."""
        self._watch_signals()
        self._find_agent(sys._getframe(1))
        waiting = self._client.nodes_waiting()
        failure = self._client.failure
        if isinstance(failure, DaemonUnavailable):
            # The daemon is gone (silent for its heartbeat window): raise, as torch's
            # own handler does when its store is, so the agent stops its workers and
            # exits now, rather than restarting them into a join that waits out
            # connect_timeout before failing all the same.
            raise _torch_error(failure, self._what())
        if self._node is not None and self._round_ended(self._node):
            self._no_restarts_left(self._node)
            return max(1, waiting)
        return waiting

    def _find_agent(self, caller: FrameType | None) -> None:
        if self._agent is None:
            self._agent = torch_agent_of(self, caller)

    def _restarts(self) -> tuple[int, int] | None:
        """torch's agent's restarts: (left, --max-restarts); None where it is unknown."""
        agent = self._agent
        if agent is None:
            return None
        left = getattr(agent, "_remaining_restarts", None)
        most = getattr(getattr(agent.get_worker_group(), "spec", None), "max_restarts", None)
        if isinstance(left, int) and isinstance(most, int):
            return left, most
        return None

    def _round_failure(self, node: NodeMembership) -> str | None:
        """What failure ended ``node``'s round: a peer's (the daemon's push, naming the
        lost node and its cause) or this node's lost link; None when no failure did (a
        scale-up, a close, this agent's own signal)."""
        if node.generation == self._signalled:
            return None
        failure = self._client.failure
        if isinstance(failure, PeerFailed):
            lost = named_losses(failure.failed, as_nodes=True)
            return f"lost {lost}" if failure.failed else str(failure)
        if node.generation == self._link_lost:
            return f"this node {self._link_lost_cause}"
        return None

    def _no_restarts_left(self, node: NodeMembership) -> None:
        """A failure ended ``node``'s round: with no restarts left, this agent stops
        (``_stop``, raised by the next ``next_rendezvous()``) instead of restarting its
        workers into the next round. A user who gives ``--max-restarts 0`` (or whose
        agent used them all) asked for no restart: re-forming restarts the workers all
        the same, and with a fixed size it waited join_timeout for a replacement,
        where c10d's survivors stop within seconds (their collectives break, torch
        counts a local failure, none is left). Whether torch's agent saw its workers
        fail first or heard the push first no longer changes the outcome. Decided
        here, where torch's agent asks while its workers look healthy, so that no
        restart of its own is in flight; torch stops them when this answers > 0."""
        if self._stop is not None:
            return
        why = self._round_failure(node)
        if why is None:
            return
        restarts = self._restarts()
        if restarts is None:
            if not self._restarts_unread_said:
                self._restarts_unread_said = True
                log.warning(
                    "rendezvousd: job %r: cannot read torch's remaining restarts (no torch "
                    "agent of this handler among num_nodes_waiting()'s callers, or one "
                    "without _remaining_restarts: a torch other than 2.13?); this agent "
                    "restarts its workers into the next round after a failure even with "
                    "no restarts left",
                    self._run_id,
                )
            return
        left, most = restarts
        if left == 0:
            self._stop_cause = f"round {node.generation} failed ({why}), {_no_restarts(most)}"
            self._stop = (
                f"round {node.generation} failed: {why}; this agent stops its workers and "
                f"exits: {_no_restarts(most)}, and re-forming the job would restart them "
                "(give --max-restarts at least 1 for each failure the job should outlive)"
            )

    def _stopping(self) -> None:
        """This agent stops, no restarts left (``_no_restarts_left``): as the gave-up
        path of ``shutdown()`` does, it says it will not re-join (a final Leave: no
        seat is kept for it, a standby may take it) and, if the other nodes cannot
        form the next round without it, closes the rendezvous, as c10d's
        ``shutdown()`` does, so that they end now instead of waiting join_timeout for
        it and the lost nodes (docs/trainer.md, "From torchrun"). Once: the round it
        held is forgotten, so ``shutdown()`` has nothing left to tell.

        The failed round is closed at once (``close_run``), with no other node in
        sight too (a standby asking again later, launched before, is refused as
        closed rather than taking a lost node's place alone): a survivor that re-joins
        after this agent exited, whenever it comes (torch stops its workers first,
        within its 30 s grace), is refused by the daemon, naming this stop; it had
        opened the next round and waited join_timeout for nodes that would not come
        once this agent had stopped watching (``CLOSE_WAIT_S``). A survivor that
        re-joined first opened the next round, which this agent closes the same way.
        A daemon from before closes leaves a failed round as it is: then this agent
        waits for the next round up to ``CLOSE_WAIT_S`` and closes that, as before,
        unless no other node of the round stays (each lost, or stopped too, its final
        Leave said) and none waits to join, or enough do."""
        node, self._node = self._node, None
        if node is None:
            return
        try:
            self._client.leave(final=True)
        except RendezvousError as exc:
            # Best effort: the close below does not depend on it.
            log.info("rendezvousd: job %r: stopping: %s", self._run_id, exc)
        until = time.monotonic() + CLOSE_WAIT_S
        tried = False  # to close the failed round itself
        while True:
            try:
                job = self._client.get_job()
                s = job.summary
                if s.generation != node.generation:
                    coming = job.nodes_waiting + job.seats_kept
                    if s.state == pb.JOB_STATE_FORMING and coming < self._min:
                        self._close_for_good(s.generation, coming)
                    return
            except RendezvousError as exc:
                log.warning(
                    "rendezvousd: job %r: could not tell the other nodes that this agent stops: %s",
                    self._run_id,
                    exc,
                )
                return
            gone = (pb.MEMBER_STATE_LOST, pb.MEMBER_STATE_LEFT)
            # This node itself too, should its goodbye above have failed.
            staying = sum(
                1
                for m in job.members
                if m.state not in gone and m.member.node_rank != node.node_rank
            )
            coming = staying + job.nodes_waiting
            if coming >= self._min:
                return  # enough nodes to form the next round
            if not tried:
                # Closed with nobody in sight too: a node of this run asking later (a
                # standby between two asks, a slow pod) took a lost node's place in a
                # round nobody else joins, and waited join_timeout there, twice.
                tried = True
                try:
                    if self._close_for_good(node.generation, coming, failed=True):
                        return  # the daemon refuses the survivors' re-joins itself
                except StaleGeneration:
                    continue  # a survivor re-joined meanwhile: that round is closed
                except RendezvousError as exc:
                    log.warning(
                        "rendezvousd: job %r: could not close the rendezvous as this agent "
                        "stops: %s",
                        self._run_id,
                        exc,
                    )
                    return
            if not coming:
                return  # a daemon from before closes: no survivor to watch for
            if time.monotonic() >= until:
                log.warning(
                    "rendezvousd: job %r: %d other node(s) of round %d did not re-join within "
                    "%g s: they wait join_timeout for the nodes this one and the lost ones "
                    "leave missing",
                    self._run_id,
                    staying,
                    node.generation,
                    CLOSE_WAIT_S,
                )
                return
            time.sleep(CLOSE_POLL_S)

    def _close_for_good(self, generation: int, coming: int, *, failed: bool = False) -> bool:
        """Close the rendezvous at ``generation`` (``failed``: the round that failed);
        whether the daemon closed the run. A daemon from before closes aborts the
        next round, forming, and leaves a failed one as it is: nothing said then."""
        reason = close_reason(self._name, self._stop_cause, self._min, self._max, coming)
        closed = self._client.close_run(reason, generation=generation)
        if failed and not closed:
            return False
        log.warning(
            "rendezvousd: job %r: closed the rendezvous: the other nodes cannot form the next "
            "round without this one (--nnodes %d:%d, %d node(s) joining)",
            self._run_id,
            self._min,
            self._max,
            coming,
        )
        return closed

    def _round_ended(self, node: NodeMembership) -> bool:
        """Whether ``node``'s round is over and every agent told: the daemon ended it
        (its push), or this agent did by reporting its lost link."""
        return self._client.failure is not None or node.generation in (
            self._link_lost,
            self._signalled,
        )

    def _watch_signals(self) -> None:
        """torch's agent, signalled (SIGTERM: a Kubernetes pod deleted; SIGINT: Ctrl-C),
        raises ``SignalException``, stops its workers and exits, and its launcher skips
        ``shutdown()`` on purpose (it would close the rendezvous for good): nothing of
        ours runs. The other nodes would hear only "heartbeat stream closed" once the
        agent is gone, after its workers' grace, or first blame the workers' broken
        collectives. So the handler torch installs at each start of its workers
        (``TORCHELASTIC_SIGNALS_TO_HANDLE``) is wrapped here, from the agent's monitor
        loop (its main thread, every ``--monitor-interval``): the others hear the signal
        first (``_stopped_by``). A signal before the first wrap is told at exit
        (``_exit_goodbye``)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self._signals:
            current = signal.getsignal(sig)
            if callable(current) and not isinstance(current, _TellFirst):
                signal.signal(sig, _TellFirst(self._stopped_by, current))

    def _stopped_by(self, signum: int) -> None:
        """Tell the other nodes that this agent was stopped by ``signum``, once per round,
        waiting up to ``STOP_TELL_S`` (a thread of its own: the signal may have come in
        the middle of one of this client's calls)."""
        node = self._node
        if node is None or self._round_ended(node):
            return
        self._signalled = node.generation
        cause = f"torchrun's agent on {self._name} was stopped by {signal.Signals(signum).name}"
        log.warning(
            "rendezvousd: job %r: %s; telling the other nodes",
            self._run_id,
            cause,
        )
        self._teller = threading.Thread(
            target=self._tell, args=(cause,), name="rendezvousd-signalled", daemon=True
        )
        self._teller.start()
        self._teller.join(STOP_TELL_S)

    def _tell(self, cause: str) -> None:
        try:
            self._client.report_failure(0, cause, timeout=STOP_TELL_S)
        except RendezvousError as exc:
            log.warning("rendezvousd: job %r: could not tell the others: %s", self._run_id, exc)

    def _others_go_on(self, node: NodeMembership) -> bool:
        """Whether the other nodes of ``node``'s round, with those waiting to join
        (standbys among them), still make ``--nnodes``' MIN without this one."""
        try:
            waiting = self._client.get_job().nodes_waiting
        except RendezvousError as exc:
            # Reporting is what this agent did before it could tell: the others then
            # wait for a replacement, at worst for join_timeout.
            log.warning("rendezvousd: job %r: shutdown: %s", self._run_id, exc)
            return True
        return node.num_nodes - 1 + waiting >= self._min

    def is_closed(self) -> bool:
        return self._closed.is_set() or closes_run(self._client.failure)

    def set_closed(self) -> None:
        """No more rounds for this run (torch's ``set_closed``): the run is closed at
        the daemon (``close_run``), as c10d's closes its whole rendezvous: the other
        agents read it as closed (``closes_run``), and a node of the run that joins
        later is refused. A daemon from before closes aborts the round (the reason's
        ``CLOSED`` head then tells the others)."""
        self._closed.set()
        node = self._node
        if node is not None and self._client.failure is None:
            reason = bounded(
                escape(f"{CLOSED}: torchrun's agent on {self._name} called set_closed()"),
                CLOSE_REASON_BYTES,
            )
            with contextlib.suppress(RendezvousError):
                self._client.close_run(reason, generation=node.generation)

    def _exit_goodbye(self) -> None:
        """At exit without ``shutdown()`` (torch skips it when a signal stops its
        agent): a node whose round already ended says it will not re-join, so the
        next generation keeps no seat for it, which a fresh launch of the job id
        would otherwise wait out standing by. One whose round still runs says
        nothing (its stream's end is its loss, which the others must hear), unless a
        signal ends it that came before ``_watch_signals`` wrapped torch's handler:
        the others hear that signal, late (after the workers stopped), but true."""
        node = self._node
        if node is None:
            return
        # Set by the interpreter as it printed the exception that ended the agent.
        stopping = getattr(sys, "last_value", None)
        if not self._round_ended(node) and isinstance(stopping, SignalException):
            self._stopped_by(int(stopping.sigval))
        if self._teller is not None:
            self._teller.join(STOP_TELL_S)
        if not self._round_ended(node):
            return
        with contextlib.suppress(RendezvousError):
            self._client.leave(final=True)

    def shutdown(self) -> bool:
        """Leave cleanly after the workers succeeded. Otherwise (restarts spent) this
        node gives up: if the others can go on without it (``_others_go_on``), report
        its failure, so they re-form at once; if not, close the rendezvous, as c10d's
        shutdown() does, so they end now instead of waiting ``join_timeout`` for a
        replacement."""
        self._closed.set()
        self._close_links()
        node, store = self._node, self._store
        try:
            if node is not None and not self._round_ended(node):
                gave_up = (
                    f"torchrun's agent on {self._name} gave up: its workers failed and no "
                    "restarts are left"
                    if self._agent is not None
                    # A caller of its own (a launcher, a test): its workers' outcome is
                    # not ours to know, and "failed" put the blame where none may be.
                    else f"the rendezvousd handler on {self._name} was shut down while its "
                    "round ran, by a caller other than torch's agent (whether its workers "
                    "succeeded is unknown)"
                )
                if store is not None and store.workers_succeeded:
                    self._client.leave()
                    return True
                if self._others_go_on(node):
                    self._client.report_failure(0, gave_up)
                else:
                    # Closed, not only aborted (as c10d's shutdown() closes its
                    # rendezvous): the others read it by data (``closes_run``), and a
                    # node of the run re-joining later is refused at once.
                    self._client.close_run(
                        bounded(
                            escape(
                                f"{CLOSED}: {gave_up}, and the job cannot go on without it "
                                f"(--nnodes {self._min}:{self._max}, no other node waiting "
                                "to join)"
                            ),
                            CLOSE_REASON_BYTES,
                        ),
                        generation=node.generation,
                    )
            if node is not None:
                self._client.leave(final=True)  # see _exit_goodbye
            return True
        except RendezvousError as exc:
            log.warning("rendezvousd: job %r: shutdown: %s", self._run_id, exc)
            return False
        finally:
            # A second shutdown() has nothing left to tell: it answers True, as c10d's.
            self._node = None
            self._store_client.close()
            self._client.close()
            if self._warm is not None:
                self._warm.stop()
