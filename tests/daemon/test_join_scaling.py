"""A join costs the daemon O(1): forming a generation of N joiners, node agents or
per-rank workers, runs O(N) Python lines in the state machine and the answers' encoder,
not O(N^2).

Counted, not timed (speed lives in benchmarks/rendezvous_scale.py): the Python lines
executed (``sys.settrace`` line events; a loop's every pass is one) for N and for 10 N
joiners. Linear work makes about 10 times the lines; a scan of every node or member
on each join, which made forming 4,096 agents spend 11 of its 24 s of daemon CPU in
three such scans, makes about 100 times.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

from rendezvousd.common.model import JoinResult, Wake
from rendezvousd.server.answers import JoinAnswers
from rendezvousd.state.machine import JoinArgs, RendezvousState

ID = b"\x07" * 128
# 10 times the joiners may cost this many times the lines: linear work with a constant
# part makes a little under 10; one O(N) scan per join, 10 times as many joiners each
# scanning 10 times as many, makes far more.
LINEAR = 12


def _lines(run: Callable[[], None]) -> int:
    """How many Python lines ``run`` executes."""
    count = 0

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "line":
            count += 1
        return local

    def enter(frame: FrameType, event: str, arg: Any) -> Any:
        return local

    previous = sys.gettrace()
    sys.settrace(enter)
    try:
        run()
    finally:
        sys.settrace(previous)
    return count


def _answers(sm: RendezvousState, last: object) -> list[object]:
    """Every join's answer: the parked ones woken by the forming, and the last one's."""
    woken = [e.value for e in sm.take_effects() if isinstance(e, Wake) and e.fault is None]
    return [*woken, last]


def _form_nodes(n: int) -> None:
    """N node agents of 8 ranks form one generation; each answer is encoded, slim."""
    sm = RendezvousState()
    answers = JoinAnswers(sm.timing)

    def args(i: int, uid: bytes = b"") -> JoinArgs:
        return JoinArgs("j", n, n, 8, None, f"host-{i}", (), uid, f"agent-{i}", 60.0)

    first = sm.join(args(0), 0.0)
    assert isinstance(first, JoinResult) and first.id_required
    out: object = sm.join(args(0, ID), 0.0)
    for i in range(1, n):
        out = sm.join(args(i), 0.001 * i)
    results = _answers(sm, out)
    assert len(results) == n and all(isinstance(r, JoinResult) for r in results)
    for r in results:
        assert isinstance(r, JoinResult) and r.local_rank is None
        answers.join(r, slim=True)


def _form_ranks(n: int) -> None:
    """N per-rank workers (one per node) form one generation; each answer is encoded."""
    sm = RendezvousState()
    answers = JoinAnswers(sm.timing)

    def args(i: int) -> JoinArgs:
        return JoinArgs.worker(
            "j", n, 1, i, 0, f"host-{i}", "", ID if i == 0 else b"", f"w-{i}", 60.0
        )

    out: object = None
    for i in range(n):
        out = sm.join(args(i), 0.001 * i)
    results = _answers(sm, out)
    assert len(results) == n and all(isinstance(r, JoinResult) for r in results)
    for r in results:
        assert isinstance(r, JoinResult)
        answers.join(r, slim=True)


def test_forming_node_agents_costs_linear_lines() -> None:
    small, large = _lines(lambda: _form_nodes(50)), _lines(lambda: _form_nodes(500))
    assert large < LINEAR * small, (small, large)


def test_forming_per_rank_workers_costs_linear_lines() -> None:
    small, large = _lines(lambda: _form_ranks(50)), _lines(lambda: _form_ranks(500))
    assert large < LINEAR * small, (small, large)


def test_the_count_sees_a_scan_per_join() -> None:
    """The measure itself: a loop over every joiner so far, on each join, is caught."""

    def quadratic(n: int) -> None:
        seen: list[int] = []
        for i in range(n):
            seen.append(i)
            assert sum(1 for _ in seen) == i + 1

    small, large = _lines(lambda: quadratic(100)), _lines(lambda: quadratic(1000))
    assert large > LINEAR * small
