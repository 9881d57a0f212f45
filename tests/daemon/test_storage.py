"""Storage failure applies nothing: a change is durable before it is applied and answered.

A real daemon whose ``--state-dir`` is taken away: its key-value calls fail with
UNAVAILABLE / STORAGE_UNAVAILABLE and change nothing, health says NOT_SERVING, and
once the directory is back the daemon rewrites its state and serves again.
"""

from __future__ import annotations

import contextlib
import shutil
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from rendezvousd.client import RendezvousClient, RendezvousError
from tests.daemon.raw_calls import bearer, raw, reason_of
from tests.support import DaemonProcess, scrape, serve_refused, spawn_daemon, wait_for

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _health(d: DaemonProcess) -> int:
    with grpc.insecure_channel(d.endpoint) as ch:
        status: int = (
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        )
        return status


def _start(tmp_path: Path, heartbeat_timeout_s: int = 5) -> tuple[DaemonProcess, Path]:
    state = tmp_path / "state"
    flags = ("--state-dir", str(state), "--heartbeat-timeout-s", str(heartbeat_timeout_s))
    return spawn_daemon(tmp_path, *flags, "--metrics-listen", "127.0.0.1:0"), state


def _stored(state: Path, job_id: str, key: str) -> bytes | None:
    db = sqlite3.connect(state / "state.db")
    try:
        row = db.execute("SELECT value FROM kv WHERE job_id=? AND key=?", (job_id, key)).fetchone()
    finally:
        db.close()
    return None if row is None else bytes(row[0])


