"""The SDK's exception tree, and the one place gRPC errors are mapped onto it.

    RendezvousError                 base; .endpoint .method .job_id .rank .reason .metadata
    ├── DaemonUnavailable           unreachable, draining or not SERVING after all attempts
    │   └── DaemonUnreachable       the heartbeat stream heard nothing for the whole window:
    │                               failure detection is gone (not a peer failure)
    ├── AuthenticationError         the daemon refused the token or certificate
    ├── InvalidRequest              the daemon rejected a field (bad job id, id, rank...),
    │                               or kv_add met a key that holds no counter
    ├── TopologyMismatch            num_nodes/gpus_per_node differ from the job's
    ├── DuplicateRank               another worker holds this (node_rank, local_rank)
    ├── IdConflict                  a different unique id is already published
    ├── StaleGeneration             the job moved on; .current_generation
    ├── PeerFailed                  a member died; .failed (FailedMember, in order of
    │                               loss) .ranks .hosts .generation
    ├── JobAborted                  someone called abort; .abort_reason
    ├── JobEnded                    every member left
    ├── RendezvousTimeout           a join, barrier or key wait ran out of time
    ├── KeyNotFound                 KvGet without wait on an absent key
    ├── NotFound                    the job or membership does not exist
    ├── LimitExceeded               a daemon limit; .limit names it
    └── ProtocolError               anything else the daemon answered
        └── VersionMismatch         two rendezvousd versions that cannot work together:
                                    a node of another version (VERSION_MISMATCH), or a
                                    daemon older than the method called (UNIMPLEMENTED)

Messages say what failed, for which job and rank, and what to do. They never
contain the unique id or the token.
"""

from __future__ import annotations

import copy
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.common.members import FailedInfo


