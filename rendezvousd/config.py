"""The daemon's settings: one frozen object that TOML, env vars and flags map onto.

Precedence: defaults < ``--config`` TOML file < ``RENDEZVOUSD_<NAME>`` env vars
< command-line flags. Every field is a flag ``--name-with-dashes``, an env var
``RENDEZVOUSD_NAME`` and a TOML key ``name``; ``deploy/`` files are tested to
use only these.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rendezvousd.errors import ConfigError
from rendezvousd.limits import Limits, Timing

ENV_PREFIX = "RENDEZVOUSD_"
DEFAULT_PORT = 29420


def _opt(help: str, default: Any) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class DaemonConfig:
    """Validated daemon settings; ``load()`` builds one from defaults, TOML, env and flags."""

    listen: str = _opt(
        "HOST:PORT or unix:PATH to serve on; port 0 picks a free port",
        default=f"127.0.0.1:{DEFAULT_PORT}",
    )
    token_file: Path | None = _opt("file with the bearer token(s), mode 0600", default=None)
    tls_cert: Path | None = _opt("PEM server certificate (enables TLS)", default=None)
    tls_key: Path | None = _opt("PEM private key for --tls-cert", default=None)
    tls_client_ca: Path | None = _opt(
        "PEM CA bundle; clients must present a certificate it signed (mTLS)", default=None
    )
    insecure_plaintext: bool = _opt("allow plaintext on a non-loopback address", default=False)
    reflection: bool = _opt("serve gRPC reflection (behind the token)", default=True)
    metrics_listen: str | None = _opt(
        "HOST:PORT for the Prometheus /metrics endpoint", default=None
    )
    state_dir: Path | None = _opt("directory where job state survives restarts", default=None)
    heartbeat_timeout_s: float = _opt(
        "silence after which a member is lost", default=Timing.heartbeat_timeout_s
    )
    default_wait_s: float = _opt(
        "wait for Join/Barrier/KvGet when the call names none", default=Timing.default_wait_s
    )
    job_ttl_s: float = _opt("how long ended or failed jobs stay visible", default=Timing.job_ttl_s)
    drain_grace_s: float = _opt("how long SIGTERM waits for calls to finish", default=10.0)
    max_jobs: int = _opt("jobs held at once", default=Limits.max_jobs)
    max_members_per_job: int = _opt("largest world size", default=Limits.max_members_per_job)
    max_concurrent_rpcs: int = _opt(
        "calls in flight, streams included", default=Limits.max_concurrent_rpcs
    )
    max_waiters: int = _opt("parked Join/Barrier/KvGet calls", default=Limits.max_waiters)
    max_keys_per_job: int = _opt("key-value keys per job", default=Limits.max_keys_per_job)
    max_value_bytes: int = _opt("largest key-value value", default=Limits.max_value_bytes)
    log_level: str = _opt("DEBUG, INFO, WARNING or ERROR", default="INFO")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in ("float", "int") and value <= 0 and f.name != "drain_grace_s":
                raise ConfigError(f"{f.name}={value!r} must be positive")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"log_level={self.log_level!r} must be DEBUG, INFO, WARNING or ERROR")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("tls_cert and tls_key go together: give both or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ConfigError("tls_client_ca (mTLS) needs tls_cert and tls_key")
        host, _ = split_listen(self.listen)
        if (
            host is not None
            and not is_loopback(host)
            and self.tls_cert is None
            and not self.insecure_plaintext
        ):
            raise ConfigError(
                f"refusing to serve plaintext on non-loopback address {self.listen!r}: "
                "pass --tls-cert/--tls-key, or --insecure-plaintext if the network is trusted"
            )

    def limits(self) -> Limits:
        return dataclasses.replace(
            Limits(),
            max_jobs=self.max_jobs,
            max_members_per_job=self.max_members_per_job,
            max_concurrent_rpcs=self.max_concurrent_rpcs,
            max_waiters=self.max_waiters,
            max_keys_per_job=self.max_keys_per_job,
            max_value_bytes=self.max_value_bytes,
        )

    def timing(self) -> Timing:
        return Timing(self.heartbeat_timeout_s, self.default_wait_s, self.job_ttl_s)


def split_listen(listen: str) -> tuple[str | None, int]:
    """(host, port) of a listen address; host None for unix sockets."""
    if listen.startswith("unix:"):
        return None, 0
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ConfigError(f"listen address {listen!r} must be HOST:PORT, [IPv6]:PORT or unix:PATH")
    if not 0 <= int(port) <= 65535:
        raise ConfigError(f"listen port {port} is out of range 0..65535")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


FIELDS = {f.name: f for f in dataclasses.fields(DaemonConfig)}


def _coerce(name: str, raw: Any, origin: str) -> Any:
    kind = FIELDS[name].type
    try:
        if kind == "bool":
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if kind == "int":
            if isinstance(raw, bool):
                raise ValueError(raw)
            return int(raw)
        if kind == "float":
            if isinstance(raw, bool):
                raise ValueError(raw)
            return float(raw)
        if kind == "Path | None":
            return Path(raw) if raw not in (None, "") else None
        return None if raw is None else str(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{origin}: {raw!r} is not a valid {kind} for {name}") from None


def load(
    config_file: Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> DaemonConfig:
    values: dict[str, Any] = {}
    if config_file is not None:
        try:
            data = tomllib.loads(config_file.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {config_file}: {exc}") from exc
        for key, raw in data.items():
            if key not in FIELDS:
                raise ConfigError(f"config file {config_file}: unknown setting {key!r}")
            values[key] = _coerce(key, raw, f"config file {config_file}")
    environ = os.environ if env is None else env
    for name in FIELDS:
        var = ENV_PREFIX + name.upper()
        if var in environ:
            values[name] = _coerce(name, environ[var], f"${var}")
    for name, raw in (overrides or {}).items():
        if raw is not None:
            values[name] = _coerce(name, raw, f"--{name.replace('_', '-')}")
    return DaemonConfig(**values)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field; unset flags stay None so env and TOML can apply."""
    parser.add_argument("--config", type=Path, help="TOML file with any of the settings below")
    for name, f in FIELDS.items():
        flag = "--" + name.replace("_", "-")
        env = ENV_PREFIX + name.upper()
        if f.type == "bool":
            parser.add_argument(
                flag,
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=f"{f.metadata['help']} (env {env})",
            )
        else:
            parser.add_argument(
                flag, dest=name, default=None, help=f"{f.metadata['help']} (env {env})"
            )
