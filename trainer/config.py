"""Distributed training config: a TOML ``[distributed]`` table, then env, then CLI.

All three layers are merged into one set of raw values and validated once, so a
file may leave out what the environment supplies (e.g. the daemon endpoint).

Only ``num_nodes >= 2`` turns on multi-node mode. With ``num_nodes = 1`` the
configured ``world_size`` (default 1) and ``rank`` (default 0) are used as is.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import tomllib
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from .errors import ConfigError
from .topology import MultiNodeTopology

Backend = Literal["cpu", "nccl"]
TransportKind = Literal["file", "daemon"]

BACKENDS: tuple[Backend, ...] = ("cpu", "nccl")
TRANSPORT_KINDS: tuple[TransportKind, ...] = ("file", "daemon")

ENV_NUM_NODES = "RENDEZVOUSD_NUM_NODES"
ENV_NODE_RANK = "RENDEZVOUSD_NODE_RANK"
ENV_GPUS_PER_NODE = "RENDEZVOUSD_GPUS_PER_NODE"
ENV_ENDPOINT = "RENDEZVOUSD_ENDPOINT"
ENV_RETRIES = "RENDEZVOUSD_RETRIES"

#: Spelling of "let the daemon assign my node rank" in TOML, env and CLI (TOML has no null).
AUTO = "auto"

SECTION = "distributed"


def _check_int(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be an integer >= {minimum}")
    if value < minimum:
        raise ConfigError(f"{name}={value} must be >= {minimum}")
    return value


def _check_seconds_or_mib(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name}={value!r} must be a positive number")
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name}={value!r} must be a positive finite number")
    return float(value)


def _check_optional_str(name: str, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{name}={value!r} must be a non-empty string")
    return value


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """Split ``"host:port"`` (or ``"[v6addr]:port"``); raise ``ConfigError`` if malformed."""
    if not isinstance(endpoint, str):
        raise ConfigError(f"endpoint={endpoint!r} must be a string 'host:port'")
    hint = "expected 'host:port', e.g. '127.0.0.1:29400'"
    if "://" in endpoint or any(c.isspace() for c in endpoint):
        raise ConfigError(f"endpoint={endpoint!r} is malformed: {hint} with no scheme or spaces")
    host, sep, port_text = endpoint.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ConfigError(f"endpoint={endpoint!r} is malformed: wrap IPv6 hosts as '[addr]:port'")
    if not sep or not host:
        raise ConfigError(f"endpoint={endpoint!r} is malformed: {hint}")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ConfigError(f"endpoint={endpoint!r} has port {port_text!r}: expected 1..65535")
    return host, int(port_text)


@dataclass(frozen=True, slots=True)
class RendezvousTransport:
    """How workers find each other.

    ``file``: a directory the workers share (single node only); ``path=None`` lets
    the launcher pick a private temporary directory. ``daemon``: the rendezvousd
    daemon at ``endpoint``, authenticating with the token in ``token_file``.
    """

    kind: TransportKind = "file"
    path: str | None = None
    endpoint: str | None = None
    token_file: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in TRANSPORT_KINDS:
            raise ConfigError(
                f"rendezvous kind={self.kind!r} is unknown; expected one of {TRANSPORT_KINDS}"
            )
        _check_optional_str("rendezvous path", self.path)
        _check_optional_str("rendezvous token_file", self.token_file)
        if self.kind == "file":
            if self.endpoint is not None or self.token_file is not None:
                raise ConfigError(
                    "rendezvous kind='file' takes only 'path'; endpoint/token_file "
                    "need kind='daemon'"
                )
            return
        if self.path is not None:
            raise ConfigError(
                f"rendezvous path={self.path!r} is only for kind='file'; "
                "kind='daemon' takes 'endpoint' and 'token_file'"
            )
        if self.endpoint is None or self.endpoint == "":
            raise ConfigError(
                "rendezvous kind='daemon' needs endpoint='host:port' "
                f"(in the config file or {ENV_ENDPOINT})"
            )
        parse_endpoint(self.endpoint)

    @classmethod
    def file(cls, path: str | None = None) -> RendezvousTransport:
        return cls(kind="file", path=path)

    @classmethod
    def daemon(cls, endpoint: str, token_file: str | None = None) -> RendezvousTransport:
        return cls(kind="daemon", endpoint=endpoint, token_file=token_file)

    def describe(self) -> str:
        """A log-safe summary: the token file is mentioned, its contents never read."""
        if self.kind == "file":
            return f"file({self.path if self.path is not None else '<launcher temp dir>'})"
        auth = "token_file" if self.token_file is not None else "none"
        return f"daemon({self.endpoint}, auth={auth})"


@dataclass(frozen=True, slots=True)
class DistributedConfig:
    """Validated distributed settings; see the module docstring for precedence.

    Defaults: ``retry_attempts=1`` (one retry of a transient failure, then fail);
    ``bucket_cap_mib=25`` and ``first_bucket_mib=1`` (gradient bucket sizes);
    ``join_timeout_s=600`` (nodes may be scheduled minutes apart);
    ``collective_timeout_s=300`` (a hung peer fails the step instead of the job
    hanging forever); ``heartbeat_interval_s=5`` (daemon liveness ping);
    ``cpu_shared_memory=true`` (the cpu backend all-reduces through shared memory when
    every rank runs on one host and node; false keeps the TCP ring).
    ``node_rank=None`` lets the daemon assign it at join time.
    """

    backend: Backend = "cpu"
    world_size: int | None = None
    rank: int | None = None
    num_nodes: int = 1
    node_rank: int | None = 0
    gpus_per_node: int | None = None
    rendezvous: RendezvousTransport = RendezvousTransport()
    retry_attempts: int = 1
    bucket_cap_mib: float = 25.0
    first_bucket_mib: float = 1.0
    join_timeout_s: float = 600.0
    collective_timeout_s: float = 300.0
    heartbeat_interval_s: float = 5.0
    cpu_shared_memory: bool = True

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend={self.backend!r} is unknown; expected one of {BACKENDS}")
        if not isinstance(self.rendezvous, RendezvousTransport):
            raise ConfigError(f"rendezvous={self.rendezvous!r} must be a RendezvousTransport")
        if not isinstance(self.cpu_shared_memory, bool):
            raise ConfigError(f"cpu_shared_memory={self.cpu_shared_memory!r} must be true or false")
        num_nodes = _check_int("num_nodes", self.num_nodes, 1)
        _check_int("retry_attempts", self.retry_attempts, 0)
        if self.gpus_per_node is not None:
            _check_int("gpus_per_node", self.gpus_per_node, 1)
        if self.world_size is not None:
            _check_int("world_size", self.world_size, 1)
        if self.rank is not None:
            _check_int("rank", self.rank, 0)
        if self.node_rank is not None:
            _check_int("node_rank", self.node_rank, 0)
            if self.node_rank >= num_nodes:
                raise ConfigError(
                    f"node_rank={self.node_rank} is out of range for num_nodes={num_nodes} "
                    f"(expected 0..{num_nodes - 1}, or '{AUTO}')"
                )
        for name in (
            "bucket_cap_mib",
            "first_bucket_mib",
            "join_timeout_s",
            "collective_timeout_s",
            "heartbeat_interval_s",
        ):
            # Normalise TOML integers (25) to floats; frozen, so bypass __setattr__.
            object.__setattr__(self, name, _check_seconds_or_mib(name, getattr(self, name)))
        if self.is_multi_node:
            self._validate_multi_node()
        else:
            world_size = self.effective_world_size
            if self.rank is not None and self.rank >= world_size:
                raise ConfigError(
                    f"rank={self.rank} is out of range for world_size={world_size} "
                    f"(expected 0..{world_size - 1})"
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
        if self.world_size is not None and self.world_size != derived:
            raise ConfigError(
                f"world_size={self.world_size} contradicts num_nodes={self.num_nodes} x "
                f"gpus_per_node={self.gpus_per_node} = {derived}; drop world_size in "
                "multi-node mode (it is derived)"
            )
        if self.rank is not None:
            topo = MultiNodeTopology.from_global_rank(self.rank, self.num_nodes, self.gpus_per_node)
            if self.node_rank is not None and topo.node_rank != self.node_rank:
                raise ConfigError(
                    f"rank={self.rank} lies on node {topo.node_rank}, "
                    f"not the configured node_rank={self.node_rank}"
                )

    @property
    def is_multi_node(self) -> bool:
        return self.num_nodes >= 2

    @property
    def effective_world_size(self) -> int:
        """The global world size: derived when multi-node, else as configured (default 1)."""
        if self.is_multi_node:
            assert self.gpus_per_node is not None  # guaranteed by validation
            return self.num_nodes * self.gpus_per_node
        return self.world_size if self.world_size is not None else 1

    def topology(
        self, *, local_rank: int | None = None, node_rank: int | None = None
    ) -> MultiNodeTopology:
        """This worker's place in the world.

        Single node: rank ``local_rank`` if given, else the configured ``rank``
        (default 0), of the configured world size. Multi-node: the configured
        global ``rank`` if set, else ``node_rank`` (the argument is the one the
        daemon assigned) and this worker's ``local_rank``.
        """
        if not self.is_multi_node:
            if node_rank not in (None, 0):
                raise ConfigError(f"node_rank={node_rank} given for a single-node config")
            rank = local_rank if local_rank is not None else (self.rank or 0)
            world_size = self.effective_world_size
            if not 0 <= rank < world_size:
                raise ConfigError(
                    f"rank={rank} is out of range for world_size={world_size} "
                    f"(expected 0..{world_size - 1})"
                )
            return MultiNodeTopology(1, world_size, 0, rank)
        assert self.gpus_per_node is not None  # guaranteed by validation
        if node_rank is not None and self.node_rank is not None and node_rank != self.node_rank:
            raise ConfigError(
                f"node_rank={node_rank} contradicts the configured node_rank={self.node_rank}"
            )
        node = node_rank if node_rank is not None else self.node_rank
        if self.rank is not None:
            topo = MultiNodeTopology.from_global_rank(self.rank, self.num_nodes, self.gpus_per_node)
            if (node is not None and node != topo.node_rank) or (
                local_rank is not None and local_rank != topo.local_rank
            ):
                raise ConfigError(
                    f"configured rank={self.rank} is node {topo.node_rank} local "
                    f"{topo.local_rank}, not node {node} local {local_rank}"
                )
            return topo
        if node is None:
            raise ConfigError(
                f"node_rank is '{AUTO}': pass the node_rank the daemon assigned to topology()"
            )
        if local_rank is None:
            raise ConfigError(
                f"multi-node topology needs this worker's local_rank (0..{self.gpus_per_node - 1})"
            )
        return MultiNodeTopology(self.num_nodes, self.gpus_per_node, node, local_rank)

    def rank0_log_line(self) -> str:
        """One summary line for global rank 0 to log; never contains a token."""
        parts = [f"backend={self.backend}", f"world_size={self.effective_world_size}"]
        if self.is_multi_node:
            node = AUTO if self.node_rank is None else str(self.node_rank)
            parts += [
                f"num_nodes={self.num_nodes}",
                f"gpus_per_node={self.gpus_per_node}",
                f"node_rank={node}",
            ]
        else:
            parts.append(f"rank={self.rank or 0}")
        parts += [
            f"rendezvous={self.rendezvous.describe()}",
            f"retry_attempts={self.retry_attempts}",
            f"bucket_cap_mib={self.bucket_cap_mib:g}",
            f"first_bucket_mib={self.first_bucket_mib:g}",
        ]
        return "distributed: " + " ".join(parts)


# ---- layering: every layer yields raw field values; one constructor call validates.

_FIELDS = frozenset(f.name for f in dataclasses.fields(DistributedConfig)) - {"rendezvous"}
_TRANSPORT_FIELDS = frozenset(f.name for f in dataclasses.fields(RendezvousTransport))

Raw = dict[str, Any]


def _parse_node_rank(value: object, where: str) -> int | None:
    if value == AUTO:
        return None
    if not isinstance(value, str):
        return _check_int(where, value, 0)
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise ConfigError(
            f"{where}={value!r} is not a node rank: expected an integer >= 0 or '{AUTO}'"
        )
    return number


def _raw_from_toml(path: Path, allow_sections: Collection[str]) -> Raw:
    try:
        with path.open("rb") as fh:
            doc = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {path} could not be read as TOML: {exc}") from exc
    for key in doc:
        if key != SECTION and key not in allow_sections:
            raise ConfigError(
                f"unknown top-level key {key!r} in {path}; expected [{SECTION}]"
                + (f" or one of {sorted(allow_sections)}" if allow_sections else "")
            )
    table = doc.get(SECTION, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{SECTION!r} in {path} must be a table")
    raw: Raw = {}
    for key, value in table.items():
        if key == "rendezvous":
            if not isinstance(value, dict):
                raise ConfigError(f"{SECTION}.rendezvous in {path} must be a table")
            for tkey in value:
                if tkey not in _TRANSPORT_FIELDS:
                    raise ConfigError(
                        f"unknown key {SECTION}.rendezvous.{tkey} in {path}; "
                        f"expected one of {sorted(_TRANSPORT_FIELDS)}"
                    )
            raw["rendezvous"] = dict(value)
        elif key in _FIELDS:
            raw[key] = _parse_node_rank(value, "node_rank") if key == "node_rank" else value
        else:
            raise ConfigError(
                f"unknown key {SECTION}.{key} in {path}; "
                f"expected one of {sorted([*_FIELDS, 'rendezvous'])}"
            )
    return raw


def _env_int(env: Mapping[str, str], name: str, minimum: int) -> int | None:
    text = env.get(name)
    if text is None:
        return None
    try:
        value = int(text.strip())
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ConfigError(f"{name}={text!r} is invalid: expected an integer >= {minimum}")
    return value


def _raw_from_env(env: Mapping[str, str]) -> Raw:
    raw: Raw = {}
    for name, field, minimum in (
        (ENV_NUM_NODES, "num_nodes", 1),
        (ENV_GPUS_PER_NODE, "gpus_per_node", 1),
        (ENV_RETRIES, "retry_attempts", 0),
    ):
        value = _env_int(env, name, minimum)
        if value is not None:
            raw[field] = value
    if (node_text := env.get(ENV_NODE_RANK)) is not None:
        raw["node_rank"] = _parse_node_rank(node_text.strip(), ENV_NODE_RANK)
    if (endpoint := env.get(ENV_ENDPOINT)) is not None:
        endpoint = endpoint.strip()
        try:
            parse_endpoint(endpoint)
        except ConfigError as exc:
            raise ConfigError(f"{ENV_ENDPOINT}={endpoint!r} is invalid: {exc}") from None
        raw["rendezvous"] = {"kind": "daemon", "endpoint": endpoint, "path": None}
    return raw


# CLI names that address the transport rather than a top-level field.
_CLI_TRANSPORT_KEYS = {
    "endpoint": "endpoint",
    "token_file": "token_file",
    "rendezvous_path": "path",
}


def _raw_from_cli(overrides: argparse.Namespace | Mapping[str, object]) -> Raw:
    strict = not isinstance(overrides, argparse.Namespace)
    items = vars(overrides) if isinstance(overrides, argparse.Namespace) else dict(overrides)
    raw: Raw = {}
    transport: Raw = {}
    for key, value in items.items():
        if key in _CLI_TRANSPORT_KEYS:
            if value is not None:
                transport[_CLI_TRANSPORT_KEYS[key]] = value
        elif key in _FIELDS:
            if value is not None:
                raw[key] = _parse_node_rank(value, "node_rank") if key == "node_rank" else value
        elif strict:
            # A Namespace carries the whole program's flags; a dict is meant for us.
            raise ConfigError(
                f"unknown override {key!r}; expected one of "
                f"{sorted([*_FIELDS, *_CLI_TRANSPORT_KEYS])}"
            )
    if "endpoint" in transport:
        transport.setdefault("kind", "daemon")
        transport.setdefault("path", None)
    elif "path" in transport:
        transport.update(kind="file", endpoint=None, token_file=None)
    if transport:
        raw["rendezvous"] = transport
    return raw


def _merge(base: Raw, top: Raw) -> Raw:
    merged = {**base, **{k: v for k, v in top.items() if k != "rendezvous"}}
    if "rendezvous" in top:
        merged["rendezvous"] = {**base.get("rendezvous", {}), **top["rendezvous"]}
    return merged


def _raw_from_config(config: DistributedConfig) -> Raw:
    raw: Raw = {name: getattr(config, name) for name in _FIELDS}
    raw["rendezvous"] = dataclasses.asdict(config.rendezvous)
    return raw


def _build(raw: Raw) -> DistributedConfig:
    fields = dict(raw)
    transport = fields.pop("rendezvous", None)
    if transport is not None:
        try:
            fields["rendezvous"] = RendezvousTransport(**transport)
        except TypeError as exc:  # only reachable via a programmatic dict
            raise ConfigError(f"rendezvous settings {transport!r} are invalid: {exc}") from exc
    return DistributedConfig(**fields)


def with_env_overrides(
    config: DistributedConfig, env: Mapping[str, str] | None = None
) -> DistributedConfig:
    """``config`` with the ``RENDEZVOUSD_*`` variables in ``env`` (default ``os.environ``)."""
    return _build(
        _merge(_raw_from_config(config), _raw_from_env(os.environ if env is None else env))
    )


def with_cli_overrides(
    config: DistributedConfig, overrides: argparse.Namespace | Mapping[str, object]
) -> DistributedConfig:
    """``config`` with non-None CLI values; unknown dict keys are errors, Namespace extras not."""
    return _build(_merge(_raw_from_config(config), _raw_from_cli(overrides)))


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    cli: argparse.Namespace | Mapping[str, object] | None = None,
    allow_sections: Collection[str] = (),
) -> DistributedConfig:
    """TOML file (optional), then env (default ``os.environ``), then CLI; validated once.

    ``allow_sections`` names other top-level tables the file may carry for other
    readers; any other top-level key is rejected as a likely typo.
    """
    raw: Raw = _raw_from_toml(Path(path), allow_sections) if path is not None else {}
    raw = _merge(raw, _raw_from_env(os.environ if env is None else env))
    if cli is not None:
        raw = _merge(raw, _raw_from_cli(cli))
    return _build(raw)


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the override flags; every default is None so unset flags override nothing."""
    group = parser.add_argument_group("distributed")
    group.add_argument("--backend", choices=BACKENDS, default=None)
    group.add_argument("--world-size", type=int, default=None, help="single-node only")
    group.add_argument("--rank", type=int, default=None)
    group.add_argument("--num-nodes", type=int, default=None)
    group.add_argument("--node-rank", default=None, help=f"integer or '{AUTO}'")
    group.add_argument("--gpus-per-node", type=int, default=None)
    group.add_argument("--endpoint", default=None, help="rendezvous daemon host:port")
    group.add_argument("--token-file", default=None)
    group.add_argument("--rendezvous-path", default=None, help="file transport directory")
    group.add_argument("--retry-attempts", type=int, default=None)
    group.add_argument("--bucket-cap-mib", type=float, default=None)
    group.add_argument("--first-bucket-mib", type=float, default=None)
    group.add_argument("--join-timeout-s", type=float, default=None)
    group.add_argument("--collective-timeout-s", type=float, default=None)
    group.add_argument("--heartbeat-interval-s", type=float, default=None)
    group.add_argument(
        "--no-cpu-shared-memory",
        dest="cpu_shared_memory",
        action="store_const",
        const=False,
        default=None,
        help="keep the cpu backend on its TCP ring even when all ranks share a host",
    )
