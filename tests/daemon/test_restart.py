"""The daemon restarts without losing jobs: the state database, fencing, and a real SIGKILL."""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import signal
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from rendezvousd.client import AsyncRendezvousClient, RendezvousClient, RendezvousError
from rendezvousd.common.limits import Limits
from rendezvousd.common.model import AbortCause, JobState, JoinResult, Parked, Transition
from rendezvousd.errors import DaemonError, RendezvousFault
from rendezvousd.state.machine import JoinArgs, RendezvousState
from rendezvousd.state.over_limits import NAMED_JOBS, over_limits
from rendezvousd.storage import snapshot
from rendezvousd.storage.persistence import Persister, StateStore
from tests.daemon.raw_calls import SERVICE
from tests.support import (
    DaemonProcess,
    free_port,
    members,
    parallel,
    scrape,
    spawn_daemon,
    wait_for,
    write_token,
)

ID = b"\x07" * 128


def _args(local: int, *, uid: bytes = b"", inst: str = "") -> JoinArgs:
    return JoinArgs.worker("j", 1, 2, 0, local, "h", "", uid, inst or f"i{local}")


def _save(sm: RendezvousState, tmp: Path) -> None:
    """Opening a database for a state machine that holds jobs writes them all."""
    saver = Persister(tmp, sm)
    saver.restore()
    saver.close()


def _roundtrip(sm: RendezvousState, tmp: Path) -> RendezvousState:
    _save(sm, tmp)
    fresh = RendezvousState()
    Persister(tmp, fresh).restore()
    return fresh


def test_running_job_survives_with_kv_and_barrier_counts_but_never_the_id(tmp_path: Path) -> None:
    sm = RendezvousState()
    sm.join(_args(0, uid=ID), 0.0)
    sm.join(_args(1), 0.0)
    sm.kv_set("j", 1, 0, "addr", b"10.0.0.1:5", instance_id="i0")
    sm.barrier("j", 1, 0, "b", 1, 0.0, instance_id="i0")
    sm.barrier("j", 1, 1, "b", 1, 0.0, instance_id="i1")
    text = json.dumps(snapshot.dump(sm))
    assert ID.hex() not in text and "BwcHBwcH" not in text  # neither hex nor base64 of the id
    back = _roundtrip(sm, tmp_path)
    job = back.jobs["j"]
    assert job.state is JobState.RUNNING and job.generation == 1 and job.gen.unique_id is None
    assert back.kv_get("j", 1, 1, "addr", False, 1.0, instance_id="i1") == b"10.0.0.1:5"
    assert back.barrier("j", 1, 0, "b", 1, 1.0, instance_id="i0") == 1  # completed round remembered
    token = back.attach_stream("j", 1, 1, "i1", 1.0)  # heartbeats reattach
    assert token == 2  # 1 stands for its stream before the restart (rounds.silence_cause)
    with pytest.raises(RendezvousFault) as info:  # a member that never got the id is fenced
        back.join(_args(1), 2.0)
    assert info.value.reason == "PEER_FAILED"


def test_a_per_rank_row_written_before_join_bounds_restores_and_keeps_its_topology() -> None:
    # Rows of per-rank jobs held min_nodes = max_nodes = 0; a per-rank Join is now the
    # thin form of a node join, whose bounds are num_nodes..num_nodes.
    sm = RendezvousState()
    sm.join(_args(0, uid=ID), 0.0)
    sm.join(_args(1), 0.0)
    record = snapshot.job_record(sm.jobs["j"]) | {"min_nodes": 0, "max_nodes": 0}
    back = RendezvousState()
    snapshot.restore_job(back, record, {}, 1.0)
    with pytest.raises(RendezvousFault) as same:  # its own member, fenced for the lost id
        back.join(_args(1), 2.0)
    assert same.value.reason == "PEER_FAILED"
    other = RendezvousState()
    snapshot.restore_job(other, record, {}, 1.0)
    with pytest.raises(RendezvousFault) as wider:
        other.join(JoinArgs.worker("j", 2, 2, 1, 0, "h2", "", b"", "x"), 2.0)
    assert wider.value.reason == "TOPOLOGY_MISMATCH"
    assert wider.value.metadata["topology"] == "1x2"


def test_an_aborts_cause_is_told_with_it_and_kept_across_a_restart(tmp_path: Path) -> None:
    """The JOB_ABORTED fault carries the abort's cause as data (metadata abort_cause),
    before and after a restart; an abort without one carries none, as an older row."""
    sm = RendezvousState()
    sm.join(_args(0, uid=ID), 0.0)
    sm.join(_args(1), 0.0)
    sm.abort("j", 1, "any words", 1.0, cause=AbortCause.LOOPBACK_ADDRESS)
    for state in (sm, _roundtrip(sm, tmp_path)):
        with pytest.raises(RendezvousFault) as info:
            state.barrier("j", 1, 1, "b", 1, 2.0, instance_id="i1")
        assert info.value.reason == "JOB_ABORTED", info.value
        assert info.value.metadata["abort_cause"] == "LOOPBACK_ADDRESS", info.value.metadata
    record = snapshot.job_record(sm.jobs["j"])
    assert record["abort_cause"] == "LOOPBACK_ADDRESS"
    # A row a newer daemon wrote with a cause this one does not know: an abort like any.
    newer = RendezvousState()
    snapshot.restore_job(newer, record | {"abort_cause": "SOMETHING_NEWER"}, {}, 1.0)
    assert newer.jobs["j"].gen.abort_cause is AbortCause.UNSPECIFIED
    plain = RendezvousState()
    plain.join(_args(0, uid=ID), 0.0)
    plain.join(_args(1), 0.0)
    plain.abort("j", 1, "any words", 1.0)
    assert "abort_cause" not in snapshot.job_record(plain.jobs["j"])
    with pytest.raises(RendezvousFault) as info:
        plain.barrier("j", 1, 1, "b", 1, 2.0, instance_id="i1")
    assert info.value.reason == "JOB_ABORTED" and "abort_cause" not in info.value.metadata


