"""Standby nodes (``JoinNodeRequest.standby``) in the pure state machine, with an
explicit clock: parked beyond max_nodes, unannounced while the world is full, called
into the slot a lost node frees, told when the job ends."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from rendezvousd.common.model import (
    EventKind,
    JobState,
    JoinMode,
    JoinResult,
    Notify,
    Parked,
    Rejoin,
)
from rendezvousd.errors import Code
from rendezvousd.state.machine import JoinArgs, RendezvousState
from tests.daemon.test_node_state import (
    ID2,
    fault,
    join_first,
    node,
    restarted,
    sdk_join,
    woken,
)


def spare(inst: str, *, lo: int = 2, hi: int = 2, uid: bytes = b"") -> JoinArgs:
    return replace(node(inst, lo=lo, hi=hi, uid=uid), standby=True)


def running_pair(sm: RendezvousState, *, lo: int = 2, hi: int = 2) -> dict[str, int]:
    """a and b formed (a is node 0), streams attached; instance -> stream token."""
    first = join_first(sm, node("a", lo=lo, hi=hi))
    assert isinstance(first, Parked)
    assert isinstance(sm.join(node("b", lo=lo, hi=hi), 0.0), JoinResult)
    assert sm.jobs["j"].state is JobState.RUNNING
    tokens = {
        inst: sm.attach_stream("j", 1, rank, inst, 0.0, mode=JoinMode.NODE)
        for inst, rank in (("a", 0), ("b", 1))
    }
    sm.take_effects()
    return tokens


def notified(sm: RendezvousState, kind: EventKind) -> list[Notify]:
    return [e for e in sm.take_effects() if isinstance(e, Notify) and e.kind is kind]


def lose_b(sm: RendezvousState, tokens: dict[str, int], now: float = 1.0) -> None:
    sm.detach_stream("j", 1, 1, tokens["b"], now, mode=JoinMode.NODE)  # b's agent died
    assert sm.jobs["j"].state is JobState.FAILED


def reform_without(sm: RendezvousState, parked: Parked, now: float) -> None:
    """a2 and b2 form generation 2 of the two-node job; ``parked``, a standby, is
    still parked on it."""
    assert sm.join(node("a2", previous="a"), now).id_required  # type: ignore[union-attr]
    assert isinstance(sm.join(node("a2", uid=ID2, previous="a"), now), Parked)
    assert isinstance(sm.join(node("b2", previous="b"), now), JoinResult)
    job = sm.jobs["j"]
    assert job.state is JobState.RUNNING and job.generation == 2
    assert job.scaleup_waiters == {parked.waiter: "s"} and parked.waiter in sm.calls.waiting


def test_a_standby_parks_beyond_max_nodes_and_the_full_world_is_not_told() -> None:
    sm = RendezvousState()
    running_pair(sm)
    parked = sm.join(spare("s"), 0.5)
    assert isinstance(parked, Parked)  # not WORLD_FULL, as a plain node gets
    assert notified(sm, EventKind.NODES_WAITING) == []
    # A stream (re)attached now is not told either: the world has no room for it.
    sm.attach_stream("j", 1, 0, "a", 0.6, mode=JoinMode.NODE)
    assert notified(sm, EventKind.NODES_WAITING) == []
    f = fault(sm.join, node("c"), 0.7)
    assert f.reason == "WORLD_FULL"  # a plain node beyond max_nodes still is refused


def test_a_lost_node_calls_the_standby_and_the_next_generation_forms_at_once() -> None:
    sm = RendezvousState()
    tokens = running_pair(sm)
    parked = sm.join(spare("s"), 0.5)
    assert isinstance(parked, Parked)
    lose_b(sm, tokens)
    assert isinstance(woken(sm)[parked.waiter], Rejoin)
    # The adapter asks again for it: s opens generation 2 and, first there, is node 0.
    asked = sm.join(spare("s"), 1.1)
    assert isinstance(asked, JoinResult) and asked.id_required and asked.generation == 2
    assert isinstance(sm.join(spare("s", uid=ID2), 1.1), Parked)
    # The survivor's rejoin completes it: no last call (5 s) is waited out. It was node
    # 0 and is again: asked for the id (s's is dropped).
    out = sdk_join(sm, node("a2", previous="a"), 1.2)
    assert isinstance(out, JoinResult) and out.num_nodes == 2 and out.generation == 2
    assert sm.jobs["j"].state is JobState.RUNNING
    assert sm.jobs["j"].standbys_called == set()


def test_a_failure_that_loses_no_node_leaves_the_standby_parked() -> None:
    sm = RendezvousState()
    running_pair(sm)
    parked = sm.join(spare("s"), 0.5)
    assert isinstance(parked, Parked)
    sm.report_failure("j", 1, 1, "b", 0, "exit code 1", 1.0)  # a worker, not its node
    assert sm.jobs["j"].state is JobState.FAILED
    assert parked.waiter not in woken(sm)
    reform_without(sm, parked, 1.1)  # both nodes come back: it is still parked


def test_one_freed_slot_calls_one_standby_in_the_order_they_parked() -> None:
    sm = RendezvousState()
    tokens = running_pair(sm)
    first = sm.join(spare("s1"), 0.5)
    second = sm.join(spare("s2"), 0.6)
    assert isinstance(first, Parked) and isinstance(second, Parked)
    lose_b(sm, tokens)
    wakes = woken(sm)
    assert isinstance(wakes[first.waiter], Rejoin) and second.waiter not in wakes
    assert sm.jobs["j"].gen.woken == {"s1"}


def test_standbys_hear_that_the_job_ended_and_a_late_one_is_told_at_once() -> None:
    sm = RendezvousState()
    running_pair(sm)
    parked = sm.join(spare("s"), 0.5)
    assert isinstance(parked, Parked)
    for rank, inst in ((0, "a"), (1, "b")):
        sm.leave("j", 1, rank, inst, 1.0, mode=JoinMode.NODE)
    assert sm.jobs["j"].state is JobState.ENDED
    ended = woken(sm)[parked.waiter]
    assert getattr(ended, "reason", None) == "JOB_ENDED"
    # A standby arriving now parks: the job's relaunch may be starting beside it...
    late = sm.join(spare("s2"), 2.0)
    assert isinstance(late, Parked) and sm.jobs["j"].generation == 1  # nothing opened
    # ...and when none came within its wait, it hears that the job ended.
    f = sm.cancel_wait(late.waiter, 62.0, timed_out=True)
    assert f is not None and f.reason == "JOB_ENDED"


def test_a_standby_started_beside_a_relaunch_of_an_ended_job_stands_by() -> None:
    """The same job id relaunched: the standby's JoinNode may arrive before the
    relaunch's first node opens the next generation; it must stand by for it."""
    sm = RendezvousState()
    running_pair(sm)
    for rank, inst in ((0, "a"), (1, "b")):
        sm.leave("j", 1, rank, inst, 1.0, mode=JoinMode.NODE)
    early = sm.join(spare("s"), 2.0)
    assert isinstance(early, Parked)
    reform_without(sm, early, 2.1)  # the relaunch forms: the standby stands by for it


