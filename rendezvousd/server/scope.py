"""Who may call what: admin tokens and job-scoped tokens derived from them.

A job token is ``rdzv-job.<job id>.<mac>.issued-<unix seconds>`` with the MAC an
HMAC-SHA256 of ``"job:" + job id + ":issued:" + seconds`` under an admin token: the
time it was minted, which binds it to the job created after it (a token minted before
the last job of its id ended opens no later job of that id: ``storage/job_ends.py``,
checked by the auth interceptor). One that expires ends in ``.until-<unix seconds>``,
its MAC over the same message + ``":until:" + seconds``. The forms of earlier
releases, without ``issued``, are ``rdzv-job.<job id>.<mac>[.until-<seconds>]`` with the
MAC over ``"job:" + job id [+ ":until:" + seconds]``: still read, for one release (a
job id has no ``:``, so no form's message can be another's). A token carries its job
and dates in clear, so the daemon verifies it from its admin tokens alone; replacing
an admin token invalidates every job token derived from it.

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
from dataclasses import dataclass, field
from datetime import UTC, datetime

from rendezvousd.common import validation
from rendezvousd.common.escape import quoted
from rendezvousd.errors import Code, Reason, RendezvousFault
from rendezvousd.server.methods import policy

JOB_TOKEN_PREFIX = "rdzv-job."
# The last dot-separated fields of a token: when it was minted, and when it expires.
# A MAC (hex) never starts so.
ISSUED = "issued-"
UNTIL = "until-"
#: How far past the daemon's clock a token's minting time may lie and still be taken:
#: hosts kept by NTP differ by far less; a host further ahead would mint tokens that
#: open a job created before them (its id's next job, within that lead), which the
#: end check (``predates``) is there to refuse.
MINTED_AHEAD_S = 300


@dataclass(frozen=True)
class Scope:
    """What a caller's token lets it touch: every job (``job`` None) or one job."""

    job: str | None = None
    # The job token that granted it: a stream opened with it carries calls that start
    # later, each checked again against the token's expiry and its job's end.
    token: JobToken | None = field(default=None, compare=False, repr=False)

    @property
    def admin(self) -> bool:
        return self.job is None

    def __str__(self) -> str:
        return "admin" if self.job is None else f"job:{self.job}"


ADMIN = Scope()
# Set by the auth interceptor for the call being handled (same task as the handler).
CALLER: contextvars.ContextVar[Scope | None] = contextvars.ContextVar("caller_scope", default=None)
# The peer of a Calls stream whose calls are being handled ("ipv4:10.0.0.2:51234"), set
# as the stream starts: a call on the stream has no gRPC context of its own to ask.
STREAM_PEER: contextvars.ContextVar[str] = contextvars.ContextVar("stream_peer", default="")


def allowed(scope: Scope, method: str, job_id: str | None) -> bool:
    """Whether ``scope`` may call ``method`` (bare name) naming ``job_id``."""
    rule = policy(method)
    if scope.job is None or rule.filtered:
        return True
    if rule.job_scoped:
        return job_id is not None and scope.job == job_id
    return False


def denied(scope: Scope, method: str, job_id: str | None) -> RendezvousFault:
    target = f" for job {quoted(job_id)}" if job_id is not None else ""
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


def _mac(key: bytes, job_id: str, until: int | None = None, issued: int | None = None) -> str:
    message = f"job:{job_id}"
    if issued is not None:
        message += f":issued:{issued}"
    if until is not None:
        message += f":until:{until}"
    return hmac.new(key, message.encode(), hashlib.sha256).hexdigest()


def derive_job_token(
    admin_token: str, job_id: str, until: int | None = None, *, issued: int | None = None
) -> str:
    """The token for ``job_id`` under ``admin_token``, minted at the Unix time ``issued``
    (now when None), valid until the Unix time ``until`` (forever when None). Raises
    INVALID_JOB_ID."""
    validation.job_id(job_id)
    issued = int(time.time()) if issued is None else issued
    mac = _mac(admin_key(admin_token), job_id, until, issued)
    token = f"{JOB_TOKEN_PREFIX}{job_id}.{mac}.{ISSUED}{issued}"
    return token if until is None else f"{token}.{UNTIL}{until}"


