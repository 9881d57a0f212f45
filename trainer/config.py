"""Distributed training config: a TOML ``[distributed]`` table, then env, then CLI.

Every field of :class:`DistributedConfig` (and of the ``[distributed.rendezvous]``
sub-table, :class:`RendezvousTransport`) is a TOML key, an env var and a flag,
through the same field-driven layering as the daemon (``rendezvousd.common.settings``):
defaults < TOML < env < CLI, merged into one set of values and validated once, so
a file may leave out what the environment supplies (e.g. the daemon endpoint).
``python -m rendezvousd.trainer.config`` prints the table of names.

Only ``num_nodes >= 2`` turns on multi-node mode. With ``num_nodes = 1`` the
world is ``world_size`` (else ``gpus_per_node``, else 1) workers on one node.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import sys
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypedDict, TypeVar, Unpack

from rendezvousd.common.address import AddressError, daemon_route, is_address_literal
from rendezvousd.common.settings import (
    AddressText,
    Bool,
    Choice,
    Float,
    Int,
    Invalid,
    Layer,
    PathText,
    Schema,
    Text,
    setting,
    table,
    validate,
)
from rendezvousd.common.validation import LONGEST_WAIT_S, SHORTEST_HEARTBEAT_S, is_wait
from rendezvousd.common.validation import job_id as check_job_id
from rendezvousd.errors import RendezvousFault
from rendezvousd.trainer.errors import ConfigError
from rendezvousd.trainer.interfaces import INTERFACE_MARK, InterfaceError, ipv4_of
from rendezvousd.trainer.topology import MultiNodeTopology

if TYPE_CHECKING:
    from rendezvousd.client.connection import TlsConfig
    from rendezvousd.client.sync import RendezvousClient

Backend = Literal["cpu", "nccl"]
TransportKind = Literal["file", "daemon"]

BACKENDS: tuple[Backend, ...] = ("cpu", "nccl")
TRANSPORT_KINDS: tuple[TransportKind, ...] = ("file", "daemon")

ENV_GPUS_PER_NODE = "RENDEZVOUSD_GPUS_PER_NODE"
ENV_NODE_RANK = "RENDEZVOUSD_NODE_RANK"
ENV_ENDPOINT = "RENDEZVOUSD_ENDPOINT"
#: Path of the TOML file itself (read by ``init_distributed``, set by the launcher).
CONFIG_ENV = "RENDEZVOUSD_CONFIG"

#: Spelling of "let the daemon assign my node rank" in TOML, env and CLI (TOML has no null).
AUTO = "auto"

SECTION = "distributed"


class NodeRank(Int):
    """An integer >= 0, or ``auto`` (None: the daemon assigns it at join time)."""

    def __init__(self) -> None:
        super().__init__(minimum=0, optional=True)

    def _wants(self) -> str:
        return f"a node rank: an integer >= 0 or '{AUTO}'"

    def check(self, value: Any) -> Any:
        return None if value == AUTO else super().check(value)

    def from_text(self, text: str) -> Any:
        return text if text == AUTO else super().from_text(text)

    def render(self, value: Any) -> str | None:
        return AUTO if value is None else str(value)


#: The largest count a protocol field holds (uint32: NodeProgress.max_restarts).
UINT32_MAX = 2**32 - 1


@dataclass(frozen=True)
class Seconds(Float):
    """A wait in seconds from ``least`` to the SDK's ``LONGEST_WAIT_S`` (30 days): every
    one ends up in an SDK call (a join's or kv_get's timeout, the heartbeat interval) or
    a thread's wait, which refused a longer one mid-job with a traceback
    (``threading.TIMEOUT_MAX`` is ~292 years, below 1e308), and 1e-9 s busy-looped."""

    least: float = 0.001
    optional: bool = False

    def _wants(self) -> str:
        return f"a number of seconds from {self.least:g} to {LONGEST_WAIT_S:.0f} (30 days)"

    def check(self, value: Any) -> Any:
        if value is None and self.optional:
            return None
        if not is_wait(value, self.least):  # NaN fails too
            raise Invalid(f"must be {self._wants()}")
        return float(value)


@dataclass(frozen=True)
class Count(Int):
    """An integer from ``minimum`` to ``maximum``: the protocol's uint32 by default (a
    larger ``max_restarts`` failed the agent's first progress report, mid-job)."""

    maximum: int = UINT32_MAX

    def _wants(self) -> str:
        return f"an integer from {self.minimum} to {self.maximum}"

    def check(self, value: Any) -> Any:
        value = super().check(value)
        if value is not None and value > self.maximum:
            raise Invalid(f"must be {self._wants()}")
        return value


