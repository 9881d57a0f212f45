"""One scenario list, run through both clients against real daemons: the blocking
``RendezvousClient`` and the ``AsyncRendezvousClient`` share one call core, so every
scenario must end the same way for both (the same outcome, the same error)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError as FutureCancelled
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvloop

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client import (
    AsyncRendezvousClient,
    AuthenticationError,
    DaemonUnavailable,
    InvalidRequest,
    JobAborted,
    NotFound,
    PeerFailed,
    RendezvousClient,
    RendezvousError,
    TlsConfig,
)
from rendezvousd.client import _calls as steps
from rendezvousd.client.membership import Membership
from tests.support import DaemonProcess, Pki, free_port, parallel, scrape, wait_for

# "aio-uvloop": the asyncio client on uvloop's loop, as in an application that runs on
# it (grpc.aio's poller hands its completions to whatever loop the client is on).
KINDS = ("sync", "aio", "aio-uvloop")
ID0 = b"\x07" * 128
ID1 = b"\x08" * 128


class Twin:
    """A client of either kind, called from the test's thread; an asyncio client
    lives on an event loop of its own thread, where each of its methods runs."""

    def __init__(self, kind: str, endpoint: str, job_id: str, **options: Any) -> None:
        self.kind = kind
        self._loop: asyncio.AbstractEventLoop | None = None
        if kind == "sync":
            self.client: Any = RendezvousClient(endpoint, job_id, **options)
            return
        loop = self._loop = (
            uvloop.new_event_loop() if kind == "aio-uvloop" else asyncio.new_event_loop()
        )
        self._thread = threading.Thread(target=loop.run_forever, daemon=True)
        self._thread.start()

        async def make() -> AsyncRendezvousClient:
            return AsyncRendezvousClient(endpoint, job_id, **options)

        self.client = self._on_loop(make())

    def _on_loop(self, coro: Any) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(60)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.client, name)
        if not callable(attr) or self._loop is None:
            return attr

        async def call(*args: Any, **kw: Any) -> Any:
            result = attr(*args, **kw)
            return await result if inspect.isawaitable(result) else result

        return lambda *args, **kw: self._on_loop(call(*args, **kw))

    def close(self) -> None:
        self.__getattr__("close")()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()


@dataclass
class World:
    """What a scenario may use: the kind under test, the module's daemon, a fresh job,
    and ways to start daemons of its own."""

    kind: str
    daemon: DaemonProcess
    job_id: str
    tmp: Path
    pki: Pki
    start_daemon: Callable[..., DaemonProcess]
    made: list[Twin]

    def daemon_waiters(self) -> float:
        """The calls parked at the module's daemon."""
        return scrape(self.daemon.metrics_url)["rendezvousd_waiters"]

    def client(self, d: DaemonProcess | None = None, **options: Any) -> Twin:
        d = d or self.daemon
        twin = Twin(self.kind, d.endpoint, self.job_id, token=d.token, **options)
        self.made.append(twin)
        return twin


def all_of(results: list[Any]) -> list[Any]:
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def join_two(w: World, **kw: Any) -> tuple[list[Twin], list[Any]]:
    a, b = w.client(), w.client()
    ms = all_of(
        parallel(
            [
                lambda c=c, i=i: c.join(  # type: ignore[misc]
                    num_nodes=2, gpus_per_node=1, local_rank=0, host=f"h{i}", timeout=20, **kw
                )
                for i, c in enumerate((a, b))
            ]
        )
    )
    return [a, b], ms


def error_of(fn: Callable[[], Any]) -> tuple[str, str]:
    with pytest.raises(RendezvousError) as info:
        fn()
    return type(info.value).__name__, info.value.reason


# -- the scenarios: each returns its outcome, the same for both kinds ----------------


def join_barrier_kv(w: World) -> object:
    (a, b), ms = join_two(w, unique_id=None)
    all_of(parallel([lambda c=c: c.barrier("step", timeout=20) for c in (a, b)]))  # type: ignore[misc]
    a.kv_set("k", b"v")
    got = b.kv_get("k", timeout=5)
    added = [a.kv_add("n", 2), b.kv_add("n", 3)]
    swapped = b.kv_compare_and_set("k", b"v", b"w")
    refused = a.kv_compare_and_set("k", b"v", b"x")
    deleted = [a.kv_delete("k"), b.kv_delete("k")]
    hosts = [x.host for x in ms[0].members]
    return (
        sorted(m.rank for m in ms),
        {m.world_size for m in ms},
        ms[0].unique_id == ms[1].unique_id != b"",
        hosts == ["h0", "h1"] or hosts == ["h1", "h0"],
        got,
        sorted(added),
        swapped,
        refused,
        deleted,
    )


def fenced_id_is_replaced(w: World) -> object:
    c = w.client()
    c.join(num_nodes=1, gpus_per_node=1, local_rank=0, node_rank=0, unique_id=ID0, timeout=10)
    c.abort("next generation")
    made = [ID1, ID0]  # pop(): the used id again first, then a new one
    m = c.join(
        num_nodes=1, gpus_per_node=1, local_rank=0, node_rank=0, id_factory=made.pop, timeout=10
    )
    return m.unique_id == ID1 and made == []


def fenced_pinned_id_is_refused(w: World) -> object:
    c = w.client()
    c.join(num_nodes=1, gpus_per_node=1, local_rank=0, node_rank=0, unique_id=ID0, timeout=10)
    c.abort("next generation")
    return error_of(
        lambda: c.join(
            num_nodes=1, gpus_per_node=1, local_rank=0, node_rank=0, unique_id=ID0, timeout=10
        )
    )


def fenced_node_id_is_replaced(w: World) -> object:
    c = w.client()
    first = c.join_node(min_nodes=1, max_nodes=1, gpus_per_node=2, id_factory=lambda: ID1)
    c.abort("next generation")
    made = [ID0, ID1]  # pop(): ID1 (fenced) first, then ID0
    again = c.join_node(min_nodes=1, max_nodes=1, gpus_per_node=2, id_factory=made.pop)
    return first.unique_id == ID1, again.unique_id == ID0, again.generation - first.generation


def factory_of_a_fenced_id_is_refused(w: World) -> object:
    c = w.client()
    c.join(num_nodes=1, gpus_per_node=1, local_rank=0, node_rank=0, unique_id=ID0, timeout=10)
    c.abort("next generation")
    made: list[int] = []

    def used_id() -> bytes:
        made.append(1)
        return ID0

    rank = error_of(
        lambda: c.join(
            num_nodes=1, gpus_per_node=1, local_rank=0, node_rank=0, id_factory=used_id, timeout=5
        )
    )
    # The node join used to send the same fenced id again and again, without end.
    (node,) = parallel(
        [lambda: c.join_node(min_nodes=1, max_nodes=1, gpus_per_node=1, id_factory=used_id)]
    )
    assert isinstance(node, RendezvousError), node
    return rank, (type(node).__name__, node.reason), len(made)


def peer_failure_reaches_the_other_node(w: World) -> object:
    a, b = w.client(), w.client()
    nodes = all_of(
        parallel(
            [
                lambda c=c, i=i: c.join_node(  # type: ignore[misc]
                    min_nodes=2, max_nodes=2, gpus_per_node=1, host=f"n{i}", timeout=20
                )
                for i, c in enumerate((a, b))
            ]
        )
    )
    seen: list[RendezvousError] = []
    survivor, failing = (a, b) if nodes[0].node_rank == 0 else (b, a)
    survivor.start_heartbeat(0.2, on_failure=seen.append)
    failing.report_failure(0, "boom\nat line 2")
    wait_for("the survivor's failure", lambda: survivor.failure is not None, 20)
    failure = survivor.failure
    assert isinstance(failure, PeerFailed)
    return type(failure).__name__, failure.ranks, seen == [failure]


