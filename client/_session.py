"""What the sync and asyncio clients share: per-client session state, request
building and the heartbeat-stream decisions. No I/O here; the calls that use it
are ``_calls``."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import numbers
import operator
import os
import secrets
import socket
import threading
import time
import types
from collections import abc
from collections.abc import Callable, Mapping, Sequence, Sized
from dataclasses import dataclass, field
from pathlib import Path
from typing import (
    Any,
    NotRequired,
    SupportsIndex,
    TypedDict,
    Union,
    Unpack,
    get_args,
    get_origin,
    get_type_hints,
)

import grpc

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client._multiplex import timeout_ms
from rendezvousd.client.connection import (
    IDEMPOTENT,
    Bearer,
    LocalShortage,
    RetryPolicy,
    TlsConfig,
    listens,
)
from rendezvousd.client.errors import (
    AuthenticationError,
    DaemonUnavailable,
    DaemonUnreachable,
    InvalidRequest,
    JobAborted,
    JobEnded,
    PeerFailed,
    RendezvousError,
    RendezvousTimeout,
    failed_members,
    from_rpc_error,
)
from rendezvousd.client.membership import (
    LazyTable,
    Membership,
    NodeMembership,
    from_join_node_response,
    from_join_response,
)
from rendezvousd.common.address import AddressError, parse_address
from rendezvousd.common.escape import bounded
from rendezvousd.common.members import failed_text
from rendezvousd.common.validation import (
    LONGEST_WAIT_S,
    UNIQUE_ID_BYTES,
    is_wait,
    longest_beat_s,
)

log = logging.getLogger("rendezvousd.client")

# Extra deadline beyond a waiting call's own timeout, so the daemon's answer
# (which names the missing ranks) arrives before the transport gives up.
SLACK_S = 5.0
# The daemon's default --heartbeat-timeout-s: the unreachable window when the daemon
# does not advertise its own (an older daemon) and the caller set none.
DEFAULT_WINDOW_S = 10.0
# The default beat: a third of the daemon's timeout, at most this often apart.
DEFAULT_HEARTBEAT_S = 5.0
# A daemon too old to say its timeout gets the SDK's former default beat.
LEGACY_HEARTBEAT_S = 1.0
# Leave after the job's work is done is a courtesy: never worth more than this.
LEAVE_TIMEOUT_S = 2.0
# Each heartbeat stream's deadline (the next one is made when it passes).
HEARTBEAT_CALL_S = 3600.0
JOIN_TIMEOUT_S = 600.0
# More window for a daemon found listening again once its members' window passed
# (``StreamWatch.may_look_back``): gRPC's longest redial backoff (2 s, +20 %), and the
# stream's reattach.
REDIAL_GRACE_S = 3.0
# How long that look's plain connect may take.
LOOK_BACK_S = 0.5
# barrier() and kv_get() without a timeout: the daemon's own default wait
# (default_wait_s), as long as a join's. They waited call_timeout (30 s), which bounds
# calls that wait for no peer, so one rank's 45 s checkpoint failed its peers' barrier.
WAIT_TIMEOUT_S = 600.0
# A call's own deadline under which a daemon that answers is told it is too short
# (``Session.too_short``): a round trip on a loaded node, a change made durable, take
# milliseconds to a few hundred; longer, the daemon is slow, not the deadline.
SHORT_DEADLINE_S = 1.0


class JoinRequest(TypedDict):
    """The keywords of every transport's ``join()``: declared once, so that the
    clients, ``FileRendezvous`` and the ``Rendezvous`` protocol cannot drift apart."""

    num_nodes: int
    gpus_per_node: int
    local_rank: int
    # None: the daemon assigns the node rank.
    node_rank: NotRequired[int | None]
    # Default: this host's name.
    host: NotRequired[str | None]
    # Where peers reach this worker (the CPU ring's address); "" for none.
    address: NotRequired[str]
    # Global rank 0's id: these bytes, else id_factory(), else 128 random bytes.
    unique_id: NotRequired[bytes | None]
    id_factory: NotRequired[Callable[[], bytes] | None]
    # Seconds to wait for the world (JOIN_TIMEOUT_S when left out or None, as for
    # join_node(); None was refused).
    timeout: NotRequired[float | None]


class NodeJoinRequest(TypedDict):
    """The keywords of both clients' ``join_node()``, declared once."""

    min_nodes: int
    max_nodes: int
    gpus_per_node: int
    node_rank: NotRequired[int | None]  # None: the daemon assigns it
    addresses: NotRequired[Sequence[str]]  # one per local rank: where peers reach it
    id_factory: NotRequired[Callable[[], bytes] | None]  # runs only on node 0
    # Seconds after the last arrival that form a generation of >= min_nodes (None:
    # the daemon's default).
    last_call: NotRequired[float | None]
    timeout: NotRequired[float | None]  # seconds to wait (None: JOIN_TIMEOUT_S)
    host: NotRequired[str | None]  # default: this host's name
    # A standby: waits beyond max_nodes until a failure frees a slot
    # (``JoinNodeRequest.standby``); RendezvousTimeout when none did within ``timeout``.
    standby: NotRequired[bool]
    # When this node agent was launched, on ``time.monotonic()``'s clock (None: not
    # said). Its first join tells the daemon how long ago: a job whose run ended
    # after that refuses it (JobEnded), as the node was launched for that run.
    launched: NotRequired[float | None]
    # What this node's workers speak to the other nodes' (``JoinNodeRequest.
    # wire_version``; rendezvous-run sends its CPU ring's): every node of a job must
    # send the same, or the daemon refuses the join (VersionMismatch). "": none said.
    wire_version: NotRequired[str]


@functools.cache
def _keywords(declared: Any) -> tuple[frozenset[str], frozenset[str]]:
    """(every key, the required keys) of a TypedDict. Read from its resolved hints:
    under ``from __future__ import annotations`` the class's own
    ``__required_keys__`` cannot see ``NotRequired``."""
    hints = get_type_hints(declared, include_extras=True)
    if not declared.__total__:
        return frozenset(hints), frozenset()
    optional = {k for k, hint in hints.items() if get_origin(hint) is NotRequired}
    return frozenset(hints), frozenset(hints) - optional


def check_keywords(call: str, declared: Any, given: Mapping[str, object]) -> None:
    """Python's own TypeError for ``call(**given)`` against the TypedDict that
    declares its keywords. The interpreter checks no ``**kwargs: Unpack[...]``, so a
    misspelt keyword would otherwise be dropped without a word (``reconect_window``)
    or surface as a KeyError from deep inside (``join(world_size=...)``)."""
    known, required = _keywords(declared)
    unknown = sorted(set(given) - known)
    missing = sorted(required - set(given))
    if unknown:
        raise TypeError(
            f"{call}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))};"
            f" it takes {', '.join(sorted(known))}"
        )
    if missing:
        raise TypeError(
            f"{call}() missing required keyword argument(s) {', '.join(map(repr, missing))}"
        )
    nullable = _nullable(declared)
    for key in sorted(WAITS & set(given)):
        check_wait(call, key, given[key], none_ok=key in nullable)
    hints = _hints(declared)
    for key in sorted(set(given) - WAITS):
        check_arg(call, key, given[key], hints[key], _SPANS.get(key, UINT32))


_hints = functools.cache(get_type_hints)


#: gRPC's own target schemes (``dns:///host:port``, ...): passed to gRPC as they are.
_GRPC_SCHEMES = ("dns:", "ipv4:", "ipv6:", "unix-abstract:", "vsock:", "xds:")


def check_endpoint(endpoint: object) -> None:
    """Refuse an endpoint no daemon can be at: gRPC takes ``localhost`` (port 443)
    and ``host::x`` as targets and waits the whole connect timeout on them, which
    then read as a daemon that is down. gRPC's own URIs are left to it."""
    if isinstance(endpoint, str) and endpoint.startswith(_GRPC_SCHEMES):
        return
    if isinstance(endpoint, str) and "://" in endpoint and not endpoint.startswith("unix:///"):
        # https://, grpc://, tcp://, unix://relative: gRPC knows no such target, or
        # reads "unix://sock" as an authority it refuses, and the client waited its
        # whole connect timeout to report no reason (or "no socket at //sock").
        raise InvalidRequest(
            f"endpoint={endpoint!r} is a URL, not a daemon's address: give 'host:port', "
            "'[v6addr]:port' or 'unix:PATH' (gRPC's own dns:///host:port, ipv4:, ipv6:, "
            "unix-abstract:, vsock: and xds: targets are passed to gRPC as they are)",
            endpoint=endpoint,
        )
    try:
        parse_address(endpoint, what="endpoint", allow_unix=True)  # type: ignore[arg-type]
    except AddressError as exc:
        raise InvalidRequest(str(exc), endpoint=str(endpoint)) from None


