"""The daemon's pure state machine, driven directly with an explicit clock."""

from __future__ import annotations

import dataclasses
import os

import pytest

from rendezvousd.common.limits import Limits, Timing
from rendezvousd.common.model import (
    EventKind,
    JobState,
    JoinResult,
    MemberState,
    Notify,
    Parked,
    Wake,
)
from rendezvousd.errors import Code, RendezvousFault
from rendezvousd.state.machine import JoinArgs, RendezvousState

ID = b"\x01" * 128


def args(
    node: int | None,
    local: int,
    *,
    job: str = "j",
    nodes: int = 2,
    gpus: int = 2,
    uid: bytes = b"",
    host: str | None = None,
    inst: str | None = None,
) -> JoinArgs:
    return JoinArgs.worker(
        job,
        nodes,
        gpus,
        node,
        local,
        host or f"h{node}",
        "",
        uid,
        inst or f"i{node}-{local}-{host}",
    )


def fault(fn: object, *a: object, **kw: object) -> RendezvousFault:
    with pytest.raises(RendezvousFault) as info:
        fn(*a, **kw)  # type: ignore[operator]
    return info.value


def inst(sm: RendezvousState, rank: int, job: str = "j") -> str:
    """The instance id that joined as ``rank``: Barrier and KV calls must name it."""
    return sm.jobs[job].gen.members[rank].instance_id


def form(sm: RendezvousState, nodes: int = 2, gpus: int = 2, job: str = "j") -> list[JoinResult]:
    """Join a full world; returns each rank's result."""
    results: dict[int, JoinResult] = {}
    parked: dict[int, int] = {}
    for n in range(nodes):
        for g in range(gpus):
            out = sm.join(
                args(n, g, job=job, nodes=nodes, gpus=gpus, uid=ID if (n, g) == (0, 0) else b""),
                0.0,
            )
            if isinstance(out, Parked):
                parked[out.waiter] = n * gpus + g
            else:
                results[out.rank] = out
    for e in sm.take_effects():
        if isinstance(e, Wake):
            assert isinstance(e.value, JoinResult)
            results[parked.pop(e.waiter)] = e.value
    assert not parked
    return [results[r] for r in range(nodes * gpus)]


def test_full_world_wakes_every_rank_with_same_id_and_table() -> None:
    sm = RendezvousState()
    results = form(sm)
    assert [r.rank for r in results] == [0, 1, 2, 3]
    assert {r.unique_id for r in results} == {ID}
    assert all(r.members is results[0].members for r in results)
    assert [m.rank for m in results[0].members] == [0, 1, 2, 3]
    assert sm.jobs["j"].state is JobState.RUNNING
    assert sm.waiter_count == 0


def test_single_node_world_matches_seed_single_node_mode() -> None:
    sm = RendezvousState()
    results = form(sm, nodes=1, gpus=4)
    assert [(r.rank, r.node_rank, r.local_rank, r.world_size) for r in results] == [
        (i, 0, i, 4) for i in range(4)
    ]


def test_rank_zero_without_id_is_asked_to_publish() -> None:
    sm = RendezvousState()
    first = sm.join(args(0, 0, nodes=1, gpus=2), 0.0)
    assert isinstance(first, JoinResult) and first.id_required and first.unique_id == b""
    other = sm.join(args(0, 1, nodes=1, gpus=2), 0.0)
    assert isinstance(other, Parked)
    done = sm.publish_id("j", first.generation, 0, "i0-0-None", ID, 1.0)
    assert isinstance(done, JoinResult) and done.unique_id == ID
    wakes = [e for e in sm.take_effects() if isinstance(e, Wake)]
    assert [w.waiter for w in wakes] == [other.waiter]


def test_topology_mismatch_names_both_values() -> None:
    sm = RendezvousState()
    sm.join(args(0, 1), 0.0)
    f = fault(sm.join, args(0, 0, nodes=3, host="wrong"), 0.0)
    assert f.code is Code.FAILED_PRECONDITION and f.reason == "TOPOLOGY_MISMATCH"
    assert "num_nodes=2" in f.message and "num_nodes=3" in f.message and "'wrong'" in f.message
    assert f.metadata["topology"] == "2x2" and f.metadata["requested_topology"] == "3x2"
    assert f.metadata["offending_host"] == "wrong"


@pytest.mark.parametrize("wrong_first", [False, True])
def test_topology_mismatch_while_forming_fails_every_waiter_at_once(wrong_first: bool) -> None:
    """Whichever side joined first, every parked joiner and the newcomer get the
    same TOPOLOGY_MISMATCH naming both topologies and the offending host."""
    sm = RendezvousState()
    wrong = args(0, 1, nodes=3, host="wrong")
    right = [args(0, 1, host="a"), args(1, 0, host="b")]
    first, rest = ([wrong], right) if wrong_first else (right, [wrong])
    parked = [sm.join(a, 0.0) for a in first]
    assert all(isinstance(p, Parked) for p in parked)
    sm.take_effects()
    newcomer = fault(sm.join, rest[0], 1.0)
    wakes = [e for e in sm.take_effects() if isinstance(e, Wake)]
    assert sorted(w.waiter for w in wakes) == sorted(p.waiter for p in parked)  # type: ignore[union-attr]
    for f in [newcomer] + [w.fault for w in wakes]:
        assert f is not None and f.reason == "TOPOLOGY_MISMATCH"
        assert f.code is Code.FAILED_PRECONDITION
        assert {"num_nodes=2", "num_nodes=3"} <= set(f.message.replace(",", "").split())
        assert "'wrong'" in f.message
    assert sm.jobs["j"].state is JobState.FAILED and sm.waiter_count == 0
    # A late worker of the same launch is told too, instead of waiting alone.
    late = fault(sm.join, rest[1] if len(rest) > 1 else args(1, 1, host="b"), 2.0)
    assert late.reason == "TOPOLOGY_MISMATCH" and "'wrong'" in late.message
    # Said as the last launch's, with when a fixed one may join (a fixed relaunch read
    # the old conflict as its own, with no word of when).
    assert "the job's last launch failed on this 1.0 s ago" in late.message, late.message
    assert f"may join in {sm.timing.heartbeat_timeout_s - 1.0:.1f} s" in late.message
    # After the hold, a corrected launch opens a fresh generation as usual.
    hold = sm.timing.heartbeat_timeout_s
    fresh = sm.join(args(0, 1, host="a", inst="relaunch"), 1.0 + hold + 0.1)
    assert isinstance(fresh, Parked)
    assert sm.jobs["j"].generation == 2 and sm.jobs["j"].state is JobState.FORMING


