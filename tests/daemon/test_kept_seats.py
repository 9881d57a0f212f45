"""Seats kept after a failure (``placement.keep_seats``), in the pure state machine
with an explicit clock: the generation forming after a node generation failed keeps
a seat for each node it expects back (survivors, called standbys) for one heartbeat
timeout, so a newcomer (a replacement pod, a ``--standby-if-full`` node) cannot take a
survivor's place; the survivor names its seat by the instance id it held, a client
too old to say by its host; a seat not claimed in time goes to a parked standby, then
to anyone."""

from __future__ import annotations

import sqlite3
from dataclasses import replace
from pathlib import Path

import pytest

from rendezvousd.common.limits import Timing
from rendezvousd.common.model import (
    JobState,
    JoinMode,
    JoinResult,
    Parked,
    Rejoin,
    Transition,
    Wake,
)
from rendezvousd.errors import ConfigError, DaemonError, RendezvousFault
from rendezvousd.state.machine import RendezvousState
from rendezvousd.state.placement import JoinArgs
from rendezvousd.storage.persistence import Persister
from tests.daemon.test_node_state import (
    ID2,
    back,
    fault,
    node,
    rejoin,
    sdk_join,
    three_elastic,
    woken,
)
from tests.daemon.test_standby import lose_b, running_pair, spare

TIMEOUT = RendezvousState().timing.heartbeat_timeout_s
ID3 = b"\x33" * 128


def generation_2_keeps_a_seat(now: float = 1.0, timing: Timing | None = None) -> RendezvousState:
    """a and b running (--nnodes 2), s parked as a standby; b is lost at ``now``; s,
    called into b's slot, is node 0 of generation 2, which keeps a's seat."""
    sm = RendezvousState(timing=timing)
    tokens = running_pair(sm)
    parked = sm.join(spare("s"), 0.5)
    assert isinstance(parked, Parked)
    lose_b(sm, tokens, now)
    assert isinstance(woken(sm)[parked.waiter], Rejoin)
    assert sm.join(spare("s"), now).id_required  # type: ignore[union-attr]
    assert isinstance(sm.join(spare("s", uid=ID2), now), Parked)
    assert sm.jobs["j"].gen.owed == {"a": "host-a"}
    return sm


def test_a_newcomer_cannot_take_the_seat_kept_for_a_survivor() -> None:
    """The race found in session 18: b lost, standby s called, then a replacement pod
    r (a plain join) arrives before the survivor a. r used to take a's seat and a got
    WORLD_FULL; now r does, told of the kept seat, and a forms generation 2 with s."""
    sm = generation_2_keeps_a_seat()
    f = fault(sm.join, node("r"), 1.3)
    assert f.reason == "WORLD_FULL"
    assert "1 node(s) and 1 seat(s) kept for nodes re-joining after the failure" in f.message
    out = sdk_join(sm, node("a2", previous="a"), 1.6)  # node 0 again (a was), asked for the id
    assert isinstance(out, JoinResult) and out.generation == 2 and out.num_nodes == 2
    job = sm.jobs["j"]
    assert job.state is JobState.RUNNING and set(job.gen.nodes) == {"s", "a2"}


def old_client(inst: str, host: str, **kw: object) -> JoinArgs:
    """A JoinNode from a client older than ``previous_instance_id`` (absent: None)."""
    return replace(node(inst, **kw), host=host)  # type: ignore[arg-type]


def test_a_client_too_old_to_name_its_seat_takes_the_one_kept_on_its_host() -> None:
    """Provisionally: the node that held the seat may come back for it until the hold
    ends, so the generation does not form on that claim; at the hold's end it does."""
    sm = generation_2_keeps_a_seat()
    assert fault(sm.join, node("r"), 1.3).reason == "WORLD_FULL"  # another host
    parked = sdk_join(sm, old_client("a2", "host-a"), 1.6)
    assert isinstance(parked, Parked) and sm.jobs["j"].state is JobState.FORMING
    assert sm.view("j", 1.6).seats_kept == 1  # what status and GetJob show meanwhile
    sm.tick(1.0 + TIMEOUT - 0.1)
    assert sm.jobs["j"].state is JobState.FORMING
    sm.take_effects()
    sm.tick(1.0 + TIMEOUT + 0.1)
    out = woken(sm)[parked.waiter]
    assert isinstance(out, JoinResult) and out.num_nodes == 2
    assert set(sm.jobs["j"].gen.nodes) == {"s", "a2"}