@contextlib.contextmanager
def joined_pair(
    d: DaemonProcess, job_id: str
) -> Iterator[tuple[RendezvousClient, RendezvousClient]]:
    """Two clients joined, concurrently, as local ranks 0 and 1 of one 1-node job;
    closed after."""
    pair = (
        RendezvousClient(d.endpoint, job_id, token=d.token),
        RendezvousClient(d.endpoint, job_id, token=d.token),
    )
    try:
        threads = [
            threading.Thread(
                target=c.join,
                kwargs={"num_nodes": 1, "gpus_per_node": 2, "local_rank": i, "timeout": 10},
            )
            for i, c in enumerate(pair)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        assert all(c.membership is not None for c in pair), "the pair did not form"
        yield pair
    finally:
        for c in pair:
            c.close()


@contextlib.contextmanager
def _writer_and_reader(
    tmp_path: Path, job_id: str, heartbeat_timeout_s: int = 5
) -> Iterator[tuple[DaemonProcess, Path, RendezvousClient, RendezvousClient]]:
    """A daemon with a state dir, and two clients joined to one job; all closed after."""
    d, state = _start(tmp_path, heartbeat_timeout_s)
    try:
        with joined_pair(d, job_id) as (writer, reader):
            yield d, state, writer, reader
    finally:
        d.kill()


def _assert_undone(d: DaemonProcess, reader: RendezvousClient, why: str) -> None:
    """Once the daemon serves again, the failed set of key "k" is not there."""
    wait_for(f"health SERVING once {why}", lambda: _health(d) == SERVING)
    with pytest.raises(RendezvousError) as undone:
        reader.kv_get("k", wait=False)
    assert undone.value.reason == "KEY_NOT_FOUND"


def test_a_removed_state_dir_refuses_changes_applies_nothing_and_recovers(tmp_path: Path) -> None:
    d, state = _start(tmp_path)
    client = RendezvousClient(d.endpoint, "counted", token=d.token)
    try:
        client.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        assert client.kv_add("n", 1) == 1
        assert _stored(state, "counted", "n") == b"1"  # incremental: that key's row
        shutil.rmtree(state)
        with pytest.raises(RendezvousError) as info:
            client.kv_add("n", 1)
        assert info.value.code == "UNAVAILABLE" and info.value.reason == "STORAGE_UNAVAILABLE"
        assert str(state) not in str(info.value) and "state.db" not in str(info.value)
        assert _health(d) == NOT_SERVING
        # Refused up front while storage is down: not applied, so a retry cannot double-count.
        with pytest.raises(RendezvousError, match="not applied"):
            client.kv_set("other", b"x")
        assert client.kv_get("n", wait=False) == b"1"
        with pytest.raises(RendezvousError) as missing:
            client.kv_get("other", wait=False)
        assert missing.value.reason == "KEY_NOT_FOUND"
        assert "cannot write the state database" in d.log()

        state.mkdir(mode=0o700)
        wait_for("health SERVING once storage is back", lambda: _health(d) == SERVING)
        assert client.kv_add("n", 1) == 2  # the retry counts once
        assert _stored(state, "counted", "n") == b"2"
    finally:
        client.close()
        d.kill()
    # The rewritten database is the whole state: a restart finds the job and its counter.
    d2 = spawn_daemon(tmp_path, "--state-dir", str(state))
    try:
        assert "restored 1 job" in d2.log()
    finally:
        d2.kill()


def _health_cli(d: DaemonProcess) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rendezvousd.cli", "health", "--endpoint", d.endpoint],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_health_command_exits_4_while_storage_fails(tmp_path: Path) -> None:
    """``rendezvousd health`` (grpc_health_probe's exit codes) at a daemon whose
    storage failed: 4, NOT_SERVING, named; 0 again once storage is back."""
    d, state = _start(tmp_path)
    client = RendezvousClient(d.endpoint, "probed", token=d.token)
    try:
        client.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        shutil.rmtree(state)
        with pytest.raises(RendezvousError) as info:
            client.kv_set("k", b"v")  # the change whose commit fails
        assert info.value.reason == "STORAGE_UNAVAILABLE"
        result = _health_cli(d)
        assert result.returncode == 4, (result.returncode, result.stdout, result.stderr)
        assert result.stderr == f"rendezvousd health: {d.endpoint} is NOT_SERVING\n"
        assert result.stdout == ""
        state.mkdir(mode=0o700)
        wait_for("health SERVING once storage is back", lambda: _health(d) == SERVING)
        result = _health_cli(d)
        assert result.returncode == 0, (result.returncode, result.stdout, result.stderr)
        assert result.stdout == f"rendezvousd health: {d.endpoint} is SERVING\n"
    finally:
        client.close()
        d.kill()


def test_a_reader_woken_by_a_change_that_failed_gets_the_fault_not_the_value(
    tmp_path: Path,
) -> None:
    outcome: list[object] = []
    with _writer_and_reader(tmp_path, "woken") as (d, state, writer, reader):
        # A raw call without the SDK's channel retries: the first answer is what is
        # asserted, not that of a re-sent KvGet parked again.
        request = pb.KvGetRequest(key="k", wait=True, wait_timeout_ms=20_000)
        request.MergeFrom(pb.KvGetRequest(**reader._kv_scope()))
        channel = grpc.insecure_channel(d.endpoint, options=[("grpc.enable_retries", 0)])

        def read() -> None:
            outcome.append(raw(channel, "KvGet", request.SerializeToString(), bearer(d), 25))

        t = threading.Thread(target=read)
        t.start()
        wait_for("the reader to park", lambda: scrape(d.metrics_url)["rendezvousd_waiters"] == 1)
        shutil.rmtree(state)
        with pytest.raises(RendezvousError) as info:
            writer.kv_set("k", b"never")  # the change that woke the reader, then failed
        assert info.value.reason == "STORAGE_UNAVAILABLE"
        t.join(20)
        channel.close()
        assert len(outcome) == 1 and isinstance(outcome[0], grpc.RpcError)
        assert reason_of(outcome[0])[0] == "STORAGE_UNAVAILABLE"
        state.mkdir(mode=0o700)
        _assert_undone(d, reader, "storage is back")


def test_a_read_never_answers_with_a_change_whose_commit_is_in_flight(tmp_path: Path) -> None:
    """A KvGet that arrives while a KvSet's commit is in flight waits for it: when that
    commit then fails and the set is undone, no reader has seen the value."""
    # A 60 s heartbeat timeout: the members outlive the 5 s lock below.
    with _writer_and_reader(tmp_path, "inflight", 60) as (d, state, writer, reader):
        # Another connection holds SQLite's write lock: the daemon's commit waits out
        # its busy timeout (5 s) and then fails, with the set already made in memory.
        locker = sqlite3.connect(state / "state.db", isolation_level=None)
        locker.execute("BEGIN EXCLUSIVE")
        failed: list[RendezvousError] = []

        def write() -> None:
            try:
                writer.kv_set("k", b"in-flight")
            except RendezvousError as exc:
                failed.append(exc)

        t = threading.Thread(target=write)
        t.start()
        seen: list[bytes | str] = []
        while t.is_alive():
            try:
                seen.append(reader.kv_get("k", wait=False, timeout=10))
            except RendezvousError as exc:
                seen.append(exc.reason)
        t.join(10)
        locker.execute("ROLLBACK")
        locker.close()
        assert failed and failed[0].reason == "STORAGE_UNAVAILABLE"
        assert seen and b"in-flight" not in seen, seen
        _assert_undone(d, reader, "the lock is gone")


def _commits(d: DaemonProcess) -> float:
    assert d.metrics_url is not None
    return sum(
        v
        for k, v in scrape(d.metrics_url).items()
        if k.startswith("rendezvousd_storage_commit_seconds_count")
    )


def test_refused_calls_that_change_nothing_do_not_commit(tmp_path: Path) -> None:
    """A token holder's refused calls (here a member's KvSet under another instance id,
    and a stale generation's barrier) cost no fsync; a real change still commits."""
    d, _ = _start(tmp_path)
    try:
        with joined_pair(d, "quiet") as (a, _b):
            m = a.membership
            assert m is not None
            stub = pb_grpc.RendezvousStub(grpc.insecure_channel(d.endpoint))
            auth = bearer(d)
            before = _commits(d)
            for i in range(20):
                with pytest.raises(grpc.RpcError):
                    stub.KvSet(
                        pb.KvSetRequest(
                            job_id="quiet",
                            generation=m.generation,
                            rank=m.rank,
                            instance_id="not-the-member",
                            key=f"k{i}",
                            value=b"v",
                        ),
                        metadata=auth,
                        timeout=5,
                    )
                with pytest.raises(grpc.RpcError):
                    stub.Barrier(
                        pb.BarrierRequest(
                            job_id="quiet",
                            generation=m.generation + 7,
                            rank=m.rank,
                            instance_id="x",
                            name="b",
                        ),
                        metadata=auth,
                        timeout=5,
                    )
            assert _commits(d) == before
            a.kv_set("real", b"change")
            assert _commits(d) > before
    finally:
        d.kill()


def _outage(tmp_path: Path, moved: Path) -> tuple[DaemonProcess, Path, RendezvousClient]:
    """A daemon (DEBUG log: its retries) with a joined job and counter ``n`` at 1, whose
    state dir was then renamed to ``moved``, a change refused, and one retry made
    while the directory was away (that retry closes the database)."""
    state = tmp_path / "state"
    d = spawn_daemon(tmp_path, "--state-dir", str(state), "--log-level", "DEBUG")
    client = RendezvousClient(d.endpoint, "moved", token=d.token)
    try:
        client.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        assert client.kv_add("n", 1) == 1
        state.rename(moved)
        with pytest.raises(RendezvousError) as info:
            client.kv_add("n", 1)
        assert info.value.reason == "STORAGE_UNAVAILABLE"
        wait_for("a retry while the dir is away", lambda: "still failing" in d.log())
    except BaseException:
        client.close()
        d.kill()
        raise
    return d, state, client


def test_a_state_dir_moved_away_and_back_serves_again_holding_its_lock(tmp_path: Path) -> None:
    """The same directory back (same inodes: a rename, a remount): the database the
    failed retry closed is opened again, and the lock the daemon never lost still
    keeps a second daemon off it."""
    d, state, client = _outage(tmp_path, tmp_path / "away")
    try:
        assert _health(d) == NOT_SERVING
        (tmp_path / "away").rename(state)
        wait_for("health SERVING once the dir is back", lambda: _health(d) == SERVING)
        assert client.kv_add("n", 1) == 2
        assert _stored(state, "moved", "n") == b"2"
        second = serve_refused(tmp_path, state)
        assert second.returncode == 2, second.stderr
        assert f"in use by another rendezvousd (pid {d.proc.pid}" in second.stderr
    finally:
        client.close()
        d.kill()


def test_another_dir_put_in_place_is_locked_once_its_own_daemon_lets_go(
    tmp_path: Path,
) -> None:
    """A different directory in the state dir's place: the daemon's lock went with the
    old one, so it takes the new one's first; while another daemon holds that, the
    daemon stays NOT_SERVING rather than write beside it."""
    d, state, client = _outage(tmp_path, tmp_path / "away")
    other_dir = tmp_path / "other"
    other = spawn_daemon(tmp_path, "--state-dir", str(other_dir))
    try:
        other_dir.rename(state)
        held_by = f"in use by another rendezvousd (pid {other.proc.pid}"
        wait_for("a retry refused by the other daemon's lock", lambda: held_by in d.log())
        assert _health(d) == NOT_SERVING
        other.kill()
        wait_for("health SERVING once the other daemon is gone", lambda: _health(d) == SERVING)
        assert (state / "rendezvousd.lock").read_text().strip() == str(d.proc.pid)
        assert client.kv_add("n", 1) == 2  # its own state, rewritten whole into that dir
        assert _stored(state, "moved", "n") == b"2"
    finally:
        other.kill()
        client.close()
        d.kill()
