"""Node joins (JoinNode) in the pure state machine, driven with an explicit clock."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import pytest

from rendezvousd.common.escape import MAX_CAUSE_BYTES
from rendezvousd.common.limits import Timing
from rendezvousd.common.model import (
    NEVER_ATTACHED,
    EventKind,
    JobState,
    JoinMode,
    JoinResult,
    MemberState,
    Notify,
    Parked,
    Rejoin,
    Transition,
    Wake,
)
from rendezvousd.errors import Code, RendezvousFault
from rendezvousd.state.joins import launched_before_close
from rendezvousd.state.machine import JoinArgs, RendezvousState
from rendezvousd.state.views import instance_tag
from rendezvousd.storage.persistence import Persister
from rendezvousd.trainer.agent.recovery import stray

ID = b"\x02" * 128
ID2 = b"\x03" * 128


def node(
    inst: str,
    *,
    lo: int = 2,
    hi: int = 2,
    gpus: int = 2,
    uid: bytes = b"",
    rank: int | None = None,
    last_call: float = 5.0,
    job: str = "j",
    previous: str | None = None,
    launched: float | None = None,
    standby: bool = False,
    wire: str = "",
) -> JoinArgs:
    return JoinArgs(
        job,
        lo,
        hi,
        gpus,
        rank,
        f"host-{inst}",
        (),
        uid,
        inst,
        60.0,
        last_call_s=last_call,
        previous=previous,
        launched_at=launched,
        standby=standby,
        wire_version=wire,
    )


def fault(fn: object, *a: object, **kw: object) -> RendezvousFault:
    with pytest.raises(RendezvousFault) as info:
        fn(*a, **kw)  # type: ignore[operator]
    return info.value


def woken(sm: RendezvousState) -> dict[int, object]:
    return {
        e.waiter: e.value if e.fault is None else e.fault
        for e in sm.take_effects()
        if isinstance(e, Wake)
    }


def join_first(sm: RendezvousState, args: JoinArgs, now: float = 0.0) -> JoinResult | Parked:
    """Node 0's two calls: asked for the id, then joins with it."""
    out = sm.join(args, now)
    assert isinstance(out, JoinResult) and out.id_required
    return sm.join(
        node(
            args.instance_id,
            lo=args.min_nodes,
            hi=args.max_nodes,
            gpus=args.gpus_per_node,
            uid=ID,
            last_call=args.last_call_s,
            job=args.job_id,
            wire=args.wire_version,
        ),
        now,
    )


def test_fixed_size_forms_with_rank_blocks_and_one_id() -> None:
    sm = RendezvousState()
    first = join_first(sm, node("a"))
    assert isinstance(first, Parked)
    second = sm.join(node("b"), 1.0)
    assert isinstance(second, JoinResult) and not second.id_required
    a = woken(sm)[first.waiter]
    assert isinstance(a, JoinResult)
    assert (a.node_rank, second.node_rank) == (0, 1)
    assert a.unique_id == second.unique_id == ID
    assert a.num_nodes == 2 and len(a.members) == 4
    job = sm.jobs["j"]
    assert job.state is JobState.RUNNING
    assert [m.rank for m in a.members] == [0, 1, 2, 3]
    assert {m.host for m in a.members[2:]} == {"host-b"}
    # each worker's member answers to the instance id handed to its node only
    assert job.gen.members[3].instance_id == second.member_instance_ids[1]
    assert len(set(a.member_instance_ids) | set(second.member_instance_ids)) == 4


def test_elastic_forms_with_min_after_last_call_and_at_once_with_max() -> None:
    sm = RendezvousState()
    join_first(sm, node("a", lo=1, hi=3, last_call=5.0), 0.0)
    assert isinstance(sm.join(node("b", lo=1, hi=3, last_call=5.0), 2.0), Parked)
    sm.tick(6.9)  # 4.9 s after the last arrival: still waiting for more
    assert sm.jobs["j"].state is JobState.FORMING
    sm.tick(7.1)
    job = sm.jobs["j"]
    assert job.state is JobState.RUNNING and job.num_nodes == 2 and job.world_size == 4

    sm2 = RendezvousState()
    join_first(sm2, node("a", lo=1, hi=2, last_call=60.0))
    out = sm2.join(node("b", lo=1, hi=2, last_call=60.0), 0.1)
    assert isinstance(out, JoinResult) and out.num_nodes == 2


def test_named_node_zero_takes_the_id_from_an_earlier_unnamed_node() -> None:
    sm = RendezvousState()
    first = join_first(sm, node("a", hi=3, lo=3))
    assert isinstance(first, Parked)
    out = sm.join(node("b", hi=3, lo=3, rank=0), 1.0)
    assert isinstance(out, JoinResult) and out.id_required  # b is node 0 now
    assert sm.jobs["j"].gen.unique_id is None
    # a is not node 0 any more: its id is dropped (not taken, not refused) and it waits.
    assert isinstance(sm.join(node("a", hi=3, lo=3, uid=ID2), 1.5), Parked)
    assert sm.jobs["j"].gen.unique_id is None
    assert isinstance(sm.join(node("b", hi=3, lo=3, rank=0, uid=ID2), 2.0), Parked)
    out = sm.join(node("c", hi=3, lo=3), 3.0)
    assert isinstance(out, JoinResult) and out.node_rank == 2 and out.unique_id == ID2
    ranks = {n.instance_id: n.node_rank for n in sm.jobs["j"].gen.nodes.values()}
    assert ranks == {"b": 0, "a": 1, "c": 2}


def test_mixing_per_rank_and_node_joins_is_refused_both_ways() -> None:
    sm = RendezvousState()
    join_first(sm, node("a"))
    f = fault(sm.join, JoinArgs.worker("j", 2, 2, 1, 0, "h", "", b"", "w"), 1.0)
    assert (f.code.value, f.reason) == ("FAILED_PRECONDITION", "JOIN_MODE_MISMATCH")
    assert "JoinNode" in f.message and "'h'" in f.message
    sm.join(JoinArgs.worker("k", 2, 2, 1, 0, "h", "", b"", "w"), 1.0)
    f = fault(sm.join, node("x", job="k"), 1.0)
    assert f.reason == "JOIN_MODE_MISMATCH"


def restarted(sm: RendezvousState, tmp_path: Path) -> RendezvousState:
    """``sm`` written to a state dir, and the state a restarted daemon restores from it."""
    saver = Persister(tmp_path, sm)
    saver.restore()
    saver.close()
    back = RendezvousState()
    Persister(tmp_path, back).restore()
    return back


#: A ring wire version, as rendezvous-run's agents send (torchrun's send none).
RING = "RDVRING3"


def formed(sm: RendezvousState, wire: str = "") -> tuple[JoinResult, JoinResult]:
    first = join_first(sm, node("a", wire=wire))
    assert isinstance(first, Parked)
    b = sm.join(node("b", wire=wire), 0.0)
    a = woken(sm)[first.waiter]
    assert isinstance(a, JoinResult) and isinstance(b, JoinResult)
    return a, b


def test_report_failure_fails_the_generation_and_tells_the_other_node_first_lost() -> None:
    sm = RendezvousState()
    formed(sm)
    sm.attach_stream("j", 1, 0, "a", 0.0, mode=JoinMode.NODE)
    sm.attach_stream("j", 1, 1, "b", 0.0, mode=JoinMode.NODE)
    sm.take_effects()
    sm.report_failure("j", 1, 1, "b", 1, "exit code -9", 1.0)
    job = sm.jobs["j"]
    assert job.state is JobState.FAILED
    assert job.gen.failed[0].rank == 3 and job.gen.failed[0].cause == "exit code -9"
    notes = [e for e in sm.take_effects() if isinstance(e, Notify)]
    assert len(notes) == 1 and notes[0].kind is EventKind.PEER_FAILED
    assert notes[0].mode is JoinMode.NODE and notes[0].to == (0,)
    assert notes[0].failed[0].host == "host-b"
    # only the node's own agent may report
    f = fault(sm.report_failure, "j", 1, 0, "b", 0, "x", 2.0)
    assert f.reason == "DUPLICATE_RANK"


def test_a_goodbye_undone_by_a_failed_commit_is_still_a_goodbye_not_a_loss() -> None:
    """The daemon undoes a change whose commit failed (``storage.rollback``). A node's
    goodbye undone so was forgotten: the end of its stream, read next, lost the node
    and failed the finished job; another's silent end did so at the tick."""
    from rendezvousd.storage import rollback, snapshot

    sm = RendezvousState()
    formed(sm)
    a = sm.attach_stream("j", 1, 0, "a", 0.0, mode=JoinMode.NODE)
    b = sm.attach_stream("j", 1, 1, "b", 0.0, mode=JoinMode.NODE)
    committed = snapshot.job_record(sm.jobs["j"])
    sm.leave("j", 1, 0, "a", 1.0, mode=JoinMode.NODE)  # these two commits fail
    sm.leave("j", 1, 1, "b", 1.0, mode=JoinMode.NODE)
    sm.detach_stream("j", 1, 1, b, 1.1, mode=JoinMode.NODE)  # read before the undo
    live = sm.jobs["j"]
    sm.jobs["j"] = rollback.durable_job(
        committed, dict(live.gen.kv), live, 1.2, hold_s=sm.timing.hold_s
    )
    sm.take_effects()
    assert [n.state for n in sm.jobs["j"].gen.nodes.values()] == [MemberState.ACTIVE] * 2
    sm.detach_stream("j", 1, 0, a, 1.3, mode=JoinMode.NODE)
    assert sm.jobs["j"].state is JobState.RUNNING  # b's stream ended before the undo
    sm.tick(1.4)  # far within the heartbeat timeout: b's goodbye, said again
    job = sm.jobs["j"]
    assert job.state is JobState.ENDED and not job.gen.failed
    assert not [e for e in sm.take_effects() if isinstance(e, Notify)]