def test_a_survivor_takes_its_seat_back_from_a_node_that_claimed_it_by_host() -> None:
    """helper-45's seat theft: a JoinNode without previous_instance_id (any token holder
    can send one; an old client's replacement pod may reuse the hostname) claimed the
    survivor's seat by its host, and the survivor, naming the seat, was refused
    WORLD_FULL and left outside the world holding the job's state. Now the survivor
    takes it back; the claimer, with no seat left, hears why."""
    sm = generation_2_keeps_a_seat()
    squatter = sdk_join(sm, old_client("x", "host-a"), 1.3)
    assert isinstance(squatter, Parked)
    sm.take_effects()
    out = sdk_join(sm, node("a2", previous="a"), 1.6)
    assert isinstance(out, JoinResult) and out.num_nodes == 2
    job = sm.jobs["j"]
    assert job.state is JobState.RUNNING and set(job.gen.nodes) == {"s", "a2"}
    told = woken(sm)[squatter.waiter]
    assert isinstance(told, RendezvousFault) and told.reason == "WORLD_FULL", told
    assert "was taken back by that node agent" in told.message
    assert "previous_instance_id" in told.message and "'host-a'" in told.message


def test_a_node_that_claimed_a_seat_by_host_stays_as_a_newcomer_where_there_is_room() -> None:
    """--nnodes 2:3, c lost: x (an old client on a's host) claims a's seat; a comes
    back for it, x keeps a seat as a newcomer (the world has room for it beside the
    seat kept for b), and the generation forms with all three once b is back."""
    sm = RendezvousState()
    nodes = three_elastic(sm)
    sm.detach_stream("j", 1, nodes["c-rank"], nodes["c"], 1.0, mode=JoinMode.NODE)
    first = sm.join(old_client("x", "host-a", lo=2, hi=3), 1.1)
    assert first.id_required  # type: ignore[union-attr]
    squatter = sm.join(old_client("x", "host-a", lo=2, hi=3, uid=ID2), 1.1)
    assert isinstance(squatter, Parked)
    assert isinstance(back(sm, "a2", 1.2), Parked)
    assert isinstance(rejoin(sm, "b2", 1.3), JoinResult)
    job = sm.jobs["j"]
    assert job.state is JobState.RUNNING and set(job.gen.nodes) == {"x", "a2", "b2"}
    # x took a's rank before with its seat, and gave both back: it ranks as a newcomer.
    assert {n.instance_id: r for r, n in job.gen.node_at.items()} == {"a2": 0, "b2": 1, "x": 2}
    assert isinstance(woken(sm)[squatter.waiter], JoinResult)


def test_a_node_naming_a_seat_not_kept_is_a_newcomer_even_on_a_kept_host() -> None:
    sm = generation_2_keeps_a_seat()
    f = fault(sm.join, replace(node("x", previous="b"), host="host-a"), 1.3)  # b was lost
    assert f.reason == "WORLD_FULL"


def test_a_survivor_not_back_within_a_heartbeat_timeout_is_not_waited_for() -> None:
    """a died before re-joining: its seat is kept one heartbeat timeout, then a
    newcomer takes it."""
    sm = generation_2_keeps_a_seat()
    assert fault(sm.join, node("r"), 1.0 + TIMEOUT - 0.1).reason == "WORLD_FULL"
    sm.take_effects()
    sm.tick(1.0 + TIMEOUT + 0.1)
    assert sm.jobs["j"].gen.owed == {}
    said = [e.detail for e in sm.take_effects() if isinstance(e, Transition)]
    assert said == [
        f"1 node(s) expected back (host-a) did not re-join within {TIMEOUT:.1f} s: "
        "their seats are free"
    ]
    out = sm.join(node("r"), 1.0 + TIMEOUT + 0.2)
    assert isinstance(out, JoinResult) and set(sm.jobs["j"].gen.nodes) == {"s", "r"}