class RendezvousError(Exception):
    """Base of every error the SDK raises; says which call, endpoint, job and rank failed.

    ``code`` is the gRPC status name, ``reason`` and ``metadata`` the daemon's
    google.rpc.ErrorInfo (empty when the daemon sent none).
    """

    def __init__(
        self,
        message: str,
        *,
        code: str = "",
        reason: str = "",
        metadata: Mapping[str, str] | None = None,
        endpoint: str = "",
        method: str = "",
        job_id: str = "",
        rank: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.reason = reason
        self.metadata = dict(metadata or {})
        self.endpoint = endpoint
        self.method = method
        self.job_id = job_id
        self.rank = rank

    @property
    def daemon_version(self) -> str:
        """The daemon's rendezvousd version, as its answer said it (ErrorInfo metadata
        ``daemon_version``); "" where it said none: a daemon from before it, or one
        that never answered (unreachable, a refused TLS handshake)."""
        return self.metadata.get("daemon_version", "")

    def with_message(self, message: str) -> Self:
        """This error, of its own class, with ``message`` in place of its own and every
        other field kept (a subclass's too): re-raised in other words (``raise
        error.with_message(...) from error``), it is still the daemon's answer. Copied
        whole, so that a field added later is not dropped by a copy of the fields by hand."""
        other = copy.copy(self)  # its class's own reduce: every attribute, no traceback
        other.message = message
        other.args = (message,)
        return other

    def _add(self, text: str) -> None:
        """Append ``text`` to the message, as ``str()`` shows it too."""
        self.message += text
        self.args = (self.message,)


def clean_exit(exc: BaseException) -> bool:
    """Whether ``exc`` ending a ``with`` block is a success: ``sys.exit(0)`` there
    succeeds as it does after the block (the client's block and
    ``init_distributed()``'s alike)."""
    return isinstance(exc, SystemExit) and exc.code in (None, 0)


class DaemonUnavailable(RendezvousError):
    """The daemon could not be reached, is draining, or is not SERVING; ``.attempts`` made."""

    def __init__(self, message: str, *, attempts: int = 0, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.attempts = attempts


class DaemonUnreachable(DaemonUnavailable):
    """The heartbeat stream heard nothing from the daemon for ``.unreachable_s`` seconds
    (at least the window): the daemon died, or this node lost its network. Peers may
    be fine; what is gone is failure detection for this worker."""

    @property
    def unreachable_s(self) -> float:
        return float(self.metadata.get("unreachable_s", "0"))

    @property
    def window_s(self) -> float:
        return float(self.metadata.get("window_s", "0"))


class AuthenticationError(RendezvousError):
    """The daemon refused the token or the TLS client certificate."""


class InvalidRequest(RendezvousError, ValueError):
    """The daemon (or the SDK before sending) rejected a field of the request."""


class TopologyMismatch(RendezvousError):
    """``num_nodes``/``gpus_per_node`` differ from the job's."""


class DuplicateRank(RendezvousError):
    """Another live worker already holds this ``(node_rank, local_rank)``."""


class IdConflict(RendezvousError):
    """A different unique id is already published for this generation."""


class StaleGeneration(RendezvousError):
    """The job moved to a newer generation; ``.current_generation`` names it."""

    @property
    def current_generation(self) -> int:
        return int(self.metadata.get("current_generation", "0"))


@dataclass(frozen=True)
class FailedMember(FailedInfo):
    """A member the daemon lost: ``rank``, ``host``, ``node_rank``, ``local_rank``,
    ``cause`` (any text: ``describe()`` shows it escaped and shortened) and
    ``lost_at`` (``time.time()`` on this host, estimated; None if unknown)."""


def failed_members(messages: Iterable[pb.FailedMember]) -> tuple[FailedMember, ...]:
    """The daemon's ``FailedMember`` messages, in their order (the order of loss)."""
    now = time.time()
    return tuple(
        FailedMember(
            f.rank,
            f.host,
            f.cause,
            f.node_rank,
            f.local_rank,
            now - f.age_ms / 1000 if f.age_ms else None,
        )
        for f in messages
    )


class PeerFailed(RendezvousError):
    """A member died or went silent. ``.failed`` lists the lost members in the order
    the daemon lost them (the first is the root cause), each with its own host and
    cause; ``.ranks`` and ``.hosts`` list the same order; ``.generation`` is theirs.

    From a heartbeat event ``.failed`` is every loss known then, whole; from a call's
    error, at most the first 8 with causes cut short (``.ranks`` has them all):
    ``get_job().failed`` is the whole record.
    """

    def __init__(self, message: str, *, failed: Sequence[FailedMember] = (), **kw: Any) -> None:
        super().__init__(message, **kw)
        self.failed = tuple(failed)

    @property
    def ranks(self) -> list[int]:
        listed = _ints(self.metadata.get("ranks", ""))
        return listed if len(listed) >= len(self.failed) else [f.rank for f in self.failed]

    @property
    def hosts(self) -> list[str]:
        """Each host with a lost rank, once, in the order of its first loss."""
        listed = [h for h in self.metadata.get("hosts", "").split(",") if h]
        return list(dict.fromkeys([*(f.host for f in self.failed), *listed]))

    @property
    def generation(self) -> int:
        return int(self.metadata.get("generation", "0"))


class JobAborted(RendezvousError):
    """Someone called AbortJob; ``.abort_reason`` is their reason."""

    @property
    def abort_reason(self) -> str:
        return self.metadata.get("reason", "")

    @property
    def abort_cause(self) -> str:
        """What the abort is, as data (``abort(cause=...)``): "" for any abort (and from
        a daemon before causes), else its name, e.g. "LOOPBACK_ADDRESS". Act on this,
        never on ``abort_reason``'s words, which any caller of abort() chooses."""
        return self.metadata.get("abort_cause", "")

    @property
    def closed(self) -> bool:
        """Whether the job's run was closed for good (``close_run``), not only aborted:
        a standby parked on it, or a node launched before the close, is not needed.
        Data from the daemon (its metadata ``closed``, or ``JobEvent.closed``), never
        the reason's words; a daemon from before says none (False)."""
        return self.metadata.get("closed") == "true"


class JobEnded(RendezvousError):
    """Every member left the job's generation."""


class RendezvousTimeout(RendezvousError, TimeoutError):
    """A join, barrier or key wait ran out of time; ``.missing_ranks`` lists who."""

    @property
    def missing_ranks(self) -> list[int]:
        return _ints(self.metadata.get("ranks", ""))


class KeyNotFound(RendezvousError, KeyError):
    """KvGet without ``wait`` found no such key."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.message


class NotFound(RendezvousError):
    """The job, or this worker's membership of it, does not exist."""


class LimitExceeded(RendezvousError):
    """A daemon limit was hit; ``.limit`` names it."""

    @property
    def limit(self) -> str:
        return self.metadata.get("limit", "")


class ProtocolError(RendezvousError):
    """Any other answer the daemon gave, with its gRPC status name in ``.code``."""


class VersionMismatch(ProtocolError):
    """Two rendezvousd versions that cannot work together: the daemon refused this
    node agent because the job's other nodes run another version (``VERSION_MISMATCH``,
    ``.metadata`` has both ``wire_version`` and ``requested_wire_version``), or the
    daemon predates the method called (``.code`` UNIMPLEMENTED: an older rendezvousd).
    No retry changes it: upgrade (the daemon first, then every node of the job)."""


#: The errors a caller brings on itself: what it asked for was wrong or refused (a bad
#: field, a limit, a topology, rank or id that clashes with the job's, a refused token,
#: a version the job does not run, a key it took for set, a wait it gave too little
#: time). A ``with`` block that ends on one reports it as the cause, as on any other
#: exception: the daemon cannot know it, and its peers would read only "heartbeat
#: stream closed". The rest say the job or the daemon failed under it (a peer lost,
#: the job aborted or ended, a newer generation, the job or membership gone, the
#: daemon unreachable, draining or answering with a bug of its own): a victim's,
#: reported by whoever caused it, never this member.
_CALLERS_OWN: tuple[type[RendezvousError], ...] = (
    InvalidRequest,
    TopologyMismatch,
    DuplicateRank,
    IdConflict,
    LimitExceeded,
    KeyNotFound,
    AuthenticationError,
    VersionMismatch,
    RendezvousTimeout,
)


def callers_own(exc: BaseException) -> bool:
    """Whether ``exc`` is the rendezvous refusing what this caller asked (``_CALLERS_OWN``),
    not the job or daemon failing under it."""
    return isinstance(exc, _CALLERS_OWN)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip().isdigit()]


_BY_REASON: dict[str, type[RendezvousError]] = {
    "TOPOLOGY_MISMATCH": TopologyMismatch,
    "JOIN_MODE_MISMATCH": InvalidRequest,
    "VERSION_MISMATCH": VersionMismatch,
    # A usage error, as a bad field is (it was ProtocolError: "anything else").
    "NOT_A_COUNTER": InvalidRequest,
    # PERMISSION_DENIED both, but neither is a wrong token or TLS setting: a PublishId
    # from a rank other than 0 is a misuse of the call; a job token naming another job
    # is the token's scope (``_scope_advice``), which the launcher must still take for a
    # setup error, as any refused token.
    "NOT_RANK_ZERO": InvalidRequest,
    "SCOPE_DENIED": AuthenticationError,
    "DUPLICATE_RANK": DuplicateRank,
    "ID_CONFLICT": IdConflict,
    "STALE_GENERATION": StaleGeneration,
    "PEER_FAILED": PeerFailed,
    "JOB_ABORTED": JobAborted,
    "JOB_ENDED": JobEnded,
    "WORLD_INCOMPLETE": RendezvousTimeout,
    "BARRIER_TIMEOUT": RendezvousTimeout,
    "KEY_WAIT_TIMEOUT": RendezvousTimeout,
    "KEY_NOT_FOUND": KeyNotFound,
    "JOB_NOT_FOUND": NotFound,
    "NOT_A_MEMBER": NotFound,
    # A call of a generation still forming (ReportFailure, Barrier, GetMembers): made
    # before its Join returned, a misuse; it was ProtocolError ("anything else").
    "NOT_RUNNING": InvalidRequest,
    "LIMIT_EXCEEDED": LimitExceeded,
    "WORLD_FULL": LimitExceeded,
    "DRAINING": DaemonUnavailable,
}

_BY_CODE: dict[grpc.StatusCode, type[RendezvousError]] = {
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: AuthenticationError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.DEADLINE_EXCEEDED: RendezvousTimeout,
    grpc.StatusCode.UNAVAILABLE: DaemonUnavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: LimitExceeded,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ABORTED: StaleGeneration,
    # The daemon never answers it itself: gRPC does, for a method the daemon does not
    # serve ("Method not found!"), which only an older daemon lacks.
    grpc.StatusCode.UNIMPLEMENTED: VersionMismatch,
}


#: What the daemon answers when it fails in a way of its own (a bug of the daemon's, its
#: log has the traceback): ProtocolError ("report it"), never a class that blames the
#: caller's request, token or setup.
_DAEMON_BUG = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})


