"""The daemon's settings: one frozen object that TOML, env vars and flags map onto.

Precedence: defaults < ``--config`` TOML file < ``RENDEZVOUSD_<NAME>`` env vars
< command-line flags. Every field is a flag ``--name-with-dashes``, an env var
``RENDEZVOUSD_NAME`` and a TOML key ``name``; ``deploy/`` files are tested to
use only these.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rendezvousd.common.address import AddressError, is_loopback, parse_address
from rendezvousd.common.limits import MIB, Limits, Timing
from rendezvousd.common.pem import bundle_problem, pair_problem
from rendezvousd.common.settings import (
    INT32_MAX,
    AddressText,
    Bool,
    Choice,
    Float,
    Int,
    OptionalPath,
    Schema,
    setting,
    validate,
)
from rendezvousd.common.validation import LONGEST_WAIT_S
from rendezvousd.errors import ConfigError

ENV_PREFIX = "RENDEZVOUSD_"
DEFAULT_PORT = 29420
# Every other duration is capped as the SDK's and the trainer's waits are (30 days): a
# typo such as 1e30 is refused when read rather than served as "never".
_SECONDS = Float(maximum=LONGEST_WAIT_S)
_SECONDS_OR_0 = Float(positive=False, maximum=LONGEST_WAIT_S)
_COUNT = Int(minimum=1)
# gRPC takes its channel arguments as C ints: a setting that becomes one (in ms, or
# in bytes) is bounded so that it fits, refused when read rather than crashing serve
# with an OverflowError. 24 days in ms, plus the keepalive ping's 5 s, fits.
MAX_GRPC_SECONDS = 24 * 24 * 3600
_GRPC_SECONDS = Float(maximum=MAX_GRPC_SECONDS)
_GRPC_COUNT = Int(minimum=1, maximum=INT32_MAX)
# gRPC core aborts the process (a failed CHECK) at INT32_MAX incoming connections.
MAX_CONNECTIONS = INT32_MAX - 1
# gRPC's receive limit is room for a KvCompareAndSet of two values (Limits.request_bytes).
MAX_VALUE_BYTES = 512 * MIB
_DEFAULT_WAIT_S = Timing.default_wait_s
_MAX_VALUE_BYTES = Limits.max_value_bytes


@dataclass(frozen=True)
class DaemonConfig:
    """Validated daemon settings; ``load()`` builds one from defaults, TOML, env and flags."""

    listen: str = setting(
        f"127.0.0.1:{DEFAULT_PORT}",
        "HOST:PORT or unix:PATH to serve on; port 0 picks a free port",
        AddressText("listen", allow_port_zero=True, allow_unix=True),
    )
    token_file: Path | None = setting(
        None,
        "file with the bearer token(s), mode 0600 (without it: the token itself in "
        '$RENDEZVOUSD_TOKEN); read again on SIGHUP ("Rotating the token")',
        OptionalPath(),
    )
    tls_cert: Path | None = setting(
        None,
        'PEM server certificate (enables TLS); read again on SIGHUP ("Renewing the certificate")',
        OptionalPath(),
    )
    tls_key: Path | None = setting(None, "PEM private key for --tls-cert", OptionalPath())
    tls_client_ca: Path | None = setting(
        None, "PEM CA bundle; clients must present a certificate it signed (mTLS)", OptionalPath()
    )
    insecure_plaintext: bool = setting(False, "allow plaintext on a non-loopback address", Bool())
    reflection: bool = setting(True, "serve gRPC reflection (behind the token)", Bool())
    metrics_listen: str | None = setting(
        None,
        "HOST:PORT for the Prometheus /metrics endpoint and the status page (/)",
        AddressText("metrics_listen", optional=True, allow_port_zero=True),
    )
    insecure_metrics: bool = setting(
        False,
        "allow --metrics-listen (/metrics, the status page) on a non-loopback address "
        "without --tls-cert",
        Bool(),
    )
    state_dir: Path | None = setting(
        None, "directory where job state survives restarts", OptionalPath()
    )
    heartbeat_timeout_s: float = setting(
        Timing.heartbeat_timeout_s,
        f"silence after which a member is lost (at most {MAX_GRPC_SECONDS} s, 24 days: "
        "it sets gRPC's keepalive timeout, in ms)",
        _GRPC_SECONDS,
    )
    default_wait_s: float = setting(
        Timing.default_wait_s,
        "wait for Join/Barrier/KvGet when the call names none (set above max_wait_s: refused)",
        _SECONDS,
    )
    max_wait_s: float = setting(
        Timing.max_wait_s,
        "the longest any Join/JoinNode/PublishId/Barrier/KvGet waits, whatever it asks "
        "(and rank 0 may owe the id)",
        _SECONDS,
    )
    job_ttl_s: float = setting(
        Timing.job_ttl_s,
        "how long ended or failed jobs stay visible (less when a new job needs the slot "
        "at max_jobs)",
        _SECONDS,
    )
    last_call_s: float = setting(
        Timing.default_last_call_s,
        "node joins (JoinNode) naming none: once min_nodes joined, wait this long after the "
        "last arrival for more",
        _SECONDS,
    )
    seat_hold_s: float = setting(
        Timing.seat_hold_s,
        "after a node generation fails: how long the next one keeps a seat for each node "
        "expected back, which a newcomer cannot take (0: --heartbeat-timeout-s)",
        _SECONDS_OR_0,
    )
    drain_grace_s: float = setting(
        10.0, "how long SIGTERM waits for calls to finish", _SECONDS_OR_0
    )
    max_jobs: int = setting(
        Limits.max_jobs,
        "live jobs (forming with a joiner present, or running) held at once; at the limit, "
        "a new job takes the slot of the oldest finished (or empty forming) job, which is "
        "forgotten early",
        _COUNT,
    )
    max_members_per_job: int = setting(Limits.max_members_per_job, "largest world size", _COUNT)
    max_concurrent_rpcs: int = setting(
        Limits.max_concurrent_rpcs,
        f"calls in flight, streams included (at most {INT32_MAX}: gRPC's pending-call cap "
        "derives from it)",
        _GRPC_COUNT,
    )
    max_concurrent_streams: int = setting(
        # The SDK opens a connection per client, each with a handful of calls. Also
        # the peak of a flood: calls refused for want of a token still cost ~20 KiB
        # each until Python gets to them (50,000 from 5 sockets: +29 MiB at 256,
        # +99 MiB at 1024).
        256,
        "HTTP/2 streams one connection may have open (SETTINGS_MAX_CONCURRENT_STREAMS); "
        f"more are refused before any handler or token check runs (~20 KiB each; at most "
        f"{INT32_MAX})",
        _GRPC_COUNT,
    )
    max_connections: int = setting(
        16384,
        "client connections held at once, all peers together (gRPC has no per-peer cap; "
        f"at most {MAX_CONNECTIONS})",
        Int(minimum=1, maximum=MAX_CONNECTIONS),
    )
    connection_idle_s: float = setting(
        300.0,
        "a connection with no call open is closed after this long (clients reconnect on "
        f"their next call; a heartbeat stream is an open call); at most {MAX_GRPC_SECONDS} s "
        "(24 days: gRPC takes it in ms)",
        _GRPC_SECONDS,
    )
    request_body_timeout_s: float = setting(
        5.0,
        "a token-less (health) call whose request message has not arrived this long after "
        "its headers ends",
        _SECONDS,
    )
    max_waiters: int = setting(
        Limits.max_waiters, "parked Join/Barrier/KvGet calls (~26 KiB each)", _COUNT
    )
    max_waiters_per_job: int = setting(
        Limits.max_waiters_per_job,
        "parked calls one job's members may hold (so one job cannot block the others' "
        "joins); its standby and scale-up joins parked for a later generation have half "
        "as many of their own",
        _COUNT,
    )
    max_barriers_per_job: int = setting(
        Limits.max_barriers_per_job, "barrier names per job generation", _COUNT
    )
    max_keys_per_job: int = setting(Limits.max_keys_per_job, "key-value keys per job", _COUNT)
    max_value_bytes: int = setting(
        Limits.max_value_bytes,
        f"largest key-value value (at most {MAX_VALUE_BYTES}, 512 MiB: gRPC's request size "
        "limit, room for two, is a C int; set above what one job may hold: refused)",
        Int(minimum=1, maximum=MAX_VALUE_BYTES),
    )
    max_kv_bytes: int = setting(
        Limits.max_kv_bytes, "key-value bytes (keys + values) held across all jobs", _COUNT
    )
    max_kv_bytes_per_job: int = setting(
        Limits.max_kv_bytes_per_job,
        "key-value bytes one job may hold (at most half of max_kv_bytes: set above it, "
        "refused at start; the default is capped at it; the last eighth of max_kv_bytes "
        "is kept for jobs holding less than an eighth)",
        _COUNT,
    )
    event_loop: str = setting(
        "asyncio",
        "the event loop the daemon runs on: asyncio's own, or uvloop (the uvloop extra; at "
        "a85618b no clear gain per stream call, ~55 % less CPU per heartbeat, a slower "
        "cold join storm: docs/operations.md)",
        Choice(("asyncio", "uvloop")),
    )
    log_level: str = setting(
        "INFO",
        "DEBUG, INFO, WARNING or ERROR",
        Choice(("DEBUG", "INFO", "WARNING", "ERROR"), upper=True),
    )

    def __post_init__(self) -> None:
        validate(self, ConfigError)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError(
                "tls_cert and tls_key go together: give both or neither",
                keys=("tls_cert", "tls_key"),
            )
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ConfigError(
                "tls_client_ca (mTLS) needs tls_cert and tls_key", keys=("tls_client_ca",)
            )
        tls = self.tls_cert is not None
        if _plaintext_off_host(self.listen, tls, allowed=self.insecure_plaintext):
            raise ConfigError(
                f"refusing to serve plaintext on non-loopback address {self.listen!r}: "
                "pass --tls-cert/--tls-key, or --insecure-plaintext if the network is trusted",
                keys=("listen", "insecure_plaintext"),
            )
        if _plaintext_off_host(self.metrics_listen, tls, allowed=self.insecure_metrics):
            raise ConfigError(
                f"refusing to serve /metrics in plaintext on non-loopback address "
                f"{self.metrics_listen!r} (it names jobs' states to anyone who connects): "
                "listen on 127.0.0.1 and scrape through a sidecar, pass --tls-cert/--tls-key, "
                "or --insecure-metrics if a network policy limits who can reach it",
                keys=("metrics_listen", "insecure_metrics"),
            )

        self._check_contradictions()

    def _check_contradictions(self) -> None:
        """Refuses settings that contradict each other, one never reachable under the
        other. Only a value set (off its default) is refused: lowering one bound alone
        (--max-wait-s 60, a small --max-kv-bytes) keeps the other's default capped by it,
        as documented, and running configurations keep starting; but --max-wait-s 60
        --default-wait-s 120 says two things at once (a review: only a value raised
        above its default was refused)."""
        if self.default_wait_s > self.max_wait_s and self.default_wait_s != _DEFAULT_WAIT_S:
            raise ConfigError(
                f"default_wait_s={self.default_wait_s:g} is above max_wait_s="
                f"{self.max_wait_s:g}: a call naming no wait would still be cut to "
                "max_wait_s; lower default_wait_s to at most max_wait_s, or raise max_wait_s",
                keys=("default_wait_s", "max_wait_s"),
            )
        if (
            self.max_waiters_per_job > self.max_waiters
            and self.max_waiters_per_job != Limits.max_waiters_per_job
        ):
            raise ConfigError(
                f"max_waiters_per_job={self.max_waiters_per_job} is above max_waiters="
                f"{self.max_waiters}: no job could ever park that many calls, since all "
                "jobs together park at most max_waiters; lower max_waiters_per_job to at "
                "most max_waiters, or raise max_waiters",
                keys=("max_waiters_per_job", "max_waiters"),
            )
        half = self.max_kv_bytes // 2
        if (
            self.max_kv_bytes_per_job > half
            and self.max_kv_bytes_per_job != Limits.max_kv_bytes_per_job
        ):
            # Was taken and silently cut to half at each KV write (an audit): the
            # operator learnt of it only from a job refused below the value set.
            raise ConfigError(
                f"max_kv_bytes_per_job={self.max_kv_bytes_per_job} is above half of "
                f"max_kv_bytes={self.max_kv_bytes} ({half}), all one job may hold: lower "
                f"max_kv_bytes_per_job to at most {half}, or raise max_kv_bytes to at "
                f"least {2 * self.max_kv_bytes_per_job}",
                keys=("max_kv_bytes_per_job", "max_kv_bytes"),
            )
        per_job = self.limits().kv_bytes_per_job
        if self.max_value_bytes > per_job and self.max_value_bytes != _MAX_VALUE_BYTES:
            if per_job == self.max_kv_bytes_per_job:
                cap, keys = f"max_kv_bytes_per_job={per_job}", ("max_kv_bytes_per_job",)
            else:
                cap = f"{per_job}, half of max_kv_bytes={self.max_kv_bytes}"
                keys = ("max_kv_bytes",)
            raise ConfigError(
                f"max_value_bytes={self.max_value_bytes} is above what one job may hold "
                f"({cap}): no value that large could ever be stored; lower max_value_bytes "
                f"or raise {keys[0]}",
                keys=("max_value_bytes", *keys),
            )

    def limits(self) -> Limits:
        """``Limits`` with the configured fields; those without a setting keep their default."""
        settable = {f.name for f in dataclasses.fields(Limits)} & FIELDS.keys()
        return dataclasses.replace(Limits(), **{name: getattr(self, name) for name in settable})

    def timing(self) -> Timing:
        return Timing(
            self.heartbeat_timeout_s,
            self.default_wait_s,
            self.job_ttl_s,
            self.last_call_s,
            self.max_wait_s,
            self.seat_hold_s,
        )


def check_tls_pair(cert: Path, key: Path) -> None:
    """Refuses a certificate and key that do not belong together, saying so."""
    problem = pair_problem(cert, key)
    if problem is not None:
        raise ConfigError(problem)


def check_client_ca(ca: Path) -> None:
    """Refuses a ``--tls-client-ca`` holding no PEM certificate, naming the file."""
    why = bundle_problem(ca)
    if why is not None:
        raise ConfigError(
            f"TLS client CA {ca} (--tls-client-ca) is not a PEM certificate bundle{why}: give "
            "the CA certificate that signed the clients' certificates, in PEM "
            "(-----BEGIN CERTIFICATE-----; convert DER with openssl x509 -inform der)"
        )


def _plaintext_off_host(listen: str | None, tls: bool, *, allowed: bool) -> bool:
    """Whether serving on ``listen`` would send plaintext beyond this host unasked."""
    if listen is None or tls or allowed:
        return False
    host, _ = split_listen(listen)
    return host is not None and not is_loopback(host)


def split_listen(listen: str) -> tuple[str | None, int]:
    """(host, port) of a listen address; host None for unix sockets."""
    try:
        address = parse_address(listen, what="listen", allow_port_zero=True, allow_unix=True)
    except AddressError as exc:
        raise ConfigError(str(exc)) from None
    return address.host, address.port


SCHEMA = Schema(DaemonConfig, ConfigError, env_prefix=ENV_PREFIX)
FIELDS = {f.name: f for f in dataclasses.fields(DaemonConfig)}


#: Variables that rendezvous-run (trainer/config.py) reads too, under another rule: a
#: value right for the launcher, set where both start, refuses the daemon. Its refusal
#: says so; docs/operations.md lists them above the settings table.
SHARED_WITH_THE_TRAINER = {
    f"{ENV_PREFIX}LAST_CALL_S": (
        "rendezvous-run reads this variable too, where 0 means the daemon's default: "
        "set it for the launcher only, not in the daemon's environment, or to seconds "
        "> 0 that both take"
    ),
}


def load(
    config_file: Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> DaemonConfig:
    """Defaults < TOML file < ``RENDEZVOUSD_*`` env < ``overrides`` (flags; None = unset)."""
    from_toml = SCHEMA.from_toml(config_file) if config_file is not None else {}
    try:
        from_env = SCHEMA.from_env(os.environ if env is None else env)
    except ConfigError as exc:
        note = next(
            (n for name, n in SHARED_WITH_THE_TRAINER.items() if str(exc).startswith(f"${name}=")),
            None,
        )
        if note is None:
            raise
        raise ConfigError(f"{exc}; {note}") from None
    layers = [from_toml, from_env, SCHEMA.from_cli(argparse.Namespace(**(overrides or {})))]
    return SCHEMA.build(layers)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field; unset flags stay None so env and TOML can apply."""
    parser.add_argument("--config", type=Path, help="TOML file with any of the settings below")
    SCHEMA.add_arguments(parser)


if __name__ == "__main__":
    # The settings table in docs/operations.md (a test compares the two).
    sys.stdout.write(SCHEMA.markdown_table())