def test_a_lapsed_seat_calls_the_next_standby_and_is_kept_for_it() -> None:
    sm = generation_2_keeps_a_seat()
    second = sm.join(spare("s2"), 1.2)
    assert isinstance(second, Parked)  # no room: a's seat is kept
    sm.take_effects()
    sm.tick(1.0 + TIMEOUT + 0.1)
    effects = sm.take_effects()
    assert any(
        isinstance(e, Transition) and e.detail.endswith("their seats are free, 1 standby(s) called")
        for e in effects
    ), effects
    assert any(isinstance(e, Wake) and isinstance(e.value, Rejoin) for e in effects)
    assert second.waiter in {e.waiter for e in effects if isinstance(e, Wake)}
    job = sm.jobs["j"]
    assert job.gen.owed == {"s2": ""}  # a newcomer still cannot take it
    assert fault(sm.join, node("r"), 1.0 + TIMEOUT + 0.2).reason == "WORLD_FULL"
    out = sm.join(spare("s2"), 1.0 + TIMEOUT + 0.3)  # the adapter's re-issued call
    assert isinstance(out, JoinResult) and set(job.gen.nodes) == {"s", "s2"}


def test_forming_waits_for_the_survivors_not_for_a_newcomer_beside_them() -> None:
    """--nnodes 2:3, c lost: a newcomer r seated first does not stand in for b. The
    generation does not form with r and a; it forms when b is back too, 3 nodes."""
    sm = RendezvousState()
    nodes = three_elastic(sm)
    sm.detach_stream("j", 1, nodes["c-rank"], nodes["c"], 1.0, mode=JoinMode.NODE)
    assert sm.join(node("r", lo=2, hi=3), 1.1).id_required  # type: ignore[union-attr]
    assert isinstance(sm.join(node("r", lo=2, hi=3, uid=ID2), 1.1), Parked)
    assert isinstance(back(sm, "a2", 1.2), Parked)
    sm.tick(1.3)
    assert sm.jobs["j"].state is JobState.FORMING  # two nodes, but b is expected
    out = rejoin(sm, "b2", 1.4)
    assert isinstance(out, JoinResult) and out.num_nodes == 3


def test_a_survivor_whose_wait_ends_gets_its_seat_kept_again() -> None:
    """--nnodes 2:3, c lost: a2 takes a's kept seat, then its join's wait ends; the
    seat is kept again for a's next try, not given to a newcomer."""
    sm = RendezvousState()
    nodes = three_elastic(sm)
    sm.detach_stream("j", 1, nodes["c-rank"], nodes["c"], 1.0, mode=JoinMode.NODE)
    assert sm.join(node("r", lo=2, hi=3), 1.1).id_required  # type: ignore[union-attr]
    assert isinstance(sm.join(node("r", lo=2, hi=3, uid=ID2), 1.1), Parked)
    waiting = back(sm, "a2", 1.2)
    assert isinstance(waiting, Parked) and sm.jobs["j"].gen.owed == {"b": "host-b"}
    sm.cancel_wait(waiting.waiter, 1.5, timed_out=True)
    assert sm.jobs["j"].gen.owed == {"a": "host-a2", "b": "host-b"}  # where a now runs
    assert fault(sm.join, node("x", lo=2, hi=3), 1.6).reason == "WORLD_FULL"
    assert isinstance(back(sm, "a3", 1.7), Parked)


def test_a_claim_whose_commit_fails_gives_the_seat_back_to_its_survivor() -> None:
    """The daemon undoes a change whose commit failed (``storage.rollback``): a seat
    claimed by that change is kept again, not lost to the next newcomer."""
    from rendezvousd.storage import rollback, snapshot

    sm = RendezvousState()
    nodes = three_elastic(sm)
    sm.detach_stream("j", 1, nodes["c-rank"], nodes["c"], 1.0, mode=JoinMode.NODE)
    assert sm.join(node("r", lo=2, hi=3), 1.1).id_required  # type: ignore[union-attr]
    assert isinstance(sm.join(node("r", lo=2, hi=3, uid=ID2), 1.1), Parked)
    job = sm.jobs["j"]
    committed = snapshot.job_record(job)
    assert isinstance(back(sm, "a2", 1.2), Parked)  # this change's commit fails
    assert job.gen.owed == {"b": "host-b"}
    undone = rollback.durable_job(committed, dict(job.gen.kv), job, 1.3, hold_s=TIMEOUT)
    assert "a2" not in undone.gen.nodes
    assert undone.gen.owed == {"a": "host-a2", "b": "host-b"}


