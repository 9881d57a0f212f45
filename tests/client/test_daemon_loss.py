"""Losing the daemon is its own fault: a worker whose heartbeat stream hears nothing
for the window gets ``DaemonUnreachable`` (never ``PeerFailed``), whether the daemon
was killed or the network silently drops packets, and ``leave()`` afterwards is a
quick warning, not a hang or an error."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from rendezvousd.client import (
    AsyncRendezvousClient,
    NodeMembership,
    NotFound,
    RendezvousClient,
    RendezvousError,
    _calls,
)
from rendezvousd.client._session import DAEMON_LOST_ADVICE, REDIAL_GRACE_S, Session, StreamWatch
from rendezvousd.client.errors import DaemonUnreachable
from tests.daemon.test_blackhole import BlackHoleProxy
from tests.support import DaemonProcess, StatefulDaemon, spawn_daemon, wait_for

TIMEOUT_S = 2.0  # the daemon's --heartbeat-timeout-s, advertised to clients at join


def _first(failures: queue.Queue[RendezvousError], limit: float) -> tuple[RendezvousError, float]:
    started = time.monotonic()
    error = failures.get(timeout=limit)
    return error, time.monotonic() - started


def test_killed_daemon_is_reported_as_unreachable_and_leave_returns_quickly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    d = spawn_daemon(tmp_path, "--heartbeat-timeout-s", str(TIMEOUT_S))
    failures: queue.Queue[RendezvousError] = queue.Queue()
    client = RendezvousClient(d.endpoint, "lost-daemon", token=d.token)
    try:
        client.join(num_nodes=1, gpus_per_node=1, node_rank=0, local_rank=0, timeout=10)
        client.start_heartbeat(0.2, on_failure=failures.put)
        d.kill()  # SIGKILL, never restarted
        error, elapsed = _first(failures, TIMEOUT_S + 10)
        assert isinstance(error, DaemonUnreachable), error
        # The window counts from the last acknowledgement (at most 0.2 s before the kill).
        assert TIMEOUT_S - 0.5 <= elapsed <= TIMEOUT_S + 2.0, elapsed
        assert d.endpoint in str(error) and "unreachable" in str(error)
        assert error.window_s == TIMEOUT_S and error.unreachable_s >= TIMEOUT_S
        assert failures.empty()  # reported once
        with pytest.raises(DaemonUnreachable):
            client.raise_if_failed()
        caplog.set_level(logging.WARNING, logger="rendezvousd.client")
        started = time.monotonic()
        client.leave()  # returns, does not raise
        assert time.monotonic() - started < 2.0 + 1.0
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, warnings
        assert d.endpoint in warnings[0] and "rank 0" in warnings[0]
        assert "results are unaffected" in warnings[0]
        started = time.monotonic()
    finally:
        client.close()
    assert time.monotonic() - started < 2.0


def test_black_holed_daemon_is_reported_as_unreachable(tmp_path: Path) -> None:
    d = spawn_daemon(tmp_path, "--heartbeat-timeout-s", str(TIMEOUT_S))
    proxy = BlackHoleProxy(d.port)
    failures: queue.Queue[RendezvousError] = queue.Queue()
    client = RendezvousClient(f"127.0.0.1:{proxy.port}", "black-hole", token=d.token)
    try:
        client.join(num_nodes=1, gpus_per_node=1, node_rank=0, local_rank=0, timeout=10)
        client.start_heartbeat(0.2, on_failure=failures.put)
        proxy.cut()  # no RST, no FIN: bytes just vanish
        error, elapsed = _first(failures, TIMEOUT_S + 10)
        assert isinstance(error, DaemonUnreachable), error
        assert elapsed <= TIMEOUT_S + 2.0, elapsed
        started = time.monotonic()
        client.leave()
        assert time.monotonic() - started < 3.0
    finally:
        client.close()
        proxy.close()
        d.kill()


async def test_async_client_reports_a_killed_daemon_within_its_own_window(
    tmp_path: Path,
) -> None:
    # The daemon allows 30 s; the client's own 1 s window wins.
    d = spawn_daemon(tmp_path, "--heartbeat-timeout-s", "30")
    seen = asyncio.Event()
    failures: list[RendezvousError] = []

    def on_failure(error: RendezvousError) -> None:
        failures.append(error)
        seen.set()

    client = AsyncRendezvousClient(
        d.endpoint, "lost-daemon-aio", token=d.token, reconnect_window=1.0
    )
    try:
        await client.join(num_nodes=1, gpus_per_node=1, node_rank=0, local_rank=0, timeout=10)
        client.start_heartbeat(0.2, on_failure=on_failure)
        d.kill()
        started = time.monotonic()
        await asyncio.wait_for(seen.wait(), 10)
        assert time.monotonic() - started <= 1.0 + 2.0
        assert len(failures) == 1 and isinstance(failures[0], DaemonUnreachable), failures
        with pytest.raises(DaemonUnreachable):
            client.raise_if_failed()
        started = time.monotonic()
        await client.leave()
        assert time.monotonic() - started < 3.0
    finally:
        await client.close()


def test_heartbeat_slower_than_the_daemon_timeout_is_sped_up_not_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Beats every 5 s against a daemon that loses members after 2 s would make each
    # side think the other is gone; the SDK beats at a third of the daemon's timeout.
    d = spawn_daemon(tmp_path, "--heartbeat-timeout-s", str(TIMEOUT_S))
    failures: queue.Queue[RendezvousError] = queue.Queue()
    caplog.set_level(logging.INFO, logger="rendezvousd.client")
    try:
        with RendezvousClient(d.endpoint, "slow-beats", token=d.token) as client:
            client.join(num_nodes=1, gpus_per_node=1, node_rank=0, local_rank=0, timeout=10)
            client.start_heartbeat(5.0, on_failure=failures.put)
            # Two daemon timeouts of quiet: a failure would have been reported by now.
            with pytest.raises(queue.Empty):
                failures.get(timeout=2 * TIMEOUT_S + 0.5)
            assert client.get_job().members[0].heartbeat_stream_open
            client.leave()
        assert any("not 5 s" in r.getMessage() for r in caplog.records), caplog.records
    finally:
        d.kill()


def _kill_once_parked(d: DaemonProcess, killed: list[float]) -> threading.Thread:
    """A thread that SIGKILLs ``d`` once a join has made its job and parked, and notes
    when in ``killed``."""

    def kill_when_parked() -> None:
        with RendezvousClient(d.endpoint, token=d.token) as probe:
            deadline = time.monotonic() + 30
            while not probe.list_jobs() and time.monotonic() < deadline:
                time.sleep(0.05)  # until node 0's JoinNode made the job
        time.sleep(0.3)  # parked
        d.kill()
        killed.append(time.monotonic())

    killer = threading.Thread(target=kill_when_parked)
    killer.start()
    return killer


@pytest.mark.parametrize("kind", ["sync", "asyncio"])
def test_a_join_parked_when_the_daemon_dies_ends_within_the_window_not_its_wait(
    tmp_path: Path, kind: str
) -> None:
    # Node 0 of 2 waits for node 1, which never comes; the daemon is SIGKILLed. The
    # join's retry would wait out the join's whole wait (60 s here) for a daemon to
    # come back; it gives up after the reconnect window (2 s) instead.
    d = spawn_daemon(tmp_path)
    started: list[float] = []

    async def join_async() -> None:
        async with AsyncRendezvousClient(
            d.endpoint, "gone-mid-join", token=d.token, reconnect_window=2
        ) as c:
            await c.join_node(min_nodes=2, max_nodes=2, gpus_per_node=1, node_rank=0, timeout=60)

    def join() -> None:
        if kind == "asyncio":
            asyncio.run(join_async())
            return
        with RendezvousClient(d.endpoint, "gone-mid-join", token=d.token, reconnect_window=2) as c:
            c.join_node(min_nodes=2, max_nodes=2, gpus_per_node=1, node_rank=0, timeout=60)

    killer = _kill_once_parked(d, started)
    with pytest.raises(DaemonUnreachable, match="was not back within 2 s") as info:
        join()
    killer.join(10)
    elapsed = time.monotonic() - started[0]
    assert elapsed < 20, f"the parked join waited {elapsed:.1f} s for a daemon gone"
    assert d.endpoint in str(info.value) and "JoinNode" in str(info.value)
    # Worded as the heartbeat's loss, whose advice torchrun's handler and the launcher
    # rewrite: it ended "then start the job again".
    assert "during JoinNode (job 'gone-mid-join')" in str(info.value), info.value
    assert str(info.value).endswith(DAEMON_LOST_ADVICE), info.value


def test_a_channel_still_ready_after_the_daemon_died_is_not_taken_for_it_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # gRPC may still say READY a moment after the daemon died (the asyncio client has
    # seen its parked call end first): the re-sent join then waited out its whole wait
    # (CI, once: 65 s). Here the channel says READY throughout; only a health check
    # that is answered counts as the daemon back.
    monkeypatch.setattr(RendezvousClient, "_ready_within", lambda *_, **__: True)
    d = spawn_daemon(tmp_path)
    killed: list[float] = []
    killer = _kill_once_parked(d, killed)
    try:
        with (
            RendezvousClient(d.endpoint, "stale-ready", token=d.token, reconnect_window=2) as c,
            pytest.raises(DaemonUnreachable, match="was not back within 2 s"),
        ):
            c.join_node(min_nodes=2, max_nodes=2, gpus_per_node=1, node_rank=0, timeout=20)
    finally:
        killer.join(10)
        d.kill()
    assert time.monotonic() - killed[0] < 10


_STOPPED_MEMBER = {
    "sync": (
        "import sys\n"
        "from rendezvousd.client import RendezvousClient\n"
        "c = RendezvousClient(sys.argv[1], 'stopped', token=sys.argv[2])\n"
        "c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)\n"
        "c.start_heartbeat(on_failure=lambda e: print(type(e).__name__, e, flush=True))\n"
        "print('ready', flush=True)\n"
        "import time; time.sleep(30)\n"
    ),
    "asyncio": (
        "import asyncio, sys\n"
        "from rendezvousd.client import AsyncRendezvousClient\n"
        "async def main():\n"
        "    async with AsyncRendezvousClient(sys.argv[1], 'stopped', token=sys.argv[2]) as c:\n"
        "        await c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)\n"
        "        c.start_heartbeat(\n"
        "            on_failure=lambda e: print(type(e).__name__, e, flush=True))\n"
        "        print('ready', flush=True)\n"
        "        await asyncio.sleep(30)\n"
        "asyncio.run(main())\n"
    ),
}


@pytest.mark.parametrize("client", sorted(_STOPPED_MEMBER))
def test_a_member_that_was_stopped_hears_what_the_daemon_did_not_that_it_died(
    tmp_path: Path, client: str
) -> None:
    """SIGSTOP for longer than the window, then SIGCONT: the watchdog (the asyncio
    client's read timeout) counted the process's own silence as the daemon's and
    reported DaemonUnreachable ("the daemon died or this node lost its network") of a
    daemon that was fine, before the stream could deliver the daemon's verdict: this
    rank lost for its silence."""
    d = spawn_daemon(tmp_path, "--heartbeat-timeout-s", "2")
    script = tmp_path / "member.py"
    script.write_text(_STOPPED_MEMBER[client])
    member = subprocess.Popen(
        [sys.executable, str(script), d.endpoint, d.token], stdout=subprocess.PIPE, text=True
    )
    try:
        assert member.stdout is not None
        assert member.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        member.send_signal(signal.SIGSTOP)
        time.sleep(5)
        member.send_signal(signal.SIGCONT)
        heard = member.stdout.readline()
    finally:
        member.kill()
        member.wait(10)
        d.kill()
    assert heard.startswith("PeerFailed") and "lost rank 0" in heard, heard
    assert "no heartbeat for" in heard, heard


class _Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE


@contextlib.contextmanager
def _session(job: str, heartbeat_timeout_s: float) -> Iterator[Session]:
    """A client's session that was told the daemon's heartbeat timeout, for the
    StreamWatch decisions without a stream (nothing listens at its endpoint)."""
    client = RendezvousClient("127.0.0.1:9", job, token="t" * 32)
    try:
        client._s.daemon_heartbeat_timeout = heartbeat_timeout_s
        yield client._s
    finally:
        client.close()


def test_a_stream_that_ends_after_a_pause_counts_the_pause_before_the_watchdog_does() -> None:
    """SIGSTOPped past the window, then continued: the stream's own thread may find its
    stream broken (the daemon gave up on its pings) before the watchdog wakes to see
    the gap, and said "the daemon died" of a daemon that was fine, where the stream was
    to get RESUMED_S to bring the daemon's verdict (CI, once under load)."""
    with _session("paused", 2.0) as session:
        watch = StreamWatch(session, None, None)  # type: ignore[arg-type]
        now = time.monotonic()
        watch.heard = now - 5.5
        watch.watchdog_at = now - 5.5  # the watchdog last ran before the stop
        watch.caught_up()
        assert watch.paused_s > 5
        deadline = watch.deadline()
        assert deadline is not None and deadline > time.monotonic() + 1.0, deadline - now
        assert watch.ended(_Unavailable()) is not None  # reconnect, not DaemonUnreachable
        assert session.failure is None


def test_a_stream_that_ends_while_the_watchdog_wakes_still_counts_the_pause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same, with the stream's thread run while the watchdog is between reading
    the gap and counting it: the watchdog's clock had moved on, so ``caught_up`` saw no
    pause and the stream's end was "the daemon died" (1 run in 6 under load)."""
    with _session("paused-race", 2.0) as session:
        watch = StreamWatch(session, None, None)  # type: ignore[arg-type]
        now = time.monotonic()
        watch.heard = now - 5.5
        watch.watchdog_at = now - 5.5
        watch.beat_s = 0.6  # a third of the window: the break is no prompt one
        watch.back_again(False)  # its look at the endpoint done: the window is the verdict
        woke = StreamWatch.woke
        switched = False

        def stream_thread_runs_first(self: StreamWatch, gap: float) -> None:
            nonlocal switched
            if not switched:  # the watchdog's own call: the stream's thread runs here
                switched = True
                self.caught_up()
                assert self.ended(_Unavailable()) is not None, "DaemonUnreachable"
            woke(self, gap)

        monkeypatch.setattr(StreamWatch, "woke", stream_thread_runs_first)
        watch.watchdog_ran()
        assert session.failure is None
        monkeypatch.undo()
        deadline = watch.deadline()
        assert deadline is not None and deadline > time.monotonic() + 1.0, deadline - now


def test_a_pause_after_the_watchdog_read_its_clock_is_still_this_processs_silence() -> None:
    """SIGSTOPped just after the watchdog read its clock (its gap small, its clock then
    set after the pause): neither it nor the stream's thread saw the pause, and the
    next look at the window said "the daemon died" of a daemon that was fine (CI,
    test_a_member_that_was_stopped_hears_what_the_daemon_did_not_that_it_died[sync],
    after f605d72). Whichever thread asks whether the window passed counts the pause
    since the watchdog's last reading first."""
    with _session("paused-late", 2.0) as session:
        watch = StreamWatch(session, None, None)  # type: ignore[arg-type]
        now = time.monotonic()
        watch.heard = now - 5.5
        watch.watchdog_at = now - 5.5  # its last reading, before the stop
        assert watch.expired() is False, session.failure
        assert session.failure is None
        assert watch.paused_s > 5
        deadline = watch.deadline()
        assert deadline is not None and deadline > time.monotonic() + 1.0, deadline - now


def test_a_broken_stream_has_the_whole_window_from_its_break() -> None:
    """The daemon SIGKILLed 1.9 s after its last ack (beats come every third of the
    window) and restarted with its state 7 s later: the window counted from that ack,
    so its members were told DaemonUnreachable (8 s after the kill, "unreachable for
    10.0 s") while the restored daemon still waited for them to reattach."""
    with _session("broken", 6.0) as session:
        watch = StreamWatch(session, None, None)  # type: ignore[arg-type]
        broke = time.monotonic()
        watch.heard = broke - 1.9
        assert watch.ended(_Unavailable()) is not None  # reconnect
        deadline = watch.deadline()
        assert deadline is not None and deadline >= broke + 6.0, deadline - broke
        assert not watch.expired()


@pytest.mark.parametrize(("broke_after", "counts_from"), [(2.0, "break"), (8.0, "ack")])
def test_only_a_prompt_break_moves_the_window_later(broke_after: float, counts_from: str) -> None:
    """Beats (and the daemon's acks) every 2 s, a 6 s window. A break 2 s after the last
    ack is the daemon going (killed): the window counts from it, as above. A break 8 s
    after it is gRPC's keepalive finding a cut network's connection dead: the daemon
    went a beat after its last ack, and counting from the break told a node cut off
    18 s after the cut, with a 10 s window (a review on namespace hosts)."""
    with _session("cut", 6.0) as session:
        member = SimpleNamespace(job_id="cut", rank=0)
        watch = StreamWatch(session, member, None, beat_s=2.0)  # type: ignore[arg-type]
        broke = time.monotonic()
        watch.heard = broke - broke_after
        watch.outage_since = broke
        deadline = watch.deadline()
        assert deadline is not None
        start = broke if counts_from == "break" else watch.heard
        assert deadline == pytest.approx(start + 6.0, abs=0.01)
        if counts_from == "ack":
            # The verdict is due 2 s after the break, and names the whole silence.
            watch.heard -= 4.5
            watch.look.looked = True  # nothing listens there: asked already
            assert watch.expired()
            failure = str(session.failure)
            assert "unreachable for 12.5 s (window 6 s)" in failure, failure


@pytest.mark.parametrize("listening", [True, False])
def test_a_broken_stream_looks_at_the_endpoint_once_its_window_passed(listening: bool) -> None:
    """Found listening again, the window gets the redial grace (gRPC dials a daemon
    that went away up to 2.4 s apart); found silent, it ends. A stream that did not
    break (a hung daemon, a cut network) is never looked at."""
    with _session("broken", 1.0) as session:
        silent = StreamWatch(session, None, None)  # type: ignore[arg-type]
        silent.heard = time.monotonic() - 2.0
        assert not silent.may_look_back()  # no break: the window is the verdict
        member = SimpleNamespace(job_id="broken", rank=0)
        watch = StreamWatch(session, member, None)  # type: ignore[arg-type]
        assert watch.ended(_Unavailable()) is not None
        assert not watch.may_look_back()  # inside the window
        watch.outage_since = watch.heard = time.monotonic() - 1.5
        assert watch.may_look_back() and not watch.expired()  # the look comes first
        watch.back_again(listening)
        assert not watch.may_look_back()  # once
        assert watch.expired() is not listening
        if listening:
            deadline = watch.deadline()
            assert deadline is not None
            assert deadline - time.monotonic() == pytest.approx(REDIAL_GRACE_S - 0.5, abs=0.2)


def test_a_join_parked_at_a_daemon_that_hangs_ends_at_the_window_not_its_timeout(
    start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    """The daemon SIGSTOPped while rank 0's join waits for its peer (its id sent as
    PublishId): its kernel still acknowledges TCP, and gRPC's keepalive timeout did
    not end the connection, so the join waited its whole timeout (600 s by default)
    and then named a deadline. Now the unanswered ping ends the connection (10 s of
    quiet, 5 s for the ack) and the parked call is the daemon's loss once the window
    passes, as for a daemon that died."""
    d = start_daemon()
    c = RendezvousClient(d.endpoint, job_id, token=d.token, reconnect_window=2)
    outcome: queue.Queue[BaseException | None] = queue.Queue()

    def join() -> None:
        try:
            c.join(num_nodes=1, gpus_per_node=2, local_rank=0, timeout=120)
        except BaseException as exc:
            outcome.put(exc)
        else:
            outcome.put(None)

    threading.Thread(target=join, daemon=True).start()
    try:
        time.sleep(1.0)  # parked at the daemon
        d.proc.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        error = outcome.get(timeout=60)
        took = time.monotonic() - stopped
    finally:
        d.proc.send_signal(signal.SIGCONT)
        c.close()
    assert isinstance(error, DaemonUnreachable), error
    assert "went away during PublishId" in str(error), error
    assert took < 30, took


def _parked_then_stopped(d: StatefulDaemon, job: str) -> tuple[threading.Thread, list[object]]:
    """Node 0 of 2 (reconnect window ``PARKED_WINDOW_S``) parked in JoinNode, then the
    daemon stopped by SIGTERM (which releases the join, DRAINING); the join's outcome
    (its NodeMembership or its error) lands in the list."""
    outcome: list[object] = []

    def join() -> None:
        try:
            with RendezvousClient(
                d.current.endpoint, job, token=d.token, reconnect_window=PARKED_WINDOW_S
            ) as c:
                outcome.append(
                    c.join_node(min_nodes=2, max_nodes=2, gpus_per_node=1, node_rank=0, timeout=60)
                )
        except RendezvousError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=join, daemon=True)
    thread.start()
    with RendezvousClient(d.current.endpoint, job, token=d.token) as probe:

        def parked() -> bool:
            try:
                return probe.get_job().id_published
            except NotFound:  # its JoinNode not there yet
                return False

        wait_for("node 0 parked", parked, 20)
    d.current.terminate()
    return thread, outcome


PARKED_WINDOW_S = 3.0


def test_a_join_released_by_a_sigterm_restart_late_in_its_window_is_sent_again(
    tmp_path: Path,
) -> None:
    """The daemon stopped by SIGTERM and serving again on its port and state dir ~1 s
    before the parked join's window ends: gRPC's next redial came after the window (up
    to 2.4 s apart by then), and the join was told "was not back within 3 s" of a
    daemon that was back (5 runs of 5), where a heartbeat stream's look at the endpoint
    gives it 3 s more (``LookBack``). Now the join gets the same look, and completes."""
    with StatefulDaemon(tmp_path) as d:
        thread, outcome = _parked_then_stopped(d, "sigterm-late")
        stopped = time.monotonic()
        # The new daemon serves ~2 s after the stop, a window's end less a second (its
        # start takes ~0.3 s of that): between gRPC's redials, then 1.4 s and 3 s after.
        time.sleep(max(0.0, PARKED_WINDOW_S - 1.3 - (time.monotonic() - stopped)))
        d.current = d._spawn()
        served = time.monotonic() - stopped
        with RendezvousClient(d.current.endpoint, "sigterm-late", token=d.token) as node1:
            # Bounded by node 0's window and grace: a node 0 that gave up forms nothing.
            with contextlib.suppress(RendezvousError):
                node1.join_node(min_nodes=2, max_nodes=2, gpus_per_node=1, node_rank=1, timeout=8)
            thread.join(30)
    if served >= PARKED_WINDOW_S and isinstance(outcome[0], DaemonUnreachable):
        # Not the case under test: the new daemon served only after the window had
        # ended (its start took seconds on a loaded host, ~0.3 s idle), and a daemon
        # not back within the window is the verdict (the next test's control).
        pytest.skip(f"the daemon served {served:.1f} s after the stop, past the window")
    assert len(outcome) == 1 and isinstance(outcome[0], NodeMembership), (served, outcome)


def test_a_join_released_by_a_daemon_stopped_for_good_ends_at_its_window(tmp_path: Path) -> None:
    """The control: no daemon comes back, nothing listens at the look, no grace is given:
    DaemonUnreachable at the window, saying so."""
    with StatefulDaemon(tmp_path) as d:
        thread, outcome = _parked_then_stopped(d, "sigterm-gone")
        stopped = time.monotonic()
        thread.join(30)
        took = time.monotonic() - stopped
    assert len(outcome) == 1 and isinstance(outcome[0], DaemonUnreachable), outcome
    said = str(outcome[0])
    assert "shut down (draining) during JoinNode" in said, said
    assert "was not back within 3 s" in said and "was stopped and not started again" in said
    assert PARKED_WINDOW_S - 0.5 <= took < PARKED_WINDOW_S + 3, took  # the window, no grace


@pytest.mark.parametrize("listening", [True, False])
def test_a_parked_call_looks_at_the_endpoint_once_its_window_passed(
    monkeypatch: pytest.MonkeyPatch, listening: bool
) -> None:
    """The steps of ``back_within`` on a clock of their own: at the window's end the
    endpoint is looked at once; found listening, the daemon has REDIAL_GRACE_S more to
    answer (here it does, 2.5 s on); found silent, the window is the verdict."""
    now = [0.0]
    monkeypatch.setattr(_calls, "time", SimpleNamespace(monotonic=lambda: now[0]))
    client = RendezvousClient("127.0.0.1:9", "looked", token="t" * 32, reconnect_window=2)
    try:
        run = _calls.Run(client._c.back_within("JoinNode", None, drained=True))
        looks = 0
        for step in run:
            if isinstance(step, _calls.Sleep):
                now[0] += step.seconds
            elif isinstance(step, _calls.Blocking):
                looks += 1
                assert now[0] >= 2.0, now[0]  # only once the window passed
                run.answer = listening
            elif isinstance(step, _calls.Reachable):
                run.answer = now[0] >= 4.5
            elif isinstance(step, _calls.Rpc):  # the health check, once reachable
                run.answer = SimpleNamespace(status=_calls.SERVING)
        assert listening and looks == 1
    except DaemonUnreachable as exc:
        assert not listening and looks == 1, exc
        assert now[0] == pytest.approx(2.0, abs=0.3)
    finally:
        client.close()
