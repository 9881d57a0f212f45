"""The default heartbeat interval: a third of the daemon's timeout, at most 5 s.

Issue 21: 4,096 members beating every second (the old default) were 4,100 calls a
second to the daemon, while a beat only has to land within the daemon's timeout.
"""

from __future__ import annotations

import pytest

from rendezvousd.client._session import DEFAULT_HEARTBEAT_S, LEGACY_HEARTBEAT_S, Session
from rendezvousd.client.connection import RetryPolicy


def _session(daemon_timeout_s: float) -> Session:
    s = Session("127.0.0.1:1", "job", "", RetryPolicy(), 30.0, 30.0)
    s.daemon_heartbeat_timeout = daemon_timeout_s
    return s


@pytest.mark.parametrize(
    ("daemon_timeout_s", "expected"),
    [(10.0, 10.0 / 3), (6.0, 2.0), (30.0, DEFAULT_HEARTBEAT_S), (0.9, 0.3)],
)
def test_the_default_beats_three_times_per_daemon_timeout_and_at_most_every_5_s(
    daemon_timeout_s: float, expected: float
) -> None:
    assert _session(daemon_timeout_s).heartbeat_interval(None) == pytest.approx(expected)


def test_a_daemon_that_does_not_say_its_timeout_gets_the_former_one_second_beat() -> None:
    assert _session(0.0).heartbeat_interval(None) == LEGACY_HEARTBEAT_S


def test_an_explicit_interval_is_kept_unless_it_would_outlast_the_daemon_timeout() -> None:
    assert _session(10.0).heartbeat_interval(0.5) == 0.5
    assert _session(10.0).heartbeat_interval(9.0) == pytest.approx(10.0 / 3)
    assert _session(0.0).heartbeat_interval(9.0) == 9.0
