"""``RendezvousClient``: the blocking SDK, with heartbeats on a background thread.

Its calls are the shared ``_calls.Calls`` steps, performed here as blocking gRPC
calls and sleeps: this module decides nothing, so it cannot drift from ``aio``."""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
import weakref
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any, TypeVar, Unpack

import grpc
from grpc_health.v1 import health_pb2_grpc

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from rendezvousd.client import _calls as steps
from rendezvousd.client._call_stream import BlockingCallStream
from rendezvousd.client._multiplex import Unsupported, copy_error, lost_error
from rendezvousd.client._session import (
    HEARTBEAT_CALL_S,
    WATCH_S,
    ClientOptions,
    JoinRequest,
    NodeJoinRequest,
    StreamWatch,
    check_arg,
)
from rendezvousd.client._stream_threads import RequestFeed, unraise
from rendezvousd.client._stubs import lazy_stub
from rendezvousd.client._tables import BlockingMembers
from rendezvousd.client.connection import connected
from rendezvousd.client.errors import RendezvousError
from rendezvousd.client.membership import Membership, NodeMembership
from rendezvousd.client.relay import RelayedCalls, RelayEnd, Send, submit_on

T = TypeVar("T")
# How long stopping the heartbeat waits for its threads and an opened stream's feeder.
STOP_HEARTBEAT_S = 2.0
# The core channel's connectivity states (grpc.ChannelConnectivity's numbers): from
# IDLE and CONNECTING a channel asked to connect may still become READY.
_CONNECTING = (grpc.ChannelConnectivity.IDLE.value[0], grpc.ChannelConnectivity.CONNECTING.value[0])
_READY = grpc.ChannelConnectivity.READY.value[0]
_SHUTDOWN = grpc.ChannelConnectivity.SHUTDOWN.value[0]
#: How long one watch of the channel's state may last (``_ready_within``).
_WATCH_SLICE_S = 0.1


class _HeldRequests:
    """An opened stream's requests (``steps.OpenStream``): none until start_heartbeat()
    gives them, or the end of the stream without a message (``None``). gRPC's feeding
    thread waits here meanwhile; it is always let go before the call is cancelled, and
    when ``owner`` (the client) is dropped without close() before either."""

    def __init__(self, owner: object) -> None:
        self._given = threading.Event()
        self._requests: Iterator[pb.HeartbeatRequest] | None = None
        # Detached once given: a client that re-joins many times keeps no finalizer
        # (nor the given requests, nor itself) per stream it ever opened.
        self._dropped = weakref.finalize(owner, self.give, None)

    def give(self, requests: Iterator[pb.HeartbeatRequest] | None) -> None:
        if not self._given.is_set():
            self._requests = requests
            self._given.set()
            self._dropped.detach()

    def __iter__(self) -> Iterator[pb.HeartbeatRequest]:
        self._given.wait()
        if self._requests is not None:
            yield from self._requests


# Blocking clients not closed yet. One still open when the interpreter exits is closed
# then (as a process exiting without close() would leave its daemon anyway), so that
# no stream thread of gRPC's is left to finalization (see _stream_threads).
_open: weakref.WeakSet[RendezvousClient] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    for client in list(_open):
        with contextlib.suppress(Exception):
            client.close()