def abort_reaches_a_member(w: World) -> object:
    c = w.client()
    c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
    c.start_heartbeat(0.2)
    w.client().abort("operator said so")
    wait_for("the abort", lambda: c.failure is not None, 20)
    assert isinstance(c.failure, JobAborted)
    return type(c.failure).__name__, "operator said so" in str(c.failure)


def heartbeat_arguments_are_checked(w: World) -> object:
    """An interval of 0 or 1e-9 s busy-looped the heartbeat (most of a core, on the
    client and on the daemon); an async on_failure was called, never awaited."""
    c = w.client()
    c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)

    async def coroutine(_error: RendezvousError) -> None:
        pass

    refused = []
    for name, value in [
        ("interval", 0),
        ("interval", -1.0),
        ("interval", float("nan")),
        ("interval", 1e-9),
        ("interval", "5"),
        ("interval", True),
        ("on_failure", 5),
        ("on_failure", coroutine),
        ("on_nodes_waiting", "x"),
    ]:
        try:
            c.start_heartbeat(**{name: value})
        except InvalidRequest as exc:
            refused.append(f"{name}=" in str(exc))
    c.start_heartbeat(0.05)  # the shortest interval
    c.leave()
    return refused


def a_raising_on_failure_is_logged_not_raised(w: World) -> object:
    """The asyncio client re-raised it from close() (the program exited 1), the
    blocking one printed a bare thread traceback; the failure itself is kept."""
    c = w.client()
    c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)

    def raises(_error: RendezvousError) -> None:
        raise RuntimeError("the callback's own bug")

    c.start_heartbeat(0.2, on_failure=raises)
    w.client().abort("operator said so")
    wait_for("the abort", lambda: c.failure is not None, 20)
    c.__getattr__("close")()  # the client, not its twin's loop (closed again at the end)
    return type(c.failure).__name__


def leave_ends_membership(w: World) -> object:
    c = w.client()
    c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
    c.start_heartbeat(0.2)
    c.leave()
    return c.membership, c.failure, error_of(lambda: c.kv_set("k", b"v"))


def a_goodbye_right_after_start_heartbeat_is_a_goodbye(w: World) -> object:
    """leave() right after start_heartbeat(): the stream has not heard the daemon's
    attach yet (which says it takes the goodbye), so the goodbye may go by a Leave
    call, answered before the stream is closed, rather than on the stream; either
    way the member left and its peer heard no failure (a review wondered)."""
    outcomes = set()
    for round_ in range(3):
        w.job_id = f"{w.job_id}-{round_}"
        (a, b), _ = join_two(w)
        b.start_heartbeat(0.2)
        a.start_heartbeat(0.2)
        a.leave()
        states = {pb.MemberState.Name(m.state) for m in b.get_job().members}
        outcomes.add((a.failure, b.failure, a.membership, tuple(sorted(states))))
    return outcomes


def a_second_join_of_a_live_member_is_refused_and_loses_nothing(w: World) -> object:
    """It was refused DuplicateRank by the daemon after the client had cleared its
    membership: kv calls then said "not joined", leave() did nothing, and the job
    failed "heartbeat stream closed" (an SDK misuse review). A failed join now leaves
    the client as it was, and the refusal says that the holder is this client."""
    c = w.client()
    c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
    c.start_heartbeat(0.2)
    with pytest.raises(RendezvousError) as info:
        c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
    refused = (type(info.value).__name__, "this client still holds rank 0" in str(info.value))
    kept = c.membership is not None and c.membership.rank == 0
    c.kv_set("k", b"v")
    c.leave()
    state = w.client().get_job(w.job_id).summary.state
    return refused, kept, pb.JobState.Name(state)


def give_up_as_answered(twin: Twin, id_required: bool = False) -> None:
    """``twin``'s next join is given up by its caller just as its answer came (the
    world formed), at the client's one I/O seam (``_perform``): Ctrl-C in the blocking
    client, the asyncio client's task cancelled (as ``asyncio.timeout()`` expiring
    then does). Not an ``id_required`` answer (the join goes on after it), unless
    ``id_required``: then that one, the seat held while it forms."""
    client = twin.client
    real = client._perform

    def answered(step: Any, answer: Any) -> bool:
        joins = ("Join", "JoinNode", "PublishId")
        if (
            isinstance(step, steps.Rpc)
            and step.method in joins
            and answer.id_required == id_required
        ):
            del client._perform  # once
            return True
        return False

    def perform(step: Any) -> Any:
        answer = real(step)
        if answered(step, answer):
            raise KeyboardInterrupt
        return answer

    async def perform_async(step: Any) -> Any:
        answer = await real(step)
        if answered(step, answer):
            task = asyncio.current_task()
            assert task is not None
            task.cancel()
            await asyncio.sleep(0)  # the cancellation lands here, the answer read
        return answer

    client._perform = perform if twin._loop is None else perform_async


def given_up(outcome: object) -> bool:
    """A call the caller gave up: Ctrl-C, or the asyncio task cancelled."""
    return isinstance(outcome, KeyboardInterrupt | asyncio.CancelledError | FutureCancelled)


def a_join_given_up_as_its_answer_came_is_taken_back(w: World) -> object:
    """A join given up (its asyncio task cancelled, ``asyncio.timeout()`` expiring,
    Ctrl-C) just as the world formed: the daemon had seated it and the client dropped
    the answer; every join after it, under a new identity, was refused DuplicateRank
    (WORLD_FULL for a node) by that seat, and at the heartbeat timeout its peers heard
    it had "sent no heartbeat". The same join again is now that join's retry: the
    seat is handed back in the same generation. JoinNode unary (``call_stream=False``)."""
    outcomes = []
    for method, options in (("Join", {}), ("JoinNode", {"call_stream": False})):
        job_id = f"{w.job_id}-{method}"
        a, b = (
            Twin(w.kind, w.daemon.endpoint, job_id, token=w.daemon.token, **options)
            for _ in range(2)
        )
        w.made.extend([a, b])

        def join(c: Twin, i: int, method: str = method) -> Any:
            if method == "Join":
                return c.join(num_nodes=2, gpus_per_node=1, local_rank=0, host=f"h{i}", timeout=20)
            return c.join_node(min_nodes=2, max_nodes=2, gpus_per_node=1, host=f"h{i}", timeout=20)

        give_up_as_answered(a)
        gave, got = parallel([lambda a=a: join(a, 0), lambda b=b: join(b, 1)])
        left_as_it_was = (a.membership, a.node_membership) == (None, None)
        again = join(a, 0)
        for c in (a, b):
            c.start_heartbeat()
        if method == "Join":
            all_of(parallel([lambda c=c: c.barrier("after", timeout=10) for c in (a, b)]))
        states = {pb.MemberState.Name(m.state) for m in b.get_job().members}
        outcomes.append(
            (given_up(gave), left_as_it_was, again.generation == got.generation, states)
        )
        assert (a.failure, b.failure) == (None, None)
    return outcomes


