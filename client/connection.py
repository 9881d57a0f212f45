"""How the SDK reaches the daemon: retry policy, TLS, token and gRPC channel options."""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import random
import resource  # loaded up front: at the limit, importing it needs a descriptor
import socket
import ssl
import stat
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client.errors import InvalidRequest
from rendezvousd.common.address import Address, AddressError, parse_address
from rendezvousd.common.pem import (
    bundle_problem,
    file_validity,
    pair_problem,
    validity,
    window_text,
)
from rendezvousd.common.secret_files import (
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    read_judged,
    unreadable_token_file,
)

__all__ = [
    "HEALTH_SERVICE",
    "SERVICE",
    "TOKEN_ENV",
    "TOKEN_FILE_ENV",
    "RetryPolicy",
    "TlsConfig",
    "TlsFiles",
    "channel_options",
    "resolve_token",
    "service_config",
]

log = logging.getLogger("rendezvousd.client")

SERVICE = "rendezvous.v1.Rendezvous"
HEALTH_SERVICE = "grpc.health.v1.Health"

# Safe to repeat: Join/PublishId by instance id, Barrier by sequence, sets overwrite.
# Not KvDelete: repeated after its answer was lost, it answers deleted=False for the
# key it deleted.
IDEMPOTENT = frozenset(
    {
        "Join",
        "JoinNode",
        "ReportFailure",
        "GetMembers",
        "PublishId",
        "Barrier",
        "KvSet",
        "KvGet",
        "Heartbeat",
        "Leave",
        "AbortJob",
        "ListJobs",
        "GetJob",
        "Check",
    }
)
# Reads may also be retried after DEADLINE_EXCEEDED (gRFC A6 leaves this to the caller).
READS = frozenset({"KvGet", "ListJobs", "GetJob", "GetMembers", "Check"})


@dataclass(frozen=True)
class RetryPolicy:
    """The seed's policy: ``attempts`` retries on a transient error, then a loud error.

    Transient = UNAVAILABLE for idempotent methods, plus DEADLINE_EXCEEDED for
    reads. Permanent errors (bad input, auth, peer failure...) get one attempt.
    Under each attempt gRPC's own service-config retry re-sends on UNAVAILABLE.
    """

    attempts: int = 1
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 2.0

    def __post_init__(self) -> None:
        if self.attempts < 0:
            raise ValueError(f"retry attempts={self.attempts} must be >= 0")

    def retryable(self, method: str, code: grpc.StatusCode) -> bool:
        if code is grpc.StatusCode.UNAVAILABLE:
            return method in IDEMPOTENT
        return code is grpc.StatusCode.DEADLINE_EXCEEDED and method in READS

    def backoff(self, attempt: int) -> float:
        """Full-jitter exponential backoff before retry number ``attempt`` (1-based)."""
        cap = min(self.max_backoff_s, self.initial_backoff_s * 2 ** (attempt - 1))
        return random.uniform(cap / 2, cap)


def service_config(channel_retries: int) -> str:
    """gRPC's service config for a client of ``channel_retries`` retries. Made once per
    distinct attempt count, then shared (a str: immutable): encoded per client, it was
    ~20 µs of every cold client's construction (docs/benchmarks.md, session 36)."""
    return _service_config(max(2, min(5, channel_retries + 1)))


#: Not idempotent (or a stream): they wait for the daemon, but are never re-sent.
WAIT_ONLY = ("KvAdd", "KvCompareAndSet", "KvDelete", "Heartbeat")


