"""``torchrun --rdzv-backend rendezvousd`` across network hosts: rendezvousd on h0, one
torchrun agent per other host, gloo workers whose TCPStore (MASTER_ADDR) is on node 0's
host, found through the daemon; nothing sets an address by hand."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.multihost.cluster import Cluster
from tests.support import (
    Torchrun,
    standby_replaces_a_killed_node,
    survivors_trained_on,
    three_nodes_stuck_at_step_two,
    torch_steps,
)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("workers", ["cold", "warm"])
def test_torchrun_trains_across_hosts_and_drops_a_cut_off_node(
    make_cluster: Callable[..., Cluster],
    torchrun: Callable[..., Torchrun],
    torch_python: str,
    tmp_path: Path,
    job_id: str,
    workers: str,
) -> None:
    """Three hosts train (--nnodes 2:3); h3's cable is pulled while every worker sits
    in what looks like a stuck collective. The daemon hears h3's silence after its
    heartbeat timeout and tells h1 and h2, whose agents restart their workers into a
    two-node round (no restart spent: --max-restarts 0) that trains to the end. Warm:
    the same with PYTHON_EXEC=rendezvous-python, every worker forked from its host's
    warm server."""
    cluster = make_cluster(3, "--heartbeat-timeout-s", "3")
    d, hosts = cluster.daemon, cluster.hosts
    log = tmp_path / "steps.jsonl"
    prefixes = [hosts[i].command([]) for i in (1, 2, 3)]
    shim = str(Path(torch_python).parent / "rendezvous-python")
    env = {"PYTHON_EXEC": shim} if workers == "warm" else None
    agents = three_nodes_stuck_at_step_two(torchrun, d, job_id, log, prefixes, env)
    cut_at = time.time()
    hosts.link(hosts[3], up=False)
    after = survivors_trained_on(agents, log)
    for a in agents[:2]:
        err = a.stderr()
        # Blamed by name and cause: h3's address and the silence, not a timeout of gloo's.
        assert hosts[3].address in err and "heartbeat" in err, err[-2000:]
    assert all(s["warm"] == (workers == "warm") for s in torch_steps(log))
    print(f"cable pulled -> survivors training again: {min(s['t'] for s in after) - cut_at:.2f} s")


def test_a_spare_torchrun_agent_on_its_own_host_takes_a_lost_hosts_place(
    make_cluster: Callable[..., Cluster],
    torchrun: Callable[..., Torchrun],
    tmp_path: Path,
    job_id: str,
) -> None:
    """--nnodes 2 and three agents, on h1, h2 and h3, started together: the last to
    arrive stands by across the network, and when a node that trains is killed it is
    called into that slot; the other two train a 4-rank world to the end. (Started
    together, not after the job trains: a late agent's torch import under load can
    outlast a short job, which it would then find ended.)"""
    cluster = make_cluster(3)
    d, hosts = cluster.daemon, cluster.hosts
    log = tmp_path / "steps.jsonl"
    worker = ("--steps", "200", "--step-log", str(log))
    agents = [
        torchrun(d, job_id, "2", *worker, max_restarts=1, prefix=hosts[i].command([]))
        for i in (1, 2, 3)
    ]
    standby_replaces_a_killed_node(agents, log, 200)