#: The request fields the keywords' ints fill are uint32; a KV counter's delta, int64.
UINT32 = (0, 2**32 - 1)
INT64 = (-(2**63), 2**63 - 1)
UINT64 = (0, 2**64 - 1)
#: Counts the daemon refuses at 0 (a topology, ``validation.topology``): uint32 fields
#: whose range, named in the error, starts at 1. (The daemon's --max-members-per-job
#: bounds their product further.)
COUNT = (1, 2**32 - 1)
_SPANS = {"num_nodes": COUNT, "gpus_per_node": COUNT, "min_nodes": COUNT, "max_nodes": COUNT}


def check_arg(
    call: str, name: str, value: object, hint: Any, span: tuple[int, int] = UINT32
) -> None:
    """Refuse a value its request field cannot carry as given: protobuf takes None
    as "unset" (``kv_set(k, None)`` stored b"", ``abort(None)`` an empty reason),
    raises a bare ValueError for an int out of its range, naming no field, and a
    TypeError or AttributeError from deep inside for the rest."""
    options = get_args(hint) if get_origin(hint) in (Union, types.UnionType) else (hint,)
    if not any(_fits(value, option, span) for option in options):
        wanted = " or ".join(_described(option, span) for option in options)
        shown = _secret(value) if name in SECRET_ARGS else _shown(value)
        if isinstance(value, str) and str in options:
            raise InvalidRequest(
                f"{call}() {name}={shown} has characters UTF-8 cannot encode (a lone "
                "surrogate, as os.fsdecode() makes of undecodable bytes): give text, e.g. "
                "bytes decoded with errors='replace'"
            )
        raise InvalidRequest(f"{call}() {name}={shown} is not {wanted}")


def abort_cause(name: str) -> pb.AbortCause.ValueType:
    """``abort(cause=...)``'s name as the request's value ("": none)."""
    if not name:
        return pb.ABORT_CAUSE_UNSPECIFIED
    try:
        return pb.AbortCause.Value(f"ABORT_CAUSE_{name}")
    except ValueError:
        known = [n.removeprefix("ABORT_CAUSE_") for n in pb.AbortCause.keys()[1:]]
        raise InvalidRequest(
            f'abort() cause={_shown(name)} is not an abort cause: give "" (any abort) or '
            f"one of {', '.join(known)}"
        ) from None


def abort_cause_name(value: int) -> str:
    """A JOB_ABORTED event's cause by the name the daemon's error metadata gives it; a
    cause newer than this SDK by its number."""
    try:
        return pb.AbortCause.Name(value).removeprefix("ABORT_CAUSE_")  # type: ignore[arg-type]
    except ValueError:
        return str(value)


def _fits(value: object, option: Any, span: tuple[int, int]) -> bool:
    origin = get_origin(option)
    if origin in (Union, types.UnionType):  # inside a Sequence[...]
        return any(_fits(value, o, span) for o in get_args(option))
    if option is type(None):
        return value is None
    if option is float:  # an int too, as Python's own float parameters take one
        return (
            isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        )
    if option is int:  # numpy's ints too, as protobuf takes them; never a bool
        if type(value) is int:  # the common case, without the Protocol's slow isinstance
            return span[0] <= value <= span[1]
        if isinstance(value, bool) or not isinstance(value, SupportsIndex):
            return False
        return span[0] <= operator.index(value) <= span[1]
    if origin is abc.Sequence:
        (item,) = get_args(option)
        return (
            isinstance(value, abc.Sequence)
            and not isinstance(value, str | bytes)
            and all(_fits(v, item, span) for v in value)
        )
    if origin is abc.Callable:
        return callable(value)
    if option is str:
        # Protobuf's own UnicodeEncodeError named no argument: a lone surrogate, as
        # os.fsdecode() makes of a file name's undecodable bytes (an SDK misuse review).
        return isinstance(value, str) and (value.isascii() or _encodes(value))
    return not isinstance(option, type) or isinstance(value, option)


