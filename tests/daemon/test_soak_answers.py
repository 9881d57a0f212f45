"""benchmarks/soak.py's answer times: a barrier round's answers counted from its last
arrival, a join's from its generation's forming, and what has no reference left out.
A wrong reference (the first arrival, or each call's own start) would report the
wait for peers as the daemon's answer time, or hide it. And how it reads the daemon's
GC collections."""

from __future__ import annotations

import asyncio
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


def test_a_leave_that_raises_is_counted_as_an_error(
    soak: Any, start_daemon: Callable[..., DaemonProcess]
) -> None:
    """The soak's teardown gathered every leave() with return_exceptions=True and
    dropped what came back: a leave that raised was in no count. Here a real one
    raises (the client used on an event loop other than its own, which leave()
    refuses before anything is torn down) and is counted, by its code."""
    from rendezvousd.client import AsyncRendezvousClient

    d = start_daemon()
    own = asyncio.new_event_loop()
    try:

        async def joined() -> Any:
            c = AsyncRendezvousClient(d.endpoint, "soak-leave", token_file=str(d.token_file))
            await c.join(
                num_nodes=1, gpus_per_node=1, node_rank=0, local_rank=0, host="h0", timeout=30
            )
            return c

        client = own.run_until_complete(asyncio.wait_for(joined(), 60))
        errors: dict[str, int] = {}
        said: list[str] = []

        def err(exc: BaseException, op: str) -> None:
            code = getattr(exc, "code", None) or type(exc).__name__
            errors[code] = errors.get(code, 0) + 1
            said.append(f"{op}: {exc}")

        _seconds, failed = asyncio.run(asyncio.wait_for(soak._leave_all([client], err), 60))
        assert failed == 1
        assert sum(errors.values()) == 1, errors
        assert said[0].startswith("leave: ") and "soak-leave" in said[0]
        # On its own loop the same client still leaves and closes cleanly.
        own.run_until_complete(asyncio.wait_for(client.leave(), 60))
        own.run_until_complete(asyncio.wait_for(client.close(), 60))
    finally:
        own.close()
