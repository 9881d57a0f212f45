"""benchmarks/soak.py's answer times: a barrier round's answers counted from its last
arrival, a join's from its generation's forming, and what has no reference left out.
A wrong reference (the first arrival, or each call's own start) would report the
wait for peers as the daemon's answer time, or hide it. And how it reads the daemon's
GC collections."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.support import DaemonProcess, benchmark_module


@pytest.fixture
def soak(monkeypatch: pytest.MonkeyPatch) -> Any:
    return benchmark_module(monkeypatch, "soak.py")


def test_a_barrier_round_is_timed_from_its_last_arrival(soak: Any) -> None:
    meetings = [
        # job a, round 0: the last member arrives at 10.5; answers at 10.6 and 10.7.
        ("a", 0, 10.0, 10.6),
        ("a", 0, 10.5, 10.7),
        # job a, round 1 is a meeting of its own (last arrival 20.0).
        ("a", 1, 20.0, 20.2),
        ("a", 1, 19.0, 20.1),
        # job b, round 0: another job's round is not job a's.
        ("b", 0, 10.9, 11.0),
    ]
    got = soak._answer_times(meetings)
    assert got == pytest.approx([0.1, 0.2, 0.2, 0.1, 0.1])


def test_a_join_is_timed_from_its_generations_forming(soak: Any) -> None:
    meetings = [("a", 0, 1.0, 5.25), ("a", 0, 4.0, 5.5), ("b", 0, 2.0, 3.0)]
    # Job b did not report a forming instant (not running any more): left out, not
    # timed from its members' calls.
    got = soak._answer_times(meetings, {"a": 5.0})
    assert got == pytest.approx([0.25, 0.5])


def test_an_answer_read_before_the_daemons_dated_forming_counts_as_zero(soak: Any) -> None:
    # state_age_ms is whole milliseconds: the forming instant may land just after an
    # answer's own clock reading.
    assert soak._answer_times([("a", 0, 1.0, 4.9995)], {"a": 5.0}) == [0.0]


def test_the_daemons_gc_collections_are_read_by_generation(
    soak: Any, start_daemon: Callable[..., DaemonProcess]
) -> None:
    """The soak's ``gc_collections_under_load`` is the difference of two readings of
    the daemon's python_gc_collections_total, one per generation."""
    d = start_daemon("--metrics-listen", "127.0.0.1:0")
    counts = soak._gc_collections(d.metrics_url)
    assert sorted(counts) == ["0", "1", "2"], counts
    assert all(n >= 0 for n in counts.values()) and counts["2"] >= 1  # serve's gc.collect()
