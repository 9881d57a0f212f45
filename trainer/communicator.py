"""The communicator interface every backend (CPU ring, NCCL) implements.

Semantics are identical across backends: collectives are in place, every rank
must call the same collectives in the same order, and a failure (a dead peer,
an abort, a timeout) raises a ``CommunicatorError`` subclass instead of hanging.
"""

from __future__ import annotations

import enum
from typing import Any, Protocol, runtime_checkable


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
