"""Topology math, validation and the device-count rule (seed Phase 44 catalogue)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rendezvousd.trainer.config import DistributedConfig, RendezvousTransport
from rendezvousd.trainer.errors import ConfigError
from rendezvousd.trainer.topology import MultiNodeTopology, required_local_devices

# No per-example deadline: the test machine is shared and timing would only add flakes.
counts = st.integers(min_value=1, max_value=16)


def test_multi_node_topology_derives_global_rank_and_world_size() -> None:
    topo = MultiNodeTopology(num_nodes=2, gpus_per_node=4, node_rank=1, local_rank=2)
    assert topo.world_size == 8
    assert topo.rank == 6
    assert topo.is_multi_node
    assert not topo.is_global_rank_zero


@settings(deadline=None)
@given(num_nodes=counts, gpus=counts)
def test_node_and_local_ranks_map_one_to_one_onto_global_ranks(num_nodes: int, gpus: int) -> None:
    ranks = [
        MultiNodeTopology(num_nodes, gpus, node, local).rank
        for node in range(num_nodes)
        for local in range(gpus)
    ]
    assert sorted(ranks) == list(range(num_nodes * gpus))


@settings(deadline=None)
@given(data=st.data(), num_nodes=counts, gpus=counts)
def test_from_global_rank_inverts_rank(data: st.DataObject, num_nodes: int, gpus: int) -> None:
    rank = data.draw(st.integers(min_value=0, max_value=num_nodes * gpus - 1))
    topo = MultiNodeTopology.from_global_rank(rank, num_nodes, gpus)
    assert topo.rank == rank
    assert topo.world_size == num_nodes * gpus
    assert (topo.node_rank, topo.local_rank) == divmod(rank, gpus)


@settings(deadline=None)
@given(num_nodes=st.integers(2, 8), gpus=counts)
def test_exactly_one_global_rank_zero_not_every_local_rank_zero(num_nodes: int, gpus: int) -> None:
    world = [
        MultiNodeTopology(num_nodes, gpus, node, local)
        for node in range(num_nodes)
        for local in range(gpus)
    ]
    zeros = [t for t in world if t.is_global_rank_zero]
    assert [(t.node_rank, t.local_rank) for t in zeros] == [(0, 0)]
    # The bug the rule guards against: one "rank zero" per node.
    assert sum(t.local_rank == 0 for t in world) == num_nodes


@pytest.mark.parametrize(
    ("kwargs", "quoted"),
    [
        ({"num_nodes": 2, "gpus_per_node": 2, "node_rank": 3, "local_rank": 0}, "node_rank=3"),
        ({"num_nodes": 2, "gpus_per_node": 2, "node_rank": -1, "local_rank": 0}, "node_rank=-1"),
        ({"num_nodes": 2, "gpus_per_node": 2, "node_rank": 0, "local_rank": 2}, "local_rank=2"),
        ({"num_nodes": 0, "gpus_per_node": 2, "node_rank": 0, "local_rank": 0}, "num_nodes=0"),
        (
            {"num_nodes": 2, "gpus_per_node": -1, "node_rank": 0, "local_rank": 0},
            "gpus_per_node=-1",
        ),
        (
            {"num_nodes": 2, "gpus_per_node": 2, "node_rank": True, "local_rank": 0},
            "node_rank=True",
        ),
    ],
)
def test_invalid_multi_node_topology_rejected(kwargs: dict[str, int], quoted: str) -> None:
    with pytest.raises(ConfigError, match=quoted):
        MultiNodeTopology(**kwargs)


def test_out_of_range_message_gives_the_valid_range() -> None:
    with pytest.raises(ConfigError) as info:
        MultiNodeTopology(num_nodes=2, gpus_per_node=2, node_rank=3, local_rank=0)
    assert str(info.value) == "node_rank=3 is out of range for num_nodes=2 (expected 0..1)"


@pytest.mark.parametrize(("rank", "nodes", "gpus"), [(4, 2, 2), (-1, 2, 2), (0, 0, 2), (0, 2, 0)])
def test_from_global_rank_rejects_bad_values(rank: int, nodes: int, gpus: int) -> None:
    with pytest.raises(ConfigError, match=r"out of range|must be at least 1"):
        MultiNodeTopology.from_global_rank(rank, nodes, gpus)


@settings(deadline=None)
@given(data=st.data(), world_size=counts)
def test_world_size_one_node_reproduces_single_node_behaviour_exactly(
    data: st.DataObject, world_size: int
) -> None:
    rank = data.draw(st.integers(min_value=0, max_value=world_size - 1))
    config = DistributedConfig(world_size=world_size, rank=rank)
    topo = config.topology()
    assert not config.is_multi_node and not topo.is_multi_node
    assert (topo.world_size, topo.rank) == (world_size, rank)
    assert topo.is_global_rank_zero == (rank == 0)
    assert config.rendezvous == RendezvousTransport.file()
    # The single-node device rule stays ">= world_size".
    assert required_local_devices(config) == world_size


def test_single_node_default_is_one_worker_rank_zero() -> None:
    topo = DistributedConfig().topology()
    assert (topo.world_size, topo.rank, topo.is_global_rank_zero) == (1, 0, True)


def test_multi_node_config_requires_gpus_per_node_devices_not_world_size() -> None:
    config = DistributedConfig(
        num_nodes=2,
        gpus_per_node=2,
        node_rank=None,
        rendezvous=RendezvousTransport.daemon("127.0.0.1:29400"),
    )
    assert config.effective_world_size == 4
    # Each node holds 2 of the 4 workers, so 2 local devices suffice (fewer is refused
    # by devices.check_local_devices: tests/trainer/test_nccl_setup.py).
    assert required_local_devices(config) == 2
    placed = dataclasses.replace(config, node_rank=1, local_rank=1).topology()
    assert placed is not None and required_local_devices(placed) == 2


def test_single_node_device_count_still_needs_world_size() -> None:
    config = DistributedConfig(world_size=4, rank=0)
    assert required_local_devices(config) == 4
