"""Bearer-token authentication, checked before any handler runs.

gRPC's own call credentials authenticate clients, not servers' callers, and
grpcio has no server-side token check; so this interceptor is ours. Every
method is covered, unknown ones and reflection included; only the standard
health service is exempt so that load balancers and Kubernetes probes, which
cannot send tokens, still work.
"""

from __future__ import annotations

import hmac
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from rendezvousd.common.escape import quoted, shortened
from rendezvousd.common.limits import Limits
from rendezvousd.common.log_throttle import LogThrottle
from rendezvousd.common.secret_files import TOKEN_ENV, read_judged, unreadable_token_file
from rendezvousd.errors import ConfigError
from rendezvousd.server.budget import Gate, Refused, gated, gated_before_body
from rendezvousd.server.metrics import code_of, observed
from rendezvousd.server.scope import (
    ADMIN,
    CALLER,
    JOB_TOKEN_PREFIX,
    JobToken,
    Scope,
    admin_key,
    allowed,
    read_job_token,
)

log = logging.getLogger("rendezvousd")

MIN_TOKEN_CHARS = 16
HEALTH_PREFIX = "/grpc.health.v1.Health/"
HEALTH_WATCH = HEALTH_PREFIX + "Watch"
# Set by systemd for a unit with LoadCredential=/SetCredential=.
CREDENTIALS_ENV = "CREDENTIALS_DIRECTORY"
RENDEZVOUS_PATH = "/rendezvous.v1.Rendezvous"
UNAUTHENTICATED = "missing or invalid bearer token"
# A refused token is said in the log at most once per caller's host in this many
# seconds (with how many were not said), and of at most this many hosts at once.
REFUSED_LOG_S = 60.0
REFUSED_HOSTS = 1024
# Job ids whose tokens of the earlier form were warned about (then no more, bounded).
LEGACY_WARNED = 1024


def systemd_credential(path: Path) -> Path | None:
    """The real path of ``$CREDENTIALS_DIRECTORY`` when ``path`` (links resolved) lies
    inside it, else None.

    systemd ≥ 254 gives a DynamicUser service read access to its credentials by an ACL
    entry, which ``stat`` shows as group-read (0440; systemd/systemd#29435). The group
    bits of a file there grant nobody else anything: systemd makes the directory the
    service's own, read-only, and closed to other users. Only such a directory counts,
    so the variable pointed at a shared one relaxes nothing."""
    directory = os.environ.get(CREDENTIALS_ENV, "")
    if not directory:
        return None
    try:
        root = Path(directory).resolve(strict=True)
        real = path.resolve(strict=True)
        info = root.stat()
    except (OSError, RuntimeError):  # RuntimeError: a link loop
        return None
    if (
        not stat.S_ISDIR(info.st_mode)
        or info.st_mode & (stat.S_IWGRP | stat.S_IRWXO)
        or root == Path(root.anchor)
        or real == root
        or not real.is_relative_to(root)
    ):
        return None
    return root


def private_file_mask(path: Path, mask: int, what: str) -> int:
    """The mode bits ``path`` must not have: ``mask``, less the group's bits for a
    systemd credential. Accepting what would be refused elsewhere is logged, so an
    operator reading the start-up sees why."""
    credentials = systemd_credential(path)
    if credentials is None:
        return mask
    try:
        mode = path.stat().st_mode
    except OSError:
        return mask  # the caller's own stat reports it
    relaxed = mask & ~stat.S_IRWXG
    if mode & stat.S_IRWXG and not mode & relaxed:
        log.info(
            "%s %s is group-accessible (mode %s) but lies in $%s (%s), which only this "
            "service can enter: systemd grants its user read access by an ACL, shown as "
            "group bits; accepted",
            what,
            path,
            stat.filemode(mode),
            CREDENTIALS_ENV,
            credentials,
        )
    return relaxed