@dataclass(frozen=True)
class JobId(Text):
    """A job id the daemon takes: its own rule (``common/validation.job_id``), checked
    here so that a bad one is a config error, not a join that fails after the spares
    started."""

    def check(self, value: Any) -> Any:
        value = super().check(value)
        try:
            return check_job_id(value)
        except RendezvousFault as exc:
            # "job id 'a b' is invalid: use 1-128 characters from ...": the rule only,
            # since the caller's message quotes the value and names the setting.
            rule = exc.message.partition(" is invalid: ")[2] or exc.message
            raise Invalid(f"must be a job id the daemon takes: {rule}") from None


#: The bucket sizes' unit: what ``bucketing`` multiplies ``*_mib`` by, then truncates.
MIB = 1 << 20
#: The most bytes a bucket size may be: 8 EiB (``int(mib * MIB)`` of a larger float
#: overflowed to inf past 1e302 MiB, an OverflowError in every worker).
LARGEST_BUCKET_BYTES = 1 << 63


@dataclass(frozen=True)
class Mebibytes(Float):
    """A bucket size in MiB of at least one byte: ``bucketing`` takes ``int(mib * MiB)``
    bytes, so 1e-7 MiB (0 bytes) passed as "positive" and then failed every worker
    mid-job, and a first bucket under one byte silently meant none."""

    def _wants(self) -> str:
        return (
            f"a size in MiB from {1 / MIB!r} (one byte, 1/{MIB}) to "
            f"{LARGEST_BUCKET_BYTES // MIB} (8 EiB)"
        )

    def check(self, value: Any) -> Any:
        try:
            value = super().check(value)
        except Invalid:
            raise Invalid(f"must be {self._wants()}") from None
        if not 1 <= value * MIB <= LARGEST_BUCKET_BYTES:
            raise Invalid(f"must be {self._wants()}")
        return value


def _check_listenable(host: str, given: str | None = None) -> None:
    """Refuse a ``ring_host`` this host cannot listen on, as its workers' rings would
    (a name that does not resolve, another host's address): each worker died with a raw
    socket error, reported only as "exit code 1"."""
    from rendezvousd.trainer.comm.ring_wire import create_listener  # what the ring does

    try:
        create_listener(host).close()
    except (OSError, UnicodeError) as exc:
        raise _not_listenable(given or host, _why(exc)) from None


def _why(exc: OSError | UnicodeError) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)


def _not_listenable(ring_host: str, why: str) -> ConfigError:
    """The refusal of a ``ring_host`` this host cannot listen on, and what to give."""
    return ConfigError(
        f"ring_host={ring_host!r} cannot be listened on here ({why}): give an address of "
        "this host that the other nodes reach, or leave it unset (the address towards the "
        "daemon)"
    )


#: The one setting that names the address a ring advertises, in every form it takes.
RING_HOST_KNOB = "--ring-host ($RENDEZVOUSD_RING_HOST, ring_host)"


@dataclass(frozen=True, slots=True)
class RingAddress:
    """The address a rank's ring (a node's link) listens on and advertises, and where
    it came from, in the words its errors say (``chosen as its host's route to the
    daemon at head:29420``, ``given by --ring-host ...``): a peer that cannot reach it,
    or a loopback refusal, names what to change."""

    address: str
    origin: str


def _resolved_ring_host(host: str) -> str:
    """``ring_host`` as an address: a name resolved once, here, to the address the
    ring's listener binds (the C library's first answer). Advertised as the name, each
    peer resolved it on its own host (``127.0.1.1 x1`` on this one, its LAN address on
    theirs: refused connections for the whole setup), and the loopback refusal, which
    reads addresses, let it by."""
    bare = host.strip("[]")
    if is_address_literal(bare):
        return bare
    try:
        return str(socket.getaddrinfo(bare, None, type=socket.SOCK_STREAM)[0][4][0])
    except (OSError, UnicodeError) as exc:
        raise _not_listenable(host, f"it does not resolve on this host: {_why(exc)}") from None