def test_topology_mismatch_against_a_running_job_refuses_only_the_newcomer() -> None:
    sm = RendezvousState()
    form(sm)
    f = fault(sm.join, args(0, 0, nodes=3, host="wrong", inst="x"), 0.0)
    assert f.reason == "TOPOLOGY_MISMATCH"
    assert sm.jobs["j"].state is JobState.RUNNING


def test_an_empty_forming_job_takes_the_next_joiners_topology() -> None:
    sm = RendezvousState()
    out = sm.join(args(0, 1), 0.0)
    assert isinstance(out, Parked)
    sm.cancel_wait(out.waiter, 1.0, timed_out=True)  # the only joiner gave up
    again = sm.join(args(0, 1, nodes=3), 2.0)
    assert isinstance(again, Parked) and sm.jobs["j"].num_nodes == 3


def test_duplicate_slot_from_other_instance_is_already_exists_but_retry_is_idempotent() -> None:
    sm = RendezvousState()
    a = sm.join(args(1, 1, inst="A"), 0.0)
    assert isinstance(a, Parked)
    again = sm.join(args(1, 1, inst="A"), 0.0)
    assert isinstance(again, Parked)
    f = fault(sm.join, args(1, 1, inst="B"), 0.0)
    assert f.code is Code.ALREADY_EXISTS and f.reason == "DUPLICATE_RANK" and "rank 3" in f.message
    # In a worker's terms, not the launcher's flags (it said "distinct --node-rank").
    assert "give each worker its own (node_rank 0..1" in f.message and "--" not in f.message


def test_a_rank_held_by_a_running_generation_is_said_as_another_run_still_running() -> None:
    """A relaunch (a second srun step of one allocation) while the job id's earlier run
    trains: every new rank was told to give each worker its own node_rank, advice about
    numbering where the cause was the run still going."""
    sm = RendezvousState()
    form(sm)
    sm.take_effects()
    f = fault(sm.join, args(0, 1, inst="relaunch"), 5.0)
    assert f.code is Code.ALREADY_EXISTS and f.reason == "DUPLICATE_RANK"
    assert "rank 1 (node_rank=0, local_rank=1) of job 'j' generation 1" in f.message
    assert "another run of job 'j' is still running (generation 1, 4 ranks" in f.message
    assert "`rendezvousd status j`" in f.message and "$SLURM_STEP_ID" in f.message
    assert "node_rank=None" not in f.message  # the numbering advice is the forming one's
    assert sm.jobs["j"].state is JobState.RUNNING  # the running run is untouched


@pytest.mark.parametrize(
    ("node", "local", "nodes", "gpus"), [(2, 0, 2, 2), (0, 2, 2, 2), (0, 0, 0, 1), (0, 0, 1, 0)]
)
def test_out_of_range_and_invalid_topology_are_invalid_argument(
    node: int, local: int, nodes: int, gpus: int
) -> None:
    f = fault(RendezvousState().join, args(node, local, nodes=nodes, gpus=gpus), 0.0)
    assert f.code is Code.INVALID_ARGUMENT


@pytest.mark.parametrize("bad", [b"", b"\x01" * 127, b"\x01" * 129, b"\x00" * 128])
def test_unique_id_must_be_128_non_zero_bytes(bad: bytes) -> None:
    sm = RendezvousState()
    first = sm.join(args(0, 0, nodes=1, gpus=1), 0.0)
    assert isinstance(first, JoinResult)
    f = fault(sm.publish_id, "j", first.generation, 0, "i0-0-None", bad, 0.0)
    assert f.code is Code.INVALID_ARGUMENT and f.reason == "INVALID_ID"
    assert bad.hex() not in f.message or not bad


def test_id_is_write_once_per_generation() -> None:
    sm = RendezvousState()
    sm.join(args(0, 0, uid=ID, inst="z"), 0.0)
    assert isinstance(sm.join(args(0, 0, uid=ID, inst="z"), 0.0), Parked)  # same bytes: fine
    f = fault(sm.join, args(0, 0, uid=b"\x02" * 128, inst="z"), 0.0)
    assert f.code is Code.ALREADY_EXISTS and f.reason == "ID_CONFLICT"
    assert sm.jobs["j"].gen.unique_id == ID


def test_only_rank_zero_supplies_the_id() -> None:
    f = fault(RendezvousState().join, args(1, 0, uid=ID), 0.0)
    assert f.reason == "INVALID_ID" and "rank 2" in f.message


