"""Who may call what: admin tokens and job-scoped tokens derived from them.

A job token is ``rdzv-job.<job id>.<mac>`` with the MAC an HMAC-SHA256 of
``"job:" + job id`` under an admin token; one that expires is
``rdzv-job.<job id>.<mac>.until-<unix seconds>``, its MAC over
``"job:" + job id + ":until:" + seconds`` (a job id has no ``:``, so neither form's
message can be the other's). It carries its job (and its end) in clear, so the
daemon verifies it from its admin tokens alone (no extra state); replacing an
admin token invalidates every job token derived from it.

``allowed`` is the one place that decides whether a scope may call a method for
a job; the servicer calls it for every Rendezvous call (which name a job in
their bodies), the interceptor for the other methods (reflection).
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from rendezvousd.common import validation
from rendezvousd.errors import Code, Reason, RendezvousFault
from rendezvousd.server.methods import policy

JOB_TOKEN_PREFIX = "rdzv-job."
# The last dot-separated field of an expiring token; a MAC (hex) never starts so.
UNTIL = "until-"


@dataclass(frozen=True)
class Scope:
    """What a caller's token lets it touch: every job (``job`` None) or one job."""

    job: str | None = None

    @property
    def admin(self) -> bool:
        return self.job is None

    def __str__(self) -> str:
        return "admin" if self.job is None else f"job:{self.job}"


ADMIN = Scope()
# Set by the auth interceptor for the call being handled (same task as the handler).
CALLER: contextvars.ContextVar[Scope | None] = contextvars.ContextVar("caller_scope", default=None)


def allowed(scope: Scope, method: str, job_id: str | None) -> bool:
    """Whether ``scope`` may call ``method`` (bare name) naming ``job_id``."""
    rule = policy(method)
    if scope.job is None or rule.filtered:
        return True
    if rule.job_scoped:
        return job_id is not None and scope.job == job_id
    return False


def denied(scope: Scope, method: str, job_id: str | None) -> RendezvousFault:
    target = f" for job {job_id[:128]!r}" if job_id is not None else ""
    if policy(method).job_scoped:
        hint = "use that job's token or the admin token"
    else:
        hint = "only the admin token may call it"
    return RendezvousFault(
        Code.PERMISSION_DENIED,
        Reason.SCOPE_DENIED,
        f"a token scoped to {scope} may not call {method}{target}; {hint}",
        {"scope": str(scope), "method": method},
    )


def admin_key(admin_token: str) -> bytes:
    """The MAC key of an admin token: its SHA-256, so the daemon keeps only digests."""
    return hashlib.sha256(admin_token.encode()).digest()


def _mac(key: bytes, job_id: str, until: int | None = None) -> str:
    message = f"job:{job_id}" if until is None else f"job:{job_id}:until:{until}"
    return hmac.new(key, message.encode(), hashlib.sha256).hexdigest()


def derive_job_token(admin_token: str, job_id: str, until: int | None = None) -> str:
    """The token for ``job_id`` under ``admin_token``, valid until the Unix time
    ``until`` (forever when None). Raises INVALID_JOB_ID."""
    validation.job_id(job_id)
    token = f"{JOB_TOKEN_PREFIX}{job_id}.{_mac(admin_key(admin_token), job_id, until)}"
    return token if until is None else f"{token}.{UNTIL}{until}"


@dataclass(frozen=True)
class JobToken:
    """A job token whose MAC matched one of the daemon's admin tokens."""

    job: str
    until: int | None  # Unix seconds; None: no expiry

    def expired(self, now: float) -> bool:
        return self.until is not None and now >= self.until

    def expiry_text(self) -> str:
        if self.until is None:
            return "never"
        return datetime.fromtimestamp(self.until, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def read_job_token(token: str, admin_keys: Sequence[bytes]) -> JobToken | None:
    """``token``'s job and expiry when its MAC matches under any of ``admin_keys``
    (expired or not), else None."""
    if not token.startswith(JOB_TOKEN_PREFIX):
        return None
    rest, until = token[len(JOB_TOKEN_PREFIX) :], None
    head, dot, last = rest.rpartition(".")
    if dot and last.startswith(UNTIL):
        digits = last[len(UNTIL) :]
        # Plain decimal only (no sign, no "_"), so one expiry has one spelling.
        if not (digits.isascii() and digits.isdigit()) or len(digits) > 12:
            return None
        rest, until = head, int(digits)
    job_id, dot, mac = rest.rpartition(".")
    if not dot or not job_id:
        return None
    try:
        validation.job_id(job_id)
    except RendezvousFault:
        return None
    presented = mac.encode()
    # Every admin token is tried, without an early exit (constant time per count).
    ok = sum(hmac.compare_digest(presented, _mac(a, job_id, until).encode()) for a in admin_keys)
    return JobToken(job_id, until) if ok else None


def verify_job_token(
    token: str, admin_keys: Sequence[bytes], now: float | None = None
) -> Scope | None:
    """The job scope ``token`` grants under any of ``admin_keys`` at ``now`` (the
    wall clock when None: expiry is a date, shared with the machine that minted
    the token), or None."""
    read = read_job_token(token, admin_keys)
    if read is None or read.expired(time.time() if now is None else now):
        return None
    return Scope(read.job)