def test_a_standby_never_takes_a_seat_in_a_fresh_launch() -> None:
    sm = RendezvousState()
    first = join_first(sm, node("a"))
    assert isinstance(first, Parked)
    # Room for one more node, but the launch's own node b is still to come.
    parked = sm.join(spare("s"), 0.1)
    assert isinstance(parked, Parked) and set(sm.jobs["j"].gen.nodes) == {"a"}
    assert isinstance(sm.join(node("b"), 0.2), JoinResult)
    assert sm.jobs["j"].state is JobState.RUNNING and parked.waiter in sm.calls.waiting


def test_a_standby_takes_the_seat_of_a_node_that_died_while_the_launch_formed() -> None:
    """Node b's agent dies in the first forming generation, then node a starts: the
    next generation expected nobody back, so it read as a fresh launch, and the
    standby stood by while a waited out its join timeout and gave up (a chaos review
    on namespace hosts, 3 of 3). The lost node freed a seat, as a lost running node
    does."""
    sm = RendezvousState()
    first = join_first(sm, node("b"))
    assert isinstance(first, Parked)
    sm.cancel_wait(first.waiter, 0.1, timed_out=False)  # b's agent died, its call cut
    job = sm.jobs["j"]
    assert job.state is JobState.FAILED
    assert sm.join(node("a"), 0.2).id_required  # type: ignore[union-attr]
    assert isinstance(sm.join(node("a", uid=ID2), 0.2), Parked)
    assert job.state is JobState.FORMING and job.generation == 2
    out = sm.join(spare("s"), 0.5)
    assert isinstance(out, JoinResult) and out.generation == 2 and out.num_nodes == 2
    assert job.state is JobState.RUNNING