def error_info(call: grpc.Call) -> tuple[str, dict[str, str]]:
    """(reason, metadata) of the google.rpc.ErrorInfo in the call's status trailer.

    ``("", {})`` when the daemon sent no rich status, or sent one whose code or
    message disagrees with the call's own status (then it describes some other
    failure, e.g. a proxy rewrote the status, and must not pick the error class).
    """
    return _status_details(call)[:2]


def _status_details(call: grpc.Call) -> tuple[str, dict[str, str], list[pb.FailedMember]]:
    """``error_info``, and the FailedMember details that follow it (PEER_FAILED)."""
    try:
        status = rpc_status.from_call(call)
    except ValueError:
        return "", {}, []
    reason, metadata, failed = "", {}, []
    for detail in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        lost = pb.FailedMember()
        if not reason and detail.Unpack(info):
            reason, metadata = info.reason, dict(info.metadata)
        elif detail.Unpack(lost):
            failed.append(lost)
    return reason, metadata, failed


#: gRPC's own words for a message over the receiver's limit.
_TOO_LARGE = re.compile(r"Received message larger than max \((?P<sent>\d+) vs\. (?P<max>\d+)\)")


#: Where a refused token came from, in the SDK's words: its keywords, and the variables
#: it reads without them (``resolve_token``). Callers with flags of their own say those
#: (torchrun's handler, rendezvous-run, ``rendezvousd status``).
TOKEN_ADVICE = "(token= / token_file=, or $RENDEZVOUSD_TOKEN_FILE / $RENDEZVOUSD_TOKEN)"