def _interface_ring_host(given: str, note: Callable[[str], None] | None) -> RingAddress:
    """``ring_host = "@eth1"``: that interface's IPv4 address on this host, so one
    config (a shared TOML, an srun script's environment) names the nodes' data network
    and each node advertises its own address on it, as GLOO_SOCKET_IFNAME and
    NCCL_SOCKET_IFNAME name an interface. A mark inside ``ring_host``, not a setting of
    its own: one setting with one precedence (a node's --ring-host 10.0.0.5 overrides a
    shared file's @eth1 as any value does), and no pair of settings to refuse together."""
    name = given[len(INTERFACE_MARK) :]
    try:
        address = ipv4_of(name)
    except InterfaceError as exc:
        raise ConfigError(
            f"ring_host={given!r} on host {socket.gethostname()}: {exc}; name an interface "
            f"this host has after {INTERFACE_MARK!r} (the one the other nodes reach it on), "
            "give an address, or leave ring_host unset (the address towards the daemon)"
        ) from None
    _check_listenable(address, given)
    if note is not None:
        note(
            f"ring_host {given!r} is interface {name}'s address {address} on this host: the "
            f"ring listens on and advertises {address}"
        )
    return RingAddress(address, f"given by {RING_HOST_KNOB} as interface {name}'s address")


def _tls(help: str, kind: Text | None = None) -> Any:
    """A TLS setting under the daemon's names: ``RENDEZVOUSD_TLS_*`` and ``--tls-*``; a
    file's path unless ``kind`` says otherwise."""
    return setting(None, help, kind or PathText(optional=True), unprefixed=True)