def test_node_ranks_are_assigned_per_host_in_arrival_order() -> None:
    sm = RendezvousState()
    b0 = sm.join(args(None, 1, host="beta"), 0.0)
    a0 = sm.join(args(None, 0, host="alpha"), 0.0)
    b1 = sm.join(args(None, 0, host="beta"), 0.0)
    members = sm.jobs["j"].gen.members
    assert {m.host: m.node_rank for m in members.values()} == {"beta": 0, "alpha": 1}
    assert isinstance(b1, JoinResult) and b1.rank == 0 and b1.id_required
    assert isinstance(b0, Parked) and isinstance(a0, Parked)
    f = fault(sm.join, args(None, 0, host="gamma"), 0.0)
    assert f.reason == "WORLD_FULL"


def test_lost_member_fails_generation_wakes_waiters_and_notifies_survivors() -> None:
    sm = RendezvousState(timing=Timing(heartbeat_timeout_s=5))
    results = form(sm)
    gen = results[0].generation
    for r in (0, 1, 2):
        assert isinstance(
            sm.barrier("j", gen, r, "b", 1, 1.0, instance_id=inst(sm, r, "j")), Parked
        )
    token = sm.attach_stream("j", gen, 3, "i1-1-None", 1.0)
    sm.take_effects()
    sm.detach_stream("j", gen, 3, token, 2.0)
    effects = sm.take_effects()
    wakes = [e for e in effects if isinstance(e, Wake)]
    assert len(wakes) == 3 and all(w.fault and w.fault.reason == "PEER_FAILED" for w in wakes)
    assert "rank 3 on h1" in wakes[0].fault.message  # type: ignore[union-attr]
    notes = [e for e in effects if isinstance(e, Notify)]
    assert len(notes) == 1 and notes[0].kind is EventKind.PEER_FAILED and notes[0].to == (0, 1, 2)
    assert sm.jobs["j"].state is JobState.FAILED
    assert sm.waiter_count == 0


def test_silent_member_is_lost_after_heartbeat_timeout_only() -> None:
    sm = RendezvousState(timing=Timing(heartbeat_timeout_s=5))
    results = form(sm, nodes=1, gpus=2)
    gen = results[0].generation
    sm.heartbeat("j", gen, 0, 4.0)
    sm.tick(4.9)
    assert sm.jobs["j"].state is JobState.RUNNING
    sm.tick(5.1)
    job = sm.jobs["j"]
    assert job.state is JobState.FAILED
    assert [f.rank for f in job.gen.failed] == [1] and "no heartbeat" in job.gen.failed[0].cause


def test_every_rank_silent_at_one_tick_is_in_the_failure_the_survivors_hear() -> None:
    """A host cut off: ranks 2 and 3 (node 1) go silent together. The survivors heard
    only "lost rank 2" (the generation had failed by rank 3's turn), though ``status``
    listed both; the failure they hear, its message and its members, names both."""
    from rendezvousd.common.model import Transition

    sm = RendezvousState(timing=Timing(heartbeat_timeout_s=5))
    gen = form(sm)[0].generation  # 2 nodes x 2
    for r in range(4):
        sm.attach_stream("j", gen, r, inst(sm, r), 0.0)
    waiter = sm.barrier("j", gen, 0, "b", 1, 1.0, instance_id=inst(sm, 0))
    assert isinstance(waiter, Parked)
    sm.take_effects()
    for r in (0, 1):
        sm.heartbeat("j", gen, r, 4.0)
    sm.tick(5.1)
    effects = sm.take_effects()
    notes = [e for e in effects if isinstance(e, Notify)]
    assert len(notes) == 1 and notes[0].kind is EventKind.PEER_FAILED, notes
    assert sorted(notes[0].to) == [0, 1]
    assert [f.rank for f in notes[0].failed] == [2, 3], notes[0].failed
    assert all("no heartbeat for 5.0 s" in f.cause for f in notes[0].failed)
    wake = next(e for e in effects if isinstance(e, Wake) and e.waiter == waiter.waiter)
    assert wake.fault is not None
    assert "lost rank 2 on h1 (" in wake.fault.message, wake.fault.message
    assert "rank 3 on h1 (" in wake.fault.message, wake.fault.message
    failed = [e for e in effects if isinstance(e, Transition) and e.new is JobState.FAILED]
    assert len(failed) == 1 and failed[0].detail.startswith("rank 2 on h1 (no heartbeat")
    assert failed[0].detail.endswith("(and 1 more lost with it)"), failed[0].detail