def a_join_given_up_and_not_sent_again_leaves_its_seat(w: World) -> object:
    """A join given up just as the world formed (as above), and then not sent again:
    its client makes another join (here from another host), or closes. The seat was left
    to lapse: its peers heard it had "sent no heartbeat" only at the heartbeat timeout.
    Now the client leaves it (``LeaveRequest.given_up``), and its peers hear at once that
    its join was given up; after another join, the two form the next generation."""
    outcomes = []
    for method in ("Join", "JoinNode"):
        for then in ("join", "close"):
            job_id = f"{w.job_id}-{method}-{then}"
            a, b = (Twin(w.kind, w.daemon.endpoint, job_id, token=w.daemon.token) for _ in range(2))
            w.made.extend([a, b])

            def join(c: Twin, host: str, method: str = method) -> Any:
                if method == "Join":
                    return c.join(num_nodes=2, gpus_per_node=1, local_rank=0, host=host, timeout=20)
                return c.join_node(min_nodes=2, max_nodes=2, gpus_per_node=1, host=host, timeout=20)

            give_up_as_answered(a)
            gave, _ = parallel([lambda a=a: join(a, "h0"), lambda b=b: join(b, "h1")])  # type: ignore[misc]
            b.start_heartbeat(0.2)
            # Attached before a's next step: a stream attaching to a generation already
            # failed (or replaced by a's next join) hears that, not the loss.
            wait_for(
                "b's heartbeat stream",
                lambda b=b: any(m.heartbeat_stream_open for m in b.get_job().members),  # type: ignore[misc]
            )
            again: list[Any] = []
            heard: list[Any] = []

            def b_heard(b: Twin = b, heard: list[Any] = heard) -> None:
                def seen() -> bool:  # one read: the failure seen is the one kept
                    heard[:] = [b.failure]
                    return heard[0] is not None

                wait_for("b to hear of a's seat", seen, 10)

            if then == "close":
                a.__getattr__("close")()  # the client, not its twin's loop
                b_heard()
            else:

                def b_again(b: Twin = b) -> Any:
                    b_heard()
                    return join(b, "h1")

                again = all_of(parallel([lambda a=a: join(a, "h0-again"), b_again]))  # type: ignore[misc]
            (failure,) = heard
            causes = [f.cause for f in failure.failed] if isinstance(failure, PeerFailed) else []
            outcomes.append(
                (
                    given_up(gave),
                    [f"{method} was given up" in cause for cause in causes],
                    len({m.generation for m in again}),
                )
            )
    return outcomes


def closing_with_a_join_given_up_when_its_daemon_is_gone(w: World) -> object:
    """A join given up as the world formed (as above), its daemon killed, then the
    client closed: close() leaves the given-up join's seat first, and that Leave, on
    the call stream (which waits for a daemon to come back), waited out the whole
    leave_timeout (2 s) for a daemon that is gone. A closing client does not wait
    for one: the Leave goes once, failing at once where nothing listens."""
    d = w.start_daemon()
    a, b = w.client(d), w.client(d)

    def join(c: Twin, host: str) -> Any:
        return c.join(num_nodes=2, gpus_per_node=1, local_rank=0, host=host, timeout=20)

    give_up_as_answered(a)
    gave, _ = parallel([lambda: join(a, "h0"), lambda: join(b, "h1")])
    d.kill()
    started = time.monotonic()
    a.__getattr__("close")()  # the client, not its twin's loop
    return given_up(gave), time.monotonic() - started < 1.0


def a_node_join_given_up_while_forming_frees_its_seat(w: World) -> object:
    """A join_node() given up as it was told ``id_required`` (node 0 of a 1-node job,
    owing the id), then another join_node() of the same client from another host. The
    seat stayed held until the id was overdue (the heartbeat timeout): the new join was
    refused WORLD_FULL. Now its client leaves it first, and the new join forms."""
    c = w.client()
    give_up_as_answered(c, id_required=True)
    join = {"min_nodes": 1, "max_nodes": 1, "gpus_per_node": 1, "timeout": 20}
    gave: BaseException | None = None
    try:
        c.join_node(host="h0", **join)
    except BaseException as exc:  # the give-up itself is the outcome
        gave = exc
    m = c.join_node(host="h0-again", **join)
    return given_up(gave), (m.generation, m.num_nodes)


def joins_given_up_as_they_wait(w: World, twin: Twin, times: int, **request: Any) -> list[bool]:
    """``twin`` joins ``times`` times, each join given up by its caller once the daemon
    holds it parked, and the next sent at once: Ctrl-C in the blocking client (a
    signal to the process, as a terminal sends it), the task cancelled in the asyncio
    client (as ``asyncio.timeout()`` does), its next join in the same coroutine.
    Whether each was given up. Join ``i`` is parked once ``i`` joins ended cancelled
    and one is parked in a forming generation (a cancelled join ends after its retry
    parked, or frees its seat, or fails its generation, as it ends)."""
    inspector = RendezvousClient(w.daemon.endpoint, w.job_id, token=w.daemon.token)
    cancelled = 'rendezvousd_rpc_duration_seconds_count{code="CANCELLED",method="Join"}'
    before = scrape(w.daemon.metrics_url).get(cancelled, 0.0)

    def parked(attempt: int) -> None:
        def forming() -> bool:
            if scrape(w.daemon.metrics_url).get(cancelled, 0.0) - before != attempt:
                return False
            try:
                job = inspector.get_job()
            except NotFound:  # the first join not there yet
                return False
            return (job.summary.state, len(job.members)) == (pb.JOB_STATE_FORMING, 1)

        wait_for(f"join {attempt} parked at the daemon", forming, 10)

    try:
        if twin._loop is not None:
            return twin._on_loop(_given_up_on_the_loop(twin, times, parked, request))
        return _interrupted(twin, times, parked, request)
    finally:
        inspector.close()


def _interrupted(
    twin: Twin, times: int, parked: Callable[[int], None], request: dict[str, Any]
) -> list[bool]:
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    outcomes: list[bool] = []
    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        for attempt in range(times):
            # To the process: Linux hands it to the main thread, waiting in the call.
            kill = threading.Thread(
                target=lambda attempt=attempt: (
                    parked(attempt),
                    os.kill(os.getpid(), signal.SIGUSR1),
                ),
                daemon=True,
            )
            kill.start()
            try:
                twin.join(**request)
                outcomes.append(False)
            except KeyboardInterrupt:
                outcomes.append(True)
            kill.join(10)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    return outcomes


async def _given_up_on_the_loop(
    twin: Twin, times: int, parked: Callable[[int], None], request: dict[str, Any]
) -> list[bool]:
    outcomes = []
    loop = asyncio.get_running_loop()
    for attempt in range(times):
        try:
            # The caller's own deadline, brought forward once the join parked: its
            # cancel and the next join are queued in one step of this task, as in
            # ``while ...: async with asyncio.timeout(T): await client.join(...)``.
            async with asyncio.timeout(None) as deadline:
                watch = asyncio.ensure_future(asyncio.to_thread(parked, attempt))
                watch.add_done_callback(lambda _, d=deadline: d.reschedule(loop.time()))
                await twin.client.join(**request)
            outcomes.append(False)
        except TimeoutError:
            outcomes.append(True)
        await watch  # its wait's own failure, if any
    return outcomes


def a_join_given_up_as_it_waits_is_retried_at_once(w: World) -> object:
    """A lone worker giving up its join (``asyncio.timeout()``, Ctrl-C) and joining
    again at once: the daemon decided the retry, sent in the call stream's batch after
    the cancel, before the cancelled join had freed its seat, and refused it
    DuplicateRank, a permanent error, every other attempt. The job then forms, in
    generation 1: a join given up on the call stream frees its seat, as its deadline
    would, and its retry takes it again. It formed in generation 5 for the blocking
    client (each Ctrl-C's cancel, read alone, failed its generation as a dead joiner's)
    and 2 for the asyncio one (only the last cancel went without its retry). Unary
    (``call_stream=False``), a cancelled call is all the daemon sees, as of a process
    that died: each give-up fails its generation, alike for both clients."""
    outcomes = []
    join: dict[str, Any] = {"num_nodes": 1, "gpus_per_node": 2, "node_rank": 0, "timeout": 30}
    for options in ({}, {"call_stream": False}):
        w.job_id += "-u" if options else ""
        c, peer = w.client(**options), w.client(**options)
        gave = joins_given_up_as_they_wait(w, c, 4, local_rank=0, **join)
        ms = all_of(
            parallel(
                [
                    lambda t=t, r=r: t.join(local_rank=r, **join)  # type: ignore[misc]
                    for r, t in enumerate((c, peer))
                ]
            )
        )
        outcomes.append((gave, [m.rank for m in ms], [m.generation for m in ms]))
    return outcomes