def test_a_daemon_restarted_while_seats_are_kept_keeps_them_again(tmp_path: Path) -> None:
    """Restarted with its state directory while generation 2 forms: the generation it
    is fenced with (3) keeps the seats again, those claimed (s's) and not (a's), for a
    fresh hold; a newcomer is refused and the re-joins form it."""
    sm = generation_2_keeps_a_seat()
    saver = Persister(tmp_path, sm)
    saver.restore()  # a database opened for a state that holds jobs writes them all
    saver.close()
    back = RendezvousState()
    Persister(tmp_path, back).restore()
    job = back.jobs["j"]
    assert job.generation == 3 and job.state is JobState.FORMING
    assert job.gen.owed == {"a": "host-a", "s": "host-s"}
    assert fault(back.join, node("r"), 100.0).reason == "WORLD_FULL"
    assert back.join(spare("s"), 100.1).id_required  # type: ignore[union-attr]
    assert isinstance(back.join(spare("s", uid=ID3), 100.1), Parked)
    out = back.join(node("a3", previous="a"), 100.2)
    assert isinstance(out, JoinResult) and out.generation == 3 and out.num_nodes == 2


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("json_object('', 'h')", "kept_seats must map instance ids"),
        ("json_object('a', 1)", "kept_seats must map instance ids"),
        ("json_object('a', 'h', 'b', 'h', 'c', 'h')", "kept_seats holds 3 seats for max_nodes=2"),
        ("json_array()", "kept_seats must be an object"),
    ],
)
def test_a_hand_edited_kept_seat_is_a_clear_startup_error(
    tmp_path: Path, value: str, problem: str
) -> None:
    saver = Persister(tmp_path, generation_2_keeps_a_seat())
    saver.restore()
    saver.close()
    db = sqlite3.connect(tmp_path / "state.db")
    db.execute(f"UPDATE jobs SET detail = json_set(detail, '$.kept_seats', {value})")
    db.commit()
    db.close()
    with pytest.raises(DaemonError, match=r"state database .*table jobs, row") as info:
        Persister(tmp_path, RendezvousState()).restore()
    assert problem in str(info.value)


def test_an_id_from_a_node_that_is_not_node_0_any_more_is_dropped() -> None:
    """s was node 0 of a generation a restart fenced; its JoinNode, sent again with that
    id, reaches the new generation after a became its node 0: the id is dropped (as an
    accepted one is when node 0 changes) and s waits, rather than failing INVALID_ID."""
    sm = RendezvousState()
    asked = sm.join(node("a"), 1.0)
    assert isinstance(asked, JoinResult) and asked.id_required
    late = sm.join(node("s", uid=b"\x44" * 128), 1.1)
    assert isinstance(late, Parked) and sm.jobs["j"].gen.unique_id is None
    out = sm.join(node("a", uid=ID3), 1.2)
    assert isinstance(out, JoinResult) and out.unique_id == ID3 and out.num_nodes == 2


def test_seat_hold_s_sets_how_long_a_seat_is_kept() -> None:
    """``--seat-hold-s`` (``RENDEZVOUSD_SEAT_HOLD_S``): 2 s here, not the heartbeat
    timeout; 0 (the default) is the heartbeat timeout; a negative hold is refused."""
    from rendezvousd import config

    timing = config.load(env={"RENDEZVOUSD_SEAT_HOLD_S": "2"}).timing()
    assert timing.hold_s == 2.0 and timing.heartbeat_timeout_s == TIMEOUT
    assert config.load(env={}).timing().hold_s == TIMEOUT
    with pytest.raises(ConfigError, match="seat_hold_s"):
        config.load(env={"RENDEZVOUSD_SEAT_HOLD_S": "-1"})
    sm = generation_2_keeps_a_seat(1.0, timing)  # b lost at 1.0: a's seat kept 2 s
    assert fault(sm.join, node("r"), 2.9).reason == "WORLD_FULL"
    sm.tick(3.1)
    assert isinstance(sm.join(node("r"), 3.2), JoinResult)