def test_a_node_loss_undone_by_a_failed_commit_is_kept_and_waits_for_storage() -> None:
    """A node agent's stream ended (its loss) and that commit failed: the undo took
    the loss back, and the tick later found the dead node silent, or its survivor
    (told of the loss, so it stopped) silent and blamed it. The loss is kept with its
    cause, made while storage fails by no tick, however long, and made once it works.
    The status page's timeline read the undo as "shrank 4 -> 0 ranks"."""
    from rendezvousd.storage import rollback, snapshot
    from rendezvousd.storage.faults import storage_unavailable
    from rendezvousd.web.timeline import Timeline

    sm = RendezvousState()
    formed(sm)
    a = sm.attach_stream("j", 1, 0, "a", 0.0, mode=JoinMode.NODE)
    sm.attach_stream("j", 1, 1, "b", 0.0, mode=JoinMode.NODE)
    committed = snapshot.job_record(sm.jobs["j"])
    timeline = Timeline()
    timeline.record(Transition("j", 1, JobState.FORMING, JobState.RUNNING, "formed", 4))
    sm.detach_stream("j", 1, 0, a, 1.0, mode=JoinMode.NODE)  # its commit fails
    live = sm.jobs["j"]
    assert live.state is JobState.FAILED
    cause = live.gen.failed[0].cause
    undone = rollback.durable_job(committed, dict(live.gen.kv), live, 1.1, hold_s=sm.timing.hold_s)
    sm.put_back("j", undone, storage_unavailable("j", waiting=True), "undone")
    sm.storage_failing = True  # as the Persister says until a commit takes
    for effect in sm.take_effects():
        if isinstance(effect, Transition):
            timeline.record(effect)
    assert [(e.new, e.change) for e in timeline.of("j")][1:] == [("FAILED", ""), ("RUNNING", "")]
    late = 1.0 + 3 * sm.timing.heartbeat_timeout_s
    sm.heartbeat("j", 1, 1, late - 0.5, mode=JoinMode.NODE)  # b lives on
    sm.tick(late)
    assert sm.jobs["j"].state is JobState.RUNNING
    assert not [e for e in sm.take_effects() if isinstance(e, Notify)]
    sm.storage_failing = False
    sm.tick(late + 0.1)
    job = sm.jobs["j"]
    assert job.state is JobState.FAILED
    assert [(f.rank, f.cause) for f in job.gen.failed] == [(0, cause), (1, cause)]
    notes = [e for e in sm.take_effects() if isinstance(e, Notify)]
    assert len(notes) == 1 and notes[0].kind is EventKind.PEER_FAILED and notes[0].to == (1,)


def test_an_undo_keeps_a_final_goodbye_and_takes_back_a_forming_one() -> None:
    """A final Leave of a failed generation (a node that will not re-join) was lost by
    the undo, though its caller is told its goodbye is kept: a seat was then kept for
    it. A goodbye to a forming generation is taken back, and says so (not "kept")."""
    from rendezvousd.state import placement
    from rendezvousd.storage import rollback, snapshot

    sm = RendezvousState()
    formed(sm)
    sm.report_failure("j", 1, 0, "a", 1, "exit code 3", 1.0)
    committed = snapshot.job_record(sm.jobs["j"])
    assert sm.leave("j", 1, 1, "b", 1.5, mode=JoinMode.NODE, final=True)  # its commit fails
    live = sm.jobs["j"]
    assert set(placement.owed_back(live)) == {"a"}
    undone = rollback.durable_job(committed, dict(live.gen.kv), live, 1.6, hold_s=sm.timing.hold_s)
    assert set(placement.owed_back(undone)) == {"a"}

    forming = RendezvousState()  # a worker of a per-rank job, waiting for its peer
    assert isinstance(
        forming.join(JoinArgs.worker("k", 1, 2, 0, 1, "h", "", b"", "w"), 2.0), Parked
    )
    assert not forming.leave("k", 1, 1, "w", 2.5)


def test_report_failure_keeps_any_cause_bounded_and_in_order_of_report() -> None:
    sm = RendezvousState()
    formed(sm)
    traceback = "Traceback:\n  line\r\x1b[31m\u202e" + "x" * 100_000
    sm.report_failure("j", 1, 1, "b", 1, traceback, 1.0)
    sm.report_failure("j", 1, 0, "a", 0, "", 2.0)
    first, second = sm.jobs["j"].gen.failed
    assert (first.rank, first.node_rank, first.local_rank, first.lost_at) == (3, 1, 1, 1.0)
    assert first.cause.startswith("Traceback:\n  line\r\x1b[31m\u202exxx")
    assert len(first.cause.encode()) <= MAX_CAUSE_BYTES
    # Its tail kept too: a long traceback ends with its exception.
    assert f" ... [cut: {len(traceback.encode())} bytes in all] ... xxx" in first.cause
    assert first.cause.endswith("x" * 100)
    assert (second.rank, second.host) == (0, "host-a") and second.cause
    f = sm.jobs["j"].generation_fault()  # what every call on the generation gets
    assert f.reason == "PEER_FAILED" and f.metadata["ranks"] == "3,0"
    assert f.metadata["hosts"] == "host-b,host-a" and f.failed == (first, second)
    assert "\n" not in f.message and "\x1b" not in f.message and len(f.message) < 600


def test_node_stream_closing_loses_every_member_of_the_node() -> None:
    """Closed by its client without a goodbye (not cut): lost at once, as before."""
    sm = RendezvousState()
    formed(sm)
    token = sm.attach_stream("j", 1, 1, "b", 0.0, mode=JoinMode.NODE)
    sm.attach_stream("j", 1, 0, "a", 0.0, mode=JoinMode.NODE)
    sm.detach_stream("j", 1, 1, token, 1.0, mode=JoinMode.NODE)
    job = sm.jobs["j"]
    assert job.state is JobState.FAILED
    assert sorted(f.rank for f in job.gen.failed) == [2, 3]
    assert job.gen.members[2].state is MemberState.LOST
    assert {f.cause for f in job.gen.failed} == {"node agent's heartbeat stream closed"}


def test_node_stream_cut_and_not_reattached_loses_every_member_of_the_node_after_a_grace() -> None:
    """A node agent's stream cut under it (no goodbye, no close) is lost only once it has not
    re-attached within a beat and a half (at least 1 s, at most half the timeout): a
    connection reset (a firewall reload) ends it as the agent's death does. Before, one
    second of resets failed the job at once, worded "node agent's heartbeat stream
    closed" (a gray-failure review, h160)."""
    sm = RendezvousState(timing=Timing(heartbeat_timeout_s=6.0))
    formed(sm, RING)
    token = sm.attach_stream("j", 1, 1, "b", 0.0, mode=JoinMode.NODE)
    sm.attach_stream("j", 1, 0, "a", 0.0, mode=JoinMode.NODE)
    for at in (0.5, 1.0):  # its cadence: 0.5 s, so its grace is the 1 s floor
        sm.heartbeat("j", 1, 1, at, mode=JoinMode.NODE)
        sm.heartbeat("j", 1, 0, at, mode=JoinMode.NODE)
    sm.detach_stream("j", 1, 1, token, 1.2, mode=JoinMode.NODE, cut=True)
    job = sm.jobs["j"]
    sm.tick(2.1)
    assert job.state is JobState.RUNNING and not job.gen.failed
    sm.tick(2.3)
    assert job.state is JobState.FAILED
    assert sorted(f.rank for f in job.gen.failed) == [2, 3]
    assert job.gen.members[2].state is MemberState.LOST
    (cause,) = {f.cause for f in job.gen.failed}
    assert cause == (
        "node agent's heartbeat stream was cut and not re-attached in 1.1 s (its connection "
        "was reset: a firewall or middlebox between, or the node agent died)"
    )


def test_a_node_dropped_from_a_failed_generation_is_told_what_failed_it() -> None:
    """Its stream cut, the job moved on before it re-attached: its refusal said only
    "the job moved on to generation 2" (h160's d2a_reject_pulse)."""
    sm = RendezvousState(timing=Timing(heartbeat_timeout_s=6.0))
    formed(sm, RING)
    token = sm.attach_stream("j", 1, 1, "b", 0.0, mode=JoinMode.NODE)
    sm.attach_stream("j", 1, 0, "a", 0.0, mode=JoinMode.NODE)
    sm.detach_stream("j", 1, 1, token, 1.0, mode=JoinMode.NODE, cut=True)
    sm.tick(4.0)
    assert sm.jobs["j"].state is JobState.FAILED
    sm.join(node("a2", wire=RING, previous="a"), 4.1)  # the other node re-joins: generation 2 opens
    assert sm.jobs["j"].generation == 2
    f = fault(sm.attach_stream, "j", 1, 1, "b", 4.2, mode=JoinMode.NODE)
    assert f.reason == "STALE_GENERATION"
    assert f.metadata["failed"].startswith(
        "rank 2 on host-b (node agent's heartbeat stream was cut and not re-attached in 3.0 s"
    ), f.metadata
    assert "(generation 1 failed: rank 2 on host-b (node agent's" in f.message, f.message


def test_a_report_while_a_cut_node_may_still_reattach_names_the_cut_node_first() -> None:
    """An agent killed: its workers die with it, and a peer's ring reports them (hearsay)
    while the daemon still waits for the agent's redial. The cut node is the root cause,
    not the reporter's worker, which its report would make it."""
    sm = RendezvousState(timing=Timing(heartbeat_timeout_s=6.0))
    formed(sm, RING)
    token = sm.attach_stream("j", 1, 1, "b", 0.0, mode=JoinMode.NODE)
    sm.attach_stream("j", 1, 0, "a", 0.0, mode=JoinMode.NODE)
    sm.detach_stream("j", 1, 1, token, 1.0, mode=JoinMode.NODE, cut=True)
    sm.report_failure("j", 1, 0, "a", 0, "rank 0: lost rank 3: connection closed", 1.5)
    job = sm.jobs["j"]
    assert job.state is JobState.FAILED
    assert [f.rank for f in job.gen.failed] == [2, 3, 0]
    assert job.gen.failed[0].cause.startswith(
        "node agent's heartbeat stream was cut and not re-attached in 0.5 s"
    )