def a_rejoin_right_after_an_abort_reaches_the_daemon(w: World) -> object:
    """Rank 0 parked in a barrier hears JobAborted and joins again at once: a first fix
    for the lost membership refused such joins as of a live member, when the abort
    came on the call before the heartbeat had said it (3 of 15 rounds, a review)."""
    outcomes = set()
    for round_ in range(15):
        job = f"{w.job_id}-r{round_}"
        a, b = (Twin(w.kind, w.daemon.endpoint, job, token=w.daemon.token) for _ in range(2))
        w.made += [a, b]
        all_of(
            parallel(
                [
                    lambda c=c, r=r: c.join(  # type: ignore[misc]
                        num_nodes=1, gpus_per_node=2, local_rank=r, node_rank=0, timeout=20
                    )
                    for r, c in enumerate((a, b))
                ]
            )
        )
        a.start_heartbeat(0.3)
        b.start_heartbeat(0.3)

        def aborted_then_rejoined(a: Twin = a, b: Twin = b) -> object:
            heard = error_of(lambda: a.barrier("x", timeout=20))
            again = parallel(
                [
                    lambda c=c, r=r: c.join(  # type: ignore[misc]
                        num_nodes=1, gpus_per_node=2, local_rank=r, node_rank=0, timeout=20
                    )
                    for r, c in enumerate((a, b))
                ]
            )
            return heard[0], [getattr(m, "generation", type(m).__name__) for m in again]

        def abort(b: Twin = b) -> None:
            time.sleep(0.3)
            b.abort("next round")

        outcome, _ = parallel([aborted_then_rejoined, abort])
        outcomes.add(repr(outcome))
    return outcomes


def a_join_while_one_is_in_flight_is_refused(w: World) -> object:
    """Two threads' joins on one client both went out under one identity: both
    answered, the client then held a mix of the two (an SDK misuse review)."""
    c, other = w.client(), w.client()
    first: list[Any] = []
    joining = threading.Thread(
        target=lambda: first.append(
            c.join(num_nodes=1, gpus_per_node=2, local_rank=0, node_rank=0, timeout=20)
        )
    )
    joining.start()
    wait_for("the first join parked", lambda: w.daemon_waiters() >= 1, timeout=20)
    refused = error_of(lambda: c.join(num_nodes=1, gpus_per_node=2, local_rank=1, timeout=20))
    other.join(num_nodes=1, gpus_per_node=2, local_rank=1, node_rank=0, timeout=20)
    joining.join(30)
    return refused, [m.rank for m in first]


def loopback_address_aborts_a_multi_host_job(w: World) -> object:
    a, b = w.client(), w.client()
    outcomes = parallel(
        [
            lambda c=c, i=i: c.join(  # type: ignore[misc]
                num_nodes=2,
                gpus_per_node=1,
                local_rank=0,
                host=f"h{i}",
                address="127.0.0.1:29500",
                timeout=20,
            )
            for i, c in enumerate((a, b))
        ]
    )
    assert all(isinstance(o, RendezvousError) for o in outcomes), outcomes
    return sorted({(type(o).__name__, o.reason) for o in outcomes})


def plaintext_client_of_a_tls_daemon_is_refused(w: World) -> object:
    d = w.start_daemon("--tls-cert", str(w.pki.server), "--tls-key", str(w.pki.server_key))
    c = w.client(d, connect_timeout=10)
    first = error_of(lambda: c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=5))
    # Known now: the second join is refused before gRPC tries (the sniff alone).
    again = error_of(lambda: c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=5))
    with pytest.raises(AuthenticationError, match="speaks TLS"):
        c.check_health()
    return first, again


def tls_client_of_a_plaintext_daemon_is_told_to_drop_its_ca(w: World) -> object:
    """It was told to "Check tls_ca (it must have signed the daemon's certificate) and
    tls_server_name", which no CA could satisfy."""
    c = w.client(tls=TlsConfig(ca=w.pki.ca), connect_timeout=10)
    with pytest.raises(AuthenticationError) as refused:
        c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=5)
    said = str(refused.value)
    return (
        "does not speak TLS" in said
        and "connect without TLS (tls=None)" in said
        and "Check TlsConfig's ca" not in said
    )


def plaintext_client_that_never_joins_hears_tls(w: World) -> object:
    """Only a join asked first why the channel does not connect: an attached worker
    or an inspecting client heard "is the daemon running?" after every retry. Its
    timeouts are no bound on the answer (a TLS daemon answers the probe at once): at
    1 s, a loaded machine left the probe too little of the call's time, and it read
    the TLS daemon as silent (DaemonUnavailable), as protocol.md says of such a wait.
    Then the attached worker heard it after each call's wait (16 s of call_timeout=20),
    the mismatch already known at the second: now at once, as an inspecting client."""
    d = w.start_daemon("--tls-cert", str(w.pki.server), "--tls-key", str(w.pki.server_key))
    c = w.client(d, call_timeout=20, connect_timeout=20)
    c.attach(Membership(w.job_id, 1, 0, 1, 1, 0, ID0), "instance")
    outcomes = []
    for call in (c.list_jobs, lambda: c.kv_add("n")):
        started = time.monotonic()
        outcomes.append((*error_of(call), time.monotonic() - started < 5.0))
    return outcomes


def plaintext_connect_or_inspection_hears_tls_at_once(w: World) -> object:
    """connect() waited its whole connect_timeout (20 s here), then blamed "no gRPC
    server answered"; an inspecting client's first call (list_jobs(), `rendezvousd
    status`) heard the TLS mismatch after its call timeout and a retry (40 s here)."""
    d = w.start_daemon("--tls-cert", str(w.pki.server), "--tls-key", str(w.pki.server_key))
    outcomes = []
    for call in ("connect", "list_jobs"):
        c = w.client(d, connect_timeout=20, call_timeout=20)
        started = time.monotonic()
        with pytest.raises(AuthenticationError, match="speaks TLS") as info:
            getattr(c, call)()
        outcomes.append((call, info.value.reason, time.monotonic() - started < 5.0))
    return outcomes


def daemon_down_is_unavailable(w: World) -> object:
    """Within connect_timeout in all: a Check retried as a transient failure waited it
    once per attempt (4 s here)."""
    port = free_port()
    c = Twin(w.kind, f"127.0.0.1:{port}", w.job_id, token="t", connect_timeout=1, retry_attempts=3)
    w.made.append(c)
    started = time.monotonic()
    with pytest.raises(DaemonUnavailable) as info:
        c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=5)
    within = time.monotonic() - started < 3.0
    return (
        type(info.value).__name__,
        info.value.method,
        within,
        "(connect_timeout)" in str(info.value),
    )