def read_token_file(path: Path) -> list[str]:
    """Tokens from ``path``, one per line (several allow rotation without downtime)."""

    def not_regular(mode: str) -> ConfigError:
        # Before its mode: a device or a directory is no token file, whatever its mode
        # (and "chmod 600 /dev/null" is no advice to give).
        return ConfigError(
            f"token file {path} is not a regular file ({mode}); "
            f"give a file created with `rendezvousd token FILE`"
        )

    def judge(info: os.stat_result) -> None:
        if info.st_mode & private_file_mask(path, stat.S_IRWXG | stat.S_IRWXO, "token file"):
            raise ConfigError(
                f"token file {path} is accessible by group/others (mode "
                f"{stat.filemode(info.st_mode)}); run: chmod 600 {path}"
            )

    try:
        text = read_judged(path, not_regular, judge).decode("ascii")
    except OSError as exc:
        # Not chained: the OSError's own text names the path, maybe a token.
        raise ConfigError(unreadable_token_file(path, exc)) from None
    except UnicodeDecodeError:
        # Clients send the token in an HTTP/2 header: only ASCII can get through.
        raise ConfigError(
            f"token file {path} holds non-ASCII bytes; create one with `rendezvousd token {path}`"
        ) from None
    tokens = [line.strip() for line in text.splitlines() if line.strip()]
    if not tokens:
        raise ConfigError(
            f"token file {path} holds no token; create one with `rendezvousd token {path}`"
        )
    return validate_tokens(tokens, f"token file {path}")


def validate_tokens(tokens: Sequence[str], origin: str) -> list[str]:
    for token in tokens:
        if (
            len(token) < MIN_TOKEN_CHARS
            or not token.isascii()  # sent in an HTTP/2 header: no client could send it
            or any(c.isspace() or not c.isprintable() for c in token)
        ):
            raise ConfigError(
                f"{origin} holds a token shorter than {MIN_TOKEN_CHARS} characters or with "
                "spaces/control/non-ASCII characters; create one with `rendezvousd token FILE`"
            )
        if token.startswith(JOB_TOKEN_PREFIX):
            # It would act as an admin token here; the daemon derives job tokens itself.
            raise ConfigError(
                f"{origin} holds a job-scoped token; the daemon needs the admin token(s) "
                "the job tokens were derived from (`rendezvousd token FILE`)"
            )
    return list(tokens)