def test_a_torchrun_nodes_cut_stream_is_lost_at_once() -> None:
    """Nodes that run no ring of ours (torchrun's agents send no wire version) have no
    peer ring to report a killed agent at once: the grace delayed the survivors' push
    (hung workers heard of a killed node 8.0 s after the kill, 2.7 s before), so their
    cut stream is their loss at once, as before the grace."""
    sm = RendezvousState(timing=Timing(heartbeat_timeout_s=6.0))
    formed(sm)
    token = sm.attach_stream("j", 1, 1, "b", 0.0, mode=JoinMode.NODE)
    sm.attach_stream("j", 1, 0, "a", 0.0, mode=JoinMode.NODE)
    sm.detach_stream("j", 1, 1, token, 1.0, mode=JoinMode.NODE, cut=True)
    job = sm.jobs["j"]
    assert job.state is JobState.FAILED
    assert {f.cause for f in job.gen.failed} == {"node agent's heartbeat stream closed"}


def test_node_stream_cut_and_reattached_within_the_grace_is_no_loss() -> None:
    sm = RendezvousState(timing=Timing(heartbeat_timeout_s=6.0))
    formed(sm, RING)
    token = sm.attach_stream("j", 1, 1, "b", 0.0, mode=JoinMode.NODE)
    sm.attach_stream("j", 1, 0, "a", 0.0, mode=JoinMode.NODE)
    sm.detach_stream("j", 1, 1, token, 1.0, mode=JoinMode.NODE, cut=True)
    sm.tick(1.5)
    sm.attach_stream("j", 1, 1, "b", 1.8, mode=JoinMode.NODE)
    sm.heartbeat("j", 1, 0, 2.0, mode=JoinMode.NODE)
    for now in (3.0, 5.0, 6.5):
        sm.heartbeat("j", 1, 1, now - 0.1, mode=JoinMode.NODE)
        sm.heartbeat("j", 1, 0, now - 0.1, mode=JoinMode.NODE)
        sm.tick(now)
    job = sm.jobs["j"]
    assert job.state is JobState.RUNNING and not job.gen.failed


def test_silent_node_is_lost_after_the_heartbeat_timeout() -> None:
    sm = RendezvousState(timing=Timing(heartbeat_timeout_s=3.0))
    formed(sm)
    sm.attach_stream("j", 1, 1, "b", 0.0, mode=JoinMode.NODE)
    sm.heartbeat("j", 1, 0, 2.0, mode=JoinMode.NODE)
    sm.tick(3.5)
    job = sm.jobs["j"]
    assert job.state is JobState.FAILED and {f.rank for f in job.gen.failed} == {2, 3}
    assert {f.cause for f in job.gen.failed} == {"no heartbeat for 3.0 s (node unreachable)"}


def test_time_the_daemon_did_not_run_is_no_nodes_silence() -> None:
    """A daemon stopped (SIGSTOP, a paused VM) past the heartbeat timeout lost every node
    as silent at its first tick, before their queued beats were read, and a standby
    took a healthy node's seat (found by a chaos review). Silence is counted in time
    the daemon ran: a node silent that long while it ran is still lost."""
    sm = RendezvousState(timing=Timing(heartbeat_timeout_s=3.0))
    formed(sm)
    for node, instance in ((0, "a"), (1, "b")):
        sm.attach_stream("j", 1, node, instance, 0.0, mode=JoinMode.NODE)
        sm.heartbeat("j", 1, node, 1.0, mode=JoinMode.NODE)
    sm.stalled(5.0)  # stopped from 1.5 s to 6.5 s
    sm.tick(6.6)
    job = sm.jobs["j"]
    assert job.state is JobState.RUNNING and not job.gen.failed
    sm.heartbeat("j", 1, 0, 6.7, mode=JoinMode.NODE)  # node 1's beats never come
    sm.tick(8.9)
    assert job.state is JobState.RUNNING
    sm.tick(9.1)  # past 1.0 + 5.0 stalled + 3.0 timeout
    assert job.state is JobState.FAILED and {f.rank for f in job.gen.failed} == {2, 3}
    assert {f.cause for f in job.gen.failed} == {"no heartbeat for 3.0 s (node unreachable)"}


def test_a_node_that_never_attached_after_placement_is_lost_as_such() -> None:
    """A stray JoinNode that never heartbeats is worded apart from a silent node, so
    that the other agents re-form without using a restart (recovery.stray)."""
    sm = RendezvousState(timing=Timing(heartbeat_timeout_s=3.0))
    formed(sm)
    sm.attach_stream("j", 1, 0, "a", 0.0, mode=JoinMode.NODE)
    sm.heartbeat("j", 1, 0, 2.0, mode=JoinMode.NODE)
    sm.tick(3.5)
    job = sm.jobs["j"]
    assert job.state is JobState.FAILED and {f.rank for f in job.gen.failed} == {2, 3}
    causes = {f.cause for f in job.gen.failed}
    assert causes == {f"{NEVER_ATTACHED} (none within 3.0 s)"}
    assert stray(list(causes)) and not stray(["no heartbeat for 3.0 s (node unreachable)"])


def test_a_stream_cut_after_the_heartbeat_timeout_of_silence_is_lost_to_the_silence() -> None:
    """The daemon's keepalive ends a silent peer's connection; if that comes before the
    tick, the cause is still the silence, not the cut."""
    sm = RendezvousState(timing=Timing(heartbeat_timeout_s=3.0))
    formed(sm, RING)
    token = sm.attach_stream("j", 1, 1, "b", 0.0, mode=JoinMode.NODE)
    sm.attach_stream("j", 1, 0, "a", 0.0, mode=JoinMode.NODE)
    sm.heartbeat("j", 1, 0, 3.0, mode=JoinMode.NODE)
    sm.detach_stream("j", 1, 1, token, 3.0, mode=JoinMode.NODE)  # silent for the whole timeout
    job = sm.jobs["j"]
    assert job.state is JobState.FAILED and {f.rank for f in job.gen.failed} == {2, 3}
    assert {f.cause for f in job.gen.failed} == {"no heartbeat for 3.0 s (node unreachable)"}


def test_attached_workers_use_barrier_with_member_instance_ids() -> None:
    sm = RendezvousState()
    a, b = formed(sm)
    outs = [
        sm.barrier("j", 1, r, "x", 1, 0.0, instance_id=ids[r % 2])
        for r, ids in (
            (0, a.member_instance_ids),
            (1, a.member_instance_ids),
            (2, b.member_instance_ids),
        )
    ]
    assert all(isinstance(o, Parked) for o in outs)
    assert sm.barrier("j", 1, 3, "x", 1, 0.0, instance_id=b.member_instance_ids[1]) == 1
    f = fault(sm.kv_set, "j", 1, 3, "k", b"v", instance_id=a.member_instance_ids[1])
    assert f.reason == "DUPLICATE_RANK"


def test_a_node_rank_held_in_the_running_generation_is_a_duplicate_not_a_full_world() -> None:
    """A second agent naming a node rank that a node of the running generation holds
    (a relaunch beside its frozen predecessor, or two nodes given one rank) was told
    WORLD_FULL in a fixed-size job, and parked for the next generation in an elastic
    one: either way its agent could not tell that the rank was held, nor by whom."""
    sm = RendezvousState()
    first = join_first(sm, node("a", rank=0))
    assert isinstance(first, Parked)
    assert isinstance(sm.join(node("b", rank=1), 1.0), JoinResult)
    f = fault(sm.join, node("c", rank=0), 2.0)
    assert (f.code, f.reason) == (Code.ALREADY_EXISTS, "DUPLICATE_RANK")
    assert (f.metadata["holder_host"], f.metadata["offending_host"]) == ("host-a", "host-c")
    heard = sm.jobs["j"].gen.nodes["a"].last_seen
    assert f.metadata["holder_heard_ms"] == str(round((2.0 - heard) * 1000))
    assert sm.jobs["j"].state is JobState.RUNNING and sm.jobs["j"].num_nodes == 2
    # The unnamed node ("auto") is a newcomer, whichever rank it would get.
    assert fault(sm.join, node("e"), 2.2).reason == "WORLD_FULL"
    # A node that left holds nothing: not "held by" an agent that is gone; the run is
    # finishing, and a node joining now waits for the next one
    # (test_a_new_run_started_while_the_last_one_finishes_waits_for_its_end).
    sm.leave("j", 1, 0, "a", 2.5, mode=JoinMode.NODE)
    assert isinstance(sm.join(node("c", rank=0), 3.0), Parked)
    # Room to grow: a held rank is still refused; a free one parks for the next round.
    sm2 = RendezvousState()
    join_first(sm2, node("a", lo=1, hi=3, rank=0, last_call=1.0))
    sm2.tick(1.5)
    assert sm2.jobs["j"].state is JobState.RUNNING
    assert fault(sm2.join, node("c", lo=1, hi=3, rank=0), 2.0).reason == "DUPLICATE_RANK"
    assert isinstance(sm2.join(node("d", lo=1, hi=3, rank=1), 2.0), Parked)
    # A single node's agent always names rank 0: a second one finds the world full,
    # which --standby-if-full turns into standing by (review: it was DUPLICATE_RANK).
    one = RendezvousState()
    assert isinstance(join_first(one, node("a", lo=1, hi=1, rank=0)), JoinResult)
    assert one.jobs["j"].state is JobState.RUNNING
    assert fault(one.join, node("b", lo=1, hi=1, rank=0), 2.0).reason == "WORLD_FULL"


