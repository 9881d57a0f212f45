"""``LogThrottle``, the one "a line at most once per interval, the rest counted" rule
of the daemon's repeatable log lines (refused joins and tokens, bad status-page
logins, status-page bugs)."""

from __future__ import annotations

from rendezvousd.common.log_throttle import Due, LogThrottle


def test_a_key_says_its_first_line_then_one_per_interval_with_the_count_held_back() -> None:
    t: LogThrottle[str] = LogThrottle(10.0, keys=4)
    assert t.due("a", 100.0) == Due(0, None)
    assert [t.due("a", now) for now in (100.0, 105.0, 109.9)] == [None, None, None]
    assert t.due("a", 110.0) == Due(3, 10.0)  # the interval's end is due again
    assert t.due("a", 119.0) is None
    assert t.due("a", 125.5) == Due(1, 15.5)  # counted from the last line said
    assert t.due("a", 140.0) == Due(0, 14.5)


def test_keys_are_throttled_apart() -> None:
    t: LogThrottle[str] = LogThrottle(60.0, keys=2)  # full: a known key evicts none
    assert t.due("a", 0.0) == Due(0, None)
    assert t.due("b", 1.0) == Due(0, None)
    assert t.due("a", 2.0) is None
    assert t.due("b", 61.0) == Due(0, 60.0)
    assert t.due("a", 62.0) == Due(1, 62.0)


def test_past_its_bound_a_new_key_forgets_the_key_said_longest_ago() -> None:
    t: LogThrottle[str] = LogThrottle(60.0, keys=2)
    assert t.due("a", 0.0) == Due(0, None)
    assert t.due("b", 1.0) == Due(0, None)
    assert t.due("a", 2.0) is None  # held back: "a" is still the one said longest ago
    assert t.due("a", 70.0) == Due(1, 70.0)  # said again: "b" is the oldest now
    assert t.due("c", 71.0) == Due(0, None)  # forgets "b", keeps "a"
    assert t.due("a", 72.0) is None
    assert t.due("b", 73.0) == Due(0, None)  # forgotten: due at once, its count gone
    assert len(t._said) == 2


def test_one_key_of_none_as_the_single_line_users_hold_it() -> None:
    t: LogThrottle[None] = LogThrottle(10.0)
    assert t.due(None, 5.0) == Due(0, None)
    assert t.due(None, 6.0) is None
    assert t.due(None, 15.0) == Due(1, 10.0)
