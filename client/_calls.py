"""Every SDK call as steps: the one client loop both clients run (sans-IO).

Each call is a generator that yields the I/O it needs (``Rpc``, ``Sleep``,
``Blocking``, ``StopStream``, ``Reachable``) and is sent each step's answer, or
has its exception thrown in. All decisions live here: which request to send, how
to read the answer or error, whether to retry, back off or re-plan a fresh id,
and which exception to raise. ``RendezvousClient`` performs the steps with
blocking calls, ``AsyncRendezvousClient`` awaits them: neither decides anything,
so the two cannot drift.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc
from grpc_health.v1 import health_pb2

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client._call_stream import CALL_BATCH_BYTES, _CallStreams
from rendezvousd.client._local_address import LocalAddress
from rendezvousd.client._multiplex import NOT_RUN, timeout_ms
from rendezvousd.client._session import (
    DAEMON_CHECK_ADVICE,
    DAEMON_LOST_ADVICE,
    INT64,
    JOIN_TIMEOUT_S,
    SLACK_S,
    UINT64,
    UNKNOWN_OUTCOME,
    WAIT_TIMEOUT_S,
    ClientOptions,
    JoinPlan,
    JoinRequest,
    LookBack,
    NodeJoinRequest,
    Session,
    StreamWatch,
    abort_cause,
    check_arg,
    check_keywords,
    check_wait,
    log,
    page_request,
)
from rendezvousd.client.connection import (
    DIAL_TIMEOUT_S,
    LOCAL_SHORTAGE,
    SERVICE,
    TLS_PROBE_TIMEOUT_S,
    LocalShortage,
    TlsFiles,
    TlsProbe,
    channel_options,
    dial_problem,
)
from rendezvousd.client.errors import (
    DaemonUnavailable,
    DaemonUnreachable,
    InvalidRequest,
    JobAborted,
    JobEnded,
    PeerFailed,
    RendezvousError,
    RendezvousTimeout,
    callers_own,
    clean_exit,
    from_rpc_error,
)
from rendezvousd.client.membership import (
    LOOPBACK_ADDRESS,
    LazyTable,
    Member,
    Membership,
    NodeMembership,
    advertises_loopback,
    loopback_conflict,
)
from rendezvousd.client.relay import RELAY_STALLED, route_of
from rendezvousd.common.calls import FIELDS
from rendezvousd.common.validation import SHORTEST_HEARTBEAT_S

T = TypeVar("T")
C = TypeVar("C")

SERVING = health_pb2.HealthCheckResponse.SERVING
# Between non-waiting TLS probes: long enough for a refused handshake to show.
PROBE_PAUSE_S = 0.2
# The most of a TLS probe's time kept for its sniff (``probe_tls``).
SNIFF_SHARE_S = 0.5
# Between asks whether a daemon that went away mid-wait is back (``back_within``).
RECHECK_S = 0.25
#: A node join whose wait ended WORLD_INCOMPLETE with more than this left of its own
#: timeout was cut by the daemon's cap on waits: it joins again (``_send_join``). Taken
#: for a cap when it was not, it only waits out the little left.
CAPPED_WAIT_MARGIN_S = 0.1
#: A client still not connected to its daemon this long after it began to wait says
#: so (a warning on the ``rendezvousd.client`` logger), once per outage.
UNREACHED_NOTE_S = 5.0
#: The most of a call's (or a connect's) deadline kept for the look at why it got no
#: answer (a health Check, the TLS probes, a plain connect), and never more than a
#: quarter of it. Taken after the deadline, that look made a call_timeout=3 call end
#: at 5 s at a host that drops packets, and barrier(timeout=3), due at 8 s, at 12 s.
DIAGNOSIS_S = 2.0


#: The least time the health Check of that look gets, past the deadline where less is
#: left: a healthy daemon's answer (a round trip) still names a deadline too short to
#: hold it (call_timeout=0.001) as the cause, where none was the daemon's fault.
LOOK_FLOOR_S = 0.2


def diagnosis_share(limit: float) -> float:
    """What of a deadline of ``limit`` seconds is kept for the look at why it passed."""
    return min(DIAGNOSIS_S, limit / 4)


def _parks(request: Any) -> bool:
    """Whether the call waits at the daemon (a join, rank 0's id for it, a barrier, a
    KvGet with wait)."""
    if isinstance(request, pb.KvGetRequest):
        return request.wait
    parking = (pb.JoinRequest, pb.JoinNodeRequest, pb.PublishIdRequest, pb.BarrierRequest)
    return isinstance(request, parking)


@dataclass(frozen=True)
class Rpc:
    """One unary gRPC call, made once: retries are the core's decision, not gRPC's."""

    method: str
    request: Any
    timeout: float
    # The health service's stub instead of the rendezvous one.
    health: bool = False
    # None: the channel's default (wait for the daemon to be up).
    wait_for_ready: bool | None = None

    @property
    def streamable(self) -> bool:
        """Whether it may travel on the client's call stream: a Rendezvous method
        made the patient way (the TLS probe's calls must fail fast, and say why), and
        small enough to share a batch. A request over the daemon's message limit ended
        the whole stream (gRPC refuses the message, not the call in it): every call in
        flight on it failed, a barrier parked on another thread named "the request is
        100069 bytes". Unary, gRPC refuses that call alone."""
        return (
            not self.health
            and self.wait_for_ready is None
            and self.method in FIELDS
            and self.request.ByteSize() <= CALL_BATCH_BYTES
        )

    def invoke(
        self,
        rendezvous: Any,
        health: Any,
        metadata: tuple[tuple[str, str], ...],
        *,
        future: bool = False,
    ) -> Any:
        """The call (asyncio stubs: awaitable; sync stubs with ``future``: a grpc.Future
        the client can cancel), or its result (sync stubs)."""
        extra = {} if self.wait_for_ready is None else {"wait_for_ready": self.wait_for_ready}
        rpc = getattr(health if self.health else rendezvous, self.method)
        if future:
            rpc = rpc.future
        return rpc(self.request, timeout=self.timeout, metadata=metadata, **extra)


@dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclass(frozen=True)
class Blocking:
    """Blocking work other than gRPC (a TLS sniff over a socket of its own): inline in
    the sync client, on a thread in the asyncio one, so it never stalls the loop."""

    work: Callable[[], Any]


@dataclass(frozen=True)
class StopStream:
    """End this client's heartbeat stream and wait for it to be gone."""


@dataclass(frozen=True)
class Reachable:
    """Answered True when the channel is READY, now or within ``timeout`` of being asked
    to connect; False when it failed to connect (TRANSIENT_FAILURE) or was still
    connecting at the timeout.

    gRPC reports READY only after the daemon's TLS handshake accepted us and its HTTP/2
    SETTINGS arrived (grpc/grpc#23636, since 1.32): a plaintext client at a TLS daemon,
    a TLS client without an acceptable certificate at a mutual-TLS one, a port that is
    not a gRPC server, all fail or stay connecting (``tests/client/test_reachable.py``
    pins this), so READY proves what the health probe would, without the daemon
    answering a call."""

    timeout: float


@dataclass(frozen=True)
class LeaveOnStream:
    """Send the goodbye (``Session.leave_beat``) as the heartbeat stream's last message
    and wait up to ``timeout`` for the stream to end. Answered True when the daemon
    confirmed it (LEFT), False when there was no live stream to say it on or it ended
    without the confirmation, None when it still runs at the timeout."""

    timeout: float


@dataclass(frozen=True)
class Connect:
    """Connect the channel within ``timeout``: answered True once connected, False
    when it was not."""

    timeout: float


@dataclass(frozen=True)
class Renew:
    """Before a call, and where a connection failed: unless the channel is connected
    (READY: its connection works whatever the files hold now, and nothing is read),
    ask ``Calls.renewed`` (off the event loop: a stat of each TLS file, a read once
    one changed) and, given credentials, make the channel anew from them, its stubs
    and call stream with it, as after any reconnect; answered True when it did. So a
    client whose certificate was renewed on disk shows the new one at its redial.
    ``readdressed``: made anew whatever its state and files, as this host lost the
    address its connection was made from (``LocalAddress``): READY, it was no use."""

    readdressed: bool = False


@dataclass(frozen=True)
class OpenStream:
    """Open the heartbeat stream's call now, before the join is sent, without a message
    yet (after the call stream, where the client has one): ``start_heartbeat()`` sends
    its first beat on it. A daemon hands new calls to its handlers one at a time, in
    arrival order; in a join storm (4,096 per-rank clients at once) a stream opened only
    after the join's answer queued behind the other clients' connects for 6-10 s, past
    the heartbeat timeout that started when the job formed, and both sides gave up on
    each other (issue 21). Opened with the join, it is handed over while the join
    waits, and the first beat is a message on it."""


Step = (
    Rpc | Sleep | Blocking | StopStream | Reachable | LeaveOnStream | Connect | OpenStream | Renew
)
Steps = Generator[Step, Any, T]


class Run(Generic[T]):
    """Steps one call: iterating gives each step due; the driver leaves the step's
    ``answer`` (or ``error``) before taking the next. Then the result is ``value``."""

    def __init__(self, steps: Steps[T]) -> None:
        self._steps = steps
        self.answer: Any = None
        self.error: BaseException | None = None
        self.value: T

    def __iter__(self) -> Iterator[Step]:
        while True:
            answer, error, self.answer, self.error = self.answer, self.error, None, None
            try:
                step = self._steps.send(answer) if error is None else self._steps.throw(error)
            except StopIteration as done:
                self.value = done.value
                return
            yield step


class Calls:
    """The SDK's calls for one client: its session, TLS probe and leave timeout."""

    def __init__(self, endpoint: str, job_id: str, options: ClientOptions) -> None:
        self.s = Session.create(endpoint, job_id, options)
        self.tls = options.get("tls")
        # The files the channel was made from, looked at again where a connection fails.
        self.files = None if self.tls is None else TlsFiles(self.tls)
        self.probe = TlsProbe(
            endpoint, tls=self.tls is not None, cert=None if self.tls is None else self.tls.cert
        )
        self.reconnect_window = options.get("reconnect_window")
        # Rpc steps as messages on one CallBatches stream (False: one unary call each).
        self.call_stream = options.get("call_stream", True)
        # The first call of a client that is no member yet looks at the daemon first
        # (``first_look``); a join and connect() always do.
        self.looked = False
        # The address this host reached the daemon from as it joined: a call on a
        # channel whose connection was made from an address the host no longer has
        # waited its whole deadline (``readdress``).
        self.local = LocalAddress(endpoint)

    def channel(
        self, secure: Callable[..., C], insecure: Callable[..., C], credentials: Any = None
    ) -> C:
        """The client's channel, made by its gRPC flavour's ``secure``/``insecure_channel``
        (of ``credentials``, a renewal's, else of the TLS files as they are now)."""
        options = channel_options(self.s.retry, self.tls.server_name if self.tls else None)
        if self.tls is not None:
            made = credentials or self.tls.credentials()
            return secure(self.s.endpoint, made, options=options)
        return insecure(self.s.endpoint, options=options)

    def renewed(self, made: int) -> tuple[int, Any] | None:
        """For a channel made at renewal ``made``: the renewal it is behind and its
        credentials, else None (``TlsFiles.renewed``). Asked for each channel of the
        client (its own, before a heartbeat stream's redial and where a call found no
        connection, ``renewal``; its member table's, ``_tables``)."""
        if self.files is None or not self.files.changed(made):
            return None
        return self.files.renewed(self.s.endpoint, made)

    def renewal(self) -> Steps[bool]:
        """Where a connection failed: the channel made anew when the TLS files were
        renewed (``Renew``); whether it was."""
        if self.files is None:
            return False
        return bool((yield Renew()))

    def readdress(self, *, now: bool = False) -> Steps[bool]:
        """Where this host lost the address its channel connected from (re-addressed
        under this client): the channel made anew, from the address the host has now,
        which is noted in turn; whether it was. Free until a join noted an address;
        looked at once a second at most, unless ``now`` (``LocalAddress.gone``)."""
        if self.local.gone(now=now) is None:
            return False
        renewed = bool((yield Renew(readdressed=True)))
        yield Blocking(self.local.note)
        return renewed

    # -- one call, with the retry policy ---------------------------------------

    def call(
        self,
        method: str,
        request: Any,
        *,
        timeout: float | None = None,
        health: bool = False,
        look: bool = True,
    ) -> Steps[Any]:
        """``method`` with retries as the policy allows; errors as ``RendezvousError``.
        ``look``: False on a channel that cannot answer ``Reachable`` (the member
        table's own, ``BlockingMembers``), where the first look would cost a health
        Check and read a daemon not up yet as gone."""
        s = self.s
        rank = s.joined.rank if s.joined else None
        # 0 is a deadline that ends at once, as a wait of 0 does; None is the default.
        limit = s.call_timeout if timeout is None else timeout
        # Named in a deadline's error where the daemon answers (``Session.too_short``).
        setting = "call_timeout" if limit == s.call_timeout else f"the {method} call's timeout"
        # One deadline for the whole call, its retry and the look at why it got no
        # answer included: each attempt waited its whole limit again, and the look
        # came after (kv_get(timeout=3), due at 8 s, ended at 22 s at a lost host).
        share = diagnosis_share(limit)
        deadline = time.monotonic() + limit
        if look and not health and (not self.looked or self.probe.seen_tls):
            # A client's first call where no join looked first (``before_join``): an
            # inspecting client (list_jobs(), `rendezvousd status`), a plaintext one of a
            # TLS daemon, heard it after its whole call timeout (30 s) and a retry; an
            # attached worker after the call's wait (8 s of call_timeout=10), at each
            # call, as the mismatch was known (``seen_tls``: asked again directly).
            # The look's wait is the call's own: counted in its first attempt's deadline.
            started = time.monotonic()
            looked = yield from self.first_look(min(TLS_PROBE_TIMEOUT_S, limit))
            # An attached worker's call waits for the daemon itself, within its own
            # deadline and retries, as before: the look only spares it the TLS wait.
            if not looked and s.joined is None and s.node is None:
                # Not connected: waited for within connect_timeout, as a join waits, then
                # what a plain connect finds there. The call itself waited its whole
                # timeout and a retry (60 s at a refused port, connect_timeout=2 or not)
                # to say the same.
                yield from self.connected(
                    method, started, min(s.connect_timeout, limit), setting, call=limit
                )
        # A refused token re-read from its file (a rotation) is sent again at once, once,
        # and spends none of the retries a transient failure gets.
        rotated = 0
        for attempt in itertools.count(1):
            # A waiting call on a channel whose certificate the daemon refuses (renewed
            # on disk since, the old one expired) would wait its whole deadline: the
            # channel is made anew first. Free while the channel is connected.
            if self.files is not None:
                yield from self.renewal()
            yield from self.readdress()
            wait = max(0.0, deadline - share - time.monotonic())
            try:
                answer = yield Rpc(method, request, wait, health)
                s.unreached_told = False  # reached: a later outage is said again
                return answer
            except grpc.RpcError as exc:
                if not rotated and s.token_rotated(exc, method):
                    rotated = 1
                    continue
                error = from_rpc_error(
                    exc, endpoint=s.endpoint, method=method, job_id=s.job_id, rank=rank
                )
                if (
                    isinstance(s.failure, DaemonUnavailable)
                    and error.code in UNKNOWN_OUTCOME
                    and not error.reason
                ):
                    # The heartbeat already said why no daemon answers (and ended this
                    # call then: Session.fail): no retry can change it.
                    raise s.failure from None
                # A deadline the daemon answered with its reason is its verdict on a
                # wait (a key never set, ranks missing), not a lost answer: asked again,
                # a KvGet waited its timeout twice and said it had waited once. (A
                # stalled relay's reason is the SDK's own: re-made on its own channel.)
                # A waiting call the daemon released as it shut down (SIGTERM: a
                # restart, an upgrade) is no verdict: it is re-sent once the daemon
                # serves again, as one cut by a daemon killed is (a SIGTERM restart
                # failed jobs that a SIGKILL restart left running). Any other DRAINING
                # answer is one.
                # A call the daemon did not run as it shut down (its stream ended before
                # it read the call, or it answered "not run") is re-sent once a daemon
                # serves again, a KvAdd too, where "not repeated: it may have been
                # applied" failed a worker.
                not_run = s.daemon_returns and (
                    error.reason == NOT_RUN
                    or (error.reason == "DRAINING" and error.metadata.get("run") == "no")
                )
                drained = error.reason == "DRAINING" and _parks(request) and s.daemon_returns
                verdict = (error.reason == "DRAINING" and not drained and not not_run) or (
                    error.code == "DEADLINE_EXCEEDED" and error.reason not in ("", RELAY_STALLED)
                )
                retry = not verdict and (not_run or s.retry.retryable(method, exc.code()))
                unanswered = not health and error.code in UNKNOWN_OUTCOME and not error.reason
                waits_back = not_run or (error.code == "UNAVAILABLE" and _parks(request))
                # Drawn once (it is jittered): checked against the deadline, then slept.
                pause = s.retry.backoff(attempt - rotated)
                if error.reason == RELAY_STALLED:
                    # The agent, not the daemon, failed to answer, and the wire's
                    # deadline is spent: the re-make on the worker's own channel gets
                    # half the share kept for the look (which it may still need). It
                    # got none, and a worker whose agent stalled failed its kv_get.
                    share /= 2
                # A retry is made within the call's deadline (one that waits for a
                # restarted daemon gets a deadline anew, as the restart's first call).
                spent = not waits_back and deadline - share - time.monotonic() <= pause
                if not retry or spent or attempt - rotated > s.retry.attempts:
                    problem = None
                    if unanswered:
                        answers, problem = yield from self.no_answer(error, deadline)
                        if answers:
                            short = s.too_short(method, attempt, error, limit, setting)
                            raise s.unrepeated(method, attempt, short) from None
                    if not retry:
                        raise s.unrepeated(method, attempt, error, problem) from None
                    raise s.exhausted(method, attempt, error, problem) from None
                if unanswered:
                    # Before waiting again: a TLS mismatch never connects, whatever the
                    # wait (a plaintext list_jobs() of a TLS daemon heard it after 60 s).
                    # Within what the retry leaves of the deadline: a whole probe here
                    # made a call_timeout=8 call end at 8.3 s at a black-holed host.
                    yield from self.tls_look(
                        TLS_PROBE_TIMEOUT_S
                        if waits_back
                        else max(
                            0.0,
                            deadline - share - time.monotonic() - pause,
                        )
                    )
                if waits_back:
                    # Re-sent, it would wait its whole wait (600 s by default) for a
                    # daemon to come back: first, the daemon back within the window, as a
                    # restart is, or its loss said now, as the heartbeat says it. A call
                    # not run waits for a daemon serving: the one shutting down still
                    # answers (NOT_SERVING), and ends every new stream unread.
                    yield from self.back_within(method, rank, drained=drained or not_run)
                    deadline = time.monotonic() + limit + pause
            yield Sleep(pause)

    def no_answer(self, error: RendezvousError, deadline: float) -> Steps[tuple[bool, str | None]]:
        """Why a call got no answer, looked at by ``deadline`` (``time.monotonic()``),
        never after it (at most 2 * DIAGNOSIS_S): whether the daemon answers a health
        check after a deadline passed (then the call's own deadline is the cause,
        ``Session.too_short``), and else what was found. A TLS mismatch is raised;
        where the channel is not connected, what a plain connect finds. A daemon that
        answers no health check within the look's time is itself the finding, with
        what a plain connect there finds: on a channel
        still READY at a host that went silent, "the daemon did not answer in time"
        read as a slow call (``RendezvousTimeout``), and the next call said "is the
        daemon running and reachable?" with no cause."""
        now = time.monotonic()
        # The floor: a deadline too short to hold a health Check (call_timeout=0.001)
        # still gets one, so that a healthy daemon names the deadline as the cause.
        end = max(now + LOOK_FLOOR_S, min(now + 2 * DIAGNOSIS_S, deadline))
        problem = yield from self.tls_mismatch(end - now)
        if problem is not None:
            return False, problem
        if error.code != "DEADLINE_EXCEEDED":
            return False, (yield from self.dialed(end))
        # Half the look for the Check (a round trip answers it), the other half for a
        # connect that can conclude: at a silent host it only ever times out.
        checked = max(LOOK_FLOOR_S, (end - time.monotonic()) / 2)
        if (yield from self.answers(within=checked)):
            return True, None
        found = yield from self.dialed(end)
        told = f"the daemon answers no health check within {checked:.2g} s"
        return False, told if found is None else f"{told}, and {found}"

    def back_within(self, method: str, rank: int | None, *, drained: bool = False) -> Steps[None]:
        """Return once the channel is READY again (``drained``: the daemon shut down, and
        is back only once a daemon serves there again: the draining one still answers,
        NOT_SERVING, for its grace); raise ``DaemonUnreachable`` when it is not within
        the reconnect window (``Session.reconnect_window_s``), and the redial grace a
        look at the endpoint then gives, as a heartbeat stream's window gets it
        (``LookBack``). ``Reachable`` answers False at a refused connect, so it is
        asked again every ``RECHECK_S``."""
        s = self.s
        window = s.reconnect_window_s(self.reconnect_window)
        look = LookBack(s.endpoint)
        # By the clock: a draining daemon's NOT_SERVING answers make a round longer
        # than RECHECK_S, and counted in rounds the window outgrew what it says.
        began = time.monotonic()
        while True:
            if (yield Reachable(RECHECK_S)) and (yield from self.answers(serving=drained)):
                return
            if (yield from self.renewal()):
                continue  # a certificate renewed on disk: the new channel asked at once
            if time.monotonic() - began >= window + look.grace_s:
                if look.looked:
                    break
                look.found((yield Blocking(look.listening)))
                if not look.grace_s:
                    break
            yield Sleep(RECHECK_S)
        went = "shut down (draining)" if drained else "went away"
        why = (
            f"something accepts connections there again, but no daemon served within "
            f"{look.grace_s:g} s more"
            if look.grace_s
            else "the daemon was stopped and not started again"
            if drained
            else "the daemon died or this host lost its network"
        )
        gone_s = time.monotonic() - began
        # Worded as the heartbeat's loss is (``StreamWatch.unreachable``), so each caller
        # that says it in its own words (torchrun's, the launcher's) finds the advice; a
        # client of no job (`rendezvousd status`) has neither a job to name nor to restart.
        who = (
            f" (job {s.job_id!r}" + ("" if rank is None else f", rank {rank}") + ")"
            if s.job_id
            else ""
        )
        raise DaemonUnreachable(
            f"rendezvousd at {s.endpoint} {went} during {method}{who} and was not back "
            f"within {window:g} s (the reconnect window): {why}. "
            + (DAEMON_LOST_ADVICE if s.job_id else DAEMON_CHECK_ADVICE),
            code="UNAVAILABLE",
            endpoint=s.endpoint,
            method=method,
            job_id=s.job_id,
            rank=rank,
            metadata={"unreachable_s": f"{gone_s:.3f}", "window_s": f"{window:g}"},
        )

    def answers(self, *, serving: bool = False, within: float = RECHECK_S * 2) -> Steps[bool]:
        """Whether the daemon answers a health check within ``RECHECK_S * 2`` (``serving``:
        and says SERVING). A READY channel alone does not say so right after the daemon
        died: the asyncio client has seen its call end before gRPC marked the connection
        gone, and a call re-sent then waited out its whole deadline (60 s in the test)
        for a daemon that is gone."""
        try:
            response = yield Rpc(
                "Check",
                health_pb2.HealthCheckRequest(service=SERVICE),
                max(0.0, min(RECHECK_S * 2, within)),
                health=True,
                wait_for_ready=False,
            )
        except grpc.RpcError:
            return False
        return not serving or response.status == SERVING

    # -- health and TLS ------------------------------------------------------------

    def connect(self) -> Steps[None]:
        """Connected, and the call stream open, within the connect timeout; no call
        where the channel connects at once. Else the TLS look a join makes first
        (``before_join``): a plaintext client of a TLS daemon waited its whole
        connect_timeout and heard "no gRPC server answered"."""
        started = time.monotonic()
        if not (yield from self.first_look(min(TLS_PROBE_TIMEOUT_S, self.s.connect_timeout))):
            yield from self.connected("connect", started)
        # Everything a join sends on: the call stream and the heartbeat stream
        # opened with the join (``OpenStream``), its start out of the join.
        yield OpenStream()

    def connected(
        self,
        method: str,
        started: float,
        within: float | None = None,
        shorter: str = "the join's timeout",
        call: float | None = None,
    ) -> Steps[None]:
        """Return once the channel is connected; ``DaemonUnavailable`` when it is not
        within ``within`` (``connect_timeout``, or ``shorter``, the caller's own
        timeout) of ``started``. gRPC reconnects meanwhile, with its backoff: a daemon
        that comes up late is found. ``call``: the deadline of the call this is the
        first of, named as the cause where the daemon answers once given longer."""
        s = self.s
        limit = s.connect_timeout if within is None else within
        which = "connect_timeout" if limit == s.connect_timeout else shorter
        # The look at why it is not connected is made within ``limit``, not after it:
        # a plain connect to a host that drops packets made connect_timeout=3 take 5 s.
        end = started + limit
        wait_end = end - diagnosis_share(limit)
        first = UNREACHED_NOTE_S - (time.monotonic() - started)
        if first < end - time.monotonic() and not s.unreached_told:
            # Said once while it waits on: a client started before its daemon (a node
            # agent, torchrun's) was silent for its whole connect_timeout (30 s), which
            # reads as a hang. Once per outage: an agent's joins asked again every
            # second would say it every time. Before the share kept for the look at
            # the end, where that comes first (a connect_timeout of 6 s said nothing).
            if (yield Connect(max(0.0, min(first, wait_end - time.monotonic())))):
                return
            problem = yield from self.dialed(wait_end)
            if isinstance(problem, LocalShortage):
                raise self.short_of(method, problem)
            s.unreached_told = True
            log.warning(
                "%srendezvousd at %s not reached after %.0f s%s; still trying, for "
                "up to %g s (%s): a daemon that comes up meanwhile is found",
                f"job {s.job_id!r}: " if s.job_id else "",  # a client of no job: status
                s.endpoint,
                time.monotonic() - started,
                "" if problem is None else f": {problem}",
                limit,
                which,
            )
        if (yield Connect(max(0.0, wait_end - time.monotonic()))):
            s.unreached_told = False
        else:
            if (
                call is not None
                and limit < s.connect_timeout
                and (
                    yield from self.answers(within=max(LOOK_FLOOR_S, (end - time.monotonic()) / 2))
                )
            ):
                # Not the daemon (the plain connect said "no gRPC server answered on
                # them ... a daemon that is stuck"): the call's own deadline.
                raise s.too_short(method, 1, DaemonUnavailable(""), call, shorter)
            problem = yield from self.dialed(end)
            if isinstance(problem, LocalShortage):
                raise self.short_of(method, problem)
            # A cause told at once (nothing listens) leaves the kept share unspent: a
            # daemon that comes up within it is still found.
            if end - time.monotonic() > 0 and (yield Connect(end - time.monotonic())):
                s.unreached_told = False
                return
            raise DaemonUnavailable(
                f"rendezvousd at {s.endpoint} could not be connected to within "
                f"{limit:g} s ({which})"
                + ("" if problem is None else f": {problem}")
                + ". Check that it runs and listens there, and that this host can reach it",
                attempts=1,
                code="UNAVAILABLE",
                endpoint=s.endpoint,
                method=method,
                job_id=s.job_id,
            )

    def short_of(self, method: str, problem: LocalShortage) -> DaemonUnavailable:
        """A connect this host cannot make (out of descriptors or local ports): said at
        once, as the fix is here, not at the daemon."""
        s = self.s
        return DaemonUnavailable(
            f"rendezvousd at {s.endpoint} could not be connected to: {problem}",
            attempts=1,
            code="UNAVAILABLE",
            metadata={LOCAL_SHORTAGE: problem.kind},
            endpoint=s.endpoint,
            method=method,
            job_id=s.job_id,
        )

    def before_join(self, timeout: float | None) -> Steps[None]:
        """What a join needs to know first: that the daemon is there and takes our
        TLS, else one clear error now rather than a wait for the join's timeout.
        Within ``connect_timeout``, or the join's own ``timeout`` if shorter (a
        join(timeout=5) at a silent port took the 30 s connect timeout)."""
        # A daemon this process already found speaking TLS to a plaintext client is
        # asked directly (``probe_tls``), never by letting gRPC connect: each attempt
        # would be one more "Handshake failed" line in the daemon's log.
        started = time.monotonic()
        # The calls after the join need no look of their own (``call``).
        self.looked = True
        within = min(self.s.connect_timeout, JOIN_TIMEOUT_S if timeout is None else timeout)
        # Half the connect timeout at most: the probes that tell why get the rest.
        look = min(TLS_PROBE_TIMEOUT_S, within / 2)
        if not self.probe.seen_tls and (yield Reachable(look)):
            self.s.unreached_told = False
            # Connected: the daemon is reachable and accepted our TLS, and a draining
            # daemon answers the join itself with DRAINING, which is raised at once.
            # The Check this saves cost the daemon about 0.5 ms of CPU per cold client,
            # a third of a cold per-rank join (benchmarks/rendezvous_scale.py, cold).
            return
        yield from self.check_health(started, within)

    def first_look(self, wait: float) -> Steps[bool]:
        """Whether the channel connects within ``wait`` (or the daemon answered the
        TLS probe); else raise the TLS mismatch, if that is why it does not. A READY
        channel costs nothing more: the call would have waited for it anyway. A
        channel still connecting after ``wait`` (a silent port, a slow route) is not
        probed: a refused handshake fails the connect at once, and each probe there
        waits its 2 s and a sniff."""
        self.looked = True
        started = time.monotonic()
        if not self.probe.seen_tls:
            if (yield Reachable(wait)):
                return True
            if time.monotonic() - started >= wait:
                return False
        return (
            yield from self.probe_tls(health_pb2.HealthCheckRequest(service=SERVICE))
        ) is not None

    def tls_mismatch(self, within: float = 2 * DIAGNOSIS_S) -> Steps[str | None]:
        """After a call found no daemon: raise the TLS mismatch that kept its channel
        from connecting, if that is why. A join asks first (``before_join``); a client
        that never joins (attached, or only inspecting) would otherwise hear "is the
        daemon running?" for a wrong CA, or a forgotten one, after every retry. Else,
        when the channel is not connected, what a plain connect there finds. Within
        ``within`` in all, the probes half, the plain connect the rest."""
        end = time.monotonic() + within
        if (yield from self.tls_look(within / 2)):
            return (yield from self.dialed(end))
        return None

    def dialed(self, end: float) -> Steps[str | None]:
        """What a plain connect to the daemon finds (``None``: nothing to say), waiting
        up to ``end`` (``time.monotonic()``) and at most DIAL_TIMEOUT_S; a few ms at
        least, so that a refusal or a listener still shows."""
        wait = max(0.01, min(DIAL_TIMEOUT_S, end - time.monotonic()))
        found: str | None = yield Blocking(functools.partial(dial_problem, self.s.endpoint, wait))
        return found

    def tls_look(self, within: float = TLS_PROBE_TIMEOUT_S) -> Steps[bool]:
        """Raise the TLS mismatch that keeps the channel from connecting, if that is
        why; whether the channel is not connected."""
        if (yield Reachable(0.0)):
            return False
        # A certificate renewed on disk is shown before anything is concluded: the
        # old one may be what the daemon refuses (expired, or its CA no longer trusted).
        if (yield from self.renewal()) and (yield Reachable(within / 2)):
            return False
        yield from self.probe_tls(health_pb2.HealthCheckRequest(service=SERVICE), within)
        return True

    def check_health(
        self, started: float | None = None, within: float | None = None
    ) -> Steps[None]:
        """Fail fast, with one clear error, when the daemon is down or draining: a
        health Check, always (a READY channel says nothing of draining). A daemon not
        up yet is waited for within ``connect_timeout`` of ``started`` (else of now),
        the TLS probes' time included (a port that accepts and never answers, or a
        host that drops packets, spends 2 s in each)."""
        started = time.monotonic() if started is None else started
        request = health_pb2.HealthCheckRequest(service=SERVICE)
        limit = self.s.connect_timeout if within is None else within
        # The probes leave the plain connect that names the cause its share.
        left = limit - diagnosis_share(limit) - (time.monotonic() - started)
        probed = yield from self.probe_tls(request, within=left)
        if probed is not None and probed.status == SERVING:
            return
        if probed is None:
            # No answer yet: the daemon is waited for within connect_timeout in all.
            # A Check that waited for it, then retried as a transient failure, took
            # twice that (61 s at the default against a refused port).
            yield from self.connected("Check", started, limit)
        s = self.s
        for attempt in itertools.count(1):
            response = yield from self.call("Check", request, timeout=limit, health=True)
            if response.status == SERVING:
                return
            if attempt > s.retry.attempts:
                raise DaemonUnavailable(
                    f"rendezvousd at {s.endpoint} is not serving (status "
                    f"{health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)}) after "
                    f"{attempt} health checks; it may be draining or restarting",
                    attempts=attempt,
                    code="UNAVAILABLE",
                    endpoint=s.endpoint,
                    method="Check",
                    job_id=s.job_id,
                )
            yield Sleep(s.retry.backoff(attempt))

    def probe_tls(
        self, request: health_pb2.HealthCheckRequest, within: float = TLS_PROBE_TIMEOUT_S
    ) -> Steps[health_pb2.HealthCheckResponse | None]:
        """Raise at once when the daemon refuses our TLS, or speaks TLS to a plaintext
        client; see ``TlsProbe``. The daemon's answer when it gave one. Within
        ``within`` (the connect timeout's rest) in all: a TLS mismatch answers at once,
        and only a silent port waits out a probe (2 s each, and a sniff, made a 1 s
        connect_timeout take 6 s there; a floor of 0.5 s per probe, 1.5 s).

        No floor: the probes share what is left, the Check first, leaving the sniff
        half (at most SNIFF_SHARE_S). Each thing a probe learns comes within a round
        trip: a refused handshake fails the Check at once (the sniff then has nearly
        all the time), a TLS daemon answers the sniff's ClientHello at once, and a
        daemon answers the Check. So a share of a few round trips still tells them
        apart (a connect_timeout below that, which no connect over the link could meet
        either, reads a TLS daemon as silent: protocol.md), and a join's look
        (``before_join``) leaves these probes half of its time.
        Only a silent port waits the shares out, where waiting past the connect
        timeout told nothing more."""
        probe = self.probe
        if probe.seen_tls and (known := (yield Blocking(probe.known_refusal))):
            raise self.s.tls_refused(known)
        end = time.monotonic() + within
        for _ in range(probe.attempts):
            left = max(0.0, end - time.monotonic())
            wait = min(TLS_PROBE_TIMEOUT_S, left - min(SNIFF_SHARE_S, left / 2))
            try:
                response: health_pb2.HealthCheckResponse = yield Rpc(
                    "Check", request, wait, health=True, wait_for_ready=False
                )
                return response
            except grpc.RpcError as exc:
                # A plaintext client's refusal asks the daemon over a socket of
                # its own (blocking, up to what is left, at most a probe's wait).
                sniff = min(TLS_PROBE_TIMEOUT_S, max(0.0, end - time.monotonic()))
                refusal = yield Blocking(functools.partial(probe.refusal, exc, sniff))
                if refusal is not None:
                    raise self.s.tls_refused(refusal) from None
                if not probe.again(exc) or time.monotonic() >= end:
                    return None
            yield Sleep(min(PROBE_PAUSE_S, max(0.0, end - time.monotonic())))
        return None

    # -- membership ------------------------------------------------------------------

    def join(self, request: JoinRequest) -> Steps[Membership]:
        """Register one rank and wait for the world: rank, id and member table."""
        check_keywords("join", JoinRequest, request)
        kept = self.s.start_joining("join")
        plan: JoinPlan | None = None
        try:
            yield from self.before_join(request.get("timeout"))
            yield Blocking(self.local.note)
            plan = self.s.plan_join(**request)
            yield OpenStream()
            yield from self.leave_given_up()
            response = yield from self._send_join(plan, "Join")
            if response.id_required:
                publish = plan.publish_request(response)
                response = yield from self.call("PublishId", publish, timeout=plan.left() + SLACK_S)
            m = plan.finish(response)
        except BaseException as exc:
            self.s.restore(kept, exc)
            if plan is not None:
                self.s.unsettle(plan, exc)
            raise
        finally:
            self.s.joining = False
        address = request.get("address", "")
        if advertises_loopback(address):
            # Both clients prefetch: the check below reads the whole table, which the
            # sync client would otherwise fetch lazily with the same GetMembers pages.
            # As steps of this call, the fetch is the same in both (retries included)
            # and the asyncio one never blocks its loop on it.
            yield from self.fetch_members()
        if (problem := loopback_conflict(m, address)) is not None:
            # Every rank must hear why, not just this one: abort the job with it.
            with contextlib.suppress(RendezvousError):
                yield from self.abort(problem, None, 0, LOOPBACK_ADDRESS)
            raise InvalidRequest(problem, reason="LOOPBACK_ADDRESS", job_id=m.job_id, rank=m.rank)
        return m

    def join_node(self, request: NodeJoinRequest) -> Steps[NodeMembership]:
        """Join once for a whole node and wait for the generation to form."""
        check_keywords("join_node", NodeJoinRequest, request)
        addresses, per_node = request.get("addresses", ()), request["gpus_per_node"]
        if addresses and len(addresses) != per_node:
            # The daemon took fewer (the rest had no address: their peers could not
            # reach them) and refused more only after the round trip.
            raise InvalidRequest(
                f"join_node() addresses= gives {len(addresses)} address"
                f"{'' if len(addresses) == 1 else 'es'} for gpus_per_node={per_node}: give "
                f"one per local rank ({per_node}), or none"
            )
        yield from self.before_join(request.get("timeout"))
        yield Blocking(self.local.note)
        # A re-join (next generation): the last generation's stream must not report
        # into this one.
        yield StopStream()
        plan = self.s.plan_join_node(**request)
        try:
            yield OpenStream()
            yield from self.leave_given_up()
            while True:
                response = yield from self._send_join(plan, "JoinNode", again_at_cap=True)
                if not response.id_required:
                    return self.s.finish_node(response)
                # This node is node 0 of the generation: it makes rank 0's id.
                plan.request.unique_id = plan.make_id()
        except BaseException as exc:
            self.s.unsettle(plan, exc)
            raise

    def leave_given_up(self, closing: bool = False) -> Steps[None]:
        """Leave the seat of a join given up and not resumed (``Session.given_up_leave``):
        before the join that forsook it, or (``closing``) as the client closes. One
        attempt within the leave timeout; a failure is one line, not an error."""
        s = self.s
        request = s.given_up_leave(closing)
        if request is None or not s.leave_timeout:
            return
        try:
            # Closing, not waiting for a daemon to come back (the call stream would, as
            # would the join this Leave goes before): a unary call fails at once where
            # nothing listens, and close() of a client whose daemon was gone took the
            # whole leave timeout (2 s).
            yield Rpc("Leave", request, s.leave_timeout, wait_for_ready=False if closing else None)
        except grpc.RpcError as exc:
            s.given_up_leave_failed(request, exc)

    def _send_join(self, plan: JoinPlan, method: str, *, again_at_cap: bool = False) -> Steps[Any]:
        """Send the plan's join until answered; a fenced id is replaced, not fatal; and,
        ``again_at_cap``, a wait the daemon ended before the join's own timeout is waited
        again. (Not a per-rank join: its rank 0 waits in PublishId, whose seat, freed at
        the cap, a second PublishId cannot take back.)"""
        waits = 1
        while True:
            left = plan.left()
            plan.stamp(left)
            plan.sent = True
            try:
                return (yield from self.call(method, plan.request, timeout=left + SLACK_S))
            except (PeerFailed, JobAborted, JobEnded) as exc:
                if not plan.afresh_after(exc):
                    raise
            except InvalidRequest as exc:
                if not plan.fresh_id_after(exc):
                    raise
            except RendezvousTimeout as exc:
                # The daemon caps every wait (--max-wait-s, 600 s by default): a join
                # given longer (torchrun's join_timeout=1800) heard WORLD_INCOMPLETE at
                # the cap, its timeout silently cut. The same join again is the same
                # seat's retry; only the join's own deadline ends it.
                capped = again_at_cap and exc.reason == "WORLD_INCOMPLETE"
                if not capped or plan.left() < CAPPED_WAIT_MARGIN_S:
                    if capped and waits > 1:
                        # The daemon's "after 2.0 s" counts its last wait only: a
                        # 12 s join read as one of 2 s (a torchrun user's review).
                        exc._add(
                            f" (the last of {waits} waits: {time.monotonic() - plan.started:.1f}"
                            " s in all, the daemon capping each at its --max-wait-s)"
                        )
                    raise
                waits += 1  # the same join again: another of the daemon's capped waits

    def fetch_members(self) -> Steps[tuple[Member, ...]]:
        """The joined (or attached) member's table, fetched page by page as steps."""
        s = self.s
        m = s.member()
        table = m._table
        if isinstance(table, LazyTable) and not table.loaded:
            pages = table.pages()
            try:
                start = next(pages)
                while True:
                    request = page_request(m.job_id, m.generation, m.rank, s.instance_id, start)
                    start = pages.send((yield from self.call("GetMembers", request)))
            except StopIteration as done:
                table.accept(done.value)
        return m.members

    def report_failure(
        self,
        local_rank: int,
        cause: str,
        timeout: float | None = None,
        witness_rank: int | None = None,
    ) -> Steps[None]:
        check_arg("report_failure", "local_rank", local_rank, int)
        check_arg("report_failure", "cause", cause, str)
        check_arg("report_failure", "witness_rank", witness_rank, int | None)
        check_wait("report_failure", "timeout", timeout, deadline=True)
        request = self.s.report_request(local_rank, cause, witness_rank)
        yield from self.call("ReportFailure", request, timeout=timeout)

    def exit_failure(self, exc: BaseException | None) -> Steps[None] | None:
        """The report (``report_failure``, within the leave timeout) a ``with`` block's
        exception makes a worker joined by rank send on its way out, or None: a clean exit
        (``sys.exit(0)`` too), a node agent's client (it reports its workers'), a
        member already failed, or an error from the rendezvous that says the job or
        daemon failed under it (a peer's failure it heard, the daemon gone: a victim's,
        not a cause). The rendezvous refusing this caller's own request (a value over a
        limit, a bad field: ``callers_own``) is a cause, reported as any other. Without
        it its peers read only "heartbeat stream closed", the exception left in its
        stderr."""
        s = self.s
        if exc is None or clean_exit(exc):
            return None
        if isinstance(exc, RendezvousError) and not callers_own(exc):
            return None
        if s.joined is None or s.node is not None or s.failure is not None:
            return None
        if not s.leave_timeout:  # leaving was asked not to wait: its goodbye neither
            return None
        return self.report_failure(s.joined.local_rank, s.exit_cause(exc), s.leave_timeout)

    def barrier(self, name: str, timeout: float | None) -> Steps[None]:
        check_arg("barrier", "name", name, str)
        check_wait("barrier", "timeout", timeout)
        wait = WAIT_TIMEOUT_S if timeout is None else timeout
        request = self.s.barrier_request(name, wait)
        try:
            yield from self.call("Barrier", request, timeout=wait + SLACK_S)
        except BaseException:  # a cancelled or interrupted round too
            self.s.barrier_failed(name)
            raise

    def leave(self, final: bool = False) -> Steps[None]:
        """One goodbye within the leave timeout; a failure is one warning, not an error.
        ``final``: a node agent that will not re-join says so (``LeaveRequest.final``),
        by a Leave call after the goodbye: no seat is kept for it in the next
        generation.

        Said on the heartbeat stream where its daemon offers it (issue 21), as its
        last message, and the stream left open until the daemon confirms it (within
        ``Session.leave_wait``): read in order before the stream's end, so that end is
        never a loss however late the daemon gets to it. A Leave call cannot be
        ordered against the stream, which is closed right after it: 4,096 of them at a
        job's end outlasted the leave timeout, and each member whose stream then
        closed first was lost. Otherwise (an older daemon, no stream), or when the
        stream broke first, by a Leave call within the leave timeout."""
        s = self.s
        request = s.leave_request()
        if request is None:
            return
        final = final and request.node
        # A heartbeat stream on the connection from an address gone hears nothing:
        # the Leave goes as a call on the channel made anew.
        anew = yield from self.readdress(now=True)
        if s.stream_leave and not anew:
            wait = s.leave_wait()
            confirmed = yield LeaveOnStream(wait)
            refused = s.leave_refused() if confirmed is False else None
            if confirmed is None:
                s.leave_unconfirmed(request, wait)
            elif refused is not None:
                s.leave_failed(request, refused)
            if confirmed is not False or refused is not None:
                yield from self._say_final(request, final)
                return
            # The stream broke before its goodbye was read: a Leave call tells it.
        request.final = final
        # A share of the leave timeout is kept for the look at why no answer came:
        # at a daemon SIGKILLed, its warning said "the daemon did not answer in
        # time" where a plain connect finds "nothing listens there".
        end = time.monotonic() + s.leave_timeout
        try:
            yield Rpc("Leave", request, s.leave_timeout - diagnosis_share(s.leave_timeout))
        except grpc.RpcError as exc:
            problem = None
            error = from_rpc_error(exc, endpoint=s.endpoint, method="Leave")
            if error.code in UNKNOWN_OUTCOME and not error.reason:
                problem = yield from self.dialed(end)
                if self.local.lost is not None:
                    # A plain connect from the new address works: "no gRPC server
                    # answered ... a daemon that is stuck" blamed the daemon.
                    problem = LocalShortage(
                        f"this host's address changed ({self.local.lost} is no longer one "
                        f"of its addresses; it reaches the daemon from "
                        f"{self.local.address or 'no address'} now), and the daemon was not "
                        "told of the leave",
                        "readdressed",
                    )
            s.leave_failed(request, exc, problem)

    def _say_final(self, request: pb.LeaveRequest, final: bool) -> Steps[None]:
        """After a goodbye on the stream (which has no room to say it): the final Leave."""
        if not final:
            return
        last = pb.LeaveRequest()
        last.CopyFrom(request)
        last.final = True
        try:
            yield Rpc("Leave", last, self.s.leave_timeout)
        except grpc.RpcError as exc:
            self.s.leave_failed(last, exc)

    def abort(
        self, reason: str, job_id: str | None, generation: int, cause: str = ""
    ) -> Steps[int]:
        check_arg("abort", "reason", reason, str)
        check_arg("abort", "job_id", job_id, str | None)
        check_arg("abort", "generation", generation, int, UINT64)
        check_arg("abort", "cause", cause, str)
        request = pb.AbortJobRequest(
            job_id=job_id or self.s.job_id,
            generation=generation,
            reason=reason,
            cause=abort_cause(cause),
        )
        response = yield from self.call("AbortJob", request)
        aborted: int = response.generation
        return aborted

    def close_run(self, reason: str, generation: int, cause: str = "") -> Steps[bool]:
        check_arg("close_run", "reason", reason, str)
        check_arg("close_run", "generation", generation, int, UINT64)
        check_arg("close_run", "cause", cause, str)
        request = pb.AbortJobRequest(
            job_id=self.s.job_id,
            generation=generation,
            reason=reason,
            close=True,
            cause=abort_cause(cause),
        )
        response = yield from self.call("AbortJob", request)
        closed: bool = response.closed
        return closed

    # -- key-value store -----------------------------------------------------------------

    def kv_set(self, key: str, value: bytes) -> Steps[None]:
        check_arg("kv_set", "key", key, str)
        check_arg("kv_set", "value", value, bytes)
        yield from self.call("KvSet", pb.KvSetRequest(key=key, value=value, **self.s.scope()))

    def kv_get(self, key: str, wait: bool, timeout: float | None) -> Steps[bytes]:
        check_arg("kv_get", "key", key, str)
        check_arg("kv_get", "wait", wait, bool)
        check_wait("kv_get", "timeout", timeout, deadline=not wait)
        # 0 is a wait that ends at once, not the default (None).
        limit = (WAIT_TIMEOUT_S if wait else self.s.call_timeout) if timeout is None else timeout
        request = pb.KvGetRequest(
            key=key, wait=wait, wait_timeout_ms=timeout_ms(limit), **self.s.scope()
        )
        # The slack is for a wait's answer to come after it; a get that does not wait
        # is any call (with it, a down daemon took call_timeout + 5 s per attempt).
        deadline = limit + SLACK_S if wait else limit
        value: bytes = (yield from self.call("KvGet", request, timeout=deadline)).value
        return value

    def kv_add(self, key: str, delta: int) -> Steps[int]:
        check_arg("kv_add", "key", key, str)
        check_arg("kv_add", "delta", delta, int, INT64)
        request = pb.KvAddRequest(key=key, delta=delta, **self.s.scope())
        value: int = (yield from self.call("KvAdd", request)).value
        return value

    def kv_compare_and_set(
        self, key: str, expected: bytes | None, desired: bytes
    ) -> Steps[tuple[bool, bytes | None]]:
        check_arg("kv_compare_and_set", "key", key, str)
        check_arg("kv_compare_and_set", "expected", expected, bytes | None)
        check_arg("kv_compare_and_set", "desired", desired, bytes)
        request = pb.KvCompareAndSetRequest(key=key, desired=desired, **self.s.scope())
        if expected is not None:
            request.expected = expected
        response = yield from self.call("KvCompareAndSet", request)
        return response.swapped, response.current if response.HasField("current") else None

    def kv_delete(self, key: str) -> Steps[bool]:
        check_arg("kv_delete", "key", key, str)
        request = pb.KvDeleteRequest(key=key, **self.s.scope())
        deleted: bool = (yield from self.call("KvDelete", request)).deleted
        return deleted

    # -- inspection ----------------------------------------------------------------------

    def list_jobs(self) -> Steps[list[pb.JobSummary]]:
        response: pb.ListJobsResponse = yield from self.call("ListJobs", pb.ListJobsRequest())
        self.s.daemon_version = response.daemon_version
        self.s.storage_failing_since_ms = response.storage_failing_since_ms
        return list(response.jobs)

    def get_job(self, job_id: str | None) -> Steps[pb.GetJobResponse]:
        check_arg("get_job", "job_id", job_id, str | None)
        request = pb.GetJobRequest(job_id=job_id or self.s.job_id)
        response: pb.GetJobResponse = yield from self.call("GetJob", request)
        self.s.daemon_version = response.daemon_version
        self.s.storage_failing_since_ms = response.storage_failing_since_ms
        return response


class ClientBase(ABC):
    """What both clients answer without I/O: the session's state, and ``attach``."""

    def __init__(self, endpoint: str, job_id: str, options: ClientOptions) -> None:
        # Named by the client's own class: RendezvousClient or AsyncRendezvousClient.
        check_keywords(type(self).__name__, ClientOptions, options)
        # Else protobuf's bare TypeError at the first call that sends it.
        check_arg(type(self).__name__, "job_id", job_id, str)
        self._c = Calls(endpoint, job_id, options)
        self._s = self._c.s
        self._s.on_daemon_lost = self._daemon_lost
        self._pid = os.getpid()
        # Unary calls in flight (call_stream=False, or a daemon without CallBatches),
        # ended with the stream's calls when the daemon is lost (``_daemon_lost``).
        self._unary: set[Any] = set()
        self._unary_lock = threading.Lock()

    def current_token(self) -> str:
        """The token this client sends now: the one it was given, or the one its token
        file held when the daemon last refused it (a rotation). A node agent hands it to
        its workers; never to be logged."""
        return self._s.token

    def _forked(self) -> bool:
        """Whether this is a forked child of the process that made the client."""
        return os.getpid() != self._pid

    def _check_process(self) -> None:
        """Refuse a call in a forked child (a DataLoader worker, say): gRPC's channel
        and threads do not survive a fork, and such a call hung in gRPC core, past
        its deadline, or failed after two attempts blaming a daemon that was fine."""
        if self._forked():
            raise InvalidRequest(
                f"this client of job {self._s.job_id!r} was made in process {self._pid}, "
                f"and process {os.getpid()} is a fork of it: gRPC channels do not survive a "
                "fork; make a new client in the child (or fork before making the client)",
                job_id=self._s.job_id,
            )

    def _daemon_lost(self) -> None:
        """The daemon is gone (``Session.fail``): the calls in flight on this client's
        own call stream fail now, and so do its unary calls, cancelled (a waiting one
        waited out its whole timeout, 600 s by default, where the stream's heard it in
        seconds: an SDK misuse review); relayed ones are the node agent's, whose own
        client ends them."""
        mux = getattr(self, "_mux", None)
        if isinstance(mux, _CallStreams):
            mux.lose()
        with self._unary_lock:
            calls = list(self._unary)
        for call in calls:
            call.cancel()

    def _track(self, call: Any) -> None:
        with self._unary_lock:
            self._unary.add(call)

    def _untrack(self, call: Any) -> None:
        with self._unary_lock:
            self._unary.discard(call)

    def _lost_with_the_daemon(self) -> bool:
        """Whether a unary call that ended cancelled was ended by ``_daemon_lost``."""
        return isinstance(self._s.failure, DaemonUnavailable)

    @property
    def endpoint(self) -> str:
        return self._s.endpoint

    def _ended_by_close(self) -> bool:
        """Whether a call that failed ended because close() came from another thread or
        task meanwhile: gRPC cancels a closing channel's calls (CANCELLED; grpc.aio's
        unary calls raise asyncio.CancelledError instead), and a parked call is
        answered PEER_FAILED once close() ended the member's heartbeat stream (the
        daemon lost it). Both clients then raise the closed client's error, as for a
        call made after close()."""
        return self._s.closed

    @property
    def membership(self) -> Membership | None:
        return self._s.joined

    @property
    def node_membership(self) -> NodeMembership | None:
        return self._s.node

    @property
    def failure(self) -> RendezvousError | None:
        return self._s.failure

    @property
    def call_route(self) -> str:
        """How this client's calls reach the daemon now: ``"relayed"`` (through its
        node agent, ``relay_through``), ``"stream"`` (its own CallBatches stream) or
        ``"unary"`` (``call_stream=False``, a daemon without CallBatches, or a relay
        whose agent went away)."""
        return route_of(getattr(self, "_mux", None))

    def _kv_scope(self) -> dict[str, Any]:
        """The fields naming this member on a request (tests build raw ones with it)."""
        return self._s.scope()

    def raise_if_failed(self) -> None:
        if self._s.failure is not None:
            raise self._s.failure

    def nodes_waiting(self) -> int:
        """Nodes parked for the next generation (NODES_WAITING from the daemon), 0 if none."""
        return self._s.nodes_waiting

    def daemon_version(self) -> str:
        """The daemon's rendezvousd version, as its last ``list_jobs()`` or
        ``get_job()`` answer said it; "" before either, or from a daemon from before it
        said it (errors say it too: ``RendezvousError.daemon_version``)."""
        return self._s.daemon_version

    def storage_failing_since(self) -> float | None:
        """Since when (seconds since the epoch) the daemon's state storage has failed,
        every change refused, as its last ``list_jobs()`` or ``get_job()`` answer said
        it; None while it takes writes, before either, or from a daemon from before it
        said it."""
        since = self._s.storage_failing_since_ms
        return since / 1000 if since else None

    def report_progress(
        self, steps: Sequence[int | None], *, restarts_used: int = 0, max_restarts: int = 0
    ) -> None:
        """Where training stands, sent with every heartbeat from now on (no call of its
        own): the last step of each of this stream's ranks (a node's by local rank,
        None before its first), and a node agent's restart budget. The daemon shows
        it in GetJob and on its status page."""
        check_arg("report_progress", "steps", steps, Sequence[int | None], INT64)
        check_arg("report_progress", "restarts_used", restarts_used, int)
        check_arg("report_progress", "max_restarts", max_restarts, int)
        if (self._s.node or self._s.joined) is not None and len(steps) > (
            ranks := self._s.stream_ranks()
        ):
            # Accepted, 25,000 steps made every beat over the daemon's message limit:
            # the heartbeat was refused, and the whole job failed (an SDK misuse review).
            raise InvalidRequest(
                f"report_progress() steps= has {len(steps)} entries, but this client's "
                f"heartbeat speaks for {ranks} rank{'s' if ranks > 1 else ''}: give the "
                "last step of each (a node's by local rank)",
                job_id=self._s.job_id,
            )
        self._s.progress = pb.Progress(
            steps=[-1 if s is None else s for s in steps],
            restarts_used=restarts_used,
            max_restarts=max_restarts,
        )

    def start_heartbeat(
        self,
        interval: float | None = None,
        on_failure: Callable[[RendezvousError], None] | None = None,
        on_nodes_waiting: Callable[[int], None] | None = None,
    ) -> None:
        """Heartbeat in the background (the sync client's thread, the asyncio one's
        task), every ``interval`` seconds: by default a third of the daemon's heartbeat
        timeout, at most 5 s (see ``Session.heartbeat_interval``); ``on_failure`` runs
        once, on the heartbeat's thread or the sync watchdog's: ``PeerFailed``,
        ``JobAborted``, ``DaemonUnreachable``... After join_node() the stream is the whole
        node's; ``on_nodes_waiting(count)`` runs when nodes park for a next generation."""
        _check_heartbeat_args(interval, on_failure, on_nodes_waiting)
        self._check_process()
        s = self._s
        m = s.stream_member()
        if self._heartbeat_running():
            # A second one ran beside the first (two streams, on the sync client two
            # more threads), and its on_failure replaced the first's.
            raise InvalidRequest(
                f"start_heartbeat() was already called for job {s.job_id!r} rank {m.rank}: "
                "its heartbeat runs until leave(), close() or the next join(); call it "
                "once per join",
                job_id=s.job_id,
                rank=m.rank,
            )
        s.on_failure, s.on_nodes_waiting = on_failure, on_nodes_waiting
        beat = s.heartbeat_interval(interval)
        watch = StreamWatch(
            s, m, self._c.reconnect_window, beat_s=beat, first=s.heartbeat_request()
        )
        self._start_stream(watch, beat)

    @abstractmethod
    def _start_stream(self, watch: StreamWatch, interval: float) -> None:
        """Start the heartbeat stream: each client with its own I/O."""

    @abstractmethod
    def _heartbeat_running(self) -> bool:
        """Whether start_heartbeat()'s stream runs (its thread or task not ended)."""

    def attach(self, membership: Membership, instance_id: str) -> None:
        """Act as ``membership``'s member (registered by a node agent's join_node) for
        barrier(), kv_*() and abort(), without joining and without a heartbeat of our
        own: the agent's node heartbeat covers this worker. A wrong ``instance_id`` is
        refused by the daemon at the first call (DuplicateRank)."""
        check_arg("attach", "membership", membership, Membership)
        check_arg("attach", "instance_id", instance_id, str)
        self._s.attach(membership, instance_id)

    def _leaves_on_exit(self, exc: BaseException | None) -> bool:
        """Whether leaving a ``with`` block says goodbye: a clean exit of a live member
        (``sys.exit(0)`` too, as after the block; it read as a crash, its peers told
        PeerFailed)."""
        s = self._s
        live = (s.joined is not None or s.node is not None) and s.failure is None
        return (exc is None or clean_exit(exc)) and live

    def _forget(self) -> None:
        """After leave(): no member or node is held any more."""
        self._s.joined = self._s.node = None


def _check_heartbeat_args(interval: object, *callbacks: object) -> None:
    """Refuse what start_heartbeat() could not use: an interval under
    SHORTEST_HEARTBEAT_S or no number of seconds (0, NaN or 1e-9 s made the heartbeat
    busy-loop), a callback that is not callable, or a coroutine function, which would
    be called and never awaited: the failure it was to hear of would go unheard."""
    check_wait("start_heartbeat", "interval", interval, least=SHORTEST_HEARTBEAT_S)
    for name, callback in zip(("on_failure", "on_nodes_waiting"), callbacks, strict=True):
        check_arg("start_heartbeat", name, callback, Callable[..., object] | None)
        if inspect.iscoroutinefunction(callback):
            raise InvalidRequest(
                f"start_heartbeat() {name}={callback!r} is a coroutine function: it is "
                "called, not awaited, so it would never run; pass a plain function (on "
                "the asyncio client it runs on the client's loop, where it may start a "
                "task: asyncio.get_running_loop().create_task(...))"
            )