def test_only_as_many_standbys_as_the_forming_launch_lost_take_its_seats() -> None:
    """Three nodes, b's agent dies while the launch forms: one standby takes b's seat,
    and a second one does not take the seat of c, a node of the launch still to come
    (review: every free seat went to standbys, and c was refused WORLD_FULL)."""
    sm = RendezvousState()
    first = join_first(sm, node("b", lo=3, hi=3))
    assert isinstance(first, Parked)
    sm.cancel_wait(first.waiter, 0.1, timed_out=False)
    assert sm.jobs["j"].state is JobState.FAILED
    assert sm.join(node("a", lo=3, hi=3), 0.2).id_required  # type: ignore[union-attr]
    assert isinstance(sm.join(node("a", lo=3, hi=3, uid=ID2), 0.2), Parked)
    assert isinstance(sm.join(spare("s1", lo=3, hi=3), 0.3), Parked)  # seated: b's seat
    second = sm.join(spare("s2", lo=3, hi=3), 0.4)
    assert isinstance(second, Parked) and second.waiter in sm.jobs["j"].standby_waiters
    assert isinstance(sm.join(node("c", lo=3, hi=3), 0.5), JoinResult)
    assert sm.jobs["j"].state is JobState.RUNNING
    assert set(sm.jobs["j"].gen.nodes) == {"a", "s1", "c"}


def test_a_standby_at_a_forming_generation_a_restart_fenced_is_not_taken_for_a_rank_join(
    tmp_path: Path,
) -> None:
    """The generation a restart fences a forming one with has no join mode until a node
    joins it: a standby there was refused "generation 2 is joined by per-rank Join
    calls" and exited 1 (a chaos review, the daemon restarted by SIGTERM)."""
    sm = RendezvousState()
    assert isinstance(join_first(sm, node("a")), Parked)  # forming: b still to come
    back = restarted(sm, tmp_path)
    job = back.jobs["j"]
    assert job.state is JobState.FORMING and job.generation == 2
    assert isinstance(back.join(spare("s"), 1.0), Parked)
    assert isinstance(back.join(node("a"), 1.1), JoinResult)  # node 0 asked for the id


def test_a_standby_arriving_after_the_failure_takes_the_freed_slot() -> None:
    sm = RendezvousState()
    tokens = running_pair(sm)
    lose_b(sm, tokens)
    # The survivor is back first and, --nnodes 2, waits for a second node.
    assert sm.join(node("a2", previous="a"), 1.1).id_required  # type: ignore[union-attr]
    assert isinstance(sm.join(node("a2", uid=ID2, previous="a"), 1.1), Parked)
    job = sm.jobs["j"]
    assert job.state is JobState.FORMING and job.gen.rejoin_expected == 1
    out = sm.join(spare("s"), 1.3)
    assert isinstance(out, JoinResult) and out.generation == 2 and out.num_nodes == 2
    assert job.state is JobState.RUNNING


