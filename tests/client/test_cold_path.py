"""What a client made cold (built, then connected inside a join) shares per process
instead of making per client, still behaving as each client's own (session 36)."""

from __future__ import annotations

import enum
import json
from typing import Any

import grpc
import numpy
import pytest
from grpc_health.v1 import health_pb2_grpc

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from rendezvousd.client import AsyncRendezvousClient, InvalidRequest, connection
from rendezvousd.client._session import JoinRequest, check_arg, check_keywords
from rendezvousd.client._stubs import lazy_stub
from rendezvousd.client.connection import (
    HEALTH_SERVICE,
    IDEMPOTENT,
    SERVICE,
    RetryPolicy,
    channel_options,
    service_config,
)
from tests.support import free_port


def _retry_of(config: str) -> dict[str, Any]:
    policy: dict[str, Any] = json.loads(config)["methodConfig"][0]["retryPolicy"]
    return policy


def test_the_shared_service_config_follows_each_clients_retry_policy() -> None:
    # gRPC's own attempts: one more than the client's retries, from 2 to 5.
    expected = {0: 2, 1: 2, 2: 3, 3: 4, 4: 5, 9: 5}
    for retries, attempts in expected.items():
        assert _retry_of(service_config(retries))["maxAttempts"] == attempts
        options = dict(channel_options(RetryPolicy(retries), None))
        config = options["grpc.service_config"]
        assert isinstance(config, str)
        assert _retry_of(config)["maxAttempts"] == attempts
    # Made once per distinct config, then the same object.
    assert service_config(3) is service_config(3)
    assert service_config(1) is service_config(0)
    assert service_config(3) != service_config(1)


def test_the_service_config_cache_is_bounded_whatever_the_retries() -> None:
    for retries in range(200):
        service_config(retries)
    assert connection._service_config.cache_info().currsize <= 4


def test_each_client_gets_its_own_options_list() -> None:
    first = channel_options(RetryPolicy(1), None)
    first.append(("grpc.extra", 1))
    assert ("grpc.extra", 1) not in channel_options(RetryPolicy(1), None)
    assert ("grpc.ssl_target_name_override", "d") in channel_options(RetryPolicy(1), "d")


class _Index:
    """An int-like that is no int: only ``__index__`` (as numpy's ints are)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value

    def __repr__(self) -> str:
        return f"_Index({self.value})"


class _Rank(enum.IntEnum):
    FIRST = 0
    BIG = 2**32


@pytest.mark.parametrize(
    ("value", "fits"),
    [
        (0, True),
        (2**32 - 1, True),
        (2**32, False),
        (-1, False),
        (True, False),  # a bool is an int to isinstance, never to a request field
        (False, False),
        (1.0, False),
        ("1", False),
        (None, False),
        (_Index(7), True),
        (_Index(-1), False),
        (_Rank.FIRST, True),
        (_Rank.BIG, False),
        (numpy.int64(5), True),
        (numpy.uint32(2**32 - 1), True),
        (numpy.int64(2**32), False),
        (numpy.bool_(True), False),
    ],
    ids=repr,
)
def test_an_int_field_takes_exactly_what_it_took_before_the_fast_path(
    value: object, fits: bool
) -> None:
    if fits:
        check_arg("join", "local_rank", value, int)
    else:
        with pytest.raises(InvalidRequest, match=r"join\(\) local_rank="):
            check_arg("join", "local_rank", value, int)


def test_keywords_of_a_join_are_checked_as_before() -> None:
    given = {"num_nodes": 2, "gpus_per_node": 1, "local_rank": 0, "node_rank": None}
    check_keywords("join", JoinRequest, given)
    with pytest.raises(InvalidRequest, match=r"join\(\) num_nodes=True"):
        check_keywords("join", JoinRequest, {**given, "num_nodes": True})
    with pytest.raises(InvalidRequest, match=r"join\(\) node_rank=4294967296"):
        check_keywords("join", JoinRequest, {**given, "node_rank": 2**32})


class _CountingChannel:
    """Hands out what a channel would, counting what it is asked for."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def __getattr__(self, kind: str) -> Any:
        def make(path: str, **kwargs: Any) -> tuple[str, str, dict[str, Any]]:
            self.asked.append(path)
            return (kind, path, kwargs)

        return make