def test_restored_running_job_takes_back_only_its_own_id(tmp_path: Path) -> None:
    # Found by the Hypothesis model: after a restart the daemon had no id for a running
    # generation, so rank 0 could publish a second, different one.
    sm = RendezvousState()
    sm.join(_args(0), 0.0)
    sm.publish_id("j", 1, 0, "i0", ID, 0.0)
    sm.join(_args(1), 0.0)
    back = _roundtrip(_roundtrip(sm, tmp_path / "a"), tmp_path / "b")  # two restarts
    with pytest.raises(RendezvousFault) as info:
        back.publish_id("j", 1, 0, "i0", b"\x09" * 128, 1.0)
    assert info.value.reason == "ID_CONFLICT"
    assert back.jobs["j"].gen.unique_id is None
    # A PublishId retried across the restart (same id) is answered normally.
    out = back.publish_id("j", 1, 0, "i0", ID, 1.0)
    assert isinstance(out, JoinResult) and out.unique_id == ID and out.generation == 1
    assert back.jobs["j"].state is JobState.RUNNING


def test_forming_job_is_fenced_by_a_new_generation_and_old_id_refused(tmp_path: Path) -> None:
    sm = RendezvousState()
    assert isinstance(sm.join(_args(0, uid=ID), 0.0), Parked)
    back = _roundtrip(sm, tmp_path)
    assert back.jobs["j"].generation == 2 and back.jobs["j"].state is JobState.FORMING
    assert not back.jobs["j"].gen.members
    with pytest.raises(RendezvousFault) as info:
        back.join(_args(0, uid=ID), 1.0)
    assert info.value.reason == "ID_REUSED"
    assert isinstance(back.join(_args(0, uid=b"\x08" * 128), 1.0), Parked)
    assert isinstance(back.join(_args(1), 1.0), JoinResult)


def test_every_restored_job_is_logged_when_a_forming_one_follows(tmp_path: Path) -> None:
    # Restoring a forming job discarded every effect queued before it: the jobs
    # restored ahead of it lost their "restored" transition (log line, metrics).
    sm = RendezvousState()
    sm.join(_args(0, uid=ID), 0.0)
    sm.join(_args(1), 0.0)
    running = snapshot.job_record(sm.jobs["j"])
    sm.join(JoinArgs.worker("f", 1, 2, 0, 0, "h", "", ID, "f0"), 0.0)
    forming = snapshot.job_record(sm.jobs["f"])
    back = RendezvousState()
    snapshot.restore_job(back, running, {}, 1.0)
    snapshot.restore_job(back, forming, {}, 1.0)
    assert [
        (t.job_id, t.new, t.detail) for t in back.take_effects() if isinstance(t, Transition)
    ] == [
        ("j", JobState.RUNNING, "restored"),
        ("f", JobState.FORMING, "fenced by a new generation after restart"),
    ]


def test_the_database_never_holds_the_id_or_its_encodings(tmp_path: Path) -> None:
    sm = RendezvousState()
    sm.join(_args(0, uid=ID), 0.0)
    sm.join(_args(1), 0.0)
    sm.kv_set("j", 1, 0, "k", b"v", instance_id="i0")
    _save(sm, tmp_path)
    raw = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.is_file())
    assert ID not in raw and ID.hex().encode() not in raw and b"BwcHBwcH" not in raw
    db = sqlite3.connect(tmp_path / "state.db")
    assert db.execute("SELECT state, generation FROM jobs").fetchall() == [("RUNNING", 1)]
    assert db.execute("SELECT key, value FROM kv").fetchall() == [("k", b"v")]


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        ("UPDATE jobs SET num_nodes = 'x'", "num_nodes must be an integer"),
        ("UPDATE jobs SET num_nodes = 0", "num_nodes must be an integer in 1"),
        ("UPDATE jobs SET state = 'BOGUS'", "state must be one of"),
        ("UPDATE jobs SET detail = '{'", "detail:"),
        ("UPDATE jobs SET detail = json_set(detail, '$.members[0].rank', -1)", "rank must be"),
        ("UPDATE jobs SET detail = json_set(detail, '$.id_digest', 'zz')", "id_digest must be"),
        ("UPDATE kv SET job_id = 'other'", "no job with this job_id"),
        ("UPDATE kv SET value = 'text'", "value a BLOB"),
    ],
)
def test_a_hand_edited_row_is_a_clear_startup_error_naming_it(
    tmp_path: Path, edit: str, problem: str
) -> None:
    sm = RendezvousState()
    sm.join(_args(0, uid=ID), 0.0)
    sm.join(_args(1), 0.0)
    sm.kv_set("j", 1, 0, "k", b"v", instance_id="i0")
    _save(sm, tmp_path)
    db = sqlite3.connect(tmp_path / "state.db")
    db.execute(edit)
    db.commit()
    db.close()
    with pytest.raises(DaemonError, match=r"state database .*table (jobs|kv), row") as info:
        Persister(tmp_path, RendezvousState()).restore()
    assert problem in str(info.value)


def test_a_file_that_is_not_a_database_is_a_clear_startup_error(tmp_path: Path) -> None:
    tmp_path.chmod(0o700)
    (tmp_path / "state.db").write_bytes(b"\x00\xff" * 100)
    with pytest.raises(DaemonError, match=r"cannot open state database .*it is damaged: move it"):
        Persister(tmp_path, RendezvousState()).restore()