def load_tokens(token_file: Path | None) -> list[str]:
    if token_file is not None:
        return read_token_file(token_file)
    env = os.environ.get(TOKEN_ENV, "").strip()
    if env:
        return validate_tokens([env], f"${TOKEN_ENV}")
    raise ConfigError(
        f"no token configured: pass --token-file FILE or set ${TOKEN_ENV} "
        "(create a token with `rendezvousd token FILE`)"
    )


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Checks the token, then counts the call against its class's budget: health
    calls (no token) have small budgets of their own, so they can never take the
    slots of authenticated calls, and watches can never take those of checks."""

    def __init__(
        self,
        tokens: Sequence[str],
        on_reject: Callable[[str], None],
        limits: Limits,
        body_timeout_s: float,
        job_ended: Callable[[str], float | None],
        on_refused: Callable[[str, str], None] | None = None,
        observe: Callable[[str, str, float], None] | None = None,
    ) -> None:
        """``job_ended``: when the last job of an id ended (None: none known); a job
        token minted before it is refused (the daemon's ``Persister.ended``).
        ``on_refused``: told the method and the caller's host of each call refused for
        its token (the daemon counts it, and words a silent member of that host by it).
        ``observe``: told ``(method, code, seconds)`` of each call the servicer does not
        observe itself (``metrics.observed``: the streams, health and reflection),
        refusals by their budget or scope included."""
        # An admin token's digest is also the key its job tokens are derived with.
        self._digests = [admin_key(t) for t in tokens]
        self._on_reject = on_reject
        self._observe = observe
        self.calls = Gate(
            "max_concurrent_rpcs",
            limits.max_concurrent_rpcs,
            "calls at once",
            by_job=_caller_job,
            job_cap=limits.calls_per_job,
            job_cap_why=(
                f"a call stream and a heartbeat stream for each of max_members_per_job="
                f"{limits.max_members_per_job} members, and max_waiters_per_job="
                f"{limits.max_waiters_per_job} parked calls"
            ),
        )
        self.health_checks = Gate(
            "max_health_checks", limits.max_health_checks, "health checks at once"
        )
        self.health_watches = Gate(
            "max_health_watches", limits.max_health_watches, "health watch streams"
        )
        self._body_timeout_s = body_timeout_s
        self._job_ended = job_ended
        self._legacy_warned: set[str] = set()
        self._on_refused = on_refused
        # Per caller's host, bounded: any address can send a call with a bad token.
        self._refused_said: LogThrottle[str] = LogThrottle(REFUSED_LOG_S, REFUSED_HOSTS)
        # Known methods only (an unknown one has no handler): bounded.
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    @property
    def token_count(self) -> int:
        return len(self._digests)

    def replace_tokens(self, tokens: Sequence[str]) -> tuple[int, bool]:
        """Accept ``tokens`` from now on (a reload of the token file, already
        validated): the list is replaced whole, in one assignment, so a call checked
        meanwhile sees the old set or the new one, never a mix. Returns how many
        accepted tokens are gone, and whether the first one (job tokens are minted
        from it) changed."""
        digests = [admin_key(t) for t in tokens]
        old = self._digests
        self._digests = digests
        removed = sum(1 for d in old if not any(hmac.compare_digest(d, n) for n in digests))
        first_changed = not hmac.compare_digest(old[0], digests[0])
        return removed, first_changed

    def token_scope(self, token: str) -> Scope | None:
        """The scope ``token`` grants (the status page's login and Bearer callers
        too), or None when it is invalid."""
        presented = admin_key(token)
        # Compare against every token, without an early exit, in constant time.
        if sum(hmac.compare_digest(presented, d) for d in self._digests) > 0:
            return ADMIN
        read = read_job_token(token, self._digests)
        if read is None or read.refusal(self._job_ended(read.job), time.time()) is not None:
            return None
        if read.issued is None:
            self._warn_legacy(read)
        return Scope(read.job, read)

    def _warn_legacy(self, read: JobToken) -> None:
        """A token of the earlier form (no minting time) is accepted for one release,
        while no job of its id has ended here; said once per job id."""
        if read.job in self._legacy_warned or len(self._legacy_warned) >= LEGACY_WARNED:
            return
        self._legacy_warned.add(read.job)
        log.warning(
            "job %s: a job token without a minting time (made by an earlier rendezvousd) "
            "was accepted; it cannot be bound to this job, and the next release refuses it: "
            "mint a new one: rendezvousd token --job %s --admin-token-file FILE OUT",
            read.job,
            read.job,
        )

    def refusal(self, token: str | None) -> str:
        """Why a call without a valid token (``token``: its bearer token, if one) is
        refused: an expired job token says so (its MAC matched, so its job and date
        are the daemon's to tell); anything else gets the one message that reveals
        nothing."""
        read = read_job_token(token, self._digests) if token is not None else None
        if read is None:
            return UNAUTHENTICATED
        return read.refusal(self._job_ended(read.job), time.time()) or UNAUTHENTICATED

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = details.method or ""
        if method == HEALTH_WATCH:
            return self._gated(method, await continuation(details), self.health_watches)
        if method.startswith(HEALTH_PREFIX):
            return self._gated(method, await continuation(details), self.health_checks)
        token = _bearer(details.invocation_metadata)
        scope = None if token is None else self.token_scope(token)
        if scope is not None:
            # Read by the servicer's dispatch: this runs in the task that runs the handler.
            CALLER.set(scope)
            service, _, name = method.rpartition("/")
            if service != RENDEZVOUS_PATH and not allowed(scope, name, None):
                return self._observed(
                    method,
                    _rejecting(
                        await continuation(details),
                        grpc.StatusCode.PERMISSION_DENIED,
                        f"a token scoped to {scope} may not call {method}; "
                        "only the admin token may call it",
                    ),
                )
            return self._gated(method, await continuation(details), self.calls)
        self._on_reject(method)
        handler = await continuation(details)
        refusal = self.refusal(token)
        read = read_job_token(token, self._digests) if token is not None else None
        return _rejecting(
            handler,
            message=refusal,
            on_run=lambda context: self._refused(method, context, refusal, read),
        )

    def _refused(self, method: str, context: Any, refusal: str, read: JobToken | None) -> None:
        """A call refused for its token, said where the operator looks (a token rotated
        under running jobs read as a network fault: nothing in the log, members lost
        as "unreachable"): one line per caller's host per ``REFUSED_LOG_S``, naming
        the method, the caller and the job a job token names; never the token."""
        peer = peer_text(context)
        host = peer_host(peer)
        name = method.rpartition("/")[2] or method
        if self._on_refused is not None:
            self._on_refused(name, host)
        if (due := self._refused_said.due(host, time.monotonic())) is None:
            return
        job = f" with a token for job {quoted(read.job)}" if read is not None else ""
        more = (
            f" ({due.skipped} more refused from {host} in the {due.since_s:.0f} s since the "
            "last line, not logged)"
            if due.skipped
            else ""
        )
        log.warning(
            "refused %s from %s%s (UNAUTHENTICATED: %s): its token is not one this daemon "
            "accepts. After a token rotation, write the new token into that client's token "
            "file (a client reads it again when refused) before the old one is removed from "
            "this daemon's token file%s",
            shortened(name),
            shortened(peer),
            job,
            refusal,
            more,
        )

    def _gated(
        self, method: str, handler: grpc.RpcMethodHandler | None, gate: Gate
    ) -> grpc.RpcMethodHandler | None:
        if handler is None:
            return None
        cached = self._wrapped.get(method)
        if cached is None or cached[0] is not handler:
            # Token-less calls are counted from their headers on: a caller that
            # never sends a body must not hold calls that no budget counts.
            early = gate is not self.calls
            # The servicer observes its unary calls (and each call on a call stream)
            # itself, so of those only the gate's refusals, which it never sees, are
            # observed here; the rest whole, outside the gate, its refusals included.
            by_servicer = method.startswith(RENDEZVOUS_PATH + "/") and not handler.request_streaming
            wrapped = (
                gated_before_body(handler, gate, self._body_timeout_s)
                if early
                else gated(handler, gate, self._refusal_observer(method) if by_servicer else None)
            )
            if not by_servicer:
                wrapped = self._observed(method, wrapped)
            cached = (handler, wrapped)
            self._wrapped[method] = cached
        return cached[1]

    def _refusal_observer(self, method: str) -> Refused | None:
        observe = self._observe
        if observe is None:
            return None
        name = method.rpartition("/")[2] or method

        def refused(context: Any, error: BaseException, seconds: float) -> None:
            observe(name, code_of(context, error), seconds)

        return refused

    def _observed(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        if self._observe is None:
            return handler
        return observed(handler, method.rpartition("/")[2] or method, self._observe)


def _caller_job() -> str | None:
    """The job the running call's token is scoped to (set by ``intercept_service`` in
    the task that runs the handler); None for the admin's."""
    scope = CALLER.get()
    return None if scope is None else scope.job


def peer_text(context: Any) -> str:
    """The caller's address as gRPC gives it (``ipv4:10.0.0.2:51234``), or "unknown"."""
    try:
        peer = context.peer()
    except Exception:  # a context without a transport (a test's)
        return "unknown"
    return peer if isinstance(peer, str) and peer else "unknown"


def peer_host(peer: str) -> str:
    """The host of a gRPC peer (``ipv4:10.0.0.2:51234`` → ``10.0.0.2``, ``ipv6:[::1]:5``
    → ``::1``, ``unix:…`` → ``unix``): the key refusals are told by, and the one a
    member's addresses are matched against."""
    kind, _, rest = peer.partition(":")
    if kind == "unix" or not rest:
        return kind or "unknown"
    host = rest.rpartition(":")[0] or rest
    return host.removeprefix("[").removesuffix("]")


def _bearer(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    """The call's one bearer token, or None (missing, duplicated: ambiguous)."""
    values = [v for k, v in metadata or () if k == "authorization"]
    return bearer_token(values[0]) if len(values) == 1 else None


def bearer_token(value: str | bytes) -> str | None:
    """The token of one ``Authorization: Bearer TOKEN`` value (gRPC metadata or an
    HTTP header), or None for another scheme, no token or non-ASCII bytes."""
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _rejecting(
    handler: grpc.RpcMethodHandler | None,
    code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED,
    message: str = UNAUTHENTICATED,
    on_run: Callable[[Any], None] | None = None,
) -> grpc.RpcMethodHandler:
    """A handler that only refuses, as soon as the call's headers arrived (``on_run``:
    told its context first, where the caller's address is known).

    It always takes a request stream (the same bytes on the wire as one message):
    grpcio would wait for a unary request's body before running the handler, and
    a caller without a token that never sends one would hold the call meanwhile.
    """
    streaming_out = bool(handler and handler.response_streaming)

    async def unary(request: Any, context: Any) -> None:
        if on_run is not None:
            on_run(context)
        await context.abort(code, message)

    async def stream_out(request: Any, context: Any) -> Any:
        if on_run is not None:
            on_run(context)
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator

    if streaming_out:
        return grpc.stream_stream_rpc_method_handler(stream_out)
    return grpc.stream_unary_rpc_method_handler(unary)