def test_a_failure_after_a_rank_left_the_running_generation_names_that_rank() -> None:
    """Rank 3 finishes early and leaves (a clean goodbye) while ranks 0-2 still run
    collectives, which break: the first victim's stream to close was all the daemon's
    line and ``status`` said ("rank 2 on h1 (heartbeat stream closed)"). The rank that
    left is the failure's context; a goodbye alone is no failure, and the losses keep
    their own causes."""
    from rendezvousd.common.model import Transition

    sm = RendezvousState(timing=Timing(heartbeat_timeout_s=5))
    gen = form(sm)[0].generation  # 2 nodes x 2
    tokens = {r: sm.attach_stream("j", gen, r, inst(sm, r), 0.0) for r in range(4)}
    sm.leave("j", gen, 3, inst(sm, 3), 1.0)
    sm.detach_stream("j", gen, 3, tokens[3], 1.0)
    job = sm.jobs["j"]
    assert job.state is JobState.RUNNING and not job.gen.failed
    sm.take_effects()
    sm.detach_stream("j", gen, 2, tokens[2], 3.0)
    effects = sm.take_effects()
    failed = [e for e in effects if isinstance(e, Transition) and e.new is JobState.FAILED]
    assert len(failed) == 1, effects
    assert failed[0].detail == (
        "rank 2 on h1 (heartbeat stream closed), after rank 3 on h1 left the running "
        "generation (finished or exited early)"
    )
    assert job.last_failure is not None and job.last_failure.cause == failed[0].detail
    assert [(f.rank, f.cause) for f in job.gen.failed] == [(2, "heartbeat stream closed")]
    # Every member's goodbye is the job's clean end, as before.
    clean = RendezvousState()
    form(clean, nodes=1, gpus=2)
    for r in (1, 0):
        clean.leave("j", 1, r, inst(clean, r), 1.0)
    assert clean.jobs["j"].state is JobState.ENDED and not clean.jobs["j"].gen.failed


@pytest.mark.parametrize(
    ("closed_at", "cause"),
    [
        (4.9, "heartbeat stream closed"),
        (5.0, "no heartbeat for 5.0 s (worker unreachable)"),
    ],
)
def test_a_stream_ending_after_the_timeout_of_silence_is_lost_to_the_silence(
    closed_at: float, cause: str
) -> None:
    """A stream the daemon's keepalive ended once its member was silent for the whole
    timeout is that silence, even before the tick; sooner, it is a closed stream."""
    sm = RendezvousState(timing=Timing(heartbeat_timeout_s=5))
    gen = form(sm, nodes=1, gpus=2)[0].generation
    token = sm.attach_stream("j", gen, 1, inst(sm, 1), 0.0)
    sm.detach_stream("j", gen, 1, token, closed_at)
    assert [(f.rank, f.cause) for f in sm.jobs["j"].gen.failed] == [(1, cause)]


def test_stale_generation_is_aborted_with_current_and_new_generation_needs_fresh_id() -> None:
    sm = RendezvousState()
    results = form(sm, nodes=1, gpus=2)
    old = results[0].generation
    sm.abort("j", 0, "operator", 1.0)
    assert sm.jobs["j"].state is JobState.ABORTED
    f = fault(sm.join, args(0, 0, nodes=1, gpus=2, uid=ID, inst="new0"), 2.0)
    assert f.reason == "ID_REUSED"
    fresh = b"\x03" * 128
    assert isinstance(sm.join(args(0, 0, nodes=1, gpus=2, uid=fresh, inst="new0"), 2.0), Parked)
    assert sm.jobs["j"].generation == old + 1
    f = fault(sm.kv_set, "j", old, 0, "k", b"v", instance_id="stale")
    assert f.code is Code.ABORTED and f.reason == "STALE_GENERATION"
    assert f.metadata["current_generation"] == str(old + 1)


def test_failed_generation_rejects_calls_until_rejoin() -> None:
    sm = RendezvousState()
    gen = form(sm, nodes=1, gpus=2)[0].generation
    token = sm.attach_stream("j", gen, 1, "i0-1-None", 0.0)
    sm.detach_stream("j", gen, 1, token, 0.5)
    f = fault(sm.barrier, "j", gen, 0, "b", 1, 1.0, instance_id=inst(sm, 0))
    assert f.code is Code.ABORTED and f.reason == "PEER_FAILED" and f.metadata["ranks"] == "1"


def test_old_stream_closing_after_reconnect_is_not_a_failure() -> None:
    sm = RendezvousState()
    gen = form(sm, nodes=1, gpus=2)[0].generation
    old = sm.attach_stream("j", gen, 1, "i0-1-None", 0.0)
    sm.attach_stream("j", gen, 1, "i0-1-None", 0.1)
    sm.detach_stream("j", gen, 1, old, 0.2)
    assert sm.jobs["j"].state is JobState.RUNNING


def test_barrier_sequences_retry_and_mismatch() -> None:
    sm = RendezvousState()
    gen = form(sm, nodes=1, gpus=2)[0].generation
    w = sm.barrier("j", gen, 0, "b", 1, 0.0, instance_id=inst(sm, 0, "j"))
    assert isinstance(w, Parked)
    assert sm.barrier("j", gen, 1, "b", 1, 0.0, instance_id=inst(sm, 1, "j")) == 1
    assert [e.value for e in sm.take_effects() if isinstance(e, Wake)] == [1]
    assert (
        sm.barrier("j", gen, 0, "b", 1, 0.0, instance_id=inst(sm, 0, "j")) == 1
    )  # a retried, completed round returns at once
    f = fault(sm.barrier, "j", gen, 0, "b", 5, 0.0, instance_id=inst(sm, 0))
    assert f.code is Code.FAILED_PRECONDITION and f.reason == "BARRIER_MISMATCH"


def test_barrier_timeout_names_missing_ranks_and_withdraws_arrival() -> None:
    sm = RendezvousState()
    gen = form(sm, nodes=1, gpus=3)[0].generation
    w = sm.barrier("j", gen, 0, "b", 1, 0.0, instance_id=inst(sm, 0, "j"))
    sm.barrier("j", gen, 1, "b", 1, 0.0, instance_id=inst(sm, 1, "j"))
    assert isinstance(w, Parked)
    f = sm.cancel_wait(w.waiter, 5.0, timed_out=True)
    assert f is not None and f.reason == "BARRIER_TIMEOUT" and f.metadata["ranks"] == "2"
    assert set(sm.jobs["j"].gen.barriers["b"].arrived) == {1}


