"""The communicator interface every backend (CPU ring, NCCL) implements.

Semantics are identical across backends: collectives are in place, every rank
must call the same collectives in the same order, and a failure (a dead peer,
an abort, a timeout) raises a ``CommunicatorError`` subclass instead of hanging.
"""

from __future__ import annotations

import abc
import enum
from typing import Any, Final, Protocol, Self, runtime_checkable

from rendezvousd.trainer.errors import CollectiveArgumentError, ConfigError
from rendezvousd.trainer.topology import check_rank


class ReduceOp(enum.Enum):
    """How ``all_reduce`` combines the ranks' arrays, element by element."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"


@runtime_checkable
class Communicator(Protocol):
    """A fixed group of ``world_size`` ranks; this object is rank ``rank``."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def backend(self) -> str: ...

    def all_reduce(self, array: Any, op: ReduceOp = ReduceOp.SUM) -> None:
        """Reduce ``array`` (contiguous numpy or CuPy) in place across all ranks."""

    def broadcast(self, array: Any, root: int = 0) -> None:
        """Overwrite ``array`` in place with rank ``root``'s contents."""

    def barrier(self) -> None:
        """Return once every rank has entered the barrier."""

    def abort(self, reason: str) -> None:
        """Make every pending and future collective on this rank fail promptly.

        Safe to call from any thread (the SDK's peer-failure callback calls it).
        """

    def close(self) -> None:
        """Release sockets/streams; idempotent."""


class RankedCommunicator(abc.ABC):
    """What every backend shares: its place in the group, the check of a collective's
    root, and ``with`` closing it. A backend implements the collectives and ``close``."""

    def __init__(self, rank: int, world_size: int) -> None:
        if not isinstance(rank, int) or not isinstance(world_size, int):
            raise ConfigError(f"rank and world_size must be ints, got {rank!r} and {world_size!r}")
        check_rank("rank", rank, "world_size", world_size)
        self.rank: Final = rank
        self.world_size: Final = world_size

    def _check_root(self, root: object) -> None:
        if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < self.world_size:
            raise CollectiveArgumentError(
                f"rank {self.rank}: broadcast root={root!r} is out of range [0, {self.world_size})"
            )

    @abc.abstractmethod
    def close(self) -> None:
        """Release sockets/streams; idempotent."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