class RendezvousClient(steps.ClientBase):
    """The blocking SDK: join a job, then barrier, key-value and leave; heartbeats run
    on a background thread and a peer failure surfaces as ``PeerFailed``.

    The keywords are ``ClientOptions``' (token, TLS, retries, timeouts). A daemon
    restarted within ``reconnect_window`` is reattached silently.
    """

    def __init__(self, endpoint: str, job_id: str = "", **options: Unpack[ClientOptions]) -> None:
        super().__init__(endpoint, job_id, options)
        self._channel = self._c.channel(grpc.secure_channel, grpc.insecure_channel)
        # Their methods made on first use: a client uses one or two (_stubs).
        self._stub: pb_grpc.RendezvousStub = lazy_stub(pb_grpc.RendezvousStub, self._channel)
        self._health = lazy_stub(health_pb2_grpc.HealthStub, self._channel)
        self._mux: BlockingCallStream | RelayedCalls | None = (
            BlockingCallStream(self._channel, self._s.bearer, self._s.endpoint)
            if self._c.call_stream
            else None
        )
        if self._mux is not None:
            # The stream's reader holds the channel, not this client: a client dropped
            # without close() must not leave its connection and threads behind. Not at
            # the interpreter's exit: there _close_at_exit closes the client, waiting
            # for its streams' threads, which an abandon run first (weakref's own exit
            # hook runs before ours) would have taken out of close()'s reach.
            weakref.finalize(self, self._mux.abandon).atexit = False
        # After close() the table of a slim join is still readable: over a channel of its own.
        self._after_close = BlockingMembers(self._c)
        self._s.get_members = lambda request: (
            self._after_close(request) if self._s.closed else self._call("GetMembers", request)
        )
        self._hb_thread: threading.Thread | None = None
        self._hb_watchdog: threading.Thread | None = None
        self._hb_stop = threading.Event()
        # Held while the heartbeat's threads start, and by close() as it marks the
        # client closed: a start_heartbeat() racing close() from another thread either
        # finds the client closed or has started threads close() then stops.
        self._hb_lock = threading.Lock()
        # Wakes the stream's request iterator before its next beat: stop, or leave.
        self._hb_wake = threading.Event()
        self._hb_leave = False
        self._hb_call: Any = None
        self._hb_feed: RequestFeed | None = None
        # The heartbeat stream opened before the join, its feed and its held requests.
        self._opened: tuple[Any, RequestFeed, _HeldRequests] | None = None
        self._opened_lock = threading.Lock()
        # Channels replaced by one of renewed TLS files (``_renew``): closed with the
        # client, not at once: a blocking unary call in flight on one is no call gRPC
        # counts (a segregated call), so no look can tell when it is safe to close, and
        # a channel whose connection broke holds no descriptor meanwhile.
        self._replaced: list[grpc.Channel] = []
        # The TLS files' renewal the channel was made at (``TlsFiles.renewed``).
        self._made = 0
        _open.add(self)

    # -- relayed calls (``relay``) ----------------------------------------------------

    def relay_end(self, reply: Send) -> RelayEnd | None:
        """A node agent's end of one worker's relay: the worker's calls made on this
        client's call stream, their Replies sent with ``reply``. None when this
        client makes unary calls (``call_stream=False``): the worker then calls
        the daemon itself."""
        if not isinstance(self._mux, BlockingCallStream):
            return None
        return RelayEnd(submit_on(self._mux, Future), reply)

    def relay_through(self, send: Send) -> RelayedCalls:
        """Make this client's calls through its node agent (``send`` carries each
        encoded Call there) instead of on a stream of its own. The link's reader
        hands each Reply to the returned end's ``deliver``, and calls its ``end``
        when the link goes; calls the agent cannot make are made unary."""
        previous, self._mux = self._mux, RelayedCalls(send)
        if isinstance(previous, BlockingCallStream):
            previous.close()
        return self._mux

    # -- plumbing: the I/O of the shared steps -------------------------------------

    def _run(self, calls: steps.Steps[T]) -> T:
        self._check_process()
        run = steps.Run(calls)
        try:
            for step in run:
                try:
                    run.answer = self._perform(step)
                except BaseException as exc:  # thrown into the call, which decides
                    run.error = exc
        except BaseException as exc:
            self._s.give_up(getattr(calls, "__name__", ""), exc)
            raise
        return run.value

    def _call(self, method: str, request: Any) -> Any:
        """One call with the retry policy (tests ask the daemon directly with it)."""
        return self._run(self._c.call(method, request))

    def _perform(self, step: steps.Step) -> Any:
        if self._s.closed:
            raise self._s.closed_error()
        if isinstance(step, steps.Rpc):
            try:
                if self._mux is not None and step.streamable:
                    with contextlib.suppress(Unsupported):  # an older daemon, a full stream
                        return self._mux.call(step.method, step.request, step.timeout)
                call = step.invoke(self._stub, self._health, self._s.metadata, future=True)
                self._track(call)
                try:
                    return call.result()
                except grpc.FutureCancelledError:
                    if self._lost_with_the_daemon():
                        raise lost_error() from None
                    raise
                except grpc.RpcError:
                    raise
                except BaseException:
                    # Interrupted (Ctrl-C in a waiting call): the daemon releases the
                    # parked wait now, as the call stream's cancel does; left to its
                    # deadline, a re-join was refused DuplicateRank meanwhile.
                    call.cancel()
                    raise
                finally:
                    self._untrack(call)
            except grpc.RpcError:
                if self._ended_by_close():  # was ProtocolError "CANCELLED", or PeerFailed
                    raise self._s.closed_error() from None
                raise
        if isinstance(step, steps.Sleep):
            time.sleep(step.seconds)
        elif isinstance(step, steps.Blocking):
            return step.work()
        elif isinstance(step, steps.StopStream):
            # A stream opened but never heartbeated (connect(), an earlier join) names
            # no member yet: the join that follows takes it.
            self._stop_heartbeat(keep_opened=True)
        elif isinstance(step, steps.OpenStream):
            self._open_stream()
        elif isinstance(step, steps.Reachable):
            return self._ready_within(step.timeout, failure_ends=True) is True
        elif isinstance(step, steps.LeaveOnStream):
            return self._leave_on_stream(step.timeout)
        elif isinstance(step, steps.Renew):
            return self._renew(unless_ready=not step.readdressed, readdressed=step.readdressed)
        elif isinstance(step, steps.Connect):
            ready = self._ready_within(step.timeout, failure_ends=False)
            if self._s.closed:
                raise self._s.closed_error()
            return self._ready_future(step.timeout) if ready is None else ready
        return None

    def _renew(self, *, unless_ready: bool = True, readdressed: bool = False) -> bool:
        """``steps.Renew``: the channel made anew from TLS files renewed since it was
        made (``Calls.renewed`` decides), its stubs and call stream with it; whether
        it was. The heartbeat's next stream opens on it too. ``unless_ready``: not
        while the channel is READY (a call's look); the heartbeat, whose stream broke,
        looks whatever the channel's state, which can still read READY then.
        ``readdressed``: made anew whatever the files (``steps.Renew``)."""
        if unless_ready and connected(self._channel):
            return False
        renewal = self._c.renewed(self._made)
        if renewal is None and not readdressed:
            return False
        made, credentials = (self._made, None) if renewal is None else renewal
        channel = self._c.channel(grpc.secure_channel, grpc.insecure_channel, credentials)
        with self._hb_lock:  # close() marks the client closed under it
            if self._s.closed:
                channel.close()
                return False
            self._replaced.append(self._channel)
            self._channel, self._made = channel, made
            self._stub = lazy_stub(pb_grpc.RendezvousStub, channel)
            self._health = lazy_stub(health_pb2_grpc.HealthStub, channel)
            # Under the lock too: two renewals in a row leave the call stream on the
            # channel the client keeps.
            if isinstance(self._mux, BlockingCallStream):
                self._mux.rechannel(channel)
        return True

    def _ready_within(self, timeout: float, *, failure_ends: bool) -> bool | None:
        """Whether the channel, asked to connect, is READY within ``timeout``;
        ``failure_ends``: False at its first failure to connect, else it waits
        through failures (a daemon not up yet). None: this grpcio cannot be asked."""
        # grpc.Channel's public way to watch its state is subscribe(), which starts
        # a polling thread and delivery threads that outlive the watch (the polling
        # thread takes a lock the channel's finalizer takes: a process exiting just
        # then can hang). The core channel under it answers the same two questions
        # the polling thread asks, from this thread.
        if not hasattr(getattr(self._channel, "_channel", None), "watch_connectivity_state"):
            return None
        # On the monotonic clock: a wall-clock deadline moved with the clock, and a
        # step back (NTP) kept a client waiting that much longer for a daemon.
        deadline = time.monotonic() + timeout
        while not self._s.closed:
            # Each round: a renewal (``_renew``) may have replaced the channel meanwhile.
            core: Any = getattr(self._channel, "_channel", None)
            try:
                state = core.check_connectivity_state(True)
                if state == _READY:
                    return True
                if state == _SHUTDOWN or (failure_ends and state not in _CONNECTING):
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                # In slices: closing the channel waits for a watch in progress, so a
                # close() from another thread (an agent giving up on its join) waited
                # out the whole connect_timeout (30 s). The core takes a wall-clock
                # time: one slice at most, so a step within it costs a slice at most.
                core.watch_connectivity_state(state, time.time() + min(left, _WATCH_SLICE_S))
            except ValueError:  # "Channel closed!": close() from another thread
                return False
        return False

    def _ready_future(self, timeout: float) -> bool:
        """``_ready_within`` the public way, for a grpcio whose core cannot be asked."""
        ready = grpc.channel_ready_future(self._channel)
        try:
            ready.result(timeout=timeout)
        except grpc.FutureTimeoutError:
            ready.cancel()  # ends gRPC's thread watching the channel
            return False
        return True

    def _leave_on_stream(self, timeout: float) -> bool | None:
        thread = self._hb_thread
        if thread is None or not thread.is_alive() or thread is threading.current_thread():
            return False  # no stream to say it on (or leave() from its own on_failure)
        self._hb_leave = True
        self._hb_wake.set()
        # The thread ends with the stream: LEFT read, or the stream over without it.
        thread.join(timeout)
        return None if thread.is_alive() else self._s.left

    def check_health(self) -> None:
        """Fail fast, with one clear error, when the daemon is down or draining."""
        self._run(self._c.check_health())

    def connect(self) -> None:
        """Connect to the daemon and open the call stream now, without a call, within
        ``connect_timeout``; ``DaemonUnavailable`` when it cannot be reached. Calls
        connect on first use anyway: this puts the cost before a measured moment."""
        self._run(self._c.connect())

    # -- membership -----------------------------------------------------------

    def join(self, **request: Unpack[JoinRequest]) -> Membership:
        """Register and wait for the world; returns rank, id and member table.

        The keywords are ``JoinRequest``'s: the topology and ``local_rank``, and
        optionally ``node_rank``, ``host``, ``address``, ``unique_id``, ``id_factory`` and
        ``timeout`` (600 s). Global rank 0 provides the id: ``unique_id``, else
        ``id_factory()`` (e.g. NCCL's get_unique_id), else 128 random bytes (enough for
        the CPU backend).
        """
        return self._run(self._c.join(request))

    def join_node(self, **request: Unpack[NodeJoinRequest]) -> NodeMembership:
        """Join once for this whole node (a node agent holding ``gpus_per_node`` local
        ranks) and wait for the generation to form: when ``max_nodes`` nodes joined,
        or when at least ``min_nodes`` joined and ``last_call`` seconds passed since
        the last arrival (the daemon's default when None). ``id_factory`` runs only if
        this node becomes node 0 (else 128 random bytes). Then ``start_heartbeat()``
        heartbeats the node, ``leave()`` leaves all its members, and the workers
        ``attach()`` with ``membership_for(i)`` / ``member_instance_id(i)``. The
        keywords are ``NodeJoinRequest``'s.
        """
        return self._run(self._c.join_node(request))

    def report_failure(
        self,
        local_rank: int,
        cause: str,
        *,
        timeout: float | None = None,
        witness_rank: int | None = None,
    ) -> None:
        """Tell the daemon this node's worker at ``local_rank`` failed: it marks that
        rank lost with ``cause`` (any text: an exception's whole message), fails the
        generation and tells every other member. A node agent reports any of its
        workers; a worker joined by rank, only itself (its own ``local_rank``), before
        it exits: its peers then read its cause, not "heartbeat stream closed" (a
        ``with`` block does it for an exception that ends it). ``timeout``: seconds
        for the call (``call_timeout`` by default). ``witness_rank``: the rank whose
        report of the failure the worker relays (a ring neighbour's notice), whose own
        report, coming soon after, the daemon records as the root cause instead."""
        self._run(self._c.report_failure(local_rank, cause, timeout, witness_rank))

    def barrier(self, name: str = "default", *, timeout: float | None = None) -> None:
        self._run(self._c.barrier(name, timeout))

    def leave(self, *, final: bool = False) -> None:
        """Say goodbye first, then close the stream: otherwise peers see a failure.

        Best effort: one attempt within ``leave_timeout``; if the daemon cannot be
        told, one WARNING is logged and leave() returns, since the work is done.
        ``final`` (a node agent): it will not re-join, so the next generation keeps
        no seat for it (a node leaving a failed generation is otherwise expected back).
        """
        # Before the goodbye, whose ``finally`` forgets the membership: a bad argument
        # must leave the member as it was, not dropped without a word to its peers.
        check_arg("leave", "final", final, bool)
        try:
            self._run(self._c.leave(final))
        finally:
            self._stop_heartbeat()
            self._forget()

    def abort(
        self, reason: str, *, job_id: str | None = None, generation: int = 0, cause: str = ""
    ) -> int:
        """Abort the job's current generation, or only ``generation`` (a generation
        already replaced is left alone); returns the generation aborted. ``cause``:
        what the abort is, as data its peers read (``JobAborted.abort_cause``), where
        ``reason`` is its words: "" (any abort), "LOOPBACK_ADDRESS" or "NODE_STOPPED"."""
        return self._run(self._c.abort(reason, job_id, generation, cause))

    def close_run(self, reason: str, *, generation: int = 0, cause: str = "") -> bool:
        """Close the job's run for good: ``generation`` (0: the current one) is aborted
        as by ``abort``, or, one that already failed, left failed; and a node agent
        launched before this call that joins the job afterwards is refused
        (``JobAborted``, with ``reason``) instead of waiting for nodes that will not
        come (docs/protocol.md, "A closed run"). Returns whether the daemon closed
        it: False from a daemon from before closes, which aborted the generation (if
        it was forming or running) and nothing more. ``cause``: as ``abort``'s, told
        to the nodes refused too ("SETUP_ERROR": a node agent leaves on a setting of
        its own, and the others end as on a setup error)."""
        return self._run(self._c.close_run(reason, generation, cause))

    # -- key-value store --------------------------------------------------------

    def kv_set(self, key: str, value: bytes) -> None:
        self._run(self._c.kv_set(key, value))

    def kv_get(self, key: str, *, wait: bool = True, timeout: float | None = None) -> bytes:
        return self._run(self._c.kv_get(key, wait, timeout))

    def kv_add(self, key: str, delta: int = 1) -> int:
        return self._run(self._c.kv_add(key, delta))

    def kv_compare_and_set(
        self, key: str, expected: bytes | None, desired: bytes
    ) -> tuple[bool, bytes | None]:
        return self._run(self._c.kv_compare_and_set(key, expected, desired))

    def kv_delete(self, key: str) -> bool:
        return self._run(self._c.kv_delete(key))

    # -- inspection ---------------------------------------------------------------

    def list_jobs(self) -> list[pb.JobSummary]:
        return self._run(self._c.list_jobs())

    def get_job(self, job_id: str | None = None) -> pb.GetJobResponse:
        return self._run(self._c.get_job(job_id))

    # -- heartbeat ----------------------------------------------------------------

    def _open_stream(self) -> None:
        """``steps.OpenStream``: the heartbeat stream's call, open before the join, its
        requests held back until start_heartbeat() (none while one is running)."""
        if self._heartbeat_running():
            return
        with self._opened_lock:
            if self._opened is not None and not self._opened[0].done():
                return
        self._release_opened()
        if self._mux is not None:
            # The call stream first: the join goes on it, and the daemon takes new
            # calls in arrival order, so the join does not wait behind this stream.
            self._mux.open()
        held, feed = _HeldRequests(self), RequestFeed()
        call = self._stub.Heartbeat(
            feed.wrap(iter(held)), metadata=self._s.metadata, timeout=HEARTBEAT_CALL_S
        )
        with self._opened_lock:
            self._opened = (call, feed, held)

    def _heartbeat_stream(self, requests: Iterator[pb.HeartbeatRequest]) -> tuple[Any, RequestFeed]:
        """The stream opened before the join and its feed, now sending ``requests``;
        a new stream when there is none, or it already ended."""
        with self._opened_lock:
            opened, self._opened = self._opened, None
        if opened is not None:
            call, feed, held = opened
            if not call.done():
                held.give(requests)
                return call, feed
            self._end_opened(opened)
        feed = RequestFeed()
        call = self._stub.Heartbeat(
            feed.wrap(requests), metadata=self._s.metadata, timeout=HEARTBEAT_CALL_S
        )
        return call, feed

    def _release_opened(self) -> None:
        """An opened stream that no heartbeat took ends without a message."""
        with self._opened_lock:
            opened, self._opened = self._opened, None
        if opened is not None:
            self._end_opened(opened)

    @staticmethod
    def _end_opened(opened: tuple[Any, RequestFeed, _HeldRequests]) -> None:
        call, feed, held = opened
        held.give(None)  # gRPC's feeding thread goes first (see _stream_threads)
        call.cancel()
        feed.join(time.monotonic() + STOP_HEARTBEAT_S)
        unraise(call)

    def _heartbeat_running(self) -> bool:
        return self._hb_thread is not None and self._hb_thread.is_alive()

    def _start_stream(self, watch: StreamWatch, interval: float) -> None:
        with self._hb_lock:
            # Closed since start_heartbeat() looked: clearing the stop close() set
            # started a heartbeat on the closed channel, whose thread died on gRPC's
            # ValueError, and whose watchdog told on_failure DaemonUnreachable.
            if self._s.closed:
                raise self._s.closed_error()
            self._hb_stop.clear()
            self._hb_wake.clear()
            self._hb_leave = False
            name = f"rendezvous-heartbeat-{watch.member.job_id}-{watch.member.rank}"
            self._hb_thread = threading.Thread(
                target=self._heartbeat_loop, args=(watch, interval), daemon=True, name=name
            )
            self._hb_watchdog = threading.Thread(
                target=self._watchdog, args=(watch,), daemon=True, name=f"{name}-watchdog"
            )
            self._hb_thread.start()
            self._hb_watchdog.start()

    def _heartbeat_requests(
        self, interval: float, watch: StreamWatch
    ) -> Iterator[pb.HeartbeatRequest]:
        first = watch.first
        request = self._s.heartbeat_request() if first is None else self._s.beat(first)
        yield request
        while not self._hb_stop.is_set():
            self._hb_wake.wait(interval)
            if self._hb_stop.is_set():
                return
            if self._hb_leave:
                yield self._s.leave_beat(request)
                return  # the daemon ends the stream once the goodbye is durable
            request = self._s.beat(request)
            yield request

    def _heartbeat_loop(self, watch: StreamWatch, interval: float) -> None:
        while not self._hb_stop.is_set() and not watch.done:
            call, feed = self._heartbeat_stream(self._heartbeat_requests(interval, watch))
            self._hb_call, self._hb_feed = call, feed
            error: grpc.RpcError | None = None
            try:
                for event in call:
                    verdict = watch.on_event(event)
                    if verdict == "reconnect" and self._mux is not None:
                        self._mux.retire()  # the daemon drains: let it go
                    if verdict != "continue":
                        break  # this member failed, or the daemon is draining
            except grpc.RpcError as exc:
                # A copy: the error raised is the call itself, which the session would
                # keep alive into the interpreter's exit (see _stream_threads).
                error = copy_error(exc)
                if self._mux is not None:
                    self._mux.retire()  # the daemon may be going: never hold it up
            finally:
                call.cancel()
            watch.caught_up()
            delay = None if self._hb_stop.is_set() else watch.ended(error)
            if delay is None:
                return
            # Before the redial: a certificate renewed on disk is shown.
            self._renew(unless_ready=False)
            self._hb_stop.wait(delay)

    def _watchdog(self, watch: StreamWatch) -> None:
        """Reports silence the stream itself cannot: a blocked read on a dead
        route, or a reconnect waiting for a daemon that is gone."""
        watch.watchdog_at = time.monotonic()
        while True:
            deadline = watch.deadline()
            wait = WATCH_S if deadline is None else deadline - time.monotonic()
            if self._hb_stop.wait(min(WATCH_S, max(0.01, wait))) or watch.done:
                return
            watch.watchdog_ran()  # every WATCH_S: a long gap was this process's
            if watch.outage_since is not None and self._renew(unless_ready=False):
                # The stream redialled meanwhile waits for a channel whose certificate
                # the daemon may refuse (waitForReady: until the window's end): it
                # ends now, and the next opens on the renewed channel.
                call = self._hb_call
                if call is not None:
                    call.cancel()
            if watch.may_look_back():
                watch.back_again(watch.look.listening())
            deadline = watch.deadline()
            if deadline is not None and watch.expired():
                call = self._hb_call
                if call is not None:
                    call.cancel()  # ends the heartbeat thread's blocked read
                return

    def _stop_heartbeat(self, *, keep_opened: bool = False) -> None:
        if not keep_opened:
            self._release_opened()
        self._hb_stop.set()
        self._hb_wake.set()
        if self._hb_call is not None:
            self._hb_call.cancel()
        deadline = time.monotonic() + STOP_HEARTBEAT_S
        for attr in ("_hb_thread", "_hb_watchdog"):
            thread = getattr(self, attr)
            setattr(self, attr, None)
            if thread is not None and thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
        feed, self._hb_feed = self._hb_feed, None
        if feed is not None:
            feed.join(deadline)
        call, self._hb_call = self._hb_call, None
        unraise(call)  # its __del__ runs now, not in the interpreter's exit

    # -- lifetime -----------------------------------------------------------------

    def close(self) -> None:
        """Close without Leave: a joined worker closing this way counts as lost."""
        _open.discard(self)
        if self._forked():
            # The parent's client, copied by a fork: its channel and threads are the
            # parent's to close (touched here, gRPC core could hang the child's exit).
            self._s.closed = True
            return
        if self._s.unsettled is not None and not self._s.closed:
            # A join given up and never sent again: its seat is left, not left to lapse.
            with contextlib.suppress(RendezvousError):
                self._run(self._c.leave_given_up(closing=True))
        # First: the heartbeat stream's end makes the daemon lose this member and
        # answer its parked calls PEER_FAILED, blaming this very rank; closed, they
        # end as the closed client's (``_ended_by_close``).
        with self._hb_lock:
            self._s.closed = True
        self._stop_heartbeat()
        self._forget()  # a ``with`` block left after this must not Leave on the closed channel
        if self._mux is not None:
            self._mux.close()
        with self._hb_lock:
            replaced, self._replaced = self._replaced, []
        for channel in (*replaced, self._channel):
            channel.close()

    def __enter__(self) -> RendezvousClient:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if self._forked():  # a forked child leaving the parent's block: the parent's client
            self.close()
            return
        try:
            if (report := self._c.exit_failure(exc)) is not None:
                with contextlib.suppress(RendezvousError):  # its own error goes on
                    self._run(report)
            elif self._leaves_on_exit(exc):
                self.leave()
        finally:
            self.close()