def test_leave_lets_barrier_finish_and_last_leave_ends_job() -> None:
    sm = RendezvousState()
    gen = form(sm, nodes=1, gpus=2)[0].generation
    w = sm.barrier("j", gen, 0, "b", 1, 0.0, instance_id=inst(sm, 0, "j"))
    sm.leave("j", gen, 1, "i0-1-None", 0.0)
    assert [e.waiter for e in sm.take_effects() if isinstance(e, Wake)] == [w.waiter]  # type: ignore[union-attr]
    sm.leave("j", gen, 0, "i0-0-None", 0.0)
    assert sm.jobs["j"].state is JobState.ENDED
    sm.tick(Timing().job_ttl_s + 1)
    assert "j" not in sm.jobs


def test_a_rank_that_leaves_while_waiting_at_a_barrier_is_not_counted_as_arrived() -> None:
    """Rank 1 arrives, then leaves (its process shutting down while a thread waits at
    the barrier): the barrier waits for ranks 0 and 2, not just for 2, which was let
    through while rank 0 had not arrived; rank 1's own call ends."""
    sm = RendezvousState()
    gen = form(sm, nodes=1, gpus=3)[0].generation
    waiting = sm.barrier("j", gen, 1, "b", 1, 0.0, instance_id=inst(sm, 1))
    assert isinstance(waiting, Parked)
    sm.leave("j", gen, 1, inst(sm, 1), 0.0)
    [wake] = [e for e in sm.take_effects() if isinstance(e, Wake)]
    assert wake.waiter == waiting.waiter and wake.fault is not None
    assert wake.fault.reason == "NOT_A_MEMBER" and "left job 'j'" in wake.fault.message
    second = sm.barrier("j", gen, 2, "b", 1, 0.0, instance_id=inst(sm, 2))
    assert isinstance(second, Parked), "rank 2 passed the barrier before rank 0 arrived"
    assert sm.barrier("j", gen, 0, "b", 1, 0.0, instance_id=inst(sm, 0)) == 1
    assert [(e.waiter, e.value) for e in sm.take_effects() if isinstance(e, Wake)] == [
        (second.waiter, 1)
    ]


def test_a_key_wait_left_behind_ends_with_its_member() -> None:
    """A KvGet's member left while it waited: it hears NOT_A_MEMBER at once, as its
    barrier would, rather than holding its slot to its deadline (600 s), keeping the
    ended job from expiring (then JOB_ENDED once every member left; an SDK review had
    it wait out its wait behind a member still there)."""
    sm = RendezvousState()
    gen = form(sm, nodes=1, gpus=2)[0].generation
    waiting = sm.kv_get("j", gen, 1, "k", True, 0.0, instance_id=inst(sm, 1))
    assert isinstance(waiting, Parked)
    sm.leave("j", gen, 1, inst(sm, 1), 0.0)
    [wake] = [e for e in sm.take_effects() if isinstance(e, Wake)]
    assert wake.waiter == waiting.waiter and wake.fault is not None
    assert wake.fault.reason == "NOT_A_MEMBER"
    assert "rank 1 left job 'j'; its wait for key 'k' ends" in wake.fault.message
    assert sm.jobs["j"].state is JobState.RUNNING
    sm.leave("j", gen, 0, inst(sm, 0), 0.0)
    assert sm.jobs["j"].state is JobState.ENDED
    assert sm.waiter_count == 0
    sm.tick(Timing().job_ttl_s + 1)
    assert "j" not in sm.jobs


def test_a_rank_whose_own_wait_ended_first_is_said_to_have_come() -> None:
    """Ranks 0 and 1 of four joined, rank 0's wait ended first (its seat freed): rank
    1's timeout names rank 0 among the missing ranks, and says it came."""
    sm = RendezvousState()
    zero = sm.join(args(0, 0, uid=b"\x05" * 128, host="h0"), 0.0)
    one = sm.join(args(0, 1, host="h0"), 0.5)
    assert isinstance(zero, Parked) and isinstance(one, Parked)
    assert sm.cancel_wait(zero.waiter, 30.0, timed_out=True) is not None
    f = sm.cancel_wait(one.waiter, 30.5, timed_out=True)
    assert f is not None and f.metadata["ranks"] == "0,2,3"
    assert (
        "1 of 4 ranks joined after 30.0 s; missing ranks [0, 2, 3] (3 total); rank 0 on h0 "
        "joined too, but its own wait ended at its deadline 0.500 s before this one, before "
        "the generation formed"
    ) in f.message, f.message


def test_join_timeout_frees_the_rank_and_names_missing_ranks() -> None:
    sm = RendezvousState()
    w = sm.join(args(1, 0), 0.0)
    assert isinstance(w, Parked)
    f = sm.cancel_wait(w.waiter, 30.0, timed_out=True)
    assert f is not None and f.code is Code.DEADLINE_EXCEEDED and f.reason == "WORLD_INCOMPLETE"
    assert f.metadata["ranks"] == "0,1,3"
    assert not sm.jobs["j"].gen.members
    assert isinstance(sm.join(args(1, 0, inst="other"), 31.0), Parked)