def test_a_new_run_started_while_the_last_one_finishes_waits_for_its_end() -> None:
    """The job id run again while its last run finishes (one node left, the other
    still writing its checkpoint): the new run's nodes were refused WORLD_FULL, or
    DUPLICATE_RANK for the rank the finishing node still held. They wait for the old
    run's end instead, untold to its nodes (NODES_WAITING would have them re-form a
    run that is ending), and form the next run; launched before that end, they are no
    late nodes of the ended run. One whose wait ends first hears who still holds it."""
    sm = RendezvousState()
    formed(sm)
    sm.attach_stream("j", 1, 0, "a", 0.0, mode=JoinMode.NODE)
    sm.attach_stream("j", 1, 1, "b", 0.0, mode=JoinMode.NODE)
    sm.leave("j", 1, 0, "a", 1.0, mode=JoinMode.NODE)
    sm.take_effects()
    job = sm.jobs["j"]
    a2 = sm.join(node("a2", rank=0, launched=1.5), 2.0)
    b2 = sm.join(node("b2", rank=1, launched=1.5), 2.0)  # b still holds node_rank 1
    c = sm.join(node("c", launched=1.5), 2.0)
    assert isinstance(a2, Parked) and isinstance(b2, Parked) and isinstance(c, Parked)
    assert not [e for e in sm.take_effects() if isinstance(e, Notify)]
    sm.tick(2.5)
    assert not [e for e in sm.take_effects() if isinstance(e, Notify)]
    f = sm.cancel_wait(c.waiter, 62.0, timed_out=True)
    assert f is not None and (f.code, f.reason) == (Code.DEADLINE_EXCEEDED, "WORLD_INCOMPLETE")
    assert "job 'j' generation 1, the job id's previous run, was still finishing" in f.message
    assert "1 of its 2 node(s) had not left (node 1 on 'host-b')" in f.message
    assert f.metadata["finishing_hosts"] == "host-b"
    sm.leave("j", 1, 1, "b", 63.0, mode=JoinMode.NODE)
    assert job.state is JobState.ENDED
    out = woken(sm)
    assert isinstance(out[a2.waiter], Rejoin) and isinstance(out[b2.waiter], Rejoin)
    # The adapter asks again: the next run forms of the two.
    first = sm.join(node("a2", rank=0, launched=1.5), 63.0)
    assert isinstance(first, JoinResult) and first.id_required and job.generation == 2
    assert isinstance(sm.join(node("a2", rank=0, uid=ID2, launched=1.5), 63.0), Parked)
    assert isinstance(sm.join(node("b2", rank=1, launched=1.5), 63.0), JoinResult)
    assert job.state is JobState.RUNNING and job.num_nodes == 2
    # Formed: its nodes are no more the next run of an ended one.
    assert not job.next_run_nodes
    # The next run may have another shape: checked once this one ended, not refused
    # TOPOLOGY_MISMATCH by the run that is ending.
    other = RendezvousState()
    formed(other)
    other.leave("j", 1, 0, "a", 1.0, mode=JoinMode.NODE)
    wide = other.join(node("wide", lo=3, hi=3, gpus=1), 2.0)
    assert isinstance(wide, Parked)
    other.take_effects()
    other.leave("j", 1, 1, "b", 3.0, mode=JoinMode.NODE)
    assert isinstance(woken(other)[wide.waiter], Rejoin)
    assert isinstance(other.join(node("wide", lo=3, hi=3, gpus=1), 3.0), JoinResult)
    assert (other.jobs["j"].generation, other.jobs["j"].max_nodes) == (2, 3)


def test_scale_up_parks_tells_running_nodes_and_joins_next_generation() -> None:
    sm = RendezvousState()
    first = join_first(sm, node("a", lo=1, hi=3, last_call=1.0))
    assert isinstance(first, Parked)
    sm.tick(1.5)
    assert sm.jobs["j"].state is JobState.RUNNING and sm.jobs["j"].num_nodes == 1
    sm.attach_stream("j", 1, 0, "a", 1.5, mode=JoinMode.NODE)
    sm.take_effects()
    parked = sm.join(node("c", lo=1, hi=3, last_call=1.0), 2.0)
    assert isinstance(parked, Parked)
    notes = [e for e in sm.take_effects() if isinstance(e, Notify)]
    assert notes[0].kind is EventKind.NODES_WAITING and notes[0].nodes_waiting == 1
    sm.abort("j", 1, "scale-up", 3.0)
    assert isinstance(woken(sm)[parked.waiter], Rejoin)
    # the adapter asks again: c opens generation 2 and is node 0 of it
    again = sm.join(node("c", lo=1, hi=3, last_call=1.0), 3.0)
    assert isinstance(again, JoinResult) and again.id_required and again.generation == 2
    fault(sm.join, node("c", lo=1, hi=3, uid=ID, last_call=1.0), 3.0)  # ID used in gen 1
    assert isinstance(sm.join(node("c", lo=1, hi=3, uid=ID2, last_call=1.0), 3.0), Parked)


def test_a_scale_up_node_timing_out_hears_the_job_kept_running_and_leaves_it_alone() -> None:
    """A node parked for the next generation of a running elastic job, whose wait
    ends while the running nodes never re-formed to take it in: it hears why (the job
    kept running short of max_nodes), it is no longer counted as waiting (the running
    nodes are told so), and the running generation is untouched."""
    sm = RendezvousState()
    join_first(sm, node("a", lo=1, hi=3, last_call=1.0))
    sm.tick(1.5)
    job = sm.jobs["j"]
    assert job.state is JobState.RUNNING and job.num_nodes == 1
    sm.attach_stream("j", 1, 0, "a", 1.5, mode=JoinMode.NODE)
    parked = sm.join(node("c", lo=1, hi=3, last_call=1.0), 2.0)
    assert isinstance(parked, Parked)
    assert job.scaleup_waiters == {parked.waiter: "c"}
    sm.take_effects()
    f = sm.cancel_wait(parked.waiter, 62.0, timed_out=True)
    assert f is not None
    assert (f.code, f.reason) == (Code.DEADLINE_EXCEEDED, "WORLD_INCOMPLETE")
    assert "job 'j' generation 1 kept running with 1 of max_nodes=3 nodes" in f.message
    assert "for 60.0 s" in f.message and "did not end it to take this node in" in f.message
    assert f.metadata["job_id"] == "j" and f.metadata["generation"] == "1"
    # no longer parked, nor counted: the running node hears that none waits now
    assert job.scaleup_waiters == {} and parked.waiter not in sm.calls.waiting
    effects = sm.take_effects()
    notes = [(e.kind, e.nodes_waiting) for e in effects if isinstance(e, Notify)]
    assert notes == [(EventKind.NODES_WAITING, 0)]
    assert not [e for e in effects if isinstance(e, (Wake, Transition))]
    # the running generation goes on as it was
    assert job.state is JobState.RUNNING and job.generation == 1 and job.num_nodes == 1
    assert set(job.gen.nodes) == {"a"} and not job.gen.failed
    sm.heartbeat("j", 1, 0, 62.0, mode=JoinMode.NODE)
    sm.tick(62.5)
    assert job.state is JobState.RUNNING and job.generation == 1


def test_node_timing_out_while_forming_frees_its_slot() -> None:
    sm = RendezvousState()
    first = join_first(sm, node("a", lo=3, hi=3))
    assert isinstance(first, Parked)
    f = sm.cancel_wait(first.waiter, 10.0, timed_out=True)
    assert f is not None and f.reason == "WORLD_INCOMPLETE" and "min_nodes=3" in f.message
    assert not sm.jobs["j"].gen.nodes and sm.jobs["j"].gen.unique_id is None


def test_node_dying_while_forming_fails_the_others() -> None:
    sm = RendezvousState()
    first = join_first(sm, node("a", lo=3, hi=3))
    other = sm.join(node("b", lo=3, hi=3), 1.0)
    assert isinstance(first, Parked) and isinstance(other, Parked)
    assert sm.cancel_wait(other.waiter, 2.0, timed_out=False) is None
    got = woken(sm)[first.waiter]
    assert isinstance(got, RendezvousFault) and got.reason == "PEER_FAILED"
    assert "host-b" in got.message


def test_bounds_mismatch_while_forming_fails_the_generation() -> None:
    sm = RendezvousState()
    first = join_first(sm, node("a", lo=2, hi=4))
    f = fault(sm.join, node("b", lo=2, hi=3), 1.0)
    assert f.reason == "TOPOLOGY_MISMATCH" and "2:4" in f.message and "2:3" in f.message
    assert (
        "the node agent on host 'host-b'" in f.message and "(hosts so far: 'host-a')" in f.message
    )
    assert f.metadata["topology"] == "2:4x2" and f.metadata["requested_topology"] == "2:3x2"
    assert f.metadata["offending_host"] == "host-b" and f.metadata["hosts"] == "host-a"
    # Only the node counts differ: the fix names only --nnodes (torchrun's agents,
    # nodes of one rank each, may differ in --nproc-per-node).
    assert "the same --nnodes (MIN:MAX): fix it" in f.message, f.message
    assert f.metadata["job_id"] == "j" and f.metadata["generation"] == "1"
    assert isinstance(first, Parked)
    assert isinstance(woken(sm)[first.waiter], RendezvousFault)


def test_a_gpus_per_node_mismatch_names_nproc_per_node_too() -> None:
    sm = RendezvousState()
    join_first(sm, node("a", lo=2, hi=2))
    f = fault(sm.join, node("b", lo=2, hi=2, gpus=4), 1.0)
    assert f.reason == "TOPOLOGY_MISMATCH"
    assert "the same --nnodes and --nproc-per-node" in f.message, f.message


def test_node_leave_leaves_every_member_and_ends_the_job() -> None:
    sm = RendezvousState()
    formed(sm)
    sm.leave("j", 1, 0, "a", 1.0, mode=JoinMode.NODE)
    assert sm.jobs["j"].state is JobState.RUNNING
    sm.leave("j", 1, 1, "b", 1.0, mode=JoinMode.NODE)
    assert sm.jobs["j"].state is JobState.ENDED


