"""Sharding by the global world: disjoint, covering, equal-length, deterministic."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from rendezvousd.trainer.data import (
    CURSOR_KEY,
    DataCursor,
    ShardedLoader,
    remaining_indices,
    shard_indices,
    shard_length,
)
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


def _world(size: int, x: np.ndarray, **kw: Any) -> list[ShardedLoader]:
    return [
        ShardedLoader(
            x,
            x,
            topology=MultiNodeTopology(num_nodes=size, gpus_per_node=1, node_rank=r, local_rank=0),
            **kw,
        )
        for r in range(size)
    ]


def _steps(
    world: list[ShardedLoader], cursor: DataCursor, steps: int
) -> tuple[list[int], DataCursor]:
    """The samples ``world`` trains on in ``steps`` steps from ``cursor``; the cursor after."""
    seen: list[int] = []
    for _ in range(steps):
        after = [loader.batch_at(cursor) for loader in world]
        assert len({c for _, c in after}) == 1  # every rank agrees on the next cursor
        seen += [i for batch, _ in after for i in batch.tolist()]
        cursor = after[0][1]
    return seen, cursor


def test_a_cursor_reshards_the_rest_of_the_epoch_so_4_to_2_to_3_sees_every_sample_once() -> None:
    # 96 samples, 4 per rank per step: world 4 takes 16 per step, world 2 8, world 3 12.
    x = np.arange(96)
    seen, cursor = _steps(_world(4, x, batch_size=4), DataCursor(), 2)
    assert cursor == DataCursor(0, 32)
    # The cursor survives as JSON, as a checkpoint or the agent's state copy keeps it.
    cursor = _world(2, x, batch_size=4)[0].resume_at(2, {CURSOR_KEY: cursor.to_meta()})
    more, cursor = _steps(_world(2, x, batch_size=4), cursor, 3)
    seen += more
    assert cursor == DataCursor(0, 56)
    # World 3 finishes the epoch: 40 left, 14 per rank (2 padding samples), 4 steps.
    more, cursor = _steps(_world(3, x, batch_size=4), cursor, 4)
    seen += more
    assert cursor == DataCursor(1, 0)
    counts = Counter(seen)
    assert set(counts) == set(range(96))
    # Only the documented padding repeats: 3 * 14 - 40 = 2 samples, from the epoch's start.
    assert sum(counts.values()) - 96 == 2
    # By the step count alone, world 3 would have started at step 5 of its 8-step
    # epoch: samples 60..95 of the permutation, replaying some and skipping others.


@settings(deadline=None, max_examples=60)
@given(
    n=samples,
    sizes=st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=4),
    steps=st.lists(st.integers(min_value=1, max_value=9), min_size=4, max_size=4),
    batch=st.integers(min_value=1, max_value=7),
    drop_last=st.booleans(),
)
# Found in a full run: world 1 left 1 sample of 25, which world 2 drops (drop_last), so
# its next batch is epoch 1's.
@example(n=25, sizes=[1, 2], steps=[6, 1, 1, 1], batch=4, drop_last=True)
def test_any_sequence_of_world_sizes_sees_each_sample_of_an_epoch_once_beyond_padding(
    n: int, sizes: list[int], steps: list[int], batch: int, drop_last: bool
) -> None:
    x = np.arange(n)
    cursor, seen, last = DataCursor(), [], 1
    for size, count in zip(sizes, steps, strict=False):
        if drop_last and size > n:
            continue  # such a world is refused at its loader's creation
        world = _world(size, x, batch_size=batch, drop_last=drop_last)
        for _ in range(count):
            if cursor.epoch == 0:
                if not len(remaining_indices(n, size, 0, cursor, 0, drop_last=drop_last)):
                    # drop_last leaves this world nothing more of epoch 0 (less than a
                    # sample per rank): its next batch is epoch 1's (batch_at starts it).
                    cursor, last = DataCursor(1, 0), size
                    continue
                more, cursor = _steps(world, cursor, 1)
                seen += more
                last = size
    counts = Counter(seen)
    extra = sum(counts.values()) - len(counts)
    if cursor.epoch == 0 or drop_last:
        # Mid-epoch, or without padding: no sample of the epoch was taken twice.
        assert extra == 0
    if cursor.epoch > 0:
        # Only the world that ended the epoch pads (or drops) a tail, of less than
        # one sample per rank.
        missing = n - len(counts)
        if drop_last:
            assert missing < last
        else:
            assert missing == 0 and extra < last


def test_an_unchanged_world_takes_the_same_batches_as_whole_epochs() -> None:
    x = np.arange(50)
    for world in (_world(3, x, batch_size=4, seed=5), _world(4, x, batch_size=5, drop_last=True)):
        for loader in world:
            cursor, by_cursor = DataCursor(), []
            while cursor.epoch < 2:
                batch, cursor = loader.batch_at(cursor)
                by_cursor.append(batch.tolist())
            whole = [b.tolist() for e in range(2) for b in loader.index_batches(e)]
            assert by_cursor == whole


def test_a_state_saved_without_a_cursor_takes_the_step_rule_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loader = _world(2, np.arange(40), batch_size=4)[1]  # 5 steps per epoch
    with caplog.at_level(logging.WARNING, logger="rendezvousd.trainer.data"):
        cursor = loader.resume_at(7, {"step": 7, "loss": 0.5})
    assert cursor == DataCursor(1, 16)
    assert loader.batch_at(cursor)[0].tolist() == list(loader.index_batches(1))[2].tolist()
    assert "state of step 7 has no data cursor" in caplog.text
    assert "at world size 2 (epoch 1, batch 2)" in caplog.text
    assert loader.resume_at(0, None) == DataCursor()


@pytest.mark.parametrize(
    "saved", [{"epoch": 1}, {"epoch": -1, "consumed": 0}, {"epoch": True, "consumed": 0}, "x"]
)
def test_a_malformed_saved_cursor_is_refused_naming_it(saved: object) -> None:
    loader = _world(1, np.arange(10), batch_size=4)[0]
    with pytest.raises(ConfigError, match="saved data cursor"):
        loader.resume_at(3, {CURSOR_KEY: saved})


def test_a_cursor_past_the_dataset_is_refused() -> None:
    loader = _world(1, np.arange(10), batch_size=4)[0]
    with pytest.raises(ConfigError, match=r"cursor \(epoch 0, consumed 10\) is past the dataset"):
        loader.resume_at(3, {CURSOR_KEY: {"epoch": 0, "consumed": 10}})
