"""Hostile and buggy callers against a real daemon process: unauthenticated work
has its own budget, calls are bound to the member that made them, rank 0 cannot
hold its slot forever, and key-value memory has a daemon-wide budget."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client import LimitExceeded, RendezvousClient
from tests.daemon.raw_calls import assert_healthy, bearer, join_one, raw, reason_of
from tests.support import DaemonProcess, parallel, wait_for

UNIQUE_ID = b"\x07" * 128


def test_token_less_health_watches_cannot_starve_calls_or_health_checks(
    start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    d = start_daemon("--max-concurrent-rpcs", "40")
    watches = []
    refused = 0
    with grpc.insecure_channel(d.endpoint) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for _ in range(60):  # more than the whole --max-concurrent-rpcs
            call = health.Watch(health_pb2.HealthCheckRequest(), timeout=60)
            try:
                assert next(call).status == health_pb2.HealthCheckResponse.SERVING
                watches.append(call)
            except grpc.RpcError as exc:
                assert exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
                assert reason_of(exc)[1].get("limit") == "max_health_watches"
                refused += 1
        assert 0 < len(watches) < 40 and refused == 60 - len(watches)
        # With every watch slot taken, the probe and the workers still get through.
        for _ in range(5):
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
        assert_healthy(d, job_id)
        for call in watches:
            call.cancel()


def _joined(d: DaemonProcess, job_id: str) -> tuple[RendezvousClient, int]:
    client = RendezvousClient(d.endpoint, job_id, token=d.token)
    return client, join_one(client).generation


def test_a_token_holder_cannot_touch_another_jobs_keys_or_barriers(
    daemon: DaemonProcess, channel: grpc.Channel, job_id: str
) -> None:
    client, gen = _joined(daemon, job_id)
    with client:
        client.kv_set("secret", b"mine")
        scope = {"job_id": job_id, "generation": gen, "rank": 0, "instance_id": "guessed"}
        attempts = {
            "KvGet": pb.KvGetRequest(key="secret", **scope),
            "KvSet": pb.KvSetRequest(key="secret", value=b"theirs", **scope),
            "KvDelete": pb.KvDeleteRequest(key="secret", **scope),
            "KvAdd": pb.KvAddRequest(key="n", delta=1, **scope),
            "KvCompareAndSet": pb.KvCompareAndSetRequest(key="secret", desired=b"x", **scope),
            "Barrier": pb.BarrierRequest(name="b", sequence=1, wait_timeout_ms=500, **scope),
        }
        for method, request in attempts.items():
            for body in (request, _without_instance(request)):
                error = raw(channel, method, body.SerializeToString(), bearer(daemon))
                assert error is not None, f"{method} of a non-member was answered"
                assert error.code() is grpc.StatusCode.ALREADY_EXISTS, method
                assert reason_of(error)[0] == "DUPLICATE_RANK"
        assert client.kv_get("secret", wait=False) == b"mine"
        assert client.get_job().kv_keys == 1
        client.barrier("b", timeout=5)  # the member itself still passes


def _without_instance(request: object) -> object:
    copy = type(request)()  # type: ignore[operator]
    copy.CopyFrom(request)  # type: ignore[attr-defined]
    copy.ClearField("instance_id")  # type: ignore[attr-defined]
    return copy


def test_a_crashed_rank_zero_without_id_frees_its_rank_for_its_restart(
    daemon: DaemonProcess, channel: grpc.Channel, job_id: str
) -> None:
    join = pb.JoinRequest(
        job_id=job_id,
        topology=pb.Topology(num_nodes=1, gpus_per_node=2),
        local_rank=0,
        host="h",
        instance_id="crashed-before-publish",
        wait_timeout_ms=1500,
    )
    join.wait_timeout_ms = 2**32 - 1  # the longest a client can ask
    error = raw(channel, "Join", join.SerializeToString(), bearer(daemon))
    assert error is None  # answered id_required at once, then the worker "crashed"
    # No call holds rank 0 while it owes the id: its restart (a new instance) takes
    # the rank at once, not after the old Join's wait.
    join.instance_id = "restarted"
    error = raw(channel, "Join", join.SerializeToString(), bearer(daemon))
    assert error is None
    # The crashed instance, had it lived, is now another instance's rank 0.
    publish = pb.PublishIdRequest(
        job_id=job_id, generation=1, rank=0, instance_id="crashed-before-publish"
    )
    publish.unique_id = UNIQUE_ID
    error = raw(channel, "PublishId", publish.SerializeToString(), bearer(daemon))
    assert error is not None and reason_of(error)[0] == "DUPLICATE_RANK"
    # The restart, too, left without publishing: the next worker on that host takes
    # rank 0 at once.
    with (
        RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as zero,
        RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as one,
    ):
        joined = parallel(
            [
                lambda: zero.join(num_nodes=1, gpus_per_node=2, local_rank=0, host="h", timeout=10),
                lambda: one.join(num_nodes=1, gpus_per_node=2, local_rank=1, host="h", timeout=10),
            ]
        )
        assert sorted(m.rank for m in joined) == [0, 1], joined


def test_one_job_cannot_take_the_whole_kv_budget(
    start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    """With --max-kv-bytes 8 MiB one job filled all of it (its own limit, 64 MiB, was
    not clamped to the total), and every other job's first KvSet was refused."""
    d = start_daemon("--max-kv-bytes", str(8 << 20))
    hog, _ = _joined(d, job_id + "-hog")
    victim, _ = _joined(d, job_id + "-victim")
    with hog, victim:
        with pytest.raises(LimitExceeded) as info:
            for i in range(1_000):
                hog.kv_set(f"k{i}", b"x" * 32_000)
        assert info.value.limit == "max_kv_bytes_per_job", info.value
        victim.kv_set("mine", b"v" * 1_000)
        assert victim.kv_get("mine", wait=False) == b"v" * 1_000


def test_the_daemon_wide_kv_budget_refuses_and_frees(
    start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    d = start_daemon("--max-kv-bytes", "100000", "--job-ttl-s", "1")
    a, _ = _joined(d, job_id + "-a")
    b, _ = _joined(d, job_id + "-b")
    with a, b:
        # A job may hold half (50,000), and the last eighth (12,500) is kept for jobs
        # holding less than that.
        a.kv_set("big", b"x" * 30_000)
        a.kv_set("big2", b"x" * 15_000)
        b.kv_set("big", b"x" * 30_000)
        with pytest.raises(LimitExceeded) as info:
            b.kv_set("more", b"x" * 15_000)  # 90,014 > 100,000 - 12,500
        assert info.value.limit == "max_kv_bytes" and info.value.code == "RESOURCE_EXHAUSTED"
        assert "max_kv_bytes=100000" in str(info.value)
        a.kv_delete("big2")
        b.kv_set("more", b"x" * 15_000)  # freed by the delete
        with pytest.raises(LimitExceeded) as info:
            b.kv_set("again", b"x" * 15_000)
        assert info.value.limit == "max_kv_bytes_per_job"
        a.leave()
    # The ended job is forgotten after its TTL and gives its bytes back.
    with RendezvousClient(d.endpoint, job_id + "-c", token=d.token) as c:
        join_one(c)

        def stored() -> bool:
            try:
                c.kv_set("fits", b"x" * 30_000)
            except LimitExceeded:
                return False
            return True

        wait_for("the forgotten job's bytes to be freed", stored, timeout=15)