@dataclass(frozen=True, slots=True)
class RendezvousTransport:
    """How workers find each other.

    ``file``: a directory the workers share (single node only); ``path=None`` lets
    the launcher pick a private temporary directory. ``daemon``: the rendezvousd
    daemon at ``endpoint``, authenticating with the token in ``token_file``.
    """

    kind: TransportKind = setting(
        "file", "'file' (one node) or 'daemon'", Choice(TRANSPORT_KINDS), env=None, flag=None
    )
    path: str | None = setting(
        None,
        "file transport directory (sets kind='file')",
        PathText(optional=True),
        implies={"kind": "file", "endpoint": None, "token_file": None},
    )
    endpoint: str | None = setting(
        None,
        "rendezvous daemon HOST:PORT or unix:PATH (sets kind='daemon')",
        AddressText("endpoint", optional=True, allow_unix=True),
        env=ENV_ENDPOINT,
        flag="--endpoint",
        implies={"kind": "daemon", "path": None},
    )
    # No env var of its own: the client SDK reads RENDEZVOUSD_TOKEN_FILE itself.
    token_file: str | None = setting(
        None, "daemon token file", PathText(optional=True), env=None, flag="--token-file"
    )
    connect_timeout_s: float = setting(
        30.0,
        "seconds a client keeps dialling the daemon before it reports it unavailable",
        Seconds(),
        unprefixed=True,
    )
    # The daemon's own names (tls_cert/tls_key), so one set of files and variables
    # configures both ends; here they are this worker's client certificate (mTLS).
    tls_ca: str | None = _tls("PEM CA bundle that signed the daemon's certificate (enables TLS)")
    tls_cert: str | None = _tls("PEM client certificate, for a daemon that requires mTLS")
    tls_key: str | None = _tls("PEM private key for tls_cert")
    tls_server_name: str | None = _tls(
        "name to verify in the daemon's certificate, when the endpoint's host differs",
        Text(optional=True),
    )

    def __post_init__(self) -> None:
        if self.kind == "daemon" and self.endpoint == "":
            object.__setattr__(self, "endpoint", None)  # reported as missing below
        validate(self, ConfigError, prefix="rendezvous ")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("rendezvous tls_cert and tls_key go together: give both or neither")
        if self.tls_cert is not None and self.tls_ca is None:
            raise ConfigError("rendezvous tls_cert (mTLS) needs tls_ca to verify the daemon")
        if self.tls_server_name is not None and self.tls_ca is None:
            raise ConfigError("rendezvous tls_server_name needs tls_ca (it is a TLS setting)")
        if self.kind == "file":
            if self.endpoint is not None or self.token_file is not None or self.tls_ca:
                raise ConfigError(
                    "rendezvous kind='file' takes only 'path'; endpoint/token_file/tls_* "
                    "need kind='daemon'"
                )
            return
        if self.path is not None:
            raise ConfigError(
                f"rendezvous path={self.path!r} is only for kind='file'; "
                "kind='daemon' takes 'endpoint' and 'token_file'"
            )
        if self.endpoint is None:
            raise ConfigError(
                "rendezvous kind='daemon' needs endpoint='host:port' "
                f"(in the config file or {ENV_ENDPOINT})"
            )

    @classmethod
    def file(cls, path: str | None = None) -> RendezvousTransport:
        return cls(kind="file", path=path)

    @classmethod
    def daemon(cls, endpoint: str, token_file: str | None = None) -> RendezvousTransport:
        return cls(kind="daemon", endpoint=endpoint, token_file=token_file)

    def describe(self) -> str:
        """A log-safe summary: whether a token and TLS are used, never the token."""
        if self.kind == "file":
            return f"file({self.path if self.path is not None else '<private temp dir, world of one>'})"
        # The SDK connects only with a token (argument, token_file or its environment
        # variables): a daemon client always authenticates, whatever token_file says.
        tls = "mtls" if self.tls_cert else "tls" if self.tls_ca else "off"
        return f"daemon({self.endpoint}, auth=token, tls={tls})"

    def tls(self) -> TlsConfig | None:
        """The SDK's TLS settings, or None for plaintext."""
        if self.tls_ca is None:
            return None
        # Here, not at the top: reading settings (the launcher, before it starts its
        # spares) must not wait for gRPC's import.
        from rendezvousd.client.connection import TlsConfig

        return TlsConfig.from_paths(self.tls_ca, self.tls_cert, self.tls_key, self.tls_server_name)

    def client(
        self, job_id: str, retry_attempts: int, *, token: str | None = None
    ) -> RendezvousClient:
        """A sync SDK client of this daemon for ``job_id`` (the launcher's and an
        agent-started worker's, which is handed the agent's ``token``); ConfigError
        when no daemon endpoint is set."""
        if self.kind != "daemon" or self.endpoint is None:
            raise ConfigError(
                "no rendezvous daemon endpoint: pass --rdzv-endpoint or set RENDEZVOUSD_ENDPOINT"
            )
        from rendezvousd.client.sync import RendezvousClient

        return RendezvousClient(
            self.endpoint,
            job_id,
            token=token,
            token_file=self.token_file,
            tls=self.tls(),
            retry_attempts=retry_attempts,
            connect_timeout=self.connect_timeout_s,
        )


_WAIT = Seconds()


