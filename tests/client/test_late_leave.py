"""A job's normal end never looks like a failure (issue 21): a member whose goodbye the
daemon answers only after the SDK's ``leave_timeout`` is still LEFT, not LOST, and its
peers hear nothing. At the soak's scale 4,096 simultaneous Leaves outlasted the SDK's
2 s, and each member whose heartbeat stream the SDK then closed was lost. Here a
daemon paused on purpose (SIGSTOP) while a member with a tiny ``leave_timeout``
leaves is the same race made deterministic. Before the fix, leave() gave up after
``leave_timeout``, closed the stream, and the daemon, resumed, lost the member."""

from __future__ import annotations

import asyncio
import logging
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client import AsyncRendezvousClient, RendezvousClient, RendezvousError
from tests.support import DaemonProcess, members, parallel, scrape, spawn_daemon, wait_for

# Long enough that silence never loses anyone here: only a stream's end could.
TIMEOUT_S = "30"
LEAVE_TIMEOUT_S = 0.3
# Well past LEAVE_TIMEOUT_S: how long a paused daemon leaves leave() waiting here.
PAUSE_S = 1.0


@pytest.fixture
def paused_daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    d = spawn_daemon(tmp_path, "--heartbeat-timeout-s", TIMEOUT_S)
    yield d
    d.proc.send_signal(signal.SIGCONT)
    d.kill()


def _settled(d: DaemonProcess, job_id: str, rank: int) -> int:
    """Member ``rank``'s state once the daemon decided it (no longer ACTIVE)."""
    states: dict[int, int] = {}

    def decided() -> bool:
        states.update({m.member.rank: m.state for m in members(d, job_id)})
        return states.get(rank, pb.MEMBER_STATE_ACTIVE) != pb.MEMBER_STATE_ACTIVE

    wait_for(f"rank {rank} to leave or be lost", decided, timeout=20)
    return states[rank]


def _streams_open(d: DaemonProcess, job_id: str, ranks: int) -> Callable[[], bool]:
    def check() -> bool:
        got = members(d, job_id)
        return len(got) == ranks and all(m.heartbeat_stream_open for m in got)

    return check


def _job_state(d: DaemonProcess, job_id: str) -> int:
    with RendezvousClient(d.endpoint, job_id, token=d.token) as probe:
        return probe.get_job().summary.state


def _leave_while_paused(d: DaemonProcess, client: RendezvousClient) -> None:
    """``client.leave()`` with the daemon paused for longer than its ``leave_timeout``:
    it waits for the daemon's answer rather than closing the stream on the goodbye."""
    d.proc.send_signal(signal.SIGSTOP)
    leaving = threading.Thread(target=client.leave, daemon=True)
    leaving.start()
    leaving.join(PAUSE_S)
    assert leaving.is_alive(), "leave() gave up on an unanswered goodbye"
    d.proc.send_signal(signal.SIGCONT)
    leaving.join(20)
    assert not leaving.is_alive(), "leave() did not return once the daemon answered"
    client.close()


def _two_node_agents(d: DaemonProcess, job_id: str) -> list[RendezvousClient]:
    """Two node agents of 2 ranks each, joined (nodes 0 and 1)."""
    agents = [
        RendezvousClient(d.endpoint, job_id, token=d.token, leave_timeout=LEAVE_TIMEOUT_S)
        for _ in range(2)
    ]
    try:
        parallel(
            [
                lambda a=a, n=n: a.join_node(
                    min_nodes=2, max_nodes=2, gpus_per_node=2, node_rank=n, timeout=20
                )
                for n, a in enumerate(agents)
            ]
        )
    except BaseException:
        for a in agents:
            a.close()
        raise
    return agents