def closing_a_client_ends_its_wait_for_a_daemon(w: World) -> object:
    """close() from another thread while a join waits for a daemon that is not there
    (as an agent gives up on its join): the sync client's close waited for the join's
    connect wait to end (connect_timeout, 20 s here) and the join then blamed the
    daemon; the asyncio join raised gRPC's UsageError."""
    c = Twin(w.kind, f"127.0.0.1:{free_port()}", w.job_id, token="t", connect_timeout=20)
    w.made.append(c)
    outcome: list[object] = []

    def join() -> None:
        outcome.append(error_of(lambda: c.join(num_nodes=1, gpus_per_node=1, local_rank=0)))

    waiting = threading.Thread(target=join, daemon=True)
    waiting.start()
    time.sleep(1.5)  # the TLS probe has failed at the refused port: the wait is on
    started = time.monotonic()
    Twin.__getattr__(c, "close")()
    waiting.join(25)
    return outcome, time.monotonic() - started < 2.0


def closing_a_client_ends_its_call_in_flight(w: World) -> object:
    """close() from another thread while a call waits for a silent daemon: the call
    failed ProtocolError "CANCELLED" (the sync client, the asyncio one on its call
    stream), or the asyncio one's unary call raised asyncio.CancelledError out of the
    caller's ``await``, which ``except Exception`` does not catch."""
    outcomes: list[object] = []
    with socket.create_server(("127.0.0.1", 0)) as silent:
        endpoint = f"127.0.0.1:{silent.getsockname()[1]}"
        for stream in (True, False):
            c = Twin(w.kind, endpoint, w.job_id, token="t", call_timeout=20, call_stream=stream)
            w.made.append(c)
            ended: list[object] = []

            def call(c: Twin = c, ended: list[object] = ended) -> None:
                try:
                    c.list_jobs()
                except BaseException as exc:  # CancelledError too: what the caller sees
                    ended.append(exc)

            waiting = threading.Thread(target=call, daemon=True)
            waiting.start()
            time.sleep(1.0)
            started = time.monotonic()
            Twin.__getattr__(c, "close")()
            waiting.join(25)
            (error,) = ended
            outcomes.append(
                (type(error).__name__, "is closed" in str(error), time.monotonic() - started < 2.0)
            )
    return outcomes


def daemon_killed_during_a_call(w: World) -> object:
    """A call made as the daemon dies waited for it to come back its whole deadline
    (call_timeout, 20 s here), then said "the daemon did not answer in time", though
    the heartbeat had told the client at its window (2 s) that the daemon was gone,
    and a plain connect there is refused. Now: the heartbeat's DaemonUnreachable when
    it says so; without a heartbeat, at the call's deadline, what a connect found."""
    outcomes: list[object] = []
    for heartbeat in (True, False):
        d = w.start_daemon("--heartbeat-timeout-s", "10")
        c = w.client(d, call_timeout=20 if heartbeat else 2, reconnect_window=2)
        c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        if heartbeat:
            c.start_heartbeat(0.2)
        c.kv_set("k", b"before")
        d.kill()
        started = time.monotonic()
        with pytest.raises(RendezvousError) as info:
            c.kv_set("k", b"after")
        took = time.monotonic() - started
        e = info.value
        outcomes.append(
            (
                type(e).__name__,
                took < 6.0,
                "unreachable for" in str(e) if heartbeat else "nothing listens there" in str(e),
            )
        )
    return outcomes


def two_joined(w: World, job_id: str, **options: Any) -> list[Twin]:
    """Two members of ``job_id`` (one node of two), heartbeating."""
    cs = [
        Twin(w.kind, w.daemon.endpoint, job_id, token=w.daemon.token, **options) for _ in range(2)
    ]
    w.made.extend(cs)
    all_of(
        parallel(
            [
                lambda c=c, i=i: c.join(  # type: ignore[misc]
                    num_nodes=1, gpus_per_node=2, local_rank=i, timeout=20
                )
                for i, c in enumerate(cs)
            ]
        )
    )
    for c in cs:
        c.start_heartbeat()
    return cs


def barrier_round_is_sent_again(w: World) -> object:
    """A round that timed out was counted as done: the daemon, which withdrew the
    arrival, refused the next barrier() of the name as "out of order" (ProtocolError)
    and the other rank waited out its timeout for this one."""
    a, b = two_joined(w, w.job_id)
    timed_out = error_of(lambda: a.barrier("step", timeout=1))
    both = parallel([lambda: a.barrier("step", timeout=10), lambda: b.barrier("step", timeout=10)])
    return timed_out, both


def waits_end_when_asked(w: World) -> object:
    """A KvGet's own timeout, answered by the daemon, was retried as a lost answer
    (twice the wait, then "not set within" once it); a wait of 0 meant call_timeout."""
    a, _ = two_joined(w, w.job_id, call_timeout=8)
    outcomes = []
    for wait, limit in (
        (lambda: a.kv_get("absent", timeout=1.5), 2.5),
        (lambda: a.kv_get("absent", timeout=0), 1.0),
        (lambda: a.barrier("alone", timeout=0), 1.0),
    ):
        started = time.monotonic()
        outcomes.append((*error_of(wait), time.monotonic() - started < limit))
    return outcomes


def waits_without_a_timeout_outlast_call_timeout(w: World) -> object:
    """``barrier()`` and ``kv_get()`` without a timeout waited ``call_timeout`` (30 s
    by default), not the daemon's default wait: a rank 0 writing a 45 s checkpoint
    failed its peers' barrier. ``call_timeout`` bounds calls that wait for no peer."""
    a, b = two_joined(w, w.job_id, call_timeout=1)

    def late() -> None:
        time.sleep(2.5)
        b.kv_set("late", b"v")
        b.barrier("late")

    waits = parallel([late, lambda: a.kv_get("late"), lambda: a.barrier("late")])
    return all_of(waits)


def an_oversize_request_fails_alone(w: World) -> object:
    """A KvSet over the daemon's message limit ended the client's call stream, and with
    it a barrier parked there by another thread, which then named the KvSet's size."""
    a, b = two_joined(w, w.job_id)

    def parked() -> None:
        a.barrier("parked", timeout=20)

    def oversize() -> tuple[str, str, bool]:
        time.sleep(0.5)  # the barrier parked first
        with pytest.raises(RendezvousError) as info:
            a.kv_set("big", b"x" * 100_000)
        refused = (type(info.value).__name__, info.value.method, "100" in str(info.value))
        time.sleep(0.5)
        b.barrier("parked", timeout=20)
        return refused

    return all_of(parallel([parked, oversize]))


def exit_block(twin: Twin, exc: BaseException) -> None:
    """Leave ``twin``'s ``with`` (``async with``) block by ``exc``, as its body raising it."""
    if twin._loop is None:
        twin.client.__exit__(type(exc), exc, None)
    else:
        twin._on_loop(twin.client.__aexit__(type(exc), exc, None))


def an_exception_ending_a_with_block_is_reported(w: World) -> object:
    """A worker joined by rank whose ``with`` block ended in an exception closed its
    stream: its peers read "heartbeat stream closed", and ``sys.exit(0)`` there was
    a crash too. Its exception is now its cause of record; ``sys.exit(0)`` leaves."""
    a, b = two_joined(w, w.job_id)
    exit_block(b, RuntimeError("line1\nline2"))
    wait_for("the peer's failure", lambda: a.failure is not None, 20)
    failure = a.failure
    assert isinstance(failure, PeerFailed)
    reported = (failure.ranks, failure.failed[0].cause)
    c, d = two_joined(w, w.job_id + "-exit0")
    exit_block(d, SystemExit(0))
    time.sleep(0.5)
    states = sorted(pb.MemberState.Name(m.state) for m in c.get_job().members)
    return reported, c.failure, states