@dataclass(frozen=True, slots=True)
class DistributedConfig:
    """Validated distributed settings; see the module docstring for precedence."""

    backend: Backend = setting("cpu", "collective backend", Choice(BACKENDS))
    world_size: int | None = setting(
        None, "single node: number of workers (default gpus_per_node, else 1)", Count(1, True)
    )
    rank: int | None = setting(None, "this worker's global rank, if fixed", Int(0, True))
    num_nodes: int = setting(1, "number of nodes; >= 2 is multi-node mode", Count(1))
    node_rank: int | None = setting(
        0, f"this node's rank, or '{AUTO}' (the daemon assigns it)", NodeRank()
    )
    gpus_per_node: int | None = setting(None, "workers (devices) per node", Count(1, True))
    local_rank: int | None = setting(
        None,
        "this worker's rank on its node (without rendezvous-run, which hands it over)",
        Int(0, True),
    )
    rendezvous: RendezvousTransport = table(RendezvousTransport, "how workers find each other")
    job_id: str = setting("default", "job id shared by every node", JobId())
    retry_attempts: int = setting(
        1, "retries of a transient failure, then fail", Count(0), env="RENDEZVOUSD_RETRIES"
    )
    bucket_cap_mib: float = setting(25.0, "gradient bucket size, MiB", Mebibytes())
    first_bucket_mib: float = setting(1.0, "first (smallest) gradient bucket, MiB", Mebibytes())
    join_timeout_s: float = setting(600.0, "nodes may be scheduled minutes apart", _WAIT)
    collective_timeout_s: float = setting(
        300.0, "a hung peer fails the step instead of hanging the job", _WAIT
    )
    slow_peer_warn_s: float = setting(
        30.0,
        "cpu backend: a collective that has waited this long on one peer logs which rank "
        "and host it waits on, and again each time the wait doubles (the wait itself "
        "still ends at collective_timeout_s)",
        _WAIT,
    )
    check_collectives: bool = setting(
        False,
        "nccl backend: compare every all-reduce's size, type and op across ranks first "
        "(a small all-reduce more each), so that a mismatch fails at once instead of at "
        "collective_timeout_s; for debugging (the cpu backend always does)",
        Bool(),
    )
    # From the SDK's floor for start_heartbeat(): 1e-9 s busy-looped the agent's heartbeat.
    # Unset: the SDK's own choice, a third of the daemon's heartbeat timeout (at most
    # 5 s). A fixed 5 s default was above a default daemon's third (10 s / 3), so every
    # rank logged that it beats faster than configured, for a setting nobody made.
    heartbeat_interval_s: float | None = setting(
        None,
        "daemon liveness ping interval (default: a third of the daemon's heartbeat "
        "timeout, at most 5 s)",
        Seconds(least=SHORTEST_HEARTBEAT_S, optional=True),
    )
    cpu_shared_memory: bool = setting(
        True, "cpu backend: all-reduce through shared memory when all ranks share a host", Bool()
    )
    ring_host: str | None = setting(
        None,
        "cpu backend: address this worker's ring listens on and advertises, or "
        "@INTERFACE for that interface's IPv4 address on each host (default: this "
        "host's address towards the daemon)",
        Text(optional=True),
    )
    setup_timeout_s: float = setting(
        300.0,
        "communicator setup (ring connections, NCCL init) must finish within",
        _WAIT,
    )
    # The node agent's (rendezvous-run's) recovery settings; workers ignore them.
    min_nodes: int | None = setting(
        None,
        "elastic: fewest nodes a generation may form with (default num_nodes; "
        "rendezvous-run --nnodes MIN:MAX)",
        Count(1, True),
    )
    max_restarts: int = setting(
        0,
        "rendezvous-run: failures this node rides out, re-joining the job after each (each "
        "node counts its own), then it gives up",
        Count(0),
    )
    hang_timeout_s: float = setting(
        300.0,
        "rendezvous-run: a worker that reported progress and then none for this long is hung",
        _WAIT,
    )
    node_link_watch: bool = setting(
        True,
        "rendezvous-run, nccl backend: each node agent keeps an idle TCP link to the next "
        "node's agent, so that a cut between two nodes is reported in ~12 s (NCCL's own "
        "sockets would wait for collective_timeout_s)",
        Bool(),
    )
    spare_gpu_context: bool = setting(
        True,
        "rendezvous-run, nccl backend: each warm spare loads CuPy and makes its GPU's CUDA "
        "context while it waits, so a restart's workers start at NCCL's init; costs one "
        "context's GPU memory per GPU",
        Bool(),
    )
    stop_grace_s: float = setting(
        10.0,
        "rendezvous-run: when it is stopped (SIGTERM, SIGINT, SIGHUP, SIGQUIT), its workers' "
        "time to act on the signal (a checkpoint on preemption) before SIGKILL",
        _WAIT,
    )
    last_call_s: float = setting(
        0.0,
        "elastic: with >= min_nodes joined, wait this long for more before forming "
        "(0: the daemon's default)",
        Seconds(least=0.0),
    )
    rejoin_timeout_s: float = setting(
        60.0,
        "rendezvous-run: a restart waits this long for min_nodes nodes, then counts as failed",
        _WAIT,
    )
    standby: bool = setting(
        False,
        "rendezvous-run: a standby node: waits, spares warm, beyond MAX nodes and takes the "
        "place of a node the job loses",
        Bool(),
    )
    standby_if_full: bool = setting(
        False,
        "rendezvous-run with --node-rank auto: a node that finds the world full stands by "
        "(as --standby) instead of failing with WORLD_FULL, so every node of a job can run "
        "one command and the extra ones are spares",
        Bool(),
    )

    def __post_init__(self) -> None:
        validate(self, ConfigError)
        if self.min_nodes is not None and self.min_nodes > self.num_nodes:
            raise ConfigError(
                f"min_nodes={self.min_nodes} exceeds num_nodes={self.num_nodes} (the maximum); "
                "pass --nnodes MIN:MAX with MIN <= MAX"
            )
        if self.is_multi_node:
            self._validate_multi_node()
        elif self.node_rank not in (None, 0):
            raise ConfigError(
                f"node_rank={self.node_rank} is out of range for num_nodes={self.num_nodes} "
                f"(expected 0, or '{AUTO}')"
            )
        elif self.world_size is not None and self.gpus_per_node not in (None, self.world_size):
            raise ConfigError(
                f"world_size={self.world_size} contradicts gpus_per_node={self.gpus_per_node} "
                "on a single node; give one of them"
            )
        elif self.rank is not None and self.rank >= self.local_world_size:
            world_size = self.local_world_size
            raise ConfigError(
                f"rank={self.rank} is out of range for world_size={world_size} "
                f"(expected 0..{world_size - 1})"
            )
        if self.standby or self.standby_if_full:
            self._validate_standby()
        placement = self.topology()
        if placement is not None and self.local_rank not in (None, placement.local_rank):
            raise ConfigError(
                f"rank={self.rank} is local rank {placement.local_rank} on its node, "
                f"not the configured local_rank={self.local_rank}"
            )

    def _validate_standby(self) -> None:
        if self.rendezvous.kind != "daemon":
            raise ConfigError(
                "standby needs the daemon rendezvous transport: a standby node waits at the "
                f"daemon for a slot (kind={self.rendezvous.kind!r}); set {ENV_ENDPOINT}"
            )
        if self.is_multi_node and self.node_rank is not None:
            raise ConfigError(
                f"a standby node takes the node rank a lost node frees, not node_rank="
                f"{self.node_rank}: pass --node-rank {AUTO}"
            )

    def _validate_multi_node(self) -> None:
        if self.gpus_per_node is None:
            raise ConfigError(
                f"num_nodes={self.num_nodes} needs gpus_per_node (workers per node) "
                f"to be set, in the config file or {ENV_GPUS_PER_NODE}"
            )
        if self.rendezvous.kind != "daemon":
            raise ConfigError(
                f"num_nodes={self.num_nodes} needs the daemon rendezvous transport; "
                f"kind={self.rendezvous.kind!r} works on a single node only. Set "
                f"[{SECTION}.rendezvous] kind='daemon' endpoint='host:port' or {ENV_ENDPOINT}"
            )
        derived = self.num_nodes * self.gpus_per_node
        if derived > UINT32_MAX:
            # Each count fits the protocol's uint32 fields, but their product is the
            # world_size (and the ranks) of every JoinNode answer: uint32 too.
            raise ConfigError(
                f"num_nodes={self.num_nodes} x gpus_per_node={self.gpus_per_node} = {derived} "
                f"workers, more than the {UINT32_MAX} a world can hold (the protocol's "
                "world_size and ranks are uint32); lower --nnodes or --nproc-per-node"
            )
        if self.world_size is not None and self.world_size != derived:
            raise ConfigError(
                f"world_size={self.world_size} contradicts num_nodes={self.num_nodes} x "
                f"gpus_per_node={self.gpus_per_node} = {derived}; drop world_size in "
                "multi-node mode (it is derived)"
            )
        if self.node_rank is not None and self.node_rank >= self.num_nodes:
            raise ConfigError(
                f"node_rank={self.node_rank} is out of range for num_nodes={self.num_nodes} "
                f"(expected 0..{self.num_nodes - 1}, or '{AUTO}')"
            )
        if self.rank is not None and self.node_rank is not None:
            topo = MultiNodeTopology.from_global_rank(self.rank, self.num_nodes, self.gpus_per_node)
            if topo.node_rank != self.node_rank:
                raise ConfigError(
                    f"rank={self.rank} lies on node {topo.node_rank}, "
                    f"not node_rank={self.node_rank}",
                    if_unset={
                        # A global rank from srun (SLURM_PROCID) without the node's.
                        "node_rank": f"node_rank was never set ({self.node_rank} is its "
                        f"default): set {ENV_NODE_RANK} to this worker's node "
                        f"({ENV_NODE_RANK}=$SLURM_NODEID under srun), or to '{AUTO}' for "
                        "the daemon to assign it"
                    },
                )

    @property
    def is_multi_node(self) -> bool:
        return self.num_nodes >= 2

    @property
    def fewest_nodes(self) -> int:
        """The elastic minimum: ``min_nodes``, else ``num_nodes`` (a fixed size)."""
        return self.num_nodes if self.min_nodes is None else self.min_nodes

    @property
    def local_world_size(self) -> int:
        """Workers on each node (the whole world on a single node)."""
        if self.is_multi_node:
            assert self.gpus_per_node is not None  # guaranteed by validation
            return self.gpus_per_node
        if self.world_size is not None:
            return self.world_size
        return self.gpus_per_node if self.gpus_per_node is not None else 1

    @property
    def effective_world_size(self) -> int:
        """The global world size: ``num_nodes x`` the workers per node."""
        return self.num_nodes * self.local_world_size

    def topology(self) -> MultiNodeTopology | None:
        """Where this worker sits as far as the config says, or None while the daemon
        has yet to assign the node rank (``node_rank = 'auto'``, no fixed ``rank``).

        A fixed ``rank`` decides node and local rank; otherwise ``node_rank`` and
        ``local_rank`` (default 0) do. The rank the daemon returns at join is what a
        running worker uses (``init_distributed``); this is the launcher's preview.
        """
        per_node = self.local_world_size
        if self.rank is not None:
            return MultiNodeTopology.from_global_rank(self.rank, self.num_nodes, per_node)
        node = 0 if not self.is_multi_node else self.node_rank
        if node is None:
            return None
        local = self.local_rank if self.local_rank is not None else 0
        return MultiNodeTopology(self.num_nodes, per_node, node, local)

    def ring_address(
        self, note: Callable[[str], None] | None = None, wait_s: float | None = None
    ) -> str:
        """The address this worker's (or node's) ring peers reach it at (``ring_choice``)."""
        return self.ring_choice(note, wait_s).address

    def ring_choice(
        self, note: Callable[[str], None] | None = None, wait_s: float | None = None
    ) -> RingAddress:
        """The address this worker's (or node's) ring peers reach it at, and where it
        came from: ``ring_host`` (a name resolved here, once, ``note`` told to what),
        else this host's address on its connection to the daemon (loopback for a
        ``unix:`` endpoint or the file transport). A daemon's name that does not
        resolve yet is asked again for ``wait_s`` (default: ``connect_timeout_s``),
        ``note`` told so."""
        if self.ring_host and self.ring_host.startswith(INTERFACE_MARK):
            return _interface_ring_host(self.ring_host, note)
        if self.ring_host:
            address = _resolved_ring_host(self.ring_host)
            _check_listenable(address, self.ring_host if address != self.ring_host else None)
            origin = f"given by {RING_HOST_KNOB}"
            if address != self.ring_host:
                origin += f" as {self.ring_host!r}, which resolves to {address} on this host"
                if note is not None:
                    note(
                        f"ring_host {self.ring_host!r} resolves to {address} on this host: "
                        f"the ring listens on and advertises {address}"
                    )
            return RingAddress(address, origin)
        wait = self.rendezvous.connect_timeout_s if wait_s is None else wait_s
        endpoint = self.rendezvous.endpoint or "unix:local"
        try:
            route = daemon_route(endpoint, wait, note)
        except (AddressError, OSError) as exc:
            raise ConfigError(f"cannot tell which address to advertise to peers: {exc}") from exc
        if not self.rendezvous.endpoint or endpoint.startswith("unix:"):
            return RingAddress(route.local, "loopback, the daemon being on this host")
        origin = f"chosen as its host's route to the daemon at {endpoint}"
        if resolved := route.resolved():
            origin += f" ({resolved})"
        return RingAddress(route.local, origin)

    def rank0_log_line(self, formed: MultiNodeTopology) -> str:
        """One summary line for global rank 0 to log, of the world that ``formed``
        (an elastic job may form with fewer nodes than ``num_nodes``); never
        contains a token."""
        parts = [f"backend={self.backend}", f"world_size={formed.world_size}"]
        if self.is_multi_node:
            nodes = f"{formed.num_nodes}"
            if self.fewest_nodes != self.num_nodes:
                nodes += f" (elastic {self.fewest_nodes}..{self.num_nodes})"
            parts += [
                f"num_nodes={nodes}",
                f"gpus_per_node={formed.gpus_per_node}",
                f"node_rank={formed.node_rank}",
            ]
        else:
            parts.append(f"rank={formed.rank}")
        parts += [
            f"rendezvous={self.rendezvous.describe()}",
            f"retry_attempts={self.retry_attempts}",
            f"bucket_cap_mib={self.bucket_cap_mib:g}",
            f"first_bucket_mib={self.first_bucket_mib:g}",
        ]
        return "distributed: " + " ".join(parts)

    def handoff(self) -> dict[str, Any]:
        """Every field as JSON values: what the node agent hands its workers
        (``resolved`` rebuilds the config on their side)."""
        return dataclasses.asdict(self)

    @classmethod
    def resolved(cls, values: Mapping[str, Any]) -> DistributedConfig:
        """The config a node agent resolved and validated, rebuilt in its worker from
        ``handoff()``'s values. Not validated again: the agent, the worker's parent,
        already did, and a worker started by it reads no TOML and no environment.
        ``KeyError`` when the fields are not exactly the config's."""
        transport = _unchecked(RendezvousTransport, values["rendezvous"])
        return _unchecked(cls, {**values, "rendezvous": transport})