def test_join_cancelled_by_a_dead_worker_fails_everyone_waiting_at_once() -> None:
    sm = RendezvousState()
    a = sm.join(args(0, 1), 0.0)
    b = sm.join(args(1, 0), 0.0)
    assert isinstance(a, Parked) and isinstance(b, Parked)
    assert sm.cancel_wait(b.waiter, 1.0, timed_out=False) is None
    wakes = [e for e in sm.take_effects() if isinstance(e, Wake)]
    assert [w.waiter for w in wakes] == [a.waiter]
    f = wakes[0].fault
    assert f is not None and f.reason == "PEER_FAILED" and f.metadata["ranks"] == "2"
    assert "rank 2 on h1" in f.message and sm.jobs["j"].state is JobState.FAILED


def test_rank_zero_leaving_before_formed_drops_its_id() -> None:
    sm = RendezvousState()
    sm.join(args(0, 0, uid=ID, inst="z"), 0.0)
    sm.leave("j", 1, 0, "z", 0.0)
    assert sm.jobs["j"].gen.unique_id is None
    assert fault(sm.join, args(0, 0, uid=ID, inst="y"), 0.0).reason == "ID_REUSED"


def test_kv_wait_cas_add_delete() -> None:
    sm = RendezvousState()
    gen = form(sm, nodes=1, gpus=2)[0].generation
    w = sm.kv_get("j", gen, 1, "k", True, 0.0, instance_id=inst(sm, 1, "j"))
    assert isinstance(w, Parked)
    assert sm.kv_compare_and_set("j", gen, 0, "k", None, b"a", instance_id=inst(sm, 0, "j")) == (
        True,
        b"a",
    )
    assert [e.value for e in sm.take_effects() if isinstance(e, Wake)] == [b"a"]
    assert sm.kv_compare_and_set("j", gen, 0, "k", None, b"b", instance_id=inst(sm, 0, "j")) == (
        False,
        b"a",
    )
    assert sm.kv_compare_and_set("j", gen, 0, "k", b"a", b"c", instance_id=inst(sm, 0, "j")) == (
        True,
        b"c",
    )
    assert (
        sm.kv_add("j", gen, 0, "n", 5, instance_id=inst(sm, 0, "j")) == 5
        and sm.kv_add("j", gen, 1, "n", -2, instance_id=inst(sm, 1, "j")) == 3
    )
    assert fault(sm.kv_add, "j", gen, 0, "k", 1, instance_id=inst(sm, 0)).reason == "NOT_A_COUNTER"
    assert sm.kv_delete("j", gen, 0, "k", instance_id=inst(sm, 0, "j")) and not sm.kv_delete(
        "j", gen, 0, "k", instance_id=inst(sm, 0, "j")
    )
    assert (
        fault(sm.kv_get, "j", gen, 0, "k", False, 0.0, instance_id=inst(sm, 0)).reason
        == "KEY_NOT_FOUND"
    )
    assert sm.jobs["j"].gen.kv_bytes == len("n") + len("3")


def test_kv_limits_name_the_limit() -> None:
    sm = RendezvousState(Limits(max_keys_per_job=2, max_value_bytes=8, max_key_bytes=4))
    gen = form(sm, nodes=1, gpus=1)[0].generation
    assert (
        fault(sm.kv_set, "j", gen, 0, "k", b"x" * 9, instance_id=inst(sm, 0)).metadata["limit"]
        == "max_value_bytes"
    )
    assert (
        fault(sm.kv_set, "j", gen, 0, "kkkkk", b"x", instance_id=inst(sm, 0)).metadata["limit"]
        == "max_key_bytes"
    )
    sm.kv_set("j", gen, 0, "a", b"1", instance_id=inst(sm, 0, "j"))
    sm.kv_set("j", gen, 0, "b", b"1", instance_id=inst(sm, 0, "j"))
    sm.kv_set("j", gen, 0, "a", b"2", instance_id=inst(sm, 0, "j"))  # replacing is not a new key
    f = fault(sm.kv_set, "j", gen, 0, "c", b"1", instance_id=inst(sm, 0))
    assert f.code is Code.RESOURCE_EXHAUSTED and f.metadata["limit"] == "max_keys_per_job"


def test_limits_on_jobs_members_and_waiters() -> None:
    sm = RendezvousState(Limits(max_jobs=1, max_members_per_job=3, max_waiters=1))
    assert fault(sm.join, args(0, 0, job="a"), 0.0).metadata["limit"] == "max_members_per_job"
    assert isinstance(sm.join(args(0, 1, job="a", nodes=1, gpus=3), 0.0), Parked)
    assert fault(sm.join, args(0, 0, job="b", nodes=1, gpus=1), 0.0).metadata["limit"] == "max_jobs"
    assert (
        fault(sm.join, args(0, 2, job="a", nodes=1, gpus=3), 0.0).metadata["limit"] == "max_waiters"
    )


@pytest.mark.parametrize("bad", ["", "a/b", "../x", "x" * 129, "tab\there", "ü", ".."])
def test_bad_job_ids_are_invalid(bad: str) -> None:
    f = fault(RendezvousState().join, args(0, 0, job=bad), 0.0)
    assert f.code is Code.INVALID_ARGUMENT and f.reason == "INVALID_JOB_ID"


def test_drain_releases_waiters_and_refuses_joins() -> None:
    sm = RendezvousState()
    gen = form(sm, nodes=1, gpus=2)[0].generation
    w = sm.kv_get("j", gen, 0, "k", True, 0.0, instance_id=inst(sm, 0, "j"))
    sm.take_effects()
    sm.drain(0.0)
    effects = sm.take_effects()
    assert any(
        isinstance(e, Wake) and e.waiter == w.waiter and e.fault and e.fault.reason == "DRAINING"  # type: ignore[union-attr]
        for e in effects
    )
    assert any(isinstance(e, Notify) and e.kind is EventKind.DAEMON_DRAINING for e in effects)
    assert fault(sm.join, args(0, 0, job="new"), 0.0).code is Code.UNAVAILABLE
    sm.detach_stream("j", gen, 0, 0, 1.0)  # streams closing during drain are not failures
    assert sm.jobs["j"].state is JobState.RUNNING