def _encodes(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _described(option: Any, span: tuple[int, int]) -> str:
    if get_origin(option) in (Union, types.UnionType):
        return " or ".join(_described(o, span) for o in get_args(option))
    if option is type(None):
        return "None"
    if option is int:
        return f"an int from {span[0]} to {span[1]}"
    if get_origin(option) is abc.Sequence:
        return f"a sequence of {_described(get_args(option)[0], span)}"
    if get_origin(option) is abc.Callable:
        return "a callable"
    return getattr(option, "__name__", str(option))


#: Arguments whose values are secrets: a token (whoever holds it calls the daemon),
#: rank 0's NCCL id, a member's instance id (whoever holds it speaks as the member).
#: A token read from its file in binary mode was echoed whole (an SDK misuse review).
SECRET_ARGS = frozenset({"token", "unique_id", "instance_id"})


def _secret(value: object) -> str:
    """A secret in an error: its type and size, never its content."""
    size = f" of {len(value)}" if isinstance(value, Sized) else ""
    return f"<a {type(value).__name__}{size}, not shown>"


def _shown(value: object) -> str:
    """``value`` in an error: its repr, cut short (it may be a whole tensor)."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


# The keywords that are seconds to wait.
WAITS = frozenset(
    {"timeout", "call_timeout", "connect_timeout", "leave_timeout", "last_call", "reconnect_window"}
)


# Bounds every call can never meet at 0: each then failed "is the daemon running and
# reachable?" against a daemon that was fine; a reconnect window of 0 would call the
# daemon lost at any broken stream (and was read as the default).
POSITIVE_WAITS = frozenset({"call_timeout", "connect_timeout", "reconnect_window"})


def check_wait(
    call: str,
    name: str,
    seconds: object,
    *,
    none_ok: bool = True,
    deadline: bool = False,
    least: float | None = None,
) -> None:
    """Refuse a wait no call could carry: one not in seconds, beyond ``LONGEST_WAIT_S``
    (infinite), None where that is no default (no deadline: a hang), or 0 for a bound
    every call must meet (``POSITIVE_WAITS``, or a ``deadline``: the time a call that
    waits for no peer has to be answered, which at 0 fails even at a daemon that is
    fine, as a daemon that does not answer); ``least`` sets the floor itself."""
    if seconds is None and none_ok:
        return
    if least is None:
        least = 0.001 if deadline or name in POSITIVE_WAITS else 0
    if is_wait(seconds, least):
        return
    kind: type = type(seconds)
    # np.float64 is a float (taken in range): only a type gRPC cannot take is blamed.
    if isinstance(seconds, numbers.Real) and not issubclass(kind, int | float):
        # A np.float32(0.5) read "not a wait ... from 0 to 2592000" (an SDK misuse
        # review): its range was fine, its type is what gRPC and the waits cannot take.
        raise InvalidRequest(
            f"{call}() {name}={seconds!r} is a {kind.__name__}: give seconds as "
            f"a Python float or int (float({name}))"
        )
    raise InvalidRequest(
        f"{call}() {name}={seconds!r} is not a wait the SDK can send: give seconds from "
        f"{least:g} to {LONGEST_WAIT_S:.0f} (30 days)"
        + (", or None for the default" if none_ok else "")
    )


@functools.cache
def _nullable(declared: Any) -> frozenset[str]:
    """The keys of a TypedDict that may be None."""
    hints = get_type_hints(declared)
    return frozenset(k for k, hint in hints.items() if type(None) in get_args(hint))


class ClientOptions(TypedDict, total=False):
    """The keywords of both clients' constructors, declared once (defaults in ())."""

    token: str | None  # else read from token_file, else from the environment
    token_file: Path | str | None
    tls: TlsConfig | None  # None: plaintext
    retry_attempts: int  # after the first, for a retryable failure (1)
    call_timeout: float  # seconds for a call that does not wait for peers (30)
    connect_timeout: float  # seconds for the health check to reach the daemon (30)
    # Silence on the heartbeat stream before DaemonUnreachable (None: the daemon's
    # heartbeat timeout, 10 s for an older daemon).
    reconnect_window: float | None
    leave_timeout: float  # the one attempt leave() makes (LEAVE_TIMEOUT_S)
    # Make every call as a message on one CallBatches stream (True), which costs the daemon
    # a fraction of a unary call, or as unary calls (False). An older daemon without
    # CallBatches gets unary calls either way.
    call_stream: bool


@dataclass(frozen=True)
class _Kept:
    """A client's membership state as a join found it (``Session.restore``)."""

    instance_id: str = field(repr=False)
    joined: Membership | None
    node: NodeMembership | None
    failure: RendezvousError | None
    barrier_counts: dict[str, int]
    leaving: bool
    nodes_waiting: int
    stream_leave: bool
    left: bool
    leave_error: grpc.RpcError | None


JoinMessage = pb.JoinRequest | pb.JoinNodeRequest


@dataclass(frozen=True)
class _Unsettled:
    """A join sent and then given up by its caller (its task cancelled, Ctrl-C) before
    its answer was read: the daemon may have seated it, the answer on its way or read
    and dropped (``Session.unsettle``). Out of repr: the request carries the instance
    id and the id."""

    request: JoinMessage = field(repr=False)
    made: bytes | None = field(repr=False)


def _copied(request: JoinMessage) -> JoinMessage:
    return type(request).FromString(request.SerializeToString())


def _same_join(kept: JoinMessage, new: JoinMessage, pinned: bool) -> bool:
    """Whether ``new`` asks for what ``kept`` asked: the same message but for what each
    send stamps (its wait, its launch age), its instance id, and the id unless pinned."""
    if type(kept) is not type(new):
        return False
    a, b = _copied(kept), _copied(new)
    for request in (a, b):
        request.ClearField("instance_id")
        request.ClearField("wait_timeout_ms")
        if isinstance(request, pb.JoinNodeRequest):
            request.ClearField("launched_ms_ago")
        if not pinned:
            request.ClearField("unique_id")
    return a == b


@dataclass
class Session:
    """Per-client state: the membership, barrier counts and any failure seen."""

    endpoint: str
    job_id: str
    # Out of repr: a traceback showing its frames' locals (Sentry's, by default) would
    # show every caller's session. So are the instance ids below: secrets, as in
    # Membership and NodeMembership (whoever holds one speaks as the member).
    bearer: Bearer = field(repr=False)
    retry: RetryPolicy
    call_timeout: float
    connect_timeout: float
    instance_id: str = field(default="", repr=False)
    joined: Membership | None = None
    barrier_counts: dict[str, int] = field(default_factory=dict)
    failure: RendezvousError | None = None
    on_failure: Callable[[RendezvousError], None] | None = None
    # The client's: a failure that says the daemon is gone (DaemonUnavailable) ends
    # the calls in flight on its call stream, set by the client owning the session.
    on_daemon_lost: Callable[[], None] | None = None
    # Whether a daemon that shut down may serve at this endpoint again (a restart), so
    # that a waiting call it released (DRAINING) waits for it: not the file
    # transport's, which ends with rank 0 (``FileRendezvous`` says so).
    daemon_returns: bool = True
    # From the JoinResponse; 0 when the daemon is too old to acknowledge heartbeats.
    daemon_heartbeat_timeout: float = 0.0
    # Set by leave(): the job's work is done, so losing the daemon now is no failure.
    leaving: bool = False
    # A node agent's join (join_node): the node heartbeats and leaves, not a rank.
    node: NodeMembership | None = None
    # A join() in flight on this client (``start_joining``).
    joining: bool = False
    _joining_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # The instance id of the last node seat this client held: its next join_node
    # names it, so the daemon seats it in the seat kept for it after a failure (a
    # newcomer cannot take it). Not cleared by ``begin``: that seat outlives the join.
    held: str = field(default="", repr=False)
    # This client's own id in every join_node it sends (``JoinNodeRequest.agent_id``):
    # its join again after its wait ended is the same node, not a second one that came.
    agent_id: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)
    # A join this client sent and then gave up on (``unsettle``): the next join asking
    # the same is sent as it, so that a seat the daemon gave it is taken back.
    unsettled: _Unsettled | None = field(default=None, repr=False)
    # That join, when the next join asked something else (``resume``): its seat is
    # left (``given_up_leave``) before the new join is sent.
    forsaken: _Unsettled | None = field(default=None, repr=False)
    # The last call its caller gave up (its name, and what ended it: an asyncio
    # cancellation, Ctrl-C), which a ``with`` block's cause names (``given_up_cause``).
    given_up: tuple[str, BaseException] | None = field(default=None, repr=False)
    # NODES_WAITING: nodes parked for the next generation (scale-up), and who hears it.
    nodes_waiting: int = 0
    # The daemon's rendezvousd version, as its last ListJobs or GetJob said it ("":
    # not asked yet, or a daemon from before it said it).
    daemon_version: str = ""
    # Since when the daemon's state storage fails, in ms since the epoch, as its last
    # ListJobs or GetJob said it (0: it takes writes, or not asked yet).
    storage_failing_since_ms: int = 0
    # The last report_progress, sent with every beat (None: never reported).
    progress: pb.Progress | None = None
    on_nodes_waiting: Callable[[int], None] | None = None
    # Makes one GetMembers call (blocking): how a slim join's table is fetched. Set by
    # the client owning the session, before any join.
    get_members: Callable[[pb.GetMembersRequest], pb.GetMembersResponse] = field(
        init=False, repr=False
    )
    leave_timeout: float = LEAVE_TIMEOUT_S
    # Whether the client said it had not reached its daemon yet (``connected``): said
    # once while that lasts.
    unreached_told: bool = False
    # Set by close(): every later call is refused (``closed_error``).
    closed: bool = False
    # The live heartbeat stream's daemon takes the goodbye on it (its attach's ack
    # said so): leave() says it there, not by a Leave call.
    stream_leave: bool = False
    # The daemon confirmed the goodbye said on the stream (LEFT); or the error that
    # ended the stream after it, if any.
    left: bool = False
    leave_error: grpc.RpcError | None = None
    # The heartbeat thread and the watchdog may both report; on_failure runs once.
    _fail_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def create(cls, endpoint: str, job_id: str, options: ClientOptions) -> Session:
        """A client's session, with the constructor's defaults for what it left out."""
        check_endpoint(endpoint)
        return cls(
            endpoint,
            job_id,
            Bearer.resolve(options.get("token"), options.get("token_file")),
            RetryPolicy(options.get("retry_attempts", 1)),
            options.get("call_timeout", 30.0),
            options.get("connect_timeout", 30.0),
            leave_timeout=options.get("leave_timeout", LEAVE_TIMEOUT_S),
        )

    def heartbeat_interval(self, requested: float | None) -> float:
        """``requested``, or less: a third of the daemon's heartbeat timeout at most.

        Beats slower than the daemon's timeout would have the daemon declare this
        member lost (and this client the daemon silent) while both are healthy.
        ``None`` takes that third (3.3 s against the default 10 s timeout), at most
        ``DEFAULT_HEARTBEAT_S``: a beat only proves liveness, and a dead process is
        seen at once by its stream closing, so beating faster than the timeout needs
        buys no earlier detection and costs the daemon a call per member per beat
        (issue 21: 4,096 members at 1 s were 4,100 calls/s).
        """
        ceiling = longest_beat_s(self.daemon_heartbeat_timeout)
        if requested is None:
            return min(ceiling, DEFAULT_HEARTBEAT_S) if ceiling > 0 else LEGACY_HEARTBEAT_S
        if self.daemon_heartbeat_timeout <= 0:
            return requested
        if requested > ceiling:
            log.info(
                "heartbeat every %.3g s, not %.3g s: the daemon at %s loses members after %.3g s",
                ceiling,
                requested,
                self.endpoint,
                self.daemon_heartbeat_timeout,
            )
            return ceiling
        return requested

    @property
    def token(self) -> str:
        """The token sent now: the one given, or its file's since the daemon refused it."""
        return self.bearer.token

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return self.bearer.metadata

    def token_rotated(self, exc: grpc.RpcError, method: str) -> bool:
        """Whether ``exc`` refused this client's token while its file now holds another
        one, sent from now on: a rotation (the new token added to the daemon, written
        into the clients' files, the old removed). The caller sends again at once,
        once; a refusal of the new token stands. Said with the file, never a token."""
        if exc.code() is not grpc.StatusCode.UNAUTHENTICATED or not self.bearer.reread():
            return False
        log.warning(
            "rendezvousd at %s refused this client's token for %s (job %r); its token "
            "file %s holds another token now (rotated): sending that one",
            self.endpoint,
            method,
            self.job_id,
            self.bearer.file,
        )
        return True

    def begin(self, instance_id: str = "") -> None:
        """A new join (a fresh identity per call; retries inside it reuse it), or an
        attach as ``instance_id``: nothing of the last one is kept."""
        self.instance_id = instance_id or secrets.token_hex(16)
        self.joined, self.node, self.failure, self.barrier_counts = None, None, None, {}
        self.leaving, self.nodes_waiting = False, 0
        self.stream_leave, self.left, self.leave_error = False, False, None

    def member(self) -> Membership:
        if self.failure is not None:
            raise self.failure
        if self.joined is None:
            raise InvalidRequest(
                f"not joined to job {self.job_id!r}: call join() first", job_id=self.job_id
            )
        return self.joined

    def page_fetcher(
        self, job_id: str, generation: int, rank: int, instance_id: str
    ) -> Callable[[int], pb.GetMembersResponse]:
        """``start_rank -> page`` of a generation's table, asked as member ``rank``."""
        call = self.get_members

        def fetch(start: int) -> pb.GetMembersResponse:
            return call(page_request(job_id, generation, rank, instance_id, start))

        return fetch

    def stream_member(self) -> Membership:
        """Who the heartbeat stream speaks for in errors: the member, or a node's first rank."""
        if self.closed:  # close() forgot the member: not "call join() first"
            raise self.closed_error()
        if self.node is not None:
            if self.failure is not None:
                raise self.failure
            return self.node.membership_for(0)
        return self.member()

    def heartbeat_request(self) -> pb.HeartbeatRequest:
        """A stream's first beat: who it speaks for (fixed for the stream's life)."""
        if self.closed:  # close() forgot the member: not "call join() first"
            raise self.closed_error()
        return self.beat(pb.HeartbeatRequest(**self._fields(self.node or self.member())))

    def beat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatRequest:
        """The stream's next beat: ``request`` with the latest ``report_progress``."""
        progress = self.progress
        if progress is None:
            return request
        if len(progress.steps) > (ranks := self.stream_ranks()):
            # One step per rank of the stream: the daemon keeps no more, and a list given
            # before the join was known (report_progress refuses one after) made every
            # beat over the daemon's message limit, failing the whole job. Cut once, in
            # place: the next beat's comparison then finds it sent already.
            del progress.steps[ranks:]
        if request.progress == progress:
            return request
        again = pb.HeartbeatRequest()
        again.CopyFrom(request)
        again.progress.CopyFrom(progress)
        return again

    def stream_ranks(self) -> int:
        """The ranks the heartbeat stream speaks for: a node's, or one member's."""
        if self.node is not None:
            return self.node.gpus_per_node
        return 1

    def plan_join_node(self, **r: Unpack[NodeJoinRequest]) -> JoinPlan:
        """Start a node join: a fresh node instance id, cleared state, the request."""
        self.begin()
        timeout = r.get("timeout")
        wait = JOIN_TIMEOUT_S if timeout is None else timeout
        request = pb.JoinNodeRequest(
            job_id=self.job_id,
            min_nodes=r["min_nodes"],
            max_nodes=r["max_nodes"],
            gpus_per_node=r["gpus_per_node"],
            host=r.get("host") or socket.gethostname(),
            addresses=list(r.get("addresses", ())),
            instance_id=self.instance_id,
            wait_timeout_ms=timeout_ms(wait),
            last_call_ms=int((r.get("last_call") or 0) * 1000),
            slim=True,
            standby=r.get("standby", False),
            previous_instance_id=self.held,
            wire_version=r.get("wire_version", ""),
            agent_id=self.agent_id,
        )
        if (node_rank := r.get("node_rank")) is not None:
            request.node_rank = node_rank
        # A node cannot pin the id: only id_factory makes it, for node 0. A re-join
        # says when it was launched too: a node dropped from its run (stopped, cut
        # off), which the other nodes then finished, opened a new run of the job and
        # waited out its join timeout for nodes that were done (a chaos review).
        launched = r.get("launched")
        plan = JoinPlan(self, None, r.get("id_factory"), wait, time.monotonic(), request, launched)
        self.resume(plan)
        return plan

    def finish_node(self, response: pb.JoinNodeResponse) -> NodeMembership:
        self.daemon_heartbeat_timeout = response.heartbeat_timeout_ms / 1000
        first = response.node_rank * response.gpus_per_node
        ids = response.member_instance_ids
        # A table is only ever fetched after a slim answer, which names every member.
        fetch = self.page_fetcher(
            response.job_id, response.generation, first, ids[0] if ids else ""
        )
        self.node = from_join_node_response(response, fetch)
        self.held = self.instance_id
        return self.node

    def reconnect_window_s(self, asked: float | None) -> float:
        """How long the daemon may be gone before it counts as lost: ``asked`` (the
        client's ``reconnect_window``), else its heartbeat timeout, else 10 s."""
        if asked is not None:
            return asked
        return self.daemon_heartbeat_timeout or DEFAULT_WINDOW_S

    def closed_error(self) -> InvalidRequest:
        """What a call on a closed client raises, from either client (gRPC's own
        errors for a closed channel differ between them and name no job)."""
        return InvalidRequest(
            f"the client of job {self.job_id!r} at {self.endpoint} is closed: make a new "
            "client to call the daemon again",
            endpoint=self.endpoint,
            job_id=self.job_id,
        )

    def tls_refused(self, refusal: str) -> AuthenticationError:
        """The error for a plaintext client of a TLS daemon (``TlsProbe``'s words)."""
        return AuthenticationError(
            refusal,
            code="UNAVAILABLE",
            endpoint=self.endpoint,
            method="Check",
            job_id=self.job_id,
        )

    def report_request(
        self, local_rank: int, cause: str, witness_rank: int | None = None
    ) -> pb.ReportFailureRequest:
        """A node agent's report for its worker at ``local_rank``, or a worker joined
        by rank reporting its own failure (``local_rank`` its own); ``witness_rank``:
        the rank whose report of it the worker relays, if any."""
        n = self.node or self.joined
        if n is None:
            raise InvalidRequest(
                f"report_failure() needs a join of job {self.job_id!r}: call join() or "
                "join_node() first",
                job_id=self.job_id,
            )
        if n is self.joined and local_rank != n.local_rank:
            raise InvalidRequest(
                f"report_failure(local_rank={local_rank}) from rank {n.rank} of job "
                f"{self.job_id!r}: a worker joined by rank reports only its own failure "
                f"(local_rank={n.local_rank}); a node's agent reports its workers'",
                job_id=self.job_id,
                rank=n.rank,
            )
        return pb.ReportFailureRequest(
            job_id=n.job_id,
            generation=n.generation,
            node_rank=n.node_rank,
            instance_id=self.instance_id,
            local_rank=local_rank,
            # Any text: the daemon keeps this much of it (a longer one is cut, not refused).
            cause=bounded(cause),
            witness_rank=witness_rank,
        )

    def attach(self, membership: Membership, instance_id: str) -> None:
        """Act as a member an agent registered: no join, no heartbeat of our own."""
        if not instance_id:
            raise InvalidRequest(
                f"attach() to job {membership.job_id!r} rank {membership.rank} needs the "
                "member instance id its node agent got from join_node()",
                job_id=membership.job_id,
                rank=membership.rank,
            )
        self.begin(instance_id)
        if not isinstance(membership._table, LazyTable) and not membership._table:
            # Handed over without its table (e.g. rebuilt from the agent's message):
            # fetch it on first use as this member.
            fetch = self.page_fetcher(
                membership.job_id, membership.generation, membership.rank, instance_id
            )
            table = LazyTable(fetch, membership.world_size)
            membership = dataclasses.replace(membership, _table=table)
        self.joined = membership

    def start_joining(self, call: str) -> _Kept:
        """Refuse ``call`` (a join) beside another join in flight on this client (two
        threads' joins went out under one identity, and the client then held a mix of
        the two); else what the join must put back should it fail (``restore``)."""
        with self._joining_lock:
            if self.joining:
                raise InvalidRequest(
                    f"{call}() while another join() of job {self.job_id!r} is in flight on "
                    "this client: one client is one member; make a client per rank",
                    job_id=self.job_id,
                )
            self.joining = True
        return _Kept(
            self.instance_id, self.joined, self.node, self.failure, dict(self.barrier_counts),
            self.leaving, self.nodes_waiting, self.stream_leave, self.left, self.leave_error,
        )  # fmt: skip

    def restore(self, kept: _Kept, error: BaseException) -> None:
        """A join that failed leaves the client as it was: it cleared the membership
        first, so a second join refused on a live member (DuplicateRank) left a
        heartbeating member its client no longer knew, and the job failed at the next
        leave() (an SDK misuse review). Refusing such a join on the client's own guess
        refused re-joins its heartbeat had not yet heard were due (a review)."""
        self.instance_id, self.joined, self.node = kept.instance_id, kept.joined, kept.node
        self.barrier_counts, self.leaving = kept.barrier_counts, kept.leaving
        # What the running heartbeat (the kept member's) heard meanwhile stands.
        self.failure = self.failure or kept.failure
        self.nodes_waiting = self.nodes_waiting or kept.nodes_waiting
        self.stream_leave = self.stream_leave or kept.stream_leave
        self.left = self.left or kept.left
        self.leave_error = self.leave_error or kept.leave_error
        m = kept.joined
        if (
            m is not None
            and isinstance(error, RendezvousError)
            and error.reason == "DUPLICATE_RANK"
        ):
            # The daemon's advice (give each worker its own rank) reads as another
            # worker's doing when the holder is this same client.
            error._add(
                f"; this client still holds rank {m.rank} of generation {m.generation}: "
                "leave() first to join again, or make another client for another rank"
            )

    def give_up(self, call: str, error: BaseException) -> None:
        """``call`` ended by ``error``: kept when its caller gave it up (a
        BaseException, not an Exception: asyncio's cancellation, KeyboardInterrupt)."""
        self.given_up = None if isinstance(error, Exception) else (call, error)

    def exit_cause(self, error: BaseException) -> str:
        """The cause a ``with`` block's ``error`` is reported with: its type and text;
        for one that says nothing (asyncio's CancelledError, its timeout's TimeoutError,
        KeyboardInterrupt), what happened and in which call. Peers read
        "CancelledError: " or "TimeoutError: ", which told them nothing."""
        name, text = type(error).__name__, str(error)
        if text:
            return f"{name}: {text}"
        call = None
        if self.given_up is not None:
            given_call, given = self.given_up
            if given in (error, error.__cause__, error.__context__):
                call = given_call
        where = f" while in {call}()" if call else ""
        if isinstance(error, asyncio.CancelledError):
            return f"{name}: the worker's asyncio task was cancelled{where}"
        if isinstance(error, KeyboardInterrupt):
            return f"{name}: the worker was interrupted (Ctrl-C, SIGINT){where}"
        if isinstance(error, TimeoutError) and call:
            return (
                f"{name}: the worker's own deadline (asyncio.timeout(), wait_for()) expired{where}"
            )
        return f"{name} (no message){where}"

    def plan_join(self, **r: Unpack[JoinRequest]) -> JoinPlan:
        """Start a join: a fresh instance id, cleared state, and the first request."""
        self.begin()
        timeout, node_rank = r.get("timeout"), r.get("node_rank")
        timeout = JOIN_TIMEOUT_S if timeout is None else timeout
        plan = JoinPlan(self, r.get("unique_id"), r.get("id_factory"), timeout, time.monotonic())
        known_rank_zero = node_rank == 0 and r["local_rank"] == 0
        plan.request = pb.JoinRequest(
            job_id=self.job_id,
            topology=pb.Topology(num_nodes=r["num_nodes"], gpus_per_node=r["gpus_per_node"]),
            local_rank=r["local_rank"],
            host=r.get("host") or socket.gethostname(),
            address=r.get("address", ""),
            unique_id=plan.make_id() if known_rank_zero else b"",
            instance_id=self.instance_id,
            wait_timeout_ms=timeout_ms(timeout),
            slim=True,
        )
        if node_rank is not None:
            plan.request.node_rank = node_rank
        self.resume(plan)
        return plan

    def unsettle(self, plan: JoinPlan, error: BaseException) -> None:
        """A join that failed: kept for the next join (``resume``) when it was sent and
        then given up by its caller (an asyncio cancellation or timeout, Ctrl-C) rather
        than answered. Its answer may have been on its way, or read and dropped as the
        caller gave up: the daemon then holds the seat, and the world may have formed
        with it. A join with a new identity was refused DuplicateRank by that seat (or
        WORLD_FULL), and the generation failed at the heartbeat timeout, its peers told
        this worker "sent no heartbeat". The same join again is a retry of it: the
        daemon hands the seat back, in the same generation (the same id too: another
        is ID_CONFLICT there). Sending Leave instead would end a formed generation's
        seat under its peers. An answer (a RendezvousError) settles the join."""
        self.unsettled = None
        if plan.sent and not isinstance(error, RendezvousError):
            self.unsettled = _Unsettled(_copied(plan.request), plan.made)

    def resume(self, plan: JoinPlan) -> None:
        """Send ``plan`` as the join given up last (``unsettle``) when it asks the same:
        its instance id and id. Any other join goes with its own, after a Leave for the
        seat the given-up one may hold (``forsaken``, ``given_up_leave``): left to lapse,
        a forming seat was held to its wait, and a formed world's peers heard only at
        the heartbeat timeout that it had "sent no heartbeat"."""
        kept, self.unsettled = self.unsettled, None
        if kept is None:
            return
        if not _same_join(kept.request, plan.request, plan.unique_id is not None):
            self.forsaken = kept
            return
        self.instance_id = plan.request.instance_id = kept.request.instance_id
        plan.made, plan.resumed = kept.made, True
        if plan.request.unique_id:  # made for this request: the kept one instead
            plan.request.unique_id = plan.make_id()

    def given_up_leave(self, closing: bool = False) -> pb.LeaveRequest | None:
        """The Leave for the seat of a join given up and not resumed (``LeaveRequest.
        given_up``: by its instance id, the generation and rank it never learned), or
        None: the next join forsook none, or (``closing``) none is left unsettled."""
        kept = self.unsettled if closing else self.forsaken
        self.forsaken = None
        if closing:
            self.unsettled = None
        if kept is None:
            return None
        return pb.LeaveRequest(
            job_id=kept.request.job_id,
            instance_id=kept.request.instance_id,
            node=isinstance(kept.request, pb.JoinNodeRequest),
            given_up=True,
        )

    def given_up_leave_failed(self, request: pb.LeaveRequest, exc: grpc.RpcError) -> None:
        """One line, no exception: the seat then lapses as before (a forming one at its
        wait, a formed one at the heartbeat timeout)."""
        error = from_rpc_error(exc, endpoint=self.endpoint, method="Leave", job_id=request.job_id)
        # Nothing held (never seated, its generation gone), or an older daemon that
        # read generation 0: nothing this client can do.
        moot = error.reason in ("NOT_A_MEMBER", "STALE_GENERATION", "JOB_NOT_FOUND")
        log.log(
            logging.DEBUG if moot else logging.WARNING,
            "could not tell the daemon at %s that the %s of job %r given up earlier is not "
            "sent again: %s; the seat it may hold lapses at the heartbeat timeout",
            self.endpoint,
            "join_node()" if request.node else "join()",
            request.job_id,
            error.message,
        )

    def barrier_failed(self, name: str) -> None:
        """This round of ``name`` ended without its answer (timed out, cancelled, its
        storage failed, its answer lost): the next barrier() of ``name`` sends the same
        round again, which the daemon answers at once should it have completed after
        all. Counted as done, the name was unusable for the rest of the generation: the
        daemon, which withdrew the timed-out arrival, refused the next round as "out of
        order" and the other ranks waited for this one."""
        if self.barrier_counts.get(name, 0) > 0:
            self.barrier_counts[name] -= 1

    def scope(self) -> dict[str, Any]:
        """The fields naming this member on Barrier, key-value and Heartbeat requests:
        the daemon answers only the worker instance that joined as the rank."""
        if self.closed:  # close() forgot the member: not "call join() first"
            raise self.closed_error()
        return self._fields(self.member())

    def _fields(self, who: Membership | NodeMembership) -> dict[str, Any]:
        """``scope()`` of a member, or of a node agent: its node rank, as a node."""
        fields = {
            "job_id": who.job_id,
            "generation": who.generation,
            "instance_id": self.instance_id,
        }
        if isinstance(who, NodeMembership):
            return fields | {"rank": who.node_rank, "node": True}
        return fields | {"rank": who.rank}

    def barrier_request(self, name: str, wait: float) -> pb.BarrierRequest:
        scope = self.scope()  # first: a failed member must not count a barrier round
        sequence = self.barrier_counts[name] = self.barrier_counts.get(name, 0) + 1
        return pb.BarrierRequest(
            **scope, name=name, sequence=sequence, wait_timeout_ms=timeout_ms(wait)
        )

    def event_error(self, event: pb.JobEvent) -> RendezvousError | None:
        """The error a heartbeat event means for this member, if any: an event that
        ends the generation, as the ABORTED error the daemon would give."""
        generation = f"job {event.job_id!r} generation {event.generation}"
        extra: dict[str, Any] = {}
        if event.kind == pb.JobEvent.PEER_FAILED:
            kind: type[RendezvousError]
            kind, reason = PeerFailed, "PEER_FAILED"
            extra["failed"] = failed = failed_members(event.failed)
            # The daemon's own words and metadata for this failure (Job.generation_fault).
            metadata = {
                "ranks": ",".join(str(f.rank) for f in failed),
                "hosts": ",".join(dict.fromkeys(f.host for f in failed)),
                "generation": str(event.generation),
            }
            message = failed_text(generation, failed)
        elif event.kind == pb.JobEvent.JOB_ABORTED:
            kind, reason = JobAborted, "JOB_ABORTED"
            message = f"{generation} was aborted: {event.reason}"
            metadata = {"reason": event.reason}
            if event.abort_cause:
                # As the daemon's JOB_ABORTED error carries it (Job.generation_fault).
                metadata["abort_cause"] = abort_cause_name(event.abort_cause)
            if event.HasField("closed"):
                # As the daemon's JOB_ABORTED error carries it; absent from a daemon
                # from before, as there.
                metadata["closed"] = "true" if event.closed else "false"
                if event.closed:
                    # A heartbeat stream is a member's of that generation: the run was
                    # closed at it, "placed" as the daemon's error says (a standby called
                    # into it reads a close, not "this standby was not needed").
                    metadata["placed"] = "true"
        else:
            return None
        return kind(
            message,
            **extra,
            code="ABORTED",
            reason=reason,
            endpoint=self.endpoint,
            method="Heartbeat",
            job_id=event.job_id,
            rank=self.joined.rank if self.joined else None,
            metadata=metadata,
        )

    def fail(self, error: RendezvousError) -> None:
        with self._fail_lock:
            if self.failure is not None or self.leaving:
                return
            if isinstance(error, JobEnded) and self.node is not None:
                # A node's ranks are left by its attached workers, not by this
                # client: the job ending because every member left is the job's
                # normal end, and the node's stream is simply over.
                self.leaving = True
                return
            self.failure = error
        if isinstance(error, DaemonUnavailable) and self.on_daemon_lost is not None:
            # A call waiting for the daemon to come back (gRPC's wait_for_ready) would
            # wait out its whole deadline (call_timeout: 30 s by default) and then say
            # "the daemon did not answer in time": it hears the cause now instead.
            self.on_daemon_lost()
        if self.on_failure is not None:
            try:
                self.on_failure(error)
            except Exception:
                # The caller's own code: logged, never raised into the heartbeat (the
                # asyncio client re-raised it from close(), the blocking one printed a
                # bare thread traceback). The failure itself is kept (self.failure).
                log.exception(
                    "on_failure raised while told of job %r's failure (kept: raise_if_failed() "
                    "raises it): %s",
                    self.job_id,
                    error,
                )

    def leave_request(self) -> pb.LeaveRequest | None:
        """The Leave to send, or None when not joined; from here on the job's
        work is over and a lost daemon is not reported as a failure."""
        who = self.node or self.joined
        if who is None:
            return None
        self.leaving = True
        return pb.LeaveRequest(**self._fields(who))

    def leave_beat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatRequest:
        """The stream's last message: its goodbye (``HeartbeatRequest.leave``), with
        the latest ``report_progress`` (the last beat's may be an interval old)."""
        goodbye = pb.HeartbeatRequest()
        goodbye.CopyFrom(self.beat(request))
        goodbye.leave = True
        return goodbye

    def leave_refused(self) -> grpc.RpcError | None:
        """The daemon's refusal of the goodbye said on the stream (the stream's error
        after it, as a Leave call's would be), or None: the stream only broke, and a
        Leave call may still tell it."""
        error = self.leave_error
        if error is None or error.code() in _TRANSIENT_STREAM_CODES:
            return None
        return error

    def leave_wait(self) -> float:
        """How long a goodbye said on the stream waits for the daemon's LEFT: the
        leave timeout, or the daemon's heartbeat timeout if longer.

        Giving up means closing the stream, and gRPC may drop a message the daemon has
        not read yet when the stream's reset follows it (1 in 4 with both arriving at
        once, measured): the member would be lost after all, which is the failure
        this wait avoids (issue 21). Waiting costs only this process's exit time, and
        a daemon that has not read the goodbye within its own heartbeat timeout is
        behind by more than it allows a silent member anyway."""
        return max(self.leave_timeout, self.daemon_heartbeat_timeout)

    def leave_unconfirmed(self, request: pb.LeaveRequest, waited: float) -> None:
        """The goodbye on the stream was not confirmed in time: said, not raised."""
        log.warning(
            "could not tell the daemon at %s that %s of job %r left: no answer "
            "within %g s to the goodbye on its heartbeat stream; the daemon may report "
            "it lost; the job's results are unaffected",
            self.endpoint,
            _leaver(request),
            request.job_id,
            waited,
        )

    def leave_failed(
        self, request: pb.LeaveRequest, exc: grpc.RpcError, problem: str | None = None
    ) -> None:
        """One warning, no exception: a finished job must not turn into a failed one.
        ``problem``: what a plain connect found where no answer came (``exhausted``)."""
        error = from_rpc_error(
            exc,
            endpoint=self.endpoint,
            method="Leave",
            job_id=request.job_id,
            rank=None if request.node else request.rank,
        )
        if problem is not None:
            error = self.exhausted("Leave", 1, error, problem)
        # Gone with its generation (a later one formed, or the job was forgotten):
        # nothing is left to leave. Warned, it read as a problem on every node of a
        # multi-node restart whose peers had re-formed first.
        moot = error.reason in ("STALE_GENERATION", "JOB_NOT_FOUND")
        log.log(
            logging.DEBUG if moot else logging.WARNING,
            "could not tell the daemon at %s that %s of job %r left: %s; "
            "the job's results are unaffected",
            self.endpoint,
            _leaver(request),
            request.job_id,
            error.message,
        )

    def unrepeated(
        self, method: str, attempts: int, error: RendezvousError, problem: str | None = None
    ) -> RendezvousError:
        """``error``, after ``attempts``, not retried: one of a call unsafe to repeat,
        which the daemon may have applied before its answer was lost, says so.
        ``problem``: what a plain connect to the daemon found (``exhausted``)."""
        if problem is not None:
            error = self.exhausted(method, attempts, error, problem)
        if isinstance(error, DaemonUnavailable):
            error.attempts = attempts
        if method not in IDEMPOTENT and not error.reason and error.code in UNKNOWN_OUTCOME:
            error._add(
                "; not repeated: the daemon may have applied it before its answer was "
                "lost, so check its effect before making it again"
            )
        return error

    def too_short(
        self, method: str, attempts: int, last: RendezvousError, limit: float, setting: str
    ) -> RendezvousTimeout:
        """``last``, a call's deadline passed unanswered, reworded for a daemon that
        answered a health check right after it: the call's own deadline (``limit``,
        from ``setting``) is why, not the daemon. ``call_timeout=0.001`` against a
        healthy daemon said "no gRPC server answered on them (... a daemon that is
        stuck)", or "is the daemon running and reachable?"."""
        rank = "" if last.rank is None else f", rank {last.rank}"
        tries = f", in {attempts} attempts," if attempts > 1 else ""
        message = (
            f"{method} to rendezvousd at {self.endpoint} (job {self.job_id!r}{rank}) got no "
            f"answer within its deadline of {limit:g} s ({setting}){tries} though the daemon "
            "answers: it answered a health check right after. "
            + (
                f"That deadline is too short for an answer to arrive: make {setting} longer "
                "(call_timeout is 30 s by default)"
                if limit < SHORT_DEADLINE_S
                else "It is slow to answer this call (loaded, or its storage slow): make "
                f"{setting} longer, or look at the daemon's log"
            )
        )
        return RendezvousTimeout(
            message,
            code=last.code or "DEADLINE_EXCEEDED",
            endpoint=self.endpoint,
            method=method,
            job_id=self.job_id,
            rank=last.rank,
        )

    def exhausted(
        self, method: str, attempts: int, last: RendezvousError, problem: str | None = None
    ) -> RendezvousError:
        """``last`` as the error of ``attempts`` made; ``problem``: what a plain connect
        to the daemon found, when its channel was not connected."""
        if isinstance(last, (DaemonUnavailable, RendezvousTimeout)) and last.reason == "":
            rank = "" if last.rank is None else f", rank {last.rank}"
            return DaemonUnavailable(
                f"{method} to rendezvousd at {self.endpoint} (job {self.job_id!r}{rank}) failed "
                f"after {attempts} attempt{'s' if attempts > 1 else ''}: {last.code or 'no answer'}; "
                + (
                    "is the daemon running and reachable?"
                    if problem is None
                    else problem
                    if isinstance(problem, LocalShortage)  # the fix is on this host
                    else f"{problem}. Check that the daemon runs and listens there"
                ),
                attempts=attempts,
                code=last.code,
                endpoint=self.endpoint,
                method=method,
                job_id=self.job_id,
                rank=last.rank,
            )
        if isinstance(last, DaemonUnavailable) and attempts > 1:
            # The daemon's own reason (STORAGE_UNAVAILABLE, DRAINING) after a retry: its
            # words, and the count protocol.md promises (it read .attempts == 0).
            last.attempts = attempts
            last._add(f" (after {attempts} attempts)")
        return last