def _relaunch(sm: RendezvousState, now: float) -> object:
    """A fresh launch of job j (new agents x and y, no seat held before): node 0's
    two calls, then node 1's answer, or its fault."""
    try:
        assert sm.join(node("x", previous=""), now).id_required  # type: ignore[union-attr]
        assert isinstance(sm.join(node("x", uid=ID2, previous=""), now), Parked)
        return sm.join(node("y", previous=""), now)
    except RendezvousFault as exc:
        return exc


@pytest.mark.parametrize("final", [True, False], ids=["final", "plain"])
def test_agents_that_leave_for_good_keep_no_seat_and_a_relaunch_forms_at_once(
    final: bool,
) -> None:
    """rendezvous-run's agents that gave up after a failure left the failed generation
    as survivors about to re-join do, so both were expected back: the job id launched
    again at once was refused WORLD_FULL ("2 seat(s) kept") for the whole hold, and a
    torchrun relaunch stood by for it. A final Leave says they will not re-join."""
    sm = RendezvousState()
    running_pair(sm)
    sm.report_failure("j", 1, 1, "b", 0, "exit code 1", 1.0)
    assert sm.jobs["j"].state is JobState.FAILED
    for inst, rank in (("a", 0), ("b", 1)):
        sm.leave("j", 1, rank, inst, 1.1, mode=JoinMode.NODE, final=final)
    out = _relaunch(sm, 1.2)
    if final:
        assert isinstance(out, JoinResult) and out.generation == 2, out
        assert set(sm.jobs["j"].gen.nodes) == {"x", "y"}
    else:
        assert isinstance(out, RendezvousFault) and "2 seat(s) kept" in str(out), out


def test_a_final_leave_after_the_next_generation_opened_frees_the_seat_kept_for_it() -> None:
    sm = generation_2_keeps_a_seat()
    assert fault(sm.join, node("r", previous=""), 1.2).reason == "WORLD_FULL"
    sm.take_effects()
    sm.leave("j", 1, 0, "a", 1.3, mode=JoinMode.NODE, final=True)  # a gave up meanwhile
    job = sm.jobs["j"]
    assert job.gen.owed == {} and job.gen.rejoin_expected == 1  # s, back already
    said = [e.detail for e in sm.take_effects() if isinstance(e, Transition)]
    assert said == ["the node agent on host-a will not re-join: its seat is free"]
    out = sm.join(node("r", previous=""), 1.4)
    assert isinstance(out, JoinResult) and set(job.gen.nodes) == {"s", "r"}


def test_a_final_leave_for_a_seat_not_kept_changes_nothing() -> None:
    """Sent for a generation the job left behind, naming no seat kept (a lost node, or
    a second goodbye): accepted, and nothing else is touched."""
    sm = generation_2_keeps_a_seat()
    sm.take_effects()
    sm.leave("j", 1, 1, "b", 1.3, mode=JoinMode.NODE, final=True)  # b was lost
    sm.leave("j", 1, 0, "nobody", 1.3, mode=JoinMode.NODE, final=True)
    assert sm.jobs["j"].gen.owed == {"a": "host-a"} and sm.take_effects() == []


def test_a_node_that_gives_up_beside_a_parked_standby_calls_it_when_the_job_re_forms() -> None:
    """b reported its own failure (its node is not lost: it would re-join with a
    restart left), so the failure freed no slot and the standby stayed parked; b then
    gave up. Its seat, kept for the hold, was the standby's only way in: 10 s later,
    or never once b's final Leave took the seat away. Now a's re-join, which opens the
    next generation, calls the standby into b's seat."""
    sm = RendezvousState()
    running_pair(sm)
    parked = sm.join(spare("s"), 0.5)
    assert isinstance(parked, Parked)
    sm.report_failure("j", 1, 1, "b", 0, "exit code 1", 1.0)
    sm.leave("j", 1, 1, "b", 1.1, mode=JoinMode.NODE, final=True)
    assert parked.waiter not in woken(sm)  # no slot freed yet: does the job re-form?
    assert sm.join(node("a2", previous="a"), 1.2).id_required  # type: ignore[union-attr]
    assert isinstance(woken(sm)[parked.waiter], Rejoin)
    assert sm.jobs["j"].gen.owed == {"s": ""}  # a2 took the seat kept for a
    assert isinstance(sm.join(node("a2", uid=ID2, previous="a"), 1.2), Parked)
    out = sm.join(spare("s"), 1.3)
    assert isinstance(out, JoinResult) and set(sm.jobs["j"].gen.nodes) == {"a2", "s"}


