"""Per-rank data sharding over the global world, like torch's DistributedSampler.

Every rank computes the same permutation from ``(seed, epoch)`` and takes every
``world_size``-th index starting at its own global rank, so shards are disjoint
and each rank's shard has the same length. Equal length matters: a rank that
ran out early would skip an all-reduce and hang the others.

Uneven datasets: by default the permutation is padded by wrapping around to
its start (a few samples are seen twice per epoch); with ``drop_last=True`` the
tail is dropped instead (a few samples are skipped this epoch).

Where the world is in the data is a ``DataCursor``: the epoch and how many
positions of that epoch's permutation the world has taken. Strided sharding
makes what a world took after any number of whole steps a prefix of the
permutation, so the cursor does not depend on the world size: a world of another
size (an elastic resize, a resume elsewhere) re-shards the rest of the epoch from
the cursor and every sample of the epoch is still seen once. A step count alone
cannot say this, because steps per epoch depend on the world size.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from rendezvousd.trainer.errors import ConfigError
from rendezvousd.trainer.topology import MultiNodeTopology, check_rank

IndexArray = npt.NDArray[np.int64]
#: The key under which a training state's metadata (a checkpoint's, the node
#: agent's state copy's) carries the data cursor: ``{"epoch": E, "consumed": C}``.
CURSOR_KEY = "data_cursor"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataCursor:
    """The world's position in the data: ``epoch``, and ``consumed``, how many
    positions of that epoch's (padded) permutation every rank together has taken.
    The same on every rank, and valid for any world size."""

    epoch: int = 0
    consumed: int = 0

    def to_meta(self) -> dict[str, int]:
        """The cursor as JSON, for a state's metadata under ``CURSOR_KEY``."""
        return {"epoch": self.epoch, "consumed": self.consumed}

    @classmethod
    def from_meta(cls, value: Any) -> DataCursor:
        """The cursor ``to_meta`` wrote; ConfigError naming what is wrong otherwise."""
        fields = value if isinstance(value, Mapping) else {}
        epoch, consumed = fields.get("epoch"), fields.get("consumed")
        if not (type(epoch) is int and type(consumed) is int and epoch >= 0 and consumed >= 0):
            raise ConfigError(
                f"the saved data cursor {value!r} is not {{'epoch': E, 'consumed': C}} with "
                "integers >= 0; resume from another checkpoint"
            )
        return cls(epoch, consumed)


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
    return remaining_indices(
        num_samples, world_size, rank, DataCursor(epoch, 0), seed, shuffle, drop_last=drop_last
    )


def remaining_indices(
    num_samples: int,
    world_size: int,
    rank: int,
    cursor: DataCursor,
    seed: int,
    shuffle: bool = True,
    *,
    drop_last: bool = False,
) -> IndexArray:
    """Global ``rank``'s share of the rest of ``cursor.epoch``'s permutation, from
    position ``cursor.consumed``, sharded over ``world_size``: at consumed 0 the
    whole epoch (``shard_indices``). Padding wraps to the permutation's start, as an
    epoch sharded whole pads, so a world that keeps its size is not changed by a
    resume. Empty when ``drop_last`` leaves too little for every rank (the epoch is
    over)."""
    if num_samples < 1:
        raise ConfigError(f"num_samples={num_samples} must be at least 1")
    check_rank("rank", rank, "world_size", world_size)
    epoch, consumed = cursor.epoch, cursor.consumed
    if epoch < 0 or seed < 0:
        raise ConfigError(f"epoch={epoch} and seed={seed} must both be >= 0")
    if not 0 <= consumed < num_samples:
        raise ConfigError(
            f"data cursor (epoch {epoch}, consumed {consumed}) is past the dataset's "
            f"{num_samples} samples; resume with the dataset it was saved with"
        )
    per_rank = shard_length(num_samples - consumed, world_size, drop_last=drop_last)
    if per_rank == 0 and consumed == 0:
        raise ConfigError(
            f"num_samples={num_samples} with drop_last=True leaves nothing for "
            f"world_size={world_size} ranks; use drop_last=False or more data"
        )
    if shuffle:
        # Seeded by (seed, epoch) only, never by rank: all ranks must agree.
        order = np.random.default_rng([seed, epoch]).permutation(num_samples)
    else:
        order = np.arange(num_samples)
    end = consumed + per_rank * world_size
    if end > num_samples:
        # np.resize repeats from the start, even when padding exceeds one full pass.
        order = np.resize(order, end)
    return order[consumed + rank : end : world_size].astype(np.int64, copy=False)


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

    def batch_at(self, cursor: DataCursor) -> tuple[IndexArray, DataCursor]:
        """This rank's batch at ``cursor`` and the cursor after the step (the same on
        every rank): the one call a training loop makes per step, whatever world size
        the cursor was reached with. A cursor at the end of an epoch (``drop_last``
        leaves too little for this world) starts the next one."""
        shard = self._remaining(cursor)
        if len(shard) == 0:
            cursor = DataCursor(cursor.epoch + 1, 0)
            shard = self._remaining(cursor)
        batch = shard[: self.batch_size]
        if len(shard) <= self.batch_size:
            return batch, DataCursor(cursor.epoch + 1, 0)
        taken = self.batch_size * self.topology.world_size
        return batch, DataCursor(cursor.epoch, cursor.consumed + taken)

    def resume_at(self, step: int, meta: Mapping[str, Any] | None) -> DataCursor:
        """The cursor to go on from, given the metadata saved with the state of
        ``step`` (a checkpoint's, ``ctx.restored.meta``). A state saved without a
        cursor (before cursors existed) falls back to the step's position at this
        world size, said at WARNING: it is right only if the world size is the one
        it was saved with."""
        saved = None if meta is None else meta.get(CURSOR_KEY)
        if saved is not None:
            cursor = DataCursor.from_meta(saved)
            self._remaining(cursor)  # refuses a cursor past this dataset now
            return cursor
        if step == 0:
            return DataCursor()
        epoch, offset = divmod(step, len(self))
        log.warning(
            "the state of step %d has no data cursor (saved before rendezvousd kept one); "
            "taking its data position from the step at world size %d (epoch %d, batch %d): "
            "if it was saved at another world size, samples of this run are replayed or "
            "skipped. Save the cursor (meta[%r] = cursor.to_meta()) to avoid this",
            step,
            self.topology.world_size,
            epoch,
            offset,
            CURSOR_KEY,
        )
        return DataCursor(epoch, offset * self.batch_size * self.topology.world_size)

    def _remaining(self, cursor: DataCursor) -> IndexArray:
        return remaining_indices(
            len(self.x),
            self.topology.world_size,
            self.topology.rank,
            cursor,
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
