"""operations.md, "Tokens": token-less health calls have a budget of their own, "at
most 64 concurrent `Check`s and 16 `Watch` streams, beyond which they get
`RESOURCE_EXHAUSTED` at once"; and `--no-reflection` turns reflection off while
health serves on. The numbers are the documented ones, written out: a test reading
the daemon's constants would follow them wherever they went."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from tests.daemon.raw_calls import bearer, reason_of
from tests.support import DaemonProcess

CHECKS = 64  # operations.md: "at most 64 concurrent `Check`s"
WATCHES = 16  # operations.md: "and 16 `Watch` streams"
SERVING = health_pb2.HealthCheckResponse.SERVING
REQUEST = health_pb2.HealthCheckRequest()


def _refused(exc: grpc.RpcError, limit: str, cap: int) -> None:
    assert exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, exc
    assert reason_of(exc)[1].get("limit") == limit, exc
    assert f"{limit}={cap} " in (exc.details() or ""), exc.details()


async def _budgets(endpoint: str) -> None:
    async with grpc.aio.insecure_channel(endpoint) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        # Watches: each answered SERVING (so counted) while the others are held.
        watches = [health.Watch(REQUEST, timeout=60) for _ in range(WATCHES)]
        for watch in watches:
            assert (await asyncio.wait_for(watch.read(), 10)).status == SERVING
        extra = health.Watch(REQUEST, timeout=60)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await asyncio.wait_for(extra.read(), 10)
        _refused(refused.value, "max_health_watches", WATCHES)

        # Checks, with every watch still held: the budgets are separate. A half-open
        # Check (its headers, its body held back) is counted from its headers.
        check = channel.stream_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        held = [check(timeout=60) for _ in range(CHECKS)]
        # One more Check is answered while any of the held ones is not counted yet,
        # and refused once all are (within the test's deadline). A held one that came
        # in while such a probe ran was refused for it: it is opened again. So the probe
        # is refused only once all 64 are counted at the same time.
        deadline = time.monotonic() + 15
        while True:
            held = [call if not call.done() else check(timeout=60) for call in held]
            try:
                answer = await health.Check(REQUEST, timeout=10)
            except grpc.aio.AioRpcError as exc:
                _refused(exc, "max_health_checks", CHECKS)
                break
            assert answer.status == SERVING
            assert time.monotonic() < deadline, f"a Check beyond {CHECKS} held ones was served"
            await asyncio.sleep(0.01)
        # Every held one was let in: given its body now, each is answered.
        for call in held:
            await call.write(REQUEST)
            await call.done_writing()
        for call in held:
            assert (await asyncio.wait_for(call, 10)).status == SERVING
        # Their slots are free again.
        assert (await health.Check(REQUEST, timeout=10)).status == SERVING
        for watch in watches:
            watch.cancel()


def test_token_less_health_serves_64_checks_and_16_watches_at_once_and_refuses_the_next(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    # The body timeout longer than the test: the held Checks stay held.
    d = start_daemon("--request-body-timeout-s", "120")
    asyncio.run(asyncio.wait_for(_budgets(d.endpoint), 60))


def test_no_reflection_turns_reflection_off_and_health_serves_on(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon("--no-reflection")
    list_services = reflection_pb2.ServerReflectionRequest(list_services="*")
    with grpc.insecure_channel(d.endpoint) as channel:
        for service in ("grpc.reflection.v1alpha", "grpc.reflection.v1"):
            stream = channel.stream_stream(
                f"/{service}.ServerReflection/ServerReflectionInfo",
                request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
            )(iter([list_services]), metadata=bearer(d), timeout=5)
            with pytest.raises(grpc.RpcError) as off:
                next(stream)
            assert off.value.code() is grpc.StatusCode.UNIMPLEMENTED, (service, off.value)
        status = health_pb2_grpc.HealthStub(channel).Check(REQUEST, timeout=5)
        assert status.status == SERVING
