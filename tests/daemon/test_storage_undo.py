"""A membership change whose commit fails is undone: nothing of it survives the outage.

Real daemon processes with a ``--state-dir`` that is taken away (removed, or its
SQLite write lock held) under a change: the caller and every call parked on the job
get UNAVAILABLE / STORAGE_UNAVAILABLE, and once storage is back GetJob and the
database show the job exactly as it was last committed, and the same calls retried
(same instance ids, same sequence numbers) succeed.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from rendezvousd.client import RendezvousClient, RendezvousError
from tests.daemon.raw_calls import bearer, join_request, reason_of
from tests.daemon.test_storage import NOT_SERVING, SERVING, _health, _start, joined_pair
from tests.support import DaemonProcess, scrape, wait_for

ID = bytes(range(128))


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[tuple[DaemonProcess, Path, Any]]:
    """A daemon with a state dir (a 60 s heartbeat timeout, so that members without a
    heartbeat stream outlive every step below), and a stub without retries for it."""
    d, state = _start(tmp_path, 60)
    try:
        yield d, state, _stub(d)
    finally:
        d.kill()


def _stub(d: DaemonProcess) -> Any:
    """A stub without channel retries: each assertion is about one call's answer."""
    channel = grpc.insecure_channel(d.endpoint, options=[("grpc.enable_retries", 0)])
    return pb_grpc.RendezvousStub(channel)


def _refused(call: Any) -> str:
    """The reason of the error that ``call`` (a thunk or a future) ends with."""
    with pytest.raises(grpc.RpcError) as info:
        call.result(timeout=30) if hasattr(call, "result") else call()
    return reason_of(info.value)[0]


def _get_job(stub: Any, d: DaemonProcess, job_id: str) -> pb.GetJobResponse | None:
    try:
        job: pb.GetJobResponse = stub.GetJob(
            pb.GetJobRequest(job_id=job_id), metadata=bearer(d), timeout=10
        )
    except grpc.RpcError as exc:
        assert exc.code() is grpc.StatusCode.NOT_FOUND, exc
        return None
    return job


def _ranks(job: pb.GetJobResponse | None) -> dict[int, str]:
    """rank -> member state name."""
    assert job is not None
    return {
        m.member.rank: pb.MemberState.Name(m.state).removeprefix("MEMBER_STATE_")
        for m in job.members
    }


def _stored(state: Path, job_id: str) -> dict[str, Any] | None:
    """The job's row in the database: generation, state and its JSON detail."""
    db = sqlite3.connect(state / "state.db")
    try:
        row = db.execute(
            "SELECT generation, state, detail FROM jobs WHERE job_id=?", (job_id,)
        ).fetchone()
    finally:
        db.close()
    if row is None:
        return None
    return {"generation": row[0], "state": row[1], **json.loads(row[2])}


def _storage_back(d: DaemonProcess, state: Path) -> None:
    state.mkdir(mode=0o700)
    wait_for("health SERVING once storage is back", lambda: _health(d) == SERVING)


def _waiters(d: DaemonProcess) -> float:
    return scrape(d.metrics_url)["rendezvousd_waiters"]


def _one_beat(done: threading.Event) -> Iterator[pb.HeartbeatRequest]:
    """Rank 1's heartbeat stream of job "f": one beat, then open (silent) until ``done``."""
    yield pb.HeartbeatRequest(job_id="f", generation=1, rank=1, instance_id="r1")
    done.wait(30)