def test_an_old_state_json_is_imported_once_and_renamed(tmp_path: Path) -> None:
    sm = RendezvousState()
    sm.join(_args(0, uid=ID), 0.0)
    sm.join(_args(1), 0.0)
    sm.kv_set("j", 1, 0, "k", b"v", instance_id="i0")
    tmp_path.chmod(0o700)
    legacy = StateStore(tmp_path)
    legacy.write(snapshot.dump(sm))
    back = RendezvousState()
    first = Persister(tmp_path, back)
    assert first.restore() == 1
    first.close()  # one daemon at a time on a state dir
    assert not legacy.path.exists() and (tmp_path / "state.json.imported").exists()
    assert back.kv_get("j", 1, 1, "k", False, 1.0, instance_id="i1") == b"v"
    again = RendezvousState()  # the next start reads the database alone
    assert Persister(tmp_path, again).restore() == 1 and again.jobs["j"].gen.kv == {"k": b"v"}


def test_a_state_json_next_to_a_database_with_jobs_is_refused(tmp_path: Path) -> None:
    sm = RendezvousState()
    sm.join(_args(0, uid=ID), 0.0)
    sm.join(_args(1), 0.0)
    _save(sm, tmp_path)
    StateStore(tmp_path).write(snapshot.dump(sm))
    with pytest.raises(DaemonError, match=r"both hold jobs.*move .*state.json aside"):
        Persister(tmp_path, RendezvousState()).restore()


def test_sigkill_and_restart_keeps_running_members_and_their_data(tmp_path: Path) -> None:
    port = free_port()
    token = write_token(tmp_path / "tok")
    state_dir = tmp_path / "state"
    flags = ("--state-dir", str(state_dir), "--heartbeat-timeout-s", "4")
    d = spawn_daemon(tmp_path, *flags, token=token, listen=f"127.0.0.1:{port}")
    endpoint = d.endpoint
    clients = [RendezvousClient(endpoint, "survivor", token=token) for _ in range(2)]
    failures: list[Exception] = []
    threads = [
        threading.Thread(
            target=lambda c=c, i=i: c.join(
                num_nodes=1, gpus_per_node=2, node_rank=0, local_rank=i, timeout=20
            )
        )
        for i, c in enumerate(clients)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for c in clients:
        c.start_heartbeat(0.3, on_failure=failures.append)
    clients[0].kv_set("before-crash", b"kept")
    d.kill()  # SIGKILL: no drain, no goodbye
    d2 = spawn_daemon(tmp_path, *flags, token=token, listen=f"127.0.0.1:{port}")
    restarted = time.monotonic()
    try:
        wait_for(
            "both members to reattach their streams",
            lambda: sum(m.heartbeat_stream_open for m in members(d2, "survivor")) == 2,
        )
        # What is tested here is that nothing fails once a whole heartbeat timeout (4 s)
        # has passed since the restart, so this wait is a measured delay, not a sync.
        time.sleep(max(0.0, restarted + 4.5 - time.monotonic()))
        assert not failures, failures
        assert clients[1].kv_get("before-crash", wait=False) == b"kept"
        done = [
            threading.Thread(target=c.barrier, args=("after-restart",), kwargs={"timeout": 10})
            for c in clients
        ]
        for t in done:
            t.start()
        for t in done:
            t.join(20)
        job = clients[0].get_job()
        assert job.summary.state == 2 and all(
            m.heartbeat_stream_open for m in job.members
        )  # RUNNING
        for c in clients:
            c.leave()
        assert "restored 1 job" in d2.log()
    finally:
        for c in clients:
            c.close()
        d2.kill()


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGKILL"])
def test_a_barrier_waiting_across_a_restart_passes_however_the_daemon_was_stopped(
    tmp_path: Path, stop: str
) -> None:
    """A member waits in a barrier while the daemon restarts with its state. SIGTERM,
    the stop systemd and Kubernetes send (a restart, an upgrade), released the waiting
    barrier with DRAINING, which the SDK raised as DaemonUnavailable: the job failed,
    where a SIGKILL restart left it running. Both now re-send the barrier to the
    restarted daemon, and the barrier passes."""
    port = free_port()
    token = write_token(tmp_path / "tok")
    flags = ("--state-dir", str(tmp_path / "state"), "--heartbeat-timeout-s", "8")
    flags += ("--drain-grace-s", "1")
    d = spawn_daemon(
        tmp_path, *flags, "--metrics-listen", "127.0.0.1:0", token=token, listen=f"127.0.0.1:{port}"
    )
    clients = [
        RendezvousClient(d.endpoint, "restarted", token=token, reconnect_window=20)
        for _ in range(2)
    ]
    joins = [
        threading.Thread(
            target=c.join, kwargs={"num_nodes": 1, "gpus_per_node": 2, "local_rank": i}
        )
        for i, c in enumerate(clients)
    ]
    for t in joins:
        t.start()
    for t in joins:
        t.join(30)
    failures: list[Exception] = []
    for c in clients:
        c.start_heartbeat(0.3, on_failure=failures.append)
    passed: list[object] = []

    def first() -> None:
        try:
            passed.append(clients[0].barrier("across", timeout=60))
        except RendezvousError as exc:
            passed.append(exc)

    waiting = threading.Thread(target=first)
    d2 = None
    try:
        waiting.start()
        wait_for("rank 0 to wait in the barrier", lambda: _parked(d) == 1)
        d.proc.send_signal(getattr(signal, stop))
        d.proc.wait(30)
        d2 = spawn_daemon(tmp_path, *flags, token=token, listen=f"127.0.0.1:{port}")
        clients[1].barrier("across", timeout=30)
        waiting.join(30)
        assert len(passed) == 1 and not isinstance(passed[0], Exception), passed
        assert not failures, failures
        assert clients[1].get_job().summary.state == JobState.RUNNING.value
    finally:
        for c in clients:
            c.close()
        d.kill()
        if d2 is not None:
            d2.kill()


def test_a_kv_add_made_while_the_daemon_restarts_counts_once_when_it_is_back(
    tmp_path: Path,
) -> None:
    """A call made between the daemon's exit and its restart waits for the daemon
    (gRPC's wait-for-ready) and is sent once, when it is back: a KvAdd, never retried
    once sent (its outcome is then unknown), must not fail there (a chaos review saw
    one fail across a SIGTERM restart, sent while the daemon stopped: not fixed)."""
    port = free_port()
    token = write_token(tmp_path / "tok")
    flags = ("--state-dir", str(tmp_path / "state"), "--heartbeat-timeout-s", "8")
    d = spawn_daemon(tmp_path, *flags, token=token, listen=f"127.0.0.1:{port}")
    c = RendezvousClient(d.endpoint, "counted", token=token, reconnect_window=20)
    d2 = None
    try:
        c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=20)
        c.start_heartbeat(0.3)
        assert c.kv_add("n", 1) == 1
        d.terminate()
        added: list[object] = []
        adder = threading.Thread(target=lambda: added.append(c.kv_add("n", 1)))
        adder.start()
        time.sleep(1.0)  # the call is made, and refused, while nothing listens
        assert added == []
        d2 = spawn_daemon(tmp_path, *flags, token=token, listen=f"127.0.0.1:{port}")
        adder.join(30)
        assert added == [2]  # sent once, after the restart
        assert c.kv_add("n", 0) == 2
    finally:
        c.close()
        d.kill()
        if d2 is not None:
            d2.kill()


