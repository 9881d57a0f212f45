"""Node ranks stay where they were across a re-form (helper-49, as a torchrun user):
unnamed nodes took the free ranks in arrival order, so the node whose worker failed,
which hears of it first and re-joins first, came back as node 0, holding rank 0 (the
one that writes checkpoints and logs, and MASTER_ADDR); a scale-up's newcomer took
ranks 0-1; and ranks swapped between nodes round after round. c10d kept node 0 where
it was. Now the nodes expected back keep the order of their last ranks, ahead of
newcomers, whatever order they re-join in; node 0 (who gives the id) follows."""

from __future__ import annotations

from rendezvousd.common.model import JobState, JoinMode, JoinResult, Parked
from rendezvousd.state.machine import RendezvousState
from tests.daemon.test_node_state import ID2, back, node, sdk_join, three_elastic, woken


def _ranks(sm: RendezvousState) -> dict[str, int]:
    return {n.instance_id: rank for rank, n in sm.jobs["j"].gen.node_at.items()}


def test_survivors_keep_the_order_of_their_ranks_whatever_order_they_re_join_in() -> None:
    sm = RendezvousState()
    before = three_elastic(sm)
    assert [before[f"{i}-rank"] for i in "abc"] == [0, 1, 2]
    sm.report_failure("j", 1, 0, "a", 0, "exit code 1", 1.0)  # node 0's own worker failed
    assert sm.jobs["j"].state is JobState.FAILED
    sm.take_effects()
    # The last node re-joins first, node 0 last: node 0 again, so it gives the id.
    assert isinstance(back(sm, "c2", 1.1), Parked)
    assert isinstance(back(sm, "b2", 1.2), Parked)
    out = back(sm, "a2", 1.3)
    assert isinstance(out, JoinResult) and out.node_rank == 0 and out.num_nodes == 3
    assert _ranks(sm) == {"a2": 0, "b2": 1, "c2": 2}
    answers = [v for v in woken(sm).values() if isinstance(v, JoinResult)]
    assert sorted(a.node_rank for a in answers if not a.id_required) == [1, 2]
    assert sm.jobs["j"].gen.id_node == "a2"


def test_a_lost_nodes_rank_goes_to_the_next_survivor_in_order_and_newcomers_come_last() -> None:
    """--nnodes 2:3, b (node 1) lost: a and c keep their order (0, then 1, not c's old
    2); a newcomer seated beside them, even first, comes after them."""
    sm = RendezvousState()
    before = three_elastic(sm)
    sm.detach_stream("j", 1, before["b-rank"], before["b"], 1.0, mode=JoinMode.NODE)
    assert isinstance(sdk_join(sm, node("r", lo=2, hi=3), 1.1), Parked)  # node 0 for now
    assert isinstance(back(sm, "c2", 1.2), Parked)
    out = back(sm, "a2", 1.3)
    assert isinstance(out, JoinResult) and out.num_nodes == 3
    assert _ranks(sm) == {"a2": 0, "c2": 1, "r": 2}


def test_a_scale_up_newcomer_takes_the_rank_after_the_running_nodes() -> None:
    """--nnodes 2:3 running with a and b; c parks, the running nodes re-form with it:
    a and b keep ranks 0 and 1, whichever re-joins first, and c is node 2."""
    sm = RendezvousState()
    from tests.daemon.test_node_state import join_first

    assert isinstance(join_first(sm, node("a", lo=2, hi=3)), Parked)
    assert isinstance(sm.join(node("b", lo=2, hi=3), 0.0), Parked)
    sm.tick(5.1)  # the last call: a and b form
    assert _ranks(sm) == {"a": 0, "b": 1}
    parked = sm.join(node("c", lo=2, hi=3), 6.0)
    assert isinstance(parked, Parked)
    sm.abort("j", 1, "scale-up", 6.5)  # the running nodes answer NODES_WAITING so
    woken(sm)
    # c, woken, re-joins first with its own instance id (it held no seat before).
    assert sm.join(node("c", lo=2, hi=3, previous=""), 6.6).id_required  # type: ignore[union-attr]
    assert isinstance(sm.join(node("c", lo=2, hi=3, uid=ID2, previous=""), 6.6), Parked)
    assert isinstance(back(sm, "b2", 6.7), Parked)
    out = back(sm, "a2", 6.8)
    assert isinstance(out, JoinResult) and out.num_nodes == 3
    assert _ranks(sm) == {"a2": 0, "b2": 1, "c": 2}