def test_inspection_never_exposes_the_id() -> None:
    sm = RendezvousState()
    form(sm, nodes=1, gpus=2)
    view = sm.view("j", 1.0)
    assert view.id_published and ID not in repr(view).encode()
    assert ID.hex() not in repr(view)
    assert [m.state for m in view.members] == [MemberState.ACTIVE, MemberState.ACTIVE]
    assert "unique_id" not in repr(form(RendezvousState(), nodes=1, gpus=1)[0])


def test_random_ids_never_collide_with_reuse_check() -> None:
    sm = RendezvousState()
    for i in range(5):
        sm.join(args(0, 0, nodes=1, gpus=1, uid=os.urandom(128), inst=f"x{i}"), float(i))
        sm.abort("j", 0, "again", float(i))
    assert sm.jobs["j"].generation == 5 and len(sm.jobs["j"].used_id_digests) == 4


def test_big_jobs_leave_the_last_waiter_slots_to_small_ones() -> None:
    """Fair share: max_waiters 64 keeps its last 8 slots for jobs holding fewer than 8."""
    sm = RendezvousState(Limits(max_waiters=64, max_waiters_per_job=32))
    assert sm.limits.waiters_reserve == 8

    def park(job: str, n: int, world: int) -> int:
        parked = 0
        for local in range(1, n + 1):  # rank 0 would be asked for the id instead
            try:
                assert isinstance(
                    sm.join(args(0, local, job=job, nodes=1, gpus=world), 0.0), Parked
                )
            except RendezvousFault as f:
                assert f.metadata["limit"] == "max_waiters" and "keeps the last 8" in f.message
                assert f"job {job!r} holds {parked}" in f.message
                break
            parked += 1
        return parked

    assert park("a", 32, 100) == 32  # the per-job cap
    assert park("b", 32, 100) == 24  # not the 32 it could take before: 8 slots kept
    assert park("c", 8, 100) == 8  # a small job still starts
    assert fault(sm.join, args(0, 1, job="d", nodes=1, gpus=2), 0.0).metadata["limit"] == (
        "max_waiters"
    )


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"host": ""}, "host must not be empty"),
        ({"host": "h" * 300}, "host is longer than"),
        ({"inst": "i" * 129}, "instance_id is longer than 128 bytes"),
    ],
)
def test_a_join_with_an_empty_or_overlong_field_is_refused_before_it_touches_a_job(
    change: dict[str, str], said: str
) -> None:
    sm = RendezvousState()
    a = args(0, 0, nodes=1, gpus=1, uid=ID)
    bad = dataclasses.replace(
        a,
        host=change.get("host", a.host),
        instance_id=change.get("inst", a.instance_id),
    )
    refused = fault(sm.join, bad, 0.0)
    assert refused.code is Code.INVALID_ARGUMENT and said in refused.message, refused
    assert "j" not in sm.jobs  # nothing created


def test_an_empty_kv_key_is_refused() -> None:
    sm = RendezvousState()
    form(sm, nodes=1, gpus=1)
    refused = fault(sm.kv_set, "j", 1, 0, "", b"v", instance_id=inst(sm, 0))
    assert refused.code is Code.INVALID_ARGUMENT and "key must not be empty" in refused.message
    assert sm.jobs["j"].gen.kv == {}


def test_a_worker_joined_by_rank_reports_its_own_failure_with_its_whole_cause() -> None:
    """Without a node agent only the worker itself can say why it failed: its
    exception, where its heartbeat stream's close said "heartbeat stream closed"."""
    sm = RendezvousState()
    form(sm)  # 2 nodes x 2: rank 3 is node 1, local rank 1
    for r in range(4):
        sm.attach_stream("j", 1, r, inst(sm, r), 0.0)
    sm.take_effects()
    # Another rank's instance may not report for it, nor a seat outside the world.
    assert fault(sm.report_failure, "j", 1, 1, inst(sm, 2), 1, "x", 1.0).reason
    assert fault(sm.report_failure, "j", 1, 2, inst(sm, 3), 1, "x", 1.0).reason == (
        "RANK_OUT_OF_RANGE"
    )
    assert sm.jobs["j"].state is JobState.RUNNING
    sm.report_failure("j", 1, 1, inst(sm, 3), 1, "RuntimeError: line1\nline2", 1.0)
    job = sm.jobs["j"]
    assert job.state is JobState.FAILED
    lost = job.gen.failed[0]
    assert (lost.rank, lost.cause) == (3, "RuntimeError: line1\nline2")
    notes = [e for e in sm.take_effects() if isinstance(e, Notify)]
    assert len(notes) == 1 and notes[0].kind is EventKind.PEER_FAILED
    assert sorted(notes[0].to) == [0, 1, 2]  # not the reporter, which is going