def test_in_an_elastic_world_with_room_a_standby_is_a_scale_up() -> None:
    sm = RendezvousState()
    first = join_first(sm, node("a", lo=1, hi=3, last_call=1.0))
    assert isinstance(first, Parked)
    sm.tick(1.5)
    sm.attach_stream("j", 1, 0, "a", 1.5, mode=JoinMode.NODE)
    sm.take_effects()
    s1 = replace(node("s1", lo=1, hi=3, last_call=1.0), standby=True)
    s2 = replace(node("s2", lo=1, hi=3, last_call=1.0), standby=True)
    s3 = replace(node("s3", lo=1, hi=3, last_call=1.0), standby=True)
    assert isinstance(sm.join(s1, 2.0), Parked)
    notes = notified(sm, EventKind.NODES_WAITING)
    assert [n.nodes_waiting for n in notes] == [1]
    sm.join(s2, 3.0)
    sm.join(s3, 4.0)
    sm.tick(4.1)
    # Three parked, room for two: the count told stops at the room.
    assert [n.nodes_waiting for n in notified(sm, EventKind.NODES_WAITING)] == [2]


def test_a_standby_of_another_shape_is_refused_without_failing_the_job() -> None:
    sm = RendezvousState()
    running_pair(sm)
    f = fault(sm.join, replace(node("s", lo=2, hi=3), standby=True), 0.5)
    assert f.code is Code.FAILED_PRECONDITION and f.reason == "TOPOLOGY_MISMATCH"
    assert sm.jobs["j"].state is JobState.RUNNING


def test_a_standby_whose_wait_ends_is_told_to_stand_by_again() -> None:
    sm = RendezvousState()
    running_pair(sm)
    parked = sm.join(spare("s"), 0.5)
    assert isinstance(parked, Parked)
    f = sm.cancel_wait(parked.waiter, 60.5, timed_out=True)
    assert f is not None and f.code is Code.DEADLINE_EXCEEDED
    assert "standby node waited 60.0 s" in f.message and "join again" in f.message
    assert sm.jobs["j"].scaleup_waiters == {} and sm.jobs["j"].standby_waiters == set()


def test_a_seated_standby_rejoins_a_later_generation_as_any_node() -> None:
    """Once seated the agent joins without standby; the state machine also lets a
    retried standby JoinNode of a seated instance through."""
    sm = RendezvousState()
    tokens = running_pair(sm)
    parked = sm.join(spare("s"), 0.5)
    assert isinstance(parked, Parked)
    lose_b(sm, tokens)
    woken(sm)
    assert sm.join(spare("s"), 1.1).id_required  # type: ignore[union-attr]
    # Its join with the id: seated already, it waits for the survivor as node 0 does,
    # not beyond max_nodes as a standby.
    again = sm.join(spare("s", uid=ID2), 1.1)
    job = sm.jobs["j"]
    assert isinstance(again, Parked) and again.waiter in job.gen.join_waiters
    assert job.scaleup_waiters == {} and "s" in job.gen.nodes


def test_a_standby_whose_wait_ends_in_a_later_generation_leaves_no_record() -> None:
    """A standby outlives generations (a worker's failure leaves it parked); its wait
    ending later must still clear it, or the next lost node would call a call that is
    gone and the survivors would wait for it."""
    sm = RendezvousState()
    running_pair(sm)
    parked = sm.join(spare("s"), 0.5)
    assert isinstance(parked, Parked)
    sm.report_failure("j", 1, 1, "b", 0, "exit code 1", 1.0)
    reform_without(sm, parked, 1.1)
    job = sm.jobs["j"]
    f = sm.cancel_wait(parked.waiter, 60.5, timed_out=True)
    assert f is not None and "standby node waited" in f.message
    assert job.scaleup_waiters == {} and job.standby_waiters == set()