def given_up_as_it_waits(w: World, twin: Twin, call: str, *args: Any, **kw: Any) -> BaseException:
    """``twin``'s ``call`` given up by its caller once the daemon holds it parked, as
    an application gives it up: Ctrl-C in the blocking client (a signal to the
    process), ``asyncio.timeout()`` expiring in the asyncio one; what it raised."""
    before = w.daemon_waiters()
    parked = functools.partial(
        wait_for, f"{call} parked at the daemon", lambda: w.daemon_waiters() > before, 10
    )
    if twin._loop is None:

        def interrupt(signum: int, frame: object) -> None:
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGUSR1, interrupt)
        kill = threading.Thread(
            target=lambda: (parked(), os.kill(os.getpid(), signal.SIGUSR1)), daemon=True
        )
        kill.start()
        try:
            getattr(twin.client, call)(*args, **kw)
        except KeyboardInterrupt as exc:
            return exc
        finally:
            kill.join(10)
            signal.signal(signal.SIGUSR1, previous)
        raise AssertionError(f"{call} was not interrupted")

    async def timed_out() -> BaseException:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(None) as deadline:
                watch = asyncio.ensure_future(asyncio.to_thread(parked))
                watch.add_done_callback(lambda _: deadline.reschedule(loop.time()))
                await getattr(twin.client, call)(*args, **kw)
        except TimeoutError as exc:
            await watch
            return exc
        raise AssertionError(f"{call} was not given up")

    given_up: BaseException = twin._on_loop(timed_out())
    return given_up


def a_with_block_given_up_in_a_call_is_reported_as_such(w: World) -> object:
    """A ``with`` block left by its caller giving up a barrier (Ctrl-C, under
    ``asyncio.run()`` the task cancelled, ``asyncio.timeout()``): its peers read the
    cause "KeyboardInterrupt: ", "CancelledError: " or "TimeoutError: ", which told
    them nothing. It now says what happened, and in which call."""
    a, b = two_joined(w, w.job_id)
    exit_block(b, given_up_as_it_waits(w, b, "barrier", "never", timeout=60))
    wait_for("the peer's failure", lambda: a.failure is not None, 20)
    failure = a.failure
    assert isinstance(failure, PeerFailed)
    cause = failure.failed[0].cause
    said = {
        "KeyboardInterrupt: the worker was interrupted (Ctrl-C, SIGINT) while in barrier()",
        "TimeoutError: the worker's own deadline (asyncio.timeout(), wait_for()) expired "
        "while in barrier()",
    }
    return failure.ranks, cause if cause not in said else "said"


def a_call_deadline_too_short_is_named(w: World) -> object:
    """``call_timeout=0.001`` against a healthy daemon: a call that got no answer within
    it blamed the daemon ("no gRPC server answered on them (... a daemon that is
    stuck)", "is the daemon running and reachable?"). It names the deadline, which the
    daemon's answer to a health check right after shows is the cause. Whether 1 ms is
    enough is a race: each kind of call is made until one is not answered in time."""

    def first_error(call: Callable[[], Any]) -> tuple[str, bool, bool] | None:
        for _ in range(40):
            try:
                call()
            except RendezvousError as exc:
                said = str(exc)
                blames = "no gRPC server" in said or "daemon running" in said
                return (
                    type(exc).__name__,
                    "too short" in said,
                    "call_timeout" in said and not blames,
                )
        return None  # never unanswered: nothing to judge

    def inspecting() -> None:
        c = w.client(call_timeout=0.001)  # its first call: connect, then ListJobs
        c.list_jobs()

    # Its KvSet answered once written to disk: rarely within 1 ms.
    durable = w.start_daemon("--state-dir", str(w.tmp / "state"))
    member = w.client(durable, call_timeout=0.001)
    member.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
    return first_error(inspecting), first_error(lambda: member.kv_set("k", b"v"))


def closed_member_refuses_calls(w: World) -> object:
    """A member's calls after close() said "not joined ... call join() first", and
    doing so said "closed"; start_heartbeat() too."""
    c = w.client()
    c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
    c.__getattr__("close")()
    refused = []
    for call in (
        lambda: c.kv_set("k", b"v"),
        lambda: c.kv_get("k"),
        lambda: c.barrier("b"),
        lambda: c.start_heartbeat(),
    ):
        with pytest.raises(RendezvousError) as info:
            call()
        refused.append((type(info.value).__name__, "is closed" in str(info.value)))
    return refused


def a_second_heartbeat_is_refused(w: World) -> object:
    """A second start_heartbeat() ran a second stream beside the first (on the sync
    client two more threads), its on_failure replacing the first's."""
    c = w.client()
    c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
    heard: list[str] = []
    c.start_heartbeat(on_failure=lambda e: heard.append(type(e).__name__))
    with pytest.raises(RendezvousError) as info:
        c.start_heartbeat(on_failure=lambda e: heard.append("the second's"))
    refused = (type(info.value).__name__, "already called" in str(info.value))
    w.client().abort("the test is done")
    wait_for("the abort heard", lambda: bool(heard), 20)
    return refused, heard


def closing_ends_parked_calls_as_closed(w: World) -> object:
    """close() from another thread while a member's calls are parked at the daemon:
    the sync client stopped its heartbeat first, so the daemon lost the member and
    answered the parked calls PeerFailed, blaming this very rank (3 rounds in 4)."""
    outcomes = []
    for round_ in range(3):
        a, _ = two_joined(w, f"{w.job_id}-{round_}")
        ended: list[object] = []

        def park(call: Callable[[], Any], ended: list[object] = ended) -> None:
            with pytest.raises(RendezvousError) as info:
                call()
            ended.append((type(info.value).__name__, "is closed" in str(info.value)))

        waiting = [
            threading.Thread(target=park, args=(functools.partial(a.kv_get, "never", timeout=30),)),
            threading.Thread(target=park, args=(functools.partial(a.barrier, "x", timeout=30),)),
        ]
        for t in waiting:
            t.start()
        time.sleep(0.5)
        Twin.__getattr__(a, "close")()
        for t in waiting:
            t.join(10)
        outcomes.append(sorted(ended))  # type: ignore[type-var]
    return outcomes


def values_a_request_cannot_carry_are_refused(w: World) -> object:
    """protobuf took None as "unset" (kv_set(k, None) stored b"", abort(None) aborted
    with no reason) and raised bare ValueErrors or TypeErrors for the rest."""
    c = w.client()
    refused = [
        error_of(lambda: c.join(num_nodes=None, gpus_per_node=1, local_rank=0)),
        error_of(lambda: c.join(num_nodes=1, gpus_per_node=1, local_rank=-1)),
        error_of(lambda: c.join(num_nodes=1, gpus_per_node=1, local_rank=0, address=None)),
    ]
    c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
    refused += [
        error_of(lambda: c.kv_set("k", None)),
        error_of(lambda: c.kv_add("n", 2**63)),
        error_of(lambda: c.kv_compare_and_set("k", b"v", None)),
        error_of(lambda: c.abort(None)),
    ]
    with pytest.raises(RendezvousError):
        c.kv_get("k", wait=False)  # nothing was stored
    c.kv_set("text", b"x")
    refused.append(error_of(lambda: c.kv_add("text")))  # a usage error, not ProtocolError
    return refused


