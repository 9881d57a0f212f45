"""A Leave for a join its caller gave up (``LeaveRequest.given_up``), in the pure state
machine: found by the join's instance id alone, since the caller never learned its
rank or generation. A formed generation loses the seat at once (its peers heard "sent
no heartbeat" only at the heartbeat timeout); a forming one frees it; an instance
holding nothing is refused NOT_A_MEMBER."""

from __future__ import annotations

from rendezvousd.common.model import EventKind, JobState, JoinMode, JoinResult, Notify, Parked
from rendezvousd.errors import Code
from rendezvousd.state.machine import RendezvousState
from tests.daemon.test_node_state import fault, formed, node
from tests.daemon.test_state_machine import args, form, inst

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