def test_a_generation_opened_after_the_job_ended_says_how_long_ago_while_it_forms() -> None:
    """A node joining after every member left opens the next generation, a new run:
    a pod restarted after its job succeeded waited out its join timeout there for
    nodes that were done, and nothing told it why. GetJob says when the run ended,
    while the new one forms; not after one that failed (its nodes restart too)."""
    sm = RendezvousState()
    formed(sm)
    sm.leave("j", 1, 0, "a", 1.0, mode=JoinMode.NODE)
    sm.leave("j", 1, 1, "b", 2.0, mode=JoinMode.NODE)
    assert sm.jobs["j"].state is JobState.ENDED
    assert sm.view("j", 3.0).previous_run_ended_s is None
    assert isinstance(sm.join(node("late"), 12.0), JoinResult)  # node 0: asked for the id
    assert sm.jobs["j"].generation == 2 and sm.jobs["j"].state is JobState.FORMING
    assert sm.view("j", 14.5).previous_run_ended_s == 12.5
    assert isinstance(sm.join(node("late", uid=ID2), 15.0), Parked)
    sm.join(node("other"), 15.0)
    assert sm.jobs["j"].state is JobState.RUNNING
    assert sm.view("j", 16.0).previous_run_ended_s is None  # formed: not a stray run
    # After a failure, the next generation is the same run re-forming.
    sm.report_failure("j", 2, 0, "late", 1, "exit code 3", 17.0)
    assert sm.jobs["j"].state is JobState.FAILED
    sm.join(node("late2", previous="late"), 18.0)  # its agent re-joining
    assert sm.jobs["j"].generation == 3 and sm.jobs["j"].state is JobState.FORMING
    assert sm.view("j", 19.0).previous_run_ended_s is None


def test_a_node_whose_own_goodbye_ended_the_run_is_no_late_node_when_it_rejoins() -> None:
    """A re-join says when its agent was launched: a node dropped from its run (lost)
    that the others finished is refused JOB_ENDED. One whose own goodbye ended the run
    (its agent left after a worker's failure it could not report) is not: refused, its
    launcher exited 0 for a failed run (review). It opens a new run, as before."""
    sm = RendezvousState()
    formed(sm)
    sm.leave("j", 1, 0, "a", 1.0, mode=JoinMode.NODE)
    sm.leave("j", 1, 1, "b", 2.0, mode=JoinMode.NODE)
    job = sm.jobs["j"]
    assert job.state is JobState.ENDED and job.ended_leavers == {"a", "b"}
    dropped = fault(sm.join, node("c", launched=0.0, previous="gone"), 3.0)
    assert dropped.reason == "JOB_ENDED"
    out = sm.join(node("a2", launched=0.0, previous="a"), 3.0)
    assert isinstance(out, JoinResult) and job.generation == 2


def test_a_node_launched_before_its_jobs_run_ended_is_told_the_job_ended() -> None:
    """A node agent launched while the job still ran, whose first join comes after
    every member left (a slow pod of a short job, one rescheduled mid-run, a scale-up),
    was meant for the run that ended: JOB_ENDED, instead of opening the job's
    next generation and waiting its join timeout there for nodes that were done. A
    node launched after the end, or one that does not say when it was launched, is a
    new run of the job id; a late node of the old run is refused while that new run
    forms as well, but not once the daemon restarted (the end's time is not stored)."""
    sm = RendezvousState()
    formed(sm)
    sm.leave("j", 1, 0, "a", 1.0, mode=JoinMode.NODE)
    sm.leave("j", 1, 1, "b", 2.0, mode=JoinMode.NODE)
    job = sm.jobs["j"]
    assert job.state is JobState.ENDED
    f = fault(sm.join, node("late", launched=1.5), 12.0)
    assert (f.code, f.reason) == (Code.FAILED_PRECONDITION, "JOB_ENDED")
    assert "job 'j' ended 10.0 s ago (every member left), after this node was launched " in (
        f.message
    )
    assert "(10.5 s ago): it was launched for the run that ended" in f.message
    assert f.metadata["ended_ms_ago"] == "10000"
    # A standby launched before the end hears the same at once, not after its wait.
    assert fault(sm.join, node("spare", launched=0.0, standby=True), 12.0).reason == "JOB_ENDED"
    assert job.state is JobState.ENDED and job.generation == 1  # nothing opened
    # Launched after the end, or not saying: a new run, as before.
    assert isinstance(sm.join(node("rerun", launched=2.5), 13.0), JoinResult)
    assert job.generation == 2 and job.state is JobState.FORMING
    # The old run's late node is refused while the new run forms, its own join isn't.
    assert fault(sm.join, node("late", launched=1.9), 14.0).reason == "JOB_ENDED"
    assert isinstance(sm.join(node("rerun", uid=ID2, launched=2.5), 14.0), Parked)
    assert isinstance(sm.join(node("unsaid"), 15.0), JoinResult)
    assert job.state is JobState.RUNNING
    # Formed, the new run is not "the generation opened after the end": a late node of
    # the old run is any other joiner there (this world is full).
    assert fault(sm.join, node("late", launched=1.9), 16.0).reason == "WORLD_FULL"


def test_after_a_restart_a_job_that_had_ended_is_run_again_by_any_node(tmp_path: Path) -> None:
    """The time of a job's end is not stored: after a daemon restart a node that says
    it was launched long ago opens a new run, as every join did before it could say."""
    sm = RendezvousState()
    formed(sm)
    sm.leave("j", 1, 0, "a", 1.0, mode=JoinMode.NODE)
    sm.leave("j", 1, 1, "b", 2.0, mode=JoinMode.NODE)
    back = restarted(sm, tmp_path)
    job = back.jobs["j"]
    assert job.state is JobState.ENDED and job.ended_at is None
    assert isinstance(back.join(node("late", launched=-1e6), job.state_since + 1), JoinResult)
    assert job.generation == 2 and job.state is JobState.FORMING


def test_formed_node_job_survives_a_restart_and_nodes_reattach(tmp_path: Path) -> None:
    sm = RendezvousState()
    _, b = formed(sm)
    sm.kv_set("j", 1, 2, "k", b"v", instance_id=b.member_instance_ids[0])
    back = restarted(sm, tmp_path)
    job = back.jobs["j"]
    assert job.state is JobState.RUNNING and job.gen.join_mode is JoinMode.NODE
    assert (job.min_nodes, job.max_nodes, job.num_nodes) == (2, 2, 2)
    restored = job.gen.node_at[0].last_seen  # the restore's clock: a full timeout to reattach
    # A restored node counts as attached once (it may have been before the restart).
    assert back.attach_stream("j", 1, 1, "b", restored, mode=JoinMode.NODE) == 2
    assert back.kv_get("j", 1, 3, "k", False, 1.0, instance_id=b.member_instance_ids[1]) == b"v"
    timeout = back.timing.heartbeat_timeout_s
    back.heartbeat("j", 1, 1, restored + timeout, mode=JoinMode.NODE)
    # Node a never reattached (it died while the daemon was down, say): its silence
    # counts from the restore, as docs/operations.md says (the daemon's downtime is no
    # member's silence), so it is lost one timeout after the restore, not before.
    back.tick(restored + timeout - 0.5)
    assert job.state is JobState.RUNNING
    back.tick(restored + timeout + 0.5)
    assert job.state is JobState.FAILED and {f.rank for f in job.gen.failed} == {0, 1}
    # A silence, not a stray that never attached: the other agents count it.
    assert all(f.cause.startswith("no heartbeat for") for f in job.gen.failed)
    # node b retrying its JoinNode hears why the generation ended
    f = fault(back.join, node("b"), restored + timeout + 1)
    assert f.reason == "PEER_FAILED"


def test_a_node_stream_attaching_after_a_node_parked_hears_nodes_waiting() -> None:
    sm = RendezvousState()
    join_first(sm, node("a", lo=1, hi=2, last_call=0.05))
    sm.tick(0.1)
    assert isinstance(sm.join(node("c", lo=1, hi=2, last_call=0.05), 0.2), Parked)
    sm.take_effects()
    sm.attach_stream("j", 1, 0, "a", 0.3, mode=JoinMode.NODE)
    notes = [e for e in sm.take_effects() if isinstance(e, Notify)]
    assert [(n.kind, n.to, n.nodes_waiting) for n in notes] == [(EventKind.NODES_WAITING, (0,), 1)]


def three_elastic(sm: RendezvousState) -> dict[str, int]:
    """a, b, c formed with --nnodes 2:3 and a 5 s last call, streams attached;
    instance -> node rank and stream token."""
    first = join_first(sm, node("a", lo=2, hi=3))
    assert isinstance(first, Parked)
    assert isinstance(sm.join(node("b", lo=2, hi=3), 0.0), Parked)
    assert isinstance(sm.join(node("c", lo=2, hi=3), 0.0), JoinResult)  # max: at once
    job = sm.jobs["j"]
    ranks = {inst: job.gen.nodes[inst].node_rank for inst in "abc"}
    tokens = {
        inst: sm.attach_stream("j", 1, r, inst, 0.0, mode=JoinMode.NODE)
        for inst, r in ranks.items()
    }
    sm.take_effects()
    return {inst: tokens[inst] for inst in "abc"} | {f"{i}-rank": r for i, r in ranks.items()}


def sdk_join(sm: RendezvousState, args: JoinArgs, now: float) -> object:
    """A join as the SDK makes it: asked for the id (its node ranks first of those
    seated so far), it joins again with one, fresh for each node (a dropped id is not
    taken again)."""
    out = sm.join(args, now)
    if isinstance(out, JoinResult) and out.id_required:
        fresh = hashlib.sha256(args.instance_id.encode()).digest() * 4
        out = sm.join(replace(args, unique_id=fresh), now)
    return out


def back(sm: RendezvousState, inst: str, now: float) -> object:
    """``rejoin`` as the SDK makes it (``sdk_join``)."""
    return sdk_join(sm, node(inst, lo=2, hi=3, previous=inst[0]), now)


def rejoin(sm: RendezvousState, inst: str, now: float, uid: bytes = b"") -> object:
    """``inst`` ("a2"), the re-join of node "a" of ``three_elastic``, naming the seat
    it held as the SDK does."""
    return sm.join(node(inst, lo=2, hi=3, uid=uid, previous=inst[0]), now)