@functools.cache  # at most 4 entries: maxAttempts is 2 to 5
def _service_config(max_attempts: int) -> str:
    retry = {
        "maxAttempts": max_attempts,
        "initialBackoff": "0.1s",
        "maxBackoff": "1s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    retried = IDEMPOTENT - {"Check", "Heartbeat"}
    service = pb.DESCRIPTOR.services_by_name[SERVICE.rsplit(".", 1)[1]]
    # Neither waits nor is retried: the call streams (Calls, CallBatches), and any method
    # not named above, as a method no entry names.
    plain = [m.name for m in service.methods if m.name not in retried | set(WAIT_ONLY)]

    def named(methods: Iterable[str]) -> list[dict[str, str]]:
        return [{"service": SERVICE, "method": m} for m in methods]

    # The retried methods' config is the whole service's, and only the others are named
    # (gRPC takes a method's own entry over its service's): each channel's core parses
    # this, ~2.5 µs a name, when it is made (13 names were ~50 µs of a cold client's).
    configs: list[dict[str, Any]] = [
        {
            "name": [{"service": SERVICE}, {"service": HEALTH_SERVICE}],
            "waitForReady": True,
            "retryPolicy": retry,
        },
        {"name": named(WAIT_ONLY), "waitForReady": True},
    ]
    if plain:
        configs.append({"name": named(plain)})
    return json.dumps({"methodConfig": configs})


@dataclass(frozen=True)
class TlsConfig:
    """PEM paths (a str or a Path): ``ca`` verifies the daemon; ``cert``/``key`` for mTLS."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        for name in ("ca", "cert", "key"):
            value = getattr(self, name)
            if isinstance(value, str | os.PathLike) and not isinstance(value, Path):
                # A str path, as from_paths and the settings take them: the reads need
                # a Path (a str raised a bare AttributeError when the client was made).
                object.__setattr__(self, name, Path(value))
            elif value is not None and not isinstance(value, Path):
                raise InvalidRequest(
                    f"TlsConfig({name}={value!r}): give the path of a PEM file (a str or "
                    "a Path), or None"
                )
        if self.server_name is not None and not isinstance(self.server_name, str):
            raise InvalidRequest(
                f"TlsConfig(server_name={self.server_name!r}): give the host name the "
                "daemon's certificate names (a str), or None"
            )
        # Refused here: given half of the pair, gRPC's core aborts the whole process
        # (SIGABRT, "Check failed: private_key != nullptr") at the first connect.
        if (self.cert is None) != (self.key is None):
            given, missing = ("cert", "key") if self.key is None else ("key", "cert")
            raise InvalidRequest(
                f"TlsConfig({given}={getattr(self, given)}) without {missing}=: a client "
                "certificate and its key go together (mutual TLS needs both); give both, "
                "or neither for TLS without a client certificate"
            )

    @classmethod
    def from_paths(
        cls,
        ca: str | None,
        cert: str | None = None,
        key: str | None = None,
        server_name: str | None = None,
    ) -> TlsConfig | None:
        """From settings that hold paths as text (``tls_ca``...): None without a CA.
        Every check the flags need is here (``rendezvousd health``/``status`` rely on
        it): a client certificate or key without a CA, then half a key pair."""
        if ca is None:
            if cert or key:  # else the connection would go out in plaintext, silently
                given = f"cert={cert}" if cert else f"key={key}"
                raise InvalidRequest(
                    f"TlsConfig.from_paths({given}) without ca=: a client certificate or "
                    "key needs ca=, the CA that signed the daemon's certificate, or the "
                    "client speaks plaintext"
                )
            return None
        return cls(
            ca=Path(ca),
            cert=Path(cert) if cert else None,
            key=Path(key) if key else None,
            server_name=server_name,
        )

    def credentials(self) -> grpc.ChannelCredentials:
        """The channel's credentials, or ``InvalidRequest`` naming the file that cannot
        work: gRPC itself would only fail every connect, and the client would wait out
        its connect deadline and then blame the network."""

        def read(path: Path | None, what: str) -> bytes | None:
            if path is None:
                return None
            try:
                return read_judged(path, _not_regular(path, f"TLS {what}", "the PEM file itself"))
            except OSError as exc:
                raise InvalidRequest(f"cannot read TLS {what} {path}: {exc.strerror}") from None

        ca = read(self.ca, "CA")
        if self.ca is not None and (why := bundle_problem(self.ca)) is not None:
            raise InvalidRequest(
                f"TLS CA {self.ca} is not a PEM certificate bundle{why}: give the CA "
                "certificate that signed the daemon's certificate, in PEM "
                "(-----BEGIN CERTIFICATE-----; convert DER with openssl x509 -inform der)"
            )
        key: bytes | None = None
        cert: bytes | None = None
        if self.key is not None and self.cert is not None:
            try:
                key = _read_private(self.key, _CLIENT_KEY)
            except OSError as exc:
                raise InvalidRequest(
                    f"cannot read TLS private key {self.key}: {exc.strerror}"
                ) from None
            except InvalidRequest:
                # A certificate given as the key is refused for its mode first (0644,
                # as certificates are): blamed on the mode, when the fix is the order.
                if (swapped := _swapped(self.cert, self.key, _peek(self.key))) is not None:
                    raise InvalidRequest(swapped) from None
                raise
            cert = read(self.cert, "certificate")
            if (swapped := _swapped(self.cert, self.key, key)) is not None:
                raise InvalidRequest(swapped)
            if (problem := pair_problem(self.cert, self.key)) is not None:
                raise InvalidRequest(problem)
        return grpc.ssl_channel_credentials(ca, key, cert)


#: A file's identity as the renewal check compares it: a file moved into place whole
#: (cert-manager, the SPIFFE helper, certbot's symlink swap) is another inode, one
#: written in place another mtime or size; None for a file not there (mid-swap).
FileStamp = tuple[int, int, int] | None


class TlsFiles:
    """A client's TLS files as they were when its channel was made, and whether they
    were renewed since: gRPC Python reads a client's certificate once, into the
    channel (it has no dynamic client credentials, grpc/grpc#41779), so a channel
    made before a renewal shows the old certificate at every new connection, and
    once that one expired, every reconnect's handshake fails although a valid one
    sits in the file. Shared by a client's twins through the call core, which asks
    ``renewed`` where a connection failed; the driver then makes its channel anew.
    Safe from several threads (the heartbeat's, the caller's)."""

    def __init__(self, tls: TlsConfig) -> None:
        self.tls = tls
        self._lock = threading.Lock()
        # Taken as the client is made, before its channel reads the files: a change
        # between the two reads as a change at the next check, which reads them again.
        # Only a renewal moves it: a channel of the client's own (``_tables``) made
        # later from newer files does not stand for the client's channel.
        self._made = self.stamp()
        # The files' stamp that last failed to load: said once, tried again only once
        # they change again (a renewal caught half-written is finished by a later write).
        self._refused: tuple[FileStamp, ...] | None = None
        #: Renewals taken so far: the generation of the files' latest working pair. Each
        #: channel of the client (its own, its member table's) remembers the one it was
        #: made at and follows a later one, whichever of them noticed the renewal.
        self.renewals = 0
        self._latest: grpc.ChannelCredentials | None = None

    def stamp(self) -> tuple[FileStamp, ...]:
        def one(path: Path | None) -> FileStamp:
            if path is None:
                return None
            try:
                st = os.stat(path)
            except OSError:
                return None
            return (st.st_ino, st.st_mtime_ns, st.st_size)

        return tuple(one(path) for path in (self.tls.ca, self.tls.cert, self.tls.key))

    def changed(self, made: int) -> bool:
        """Whether a channel made at renewal ``made`` is behind: a later renewal taken,
        or the files differ from the last pair taken and from the last that failed to
        load. Three stats, no read (cheap enough for the asyncio client to ask on its
        loop, going to a thread only to read them)."""
        return self.renewals > made or self.stamp() not in (self._made, self._refused)

    def renewed(self, endpoint: str, made: int) -> tuple[int, grpc.ChannelCredentials] | None:
        """For a channel made at renewal ``made``: the renewal to make it anew at and
        its credentials, where the files changed since and load as a working pair (or
        another channel of the client took a later renewal already); else None. A pair
        that does not load (a renewal caught between its certificate and its key) keeps
        the channel: a WARNING says so once per state of the files, naming them (never
        their bytes)."""
        with self._lock:
            now = self.stamp()
            if now not in (self._made, self._refused):
                self._take(endpoint, now)
            if self.renewals <= made or self._latest is None:
                return None
            return self.renewals, self._latest

    def _take(self, endpoint: str, now: tuple[FileStamp, ...]) -> None:
        try:
            made = self.tls.credentials()
        except InvalidRequest as exc:
            self._refused = now
            log.warning(
                "the TLS files of this client of rendezvousd at %s changed (certificate "
                "%s, key %s, CA %s) but do not work together yet: %s. This client keeps "
                "the certificate it connected with, and reads the files again at its "
                "next reconnect once they change; if they stay so, write the "
                "certificate and its key again, each moved into place whole",
                endpoint,
                self.tls.cert,
                self.tls.key,
                self.tls.ca,
                exc,
            )
            return
        self._made, self._refused, self._latest = now, None, made
        self.renewals += 1
        log.info(
            "the TLS files of this client of rendezvousd at %s were renewed (certificate "
            "%s): its next connection shows them",
            endpoint,
            self.tls.cert,
        )


_PEM_CERTIFICATE = b"-----BEGIN CERTIFICATE-----"
_PEM_PRIVATE_KEY = b"PRIVATE KEY-----"  # PKCS#8, RSA, EC and ENCRYPTED keys alike


def _swapped(cert: Path, key: Path, key_pem: bytes | None) -> str | None:
    """Why ``cert`` and ``key`` look given the wrong way round (the key file holds a
    certificate and no private key), or None. Names the files, never their bytes."""
    if key_pem is None or _PEM_CERTIFICATE not in key_pem or _PEM_PRIVATE_KEY in key_pem:
        return None
    cert_pem = _peek(cert)
    also = (
        f", and the certificate {cert} holds a private key"
        if cert_pem is not None and _PEM_PRIVATE_KEY in cert_pem
        else ""
    )
    # In the SDK's words, which each caller with flags of its own says in its own
    # (``TLS_WORDS``): "cert= (--tls-cert)" named a flag to an SDK user, and a keyword
    # to the user of a command.
    return (
        f"TLS private key {key} holds a certificate and no private key{also}: the two look "
        f"swapped; {TLS_SWAP_ADVICE}"
    )


def _peek(path: Path) -> bytes | None:
    """The head of ``path`` if it is a regular file that can be read, else None (its
    own read, or the caller's, says why)."""
    try:
        return read_judged(path, _not_regular(path, "file", "a file"), limit=1 << 20)
    except (OSError, InvalidRequest):
        return None


#: What a client given no token is told to do (torchrun's handler says it in its words).
NO_TOKEN_ADVICE = f"pass token= or token_file=, or set ${TOKEN_ENV} / ${TOKEN_FILE_ENV}"
#: Set in each worker rendezvous-run starts (``rendezvousd.trainer.agent._agent_boot``
#: owns the name; the SDK imports nothing of the trainer's).
AGENT_FD_ENV = "RENDEZVOUSD_AGENT_FD"
#: The same advice to a worker of rendezvous-run: the launcher leaves $RENDEZVOUSD_TOKEN
#: out of its workers' environment, so "set $RENDEZVOUSD_TOKEN" could never work there.
AGENT_NO_TOKEN_ADVICE = (
    "this process is a worker of rendezvous-run, which puts no token in its workers' "
    "environment: use the worker's own client, ctx.rendezvous (from init_distributed()), "
    f"or give the launcher --token-file, whose path reaches its workers as "
    f"${TOKEN_FILE_ENV}; or pass token= or token_file="
)


def resolve_token(token: str | None, token_file: Path | str | None) -> str:
    if token:
        return _sendable(token.strip(), "token=")
    path = token_file or os.environ.get(TOKEN_FILE_ENV)
    if path:
        try:
            lines = [
                ln.strip()
                for ln in _read_private(Path(path), _TOKEN).decode().splitlines()
                if ln.strip()
            ]
        except OSError as exc:
            # Named by where it came from: a variable set long ago, in another file,
            # is what the user must find.
            origin = "" if token_file else f" (from ${TOKEN_FILE_ENV})"
            # Not chained: the OSError's own text names the path, maybe a token.
            raise InvalidRequest(unreadable_token_file(path, exc, origin)) from None
        except UnicodeDecodeError:
            raise InvalidRequest(
                f"token file {path} is not text (UTF-8): give the file `rendezvousd token "
                "FILE` wrote"
            ) from None
        if lines:
            return _sendable(lines[0], f"token file {path}")
        raise InvalidRequest(f"token file {path} is empty")
    env = os.environ.get(TOKEN_ENV, "").strip()
    if env:
        return _sendable(env, f"${TOKEN_ENV}")
    under_agent = bool(os.environ.get(AGENT_FD_ENV))
    raise InvalidRequest(
        f"no rendezvous token: {AGENT_NO_TOKEN_ADVICE if under_agent else NO_TOKEN_ADVICE}"
    )


class Bearer:
    """The token a client sends, shared by its session and its call stream, which read
    it at each call or stream they open: re-read from its file when the daemon refuses
    it (``reread``), so that a token rotated by the runbook (add the new token to the
    daemon, write it into the clients' files, remove the old) keeps running jobs alive.
    A holder of its own, not the session: the call stream's reader must not keep the
    client alive. Never in a repr."""

    __slots__ = ("file", "token")

    def __init__(self, token: str, file: Path | str | None) -> None:
        self.token = token
        # The file to re-read, or None: a token given as text (token=, $RENDEZVOUSD_TOKEN)
        # can change only with its process.
        self.file = file

    @classmethod
    def resolve(cls, token: str | None, token_file: Path | str | None) -> Bearer:
        """``resolve_token``'s token, with the file it may change in."""
        file = token_file or (None if token else os.environ.get(TOKEN_FILE_ENV) or None)
        return cls(resolve_token(token, token_file), file)

    def __repr__(self) -> str:
        return f"Bearer(file={self.file!r})"

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),)

    def reread(self) -> bool:
        """After the daemon refused this token: True when its file now holds another
        one, which is sent from now on (the caller tries again once); False when there
        is no file, it cannot be read, or it holds the token refused."""
        if self.file is None:
            return False
        try:
            token = resolve_token(None, self.file)
        except InvalidRequest:
            return False  # the refusal stands, and its message names the file's problem
        if token == self.token:
            return False
        self.token = token
        return True


# What a secret file's mode must not allow: others anything, the group writing. Group
# read stays allowed, unlike the daemon's own secrets (0600 only): a Kubernetes pod
# with fsGroup gets its Secret group-readable whatever defaultMode says
# (kubernetes/kubernetes#57923), and that group is the pod's own.
_SECRET_FORBIDDEN = stat.S_IWGRP | stat.S_IRWXO


@dataclass(frozen=True)
class _Secret:
    """What a secret file is, for its errors."""

    what: str  # "token file"
    leak: str  # what whoever reads it can do
    renew: str  # how to replace one others may have read
    instead: str  # what to give rather than a file that is not regular


_TOKEN = _Secret(
    "token file",
    "holds the token",
    "make a new token with `rendezvousd token`",
    f"the file `rendezvousd token FILE` wrote, or the token itself in ${TOKEN_ENV} (a pipe "
    "is read once: workers started after could not read it)",
)
_CLIENT_KEY = _Secret(
    "TLS private key",
    "can act as this client",
    "issue a new key and certificate",
    "the key file itself",
)


def _read_private(path: Path, secret: _Secret) -> bytes:
    """The bytes of the secret file ``path``, refused if others may read it or anyone
    but its owner may change it, or if it is not a regular file (a FIFO or a device
    would block the read with no deadline)."""

    def judge(info: os.stat_result) -> None:
        if info.st_mode & _SECRET_FORBIDDEN:
            raise InvalidRequest(
                f"{secret.what} {path} can be read or changed by other users (mode "
                f"{stat.filemode(info.st_mode)}): whoever reads it {secret.leak}; run "
                f"'chmod 600 {path}' (0640 if a group must read it) and, if others could "
                f"have read it, {secret.renew}"
            )

    return read_judged(path, _not_regular(path, secret.what, secret.instead), judge)


def _not_regular(path: Path, what: str, instead: str) -> Callable[[str], InvalidRequest]:
    """``read_judged``'s refusal of a file that is not regular (a FIFO would block the
    read with no deadline, a directory says nothing to do)."""
    return lambda mode: InvalidRequest(
        f"{what} {path} is not a regular file ({mode}); give {instead}"
    )


# Words of gRPC's reason for a failed connect that say the TLS handshake was refused
# (the CA, a certificate, the server name: "Hostname Verification Check failed" has
# only the last); the SDK's probe and ``rendezvousd health`` read them alike.
HANDSHAKE_SIGNS = ("handshake", "certificate", "verification")
# BoringSSL's words for a certificate refused for its dates (X509_V_ERR_CERT_NOT_YET_VALID,
# X509_V_ERR_CERT_HAS_EXPIRED): checked against the verifying host's own clock, so a
# clock that is off reads as a bad certificate.
CLOCK_SIGNS = ("not yet valid", "has expired")


def _sendable(token: str, origin: str) -> str:
    """``token``, refused now if no daemon could accept it: gRPC cannot send it in a
    header (every call would fail INTERNAL "Invalid metadata"), or daemons refuse it."""
    if token.isascii() and token.isprintable() and not any(c.isspace() for c in token):
        return token
    raise InvalidRequest(
        f"the token from {origin} has spaces, control or non-ASCII characters (a "
        "byte-order mark, a pasted quote?), which no daemon accepts; give the token as "
        "the one line `rendezvousd token FILE` wrote"
    )


def channel_options(retry: RetryPolicy, server_name: str | None) -> list[tuple[str, object]]:
    options: list[tuple[str, object]] = [
        ("grpc.enable_retries", 1),
        ("grpc.service_config", service_config(retry.attempts)),
        ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        # What ends a connection whose ping goes unanswered (grpcio 1.85: the keepalive
        # timeout above did not; a SIGSTOPped daemon, whose kernel still acknowledges
        # TCP, held a join parked for its whole 600 s). Answered by gRPC core's own
        # thread, not the daemon's busy Python, so load does not trip it.
        ("grpc.http2.ping_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        # Redial quickly once the daemon is back (default backoff grows to 120 s).
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
        # Look the daemon's name up again within a second of a lost connection, not 30
        # s (gRPC's default): a daemon that came back under its name at a new address
        # (a rescheduled pod behind a headless Service, DNS failover) was dialled at
        # the dead one for 30 s, past the 10 s heartbeat window, and every job lost
        # its running generation (h170, namespace hosts; 1.0 s with this).
        ("grpc.dns_min_time_between_resolutions_ms", 1_000),
        # A connection of its own per client: gRPC otherwise shares one between every
        # channel of a process to the same daemon, and the daemon caps the streams a
        # connection may open (--max-concurrent-streams); a process hosting many
        # members (tests, benchmarks) would queue their heartbeat streams behind it.
        ("grpc.use_local_subchannel_pool", 1),
    ]
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    return options


#: Fast probes of a TLS channel before the patient, wait-for-ready health check.
TLS_PROBES = 3
#: The TLS advice of the SDK's refusals, in the SDK's own words: the client takes
#: ``tls=TlsConfig(...)`` and reads no TLS variable. Each caller with flags or settings
#: of its own says them instead (``TLS_WORDS`` lists the phrases it replaces): torchrun's
#: handler (``_in_torchruns_words``), rendezvous-run (``in_launchers_words``) and
#: ``rendezvousd status`` (``_FLAG_WORDS``).
#: What a plaintext client of a TLS daemon is told to pass.
TLS_CA_ADVICE = "pass tls=TlsConfig(ca=PATH)"
#: What a TLS client of a plaintext daemon is told to drop.
TLS_DROP_ADVICE = "connect without TLS (tls=None)"
#: What to check after a failed handshake (a CA that did not sign the daemon's
#: certificate, or a name it does not hold).
TLS_CHECK_ADVICE = (
    "Check TlsConfig's ca (it must have signed the daemon's certificate) and server_name"
)
#: What a client an mTLS daemon turns away must give.
TLS_PAIR_ADVICE = "TlsConfig's cert and key"
#: What a client whose key file holds the certificate (``_swapped``) must give.
TLS_SWAP_ADVICE = (
    "give the client certificate as TlsConfig's cert and its private key as TlsConfig's key"
)
TLS_WORDS = (TLS_CA_ADVICE, TLS_DROP_ADVICE, TLS_CHECK_ADVICE, TLS_PAIR_ADVICE, TLS_SWAP_ADVICE)
TLS_PROBE_TIMEOUT_S = 2.0
#: How long a plaintext client looks for a TLS daemon: one TCP connect, one answer.
TLS_SNIFF_TIMEOUT_S = 2.0
#: The record types a TLS server answers a ClientHello with (RFC 8446 5.1): alert, handshake.
TLS_RECORD_TYPES = frozenset({21, 22})
#: Endpoints a plaintext client of this process found speaking TLS (``TlsProbe``).
_SEEN_TLS: set[str] = set()


class TlsProbe:
    """Tells a TLS mismatch from a daemon that is merely not up yet.

    A waiting (waitForReady) call never reports why it cannot connect, so a wrong
    CA, a missing client certificate or a forgotten CA (plaintext to a TLS daemon)
    would look like "daemon unreachable" after the whole connect timeout, retries
    included. One call that does not wait reports the transport's reason at once:
    a failed handshake is final; a connection the daemon keeps closing right after
    accepting it is how a mutual-TLS daemon refuses a client without an acceptable
    certificate. A plaintext client whose call fails cannot tell a TLS daemon from
    gRPC's reason (the daemon just drops the connection), so it then asks the
    daemon directly (``speaks_tls``). Anything else is left to the patient check.
    """

    def __init__(self, endpoint: str, *, tls: bool, cert: Path | None = None) -> None:
        self.endpoint = endpoint
        self.tls = tls
        # This client's certificate (mTLS): its dates, where a daemon turns it away.
        self.cert = cert
        self.closed = 0

    @property
    def seen_tls(self) -> bool:
        """Whether this plaintext client's daemon was found speaking TLS before."""
        return not self.tls and self.endpoint in _SEEN_TLS

    def known_refusal(self) -> str | None:
        """Before any call, when ``seen_tls``: the mismatch of a daemon this process already found
        speaking TLS to a plaintext client, asked again directly (it may have been
        restarted without TLS). gRPC is not let try: each of its attempts is one more
        "Handshake failed" line in the daemon's log, which would otherwise get one per
        client (the launcher's, its root-cause query's, each restart's)."""
        if speaks_tls(self.endpoint):
            return self._speaks_tls()
        _SEEN_TLS.discard(self.endpoint)
        return None

    @property
    def attempts(self) -> int:
        """Non-waiting calls to make: a plaintext client's first failure is conclusive."""
        return TLS_PROBES if self.tls else 1

    def refusal(self, exc: grpc.RpcError, timeout: float = TLS_SNIFF_TIMEOUT_S) -> str | None:
        """The TLS refusal or mismatch ``exc`` shows, or None to keep going (returns,
        too, when the daemon answered or is simply down). A plaintext client may block
        for up to ``timeout`` here."""
        if not self.tls:
            # DEADLINE_EXCEEDED too: on a starved machine the probe's deadline can pass
            # before gRPC reports the dropped connection, and the patient check would
            # then make gRPC reconnect (one more "Handshake failed" line each time).
            failed = exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            if failed and speaks_tls(self.endpoint, timeout):
                _SEEN_TLS.add(self.endpoint)
                return self._speaks_tls()
            return None
        details = str(exc.details() or "")
        lowered = details.lower()
        if any(w in lowered for w in (*HANDSHAKE_SIGNS, "ssl")):
            reason = details.rsplit("last error: ", 1)[-1]
            if not speaks_tls(self.endpoint, timeout):
                # A plaintext daemon (gRPC: WRONG_VERSION_NUMBER): no CA or server name
                # would help, as the advice below says. `rendezvousd health` asks alike.
                return (
                    f"the daemon at {self.endpoint} does not speak TLS (it serves "
                    f"plaintext): {TLS_DROP_ADVICE}, or serve TLS there (the daemon's "
                    "--tls-cert/--tls-key)"
                )
            if any(sign in lowered for sign in CLOCK_SIGNS):
                # No CA or server name would help: this host's clock or the dates.
                return (
                    f"TLS handshake with rendezvousd at {self.endpoint} failed: {reason}. "
                    f"{daemon_certificate_dates(self.endpoint, timeout)}"
                )
            return (
                f"TLS handshake with rendezvousd at {self.endpoint} failed: {reason}. "
                f"{TLS_CHECK_ADVICE}"
            )
        if "socket closed" in lowered:
            self.closed += 1
            if self.closed >= TLS_PROBES:
                return (
                    f"rendezvousd at {self.endpoint} closes every TLS connection during the "
                    "handshake: it requires a client certificate (mTLS) signed by its "
                    f"--tls-client-ca. Give {TLS_PAIR_ADVICE}, or check that they are "
                    f"signed by that CA{client_certificate_dates(self.cert)}"
                )
        return None

    def _speaks_tls(self) -> str:
        return (
            f"the daemon at {self.endpoint} speaks TLS: {TLS_CA_ADVICE}, the CA that signed "
            "its certificate; this client connected in plaintext"
        )

    @staticmethod
    def again(exc: grpc.RpcError) -> bool:
        """Whether another non-waiting call may tell more: the daemon closed the
        connection (an mTLS refusal shows only as that, repeatedly)."""
        return "socket closed" in str(exc.details() or "").lower()


def _clock_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def daemon_certificate_dates(endpoint: str, timeout: float) -> str:
    """What to do when this host refused the daemon's certificate for its dates: the
    certificate's validity, read from the daemon where it answers (``peer_validity``),
    beside this host's clock."""
    window = peer_validity(endpoint, timeout)
    dates = "" if window is None else f" (the daemon's certificate is valid {window_text(window)})"
    return (
        f"This host checks the daemon's certificate against its own clock: check this "
        f"host's clock (it reads {_clock_now()}){dates}; if the clock is right, the "
        "certificate is expired or not valid yet, and the daemon needs one that is "
        "valid now"
    )


def client_certificate_dates(cert: Path | None) -> str:
    """The dates of this client's certificate ``cert``, for an mTLS daemon that turns
    it away: the daemon checks them against its own clock, whose reading the client
    cannot see (it closes the connection and says nothing). "" without one."""
    window = None if cert is None else file_validity(cert)
    if cert is None or window is None:
        return ""
    now = _clock_now()
    not_before, not_after = window
    if datetime.now(UTC) < not_before or datetime.now(UTC) > not_after:
        return (
            f"; this client's certificate {cert} is valid {window_text(window)}, which "
            f"this host's clock (it reads {now}) is outside of: check this host's clock, "
            "or renew the certificate"
        )
    return (
        f"; if they are, the daemon's host's clock may be outside the certificate's "
        f"validity ({cert} is valid {window_text(window)}; this host's clock reads {now}): "
        "a daemon whose clock is off refuses a good certificate as not yet valid or "
        "expired: check the daemon's host's clock"
    )


def peer_validity(endpoint: str, timeout: float) -> tuple[datetime, datetime] | None:
    """The validity of the certificate the TLS server at ``endpoint`` presents, read
    without verifying it (None where it cannot be had). Nothing of ours is sent."""
    try:
        address = parse_address(endpoint, what="endpoint", allow_unix=True)
    except AddressError:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    try:
        with _dial(address, timeout) as sock:
            sock.settimeout(timeout)
            with context.wrap_socket(sock) as tls:
                der = tls.getpeercert(binary_form=True)
    except OSError:  # ssl.SSLError included: refused, reset, timed out
        return None
    return None if der is None else validity(der)


def _client_hello() -> bytes:
    """The first flight of a TLS client, as the standard library's ssl writes it.

    Only the answer's first record header is read, so nothing is verified: nothing
    secret is sent, and the handshake is never finished.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing)
    with contextlib.suppress(ssl.SSLWantReadError):  # it waits for the ServerHello
        tls.do_handshake()
    return outgoing.read()


def _dial(address: Address, timeout: float) -> socket.socket:
    """A socket connected to ``address`` (TCP or Unix) within ``timeout``; OSError
    (``socket.gaierror`` for a name) when it cannot be."""
    if address.unix_path is None:
        assert address.host is not None
        return socket.create_connection((address.host, address.port), timeout=timeout)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(address.unix_path)
    except OSError:
        sock.close()
        raise
    return sock


#: How long ``dial_problem`` waits for its connection.
DIAL_TIMEOUT_S = 2.0

#: The ``DaemonUnavailable`` metadata key a connect failed for want of this host's own
#: resources carries (its value: ``open_files`` or ``local_ports``), so that a caller
#: that retries an unreachable daemon (the node agent) stops at once instead.
LOCAL_SHORTAGE = "local_shortage"


class LocalShortage(str):
    """What a plain connect found when this process or host, not the daemon, is out
    of something (descriptors, local ports): waiting out connect_timeout, or a node
    agent's retries, fixes nothing, and "check that it runs" pointed away from it."""

    kind: str

    def __new__(cls, text: str, kind: str) -> LocalShortage:
        made = super().__new__(cls, text)
        made.kind = kind
        return made


def _shortage(exc: OSError) -> LocalShortage | None:
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        limit = "unlimited" if soft == resource.RLIM_INFINITY else str(soft)
        which = "this process" if exc.errno == errno.EMFILE else "this host"
        return LocalShortage(
            f"a connect fails: {exc.strerror}: {which} ran out of open files (this "
            f"process's open-file limit is {limit}); raise this process's open-file limit "
            "(ulimit -n, or LimitNOFILE= in its systemd unit) and start it again",
            "open_files",
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return LocalShortage(
            f"a connect fails: {exc.strerror}: this host ran out of local ports for new "
            "connections; widen net.ipv4.ip_local_port_range, or make fewer connections "
            "from this host (connections just closed hold theirs in TIME_WAIT a while)",
            "local_ports",
        )
    return None


def dial_problem(endpoint: str, timeout: float = DIAL_TIMEOUT_S) -> str | None:
    """Why a channel to ``endpoint`` does not connect, as one plain TCP (or Unix
    socket) connect sees it; None for a target this does not dial. gRPC's waiting
    channel never says why (only its debug log does), and "could not be connected"
    alone leaves the user to guess between a daemon not started, a wrong port, a
    host name that does not resolve and a firewall."""
    try:
        address = parse_address(endpoint, what="endpoint", allow_unix=True)
    except AddressError:
        return None
    path = address.unix_path
    try:
        sock = _dial(address, timeout)
    except socket.gaierror as exc:
        return f"the host name {address.host!r} does not resolve ({exc.strerror})"
    except ConnectionRefusedError:
        return "nothing listens there (connection refused)"
    except FileNotFoundError:
        return f"there is no socket at {path}"
    except PermissionError:
        return f"this user may not connect to the socket at {path}"
    except TimeoutError:
        return (
            f"a TCP connect gets no answer within {timeout:.2g} s (a firewall, a network "
            "partition, or a host that is down)"
        )
    except OSError as exc:
        return _shortage(exc) or f"a connect fails: {exc.strerror or exc}"
    sock.close()
    return (
        "it accepts connections, but no gRPC server answered on them (another service "
        "on that port, or a daemon that is stuck)"
    )


def listens(endpoint: str, timeout: float) -> bool:
    """Whether anything at ``endpoint`` accepts a plain connect within ``timeout``
    (False for a target this does not dial)."""
    try:
        _dial(parse_address(endpoint, what="endpoint", allow_unix=True), timeout).close()
    except (AddressError, OSError):
        return False
    return True


def speaks_tls(endpoint: str, timeout: float = TLS_SNIFF_TIMEOUT_S) -> bool:
    """Whether the server at ``endpoint`` answers a TLS ClientHello with a TLS record.

    A TLS daemon answers it with its ServerHello (or an alert), a plaintext gRPC
    daemon with an HTTP/2 frame or by closing. A plaintext HTTP/2 preface would not
    do: gRPC's TLS server drops it without an alert (measured with grpcio 1.85), as
    it drops gRPC's own plaintext attempt. Neither gRPC nor the ssl module tells
    "this peer speaks TLS" apart from every other failure, so the record header (its
    type, then major version 3) is read here; ssl writes the hello. The daemon logs
    nothing for it (the connection ends before its handshake fails). False for
    anything unreachable and for target forms this probe does not resolve.
    """
    try:
        address = parse_address(endpoint, what="endpoint", allow_unix=True)
    except AddressError:
        return False
    deadline = time.monotonic() + timeout
    try:
        with _dial(address, timeout) as sock:
            head = b""
            sock.sendall(_client_hello())
            while len(head) < 2 and (left := deadline - time.monotonic()) > 0:
                sock.settimeout(left)
                chunk = sock.recv(2 - len(head))
                if not chunk:
                    break
                head += chunk
    except OSError:  # refused, reset, timed out: not a TLS answer
        return False
    return len(head) == 2 and head[0] in TLS_RECORD_TYPES and head[1] == 3


_READY = grpc.ChannelConnectivity.READY.value[0]


def connected(channel: Any) -> bool:
    """Whether a blocking channel is READY (asked of its core, as ``_ready_within``
    does: grpc.Channel's public ``subscribe`` starts threads that outlive the look).
    False for a closed one."""
    core: Any = getattr(channel, "_channel", None)
    try:
        return core is not None and bool(core.check_connectivity_state(False) == _READY)
    except ValueError:  # "Channel closed!"
        return False