def silent_daemon_fails_a_table_fetch_alike(w: World) -> object:
    """A daemon that accepts connections and never answers: reading the table of a
    slim join (a plain property, which the asyncio client serves over a blocking
    channel of its own) fails as the sync client's call does: within call_timeout,
    whose whole wait leaves its retry no time (docs/sdk.md, "Timeouts and deadlines")."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        endpoint = f"127.0.0.1:{silent.getsockname()[1]}"
        c = Twin(w.kind, endpoint, w.job_id, token="t", call_timeout=1, connect_timeout=1)
        w.made.append(c)
        c.attach(Membership(w.job_id, 1, 0, 2, 1, 0, ID0), "instance")
        with pytest.raises(RendezvousError) as info:
            c.membership.members  # noqa: B018
    e = info.value
    return (
        type(e).__name__,
        getattr(e, "attempts", None),
        str(e).replace(endpoint, "EP").replace(w.job_id, "JOB"),
    )


def closed_client_refuses_calls(w: World) -> object:
    """Each client used to raise gRPC's own error for its closed channel: ValueError
    from one, grpc.aio.UsageError from the other, naming no job."""
    c = w.client()
    c.list_jobs()
    c.__getattr__("close")()  # the client, not its twin's loop (closed again at the end)
    refused = []
    for call in (
        c.list_jobs,
        lambda: c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=5),
    ):
        with pytest.raises(RendezvousError) as info:
            call()
        refused.append((type(info.value).__name__, str(info.value).replace(w.job_id, "JOB")))
    c.leave()  # nothing to leave: no error
    return [(kind, text.replace(w.daemon.endpoint, "EP")) for kind, text in refused]


def a_hung_daemon_is_reported_at_its_window(w: World) -> object:
    """A daemon SIGSTOPped (hung) with a 3 s window: the blocking client said so at
    the window, the asyncio one after twice it and a look's 3 s grace (12 s of a 5 s
    window), "something accepts connections there again" (an SDK misuse review)."""
    d = w.start_daemon("--heartbeat-timeout-s", "3")
    c = w.client(d)
    c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
    heard: list[tuple[float, BaseException]] = []
    c.start_heartbeat(0.3, on_failure=lambda e: heard.append((time.monotonic(), e)))
    time.sleep(0.5)
    d.proc.send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        wait_for("the verdict", lambda: bool(heard), timeout=20)
    finally:
        d.proc.send_signal(signal.SIGCONT)
    at, error = heard[0]
    # Twice the window and a 3 s grace (9 s) before; the window (3 s) and load after.
    return type(error).__name__, at - stopped < 3 + 3, "accepts connections" in str(error)


def a_unary_wait_hears_its_daemon_lost_at_the_window(w: World) -> object:
    """With call_stream=False (an older daemon without CallBatches gets the same), a
    waiting unary call at a daemon that died waited out its whole timeout (34 s for
    30 s here, ~605 s at the default), where the call stream's heard the heartbeat's
    verdict in seconds (an SDK misuse review)."""
    d = w.start_daemon("--heartbeat-timeout-s", "3")
    c = w.client(d, call_stream=False)
    c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
    c.start_heartbeat(0.3)
    outcome: list[object] = []

    def wait() -> None:
        started = time.monotonic()
        try:
            c.kv_get("never", timeout=30)
        except RendezvousError as exc:
            outcome.append((type(exc).__name__, time.monotonic() - started < 10))

    waiting = threading.Thread(target=wait)
    waiting.start()
    time.sleep(1.0)
    d.kill()
    waiting.join(40)
    return outcome


def daemon_restart_is_survived(w: World) -> object:
    state = w.tmp / f"state-{w.kind}"
    port = free_port()
    listen = f"127.0.0.1:{port}"
    d = w.start_daemon("--state-dir", str(state), "--heartbeat-timeout-s", "10", listen=listen)
    c = w.client(d, retry_attempts=5)
    m = c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
    c.start_heartbeat(0.2)
    c.kv_set("k", b"before")
    d.terminate()
    again = w.start_daemon(
        "--state-dir", str(state), "--heartbeat-timeout-s", "10", listen=listen, token=d.token
    )
    deadline = time.monotonic() + 20
    while True:  # the client's own retries bridge the restart; these bound the test
        try:
            got = c.kv_get("k", timeout=5)
            break
        except RendezvousError:
            if time.monotonic() > deadline:
                raise
    c.kv_set("k", b"after")
    c.barrier("after-restart", timeout=10)
    assert again.endpoint == d.endpoint
    return m.generation, got, c.kv_get("k", timeout=5), c.failure


class Outage:
    """A TCP proxy in front of a daemon that can go away and come back at an exact
    instant, where a restarted daemon takes its start-up (seconds under load). Gone,
    it closes its clients' connections and refuses new ones; the daemon's side stays
    open, so the daemon sees only silence (its timeout is the test's to choose)."""

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.port = free_port()
        self.clients: list[socket.socket] = []
        self.upstream: list[socket.socket] = []
        self.listener: socket.socket | None = None
        self.up()

    def up(self) -> None:
        listener = socket.create_server(("127.0.0.1", self.port), reuse_port=False)
        self.listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        assert self.listener is not None
        self.listener.close()
        for c in self.clients:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()
        self.clients = []

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self.clients.append(client)
            self.upstream.append(upstream)  # held: collected, it would close
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)


def daemon_back_late_in_the_window_is_reattached(w: World) -> object:
    """The daemon gone (its connections closed, connects refused) and back 3 s later,
    within the member's 8 s window (margins for a loaded machine, where this thread's
    own sleeps run late): reattached, silently. (What made a daemon restarted
    late in the window miss it, gRPC's redial backoff, is timed by the restart's own
    start-up, seconds under load, so this cannot show it failing;
    test_daemon_loss.py's look at the endpoint is the fix's unit test.)"""
    d = w.start_daemon("--heartbeat-timeout-s", "30")  # the daemon waits; the member judges
    proxy = Outage(d.port)
    c = Twin(w.kind, f"127.0.0.1:{proxy.port}", w.job_id, token=d.token, reconnect_window=8)
    w.made.append(c)
    c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
    c.start_heartbeat()
    proxy.down()
    time.sleep(3.0)
    proxy.up()
    time.sleep(6.0)  # past the window, and into the grace
    failure = c.failure
    c.kv_set("k", b"after")
    return failure, c.kv_get("k", timeout=5)


def join_outlasts_the_daemons_cap_on_waits(w: World) -> object:
    """A daemon that caps waits at 1 s (--max-wait-s) and a node join given 8 s whose
    peer comes at 2.5 s: the join is answered (torchrun's join_timeout=1800 against the
    default 600 s cap heard WORLD_INCOMPLETE at 600 s, its timeout silently cut); a join
    whose own timeout passes still hears it, at that timeout."""
    d = w.start_daemon("--max-wait-s", "1")
    first, second = w.client(d), w.client(d)

    def join(c: Twin, seconds: float) -> int:
        m = c.join_node(min_nodes=2, max_nodes=2, gpus_per_node=1, timeout=seconds)
        return int(m.node_rank)

    def late() -> int:
        time.sleep(2.5)
        return join(second, 8)

    ranks = sorted(all_of(parallel([lambda: join(first, 8), late])))
    alone = Twin(w.kind, d.endpoint, f"{w.job_id}-alone", token=d.token)
    w.made.append(alone)
    started = time.monotonic()
    try:
        join(alone, 2.5)
    except RendezvousError as exc:
        # Its message counts the whole wait, not the daemon's last 1 s (a review).
        said = re.search(r"the last of \d+ waits: ([\d.]+) s in all", str(exc))
        in_all = said is not None and 2.4 < float(said[1]) < 6
        return ranks, (type(exc).__name__, exc.reason, 2.4 < time.monotonic() - started < 6), in_all
    return ranks, None


