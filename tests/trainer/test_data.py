"""Sharding by the global world: disjoint, covering, equal-length, deterministic."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rendezvousd.trainer.data import ShardedLoader, shard_indices, shard_length
from rendezvousd.trainer.errors import ConfigError
from rendezvousd.trainer.topology import MultiNodeTopology

# No per-example deadline: the test machine is shared and timing would only add flakes.
samples = st.integers(min_value=1, max_value=300)
worlds = st.integers(min_value=1, max_value=12)
seeds = st.integers(min_value=0, max_value=2**32)
epochs = st.integers(min_value=0, max_value=1000)


def all_shards(n: int, world: int, epoch: int, seed: int, **kw: bool) -> list[list[int]]:
    return [shard_indices(n, world, r, epoch, seed, **kw).tolist() for r in range(world)]


def test_sharded_data_loader_partitions_across_global_world_size_not_local_gpus() -> None:
    n = 64
    x = np.arange(n, dtype=np.float32).reshape(n, 1)
    y = np.arange(n)
    world = [
        MultiNodeTopology(num_nodes=2, gpus_per_node=2, node_rank=node, local_rank=local)
        for node in range(2)
        for local in range(2)
    ]
    shards = [
        np.concatenate(list(ShardedLoader(x, y, batch_size=5, topology=t).index_batches(0)))
        for t in world
    ]
    # Four global shards of n/4, not two per-node shards of n/2 that the other node repeats.
    assert [len(s) for s in shards] == [16] * 4
    assert sorted(np.concatenate(shards).tolist()) == list(range(n))
    # Same local rank on different nodes must see different data.
    assert set(shards[0].tolist()).isdisjoint(shards[2].tolist())


@settings(deadline=None)
@given(n=samples, world=worlds, epoch=epochs, seed=seeds)
def test_padded_shards_are_equal_length_and_cover_everything(
    n: int, world: int, epoch: int, seed: int
) -> None:
    shards = all_shards(n, world, epoch, seed)
    per_rank = shard_length(n, world)
    assert all(len(s) == per_rank for s in shards)
    counts = Counter(i for s in shards for i in s)
    assert set(counts) == set(range(n))
    # Only wrap-around padding repeats: exactly per_rank*world - n extra visits.
    assert sum(counts.values()) - n == per_rank * world - n
    if n % world == 0:
        assert max(counts.values()) == 1


@settings(deadline=None)
@given(n=samples, world=worlds, epoch=epochs, seed=seeds)
def test_drop_last_shards_are_disjoint_equal_and_drop_less_than_a_round(
    n: int, world: int, epoch: int, seed: int
) -> None:
    if n < world:
        with pytest.raises(ConfigError, match="leaves nothing"):
            shard_indices(n, world, 0, epoch, seed, drop_last=True)
        return
    shards = all_shards(n, world, epoch, seed, drop_last=True)
    flat = [i for s in shards for i in s]
    assert len(flat) == len(set(flat))
    assert {len(s) for s in shards} == {n // world}
    assert n - len(flat) < world


@settings(deadline=None)
@given(n=samples, world=worlds, epoch=epochs, seed=seeds)
def test_shards_are_deterministic_per_seed_and_epoch(
    n: int, world: int, epoch: int, seed: int
) -> None:
    assert all_shards(n, world, epoch, seed) == all_shards(n, world, epoch, seed)


def test_permutation_changes_with_epoch_and_seed_and_shuffle_off_is_ordered() -> None:
    base = shard_indices(1000, 4, 1, epoch=0, seed=7).tolist()
    assert shard_indices(1000, 4, 1, epoch=1, seed=7).tolist() != base
    assert shard_indices(1000, 4, 1, epoch=0, seed=8).tolist() != base
    assert shard_indices(10, 3, 1, 0, 0, shuffle=False).tolist() == [1, 4, 7, 0]


def test_loader_yields_matching_x_y_batches_with_equal_counts_on_every_rank() -> None:
    n = 23
    x = np.arange(n * 2, dtype=np.float64).reshape(n, 2)
    y = np.arange(n) * 10
    loaders = [
        ShardedLoader(x, y, batch_size=4, topology=MultiNodeTopology.from_global_rank(r, 2, 2))
        for r in range(4)
    ]
    lengths = {len(loader) for loader in loaders}
    assert lengths == {2}  # ceil(23/4)=6 samples per rank -> batches of 4 and 2
    for loader in loaders:
        batches = list(loader.batches(epoch=3))
        assert len(batches) == len(loader)
        for bx, by in batches:
            np.testing.assert_array_equal(bx[:, 0] / 2 * 10, by)


@pytest.mark.parametrize(
    ("args", "quoted"),
    [
        ((0, 2, 0, 0, 0), "num_samples=0"),
        ((5, 0, 0, 0, 0), "world_size=0"),
        ((5, 2, 2, 0, 0), "rank=2"),
        ((5, 2, 0, -1, 0), "epoch=-1"),
    ],
)
def test_bad_shard_arguments_are_quoted(args: tuple[int, ...], quoted: str) -> None:
    with pytest.raises(ConfigError, match=quoted):
        shard_indices(*args)


def test_loader_rejects_mismatched_arrays_and_bad_batch_size() -> None:
    topo = MultiNodeTopology(1, 1, 0, 0)
    with pytest.raises(ConfigError, match="x has 3 samples but y has 2"):
        ShardedLoader(np.zeros(3), np.zeros(2), batch_size=1, topology=topo)
    with pytest.raises(ConfigError, match="batch_size=0"):
        ShardedLoader(np.zeros(3), np.zeros(3), batch_size=0, topology=topo)