def test_a_join_whose_commit_fails_is_undone_and_its_retry_joins(
    daemon: tuple[DaemonProcess, Path, Any],
) -> None:
    d, state, stub = daemon
    # Generation 1 ran, kept a key, and ended: that much is durable.
    with RendezvousClient(d.endpoint, "a", token=d.token) as first:
        first.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        first.kv_set("k", b"v")
        first.leave()
    shutil.rmtree(state)
    # A Join that opens and forms generation 2 at once; its commit fails.
    join = join_request("a", 1, 0, host="h", unique_id=ID, instance_id="again")
    assert _refused(lambda: stub.Join(join, metadata=bearer(d), timeout=10)) == (
        "STORAGE_UNAVAILABLE"
    )
    _storage_back(d, state)

    job = _get_job(stub, d, "a")
    assert job is not None
    assert (job.summary.generation, job.summary.state) == (1, pb.JOB_STATE_ENDED)
    assert _ranks(job) == {0: "LEFT"} and job.kv_keys == 1
    stored = _stored(state, "a")
    assert stored is not None and (stored["generation"], stored["state"]) == (1, "ENDED")

    # The same Join again (same instance, same id: it was never used) gets its rank.
    answer = stub.Join(join, metadata=bearer(d), timeout=10)
    assert (answer.generation, answer.rank, answer.unique_id) == (2, 0, ID)
    stored = _stored(state, "a")
    assert stored is not None and (stored["generation"], stored["state"]) == (2, "RUNNING")


def test_a_join_that_completes_the_world_and_fails_releases_every_joiner(
    daemon: tuple[DaemonProcess, Path, Any],
) -> None:
    d, state, stub = daemon

    def join(rank: int, instance: str, **fields: Any) -> pb.JoinRequest:
        return join_request(
            "b", 3, rank, host="h", instance_id=instance, wait_timeout_ms=30_000, **fields
        )

    meta = bearer(d)
    rank1 = stub.Join.future(join(1, "r1"), metadata=meta, timeout=35)
    wait_for("rank 1 to park", lambda: _waiters(d) == 1)
    # Rank 0 without the id is told to publish it: answered, so committed with rank 1.
    told = stub.Join(join(0, "r0"), metadata=meta, timeout=10)
    assert told.id_required
    publish = pb.PublishIdRequest(
        job_id="b", generation=1, rank=0, instance_id="r0", unique_id=ID, wait_timeout_ms=30_000
    )
    rank0 = stub.PublishId.future(publish, metadata=meta, timeout=35)
    wait_for("rank 0's PublishId to park", lambda: _waiters(d) == 2)

    shutil.rmtree(state)
    assert _refused(lambda: stub.Join(join(2, "r2"), metadata=meta, timeout=10)) == (
        "STORAGE_UNAVAILABLE"
    )
    assert _refused(rank1) == "STORAGE_UNAVAILABLE"
    assert _refused(rank0) == "STORAGE_UNAVAILABLE"
    _storage_back(d, state)

    job = _get_job(stub, d, "b")
    assert job is not None
    assert (job.summary.generation, job.summary.state) == (1, pb.JOB_STATE_FORMING)
    assert _ranks(job) == {0: "JOINING", 1: "JOINING"} and not job.id_published
    assert _waiters(d) == 0

    # Rank 1's worker gave up; a restarted one (another instance) takes the rank
    # nobody holds, rank 2 retries, and rank 0's retried Join with the id forms it.
    later = [
        stub.Join.future(join(1, "r1-restarted"), metadata=meta, timeout=35),
        stub.Join.future(join(2, "r2"), metadata=meta, timeout=35),
    ]
    wait_for("ranks 1 and 2 to park", lambda: _waiters(d) == 2)
    formed = stub.Join(join(0, "r0", unique_id=ID), metadata=meta, timeout=10)
    answers = [formed] + [f.result(timeout=10) for f in later]
    assert [(a.generation, a.rank, a.unique_id) for a in answers] == [
        (1, 0, ID),
        (1, 1, ID),
        (1, 2, ID),
    ]