def test_a_report_failure_in_a_forming_generation_is_refused_by_rank_and_by_node() -> None:
    """A worker's report (a raw client: the SDK reports only once formed) while its
    generation formed marked it LOST and failed nothing: the generation formed without
    it ever being told, and a later loss named it the root cause. Refused now, as a node
    agent's is, both naming the job, generation and seat; nothing changes."""
    from tests.daemon.test_node_state import node

    sm = RendezvousState()
    assert isinstance(sm.join(args(0, 1), 0.0), Parked)
    refused = fault(sm.report_failure, "j", 1, 0, inst(sm, 1), 1, "boom", 0.5)
    assert (refused.code, refused.reason) == (Code.FAILED_PRECONDITION, "NOT_RUNNING")
    assert refused.message.startswith(
        "ReportFailure for rank 1 of job 'j' generation 1 refused: the generation is still forming"
    )
    assert refused.metadata == {"job_id": "j", "generation": "1", "ranks": "1"}
    job = sm.jobs["j"]
    assert job.gen.members[1].state is MemberState.JOINING and not job.gen.failed
    for n, g in ((0, 0), (1, 0), (1, 1)):  # the rest join: it forms with rank 1
        sm.join(args(n, g, uid=ID if n == g == 0 else b""), 1.0)
    assert job.state is JobState.RUNNING and not job.gen.failed
    sm.report_failure("j", 1, 1, inst(sm, 2), 0, "the real cause", 1.0)
    assert [(f.rank, f.cause) for f in job.gen.failed] == [(2, "the real cause")]

    nodes = RendezvousState()
    assert nodes.join(node("a", job="n"), 0.0).id_required  # type: ignore[union-attr]
    assert isinstance(nodes.join(node("b", job="n"), 0.0), Parked)
    by_node = fault(nodes.report_failure, "n", 1, 0, "b", 0, "boom", 0.5)
    assert (by_node.code, by_node.reason) == (Code.FAILED_PRECONDITION, "NOT_RUNNING")
    assert by_node.message.startswith("ReportFailure for node_rank=0 of job 'n' generation 1")


def test_a_member_that_never_beat_is_told_apart_from_one_that_went_silent() -> None:
    """A live SDK user's worker that never called start_heartbeat() (the README's own
    second worker did not) was lost as "worker unreachable"."""
    sm = RendezvousState(timing=Timing(heartbeat_timeout_s=5))
    gen = form(sm, nodes=1, gpus=2)[0].generation
    sm.attach_stream("j", gen, 0, inst(sm, 0), 0.0)
    sm.tick(5.1)
    causes = {f.rank: f.cause for f in sm.jobs["j"].gen.failed}
    assert causes[0] == "no heartbeat for 5.0 s (worker unreachable)", causes
    assert causes[1].startswith("joined, then sent no heartbeat within 5.0 s"), causes
    assert "start_heartbeat()" in causes[1], causes


def test_a_rank_lost_to_its_cut_join_joins_the_next_generation_when_it_comes_back() -> None:
    """A worker's Join cancelled (a connection blip, read as its death) failed the
    forming generation; the same Join re-sent (the SDK's retry, or gRPC's) was answered
    that generation's PEER_FAILED naming its own rank as the failed peer. A lost rank is
    not a returning one, as a lost node is not: its join opens the next generation."""
    sm = RendezvousState()
    a = sm.join(args(0, 1), 0.0)
    b = sm.join(args(1, 0), 0.0)
    assert isinstance(a, Parked) and isinstance(b, Parked)
    sm.cancel_wait(b.waiter, 1.0, timed_out=False)
    assert sm.jobs["j"].state is JobState.FAILED
    again = sm.join(args(1, 0), 2.0)
    assert isinstance(again, Parked), again  # before: PEER_FAILED naming rank 2, itself
    job = sm.jobs["j"]
    assert (job.generation, job.state, list(job.gen.members)) == (2, JobState.FORMING, [2])


def test_a_survivors_re_sent_join_still_hears_the_loss_of_its_failed_generation() -> None:
    """A member not lost re-sending its Join (its answer lost with the connection) is
    returning: it hears the loss that failed the generation it joined."""
    sm = RendezvousState()
    a = sm.join(args(0, 1), 0.0)
    b = sm.join(args(1, 0), 0.0)
    assert isinstance(a, Parked) and isinstance(b, Parked)
    sm.cancel_wait(b.waiter, 1.0, timed_out=False)
    f = fault(sm.join, args(0, 1), 2.0)
    assert f.reason == "PEER_FAILED" and f.metadata["ranks"] == "2", f
    assert sm.jobs["j"].generation == 1


def test_ranks_silent_at_one_tick_are_named_in_rank_order() -> None:
    """Lost together, they were named in the order they had joined: node 1's ranks,
    joined 3 then 2, read "lost rank 3 ..., rank 2 ..." (a review on namespace hosts),
    and rank 3 was the root cause of record. They are named by rank."""
    sm = RendezvousState(timing=Timing(heartbeat_timeout_s=5))
    results = [
        sm.join(args(n, g, uid=ID if (n, g) == (0, 0) else b""), 0.0)
        for n, g in ((1, 1), (1, 0), (0, 1), (0, 0))
    ]
    gen = next(r.generation for r in results if isinstance(r, JoinResult))
    for r in range(4):
        sm.attach_stream("j", gen, r, inst(sm, r), 0.0)
    sm.take_effects()
    for r in (0, 1):
        sm.heartbeat("j", gen, r, 4.0)
    sm.tick(5.1)
    notes = [e for e in sm.take_effects() if isinstance(e, Notify)]
    assert [f.rank for f in notes[0].failed] == [2, 3], notes[0].failed
    assert [f.rank for f in sm.jobs["j"].gen.failed] == [2, 3]
