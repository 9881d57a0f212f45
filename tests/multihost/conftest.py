"""Fixtures for tests across real network hosts (namespaces; see netns.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rendezvousd.trainer.demo.netns import Hosts
from tests.multihost.cluster import Cluster, start_cluster
from tests.support import need_hosts


@pytest.fixture
def make_hosts() -> Iterator[Callable[[int], Hosts]]:
    """``make_hosts(n)`` builds n hosts; all are torn down after the test."""
    need_hosts("multi-host tests")
    stack: list[Hosts] = []

    def make(count: int) -> Hosts:
        hosts = Hosts(count)
        stack.append(hosts)
        hosts.build()
        return hosts

    yield make
    for hosts in stack:
        hosts.teardown()


@pytest.fixture
def make_cluster(
    make_hosts: Callable[[int], Hosts], tmp_path: Path
) -> Iterator[Callable[..., Cluster]]:
    """``make_cluster(nodes, *daemon_flags)``: rendezvousd on h0 and ``nodes`` more hosts."""
    made: list[Cluster] = []

    def make(nodes: int, *daemon_flags: str, listen_port: int = 0) -> Cluster:
        cluster = start_cluster(
            make_hosts(nodes + 1), tmp_path, *daemon_flags, listen_port=listen_port
        )
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.stop()