def test_a_barrier_round_whose_commit_fails_is_not_counted(
    daemon: tuple[DaemonProcess, Path, Any],
) -> None:
    d, state, stub = daemon
    with joined_pair(d, "c") as (a, b):

        def barrier(client: RendezvousClient) -> pb.BarrierRequest:
            return pb.BarrierRequest(
                name="step", sequence=1, wait_timeout_ms=30_000, **client._kv_scope()
            )

        meta = bearer(d)
        first = stub.Barrier.future(barrier(a), metadata=meta, timeout=35)
        wait_for("the first arrival to park", lambda: _waiters(d) == 1)
        shutil.rmtree(state)
        # The last arrival completes the round; its commit fails.
        assert _refused(lambda: stub.Barrier(barrier(b), metadata=meta, timeout=10)) == (
            "STORAGE_UNAVAILABLE"
        )
        assert _refused(first) == "STORAGE_UNAVAILABLE"
        _storage_back(d, state)
        stored = _stored(state, "c")
        assert stored is not None and stored["barriers"].get("step", 0) == 0

        # Not counted: the retried first arrival waits for the other rank again
        # (a counted round would answer it at once), and the retries release both.
        retried = stub.Barrier.future(barrier(a), metadata=meta, timeout=35)
        wait_for("the retried arrival to park", lambda: _waiters(d) == 1)
        assert stub.Barrier(barrier(b), metadata=meta, timeout=10).sequence == 1
        assert retried.result(timeout=10).sequence == 1
        stored = _stored(state, "c")
        assert stored is not None and stored["barriers"]["step"] == 1


def test_a_leave_or_abort_whose_commit_fails_leaves_the_job_as_it_was(
    daemon: tuple[DaemonProcess, Path, Any],
) -> None:
    d, state, stub = daemon
    with joined_pair(d, "d") as (a, b):
        a.start_heartbeat()
        b.start_heartbeat()
        meta = bearer(d)

        def streams_open() -> bool:
            job = _get_job(stub, d, "d")
            return job is not None and all(m.heartbeat_stream_open for m in job.members)

        wait_for("both heartbeat streams", streams_open)
        leave = pb.LeaveRequest(**b._kv_scope())

        shutil.rmtree(state)
        assert _refused(lambda: stub.Leave(leave, metadata=meta, timeout=10)) == (
            "STORAGE_UNAVAILABLE"
        )
        _storage_back(d, state)
        job = _get_job(stub, d, "d")
        assert job is not None and job.summary.state == pb.JOB_STATE_RUNNING
        assert _ranks(job) == {0: "ACTIVE", 1: "ACTIVE"}
        stored = _stored(state, "d")
        assert stored is not None
        assert [m["state"] for m in stored["members"]] == ["ACTIVE", "ACTIVE"]

        shutil.rmtree(state)
        abort = pb.AbortJobRequest(job_id="d", reason="undone abort")
        assert _refused(lambda: stub.AbortJob(abort, metadata=meta, timeout=10)) == (
            "STORAGE_UNAVAILABLE"
        )
        _storage_back(d, state)
        job = _get_job(stub, d, "d")
        assert job is not None and job.summary.state == pb.JOB_STATE_RUNNING
        assert job.abort_reason == "" and _ranks(job) == {0: "ACTIVE", 1: "ACTIVE"}
        # Both members kept their streams, which never heard of either undone change:
        # the first event they get is the abort that does happen now.
        assert all(m.heartbeat_stream_open for m in job.members)
        assert a.failure is None and b.failure is None
        stub.AbortJob(
            pb.AbortJobRequest(job_id="d", reason="real abort"), metadata=meta, timeout=10
        )
        wait_for("both members to hear the abort", lambda: bool(a.failure and b.failure))
        for client in (a, b):
            assert client.failure is not None and client.failure.reason == "JOB_ABORTED"
            assert "real abort" in str(client.failure)


def test_goodbyes_said_while_storage_is_down_end_the_job_rather_than_fail_it(
    daemon: tuple[DaemonProcess, Path, Any],
) -> None:
    """A job's two members finish while the state dir is gone. The first goodbye's
    commit failed and was undone, so its stream's end, read next, lost that member:
    the job was written FAILED ("heartbeat stream closed") once storage was back, and
    the other member heard PEER_FAILED as it finished. A goodbye is kept through the
    undo, and the member's end is its goodbye again."""
    d, state, stub = daemon
    with joined_pair(d, "g") as (a, b):
        a.start_heartbeat()
        b.start_heartbeat()

        def streams_open() -> bool:
            job = _get_job(stub, d, "g")
            return job is not None and all(m.heartbeat_stream_open for m in job.members)

        wait_for("both heartbeat streams", streams_open)
        shutil.rmtree(state)
        a.leave()  # refused: the SDK warns, the member goes on ending
        with contextlib.suppress(AssertionError):  # (a timeout is the good outcome)
            wait_for("a failure to reach rank 1", lambda: b.failure is not None, timeout=1)
        assert b.failure is None, b.failure
        b.leave()
    _storage_back(d, state)

    def ended() -> bool:
        job = _get_job(stub, d, "g")
        return job is not None and job.summary.state != pb.JOB_STATE_RUNNING

    wait_for("the job to end", ended, timeout=10)
    job = _get_job(stub, d, "g")
    assert job is not None and job.summary.state == pb.JOB_STATE_ENDED, job
    assert _ranks(job) == {0: "LEFT", 1: "LEFT"} and not job.failed
    wait_for("the end written", lambda: (_stored(state, "g") or {}).get("state") == "ENDED")