def page_request(
    job_id: str, generation: int, rank: int, instance_id: str, start: int
) -> pb.GetMembersRequest:
    """The GetMembers for the page from ``start``, asked as member ``rank``."""
    return pb.GetMembersRequest(
        job_id=job_id, generation=generation, rank=rank, instance_id=instance_id, start_rank=start
    )


def _leaver(request: pb.LeaveRequest) -> str:
    """Who a Leave is for: a node agent's names its node rank, not a rank."""
    return f"node {request.rank}" if request.node else f"rank {request.rank}"


# How often the heartbeat's watchdog looks (the sync client's thread, the asyncio
# client's read); a gap that means this process was stopped, at least
# (``StreamWatch.woke``), and how long the stream then has to hear from the daemon
# before the window counts.
WATCH_S = 0.5
PAUSED_S = 2.0
RESUMED_S = 2.0
# A stream's break this many beats after the last ack is the daemon's going; later, it
# is only when the connection was found dead (``StreamWatch.silent_since``).
PROMPT_BREAK_BEATS = 1.5

# A call failing with these may or may not have reached the daemon.
UNKNOWN_OUTCOME = ("UNAVAILABLE", "DEADLINE_EXCEEDED")

_TRANSIENT_STREAM_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)


@dataclass
class LookBack:
    """The one rule for a daemon whose reconnect window passed while its connection was
    broken, heard by a heartbeat stream (``StreamWatch``) and by a call parked at the
    daemon (``Calls.back_within``, a join released by a daemon's SIGTERM): the endpoint is
    looked at once (``listening``, a plain connect), and found accepting connections
    again, the window gets REDIAL_GRACE_S more; otherwise it has ended.

    gRPC redials a daemon that went away at its backoff, growing to 2 s (+20 %) apart, so
    a daemon restarted with its state late in the window (its members given a whole
    timeout to reattach) was dialled after the window ended, and its members told it was
    unreachable when it was back (at 8 s of 10, 1 run of 2; 3.7-4.1 s of 5, 5 of 6). A
    node agent parked in JoinNode had no look: told "was not back within 10 s" of a
    daemon restarted by SIGTERM 9 s after (3 runs of 4), where running jobs rode it out."""

    endpoint: str
    looked: bool = False
    grace_s: float = 0.0

    def listening(self) -> bool:
        """Whether anything accepts connections at the endpoint (up to LOOK_BACK_S):
        blocking, so the asyncio client runs it on a thread."""
        return listens(self.endpoint, LOOK_BACK_S)

    def found(self, listening: bool) -> None:
        """``listening``: the look's answer; the window is extended at most once."""
        self.looked = True
        if listening:
            self.grace_s = REDIAL_GRACE_S