def _date(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class JobToken:
    """A job token whose MAC matched one of the daemon's admin tokens."""

    job: str
    until: int | None  # Unix seconds; None: no expiry
    # Unix seconds it was minted at; None: the form of earlier releases, without it.
    issued: int | None = None

    def expired(self, now: float) -> bool:
        return self.until is not None and now >= self.until

    def expiry_text(self) -> str:
        return "never" if self.until is None else _date(self.until)

    def predates(self, ended: float | None) -> bool:
        """Whether this token was minted before ``ended``, the end of the last job of
        its id (None: none known): it then opens no later job of that id. A token
        without its minting time counts as minted before any end."""
        return ended is not None and (self.issued is None or self.issued < ended)

    def refusal(self, ended: float | None, now: float) -> str | None:
        """Why this token opens nothing at ``now`` (the daemon's wall clock): minted
        later than ``now`` by more than ``MINTED_AHEAD_S``, minted before ``ended``, its
        job's last end, or expired; None while it is good."""
        if self.issued is not None and self.issued > now + MINTED_AHEAD_S:
            return self.ahead_text(now)
        if ended is not None and self.predates(ended):
            return self.stale_text(ended, now)
        if not self.expired(now):
            return None
        return (
            f"the job token for job {self.job!r} expired at {self.expiry_text()} "
            f"({_clock(now)}: if that date is still to come, this daemon's host's clock is "
            f"ahead: check it); mint a new one: rendezvousd token --job {self.job} "
            "--admin-token-file FILE --valid-for DURATION OUT"
        )

    def ahead_text(self, now: float) -> str:
        """Why a token minted in the daemon's future is refused: a minting host whose
        clock is ahead would otherwise mint tokens that open the job of their id created
        after them, by the daemon's clock, for as long as that clock is behind."""
        assert self.issued is not None
        return (
            f"the job token for job {self.job!r} was minted at {_date(self.issued)}, more "
            f"than {MINTED_AHEAD_S} s after {_clock(now)}: it was minted on a host whose "
            "clock is ahead (or this daemon's is behind); set that host's clock right "
            f"(NTP), then mint a new one: rendezvousd token --job {self.job} "
            "--admin-token-file FILE OUT"
        )

    def stale_text(self, ended: float, now: float) -> str:
        """Why a token that ``predates`` the end ``ended`` is refused at ``now``, and
        what to do."""
        minted = (
            "carries no minting time"
            if self.issued is None
            else (f"was minted at {_date(self.issued)}")
        )
        mint = f"rendezvousd token --job {self.job} --admin-token-file FILE OUT"
        said = (
            f"the job token for job {self.job!r} {minted}, before the last job {self.job!r} "
            f"ended at {_date(ended)}"
        )
        if ended > now:
            # Recorded by a clock that was ahead then: minting again does not help
            # until the daemon's clock passes it, so "mint a new one" alone misleads.
            return (
                f"{said}, which is later than {_clock(now)}: that end was recorded while "
                "this daemon's clock was ahead (or it is behind now), and a token of this "
                f"job id minted before {_date(ended)} is refused; check this daemon's "
                f"clock, and use another job id, or mint a new token after that: {mint}"
            )
        return (
            f"{said} ({_clock(now)}: a token minted since that end on a host whose clock "
            "is behind looks older; check that host's clock); a job token opens only the "
            f"job created after it was minted: mint a new one: {mint}"
        )


def _clock(now: float) -> str:
    """The daemon's wall clock as a refusal names it: a client whose own clock differs
    sees that the two disagree."""
    return f"this daemon's clock reads {_date(now)}"


def _field(rest: str, name: str) -> tuple[str, int | None] | None:
    """``rest`` without its last field when that is ``name`` + seconds, and the
    seconds (None: no such field); None when the field is malformed."""
    head, dot, last = rest.rpartition(".")
    if not (dot and last.startswith(name)):
        return rest, None
    digits = last[len(name) :]
    # Plain decimal only (no sign, no "_"), so one date has one spelling.
    if not (digits.isascii() and digits.isdigit()) or len(digits) > 12:
        return None
    return head, int(digits)


def read_job_token(token: str, admin_keys: Sequence[bytes]) -> JobToken | None:
    """``token``'s job and dates when its MAC matches under any of ``admin_keys``
    (expired or not), else None."""
    if not token.startswith(JOB_TOKEN_PREFIX):
        return None
    until_field = _field(token[len(JOB_TOKEN_PREFIX) :], UNTIL)
    issued_field = None if until_field is None else _field(until_field[0], ISSUED)
    if until_field is None or issued_field is None:
        return None
    (rest, issued), until = issued_field, until_field[1]
    job_id, dot, mac = rest.rpartition(".")
    if not dot or not job_id:
        return None
    try:
        validation.job_id(job_id)
    except RendezvousFault:
        return None
    presented = mac.encode()
    # Every admin token is tried, without an early exit (constant time per count).
    ok = sum(
        hmac.compare_digest(presented, _mac(a, job_id, until, issued).encode()) for a in admin_keys
    )
    return JobToken(job_id, until, issued) if ok else None