def test_a_leave_call_while_storage_is_down_is_still_the_members_goodbye(
    daemon: tuple[DaemonProcess, Path, Any],
) -> None:
    """Members without a heartbeat stream leave by a Leave call. While the daemon
    knew its storage down it refused that call up front, so nothing of the goodbye
    was left to apply once storage came back: the job stayed RUNNING, until the
    members' silence failed it."""
    d, state, stub = daemon
    with joined_pair(d, "h") as (a, b):
        shutil.rmtree(state)
        with pytest.raises(RendezvousError):
            a.kv_set("k", b"v")  # the outage begins
        wait_for("health NOT_SERVING", lambda: _health(d) == NOT_SERVING)
        for client in (a, b):
            leave = pb.LeaveRequest(**client._kv_scope())
            with pytest.raises(grpc.RpcError) as refused:
                stub.Leave(leave, metadata=bearer(d), timeout=10)
            assert reason_of(refused.value)[0] == "STORAGE_UNAVAILABLE"
            # Said as it is: kept, not "not applied; retry".
            assert "this goodbye from job 'h' is kept" in str(refused.value.details())
        _storage_back(d, state)

        def ended() -> bool:
            job = _get_job(stub, d, "h")
            return job is not None and job.summary.state == pb.JOB_STATE_ENDED

        wait_for("the job to end", ended, timeout=10)
        assert _ranks(_get_job(stub, d, "h")) == {0: "LEFT", 1: "LEFT"}


def test_a_join_node_whose_commit_fails_is_undone_and_its_retry_joins(
    daemon: tuple[DaemonProcess, Path, Any],
) -> None:
    d, state, stub = daemon
    request = pb.JoinNodeRequest(
        job_id="e",
        min_nodes=1,
        max_nodes=1,
        gpus_per_node=2,
        host="h",
        unique_id=ID,
        instance_id="node-a",
        wait_timeout_ms=10_000,
    )
    shutil.rmtree(state)
    # One node of one: the generation forms at once; its commit fails.
    assert _refused(lambda: stub.JoinNode(request, metadata=bearer(d), timeout=10)) == (
        "STORAGE_UNAVAILABLE"
    )
    _storage_back(d, state)
    assert _get_job(stub, d, "e") is None  # it had never been committed: it is gone
    assert _stored(state, "e") is None

    answer = stub.JoinNode(request, metadata=bearer(d), timeout=10)
    assert (answer.generation, answer.node_rank, answer.unique_id) == (1, 0, ID)
    assert _ranks(_get_job(stub, d, "e")) == {0: "ACTIVE", 1: "ACTIVE"}


