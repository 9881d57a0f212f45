"""A Leave for a join its caller gave up (``LeaveRequest.given_up``), in the pure state
machine: found by the join's instance id alone, since the caller never learned its
rank or generation. A formed generation loses the seat at once (its peers heard "sent
no heartbeat" only at the heartbeat timeout); a forming one frees it; an instance
holding nothing is refused NOT_A_MEMBER."""

from __future__ import annotations

import grpc

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client import PeerFailed, RendezvousClient
from rendezvousd.common.model import EventKind, JobState, JoinMode, JoinResult, Notify, Parked
from rendezvousd.errors import Code
from rendezvousd.server.scope import derive_job_token
from rendezvousd.state.machine import RendezvousState
from tests.daemon.raw_calls import raw, reason_of
from tests.daemon.test_node_state import fault, formed, node
from tests.daemon.test_state_machine import args, form, inst
from tests.support import DaemonProcess, parallel, wait_for

ID = b"\x01" * 128


def test_a_formed_worker_s_given_up_join_fails_the_generation_at_once() -> None:
    sm = RendezvousState()
    form(sm, nodes=1, gpus=2)
    sm.take_effects()
    sm.leave_given_up("j", inst(sm, 1), 1.0, mode=JoinMode.RANK)
    job = sm.jobs["j"]
    assert job.state is JobState.FAILED
    (lost,) = job.gen.failed
    assert lost.rank == 1 and "its Join was given up by its caller" in lost.cause
    told = [e for e in sm.take_effects() if isinstance(e, Notify)]
    assert [(e.kind, e.to) for e in told] == [(EventKind.PEER_FAILED, (0,))]


def test_a_formed_node_s_given_up_join_fails_the_generation_and_keeps_no_seat() -> None:
    sm = RendezvousState()
    formed(sm)
    sm.take_effects()
    sm.leave_given_up("j", "b", 1.0, mode=JoinMode.NODE)
    job = sm.jobs["j"]
    assert job.state is JobState.FAILED
    assert {f.rank for f in job.gen.failed} == {2, 3}  # node b's ranks
    assert all("its JoinNode was given up" in f.cause for f in job.gen.failed)
    # The next generation keeps a seat for the survivor only.
    assert isinstance(sm.join(node("a2", previous="a"), 2.0), JoinResult)
    job = sm.jobs["j"]
    assert job.generation == 2 and not job.gen.owed  # "b" is owed nothing
    assert not job.gen.nodes["a2"].kept or job.gen.nodes["a2"].kept == "a"


def test_a_forming_worker_s_given_up_join_frees_its_seat() -> None:
    """Rank 0 answered id_required, its PublishId never sent: the seat is free, and the
    job waits on (it did not fail, as a dead joiner's would)."""
    sm = RendezvousState()
    out = sm.join(args(0, 0, nodes=1, gpus=2), 0.0)
    assert isinstance(out, JoinResult) and out.id_required
    peer = sm.join(args(0, 1, nodes=1, gpus=2), 0.5)
    assert isinstance(peer, Parked)
    sm.leave_given_up("j", inst(sm, 0), 1.0, mode=JoinMode.RANK)
    job = sm.jobs["j"]
    assert job.state is JobState.FORMING and set(job.gen.members) == {1}
    assert job.gen.id_deadline is None
    # A new worker takes rank 0 at once.
    again = sm.join(args(0, 0, nodes=1, gpus=2, uid=ID, inst="new"), 2.0)
    assert isinstance(again, JoinResult) and not again.id_required


def test_a_forming_node_s_given_up_join_frees_its_seat() -> None:
    sm = RendezvousState()
    out = sm.join(node("a"), 0.0)
    assert isinstance(out, JoinResult) and out.id_required
    sm.leave_given_up("j", "a", 1.0, mode=JoinMode.NODE)
    job = sm.jobs["j"]
    assert job.state is JobState.FORMING and not job.gen.nodes and not job.gen.id_node


def test_an_instance_holding_no_seat_is_refused_not_a_member() -> None:
    sm = RendezvousState()
    form(sm, nodes=1, gpus=2)
    for who, mode in (("nobody", JoinMode.RANK), ("", JoinMode.RANK), ("nobody", JoinMode.NODE)):
        f = fault(sm.leave_given_up, "j", who, 1.0, mode=mode)
        assert (f.code, f.reason.name) == (Code.FAILED_PRECONDITION, "NOT_A_MEMBER"), f
        assert "holds no seat in job 'j' generation 1" in f.message
    assert sm.jobs["j"].state is JobState.RUNNING
    f = fault(sm.leave_given_up, "other", "x", 1.0, mode=JoinMode.RANK)
    assert f.reason.name == "JOB_NOT_FOUND"


def test_a_daemon_takes_a_given_up_leave_only_from_the_job_s_token_for_a_seated_instance(
    daemon: DaemonProcess, job_id: str
) -> None:
    """Against a real daemon: another job's token is refused (SCOPE_DENIED), an instance
    that holds nothing NOT_A_MEMBER, both changing nothing; the seat's own instance id
    loses it, and its peer hears why at once."""
    a, b = (RendezvousClient(daemon.endpoint, job_id, token=daemon.token) for _ in range(2))
    try:
        parallel(
            [
                lambda c=c, r=r: c.join(  # type: ignore[misc]
                    num_nodes=1, gpus_per_node=2, node_rank=0, local_rank=r, timeout=10
                )
                for r, c in enumerate((a, b))
            ]
        )
        b.start_heartbeat(0.2)
        seat = a._s.instance_id

        def leave(instance_id: str, token: str) -> grpc.RpcError | None:
            body = pb.LeaveRequest(job_id=job_id, instance_id=instance_id, given_up=True)
            with grpc.insecure_channel(daemon.endpoint) as ch:
                auth = [("authorization", f"Bearer {token}")]
                return raw(ch, "Leave", body.SerializeToString(), auth)

        other_job = leave(seat, derive_job_token(daemon.token, job_id + "-other"))
        assert other_job is not None and reason_of(other_job)[0] == "SCOPE_DENIED"
        nobody = leave("not-" + seat, derive_job_token(daemon.token, job_id))
        assert nobody is not None and nobody.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert reason_of(nobody)[0] == "NOT_A_MEMBER", nobody.details()
        assert "holds no seat" in (nobody.details() or "")
        assert b.failure is None and b.get_job().summary.state == pb.JOB_STATE_RUNNING
        assert leave(seat, derive_job_token(daemon.token, job_id)) is None
        wait_for("b to hear it", lambda: b.failure is not None)
        assert isinstance(b.failure, PeerFailed)
        assert [f.rank for f in b.failure.failed] == [0]
        assert "its Join was given up by its caller" in b.failure.failed[0].cause
    finally:
        a.close()
        b.close()
