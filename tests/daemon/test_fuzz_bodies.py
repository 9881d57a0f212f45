"""Garbage, random and well-formed random bodies on every method: never a crash, never
UNKNOWN, and the daemon is still healthy afterwards."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client import (
    Membership,
    RendezvousClient,
)
from tests.daemon.raw_calls import (
    KIB,
    METHODS,
    SERVICE,
    UNARY,
    _identity,
    assert_healthy,
    bearer,
    join_one,
    raw,
)
from tests.support import DaemonProcess

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
    if t == fd.TYPE_ENUM:
        # proto3 enums are open: a number the schema does not name must be taken too.
        return st.integers(0, 2**31 - 1)
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
