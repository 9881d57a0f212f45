"""Fixtures for tests across real network hosts (namespaces; see netns.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.multihost.netns import Hosts, unavailable_reason


@pytest.fixture
def make_hosts() -> Iterator[Callable[[int], Hosts]]:
    """``make_hosts(n)`` builds n hosts; all are torn down after the test."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"multi-host tests need network namespaces: {reason}")
    stack: list[Hosts] = []

    def make(count: int) -> Hosts:
        hosts = Hosts(count)
        stack.append(hosts)
        hosts.build()
        return hosts

    yield make
    for hosts in stack:
        hosts.teardown()