def test_a_stream_of_a_member_that_is_undone_ends_with_the_fault(
    daemon: tuple[DaemonProcess, Path, Any],
) -> None:
    d, state, stub = daemon
    meta = bearer(d)
    # Another connection holds SQLite's write lock: the commit that forms the job waits
    # out its busy timeout (5 s) with the job RUNNING in memory, and then fails.
    locker = sqlite3.connect(state / "state.db", isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    stream_done = threading.Event()
    try:
        rank1 = stub.Join.future(
            join_request("f", 2, 1, host="h", instance_id="r1", wait_timeout_ms=30_000),
            metadata=meta,
            timeout=35,
        )
        wait_for("rank 1 to park", lambda: _waiters(d) == 1)
        rank0 = stub.Join.future(
            join_request("f", 2, 0, host="h", instance_id="r0", unique_id=ID),
            metadata=meta,
            timeout=35,
        )
        wait_for("the job to form in memory", lambda: _waiters(d) == 0)
        # Rank 1 of that generation attaches its stream before the commit is decided.
        beats = stub.Heartbeat(_one_beat(stream_done), metadata=meta, timeout=30)
        assert next(beats).kind == pb.JobEvent.HEARTBEAT_ACK
        with pytest.raises(grpc.RpcError) as ended:
            for _ in beats:
                pass
        assert reason_of(ended.value)[0] == "STORAGE_UNAVAILABLE"
        assert _refused(rank0) == "STORAGE_UNAVAILABLE"
        assert _refused(rank1) == "STORAGE_UNAVAILABLE"
    finally:
        stream_done.set()
        locker.execute("ROLLBACK")
        locker.close()
    wait_for("health SERVING once the lock is gone", lambda: _health(d) == SERVING)
    assert _get_job(stub, d, "f") is None and _stored(state, "f") is None


def test_a_call_woken_by_an_undone_leave_gets_the_fault_even_past_its_deadline(
    daemon: tuple[DaemonProcess, Path, Any],
) -> None:
    """A Leave that completes a barrier round wakes the waiter only once it is durable;
    the waiter's own deadline passing meanwhile does not lose that answer."""
    d, state, stub = daemon
    meta = bearer(d)
    with joined_pair(d, "g") as (a, b):
        request = pb.BarrierRequest(name="step", sequence=1, wait_timeout_ms=1_000)
        request.MergeFrom(pb.BarrierRequest(**a._kv_scope()))
        waiting = stub.Barrier.future(request, metadata=meta, timeout=30)
        wait_for("the arrival to park", lambda: _waiters(d) == 1)
        # The commit of the Leave waits out SQLite's busy timeout (5 s), past the
        # barrier's 1 s, and then fails.
        locker = sqlite3.connect(state / "state.db", isolation_level=None)
        locker.execute("BEGIN EXCLUSIVE")
        try:
            leave = pb.LeaveRequest(**b._kv_scope())
            assert _refused(lambda: stub.Leave(leave, metadata=meta, timeout=30)) == (
                "STORAGE_UNAVAILABLE"
            )
            assert _refused(waiting) == "STORAGE_UNAVAILABLE"
        finally:
            locker.execute("ROLLBACK")
            locker.close()
        wait_for("health SERVING once the lock is gone", lambda: _health(d) == SERVING)
        # Rank 1's goodbye is kept through the undo: with no stream of its own to end,
        # the next tick says it again (the barrier's round is the undone change).
        assert _ranks(_get_job(stub, d, "g")) == {0: "ACTIVE", 1: "LEFT"}


def test_the_sdk_sends_an_undone_barrier_round_again(daemon: tuple[DaemonProcess, Path]) -> None:
    """barrier() numbers rounds itself: after one the daemon undid, the next barrier()
    of that name is the same round, not one the daemon would refuse as ahead."""
    d, state, _ = daemon
    with RendezvousClient(d.endpoint, "h", token=d.token) as alone:
        alone.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        shutil.rmtree(state)
        with pytest.raises(RendezvousError) as undone:
            alone.barrier("step", timeout=10)
        assert undone.value.reason == "STORAGE_UNAVAILABLE"
        _storage_back(d, state)
        alone.barrier("step", timeout=10)
        alone.barrier("step", timeout=10)
        stored = _stored(state, "h")
        assert stored is not None and stored["barriers"]["step"] == 2


def test_a_refusal_that_would_fail_the_generation_is_not_answered_when_its_commit_fails(
    daemon: tuple[DaemonProcess, Path, Any],
) -> None:
    """A joiner with another topology fails a forming generation (both sides are
    told): when that cannot be committed, neither is told the mismatch, and the
    generation is still forming once storage is back."""
    d, state, stub = daemon
    meta = bearer(d)
    parked = stub.Join.future(
        join_request("t", 2, 1, host="h", instance_id="r1", wait_timeout_ms=30_000),
        metadata=meta,
        timeout=35,
    )
    wait_for("rank 1 to park", lambda: _waiters(d) == 1)
    assert _get_job(stub, d, "t") is not None  # a read commits the job's pending join
    shutil.rmtree(state)
    conflicting = join_request("t", 3, 0, host="h", instance_id="r0", wait_timeout_ms=30_000)
    assert _refused(lambda: stub.Join(conflicting, metadata=meta, timeout=10)) == (
        "STORAGE_UNAVAILABLE"
    )
    assert _refused(parked) == "STORAGE_UNAVAILABLE"
    _storage_back(d, state)
    job = _get_job(stub, d, "t")
    assert job is not None
    assert (job.summary.generation, job.summary.state) == (1, pb.JOB_STATE_FORMING)
    # Told now that storage is back: the mismatch itself.
    assert _refused(lambda: stub.Join(conflicting, metadata=meta, timeout=10)) == (
        "TOPOLOGY_MISMATCH"
    )


@contextlib.contextmanager
def _commits_held(d: DaemonProcess, state: Path, method: str) -> Iterator[None]:
    """The database's write lock held (for less than the daemon's 5 s busy timeout, so
    its commit waits and then takes) while the block's ``method`` call gives up: until
    the daemon saw it cancelled, mid-commit."""
    lock = sqlite3.connect(state / "state.db", isolation_level=None)
    lock.execute("BEGIN IMMEDIATE")
    try:
        yield
        cancelled = f'rendezvousd_rpc_duration_seconds_count{{code="CANCELLED",method="{method}"}}'
        wait_for(
            f"the daemon to see {method} cancelled", lambda: cancelled in scrape(d.metrics_url)
        )
    finally:
        lock.execute("ROLLBACK")
        lock.close()


def test_a_change_whose_caller_gives_up_during_its_commit_still_wakes_its_readers(
    daemon: tuple[DaemonProcess, Path, Any],
) -> None:
    """A KvSet's caller gone before its commit ends (its deadline): the value is stored
    all the same, so the reader waiting for it gets it (it hung until its own deadline)."""
    d, state, stub = daemon
    with joined_pair(d, "h") as (a, b):
        meta = bearer(d)
        get = stub.KvGet.future(
            pb.KvGetRequest(key="k", wait=True, wait_timeout_ms=20_000, **b._kv_scope()),
            metadata=meta,
            timeout=25,
        )
        wait_for("the reader to park", lambda: _waiters(d) == 1)
        with _commits_held(d, state, "KvSet"), pytest.raises(grpc.RpcError) as gave_up:
            stub.KvSet(
                pb.KvSetRequest(key="k", value=b"v", **a._kv_scope()), metadata=meta, timeout=1
            )
        assert gave_up.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        assert get.result(timeout=10).value == b"v"
        assert _waiters(d) == 0


def test_a_commit_whose_caller_gives_up_is_still_what_a_later_undo_goes_back_to(
    daemon: tuple[DaemonProcess, Path, Any],
) -> None:
    """An AbortJob's caller gone mid-commit: the abort is on disk, and a later failed
    commit puts the job back to it, not to the running job before it (which the rewrite
    after the outage then wrote over the abort)."""
    d, state, stub = daemon
    meta = bearer(d)
    with joined_pair(d, "i"):
        abort = pb.AbortJobRequest(job_id="i", reason="operator")
        ok = 'rendezvousd_storage_commit_seconds_count{outcome="ok"}'
        before = scrape(d.metrics_url).get(ok, 0.0)
        with _commits_held(d, state, "AbortJob"), pytest.raises(grpc.RpcError):
            stub.AbortJob(abort, metadata=meta, timeout=1)
        wait_for("the abort on disk", lambda: (_stored(state, "i") or {}).get("state") == "ABORTED")
        # Visible on disk is not yet done: the commit's fsync follows, and a state dir
        # removed before it fails the commit (then undone, rightly). Wait for its end.
        wait_for("the abort's commit to end", lambda: scrape(d.metrics_url).get(ok, 0.0) > before)
        shutil.rmtree(state)
        rejoin = join_request("i", 2, 0, host="h", instance_id="next", wait_timeout_ms=5_000)
        assert _refused(lambda: stub.Join(rejoin, metadata=meta, timeout=10)) == (
            "STORAGE_UNAVAILABLE"
        )
        job = _get_job(stub, d, "i")
        assert job is not None and job.summary.state == pb.JOB_STATE_ABORTED
        _storage_back(d, state)
        assert (_stored(state, "i") or {}).get("state") == "ABORTED"


def test_a_forming_joiners_death_whose_commit_fails_is_not_told_until_it_is_written(
    daemon: tuple[DaemonProcess, Path, Any],
) -> None:
    """Rank 1's parked Join is cancelled (its process died) as storage fails: the other
    parked joiner hears STORAGE_UNAVAILABLE (its answer waits for the commit, which
    fails), and the undo put the generation back to forming with rank 1's seat held by
    nobody: the other's retry, once storage was back, waited for the dead rank until its
    own deadline. The death is kept, and that retry hears it (PEER_FAILED, rank 1),
    written."""
    d, state, stub = daemon
    meta = bearer(d)

    def join(rank: int) -> Any:
        request = join_request(
            "fj", 3, rank, host="h", instance_id=f"r{rank}", wait_timeout_ms=30_000
        )
        return stub.Join.future(request, metadata=meta, timeout=35)

    dying, other = join(1), join(2)
    wait_for("ranks 1 and 2 to park", lambda: _waiters(d) == 2)
    wait_for(
        "their seats written", lambda: len((_stored(state, "fj") or {}).get("members", [])) == 2
    )
    shutil.rmtree(state)
    dying.cancel()
    assert _refused(other) == "STORAGE_UNAVAILABLE"
    job = _get_job(stub, d, "fj")
    assert job is not None and job.summary.state == pb.JOB_STATE_FORMING, job
    _storage_back(d, state)

    again = join(2)
    with pytest.raises(grpc.RpcError) as info:
        again.result(timeout=30)
    reason, _ = reason_of(info.value)
    assert reason == "PEER_FAILED", info.value
    assert "rank 1 on h (its Join was cancelled" in str(info.value.details()), info.value
    job = _get_job(stub, d, "fj")
    assert job is not None and job.summary.state == pb.JOB_STATE_FAILED, job
    assert [f.rank for f in job.failed] == [1]
    wait_for("the failure written", lambda: (_stored(state, "fj") or {}).get("state") == "FAILED")


def test_a_forming_joiner_dead_during_an_outage_is_told_once_storage_is_back(
    daemon: tuple[DaemonProcess, Path, Any],
) -> None:
    """Storage is failing when rank 1's parked Join is cancelled (its process died):
    the generation's failure was made in memory and rank 2's parked Join released
    (STORAGE_UNAVAILABLE), a failure any later failed commit of the outage undid. Now
    the death is kept, rank 2 stays parked, and hears it once storage takes writes."""
    d, state, stub = daemon
    meta = bearer(d)

    def join(rank: int) -> Any:
        request = join_request(
            "fo", 3, rank, host="h", instance_id=f"r{rank}", wait_timeout_ms=60_000
        )
        return stub.Join.future(request, metadata=meta, timeout=65)

    dying, other = join(1), join(2)
    wait_for("ranks 1 and 2 to park", lambda: _waiters(d) == 2)
    wait_for(
        "their seats written", lambda: len((_stored(state, "fo") or {}).get("members", [])) == 2
    )
    with RendezvousClient(d.endpoint, "g", token=d.token) as g:
        g.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        shutil.rmtree(state)
        with pytest.raises(RendezvousError) as refused:
            g.kv_set("k", b"v")  # another job's change finds storage failing
        assert refused.value.reason == "STORAGE_UNAVAILABLE"
        dying.cancel()
        wait_for("rank 1's Join gone, rank 2's still parked", lambda: _waiters(d) == 1)
        assert not other.done()
        _storage_back(d, state)
    with pytest.raises(grpc.RpcError) as info:
        other.result(timeout=30)
    assert reason_of(info.value)[0] == "PEER_FAILED", info.value
    assert "rank 1 on h (its Join was cancelled" in str(info.value.details()), info.value
    wait_for("the failure written", lambda: (_stored(state, "fo") or {}).get("state") == "FAILED")