@pytest.mark.parametrize("flavour", ["blocking", "asyncio"])
def test_kv_adds_in_flight_as_the_daemon_drains_each_count_once_after_its_restart(
    tmp_path: Path, flavour: str
) -> None:
    """A draining daemon answers the calls it read and ends its call streams without
    reading the rest, and refuses new streams unserved: an add left unanswered there
    was never run, and is re-sent once a daemon serves again. It failed "not repeated:
    the daemon may have applied it" (a chaos review, 1 of 23 SIGTERM rounds, a worker's
    restart used; here most runs, 8 adders on one client)."""
    port = free_port()
    token = write_token(tmp_path / "tok")
    flags = ("--state-dir", str(tmp_path / "state"), "--heartbeat-timeout-s", "8")
    d = spawn_daemon(tmp_path, *flags, token=token, listen=f"127.0.0.1:{port}")
    d2 = None
    counted: list[int] = []
    failed: list[BaseException] = []
    stop = threading.Event()

    async def add_async() -> None:
        async with AsyncRendezvousClient(
            d.endpoint, "counted", token=token, reconnect_window=20
        ) as c:
            await c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=20)
            c.start_heartbeat(0.3)

            async def add() -> None:
                while not stop.is_set():
                    try:
                        counted.append(await c.kv_add("n", 1))
                    except BaseException as exc:
                        failed.append(exc)
                        return

            await asyncio.gather(*(add() for _ in range(8)))
            counted.append(await c.kv_add("n", 0))  # the total, counted once more

    def add_blocking() -> None:
        with RendezvousClient(d.endpoint, "counted", token=token, reconnect_window=20) as c:
            c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=20)
            c.start_heartbeat(0.3)

            def add() -> None:
                while not stop.is_set():
                    try:
                        counted.append(c.kv_add("n", 1))
                    except BaseException as exc:
                        failed.append(exc)
                        return

            adders = [threading.Thread(target=add) for _ in range(8)]
            for t in adders:
                t.start()
            for t in adders:
                t.join(60)
            counted.append(c.kv_add("n", 0))

    run = add_blocking if flavour == "blocking" else lambda: asyncio.run(add_async())
    client = threading.Thread(target=lambda: failed.extend(_raised(run)))
    try:
        client.start()
        wait_for("adds under way", lambda: len(counted) >= 200 or bool(failed), timeout=30)
        d.terminate(20)
        d2 = spawn_daemon(tmp_path, *flags, token=token, listen=f"127.0.0.1:{port}")
        wait_for("adds after the restart", lambda: len(counted) >= 400 or bool(failed), timeout=60)
        stop.set()
        client.join(60)
        assert failed == [], [str(e) for e in failed]
        *adds, total = counted
        # Every add answered counted once, and none counted unanswered.
        assert sorted(adds) == list(range(1, len(adds) + 1))
        assert total == len(adds)
    finally:
        stop.set()
        client.join(30)
        d.kill()
        if d2 is not None:
            d2.kill()


