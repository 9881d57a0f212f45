"""What a client made cold (built, then connected inside a join) shares per process
instead of making per client, still behaving as each client's own (session 36)."""

from __future__ import annotations

import enum
import json
from typing import Any

import numpy
import pytest

from rendezvousd.client import InvalidRequest, connection
from rendezvousd.client._session import JoinRequest, check_arg, check_keywords
from rendezvousd.client.connection import RetryPolicy, channel_options, service_config


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