def test_survivors_of_a_lost_node_form_without_waiting_out_the_last_call() -> None:
    sm = RendezvousState()
    nodes = three_elastic(sm)
    sm.detach_stream("j", 1, nodes["c-rank"], nodes["c"], 1.0, mode=JoinMode.NODE)  # c's agent died
    assert sm.jobs["j"].state is JobState.FAILED
    # The survivors' streams end after PEER_FAILED: not a loss of theirs.
    sm.detach_stream("j", 1, nodes["b-rank"], nodes["b"], 1.1, mode=JoinMode.NODE)
    assert [f.rank // 2 for f in sm.jobs["j"].gen.failed] == [nodes["c-rank"]] * 2
    # a comes back first (node 0: asked for the id), alone it waits for b...
    asked = rejoin(sm, "a2", 2.0)
    assert isinstance(asked, JoinResult) and asked.id_required and asked.generation == 2
    assert isinstance(rejoin(sm, "a2", 2.0, ID2), Parked)
    sm.tick(2.5)
    assert sm.jobs["j"].state is JobState.FORMING
    # ...and forms the moment b, the last survivor, is back: 5 s before the last call.
    out = rejoin(sm, "b2", 3.0)
    assert isinstance(out, JoinResult) and out.num_nodes == 2
    assert sm.jobs["j"].state is JobState.RUNNING


def test_after_a_clean_end_a_relaunch_still_waits_the_last_call() -> None:
    sm = RendezvousState()
    nodes = three_elastic(sm)
    for inst in "abc":
        sm.leave("j", 1, nodes[f"{inst}-rank"], inst, 1.0, mode=JoinMode.NODE)
    assert sm.jobs["j"].state is JobState.ENDED
    assert rejoin(sm, "a2", 2.0).id_required  # type: ignore[attr-defined]
    assert isinstance(rejoin(sm, "a2", 2.0, ID2), Parked)
    assert isinstance(rejoin(sm, "b2", 2.0), Parked)
    sm.tick(6.9)  # a third node may still come: nobody was expected back
    assert sm.jobs["j"].state is JobState.FORMING
    sm.tick(7.1)
    assert sm.jobs["j"].state is JobState.RUNNING and sm.jobs["j"].num_nodes == 2


def test_a_node_rank_held_by_another_agent_is_refused_with_both_hosts() -> None:
    sm = RendezvousState()
    join_first(sm, node("a", rank=0))
    f = fault(sm.join, node("b", rank=0), 1.0)
    assert f.code is Code.ALREADY_EXISTS and f.reason == "DUPLICATE_RANK"
    assert "node_rank=0" in f.message and "host-a" in f.message
    assert f.metadata["node_rank"] == "0" and f.metadata["holder_host"] == "host-a"
    assert f.metadata["offending_host"] == "host-b"
    assert set(sm.jobs["j"].gen.nodes) == {"a"}  # the refused node took no seat
    # Forming: the holder's join waits, with no heartbeat yet to tell a live twin from a
    # frozen one, so the refusal says nothing of when it was heard (an agent on another
    # host gives up at once rather than wait out the join's timeout for a live twin).
    assert sm.jobs["j"].state is JobState.FORMING and "holder_heard_ms" not in f.metadata
    # --nnodes >= 2 needs a node rank: the hint names both ways to give one.
    assert "give each node a distinct --node-rank (0..1), or --node-rank auto" in f.message
    assert "(or none)" not in f.message


@pytest.mark.parametrize("running", [False, True])
def test_a_node_beyond_max_nodes_is_refused_world_full(running: bool) -> None:
    sm = RendezvousState()
    if running:
        join_first(sm, node("a", lo=1, hi=2))
    else:  # node 0 has not given the id yet: the generation is still forming
        assert isinstance(sm.join(node("a", lo=1, hi=2), 0.0), JoinResult)
    sm.join(node("b", lo=1, hi=2), 0.0)
    assert sm.jobs["j"].state is (JobState.RUNNING if running else JobState.FORMING)
    f = fault(sm.join, node("c", lo=1, hi=2), 2.0)
    assert f.code is Code.RESOURCE_EXHAUSTED and f.reason == "WORLD_FULL"
    assert "max_nodes=2" in f.message and "'host-c'" in f.message
    assert f.metadata["max_nodes"] == "2" and f.metadata["offending_host"] == "host-c"


def test_node_table_keeps_its_lookups_in_step_with_its_nodes() -> None:
    """The O(1) lookups every JoinNode makes (a named rank's holder, the earliest
    arrival that named none) follow adds, replacements, removals and a reset."""
    from rendezvousd.state.job import Node, NodeTable

    def node(iid: str, rank: int | None, t: float) -> Node:
        return Node(iid, f"h-{iid}", (), rank or 0, rank is not None, t)

    table = NodeTable()
    table["a"] = node("a", None, 1.0)
    table["b"] = node("b", 3, 2.0)
    table["c"] = node("c", None, 3.0)
    assert table.first_unnamed() is table["a"] and table.named_at[3] is table["b"]
    table.pop("a", None)
    assert table.first_unnamed() is table["c"]
    table["b"] = node("b", None, 4.0)  # the same instance again, now unnamed
    assert 3 not in table.named_at and list(table.unnamed) == ["c", "b"]
    del table["c"]
    assert table.first_unnamed() is table["b"]
    assert table.pop("missing", None) is None
    table.clear()
    assert not table and not table.named_at and table.first_unnamed() is None


def test_nodes_parking_one_by_one_make_few_nodes_waiting_events() -> None:
    """The first parked node is told at once; a burst of them is coalesced into the
    latest count at the next tick, not one event each (200 parks made 200 events)."""
    sm = RendezvousState()
    join_first(sm, node("a", lo=1, hi=300, gpus=1, last_call=0.05))
    sm.tick(0.1)
    assert sm.jobs["j"].state is JobState.RUNNING
    sm.take_effects()
    for i in range(200):
        out = sm.join(node(f"n{i}", lo=1, hi=300, gpus=1, last_call=0.05), 1.0 + i / 1000)
        assert isinstance(out, Parked)
    told = [e.nodes_waiting for e in sm.take_effects() if isinstance(e, Notify)]
    assert told == [1]
    sm.tick(1.6)
    told = [e.nodes_waiting for e in sm.take_effects() if isinstance(e, Notify)]
    assert told == [200]
    sm.tick(2.6)  # nothing changed: nothing told
    assert not [e for e in sm.take_effects() if isinstance(e, Notify)]


def test_node_zero_that_never_sends_the_id_frees_its_seat_at_its_capped_wait() -> None:
    """The one id-holder path: node 0 answered id_required is held to its JoinNode's
    wait capped by max_wait_s, as rank 0 is, and its overdue seat is worded alike."""
    sm = RendezvousState(timing=Timing(max_wait_s=10.0, job_ttl_s=600.0))
    out = sm.join(node("a"), 0.0)  # asks for a 60 s wait
    assert isinstance(out, JoinResult) and out.id_required
    assert isinstance(sm.join(node("b"), 0.1), Parked)
    sm.take_effects()
    sm.tick(9.0)
    assert "a" in sm.jobs["j"].gen.nodes  # not yet
    sm.tick(10.5)
    job = sm.jobs["j"]
    assert "a" not in job.gen.nodes and job.state is JobState.FORMING
    effects = sm.take_effects()
    # b became node 0: its parked JoinNode is asked for the id instead.
    asked = [e.value for e in effects if isinstance(e, Wake)]
    assert len(asked) == 1 and isinstance(asked[0], JoinResult) and asked[0].id_required
    assert any(
        isinstance(e, Transition) and "node agent on host-a did not publish" in e.detail
        for e in effects
    )


@pytest.mark.parametrize("stray", ["other-nnodes", "per-rank"])
def test_a_stray_join_while_seats_are_kept_is_refused_alone_and_the_bounds_stand(
    stray: str, tmp_path: Path
) -> None:
    """Node b is lost; the next generation keeps a's seat, and before a is back a join
    of another kind arrives under the job id. It set the generation's bounds as its
    first joiner: a JoinNode of --nnodes 1 (refused WORLD_FULL, a's seat kept) left
    seats kept past max_nodes=1, a row the next daemon start refused to load; a
    per-rank Join took the generation over, and a was refused JOIN_MODE_MISMATCH (a
    model-based fuzz of the state machine)."""
    sm = RendezvousState()
    formed(sm)
    stream = sm.attach_stream("j", 1, 1, "b", 0.1, mode=JoinMode.NODE)
    sm.detach_stream("j", 1, 1, stream, 0.2, mode=JoinMode.NODE)  # b lost
    if stray == "other-nnodes":
        f = fault(sm.join, node("x", lo=1, hi=1), 0.3)
        assert f.reason == "TOPOLOGY_MISMATCH", f
    else:
        f = fault(sm.join, JoinArgs.worker("j", 1, 1, None, 0, "w", "", b"", "W"), 0.3)
        assert f.reason == "JOIN_MODE_MISMATCH", f
    job = sm.jobs["j"]
    assert (job.state, job.min_nodes, job.max_nodes, job.gpus_per_node) == (
        JobState.FORMING,
        2,
        2,
        2,
    )
    assert restarted(sm, tmp_path).jobs["j"].max_nodes == 2  # the row loads
    sm.join(node("a2", previous="a"), 0.4)  # a takes its kept seat
    assert len(sm.jobs["j"].gen.nodes) == 1


def test_a_closed_run_refuses_the_nodes_launched_before_the_close_when_they_re_join() -> None:
    """AbortJob with ``close`` (a torchrun agent out of restarts, whose round the others
    cannot form without it) on a generation that already failed: an abort alone leaves
    it as it is, and a survivor re-joining later opened the next generation and
    waited its join timeout there. Closed, a node agent launched before the close is
    refused JOB_ABORTED with the reason, at once, while that generation is the job's
    or the next one forms; one launched after it is a new run, as is one that does
    not say when it was launched, and a plain abort closes nothing."""
    sm = RendezvousState()
    formed(sm)
    sm.report_failure("j", 1, 1, "b", 1, "exit code -9", 1.0)
    job = sm.jobs["j"]
    assert job.state is JobState.FAILED
    # Node b's agent stops (no restarts left): no seat kept for it.
    sm.leave("j", 1, 1, "b", 1.5, mode=JoinMode.NODE, final=True)
    # A plain abort of the failed generation: nothing changes, nobody refused.
    assert sm.abort("j", 1, "not a close", 2.0) == 1
    assert job.state is JobState.FAILED and job.closed is None
    assert sm.abort("j", 1, "closed: node a stopped", 3.0, close=True) == 1
    assert job.state is JobState.FAILED and job.generation == 1  # the failure stands
    f = fault(sm.join, node("a2", previous="a", launched=0.5), 10.0)
    assert (f.code, f.reason) == (Code.ABORTED, "JOB_ABORTED")
    assert f.message == (
        "job 'j' was closed 7.0 s ago, after this node was launched (9.5 s ago): "
        "closed: node a stopped"
    )
    assert f.metadata["reason"] == "closed: node a stopped"
    assert job.generation == 1 and job.state is JobState.FAILED  # nothing opened
    # A standby of that run hears it at once too, not after its wait.
    assert fault(sm.join, node("spare", launched=2.9, standby=True), 11.0).reason == "JOB_ABORTED"
    # Launched after the close: a new run, which a node of the old one may not join.
    new = sm.join(node("new", launched=3.5), 12.0)
    assert isinstance(new, (JoinResult, Parked))
    assert job.generation == 2 and job.state is JobState.FORMING
    assert fault(sm.join, node("a2", previous="a", launched=0.5), 13.0).reason == "JOB_ABORTED"
    # One that does not say when it was launched is not refused either.
    assert launched_before_close(job, node("unsaid"), 14.0) is None
    assert launched_before_close(job, node("a2", previous="a", launched=0.5), 14.0) is not None


def test_a_closed_run_s_next_generation_keeps_no_seat_for_its_nodes() -> None:
    """After a close, the next generation is a new run: the old run's nodes are refused
    as closed, so it keeps no seat for them. It kept one for each node of the closed
    round for a seat hold (the survivor's), and the new run's second node was refused
    WORLD_FULL meanwhile; a plain abort still keeps them."""
    for close in (True, False):
        sm = RendezvousState()
        formed(sm)
        sm.report_failure("j", 1, 1, "b", 1, "exit code -9", 1.0)
        sm.leave("j", 1, 1, "b", 1.5, mode=JoinMode.NODE, final=True)
        sm.abort("j", 1, "closed: node b stopped", 2.0, close=close)
        first = sm.join(node("new1", launched=3.0), 3.0)  # within the seat hold
        assert isinstance(first, (JoinResult, Parked))
        job = sm.jobs["j"]
        assert job.generation == 2 and job.state is JobState.FORMING
        if close:
            second = sm.join(node("new2", launched=3.0), 3.1)
            assert isinstance(second, (JoinResult, Parked))
            assert len(job.gen.nodes) == 2
            assert not job.gen.owed and job.gen.rejoin_expected == 0
        else:
            assert set(job.gen.owed) == {"a"}  # the survivor's seat, for the hold
            assert fault(sm.join, node("new2", launched=3.0), 3.1).reason == "WORLD_FULL"


def test_a_close_of_a_forming_generation_aborts_it_and_refuses_its_late_nodes() -> None:
    """The close the torchrun agent made before (a survivor had re-joined first): the
    forming generation is aborted, its parked joins told, and a node of the run
    launched before that re-joins later is refused too (it opened generation 3)."""
    sm = RendezvousState()
    formed(sm)
    sm.report_failure("j", 1, 1, "b", 1, "exit code -9", 1.0)
    parked = sm.join(node("a2", previous="a", launched=0.0), 2.0)
    assert isinstance(parked, JoinResult) and parked.id_required
    job = sm.jobs["j"]
    assert job.generation == 2 and job.state is JobState.FORMING
    sm.abort("j", 2, "closed: node b stopped", 3.0, close=True)
    assert job.state is JobState.ABORTED
    assert fault(sm.join, node("c", launched=0.1), 9.0).reason == "JOB_ABORTED"
    assert job.generation == 2


def test_a_node_lost_to_its_cut_join_joins_the_next_generation_when_it_comes_back() -> None:
    """Its JoinNode's cancel (a connection blip) read as its death failed the forming
    generation; the same join re-sent (the SDK's retry, or gRPC's) was answered that
    generation's PEER_FAILED, naming the node itself by host alone (torchrun's handler
    listed "the node joining from <its own host>" as a node to replace). A lost node
    is not a returning one: the join opens the next generation."""
    sm = RendezvousState()
    first = join_first(sm, node("a"))
    assert isinstance(first, Parked)
    sm.cancel_wait(first.waiter, 1.0, timed_out=False)
    assert sm.jobs["j"].state is JobState.FAILED
    again = sm.join(node("a"), 2.0)
    assert isinstance(again, JoinResult) and again.id_required  # node 0 of the next one
    job = sm.jobs["j"]
    assert (job.generation, job.state, list(job.gen.nodes)) == (2, JobState.FORMING, ["a"])


def test_a_join_deadline_names_the_nodes_joined_and_the_missing_node_rank() -> None:
    """Nodes 0 and 2 of three came, node 1 never did (an operator review, D5): the
    forming view lists both with their hosts and says node rank 1 is missing; node 0's
    deadline names both and node 1; node 2's, 0.5 s later, says node 0 came and its own
    wait ended first, where it read "needs min_nodes=3 and node 0's id" (node 0's seat
    freed by its own deadline read as node 0 missing)."""
    sm = RendezvousState()
    sm.join(node("a", lo=3, hi=3, rank=0), 0.0)
    zero = sm.join(node("a", lo=3, hi=3, rank=0, uid=ID), 0.0)
    two = sm.join(node("c", lo=3, hi=3, rank=2), 0.5)
    assert isinstance(zero, Parked) and isinstance(two, Parked)
    view = sm.view("j", 1.0)
    assert [(n.node_rank, n.host, n.instance_tag) for n in view.joining] == [
        (0, "host-a", instance_tag("a")),
        (2, "host-c", instance_tag("c")),
    ]
    # The instance id is the seat's secret: inspection shows a tag of it, never it.
    assert instance_tag("a") == hashlib.sha256(b"a").hexdigest()[:8] != "a"
    assert (view.missing_node_ranks, view.nodes_needed, view.min_nodes) == ((1,), 1, 3)
    first = sm.cancel_wait(zero.waiter, 40.0, timed_out=True)
    assert first is not None and first.reason == "WORLD_INCOMPLETE"
    assert "2 node(s) joined of the min_nodes=3 it needs (node 0 on host-a, node 2 on host-c)" in (
        first.message
    )
    assert "no node agent joined as node 1: start it (rendezvous-run --node-rank 1)" in (
        first.message
    )
    assert first.metadata["missing_node_ranks"] == "1"
    second = sm.cancel_wait(two.waiter, 40.5, timed_out=True)
    assert second is not None and second.reason == "WORLD_INCOMPLETE"
    assert "node 0's id" not in second.message, second.message
    assert (
        "1 node(s) joined of the min_nodes=3 it needs (node 2 on host-c); node 0 on host-a "
        "joined too, but its own wait ended at its deadline 0.500 s before this one, before "
        "the generation formed; no node agent joined as node 1:"
    ) in second.message, second.message


def test_an_elastic_join_deadline_counts_the_nodes_still_needed() -> None:
    """Nodes that name no rank take any free one: what is missing is a count, and a
    node that came but whose wait ended first is not counted as missing."""
    sm = RendezvousState()
    first = join_first(sm, node("a", lo=3, hi=4))
    other = sm.join(node("b", lo=3, hi=4), 1.0)
    assert isinstance(first, Parked) and isinstance(other, Parked)
    view = sm.view("j", 2.0)
    assert [(n.node_rank, n.host) for n in view.joining] == [(None, "host-a"), (None, "host-b")]
    assert (view.missing_node_ranks, view.nodes_needed, view.min_nodes) == (None, 1, 3)
    f = sm.cancel_wait(first.waiter, 60.0, timed_out=True)
    assert f is not None
    assert "2 node(s) joined of the min_nodes=3 (up to 4) it needs (a node on host-a, a node " \
        "on host-b); 1 more node(s) never joined" in f.message, f.message  # fmt: skip
    # b is node 0 now: asked for the id, it joins again with one, and waits on.
    assert isinstance(woken(sm).get(other.waiter), JoinResult)
    again = sm.join(node("b", lo=3, hi=4, uid=ID2), 61.0)
    assert isinstance(again, Parked)
    f = sm.cancel_wait(again.waiter, 100.0, timed_out=True)
    assert f is not None
    assert "a node on host-a joined too, but its own wait ended" in f.message, f.message
    assert "1 more node(s) never joined" in f.message, f.message


def test_nodes_that_all_came_but_not_within_one_anothers_waits_are_told_so() -> None:
    """Node 0 waited out its join before nodes 1 and 2 came: nothing is missing but
    the overlap, and node 1's deadline says so rather than naming a node to start."""
    sm = RendezvousState()
    sm.join(node("a", lo=3, hi=3, rank=0), 0.0)
    zero = sm.join(node("a", lo=3, hi=3, rank=0, uid=ID), 0.0)
    assert isinstance(zero, Parked)
    assert sm.cancel_wait(zero.waiter, 40.0, timed_out=True) is not None
    one = sm.join(node("b", lo=3, hi=3, rank=1), 50.0)
    two = sm.join(node("c", lo=3, hi=3, rank=2), 51.0)
    assert isinstance(one, Parked) and isinstance(two, Parked)
    assert sm.view("j", 52.0).missing_node_ranks == (0,)
    f = sm.cancel_wait(one.waiter, 90.0, timed_out=True)
    assert f is not None
    assert "node 0 on host-a joined too, but its own wait ended at its deadline 50.000 s " \
        "before this one" in f.message, f.message  # fmt: skip
    assert "every node the job needs came, but not within one another's waits: start them " \
        "within one wait (40.0 s here) of each other, or raise it (rendezvous-run: " \
        "--join-timeout-s for a node's first join, --rejoin-timeout-s after a failure)" \
        in f.message, f.message  # fmt: skip
    assert "no node agent joined as" not in f.message, f.message


def test_a_node_that_joins_again_after_its_own_wait_ended_is_one_node_not_two() -> None:
    """h122 D2: a lone node of a 2:3 job waited out its join, then joined again (its
    agent's restart, a new instance id): that re-join's deadline said "every node the
    job needs came, but not within one another's waits" (its own earlier join counted
    as a second node). The agent's id links the two: one node came, one never did."""
    sm = RendezvousState()

    def seated(inst: str, uid: bytes, now: float) -> Parked:
        # A lone node is node 0: asked for the id, it joins again with one and waits.
        ask = replace(node(inst, lo=2, hi=3), host="host-a", agent="agent-a")
        assert isinstance(sm.join(ask, now), JoinResult)
        out = sm.join(replace(ask, unique_id=uid), now)
        assert isinstance(out, Parked)
        return out

    first = seated("a1", ID, 0.0)
    assert sm.cancel_wait(first.waiter, 4.0, timed_out=True) is not None
    again = seated("a2", ID2, 4.1)
    f = sm.cancel_wait(again.waiter, 8.1, timed_out=True)
    assert f is not None and f.reason == "WORLD_INCOMPLETE"
    assert "every node the job needs came" not in f.message, f.message
    assert "joined too" not in f.message, f.message
    assert "1 node(s) joined of the min_nodes=2 (up to 3) it needs (a node on host-a); 1 " \
        "more node(s) never joined: start the missing node agents" in f.message, f.message  # fmt: skip


def test_a_node_silent_since_its_host_was_refused_for_its_token_is_lost_for_that() -> None:
    """h115 D1: a token rotation that removed the token a node still sent lost it as
    "no heartbeat for 10.0 s (node unreachable)", sending the operator to the network.
    A refusal from its host since its last heartbeat words the loss by its token; one
    before that heartbeat, or from another host, changes nothing. The host is its
    stream's peer, or, for a node whose stream never reached this daemon (a restart),
    an address it advertised."""
    sm = RendezvousState()
    first = join_first(sm, node("a"))
    assert isinstance(first, Parked)
    sm.join(replace(node("b"), addresses=("10.0.0.3", "10.0.0.3")), 0.0)
    sm.take_effects()
    sm.attach_stream("j", 1, 0, "a", 0.0, mode=JoinMode.NODE, peer="10.0.0.1")
    sm.attach_stream("j", 1, 1, "b", 0.0, mode=JoinMode.NODE)  # no peer: its addresses
    sm.refused_token("10.0.0.1", 0.5)  # before a's last heartbeat: not its cause
    sm.refused_token("10.0.0.9", 2.0)  # another host
    for inst_rank in (0, 1):
        sm.heartbeat("j", 1, inst_rank, 1.0, mode=JoinMode.NODE)
    sm.refused_token("10.0.0.3", 2.0)  # b's host, since its last heartbeat
    sm.tick(11.5)
    job = sm.jobs["j"]
    assert job.state is JobState.FAILED
    causes = {f.node_rank: f.cause for f in job.gen.failed}
    assert causes[1].startswith("no heartbeat for 10.0 s: calls from its host 10.0.0.3 were ")
    assert "refused for their token" in causes[1] and "unreachable" not in causes[1]
    assert causes[0] == "no heartbeat for 10.0 s (node unreachable)"  # the same tick


def test_a_drained_restart_goes_on_counting_each_nodes_silence() -> None:
    """As a per-rank member's (test_restart.py): a node agent silent when the daemon
    drained keeps its silence across the restart, so a node cut off just before it is
    lost a heartbeat timeout after its last beat, not a timeout after the restart."""
    from rendezvousd.storage import snapshot

    sm = RendezvousState()
    formed(sm)
    job = sm.jobs["j"]
    job.gen.node_at[0].last_seen = 10.0
    job.gen.node_at[1].last_seen, job.gen.node_at[1].beat_gap = 5.0, 0.5
    sm.drain(10.0)
    fresh = RendezvousState()
    snapshot.restore_job(fresh, snapshot.job_record(job), {}, 12.0)
    nodes = fresh.jobs["j"].gen.node_at
    assert [round(12.0 - nodes[r].last_seen, 3) for r in (0, 1)] == [2.0, 7.0]
    fresh.tick(12.0 + sm.timing.heartbeat_timeout_s - 6.5)
    assert fresh.jobs["j"].state is JobState.FAILED
    assert [f.node_rank for f in fresh.jobs["j"].gen.failed] == [1, 1]


@pytest.mark.parametrize("stored", [True, False], ids=["row-with-last-call", "older-row"])
def test_a_restored_job_keeps_a_last_call_so_a_scale_up_forms_once(
    tmp_path: Path, stored: bool
) -> None:
    """--nnodes 2:3, a and b running, the daemon restarted, then c parks for a
    scale-up (h139 F4). The job re-forms once, with all three: the survivors re-joining
    first wait for c, as without a restart. Before, a restored job's last call was 0 s
    (the row did not keep it), so a and b re-formed alone at once and c's park aborted
    that generation again: generations 1 to 5 in half a second. A row from before the
    last call was kept takes the daemon's default."""
    import sqlite3

    sm = RendezvousState()
    join_first(sm, node("a", lo=2, hi=3), 0.0)
    assert isinstance(sm.join(node("b", lo=2, hi=3), 0.0), Parked)
    sm.tick(5.1)
    assert sm.jobs["j"].state is JobState.RUNNING
    if not stored:
        saver = Persister(tmp_path, sm)
        saver.restore()
        saver.close()
        with sqlite3.connect(tmp_path / "state.db") as db:
            db.execute("UPDATE jobs SET detail = json_remove(detail, '$.last_call_s')")
        back = RendezvousState()
        Persister(tmp_path, back).restore()
    else:
        back = restarted(sm, tmp_path)
    now = back.jobs["j"].gen.node_at[0].last_seen
    parked = back.join(node("c", lo=2, hi=3), now)
    assert isinstance(parked, Parked)
    back.abort("j", 1, "scale-up", now + 0.1)
    assert isinstance(woken(back)[parked.waiter], Rejoin)
    for inst in ("a2", "b2"):
        assert isinstance(
            sdk_join(back, node(inst, lo=2, hi=3, previous=inst[0]), now + 0.2), Parked
        )
    assert back.jobs["j"].state is JobState.FORMING and back.jobs["j"].generation == 2
    out = sdk_join(back, node("c", lo=2, hi=3), now + 0.3)
    assert isinstance(out, JoinResult) and out.generation == 2 and out.num_nodes == 3


def test_a_witness_report_soon_after_a_hearsay_one_becomes_the_root_cause() -> None:
    """Rank 3 relayed "lost rank 1 (reported by rank 2)" and was recorded first; rank
    2's own report came 20 ms later: the daemon, `status` and every launcher named the
    relay's host (h160's nopeers_drop). Its own report within the window now leads.
    The witness is the report's ``witness_rank``, as data: the cause's words are not read."""
    sm = RendezvousState()
    formed(sm)
    sm.attach_stream("j", 1, 0, "a", 0.0, mode=JoinMode.NODE)
    sm.attach_stream("j", 1, 1, "b", 0.0, mode=JoinMode.NODE)
    hearsay = "PeerConnectionError: rank 3: lost rank 1: its host answered nothing"
    witness = "PeerConnectionError: rank 2: lost rank 1: its host answered nothing for 10 s"
    sm.report_failure("j", 1, 1, "b", 1, hearsay, 5.0, witness=2)
    sm.report_failure("j", 1, 1, "b", 0, witness, 5.02)
    job = sm.jobs["j"]
    assert [(f.rank, f.cause) for f in job.gen.failed] == [(2, witness), (3, hearsay)]
    assert job.last_failure is not None and job.last_failure.cause.startswith("rank 2 on host-b")
    assert job.generation_fault().failed[0].rank == 2  # what a late call is told


def test_a_witness_report_past_the_window_or_another_ranks_keeps_the_first() -> None:
    sm = RendezvousState()
    formed(sm)
    sm.attach_stream("j", 1, 0, "a", 0.0, mode=JoinMode.NODE)
    sm.attach_stream("j", 1, 1, "b", 0.0, mode=JoinMode.NODE)
    hearsay = "PeerConnectionError: rank 3: lost rank 1 (reported by rank 2): reset"
    sm.report_failure("j", 1, 1, "b", 1, hearsay, 5.0, witness=2)
    sm.report_failure("j", 1, 0, "a", 0, "rank 0: something else", 5.1)  # not the witness
    sm.report_failure("j", 1, 1, "b", 0, "rank 2: lost rank 1: reset", 6.5)  # too late
    assert [f.rank for f in sm.jobs["j"].gen.failed] == [3, 0, 2]


def test_a_report_naming_no_witness_keeps_the_recorded_order_whatever_its_words() -> None:
    """An older SDK's report sends no ``witness_rank``: its order of record stands,
    though its cause says "(reported by rank 2)" (the daemon once read that back)."""
    sm = RendezvousState()
    formed(sm)
    sm.attach_stream("j", 1, 0, "a", 0.0, mode=JoinMode.NODE)
    sm.attach_stream("j", 1, 1, "b", 0.0, mode=JoinMode.NODE)
    hearsay = "PeerConnectionError: rank 3: lost rank 1 (reported by rank 2): reset"
    sm.report_failure("j", 1, 1, "b", 1, hearsay, 5.0)
    sm.report_failure("j", 1, 1, "b", 0, "PeerConnectionError: rank 2: lost rank 1: reset", 5.02)
    assert [f.rank for f in sm.jobs["j"].gen.failed] == [3, 2]