def _scope_advice(job_id: str) -> str:
    """What a client refused SCOPE_DENIED can do: its token is a job token for another
    job (a wrong token, not a TLS setting)."""
    job = f"job {job_id!r}'s token" if job_id else "that job's token"
    mint = job_id or "JOB"
    return (
        f"; give this client {job} {TOKEN_ADVICE} (`rendezvousd token --job {mint} "
        "--admin-token-file ADMIN_TOKEN_FILE OUT` makes one) or the admin token"
    )


def _versions(daemon: str) -> str:
    """Which rendezvousd each end runs, for an error where versions are the question
    (two versions that cannot work together; a daemon going away, restarted on an
    upgrade): the daemon's as it said it, unknown from one from before it said it."""
    from rendezvousd.common.version import installed_version

    theirs = daemon or "unknown (a rendezvousd from before it said its version, 2026-12-07)"
    return f" [daemon: rendezvousd {theirs}; this client: rendezvousd {installed_version()}]"


def from_rpc_error(
    exc: grpc.RpcError, *, endpoint: str, method: str, job_id: str = "", rank: int | None = None
) -> RendezvousError:
    code: grpc.StatusCode = exc.code()
    details: str = exc.details() or ""
    reason, metadata, lost = _status_details(exc)
    # A daemon bug's class whatever reason comes with it: the daemon's call without its
    # auth verdict is INTERNAL with SCOPE_DENIED, and was taken for a wrong token (told
    # to use another job's), when no token or setting of the caller is to blame.
    cls = (
        ProtocolError
        if code in _DAEMON_BUG
        else _BY_REASON.get(reason) or _BY_CODE.get(code, ProtocolError)
    )
    where = f"{method} on rendezvousd at {endpoint}"
    who = f" (job {job_id!r}" + (f", rank {rank})" if rank is not None else ")") if job_id else ""
    if reason == "SCOPE_DENIED" and cls is AuthenticationError:
        message = f"{where}{who} was refused ({code.name}): {details}{_scope_advice(job_id)}"
    elif cls is AuthenticationError:
        # A refused token reads like no network fault: a rotation that removed it from
        # the daemon (the client's file is re-read once at the refusal) is the usual cause.
        rotated = (
            "the daemon does not accept this client's token (was it rotated? the daemon "
            "accepts the tokens its token file listed when it started; a client's token "
            "file is read again when its token is refused); "
            if code is grpc.StatusCode.UNAUTHENTICATED
            else ""
        )
        message = (
            f"{where}{who} was refused ({code.name}): {details}; {rotated}check that the "
            f"token {TOKEN_ADVICE} and TLS settings match the daemon's"
        )
    elif reason:
        message = f"{where}{who}: {details}"
    elif code is grpc.StatusCode.UNIMPLEMENTED:
        # The SDK user read "failed with UNIMPLEMENTED: Method not found!", and a node
        # agent took it for a transient failure, using up its restarts on it.
        message = (
            f"{where}{who}: the daemon at {endpoint} predates {method} (an older "
            f"rendezvousd: it answered UNIMPLEMENTED, {details!r}): upgrade the daemon "
            "first, then the nodes (a daemon serves the clients older than itself, not "
            "newer ones)"
        )
    elif code is grpc.StatusCode.DEADLINE_EXCEEDED:
        message = f"{where}{who} exceeded its deadline; the daemon did not answer in time"
    elif code is grpc.StatusCode.RESOURCE_EXHAUSTED and (sizes := _TOO_LARGE.search(details)):
        # gRPC refuses the message before the daemon reads it, so no ErrorInfo says which
        # limit: name it here, with the one a KV value meets first.
        metadata = {"limit": "max_message_bytes"}
        message = (
            f"{where}{who}: the request is {sizes['sent']} bytes, over the "
            f"{sizes['max']} bytes the daemon takes in one message (its max_message_bytes)"
            + (
                "; a KV value must also fit its max_value_bytes (32 KiB unless configured)"
                if method.startswith("Kv")
                else ""
            )
        )
    else:
        message = f"{where}{who} failed with {code.name}: {details}"
    if cls is VersionMismatch or (issubclass(cls, DaemonUnavailable) and metadata):
        message += _versions(metadata.get("daemon_version", ""))
    extra: dict[str, Any] = {"failed": failed_members(lost)} if cls is PeerFailed else {}
    return cls(
        message,
        **extra,
        code=code.name,
        reason=reason,
        metadata=metadata,
        endpoint=endpoint,
        method=method,
        job_id=job_id,
        rank=rank,
    )
