"""Every wait is capped on the daemon (--max-wait-s), whatever the call asks, and a
peer whose Join times out while rank 0 owes the id is told that, not "missing ranks []"."""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from tests.daemon.raw_calls import bearer, raw, reason_of
from tests.support import DaemonProcess, members, wait_for

LONGEST_MS = 2**32 - 1  # wait_timeout_ms is a uint32: ~49.7 days


def _join(job_id: str, local_rank: int, wait_ms: int, instance: str) -> bytes:
    return pb.JoinRequest(
        job_id=job_id,
        topology=pb.Topology(num_nodes=1, gpus_per_node=2),
        local_rank=local_rank,
        host="h",
        instance_id=instance,
        wait_timeout_ms=wait_ms,
    ).SerializeToString()


def test_a_join_asking_for_days_waits_at_most_max_wait_s(
    start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    d = start_daemon("--max-wait-s", "1")
    with grpc.insecure_channel(d.endpoint) as ch:
        started = time.monotonic()
        error = raw(ch, "Join", _join(job_id, 1, LONGEST_MS, "r1"), bearer(d), timeout=30)
        waited = time.monotonic() - started
    assert error is not None and error.code() is grpc.StatusCode.DEADLINE_EXCEEDED, error
    assert reason_of(error)[0] == "WORLD_INCOMPLETE"
    assert waited < 10, f"waited {waited:.1f} s, not the 1 s cap"


def test_rank_zero_owing_the_id_holds_its_rank_at_most_max_wait_s(
    start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    d = start_daemon("--max-wait-s", "1")
    with grpc.insecure_channel(d.endpoint) as ch:
        # Answered id_required at once; it asked to be waited for ~49.7 days.
        assert raw(ch, "Join", _join(job_id, 0, LONGEST_MS, "r0"), bearer(d)) is None
    assert len(members(d, job_id)) == 1
    wait_for("rank 0 to be freed", lambda: members(d, job_id) == [], timeout=10)


def test_a_peer_timing_out_is_told_rank_zero_never_published_the_id(
    daemon: DaemonProcess, channel: grpc.Channel, job_id: str
) -> None:
    assert raw(channel, "Join", _join(job_id, 0, 60_000, "r0"), bearer(daemon)) is None
    error = raw(channel, "Join", _join(job_id, 1, 500, "r1"), bearer(daemon))
    assert error is not None and error.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    reason, meta = reason_of(error)
    assert reason == "WORLD_INCOMPLETE" and meta.get("ranks") == "0", meta
    message = error.details() or ""
    assert "rank 0 joined but never published the id" in message, message
    assert "missing ranks []" not in message, message
    assert job_id in message, message