@pytest.mark.parametrize("flavour", ["blocking", "asyncio"])
def test_kv_adds_a_slow_client_writes_after_the_drain_stopped_reading_count_once(
    tmp_path: Path, flavour: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client too slow to half-close within the drain's DRAIN_ANSWER_S (a loaded
    machine: load 13 on 2 cores) writes its KvAdds only after the draining daemon
    stopped reading and ended its stream: none was read, none ran, and each is re-sent
    to the daemon that replaces it and counted once. Here it writes them only once the
    daemon ended the stream (another stream, which it ends with it, says when): the
    blocking client's request feed is held, the asyncio client's event loop blocked
    (what load does to it). grpc.aio then replaced the stream's status ("Internal
    error from Core") whenever the write's failure reached it before the daemon's
    status did, most rounds, and each add failed "not repeated: the daemon may have
    applied it" (CI, 8 adders under load). Several restarts, for that race."""
    port = free_port()
    token = write_token(tmp_path / "tok")
    flags = ("--state-dir", str(tmp_path / "state"), "--heartbeat-timeout-s", "8")
    daemons = [spawn_daemon(tmp_path, *flags, token=token, listen=f"127.0.0.1:{port}")]
    # The asyncio race is lost in most rounds, not all; the blocking client has none.
    rounds, adds = (5 if flavour == "asyncio" else 2), 8

    restarts: list[threading.Thread] = []
    restart_failed: list[BaseException] = []

    def drained() -> None:
        """The daemon drains and ends its call streams unread while the client's
        calls wait to be written; a daemon serves there again once it exited."""
        for t in restarts:
            t.join(60)
        assert restart_failed == [], restart_failed
        d = daemons[-1]
        with _watched_stream(d) as ended:  # ended as the client's stream is
            d.proc.send_signal(signal.SIGTERM)
            assert ended.wait(30), "the draining daemon did not end its call streams"
        time.sleep(0.2)  # the client's gRPC has the end of its stream by now

        def again() -> None:
            try:
                d.proc.wait(30)
                daemons.append(
                    spawn_daemon(tmp_path, *flags, token=token, listen=f"127.0.0.1:{port}")
                )
            except BaseException as exc:
                restart_failed.append(exc)

        restarts.append(threading.Thread(target=again, daemon=True))
        restarts[-1].start()

    async def add_async() -> list[object]:
        async with AsyncRendezvousClient(
            daemons[0].endpoint, "counted", token=token, reconnect_window=30
        ) as c:
            await c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=20)
            got: list[object] = [await c.kv_add("n", 1)]  # the stream has answered calls
            for _ in range(rounds):
                calls = [asyncio.ensure_future(c.kv_add("n", 1)) for _ in range(adds)]
                await asyncio.sleep(0)  # each is queued on the stream, none written yet
                drained()  # on the event loop: nothing of the client runs meanwhile
                got += await asyncio.gather(*calls, return_exceptions=True)
            return [*got, await c.kv_add("n", 0)]

    def add_blocking() -> list[object]:
        from rendezvousd.client import _call_stream

        held = threading.Event()
        held.set()
        feed = _call_stream._BlockingStream._requests

        def slow_feed(self: Any) -> Iterator[Any]:
            for batch in feed(self):
                held.wait(60)
                yield batch

        monkeypatch.setattr(_call_stream._BlockingStream, "_requests", slow_feed)
        endpoint = daemons[0].endpoint
        with RendezvousClient(endpoint, "counted", token=token, reconnect_window=30) as c:
            c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=20)
            got: list[object] = [c.kv_add("n", 1)]
            for done in range(rounds):
                held.clear()
                adders = threading.Thread(target=lambda: got.extend(_outcomes(c, adds)))
                adders.start()
                sent = 1 + (done + 1) * adds
                wait_for("the adds queued", lambda: c._mux.sent["KvAdd"] >= sent, timeout=10)  # type: ignore[union-attr]  # noqa: B023
                drained()
                held.set()
                adders.join(60)
            return [*got, c.kv_add("n", 0)]

    try:
        *answers, total = add_blocking() if flavour == "blocking" else asyncio.run(add_async())
        failed = [str(o) for o in answers if isinstance(o, BaseException)]
        assert failed == [], failed
        # Every add answered counted once, and none counted unanswered.
        assert sorted(answers) == list(range(1, len(answers) + 1))  # type: ignore[type-var]
        assert total == len(answers) == 1 + rounds * adds
    finally:
        for t in restarts:
            t.join(60)
        for d in daemons:
            d.kill()


@contextlib.contextmanager
def _watched_stream(d: DaemonProcess) -> Iterator[threading.Event]:
    """A CallBatches stream of ``d``, served, that sends nothing and never
    half-closes, and an event set once the daemon ends it, however."""
    ended = threading.Event()
    requests: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
    with grpc.insecure_channel(d.endpoint) as channel:
        call = channel.stream_stream(f"/{SERVICE}/CallBatches")(
            iter(requests.get, None),
            metadata=[("authorization", f"Bearer {d.token}")],
            timeout=60,
        )

        def read() -> None:
            with contextlib.suppress(grpc.RpcError):
                for _ in call:
                    pass
            ended.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            call.initial_metadata()  # served: the daemon ends it with its drain, not first
            yield ended
        finally:
            requests.put(None)
            call.cancel()
            reader.join(10)


def _outcomes(c: RendezvousClient, adds: int) -> list[object]:
    """``adds`` KvAdds of 1 made at once on ``c``'s stream: their answers or errors."""
    got: list[object] = []

    def add() -> None:
        try:
            got.append(c.kv_add("n", 1))
        except Exception as exc:
            got.append(exc)

    threads = [threading.Thread(target=add) for _ in range(adds)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return got


def _raised(run: Callable[[], object]) -> list[BaseException]:
    try:
        run()
    except BaseException as exc:
        return [exc]
    return []


def _parked(d: DaemonProcess) -> float:
    """The calls parked at the daemon (a join, barrier or key wait)."""
    return scrape(d.metrics_url)["rendezvousd_waiters"]


def test_a_job_restored_over_a_lowered_kv_limit_is_named_at_start_and_keeps_working(
    tmp_path: Path,
) -> None:
    """Restarted with a smaller --max-kv-bytes (or by a release that added a per-job
    limit), a job holding more was restored without a word, and then every KvSet it
    made was refused, an overwrite of the same size included (found by review)."""
    token = write_token(tmp_path / "tok")
    state = ("--state-dir", str(tmp_path / "state"))
    listen = f"127.0.0.1:{free_port()}"
    d = spawn_daemon(tmp_path, *state, "--max-kv-bytes", "400000", token=token, listen=listen)
    d2 = None
    with RendezvousClient(d.endpoint, "kvjob", token=token) as c:
        try:
            c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=20)
            for k in range(5):
                c.kv_set(f"k{k}", b"x" * 30_000)
            d.kill()
            d2 = spawn_daemon(
                tmp_path, *state, "--max-kv-bytes", "200000", token=token, listen=listen
            )
            assert "restored 1 job" in d2.log(), d2.log()
            assert (
                "job 'kvjob' holds 150010 key-value bytes, over the 100000 one job may now hold"
                in d2.log()
            ), d2.log()
            c.kv_set("k0", b"y" * 30_000)  # as long: refused before
            assert c.kv_get("k0", wait=False) == b"y" * 30_000
        finally:
            d.kill()
            if d2 is not None:
                d2.kill()


