"""The communicator interface every backend (CPU ring, NCCL) implements.

Semantics are identical across backends: collectives are in place, every rank
must call the same collectives in the same order, and a failure (a dead peer,
an abort, a timeout) raises a ``CommunicatorError`` subclass instead of hanging.
"""

from __future__ import annotations

import abc
import enum
import functools
import os
import threading
from collections.abc import Callable
from typing import (
    TYPE_CHECKING,
    Any,
    Final,
    Protocol,
    Self,
    TypeVar,
    runtime_checkable,
)

from rendezvousd.trainer.errors import CollectiveArgumentError, CommunicatorError, ConfigError
from rendezvousd.trainer.topology import check_rank

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt


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


R = TypeVar("R")

# How many collectives this process is inside (its training thread's, the bucketed
# reducer's thread's): its alive beats tell the node agent, whose hang rule gives a
# worker waiting in one longer, as it may only wait for a peer that stopped making
# progress (whose own agent then names that peer first).
_inside = 0
_inside_lock = threading.Lock()


def in_collective() -> bool:
    """Whether a collective of this process is in progress now."""
    return _inside > 0


# Whom this thread's collectives are for (``RankedCommunicator.hold``): the bucketed
# reducer's worker thread acts for its reducer.
_acting = threading.local()


def act_for(holder: object) -> None:
    """This thread's collectives are ``holder``'s (a reducer's worker thread)."""
    _acting.holder = holder


def _counted(method: Callable[..., R]) -> Callable[..., R]:
    @functools.wraps(method)
    def collective(self: RankedCommunicator, *args: Any, **kwargs: Any) -> R:
        global _inside
        # First, and touching no lock: a fork copies locks held by the parent's other
        # threads, and the parent's in-flight note is not this process's.
        self._check_process(method.__name__)
        holder = self._holder
        if holder is not None and getattr(_acting, "holder", None) is not holder:
            raise CollectiveArgumentError(
                f"rank {self.rank}: {method.__name__}() was called while {holder} is in "
                "flight on this communicator (gradients marked ready, wait() not yet "
                "returned): each rank's collectives are paired with the other ranks' in "
                "the order they start, so this one could be summed with another rank's "
                "gradient bucket. Make it before the first mark_ready() or after wait()"
            )
        self._enter_flight(method.__name__)
        with _inside_lock:
            _inside += 1
        try:
            return method(self, *args, **kwargs)
        finally:
            with _inside_lock:
                _inside -= 1
            self._leave_flight()

    return collective