_T = TypeVar("_T")


def _unchecked(cls: type[_T], values: Mapping[str, Any]) -> _T:
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    if set(values) != set(names):
        raise KeyError(f"{cls.__name__} fields differ: {sorted(set(values) ^ set(names))}")
    instance = object.__new__(cls)
    for name in names:
        # How a frozen dataclass's own __init__ sets its fields.
        object.__setattr__(instance, name, values[name])
    return instance


SCHEMA = Schema(DistributedConfig, ConfigError, section=SECTION)


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


class ConfigSources(TypedDict, total=False):
    """Where ``load_layers`` and ``load_config`` read besides the TOML file.

    ``env`` defaults to ``os.environ``; ``cli`` is an argparse result or a mapping
    of field names; ``allow_sections`` names other top-level tables the file may
    carry for other readers (any other top-level key is rejected as a likely typo).
    """

    env: Mapping[str, str] | None
    cli: argparse.Namespace | Mapping[str, object] | None
    allow_sections: Collection[str]


def load_layers(
    path: str | os.PathLike[str] | None = None, **sources: Unpack[ConfigSources]
) -> Layer:
    """The merged values with their origins (``$VAR``, ``--flag``, ``key in file``);
    what was not set anywhere is absent."""
    cli = sources.get("cli")
    return SCHEMA.merge(
        [
            SCHEMA.from_toml(Path(path), sources.get("allow_sections", ()))
            if path is not None
            else {},
            SCHEMA.from_env(_env(sources.get("env"))),
            SCHEMA.from_cli(cli) if cli is not None else {},
        ]
    )


def load_config(
    path: str | os.PathLike[str] | None = None, **sources: Unpack[ConfigSources]
) -> DistributedConfig:
    """TOML file (optional), then env (default ``os.environ``), then CLI; validated once."""
    return SCHEMA.build([load_layers(path, **sources)])


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """Register one override flag per field; unset flags override nothing."""
    SCHEMA.add_arguments(parser.add_argument_group(SECTION))


def settings_table() -> str:
    """Markdown table of every setting (docs/trainer.md holds it; a test compares)."""
    return SCHEMA.markdown_table()


if __name__ == "__main__":
    sys.stdout.write(settings_table())