def test_when_every_node_gave_up_a_parked_standby_is_not_called_but_told_the_run_closed() -> None:
    """An aborted job whose agents all gave up: nobody re-forms it, and a standby
    called into it would wait in a generation of its own (the status page then showed
    the dead job as forming). Left parked, it was never told and, asking again at its
    join timeout, opened that generation itself (h122 D1): the last final Leave closes
    the run, and the standby hears so."""
    sm = RendezvousState()
    running_pair(sm)
    parked = sm.join(spare("s"), 0.5)
    assert isinstance(parked, Parked)
    sm.abort("j", 1, "aborted from the status page", 1.0)
    sm.leave("j", 1, 0, "a", 1.1, mode=JoinMode.NODE, final=True)
    assert parked.waiter not in woken(sm)  # b may re-join yet
    sm.leave("j", 1, 1, "b", 1.1, mode=JoinMode.NODE, final=True)
    told = woken(sm)[parked.waiter]
    assert isinstance(told, RendezvousFault) and told.metadata.get("closed") == "true", told
    assert "aborted from the status page" in told.message, told.message
    job = sm.jobs["j"]
    assert job.state is JobState.ABORTED and job.generation == 1
    assert job.closed is not None and job.closed.generation == 1


def test_a_final_leave_into_a_forming_generation_calls_a_parked_standby() -> None:
    sm = generation_2_keeps_a_seat()
    second = sm.join(spare("s2"), 1.2)
    assert isinstance(second, Parked)  # no room: a's seat is kept
    sm.take_effects()
    sm.leave("j", 1, 0, "a", 1.3, mode=JoinMode.NODE, final=True)
    effects = sm.take_effects()
    said = [e.detail for e in effects if isinstance(e, Transition)]
    assert said == [
        "the node agent on host-a will not re-join: its seat is free, 1 standby(s) called"
    ]
    assert second.waiter in {e.waiter for e in effects if isinstance(e, Wake)}
    assert sm.jobs["j"].gen.owed == {"s2": ""}  # kept for it, not for a newcomer
    out = sm.join(spare("s2"), 1.4)
    assert isinstance(out, JoinResult) and set(sm.jobs["j"].gen.nodes) == {"s", "s2"}


def test_an_agent_that_gave_its_running_generation_up_re_forms_the_job() -> None:
    """The daemon restarted with its state after its members' window: the restored
    generation runs with seats nobody holds, and the agents, having given it up
    (DaemonUnreachable), join again naming the seats they held. Each such join was
    refused "generation 1 already has max_nodes=2 nodes" and the job could not
    recover. The first re-join fails the generation (its node's workers are stopped);
    the next generation keeps the other's seat for it."""
    sm = RendezvousState()
    running_pair(sm)
    out = sm.join(node("a2", previous="a"), 5.0)
    assert isinstance(out, JoinResult) and out.id_required, out
    job = sm.jobs["j"]
    assert job.generation == 2 and job.gen.owed == {"b": "host-b"}
    said = [e.detail for e in sm.take_effects() if isinstance(e, Transition)]
    assert said[0] == (
        "rank 0 on host-a (its node agent left this generation and joined again (its "
        "workers were stopped)) (and 1 more of its node)"
    ), said
    assert isinstance(sm.join(node("a2", uid=ID2, previous="a"), 5.0), Parked)
    out = sm.join(node("b2", previous="b"), 5.1)
    assert isinstance(out, JoinResult) and out.generation == 2 and out.num_nodes == 2