@dataclass
class StreamWatch:
    """What the heartbeat loops (thread and task) decide; they only do the I/O.

    A daemon that advertised its heartbeat timeout acknowledges heartbeats, so
    silence on the stream for the whole window means the daemon is unreachable,
    whether the connection broke (daemon killed) or packets vanish (cut network).
    An older daemon sends nothing while all is well: then only an outage seen as
    stream errors counts.
    """

    session: Session
    member: Membership
    window: float | None = None
    heard: float = field(default_factory=time.monotonic)
    outage_since: float | None = None
    attempt: int = 0
    # How long this process itself did not run (``woke``), once that was the silence.
    paused_s: float = 0.0
    # The endpoint looked at once the window passed on a broken stream (``may_look_back``),
    # and the grace that look gave.
    look: LookBack = field(init=False)
    # When the blocking client's watchdog last ran (``watchdog_ran``); None for the
    # asyncio client, whose read loop sees its own gaps.
    watchdog_at: float | None = None
    # The stream's beat interval, which the daemon's acks follow (0: not known, every
    # break counts as the daemon's going; ``silent_since``).
    beat_s: float = 0.0
    # Each stream's first beat, made when start_heartbeat() was called: the heartbeat
    # speaks for the member it was started for. Made by the stream's thread when it
    # first pulled a request, a join() called right after start_heartbeat() (whose new
    # identity clears the membership until it is answered) made it raise "not joined",
    # which broke the stream and failed the kept member.
    first: pb.HeartbeatRequest | None = None

    def __post_init__(self) -> None:
        self.look = LookBack(self.session.endpoint)

    @property
    def grace_s(self) -> float:
        return self.look.grace_s

    @property
    def window_s(self) -> float:
        """The caller's window, else the daemon's heartbeat timeout, else 10 s."""
        return self.session.reconnect_window_s(self.window)

    @property
    def done(self) -> bool:
        return self.session.failure is not None or self.session.left

    def deadline(self) -> float | None:
        """When silence becomes DaemonUnreachable; None while there is no clock. The
        window counts from when the daemon went away, as best told (``silent_since``)."""
        if self.session.daemon_heartbeat_timeout > 0:
            return self.silent_since() + self.window_s + self.grace_s
        return None

    def silent_since(self) -> float:
        """When the daemon went away, as best told: the last word heard, or the
        stream's break where it broke within a beat and a half of that word.

        A prompt break is the daemon ending the stream (killed, or restarted), and the
        last ack may be a beat older (up to a third of the window): a daemon restarted
        with its state inside the window after a SIGKILL (its members given a whole
        timeout to reattach) was reported unreachable first (7 s after the kill,
        against a 10 s window). A break found later is no news of when the daemon
        went: acks stopped coming a beat after the last one, and gRPC's keepalive
        finds a cut network's connection dead only ~8 s on. Counting the window from
        that break told a node cut off 18 s after the cut, with a 10 s window (a
        review that followed the docs on namespace hosts)."""
        if self.outage_since is None:
            return self.heard
        if self.beat_s and self.outage_since > self.heard + PROMPT_BREAK_BEATS * self.beat_s:
            return self.heard
        return max(self.heard, self.outage_since)

    def may_look_back(self) -> bool:
        """Whether the window passed on a broken stream with no look at the endpoint
        yet: the twin then asks ``look.listening()`` (off its event loop) and passes the
        answer to ``back_again`` (``LookBack``). A stream that did not break (a hung
        daemon, a cut network) is never looked at: its window is the verdict."""
        if self.look.looked or self.outage_since is None or self.done:
            return False
        deadline = self.deadline()
        return deadline is not None and time.monotonic() >= deadline

    def back_again(self, listening: bool) -> None:
        """What the look found (``LookBack.found``)."""
        self.look.found(listening)

    def on_event(self, event: pb.JobEvent) -> str:
        """ "stop" (the member failed), "reconnect" (daemon draining) or "continue"."""
        self.heard = time.monotonic()
        self.outage_since, self.attempt = None, 0
        if event.stream_leave:
            self.session.stream_leave = True
        if event.kind == pb.JobEvent.LEFT:
            self.session.left = True
            return "stop"
        if event.kind == pb.JobEvent.NODES_WAITING:
            self.session.nodes_waiting = event.nodes_waiting
            if self.session.on_nodes_waiting is not None:
                self.session.on_nodes_waiting(event.nodes_waiting)
            return "continue"
        error = self.session.event_error(event)
        if error is not None:
            self.session.fail(error)
            return "stop"
        return "reconnect" if event.kind == pb.JobEvent.DAEMON_DRAINING else "continue"

    def on_error(self, exc: grpc.RpcError) -> bool:
        """True to reconnect; False when the error ends this member."""
        if exc.code() in _TRANSIENT_STREAM_CODES or self.session.token_rotated(exc, "Heartbeat"):
            return not self.done
        self.session.fail(
            from_rpc_error(
                exc,
                endpoint=self.session.endpoint,
                method="Heartbeat",
                job_id=self.member.job_id,
                rank=self.member.rank,
            )
        )
        return False

    def woke(self, gap: float) -> None:
        """The watchdog ran again ``gap`` seconds after it last did, where it runs
        every WATCH_S (the asyncio client's read: every quarter window): longer than
        half the window, this process was stopped (SIGSTOP, a debugger, a suspended
        machine, an event loop blocked) and the silence was its own. The
        stream gets a moment to tell what the daemon did meanwhile (its acks, or its
        verdict on this member, lost for that silence) before the window counts:
        "the daemon died" was said of a daemon that was fine."""
        if gap > max(PAUSED_S, self.window_s / 2):
            self.paused_s = gap
            self.heard = max(self.heard, time.monotonic() - self.window_s + RESUMED_S)

    def watchdog_ran(self) -> None:
        """The blocking client's watchdog woke (it runs every WATCH_S). Its gap and its
        new clock are one reading: the watchdog measured its gap from a clock read before
        a SIGSTOP that landed before this call, and set its clock after it, so neither it
        nor the stream's thread (``caught_up``) saw the pause, and said "the daemon died"
        of a daemon that was fine (CI: after f605d72 counted the gap first, still 1 run
        in ~3 CI runs)."""
        now = time.monotonic()
        if self.watchdog_at is not None:
            self.woke(now - self.watchdog_at)
        self.watchdog_at = now

    def caught_up(self) -> None:
        """The stream's own thread, as its stream ends, before the verdict: a watchdog
        that has not run for longer than a pause (it runs every WATCH_S) means this
        process was stopped, counted as ``woke`` counts it. After a SIGSTOP the stream's
        thread could see its stream broken (the daemon gave up on its pings) before the
        watchdog saw the gap, and said "the daemon died" of a daemon that was fine (CI,
        once under load)."""
        if self.watchdog_at is not None:
            self.woke(time.monotonic() - self.watchdog_at)  # which judges the gap

    def expired(self) -> bool:
        """True (and the member failed with DaemonUnreachable) once the window passed,
        and the endpoint was looked at if it is due (``may_look_back``)."""
        # A pause since the watchdog last read its clock is this process's silence, not
        # the daemon's, whichever thread gets here first after it (a SIGSTOP can land
        # between any two of its steps).
        self.caught_up()
        if self.may_look_back():
            return False
        now = time.monotonic()
        deadline = self.deadline()
        if deadline is not None and now >= deadline:
            self.session.fail(self.unreachable(now - self.silent_since()))
        elif (
            self.outage_since is not None and now - self.outage_since > self.window_s + self.grace_s
        ):
            self.session.fail(self.unreachable(now - self.outage_since))
        return self.done

    def ended(self, error: grpc.RpcError | None) -> float | None:
        """The stream ended, by ``error`` or not: seconds to wait before reconnecting,
        or None once this member is over."""
        # A next stream (a restarted daemon, maybe an older one) says it again.
        self.session.stream_leave = False
        if self.session.leaving:
            # After leave() said goodbye (here, or by a Leave call): no reconnect; how
            # the stream ended is the goodbye's outcome.
            self.session.leave_error = error
            return None
        if error is not None and not self.on_error(error):
            return None
        return self.next_backoff()

    def next_backoff(self) -> float | None:
        """Seconds to wait before reconnecting, or None once this member is over."""
        self.outage_since = self.outage_since or time.monotonic()
        if self.expired():
            return None
        self.attempt += 1
        delay = self.session.retry.backoff(self.attempt)
        deadline = self.deadline()
        if deadline is not None:
            # Wake at the deadline rather than after it, so the report is on time.
            delay = min(delay, max(0.0, deadline - time.monotonic()))
        return delay

    def unreachable(self, silent_s: float) -> DaemonUnreachable:
        m, s = self.member, self.session
        why = (
            f"something accepts connections there again, but no heartbeat stream "
            f"reattached within {self.grace_s:g} s more"
            if self.grace_s
            else "the daemon died or this node lost its network"
            if not self.paused_s
            else f"this process did not run for {self.paused_s:.1f} s before (stopped: "
            "SIGSTOP, a debugger, or a suspended machine), and the daemon has not answered "
            "since"
        )
        return DaemonUnreachable(
            f"rendezvousd at {s.endpoint} has been unreachable for {silent_s:.1f} s (window "
            f"{self.window_s:g} s) from job {m.job_id!r} rank {m.rank}: {why}, so peer "
            f"failures can no longer be detected; no peer is known to have failed. "
            f"{DAEMON_LOST_ADVICE}",
            code="UNAVAILABLE",
            endpoint=s.endpoint,
            method="Heartbeat",
            job_id=m.job_id,
            rank=m.rank,
            metadata={"unreachable_s": f"{silent_s:.3f}", "window_s": f"{self.window_s:g}"},
        )


