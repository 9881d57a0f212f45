"""Per-rank data sharding over the global world, like torch's DistributedSampler.

Every rank computes the same permutation from ``(seed, epoch)`` and takes every
``world_size``-th index starting at its own global rank, so shards are disjoint
and each rank's shard has the same length. Equal length matters: a rank that
ran out early would skip an all-reduce and hang the others.

Uneven datasets: by default the permutation is padded by wrapping around to
its start (a few samples are seen twice per epoch); with ``drop_last=True`` the
tail is dropped instead (a few samples are skipped this epoch).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from rendezvousd.trainer.errors import ConfigError
from rendezvousd.trainer.topology import MultiNodeTopology, check_rank

IndexArray = npt.NDArray[np.int64]


def shard_length(num_samples: int, world_size: int, *, drop_last: bool = False) -> int:
    """Samples each rank gets per epoch."""
    if drop_last:
        return num_samples // world_size
    return math.ceil(num_samples / world_size)


def shard_indices(
    num_samples: int,
    world_size: int,
    rank: int,
    epoch: int,
    seed: int,
    shuffle: bool = True,
    *,
    drop_last: bool = False,
) -> IndexArray:
    """Dataset indices for global ``rank`` of ``world_size`` in ``epoch``."""
    if num_samples < 1:
        raise ConfigError(f"num_samples={num_samples} must be at least 1")
    check_rank("rank", rank, "world_size", world_size)
    if epoch < 0 or seed < 0:
        raise ConfigError(f"epoch={epoch} and seed={seed} must both be >= 0")
    per_rank = shard_length(num_samples, world_size, drop_last=drop_last)
    if per_rank == 0:
        raise ConfigError(
            f"num_samples={num_samples} with drop_last=True leaves nothing for "
            f"world_size={world_size} ranks; use drop_last=False or more data"
        )
    if shuffle:
        # Seeded by (seed, epoch) only, never by rank: all ranks must agree.
        order = np.random.default_rng([seed, epoch]).permutation(num_samples)
    else:
        order = np.arange(num_samples)
    total = per_rank * world_size
    if total > num_samples:
        # np.resize repeats from the start, even when padding exceeds one full pass.
        order = np.resize(order, total)
    return order[rank:total:world_size].astype(np.int64, copy=False)


@dataclass(eq=False)
class ShardedLoader:
    """Batches of this rank's shard of ``(x, y)``; sharded by the topology's global world."""

    x: npt.NDArray[Any] = field(repr=False)
    y: npt.NDArray[Any] = field(repr=False)
    _: KW_ONLY
    batch_size: int
    topology: MultiNodeTopology
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = False

    def __post_init__(self) -> None:
        x, y, batch_size = self.x, self.y, self.batch_size
        if len(x) != len(y):
            raise ConfigError(f"x has {len(x)} samples but y has {len(y)}; they must match")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size={batch_size!r} must be a positive integer")
        # Validate now rather than on the first epoch.
        self.indices(0)

    @property
    def samples_per_rank(self) -> int:
        return shard_length(len(self.x), self.topology.world_size, drop_last=self.drop_last)

    def __len__(self) -> int:
        """Batches per epoch; identical on every rank (the last one may be short)."""
        return math.ceil(self.samples_per_rank / self.batch_size)

    def indices(self, epoch: int) -> IndexArray:
        return shard_indices(
            len(self.x),
            self.topology.world_size,
            self.topology.rank,
            epoch,
            self.seed,
            self.shuffle,
            drop_last=self.drop_last,
        )

    def index_batches(self, epoch: int) -> Iterator[IndexArray]:
        idx = self.indices(epoch)
        for start in range(0, len(idx), self.batch_size):
            yield idx[start : start + self.batch_size]

    def batches(self, epoch: int) -> Iterator[tuple[npt.NDArray[Any], npt.NDArray[Any]]]:
        for idx in self.index_batches(epoch):
            yield self.x[idx], self.y[idx]
