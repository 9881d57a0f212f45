"""What a client made cold (built, then connected inside a join) shares per process
instead of making per client, still behaving as each client's own (session 36)."""

from __future__ import annotations

import json
from typing import Any

from rendezvousd.client import connection
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
