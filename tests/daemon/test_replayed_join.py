"""A join sent again by a member that left its running generation (a replay of its old
request, or a retry after its Leave): refused, so that it never becomes a member again,
nor, after a daemon restart, a lost one whose job then never ended (a model-based fuzz
of the state machine, reproduced here with a raw client and a real daemon)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from rendezvousd.common.model import JobState, JoinMode, JoinResult, MemberState, Parked
from rendezvousd.state.machine import RendezvousState
from rendezvousd.storage.persistence import Persister
from tests.daemon.raw_calls import bearer, join_request, reason_of
from tests.daemon.test_node_state import fault, join_first, node
from tests.support import DaemonProcess, free_port, spawn_daemon, write_token

ID = b"\x09" * 128


@contextmanager
def _daemon(tmp_path: Path, port: int, token: str) -> Iterator[tuple[DaemonProcess, Any]]:
    # A heartbeat timeout far past the test: nobody is lost for not beating.
    flags = ("--state-dir", str(tmp_path / "state"), "--heartbeat-timeout-s", "120")
    d = spawn_daemon(tmp_path, *flags, token=token, listen=f"127.0.0.1:{port}")
    try:
        with grpc.insecure_channel(d.endpoint) as channel:
            yield d, pb_grpc.RendezvousStub(channel)
    finally:
        d.terminate()


def _job(d: DaemonProcess, stub: Any) -> pb.GetJobResponse:
    return stub.GetJob(pb.GetJobRequest(job_id="r"), metadata=bearer(d), timeout=5)


def test_a_join_replayed_after_leave_and_restarts_is_refused_and_the_job_ends(
    tmp_path: Path,
) -> None:
    """Rank 1 of a running job leaves; the daemon restarts; rank 1's JoinRequest is sent
    again. It was answered "still forming" and marked rank 1 LOST without failing the
    job; after a second restart rank 0's goodbye never ended the job (one LEFT member
    short). Now the replay is refused naming the job and rank, and the job ends."""
    port, token = free_port(), write_token(tmp_path / "tok")
    joins = [join_request("r", 2, r, host=f"h{r}", instance_id=f"w{r}") for r in (0, 1)]
    joins[0].unique_id = ID
    with _daemon(tmp_path, port, token) as (d, stub):
        pending = [stub.Join.future(j, metadata=bearer(d), timeout=10) for j in joins]
        assert [f.result().generation for f in pending] == [1, 1]
        stub.Leave(
            pb.LeaveRequest(job_id="r", generation=1, rank=1, instance_id="w1"),
            metadata=bearer(d),
            timeout=5,
        )
    with _daemon(tmp_path, port, token) as (d, stub):
        try:
            stub.Join(joins[1], metadata=bearer(d), timeout=5)
            raise AssertionError("the replayed Join was answered")
        except grpc.RpcError as exc:
            refused = exc
        assert refused.code() is grpc.StatusCode.FAILED_PRECONDITION
        reason, metadata = reason_of(refused)
        assert reason == "NOT_A_MEMBER" and metadata["ranks"] == "1", metadata
        assert "rank 1 on host 'h1' left job 'r' generation 1" in refused.details()
        job = _job(d, stub)
        assert [m.state for m in job.members] == [pb.MEMBER_STATE_ACTIVE, pb.MEMBER_STATE_LEFT]
        assert not job.failed
    with _daemon(tmp_path, port, token) as (d, stub):
        stub.Leave(
            pb.LeaveRequest(job_id="r", generation=1, rank=0, instance_id="w0"),
            metadata=bearer(d),
            timeout=5,
        )
        job = _job(d, stub)
        assert job.summary.state == pb.JOB_STATE_ENDED and not job.failed


def test_a_node_agents_join_node_sent_again_after_its_leave_is_refused() -> None:
    """The node path alike: answered, the node agent that left got the running
    generation's id again."""
    sm = RendezvousState()
    assert isinstance(join_first(sm, node("a")), Parked)
    assert isinstance(sm.join(node("b"), 0.0), JoinResult)
    sm.leave("j", 1, 1, "b", 1.0, mode=JoinMode.NODE)
    refused = fault(sm.join, node("b"), 2.0)
    assert (refused.reason, refused.metadata["ranks"]) == ("NOT_A_MEMBER", "2-3")
    assert refused.message.startswith(
        "the node agent of node_rank=1 on host 'host-b' left job 'j' generation 1 (Leave)"
    )
    assert sm.jobs["j"].gen.nodes["b"].state is MemberState.LEFT


def _written_by_an_older_daemon(tmp_path: Path, member_states: str) -> None:
    """A state dir holding job 'j', running with 2 ranks of which rank 1 left, then
    rewritten with ``member_states`` (``json_set`` paths and values), as a daemon from
    before the replayed-join refusal could have left it."""
    from rendezvousd.state.placement import JoinArgs

    sm = RendezvousState()
    for r in (0, 1):
        sm.join(JoinArgs.worker("j", 1, 2, 0, r, "h", "", ID if r == 0 else b"", f"i{r}"), 0.0)
    sm.leave("j", 1, 1, "i1", 1.0)
    saver = Persister(tmp_path, sm)
    saver.restore()
    saver.close()
    db = sqlite3.connect(tmp_path / "state.db")
    db.execute(f"UPDATE jobs SET detail = json_set(detail, {member_states})")
    db.commit()
    db.close()


def test_a_running_row_holding_a_member_a_replay_marked_lost_restores_it_as_left(
    tmp_path: Path,
) -> None:
    """A state dir written by a daemon before the refusal: the member the replay marked
    LOST is restored as the LEFT member it was, and the job ends with the others."""
    _written_by_an_older_daemon(tmp_path, "'$.members[1].state', 'LOST'")
    back = RendezvousState()
    Persister(tmp_path, back).restore()
    assert back.jobs["j"].gen.members[1].state is MemberState.LEFT
    back.leave("j", 1, 0, "i0", 2.0)
    assert back.jobs["j"].state is JobState.ENDED


def test_a_running_row_whose_members_all_left_once_read_back_restores_ended(
    tmp_path: Path,
) -> None:
    """The replay-marked LOST member read back LEFT may have been the last one not left:
    the old daemon's count missed it, so its last Leave did not end the job. Restored
    RUNNING, it stayed so for good (no Leave is to come, a tick looks only at active
    members, only an ended job expires); it ends, as that last Leave would have ended
    it, and then expires."""
    from rendezvousd.state import liveness

    _written_by_an_older_daemon(
        tmp_path, "'$.members[1].state', 'LOST', '$.members[0].state', 'LEFT'"
    )
    back = RendezvousState()
    restorer = Persister(tmp_path, back)
    restorer.restore()
    restorer.close()
    job = back.jobs["j"]
    assert [m.state for m in job.gen.members.values()] == [MemberState.LEFT] * 2
    assert job.state is JobState.ENDED
    liveness.tick(back, 1e9)  # past any ended job's TTL
    assert "j" not in back.jobs
    again = RendezvousState()  # written back ENDED as restored
    reader = Persister(tmp_path, again)
    reader.restore()
    reader.close()
    assert again.jobs["j"].state is JobState.ENDED