class RankedCommunicator(abc.ABC):
    """What every backend shares: its place in the group, the check of a collective's
    root, the ranks' agreement on a collective before it is sent, and ``with`` closing
    it. A backend implements the collectives, ``_max_across_ranks`` and ``close``."""

    #: How errors name the backend: "NCCL broadcast", "CPU broadcast".
    _label = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Each backend's collectives count themselves (``in_collective``)."""
        super().__init_subclass__(**kwargs)
        for name in ("all_reduce", "broadcast", "barrier"):
            if name in cls.__dict__:
                setattr(cls, name, _counted(cls.__dict__[name]))

    def __init__(self, rank: int, world_size: int) -> None:
        if not isinstance(rank, int) or not isinstance(world_size, int):
            raise ConfigError(f"rank and world_size must be ints, got {rank!r} and {world_size!r}")
        check_rank("rank", rank, "world_size", world_size)
        self.rank: Final = rank
        self.world_size: Final = world_size
        self._holder: object | None = None
        self._holding = threading.Lock()
        # The process that made the communicator: its sockets, memory and NCCL
        # communicator are shared with a forked child (a DataLoader worker), which must
        # neither use them nor end them (``_forked``).
        self._pid = os.getpid()
        # The thread whose collective is in flight (its ident, name and the
        # collective's), and how deep: a collective may make another inside it.
        self._flying: tuple[int, str, str] | None = None
        self._depth = 0
        self._flight_lock = threading.Lock()

    def _forked(self) -> bool:
        """Whether this process is a fork of the one that made the communicator."""
        return os.getpid() != self._pid

    def _check_process(self, operation: str) -> None:
        """Refuse a collective in a forked child, in the SDK's words for its client: the
        child reads and writes the parent's ring sockets (or shared memory), so the
        parent's and the peers' frames were read as each other's (a corrupt header
        blaming a healthy rank) or the call waited out the collective timeout."""
        if self._forked():
            raise CommunicatorError(
                f"rank {self.rank}: {operation}() refused: this communicator was made in "
                f"process {self._pid}, and process {os.getpid()} is a fork of it: its "
                "sockets, shared memory and gRPC channels do not survive a fork (the "
                "parent still uses them); make collectives in the process that called "
                "init_distributed(), and hand a forked child's values to it (or fork "
                "before init_distributed())"
            )

    def _enter_flight(self, operation: str) -> None:
        """Refuse a collective entered while another thread's is in flight, and abort
        the communicator. Ranks pair collectives by the order they start and compare
        only their op, type and size, so two threads' same-shaped collectives were
        paired across ranks in whichever order each rank ran them, and each thread got
        the other's sum with no error (a review: 198 of 400 wrong). Refusing only the
        late one would leave each rank with another thread's collective to pair: the
        abort tells every rank, so none returns a mixed sum after this."""
        me = threading.current_thread()
        with self._flight_lock:
            flying = self._flying
            if flying is None or flying[0] == me.ident:
                if flying is None:
                    self._flying = (me.ident or 0, me.name, operation)
                self._depth += 1
                return
        message = (
            f"rank {self.rank}/{self.world_size}: {operation}() was called on thread "
            f"{me.name!r} while {flying[2]}() of thread {flying[1]!r} is in flight on this "
            "communicator: ranks pair collectives by the order they start, so two "
            "threads' collectives can be paired with each other across ranks and each "
            "summed with the other's data, with no error. The communicator is aborted. "
            "Make every collective from one thread, in the same program order on every "
            "rank (hand a metrics or evaluation thread's values to the training thread)"
        )
        self.abort(message)
        raise CollectiveArgumentError(message)

    def _leave_flight(self) -> None:
        with self._flight_lock:
            self._depth -= 1
            if self._depth == 0:
                self._flying = None

    def hold(self, holder: object) -> None:
        """Only ``holder``'s thread (``act_for``) may make collectives until ``release``:
        a bucketed reducer's step, whose buckets start on its worker thread in an order
        no other caller's collective is part of. Ranks pair their collectives by the
        order they start, so another collective made meanwhile, on any rank, could be
        paired with a bucket, and summed with it without an error when their sizes and
        types agree. Refused the same way on every rank, since each marks its gradients
        and calls its collectives in its program's order."""
        with self._holding:
            if self._holder is not None and self._holder is not holder:
                raise CollectiveArgumentError(
                    f"rank {self.rank}: {holder} started while {self._holder} is in flight "
                    "on this communicator: a communicator serves one reducer's step at a "
                    "time (register every gradient in one reducer, or wait() the other's "
                    "step first)"
                )
            self._holder = holder

    def release(self, holder: object) -> None:
        with self._holding:
            if self._holder is holder:
                self._holder = None

    def _check_root(self, root: object) -> None:
        if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < self.world_size:
            raise CollectiveArgumentError(
                f"rank {self.rank}: broadcast root={root!r} is out of range [0, {self.world_size})"
            )

    def _agree(self, operation: str, fields: dict[str, int]) -> None:
        """Every rank's ``fields`` of a collective (its root or op, size and type),
        compared before anything is sent: one MAX all-reduce of each value and its
        negation gives every rank the highest and the lowest. Ranks that disagree on a
        broadcast's root (each taking another for it) would otherwise wait for data no
        one sends until the collective timeout; so each raises now, naming what differs,
        and as nothing was sent the communicator stays usable, on every backend."""
        if self.world_size == 1:
            return  # nothing to disagree with
        # Here, not at the top: the node agent imports this module (ReduceOp) and
        # never numpy (tests/trainer/test_launcher_startup.py).
        import numpy as np

        mine = np.array(list(fields.values()), dtype=np.int64)
        seen = self._max_across_ranks(np.concatenate([mine, -mine]), operation)
        high, low = seen[: len(mine)], -seen[len(mine) :]
        if (high == low).all():
            return
        differ = ", ".join(
            f"{name} {low[i]} to {high[i]}" for i, name in enumerate(fields) if high[i] != low[i]
        )
        this = ", ".join(f"{name} {value}" for name, value in fields.items())
        raise CommunicatorError(
            f"rank {self.rank}/{self.world_size}: {self._label} {operation}: the ranks "
            f"disagree on its {differ} (this rank: {this}); nothing was sent. Every rank "
            "must make the same collective on the same array shape and dtype"
        )

    @abc.abstractmethod
    def _max_across_ranks(
        self, values: npt.NDArray[np.int64], operation: str
    ) -> npt.NDArray[np.int64]:
        """``values``' element-wise maximum over the ranks, on the host, as the first
        step of ``operation`` (``_agree``; its failures name ``operation``)."""

    @abc.abstractmethod
    def abort(self, reason: str) -> None:
        """Make every pending and future collective on this rank fail promptly, and
        tell the peers where the backend can; safe from any thread."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release sockets/streams; idempotent. In a forked child only this process's
        descriptors go: no notice to the peers, no shutdown of what the parent uses."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