def test_jobs_restored_over_lowered_job_member_and_key_limits_are_named_at_start(
    tmp_path: Path,
) -> None:
    """Restarted with a lower --max-jobs, --max-members-per-job or --max-keys-per-job,
    jobs holding more were restored without a word (an audit): only KV bytes were
    named, though operations.md says the daemon names such data as it starts."""
    token = write_token(tmp_path / "tok")
    state = ("--state-dir", str(tmp_path / "state"))
    listen = f"127.0.0.1:{free_port()}"
    d = spawn_daemon(tmp_path, *state, token=token, listen=listen)
    d2 = None
    clients = [
        RendezvousClient(d.endpoint, job, token=token) for job in ("wide", "wide", "keys", "small")
    ]
    try:
        shapes = [(2, 0), (2, 1), (1, 0), (1, 0)]  # (gpus_per_node, local_rank)
        joined = parallel(
            [
                lambda c=c, g=g, r=r: c.join(num_nodes=1, gpus_per_node=g, local_rank=r, timeout=20)
                for c, (g, r) in zip(clients, shapes, strict=True)
            ]
        )
        assert not [j for j in joined if isinstance(j, BaseException)], joined
        for k in range(3):
            clients[2].kv_set(f"k{k}", b"v")
        d.kill()
        limits = ("--max-jobs", "2", "--max-members-per-job", "1", "--max-keys-per-job", "2")
        d2 = spawn_daemon(tmp_path, *state, *limits, token=token, listen=listen)
        log = d2.log()
        assert "restored 3 job(s)" in log, log
        warned = [line for line in log.splitlines() if " WARNING " in line]
        assert any(
            "job 'wide' holds a world of 2 ranks, over max_members_per_job=1 (its generation "
            "goes on; a join of that world size, its next generation's, is refused): it "
            "keeps them; restart with the limit raised, or let the job end" in line
            for line in warned
        ), log
        assert any(
            "job 'keys' holds 3 keys, over max_keys_per_job=2 (a new key is refused until it "
            "deletes keys)" in line
            for line in warned
        ), log
        assert any(
            "restored 3 live jobs, over max_jobs=2: every one is kept, and no new job can "
            "start until fewer than 2 remain live" in line
            for line in warned
        ), log
        assert not [line for line in warned if "'small'" in line], log
        assert len(warned) == 3, log
        assert clients[2].kv_get("k2", wait=False) == b"v"  # nothing was dropped
    finally:
        for c in clients:
            c.close()
        d.kill()
        if d2 is not None:
            d2.kill()


def test_many_jobs_over_a_lowered_limit_are_said_in_one_summary_line() -> None:
    """A restart with a much lower limit must not print a line per job of thousands."""
    sm = RendezvousState()
    for n in range(NAMED_JOBS + 3):
        sm.join(JoinArgs.worker(f"job{n}", 1, 1, 0, 0, "h", "", ID, f"i{n}"), 0.0)
        sm.kv_set(f"job{n}", 1, 0, "a", b"x", instance_id=f"i{n}")
        sm.kv_set(f"job{n}", 1, 0, "b", b"x", instance_id=f"i{n}")
    lines = over_limits(sm.jobs, Limits(max_keys_per_job=1, max_jobs=4))
    assert lines == [
        f"{NAMED_JOBS + 3} restored jobs hold more than the limits now allow (11 over "
        "max_keys_per_job): jobs 'job0', 'job1', 'job2', 'job3', 'job4', 'job5', 'job6', "
        "'job7' and 3 more; they keep it; restart with the limits raised, or let the jobs "
        "end (`rendezvousd status` lists them)",
        "restored 11 live jobs, over max_jobs=4: every one is kept, and no new job can "
        "start until fewer than 4 remain live (forming with a joiner present, or running); "
        "restart with a larger --max-jobs to start new ones meanwhile",
    ]
    assert over_limits(sm.jobs, Limits()) == []
    # Finished jobs fill no slot (a new job takes theirs): not said to be over max_jobs.
    for n in range(NAMED_JOBS + 3):
        sm.leave(f"job{n}", 1, 0, f"i{n}", 1.0)
    assert not [line for line in over_limits(sm.jobs, Limits(max_jobs=4)) if "max_jobs" in line]


def test_a_job_keeps_its_age_across_a_restart(tmp_path: Path) -> None:
    """When a job entered its state died with the old process's clock: restored, an
    ended job's TTL (and the age `status` shows) started again, so a daemon
    restarting more often than job_ttl_s never forgot one, and each held a
    --max-jobs slot."""
    sm = RendezvousState()
    ended_at = time.monotonic() - 100.0
    sm.join(_args(0, uid=ID), ended_at - 1.0)
    sm.join(_args(1), ended_at - 1.0)
    sm.leave("j", 1, 0, "i0", ended_at)
    sm.leave("j", 1, 1, "i1", ended_at)
    assert sm.jobs["j"].state is JobState.ENDED
    back = _roundtrip(sm, tmp_path).jobs["j"]
    assert back.state is JobState.ENDED
    assert back.state_since == pytest.approx(ended_at, abs=1.0)