@pytest.mark.parametrize("stub", [pb_grpc.RendezvousStub, health_pb2_grpc.HealthStub])
def test_a_lazy_stub_makes_each_method_as_the_generated_stub_does_on_first_use(
    stub: type,
) -> None:
    eager_channel, lazy_channel = _CountingChannel(), _CountingChannel()
    eager = vars(stub(eager_channel))
    lazy = lazy_stub(stub, lazy_channel)
    assert lazy_channel.asked == []  # nothing made until asked for
    for name, made in eager.items():
        assert getattr(lazy, name) == made  # the same factory, path and arguments
        assert getattr(lazy, name) is getattr(lazy, name)  # made once, then kept
    assert sorted(lazy_channel.asked) == sorted(eager_channel.asked)
    assert set(eager) <= set(dir(lazy))


def test_a_lazy_stub_refuses_a_method_its_service_lacks_as_the_generated_one_does() -> None:
    channel = grpc.insecure_channel("127.0.0.1:1")
    try:
        with pytest.raises(AttributeError) as generated:
            pb_grpc.RendezvousStub(channel).Jion  # noqa: B018
        with pytest.raises(AttributeError) as lazy:
            lazy_stub(pb_grpc.RendezvousStub, channel).Jion  # noqa: B018
        assert str(lazy.value) == str(generated.value)
    finally:
        channel.close()


def test_real_channels_get_the_generated_stubs_methods() -> None:
    channel = grpc.insecure_channel("127.0.0.1:1")
    try:
        eager = pb_grpc.RendezvousStub(channel)
        lazy = lazy_stub(pb_grpc.RendezvousStub, channel)
        for name in ("Join", "Heartbeat", "CallBatches"):
            assert type(getattr(lazy, name)) is type(getattr(eager, name))
            assert getattr(lazy, name)._method == getattr(eager, name)._method
    finally:
        channel.close()


async def test_a_cold_asyncio_client_makes_no_stub_method_before_its_first_call() -> None:
    client = AsyncRendezvousClient("127.0.0.1:1", "cold", token="t" * 32)
    try:
        assert not any(name in vars(client._stub) for name in ("Join", "Heartbeat", "KvGet"))
        assert "Check" not in vars(client._health)
        call = client._stub.Heartbeat  # made now, on the client's own aio channel
        assert isinstance(call, grpc.aio.StreamStreamMultiCallable)
    finally:
        await client.close()


