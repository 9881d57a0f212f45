"""The two shared rules of a loss (``rendezvousd.common.members``): how losses are named
(``FailedInfo.describe``, ``named_losses``), which the daemon's failure sentence, the
node agent's "this node was lost" and the torchrun handler's "lost node N" all say; and
whether a lost rank is a seat's own (``Seat.holds``), which the node agent, the
launcher's root cause and the torchrun handler all ask. Each had its own copy."""

from __future__ import annotations

import pytest

from rendezvousd.common.members import NAMED_LOSSES, FailedInfo, Seat, failed_text, named_losses


def _lost(rank: int, *, node_rank: int | None = None, cause: str = "died") -> FailedInfo:
    return FailedInfo(rank, f"h{rank}", cause, node_rank=node_rank)


def test_a_loss_is_named_by_rank_or_as_a_node_with_its_host_escaped_and_cause_shortened() -> None:
    forged = FailedInfo(5, "h\x1b[31m\nx", "c" * 5000, node_rank=2, local_rank=1)
    said = forged.describe()
    assert said.startswith("rank 5 on h\\x1b[31m\\x0ax (") and "\n" not in said
    assert len(said) < 1000, len(said)
    # A torchrun agent is a node of one rank: named by its node rank, or, where the
    # daemon did not say it, by its rank (the same for a node of one rank).
    assert _lost(3, node_rank=3).describe(as_node=True) == "node 3 on h3 (died)"
    assert _lost(4).describe(as_node=True) == "node 4 on h4 (died)"
    assert _lost(4).describe(as_node=True, in_round=7) == "node 4 on h4 in round 7 (died)"
    joining = _lost(4, node_rank=0).describe(as_node=True, in_round=2, joining=True)
    assert joining == "the node joining from h4 in round 2 (died)"


def test_more_losses_than_named_are_counted_and_as_many_as_named_are_all_named() -> None:
    exactly = [_lost(r, node_rank=r) for r in range(NAMED_LOSSES)]
    said = named_losses(exactly)
    assert said.count("rank ") == NAMED_LOSSES and " more" not in said, said
    one_more = [*exactly, _lost(NAMED_LOSSES, node_rank=NAMED_LOSSES)]
    said = named_losses(one_more, as_nodes=True)
    assert said.startswith("node 0 on h0 (died), node 1 on h1 (died), "), said
    assert said.endswith(f"node {NAMED_LOSSES - 1} on h{NAMED_LOSSES - 1} (died) and 1 more")
    assert f"h{NAMED_LOSSES} " not in said, said
    # The daemon's sentence names them the same way.
    text = failed_text("job 'j' generation 3", one_more)
    assert text == f"job 'j' generation 3 failed: lost {named_losses(one_more)}"


def _node(generation: int = 4, node_rank: int = 1, gpus: int = 4) -> Seat:
    return Seat("j", generation, node_rank, 3, gpus, None)


@pytest.mark.parametrize(
    ("rank", "ours"),
    [(3, False), (4, True), (5, True), (7, True), (8, False), (0, False)],
    ids=["last of the node before", "first", "middle", "last", "first of the next", "node 0"],
)
def test_a_node_seat_holds_its_ranks_up_to_the_node_rank_boundary(rank: int, ours: bool) -> None:
    assert _node().holds(4, rank) is ours


def test_a_loss_in_another_generation_is_not_the_seats() -> None:
    """A node's rank in the generation before is another node's now (ranks move when
    nodes are lost), and the next generation's is not yet its own."""
    seat = _node(generation=4)
    assert not seat.holds(3, 5) and not seat.holds(5, 5) and seat.holds(4, 5)


def test_a_workers_seat_holds_its_one_rank_and_a_torchrun_node_its_node_rank() -> None:
    worker = Seat("j", 2, 1, 2, 4, 3)  # global rank 7
    assert worker.holds(2, 7)
    assert not worker.holds(2, 4) and not worker.holds(2, 6) and not worker.holds(1, 7)
    torchrun = _node(generation=2, node_rank=1, gpus=1)
    assert torchrun.holds(2, 1) and not torchrun.holds(2, 0) and not torchrun.holds(2, 2)