def test_a_leave_answered_after_leave_timeout_is_a_leave_not_a_loss(
    paused_daemon: DaemonProcess, job_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    d = paused_daemon
    failures: queue.Queue[RendezvousError] = queue.Queue()
    stay = RendezvousClient(d.endpoint, job_id, token=d.token)
    go = RendezvousClient(d.endpoint, job_id, token=d.token, leave_timeout=LEAVE_TIMEOUT_S)
    try:
        parallel(
            [
                lambda: stay.join(num_nodes=2, gpus_per_node=1, node_rank=0, local_rank=0),
                lambda: go.join(num_nodes=2, gpus_per_node=1, node_rank=1, local_rank=0),
            ]
        )
        stay.start_heartbeat(0.2, on_failure=failures.put)
        go.start_heartbeat(0.2, on_failure=failures.put)
        wait_for("both heartbeat streams", _streams_open(d, job_id, 2))
        # The stream's first ack (with the attach) offers the goodbye on the stream.
        wait_for("rank 1's stream acknowledged", lambda: go._s.stream_leave)
        with caplog.at_level(logging.WARNING, logger="rendezvousd.client"):
            _leave_while_paused(d, go)
        assert "could not tell the daemon" not in caplog.text
        assert _settled(d, job_id, 1) == pb.MEMBER_STATE_LEFT
        assert _job_state(d, job_id) == pb.JOB_STATE_RUNNING
        stay.leave()  # its stream's events, in order, end with its own goodbye's LEFT
        assert failures.empty(), failures.get()
        assert _job_state(d, job_id) == pb.JOB_STATE_ENDED
    finally:
        stay.close()
        go.close()


def test_a_node_agent_leaving_late_leaves_every_rank_of_its_node(
    paused_daemon: DaemonProcess, job_id: str
) -> None:
    d = paused_daemon
    failures: queue.Queue[RendezvousError] = queue.Queue()
    agents = _two_node_agents(d, job_id)
    try:
        for a in agents:
            a.start_heartbeat(0.2, on_failure=failures.put)
        wait_for("node 1's stream acknowledged", lambda: agents[1]._s.stream_leave)
        _leave_while_paused(d, agents[1])
        assert _settled(d, job_id, 2) == pb.MEMBER_STATE_LEFT
        assert _settled(d, job_id, 3) == pb.MEMBER_STATE_LEFT
        assert _job_state(d, job_id) == pb.JOB_STATE_RUNNING
        agents[0].leave()
        assert failures.empty(), failures.get()
        assert _job_state(d, job_id) == pb.JOB_STATE_ENDED
    finally:
        for a in agents:
            a.close()


async def test_the_asyncio_client_leaving_late_is_a_leave_not_a_loss(
    paused_daemon: DaemonProcess, job_id: str
) -> None:
    d = paused_daemon
    failures: list[RendezvousError] = []
    stay = AsyncRendezvousClient(d.endpoint, job_id, token=d.token)
    go = AsyncRendezvousClient(d.endpoint, job_id, token=d.token, leave_timeout=LEAVE_TIMEOUT_S)
    try:
        await asyncio.gather(
            stay.join(num_nodes=2, gpus_per_node=1, node_rank=0, local_rank=0),
            go.join(num_nodes=2, gpus_per_node=1, node_rank=1, local_rank=0),
        )
        stay.start_heartbeat(0.2, on_failure=failures.append)
        go.start_heartbeat(0.2, on_failure=failures.append)
        async with asyncio.timeout(10):
            while not go._s.stream_leave:  # the stream's first ack
                await asyncio.sleep(0.005)
        d.proc.send_signal(signal.SIGSTOP)
        leaving = asyncio.create_task(go.leave())
        done, _ = await asyncio.wait({leaving}, timeout=PAUSE_S)
        assert not done, "leave() gave up on an unanswered goodbye"
        d.proc.send_signal(signal.SIGCONT)
        await asyncio.wait_for(leaving, 20)
        await go.close()
        state = await asyncio.to_thread(_settled, d, job_id, 1)
        assert state == pb.MEMBER_STATE_LEFT
        await stay.leave()
        assert not failures, failures
    finally:
        await stay.close()
        await go.close()


def test_leave_gives_up_on_a_daemon_that_never_answers(
    tmp_path: Path, job_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The wait for the goodbye's answer is bounded: by the daemon's heartbeat
    timeout (1 s here), after which one warning says the member may be lost."""
    d = spawn_daemon(tmp_path, "--heartbeat-timeout-s", "1")
    c = RendezvousClient(d.endpoint, job_id, token=d.token, leave_timeout=LEAVE_TIMEOUT_S)
    try:
        c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        c.start_heartbeat()
        wait_for("the stream acknowledged", lambda: c._s.stream_leave)
        d.proc.send_signal(signal.SIGSTOP)
        with caplog.at_level(logging.WARNING, logger="rendezvousd.client"):
            leaving = threading.Thread(target=c.leave, daemon=True)
            leaving.start()
            leaving.join(20)
            assert not leaving.is_alive(), "leave() waited without end"
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, warnings
        assert "no answer within 1 s" in warnings[0] and "rank 0" in warnings[0]
    finally:
        d.proc.send_signal(signal.SIGCONT)
        c.close()
        d.kill()


def test_leave_from_on_failure_on_the_heartbeat_thread_returns(
    paused_daemon: DaemonProcess, job_id: str
) -> None:
    """on_failure runs on the stream's own thread, which cannot wait for itself: the
    goodbye there goes by a Leave call."""
    d = paused_daemon
    outcome: queue.Queue[BaseException | None] = queue.Queue()
    survivor = RendezvousClient(d.endpoint, job_id, token=d.token)
    victim = RendezvousClient(d.endpoint, job_id, token=d.token)

    def leave_at_once(error: RendezvousError) -> None:
        try:
            survivor.leave()
            outcome.put(None)
        except BaseException as exc:
            outcome.put(exc)

    try:
        parallel(
            [
                lambda: survivor.join(num_nodes=2, gpus_per_node=1, node_rank=0, local_rank=0),
                lambda: victim.join(num_nodes=2, gpus_per_node=1, node_rank=1, local_rank=0),
            ]
        )
        survivor.start_heartbeat(0.2, on_failure=leave_at_once)
        victim.start_heartbeat(0.2)
        wait_for("both heartbeat streams", _streams_open(d, job_id, 2))
        wait_for("the survivor's stream acknowledged", lambda: survivor._s.stream_leave)
        victim.close()  # no goodbye: a loss, which the survivor hears
        assert outcome.get(timeout=20) is None
        assert _settled(d, job_id, 0) == pb.MEMBER_STATE_LEFT
    finally:
        survivor.close()
        victim.close()


def test_a_node_agent_s_unanswered_leave_names_its_node_not_a_rank(
    paused_daemon: DaemonProcess, job_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Node 1 holds ranks 2 and 3: its warning said "rank 1 of job"."""
    d = paused_daemon
    agents = _two_node_agents(d, job_id)
    try:
        d.proc.send_signal(signal.SIGSTOP)
        with caplog.at_level(logging.WARNING, logger="rendezvousd.client"):
            agents[1].leave()  # no heartbeat stream: a Leave call, unanswered
        (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert f"node 1 of job {job_id!r} left" in warning, warning
        assert "rank 1" not in warning, warning
    finally:
        d.proc.send_signal(signal.SIGCONT)
        for a in agents:
            a.close()


def test_leaving_a_generation_already_replaced_warns_of_nothing(
    daemon: DaemonProcess, job_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A node agent leaving the generation its peers had already re-formed warned
    "could not tell the daemon ... left: job is at generation 2" on every node of a
    multi-node restart: there is nothing left to leave, and nothing went wrong."""
    old = RendezvousClient(daemon.endpoint, job_id, token=daemon.token)
    new = RendezvousClient(daemon.endpoint, job_id, token=daemon.token)
    try:
        old.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        old.abort("replaced")
        assert new.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10).generation == 2
        with caplog.at_level(logging.DEBUG, logger="rendezvousd.client"):
            old.leave()
        said = [r for r in caplog.records if "could not tell the daemon" in r.getMessage()]
        assert [r.levelno for r in said] == [logging.DEBUG], [r.getMessage() for r in said]
    finally:
        old.close()
        new.close()


@pytest.mark.parametrize("wait", ["barrier", "kv_get"])
def test_a_wait_of_a_member_that_leaves_from_another_thread_ends_at_once(
    daemon: DaemonProcess, job_id: str, wait: str
) -> None:
    """A barrier parked when its member left (leave() from another thread) ended at once;
    a key wait waited out its whole wait (30 s here, 600 s by default), then timed out
    (an SDK misuse review)."""
    c = RendezvousClient(daemon.endpoint, job_id, token=daemon.token)
    peer = RendezvousClient(daemon.endpoint, job_id, token=daemon.token)
    ended: list[tuple[float, BaseException | None]] = []

    def parked() -> None:
        try:
            if wait == "barrier":
                c.barrier("x", timeout=30)
            else:
                c.kv_get("never", timeout=30)
            ended.append((time.monotonic(), None))
        except BaseException as exc:
            ended.append((time.monotonic(), exc))

    try:
        parallel(
            [
                lambda x=x, r=r: x.join(  # type: ignore[misc]
                    num_nodes=1, gpus_per_node=2, local_rank=r, node_rank=0, timeout=20
                )
                for r, x in enumerate((c, peer))
            ]
        )
        for x in (c, peer):
            x.start_heartbeat(0.3)
        waiter = threading.Thread(target=parked)
        waiter.start()
        wait_for("the call parked", lambda: scrape(daemon.metrics_url)["rendezvousd_waiters"] >= 1)
        left = time.monotonic()
        c.leave()
        waiter.join(40)
        peer.leave()
    finally:
        c.close()
        peer.close()
    ((at, error),) = ended
    assert at - left < 5, f"the {wait} ended {at - left:.1f} s after leave()"
    assert error is not None and "left job" in str(error), error