def _explicit_config(channel_retries: int) -> str:
    """The service config as it was up to session 35, every method named: the reference
    the shorter one must resolve as, method by method."""
    retry = {
        "maxAttempts": max(2, min(5, channel_retries + 1)),
        "initialBackoff": "0.1s",
        "maxBackoff": "1s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    safe = sorted(IDEMPOTENT - {"Check", "Heartbeat"})
    return json.dumps(
        {
            "methodConfig": [
                {
                    "name": [{"service": SERVICE, "method": m} for m in safe]
                    + [{"service": HEALTH_SERVICE}],
                    "waitForReady": True,
                    "retryPolicy": retry,
                },
                {
                    "name": [
                        {"service": SERVICE, "method": m}
                        for m in ("KvAdd", "KvCompareAndSet", "KvDelete", "Heartbeat")
                    ],
                    "waitForReady": True,
                },
            ]
        }
    )


def _resolved(config: str, service: str, method: str) -> dict[str, Any]:
    """What gRPC applies to ``service/method`` under ``config``: the entry naming the
    method, else the one naming its whole service, else none. A name given twice makes
    gRPC refuse the whole config."""
    exact: dict[tuple[str, str], dict[str, Any]] = {}
    whole: dict[str, dict[str, Any]] = {}
    for entry in json.loads(config)["methodConfig"]:
        rest = {k: v for k, v in entry.items() if k != "name"}
        for name in entry["name"]:
            if "method" in name:
                assert (name["service"], name["method"]) not in exact
                exact[name["service"], name["method"]] = rest
            else:
                assert name["service"] not in whole
                whole[name["service"]] = rest
    return exact.get((service, method), whole.get(service, {}))


_METHODS = [(SERVICE, m.name) for m in pb.DESCRIPTOR.services_by_name["Rendezvous"].methods] + [
    (HEALTH_SERVICE, m) for m in ("Check", "Watch", "List")
]


@pytest.mark.parametrize("retries", [0, 1, 2, 4])
def test_the_shorter_service_config_resolves_as_the_explicit_one_for_every_method(
    retries: int,
) -> None:
    for service, method in _METHODS:
        assert _resolved(service_config(retries), service, method) == _resolved(
            _explicit_config(retries), service, method
        ), method
    # The point of it: fewer names for each channel's core to parse.
    assert service_config(1).count('"service"') < _explicit_config(1).count('"service"')


def test_every_method_waits_and_is_retried_as_its_kind_says() -> None:
    for service, method in _METHODS:
        config = _resolved(service_config(1), service, method)
        retried = method in IDEMPOTENT - {"Check", "Heartbeat"} or service == HEALTH_SERVICE
        assert ("retryPolicy" in config) is retried, method
        waits = retried or method in ("KvAdd", "KvCompareAndSet", "KvDelete", "Heartbeat")
        assert config.get("waitForReady", False) is waits, method
    assert not _resolved(service_config(1), SERVICE, "CallBatches")


def _outcome_at_a_dead_port(config: str, method: str) -> grpc.StatusCode:
    options = dict(channel_options(RetryPolicy(1), None))
    options["grpc.service_config"] = config
    channel = grpc.insecure_channel(f"127.0.0.1:{free_port()}", options=list(options.items()))
    try:
        service = HEALTH_SERVICE if method == "Check" else SERVICE
        path = f"/{service}/{method}"
        try:
            if method == "CallBatches":
                for _ in channel.stream_stream(path)(iter(()), timeout=0.4):
                    pass
            else:
                channel.unary_unary(path)(b"", timeout=0.4)
        except grpc.RpcError as exc:
            code: grpc.StatusCode = exc.code()
            return code
        raise AssertionError(f"{method} was answered at a port where nothing listens")
    finally:
        channel.close()


@pytest.mark.parametrize("method", ["Join", "KvAdd", "Check", "CallBatches"])
def test_grpc_takes_the_shorter_config_and_waits_as_with_the_explicit_one(method: str) -> None:
    """A config gRPC's core refused would fail every call at once: the waiting methods
    would not wait out their deadline, as they do under both."""
    shorter = _outcome_at_a_dead_port(service_config(1), method)
    assert shorter == _outcome_at_a_dead_port(_explicit_config(1), method)
    waits = method != "CallBatches"
    expected = grpc.StatusCode.DEADLINE_EXCEEDED if waits else grpc.StatusCode.UNAVAILABLE
    assert shorter == expected


def test_grpc_itself_retries_exactly_the_idempotent_methods() -> None:
    """What gRPC does with the service config, not this file's model of its rule (a
    method's own entry over its service's): a server that answers every call
    UNAVAILABLE counts each method's attempts. A non-idempotent call (KvAdd, a stream)
    re-sent after its answer was lost would act twice."""
    from concurrent import futures

    attempts: dict[str, int] = {}

    def handler(details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        def refuse(_request: object, context: grpc.ServicerContext) -> None:
            attempts[details.method] = attempts.get(details.method, 0) + 1
            context.abort(grpc.StatusCode.UNAVAILABLE, "refused on purpose")

        return grpc.stream_stream_rpc_method_handler(refuse)

    class Refuser(grpc.GenericRpcHandler):
        service = staticmethod(handler)

    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers([Refuser()])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    methods = [f"/{SERVICE}/{m.name}" for m in pb.DESCRIPTOR.services_by_name["Rendezvous"].methods]
    methods.append(f"/{HEALTH_SERVICE}/Check")
    try:
        options = channel_options(RetryPolicy(1), None)
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            for method in methods:
                # A stream-stream call of one message: the same attempt for any kind.
                call = channel.stream_stream(method)(iter([b""]), timeout=10)
                with pytest.raises(grpc.RpcError) as failed:
                    list(call)
                assert failed.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    finally:
        server.stop(None)
    retried = {m for m in methods if m.rsplit("/", 1)[1] in IDEMPOTENT - {"Heartbeat"}}
    assert {m: attempts.get(m) for m in methods} == {m: 2 if m in retried else 1 for m in methods}
    assert len(retried) > 5  # the retried set is not empty by accident