def test_a_member_of_a_daemon_restarted_without_its_state_is_told_so(tmp_path: Path) -> None:
    """It read only "job 'j' does not exist", as for a typo in the job id."""
    token = write_token(tmp_path / "tok")
    listen = f"127.0.0.1:{free_port()}"
    d = spawn_daemon(tmp_path, token=token, listen=listen)
    with RendezvousClient(d.endpoint, "j", token=token, retry_attempts=0) as c:
        c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        d.kill()
        again = spawn_daemon(tmp_path, token=token, listen=listen)
        try:
            with pytest.raises(RendezvousError) as info:
                c.kv_set("k", b"v")
        finally:
            again.kill()
    assert info.value.reason == "JOB_NOT_FOUND", info.value
    assert "the daemon restarted without --state-dir" in str(info.value), info.value


def test_every_node_agent_of_a_daemon_restarted_without_its_state_is_told_so(
    tmp_path: Path,
) -> None:
    """The first agent to call after the restart heard that the job does not exist and
    joined again, which started the job's generation 1 anew; the second, calling for
    its seat in the forgotten run's generation 1, heard that its node rank "belongs to
    another node agent instance (or to none)": read as a duplicate agent, nothing of
    the restart. Every caller of the forgotten run hears why."""
    token = write_token(tmp_path / "tok")
    listen = f"127.0.0.1:{free_port()}"
    d = spawn_daemon(tmp_path, token=token, listen=listen)
    again: DaemonProcess | None = None
    shape = {"min_nodes": 1, "max_nodes": 2, "gpus_per_node": 1, "timeout": 20}
    clients = [RendezvousClient(d.endpoint, "jns", token=token, retry_attempts=0) for _ in range(3)]
    n1, n2, n1_again = clients
    try:
        # Both within the last call: the generation forms once the second joins.
        joined = parallel([lambda c=c: c.join_node(last_call=10, **shape) for c in (n1, n2)])
        assert all(m.generation == 1 for m in joined), joined
        d.kill()
        again = spawn_daemon(tmp_path, token=token, listen=listen)
        with pytest.raises(RendezvousError) as first:
            n1.report_failure(0, "a worker failed", timeout=10)
        assert first.value.reason == "JOB_NOT_FOUND", first.value
        assert "the daemon restarted without --state-dir" in str(first.value), first.value
        # n1's agent joins again, as told: generation 1 of the job, run anew, alone.
        rejoined = n1_again.join_node(last_call=0.2, **shape)
        assert (rejoined.generation, rejoined.num_nodes) == (1, 1), rejoined
        with pytest.raises(RendezvousError) as second:
            n2.report_failure(0, "a worker failed", timeout=10)
        said = str(second.value)
        # Its reason stays the seat's refusal (a token holder naming a seat it never
        # joined hears the same): what changes is that it says why.
        assert second.value.reason == "DUPLICATE_RANK", said
        assert "of job 'jns' generation 1 was never this node agent instance's" in said, said
        assert "it made no join on this daemon, which started at 20" in said, said
        assert "--state-dir: if this caller joined before then, that restart forgot" in said
        assert "the job's generation 1 now is a new run of it" in said, said
        assert "join again" in said and "belongs to another node agent" not in said, said
    finally:
        for c in clients:
            c.close()
        d.kill()
        if again is not None:
            again.kill()


@pytest.mark.parametrize("cause", ["", "SETUP_ERROR"])
def test_a_closed_run_is_still_closed_after_a_restart(tmp_path: Path, cause: str) -> None:
    """A close (``close_run``: a torchrun agent out of restarts whose round the others
    cannot form without it) is kept in the state database: restarted on it, the daemon
    still refuses the node agents launched before the close, a survivor and a standby,
    as closed; it let the survivor open the next generation and wait its join timeout
    there, and parked the standby, for nodes that had stopped for good. The close's
    cause is kept with it (``SETUP_ERROR``: a node agent that left on its setting, which
    the refused nodes end on as a setup error)."""
    from rendezvousd.client import JobAborted

    token = write_token(tmp_path / "tok")
    listen = f"127.0.0.1:{free_port()}"
    flags = ("--state-dir", str(tmp_path / "state"))
    d = spawn_daemon(tmp_path, *flags, token=token, listen=listen)
    again: DaemonProcess | None = None
    shape = {"min_nodes": 2, "max_nodes": 2, "gpus_per_node": 1}
    launched = time.monotonic()
    clients = [RendezvousClient(d.endpoint, "closed", token=token) for _ in range(4)]
    a, b, probe, spare = clients
    try:
        joined = parallel(
            [lambda c=c: c.join_node(timeout=20, launched=launched, **shape) for c in (a, b)]
        )
        assert all(m.generation == 1 for m in joined), joined
        b.report_failure(0, "exit code -9")
        b.leave(final=True)
        assert probe.close_run(
            "closed: node b stopped, no restarts left", generation=1, cause=cause
        )
        d.kill()
        again = spawn_daemon(tmp_path, *flags, token=token, listen=listen)
        for client, standby in ((a, False), (spare, True)):
            with pytest.raises(JobAborted) as info:
                client.join_node(timeout=10, launched=launched, standby=standby, **shape)
            said = str(info.value)
            assert "was closed" in said and "node b stopped, no restarts left" in said, said
            assert info.value.abort_cause == cause, info.value
        assert probe.get_job().summary.generation == 1  # nothing opened
        # Launched after the close: a new run, with no seat kept for the closed run's
        # nodes (its second node was refused WORLD_FULL for a seat hold).
        fresh = time.monotonic()
        clients += [RendezvousClient(again.endpoint, "closed", token=token) for _ in range(2)]
        new_run = parallel(
            [lambda c=c: c.join_node(timeout=10, launched=fresh, **shape) for c in clients[4:]]
        )
        assert all(getattr(m, "generation", None) == 2 for m in new_run), new_run
    finally:
        for c in clients:
            c.close()
        d.kill()
        if again is not None:
            again.kill()


