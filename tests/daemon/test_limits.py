"""Every daemon limit, bad job ids and garbage bodies, against real daemon processes.

A limit answers RESOURCE_EXHAUSTED fast (with reason LIMIT_EXCEEDED and the
limit's name when the daemon itself refuses), and the daemon stays healthy.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from rendezvousd.client import (
    InvalidRequest,
    LimitExceeded,
    Membership,
    NotFound,
    RendezvousClient,
    RendezvousTimeout,
)
from tests.support import DaemonProcess, members, spawn_daemon, wait_for

KIB = 1024
SERVICE = "rendezvous.v1.Rendezvous"
METHODS = list(pb.DESCRIPTOR.services_by_name["Rendezvous"].methods_by_name)
UNARY = [m for m in METHODS if m != "Heartbeat"]


def _identity(data: bytes) -> bytes:
    return data


def bearer(d: DaemonProcess) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {d.token}")]


def reason_of(exc: grpc.RpcError) -> tuple[str, dict[str, str]]:
    for key, value in exc.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            for detail in status_pb2.Status.FromString(value).details:
                info = error_details_pb2.ErrorInfo()
                if detail.Unpack(info):
                    return info.reason, dict(info.metadata)
    return "", {}


def raw(
    channel: grpc.Channel, method: str, body: bytes, metadata: Any, timeout: float = 5.0
) -> grpc.RpcError | None:
    """The error of one generic unary call, or None when it succeeded."""
    try:
        channel.unary_unary(
            f"/{SERVICE}/{method}", request_serializer=_identity, response_deserializer=_identity
        )(body, metadata=metadata, timeout=timeout)
    except grpc.RpcError as exc:
        return exc
    return None


def assert_healthy(d: DaemonProcess, job_id: str) -> None:
    """SERVING, and a fresh 1x1 join completes."""
    assert d.proc.poll() is None, "the daemon exited"
    with grpc.insecure_channel(d.endpoint) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert status.status == health_pb2.HealthCheckResponse.SERVING
    with RendezvousClient(d.endpoint, job_id, token=d.token) as client:
        m = client.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        assert m.world_size == 1


def join_one(client: RendezvousClient) -> Membership:
    return client.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)


@pytest.fixture(scope="module")
def channel(daemon: DaemonProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(daemon.endpoint) as ch:
        yield ch


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = spawn_daemon(
        tmp_path_factory.mktemp("limited"),
        "--max-keys-per-job",
        "4",
        "--max-members-per-job",
        "8",
        "--max-waiters",
        "2",
    )
    yield d
    d.kill()


# -- message and metadata size ---------------------------------------------------


def test_oversized_message_is_resource_exhausted(
    daemon: DaemonProcess, channel: grpc.Channel, job_id: str
) -> None:
    with RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as client:
        m = join_one(client)
        with pytest.raises(LimitExceeded) as info:
            client.kv_set("big", b"v" * (70 * KIB))
        assert info.value.code == "RESOURCE_EXHAUSTED"
        assert info.value.limit == ""  # grpc refused it before the daemon's code ran
        request = pb.KvSetRequest(
            job_id=job_id, generation=m.generation, rank=0, key="big", value=b"v" * (70 * KIB)
        )
        error = raw(channel, "KvSet", request.SerializeToString(), bearer(daemon))
        assert error is not None and error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        # Nothing was stored, and the membership still works.
        assert client.get_job().kv_keys == 0
        client.kv_set("small", b"v")
    # Unauthenticated oversized bodies are refused too (size before auth or auth first).
    error = raw(channel, "ListJobs", b"\0" * (100 * KIB), None)
    assert error is not None
    assert error.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED)
    assert_healthy(daemon, job_id + "-after")


@pytest.mark.parametrize("size_kib", [20, 64])
def test_oversized_metadata_is_refused(
    daemon: DaemonProcess, channel: grpc.Channel, job_id: str, size_kib: int
) -> None:
    # The daemon sets grpc.max_metadata_size = 16 KiB (hard limit 20 KiB): grpc-core
    # refuses bigger headers with RESOURCE_EXHAUSTED before any handler or auth runs.
    big = [("x-padding", "a" * (size_kib * KIB))]
    for metadata in (big + bearer(daemon), bearer(daemon) + big, big):
        error = raw(channel, "ListJobs", b"", metadata)
        assert error is not None, "a 20 KiB header was accepted"
        assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, error.code()
    health = health_pb2_grpc.HealthStub(channel)
    with pytest.raises(grpc.RpcError) as info:
        health.Check(health_pb2.HealthCheckRequest(), metadata=big, timeout=5)
    assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert raw(channel, "ListJobs", b"", bearer(daemon)) is None
    assert_healthy(daemon, job_id)


# -- key-value limits ----------------------------------------------------------------


def test_kv_key_and_value_sizes(daemon: DaemonProcess, job_id: str) -> None:
    with RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as client:
        join_one(client)
        client.kv_set("k" * 512, b"")  # the largest key
        with pytest.raises(LimitExceeded) as info:
            client.kv_set("k" * 513, b"")
        assert (info.value.reason, info.value.limit) == ("LIMIT_EXCEEDED", "max_key_bytes")
        assert info.value.code == "RESOURCE_EXHAUSTED"
        # Bytes, not characters: 171 three-byte characters are 513 bytes.
        with pytest.raises(LimitExceeded) as info:
            client.kv_get("€" * 171, wait=False)
        assert info.value.limit == "max_key_bytes"
        for call in (
            lambda: client.kv_add("k" * 513),
            lambda: client.kv_delete("k" * 513),
            lambda: client.kv_compare_and_set("k" * 513, None, b"x"),
        ):
            with pytest.raises(LimitExceeded) as info:
                call()
            assert info.value.limit == "max_key_bytes"

        client.kv_set("v", b"x" * (32 * KIB))  # the largest value
        with pytest.raises(LimitExceeded) as info:
            client.kv_set("v", b"x" * (32 * KIB + 1))
        assert (info.value.reason, info.value.limit) == ("LIMIT_EXCEEDED", "max_value_bytes")
        with pytest.raises(LimitExceeded) as info:
            client.kv_compare_and_set("v", b"nope", b"y" * (32 * KIB + 1))
        assert info.value.limit == "max_value_bytes"
        assert client.kv_get("v", wait=False) == b"x" * (32 * KIB)  # unchanged

        for bad in ("", "a\x00b", "new\nline"):
            with pytest.raises(InvalidRequest) as bad_info:
                client.kv_set(bad, b"v")
            assert bad_info.value.reason == "INVALID_ARGUMENT"


def test_keys_per_job(limited: DaemonProcess, job_id: str) -> None:
    with RendezvousClient(limited.endpoint, job_id, token=limited.token) as client:
        join_one(client)
        for i in range(4):
            client.kv_set(f"k{i}", b"v")
        for call in (
            lambda: client.kv_set("k4", b"v"),
            lambda: client.kv_add("counter"),
            lambda: client.kv_compare_and_set("k4", None, b"v"),
        ):
            with pytest.raises(LimitExceeded) as info:
                call()
            assert (info.value.reason, info.value.limit) == ("LIMIT_EXCEEDED", "max_keys_per_job")
        client.kv_set("k0", b"replaced")  # replacing is not a new key
        assert client.get_job().kv_keys == 4
        assert client.kv_delete("k1")
        client.kv_set("k4", b"v")
        assert client.get_job().kv_keys == 4


# -- jobs, members, waiters --------------------------------------------------------


def test_max_jobs(start_daemon: Callable[..., DaemonProcess], job_id: str) -> None:
    d = start_daemon("--max-jobs", "2")
    clients = [RendezvousClient(d.endpoint, f"{job_id}-{i}", token=d.token) for i in range(3)]
    try:
        join_one(clients[0])
        join_one(clients[1])
        started = time.monotonic()
        with pytest.raises(LimitExceeded) as info:
            join_one(clients[2])
        assert time.monotonic() - started < 5
        assert (info.value.reason, info.value.limit) == ("LIMIT_EXCEEDED", "max_jobs")
        # A join of an existing job still works (retry of rank 0 of job 0 is idempotent).
        assert clients[0].get_job().summary.world_size == 1
        assert len(clients[0].list_jobs()) == 2
        with pytest.raises(NotFound):
            clients[0].get_job(f"{job_id}-2")
    finally:
        for client in clients:
            client.close()


def test_max_members_per_job(limited: DaemonProcess, job_id: str) -> None:
    with RendezvousClient(limited.endpoint, job_id, token=limited.token) as client:
        started = time.monotonic()
        with pytest.raises(LimitExceeded) as info:
            client.join(num_nodes=2, gpus_per_node=8, local_rank=0, node_rank=0, timeout=30)
        assert time.monotonic() - started < 5
        assert (info.value.reason, info.value.limit) == ("LIMIT_EXCEEDED", "max_members_per_job")
        assert "16" in str(info.value)
        with pytest.raises(NotFound):  # the refused join created no job
            client.get_job()


def _park_joins(d: DaemonProcess, job_id: str, ranks: list[int], world: int) -> list[Any]:
    """Start raw Join calls of a 1 x ``world`` job that park (rank 0 never comes)."""
    channel = grpc.insecure_channel(d.endpoint)
    stub = pb_grpc.RendezvousStub(channel)
    futures = []
    for rank in ranks:
        request = pb.JoinRequest(
            job_id=job_id,
            topology=pb.Topology(num_nodes=1, gpus_per_node=world),
            node_rank=0,
            local_rank=rank,
            host="parked",
            instance_id=f"parked-{rank}",
            wait_timeout_ms=30_000,
        )
        futures.append(stub.Join.future(request, metadata=bearer(d), timeout=35))
    return futures


def _wait_members(d: DaemonProcess, job_id: str, n: int) -> None:
    wait_for(f"{n} parked joins to register", lambda: len(members(d, job_id)) == n)


def _failed(d: DaemonProcess, job_id: str) -> bool:
    with RendezvousClient(d.endpoint, job_id, token=d.token) as probe:
        return bool(probe.get_job().summary.state == pb.JOB_STATE_FAILED)


def test_max_waiters(limited: DaemonProcess, job_id: str) -> None:
    with RendezvousClient(limited.endpoint, job_id, token=limited.token) as client:
        join_one(client)
        # Two parked joins of another job fill --max-waiters 2 (observable via GetJob).
        parked = _park_joins(limited, job_id + "-world", [1, 2], 3)
        try:
            _wait_members(limited, job_id + "-world", 2)
            started = time.monotonic()
            with pytest.raises(LimitExceeded) as info:
                client.kv_get("never-set", wait=True, timeout=20)
            assert time.monotonic() - started < 3, "the third waiter was not refused fast"
            assert (info.value.reason, info.value.limit) == ("LIMIT_EXCEEDED", "max_waiters")
            # Calls that do not wait are unaffected.
            client.kv_set("k", b"v")
            assert client.kv_get("k", wait=True, timeout=5) == b"v"
        finally:
            for future in parked:
                future.cancel()
        # Cancelled waiters free their slots: waiting works again.
        # (a cancelled parked Join is a dead joiner: it fails that generation)
        wait_for(
            "the cancelled joins to fail their job", lambda: _failed(limited, job_id + "-world")
        )
        with pytest.raises(RendezvousTimeout):
            client.kv_get("never-set", wait=True, timeout=0.2)


def test_join_refused_by_max_waiters_does_not_hold_the_rank(
    limited: DaemonProcess, job_id: str
) -> None:
    parked = _park_joins(limited, job_id + "-full", [1, 2], 3)
    probe = RendezvousClient(limited.endpoint, job_id, token=limited.token)
    try:
        _wait_members(limited, job_id + "-full", 2)
        with pytest.raises(LimitExceeded):
            probe.join(num_nodes=1, gpus_per_node=2, node_rank=0, local_rank=1, timeout=5)
    finally:
        for future in parked:
            future.cancel()
    try:
        # The refused rank must be free: a retry parks (and times out), no DUPLICATE_RANK.
        wait_for(
            "the cancelled joins to fail their job", lambda: _failed(limited, job_id + "-full")
        )
        with pytest.raises(RendezvousTimeout):
            probe.join(num_nodes=1, gpus_per_node=2, node_rank=0, local_rank=1, timeout=0.5)
        assert len(probe.get_job().members) == 0
    finally:
        probe.close()


def test_max_concurrent_rpcs(start_daemon: Callable[..., DaemonProcess], job_id: str) -> None:
    d = start_daemon("--max-concurrent-rpcs", "4")
    parked = _park_joins(d, job_id, [1, 2, 3, 4], 5)
    with grpc.insecure_channel(d.endpoint) as ch:
        try:
            deadline = time.monotonic() + 10
            while True:  # until all four are in flight
                started = time.monotonic()
                error = raw(ch, "ListJobs", b"", bearer(d))
                elapsed = time.monotonic() - started
                if error is not None:
                    break
                assert time.monotonic() < deadline, "four parked calls never filled the limit"
                time.sleep(0.02)
            assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert elapsed < 2.0, f"refusal took {elapsed:.2f} s"
            # A fifth waiting call is refused just as fast.
            fifth = _park_joins(d, job_id, [0], 5)[0]
            with pytest.raises(grpc.RpcError) as info:
                fifth.result(timeout=5)
            assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert all(not f.done() for f in parked), "a parked call ended early"
        finally:
            for future in parked:
                future.cancel()
        deadline = time.monotonic() + 10
        while raw(ch, "ListJobs", b"", bearer(d)) is not None:
            assert time.monotonic() < deadline, "the daemon did not recover after the overload"
            time.sleep(0.05)
    assert_healthy(d, job_id + "-after")


# -- job ids ---------------------------------------------------------------------------

BAD_JOB_IDS = [
    "x" * 129,
    "",
    ".",
    "..",
    "../x",
    "a/b",
    "/abs",
    "a\\b",
    "a\x00b",
    "new\nline",
    "tab\there",
    "del\x7f",
    "sp ace",
    "jöb",
    "a:b",
]


@pytest.mark.parametrize("bad", BAD_JOB_IDS, ids=repr)
def test_bad_job_ids(daemon: DaemonProcess, channel: grpc.Channel, bad: str) -> None:
    with RendezvousClient(daemon.endpoint, bad, token=daemon.token) as client:
        with pytest.raises(InvalidRequest) as info:
            client.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=5)
        assert info.value.reason == "INVALID_JOB_ID"
        assert info.value.code == "INVALID_ARGUMENT"
        # Control characters are escaped, never echoed raw into messages (and logs).
        assert not any(c in info.value.message for c in "\x00\n\t\x7f")
        with pytest.raises(InvalidRequest) as info:
            client.get_job(bad or None)
        if bad:
            assert info.value.reason == "INVALID_JOB_ID"
    for method, request in (
        ("GetJob", pb.GetJobRequest(job_id=bad)),
        ("AbortJob", pb.AbortJobRequest(job_id=bad)),
        ("KvGet", pb.KvGetRequest(job_id=bad, generation=1, key="k")),
    ):
        error = raw(channel, method, request.SerializeToString(), bearer(daemon))
        assert error is not None and error.code() is grpc.StatusCode.INVALID_ARGUMENT, method
        assert reason_of(error)[0] == "INVALID_JOB_ID", method
    listed = raw_list_jobs(channel, daemon)
    assert bad not in listed


def raw_list_jobs(channel: grpc.Channel, d: DaemonProcess) -> list[str]:
    stub = pb_grpc.RendezvousStub(channel)
    return [j.job_id for j in stub.ListJobs(pb.ListJobsRequest(), metadata=bearer(d)).jobs]


def test_longest_job_id_is_valid(daemon: DaemonProcess, channel: grpc.Channel) -> None:
    error = raw(
        channel, "GetJob", pb.GetJobRequest(job_id="x" * 128).SerializeToString(), bearer(daemon)
    )
    assert error is not None and error.code() is grpc.StatusCode.NOT_FOUND
    assert reason_of(error)[0] == "JOB_NOT_FOUND"


# -- garbage bodies --------------------------------------------------------------------

OK_OR_CLIENT_ERROR = {
    None,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}


def heartbeat_raw(
    channel: grpc.Channel, bodies: list[bytes], d: DaemonProcess
) -> grpc.StatusCode | None:
    stream = channel.stream_stream(
        f"/{SERVICE}/Heartbeat", request_serializer=_identity, response_deserializer=_identity
    )(iter(bodies), metadata=bearer(d), timeout=5)
    try:
        for _ in stream:
            pass
    except grpc.RpcError as exc:
        code: grpc.StatusCode = exc.code()
        return code
    return None


def _code(error: grpc.RpcError | None) -> grpc.StatusCode | None:
    return None if error is None else error.code()


NASTY = [
    b"\x0b" * 20_000,  # 20k nested start-group tags (CVE-2024-7254 style)
    b"\x12\x80\x80\x80\x80\x10",  # a length-delimited field claiming 4 GiB
    b"\xff" * 64,  # an over-long varint tag
    b"\x0a\x03\xff\xfe\xfd",  # job_id with invalid UTF-8
    b"\x08" + b"\xff" * 10 + b"\x01",  # an 11-byte varint
    b"\x07",  # field 0
    bytes(range(256)),
]


def test_nasty_bodies_never_crash(
    daemon: DaemonProcess, channel: grpc.Channel, job_id: str
) -> None:
    nested = b""
    for _ in range(200):  # deep nesting of a length-delimited field 2 (topology)
        nested = b"\x12" + _varint(len(nested)) + nested
    bodies = [*NASTY, nested, os.urandom(60 * KIB)]
    bad = {}
    for method in UNARY:
        for i, body in enumerate(bodies):
            code = _code(raw(channel, method, body, bearer(daemon)))
            if code not in OK_OR_CLIENT_ERROR:
                bad[(method, i)] = code
    for i, body in enumerate(bodies):
        code = heartbeat_raw(channel, [body], daemon)
        if code not in OK_OR_CLIENT_ERROR:
            bad[("Heartbeat", i)] = code
        for method, shape in OTHER_SERVICES.items():
            code = other_raw(channel, method, shape, body, daemon)
            if code not in OK_OR_CLIENT_ERROR:
                bad[(method, i)] = code
    assert not bad, f"unexpected status codes: {bad}"
    # Garbage is the caller's mistake, on every service and streaming shape.
    garbage = b"\xff" * 64
    assert _code(raw(channel, "ListJobs", garbage, bearer(daemon))) is (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    assert heartbeat_raw(channel, [garbage], daemon) is grpc.StatusCode.INVALID_ARGUMENT
    for method, shape in OTHER_SERVICES.items():
        code = other_raw(channel, method, shape, garbage, daemon)
        assert code is grpc.StatusCode.INVALID_ARGUMENT, (method, code)
    assert "Traceback" not in daemon.log()
    assert_healthy(daemon, job_id)


OTHER_SERVICES = {
    "/grpc.health.v1.Health/Check": "unary",
    "/grpc.health.v1.Health/Watch": "unary_stream",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": "stream_stream",
}


def other_raw(
    channel: grpc.Channel, method: str, shape: str, body: bytes, d: DaemonProcess
) -> grpc.StatusCode | None:
    """Health and reflection with a raw body; streams are read for their first answer."""
    try:
        if shape == "unary":
            channel.unary_unary(
                method, request_serializer=_identity, response_deserializer=_identity
            )(body, metadata=bearer(d), timeout=5)
            return None
        if shape == "unary_stream":
            call = channel.unary_stream(
                method, request_serializer=_identity, response_deserializer=_identity
            )(body, metadata=bearer(d), timeout=5)
        else:
            call = channel.stream_stream(
                method, request_serializer=_identity, response_deserializer=_identity
            )(iter([body]), metadata=bearer(d), timeout=5)
        for _ in call:
            call.cancel()
            break
    except grpc.RpcError as exc:
        code: grpc.StatusCode = exc.code()
        return None if code is grpc.StatusCode.CANCELLED else code
    return None


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


@pytest.mark.parametrize("method", METHODS)
@settings(
    max_examples=25,
    deadline=None,
    derandomize=False,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(body=st.one_of(st.binary(max_size=600), st.builds(os.urandom, st.integers(0, 300))))
def test_random_bodies_never_unknown(
    daemon: DaemonProcess, channel: grpc.Channel, method: str, body: bytes
) -> None:
    if method == "Heartbeat":
        code = heartbeat_raw(channel, [body, body], daemon)
    else:
        code = _code(raw(channel, method, body, bearer(daemon), timeout=3))
    assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (method, code)
    assert code in OK_OR_CLIENT_ERROR, (method, code)


def _scalar(field: Any, live: dict[str, Any]) -> st.SearchStrategy[Any]:
    t = field.type
    if field.name in live:
        return st.one_of(st.just(live[field.name]), _scalar_any(t, field.name))
    return _scalar_any(t, field.name)


def _scalar_any(t: int, name: str) -> st.SearchStrategy[Any]:
    fd = pb.DESCRIPTOR.message_types_by_name["JoinRequest"].fields_by_name["job_id"]
    if name == "wait_timeout_ms":
        return st.integers(1, 100)  # 0 would mean the daemon's 600 s default
    if t == fd.TYPE_STRING:
        return st.text(max_size=40)
    if t == fd.TYPE_BYTES:
        return st.binary(max_size=200)
    if t == fd.TYPE_BOOL:
        return st.booleans()
    if t in (fd.TYPE_UINT32,):
        return st.integers(0, 2**32 - 1)
    if t in (fd.TYPE_UINT64,):
        return st.integers(0, 2**64 - 1)
    if t in (fd.TYPE_INT64,):
        return st.integers(-(2**63), 2**63 - 1)
    raise AssertionError(f"no strategy for field type {t} ({name})")


def _message(descriptor: Any, live: dict[str, Any]) -> st.SearchStrategy[Any]:
    cls = getattr(pb, descriptor.name)
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        if field.message_type is not None:
            fields[field.name] = _message(field.message_type, live)
        else:
            fields[field.name] = _scalar(field, live)
    return st.fixed_dictionaries({}, optional=fields).map(lambda kw: cls(**kw))


@pytest.fixture(scope="module")
def live_member(daemon: DaemonProcess) -> Iterator[tuple[RendezvousClient, Membership]]:
    client = RendezvousClient(daemon.endpoint, "fuzz-live", token=daemon.token)
    m = join_one(client)
    yield client, m
    client.close()


@pytest.mark.parametrize("method", UNARY)
@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_well_formed_random_requests_never_unknown(
    daemon: DaemonProcess,
    channel: grpc.Channel,
    live_member: tuple[RendezvousClient, Membership],
    method: str,
    data: st.DataObject,
) -> None:
    # Valid protobuf with random field values, often naming the live job, generation
    # and rank so the calls reach past validation into the state machine.
    _, m = live_member
    descriptor = pb.DESCRIPTOR.services_by_name["Rendezvous"].methods_by_name[method].input_type
    live = {"job_id": m.job_id, "generation": m.generation, "rank": m.rank, "key": "k"}
    request = data.draw(_message(descriptor, live))
    code = _code(raw(channel, method, request.SerializeToString(), bearer(daemon), timeout=3))
    assert code in OK_OR_CLIENT_ERROR, (method, code, request)


def test_daemon_survived_the_fuzzing(daemon: DaemonProcess, job_id: str) -> None:
    assert_healthy(daemon, job_id)
    log = daemon.log()
    assert "Traceback" not in log, log[-3000:]
    assert "Unexpected" not in log, log[-3000:]


def test_limited_daemon_stayed_healthy(limited: DaemonProcess, job_id: str) -> None:
    assert_healthy(limited, job_id)
    assert "Traceback" not in limited.log()