SCENARIOS: dict[str, tuple[Callable[[World], object], object]] = {
    "join, barrier and kv": (
        join_barrier_kv,
        ([0, 1], {2}, True, True, b"v", [2, 5], (True, b"w"), (False, b"w"), [True, False]),
    ),
    "a fenced id is replaced": (fenced_id_is_replaced, True),
    "a fenced pinned id is refused": (fenced_pinned_id_is_refused, ("InvalidRequest", "ID_REUSED")),
    "a fenced node id is replaced": (fenced_node_id_is_replaced, (True, True, 1)),
    "an id factory making a fenced id": (
        factory_of_a_fenced_id_is_refused,
        (("InvalidRequest", "ID_REUSED"), ("InvalidRequest", "ID_REUSED"), 4),
    ),
    "peer failure": (peer_failure_reaches_the_other_node, ("PeerFailed", [1], True)),
    "abort": (abort_reaches_a_member, ("JobAborted", True)),
    "heartbeat arguments": (heartbeat_arguments_are_checked, [True] * 9),
    "an on_failure that raises": (a_raising_on_failure_is_logged_not_raised, "JobAborted"),
    "leave": (leave_ends_membership, (None, None, ("InvalidRequest", ""))),
    "a goodbye right after start_heartbeat()": (
        a_goodbye_right_after_start_heartbeat_is_a_goodbye,
        {(None, None, None, ("MEMBER_STATE_ACTIVE", "MEMBER_STATE_LEFT"))},
    ),
    "a second join of a live member": (
        a_second_join_of_a_live_member_is_refused_and_loses_nothing,
        (("DuplicateRank", True), True, "JOB_STATE_ENDED"),
    ),
    "a join given up as its answer came": (
        a_join_given_up_as_its_answer_came_is_taken_back,
        [(True, True, True, {"MEMBER_STATE_ACTIVE"})] * 2,
    ),
    "a join given up and not sent again": (
        a_join_given_up_and_not_sent_again_leaves_its_seat,
        [(True, [True], 1), (True, [True], 0)] * 2,
    ),
    "closed with a given-up join, its daemon gone": (
        closing_with_a_join_given_up_when_its_daemon_is_gone,
        (True, True),
    ),
    "a node join given up while forming": (
        a_node_join_given_up_while_forming_frees_its_seat,
        (True, (1, 1)),
    ),
    "a join given up as it waits, retried at once": (
        a_join_given_up_as_it_waits_is_retried_at_once,
        [([True] * 4, [0, 1], [1, 1]), ([True] * 4, [0, 1], [5, 5])],
    ),
    "a re-join right after an abort": (
        a_rejoin_right_after_an_abort_reaches_the_daemon,
        {"('JobAborted', [2, 2])"},
    ),
    "a join while one is in flight": (
        a_join_while_one_is_in_flight_is_refused,
        (("InvalidRequest", ""), [0]),
    ),
    "loopback address": (
        loopback_address_aborts_a_multi_host_job,
        [("InvalidRequest", "LOOPBACK_ADDRESS")],
    ),
    "tls refusal": (
        plaintext_client_of_a_tls_daemon_is_refused,
        (("AuthenticationError", ""), ("AuthenticationError", "")),
    ),
    "a tls client of a plaintext daemon": (
        tls_client_of_a_plaintext_daemon_is_told_to_drop_its_ca,
        True,
    ),
    "tls refusal without a join": (
        plaintext_client_that_never_joins_hears_tls,
        [("AuthenticationError", "", True), ("AuthenticationError", "", True)],
    ),
    "tls refusal at connect() or inspection": (
        plaintext_connect_or_inspection_hears_tls_at_once,
        [("connect", "", True), ("list_jobs", "", True)],
    ),
    "daemon down": (daemon_down_is_unavailable, ("DaemonUnavailable", "Check", True, True)),
    "daemon restart": (daemon_restart_is_survived, (1, b"before", b"after", None)),
    "a hung daemon": (a_hung_daemon_is_reported_at_its_window, ("DaemonUnreachable", True, False)),
    "a unary wait when the daemon dies": (
        a_unary_wait_hears_its_daemon_lost_at_the_window,
        [("DaemonUnreachable", True)],
    ),
    "daemon back late in the window": (
        daemon_back_late_in_the_window_is_reattached,
        (None, b"after"),
    ),
    "a closed client": (
        closed_client_refuses_calls,
        [
            (
                "InvalidRequest",
                "the client of job 'JOB' at EP is closed: make a new client to call the "
                "daemon again",
            )
        ]
        * 2,
    ),
    "closed while it waits to connect": (
        closing_a_client_ends_its_wait_for_a_daemon,
        ([("InvalidRequest", "")], True),
    ),
    "closed during a call": (
        closing_a_client_ends_its_call_in_flight,
        [("InvalidRequest", True, True)] * 2,
    ),
    "daemon killed during a call": (
        daemon_killed_during_a_call,
        [("DaemonUnreachable", True, True), ("DaemonUnavailable", True, True)],
    ),
    "a barrier round that timed out": (
        barrier_round_is_sent_again,
        (("RendezvousTimeout", "BARRIER_TIMEOUT"), [None, None]),
    ),
    "waits end when asked": (
        waits_end_when_asked,
        [
            ("RendezvousTimeout", "KEY_WAIT_TIMEOUT", True),
            ("RendezvousTimeout", "KEY_WAIT_TIMEOUT", True),
            ("RendezvousTimeout", "BARRIER_TIMEOUT", True),
        ],
    ),
    "waits without a timeout outlast call_timeout": (
        waits_without_a_timeout_outlast_call_timeout,
        [None, b"v", None],
    ),
    "an oversize request fails alone": (
        an_oversize_request_fails_alone,
        [None, ("LimitExceeded", "KvSet", True)],
    ),
    "an exception ending a with block": (
        an_exception_ending_a_with_block_is_reported,
        (([1], "RuntimeError: line1\nline2"), None, ["MEMBER_STATE_ACTIVE", "MEMBER_STATE_LEFT"]),
    ),
    "a with block given up in a call": (
        a_with_block_given_up_in_a_call_is_reported_as_such,
        ([1], "said"),
    ),
    "a call deadline too short": (
        a_call_deadline_too_short_is_named,
        (("RendezvousTimeout", True, True), ("RendezvousTimeout", True, True)),
    ),
    "a closed member's calls": (closed_member_refuses_calls, [("InvalidRequest", True)] * 4),
    "a join outlasting the daemon's cap on waits": (
        join_outlasts_the_daemons_cap_on_waits,
        ([0, 1], ("RendezvousTimeout", "WORLD_INCOMPLETE", True), True),
    ),
    "a second heartbeat": (
        a_second_heartbeat_is_refused,
        (("InvalidRequest", True), ["JobAborted"]),
    ),
    "closed with calls parked": (
        closing_ends_parked_calls_as_closed,
        [[("InvalidRequest", True)] * 2] * 3,
    ),
    "values a request cannot carry": (
        values_a_request_cannot_carry_are_refused,
        [("InvalidRequest", "")] * 7 + [("InvalidRequest", "NOT_A_COUNTER")],
    ),
    "a silent daemon's table": (
        silent_daemon_fails_a_table_fetch_alike,
        (
            "DaemonUnavailable",
            1,
            "GetMembers to rendezvousd at EP (job 'JOB', rank 0) failed after 1 attempt: "
            "DEADLINE_EXCEEDED; it accepts connections, but no gRPC server answered on them "
            "(another service on that port, or a daemon that is stuck). Check that the "
            "daemon runs and listens there",
        ),
    ),
}


@pytest.fixture
def made() -> Iterator[list[Twin]]:
    twins: list[Twin] = []
    yield twins
    for t in twins:
        t.close()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_both_clients_end_each_scenario_alike(
    name: str,
    kind: str,
    daemon: DaemonProcess,
    job_id: str,
    tmp_path: Path,
    pki: Pki,
    start_daemon: Callable[..., DaemonProcess],
    made: list[Twin],
) -> None:
    scenario, expected = SCENARIOS[name]
    world = World(kind, daemon, job_id, tmp_path, pki, start_daemon, made)
    assert scenario(world) == expected