def test_a_drained_restart_goes_on_counting_each_members_silence() -> None:
    """A member silent when the daemon drained (its host cut off) was given a whole
    heartbeat timeout again from the restore, so it was lost seconds after its peers'
    own links had noticed, and the peer that reported first was named as the root
    cause. Its silence now goes on across a drained restart (the restart's seconds
    counted for every member, as the SDK counts its reconnect window from the drain; a
    member between two beats of its cadence counts from the drain), keeping
    REATTACH_S to reattach; a row from no drain, or a daemon down for a
    timeout or longer, gives a whole timeout as before."""
    sm = RendezvousState()
    sm.join(_args(0, uid=ID), 1000.0)
    sm.join(_args(1), 1000.0)
    job = sm.jobs["j"]
    timeout = sm.timing.heartbeat_timeout_s
    job.gen.members[0].last_seen = 1000.0  # heard as the drain began
    job.gen.members[1].last_seen = 996.0  # silent for 4 s by then, beating every 0.5 s
    job.gen.members[1].beat_gap = 0.5
    assert "drained_unix" not in snapshot.job_record(job)
    sm.drain(1000.0)
    drained = snapshot.job_record(job)

    def silences(raw: dict[str, Any], now: float) -> list[float]:
        fresh = RendezvousState()
        snapshot.restore_job(fresh, raw, {}, now)
        restored = fresh.jobs["j"]
        assert "drained_unix" not in snapshot.job_record(restored)  # its next row: none
        return [round(now - restored.gen.members[r].last_seen, 3) for r in (0, 1)]

    assert silences(drained, 1003.0) == [3.0, 7.0]
    # Between two beats of its own cadence (every 3 s here) it was beating: counted from
    # the drain, as its SDK counts its window, not from its last beat.
    job.gen.members[0].last_seen, job.gen.members[0].beat_gap = 998.0, 3.0
    assert silences(snapshot.job_record(job), 1003.0) == [3.0, 7.0]
    job.gen.members[0].beat_gap = 1.0  # two beats missed: silent since its last
    assert silences(snapshot.job_record(job), 1003.0) == [5.0, 7.0]
    # One beat only (its gap was from its join): its cadence is taken as the longest
    # the daemon allows, a third of the timeout, so 4 s after its join it was beating.
    job.gen.members[0].last_seen, job.gen.members[0].beat_gap = 996.0, None
    assert silences(snapshot.job_record(job), 1003.0) == [3.0, 7.0]
    job.gen.members[0].last_seen = 1000.0
    job.gen.members[1].last_seen = 1000.0 - (timeout - 1.0)
    assert silences(snapshot.job_record(job), 1003.0) == [3.0, timeout - snapshot.REATTACH_S]
    # Rows keep Unix seconds to the millisecond (``snapshot._unix``): the drain read back
    # is up to 0.5 ms off, by where the wall clock's offset falls, so one millisecond past
    # the timeout (at exactly the timeout this failed on some runs: [8.0, 8.0]).
    assert silences(drained, 1000.0 + timeout + 0.001) == [0.0, 0.0]
    undrained = {k: v for k, v in drained.items() if k != "drained_unix"}
    assert silences(undrained, 1003.0) == [0.0, 0.0]


def test_a_member_that_beat_once_before_a_drain_is_beating_not_silent() -> None:
    """Its first beat's gap is from its join, not a cadence: taken as one, a member
    drained within its first beat interval of a generation (3.3 s at the default) was
    counted silent from its last beat (a chaos review), and got that much less than its
    SDK gives itself to reattach. Until it beat twice, its cadence is a third of the
    timeout, the longest the daemon allows."""
    sm = RendezvousState()
    sm.join(_args(0, uid=ID), 1000.0)
    sm.join(_args(1), 1000.0)
    for rank in (0, 1):
        sm.heartbeat("j", 1, rank, 1000.1)
    sm.drain(1003.0)
    fresh = RendezvousState()
    snapshot.restore_job(fresh, snapshot.job_record(sm.jobs["j"]), {}, 1004.0)
    restored = fresh.jobs["j"].gen.members
    assert [round(1004.0 - restored[r].last_seen, 3) for r in (0, 1)] == [1.0, 1.0]


async def test_the_time_a_restore_takes_is_no_restored_members_silence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member silent long before a drain is left REATTACH_S to reattach: counted from
    when the restore began, a slow restore (a big state dir) took its own time out of
    that (a chaos review: 1.63 s left of 2 after a 0.37 s restore). It counts from when
    the daemon serves."""
    from rendezvousd.config import DaemonConfig
    from rendezvousd.daemon import Daemon

    now = time.monotonic()
    sm = RendezvousState()
    sm.join(_args(0, uid=ID), now)
    sm.join(_args(1), now)
    silent = sm.jobs["j"].gen.members[1]
    silent.last_seen, silent.beat_gap = now - 9.0, 0.5
    sm.drain(now)
    _save(sm, tmp_path)
    restore = Persister.restore

    def slow_restore(self: Persister) -> int:
        restored = restore(self)
        time.sleep(1.0)  # what a big state dir's restore takes
        return restored

    monkeypatch.setattr(Persister, "restore", slow_restore)
    daemon = Daemon(DaemonConfig(listen="127.0.0.1:0", state_dir=tmp_path), ["t" * 32])
    await daemon.start()
    try:
        member = daemon.state.jobs["j"].gen.members[1]
        left = daemon.state.timing.heartbeat_timeout_s - (time.monotonic() - member.last_seen)
        assert left > snapshot.REATTACH_S - 0.3, f"{left:.2f} s left to reattach"
    finally:
        await daemon.stop(grace=0)