#: The end of ``DaemonUnreachable``'s message, the heartbeat's and a call's alike: what
#: its caller, which may go on, can do (torchrun's handler and rendezvous-run's agent,
#: which stop their workers then, say so in their words). A client of no job is told
#: only the check.
DAEMON_CHECK_ADVICE = "Check that the daemon is running and that this host can reach it"
DAEMON_LOST_ADVICE = f"{DAEMON_CHECK_ADVICE}, then restart the job if it cannot finish"


@dataclass
class JoinPlan:
    """The decisions of one ``join()`` call, shared by the sync and asyncio clients."""

    session: Session
    # Out of repr, as Session's secrets: the id, and the request that carries it and
    # the instance id.
    unique_id: bytes | None = field(repr=False)
    id_factory: Callable[[], bytes] | None
    timeout: float
    started: float
    request: pb.JoinRequest | pb.JoinNodeRequest = field(default_factory=pb.JoinRequest, repr=False)
    # A node agent's first join: when it was launched (``NodeJoinRequest.launched``).
    launched: float | None = None
    # The id this join made (``make_id``): one per join, so that a retry, or the next
    # join resuming this one (``Session.resume``), sends the same.
    made: bytes | None = field(default=None, repr=False)
    # Whether the join went to the daemon (``Session.unsettle``).
    sent: bool = False
    # Sent as the join given up last (``Session.resume``), until an answer says that
    # seat's generation is over (``afresh_after``).
    resumed: bool = False

    def stamp(self, left: float) -> None:
        """Before each send of the join: how long it may wait (``left``), and how
        long ago its node was launched."""
        self.request.wait_timeout_ms = timeout_ms(left)
        if self.launched is not None and isinstance(self.request, pb.JoinNodeRequest):
            ago = round(max(0.0, time.monotonic() - self.launched) * 1000)
            self.request.launched_ms_ago = min(ago, UINT64[1])

    def make_id(self) -> bytes:
        """Rank 0's id: the caller's bytes, else ``id_factory()`` (e.g. NCCL's), else 128
        random bytes (all the CPU backend needs: it keys the ring's HMAC)."""
        if self.unique_id is not None:
            # Given, b"" too: refused by the daemon as not 128 bytes, where it was taken
            # for "none given" and replaced without a word (an SDK misuse review).
            return self.unique_id
        if self.made is not None:
            return self.made
        if self.id_factory is None:
            self.made = os.urandom(UNIQUE_ID_BYTES)
            return self.made
        made = self.id_factory()
        if not isinstance(made, bytes):
            # protobuf's bare TypeError named nothing; a tuple is what NCCL's
            # get_unique_id() returns before bytes() (an SDK misuse review).
            raise InvalidRequest(
                f"id_factory() returned {_secret(made)}, not bytes: return rank 0's "
                f"{UNIQUE_ID_BYTES}-byte id as bytes (e.g. bytes(nccl.get_unique_id()))",
                job_id=self.session.job_id,
            )
        self.made = made
        return made

    def left(self) -> float:
        return max(0.001, self.timeout - (time.monotonic() - self.started))

    def fresh_id_after(self, error: RendezvousError) -> bool:
        """True when the join (Join or JoinNode) should be sent again with a new id.

        A restarted daemon fenced the generation the id we sent belonged to: a fresh
        id is all rank 0 needs, unless the caller pinned the bytes. An id factory that
        makes the refused id again cannot help: the error stands (not a loop).
        """
        refused = self.request.unique_id
        if error.reason != "ID_REUSED" or self.unique_id is not None or not refused:
            return False
        self.made = None
        self.request.unique_id = self.make_id()
        return self.request.unique_id != refused

    def afresh_after(self, error: RendezvousError) -> bool:
        """True when the join should be sent again as a new join (an identity and an id
        of its own): it resumed one given up (``Session.resume``), and the daemon says
        that seat's generation is over. Its own cancellation, reaching the daemon
        before the world formed, failed it (as a joiner that died does); without this
        the retry was answered PeerFailed, "its Join was cancelled"."""
        if not self.resumed:
            return False
        self.resumed = False
        self.session.instance_id = self.request.instance_id = secrets.token_hex(16)
        if self.unique_id is None:
            # The failed generation's: ID_REUSED in the next one. Not only when the
            # request carries it: a JoinNode goes without one, its id made when node 0
            # is told id_required (PublishId) and kept for the resumed join.
            self.made = None
            if self.request.unique_id:
                self.request.unique_id = self.make_id()
        return True

    def publish_request(self, response: pb.JoinResponse) -> pb.PublishIdRequest:
        return pb.PublishIdRequest(
            job_id=self.session.job_id,
            generation=response.generation,
            rank=response.rank,
            instance_id=self.session.instance_id,
            unique_id=self.make_id(),
            wait_timeout_ms=timeout_ms(self.left()),
            slim=True,
        )

    def finish(self, response: pb.JoinResponse) -> Membership:
        s = self.session
        s.daemon_heartbeat_timeout = response.heartbeat_timeout_ms / 1000
        fetch = s.page_fetcher(response.job_id, response.generation, response.rank, s.instance_id)
        assert isinstance(self.request, pb.JoinRequest)  # a per-rank join's answer
        s.joined = from_join_response(response, self.request.topology.gpus_per_node, fetch)
        return s.joined
