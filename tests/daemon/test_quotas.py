"""Per-job quotas against a real daemon: parked calls per job, barrier names."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from rendezvousd.client import LimitExceeded, RendezvousClient, RendezvousTimeout
from rendezvousd.common.limits import KIB, Limits
from tests.daemon.raw_calls import assert_healthy, join_one, park_joins, wait_members
from tests.daemon.test_limits import limited_daemon
from tests.support import DaemonProcess


@pytest.fixture(scope="module")
def quota(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    yield from limited_daemon(
        tmp_path_factory.mktemp("quota"),
        max_waiters=6,
        max_waiters_per_job=3,
        max_barriers_per_job=2,
    )


def test_one_job_cannot_take_every_waiter_slot(quota: DaemonProcess, job_id: str) -> None:
    hog = job_id + "-hog"
    parked = park_joins(quota, hog, [1, 2, 3], 8)
    try:
        wait_members(quota, hog, 3)
        # The hog's fourth parked call is refused, naming the per-job quota ...
        fourth = park_joins(quota, hog, [4], 8)[0]
        with pytest.raises(Exception) as info:
            fourth.result(timeout=10)
        assert "max_waiters_per_job" in str(info.value)
        # ... while another job still parks (and completes) its joins.
        with RendezvousClient(quota.endpoint, job_id, token=quota.token) as client:
            join_one(client)
            started = time.monotonic()
            with pytest.raises(RendezvousTimeout):
                client.kv_get("never-set", wait=True, timeout=0.5)
            assert time.monotonic() - started >= 0.4, "the other job's waiter was not parked"
    finally:
        for future in parked:
            future.cancel()


def test_per_job_quota_is_freed_when_calls_end(quota: DaemonProcess, job_id: str) -> None:
    with RendezvousClient(quota.endpoint, job_id, token=quota.token) as client:
        join_one(client)
        for _ in range(5):  # more rounds than the quota: each timed-out wait gives its slot back
            with pytest.raises(RendezvousTimeout):
                client.kv_get("never-set", wait=True, timeout=0.2)


def test_barrier_names_per_generation_are_capped(quota: DaemonProcess, job_id: str) -> None:
    with RendezvousClient(quota.endpoint, job_id, token=quota.token) as client:
        join_one(client)
        client.barrier("a")
        client.barrier("b")
        client.barrier("a")  # a known name's next round is no new name
        with pytest.raises(LimitExceeded) as info:
            client.barrier("c")
        assert info.value.limit == "max_barriers_per_job"
        assert "max_barriers_per_job=2" in str(info.value)
    assert_healthy(quota, job_id + "-after")


def test_defaults_fit_the_1_gib_container() -> None:
    """Measured ~26 KiB per parked call; KV snapshot copies ~3x max_kv_bytes."""
    limits = Limits()
    waiters = limits.max_waiters * 26 * KIB
    kv = 3 * limits.max_kv_bytes
    assert waiters + kv + 100 * 1024 * KIB < 1024 * 1024 * KIB
    assert limits.max_waiters_per_job < limits.max_waiters
    assert limits.max_members_per_job <= limits.max_waiters_per_job
