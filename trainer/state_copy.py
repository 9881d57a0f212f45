"""The last step's training state, kept off the worker that computed it.

A worker hands its state after each step to its node agent (``ctx.save_state``);
the agent keeps the newest copy in its own memory, so a killed worker loses at
most the step it was in. Only local rank 0 sends (in data-parallel training
every rank holds the same parameters after a step) and the agent keeps one
copy: a state for step ``s`` exists only once step ``s``'s all-reduce completed
on its rank, which needs every rank's gradients, so any rank's copy of step
``s`` is the state every rank would have had.

On restart every rank offers the newest step it can restore (its agent's copy,
rank 0 also its newest checkpoint); the ranks take the largest (``agree_on_step``)
and the lowest rank holding it broadcasts its state. Copies held by an agent
that died with its node are simply not offered.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from .agent_channel import Frame, HostArrays, unpack_arrays
from .communicator import Communicator, ReduceOp

NOTHING = -1


@dataclass(frozen=True)
class StepState:
    """One step's training state as the node agent holds it (``ctx.restored``):
    the step it completed, JSON ``meta`` and host arrays (``arrays()``)."""

    step: int
    meta: dict[str, Any]
    entries: list[dict[str, Any]] = field(repr=False)
    payload: bytes = field(repr=False)

    def arrays(self) -> HostArrays:
        return unpack_arrays(self.entries, self.payload)


class StateCopy:
    """The agent's copy: the newest step state any of its workers handed over.

    Kept as the raw frame (no decode in the agent), replaced only by a newer
    step: a restarted worker re-sending an older step cannot roll it back.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest: StepState | None = None

    def offer(self, frame: Frame) -> bool:
        step = frame.header.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            return False
        meta = frame.header.get("meta")
        state = StepState(
            step,
            meta if isinstance(meta, dict) else {},
            list(frame.header.get("arrays") or []),
            frame.payload,
        )
        with self._lock:
            if self._latest is not None and self._latest.step >= step:
                return False
            self._latest = state
        return True

    def latest(self) -> StepState | None:
        with self._lock:
            return self._latest


def agree_on_step(comm: Communicator, offered: int, xp: Any = None) -> tuple[int, int]:
    """(the largest step any rank offered, the lowest rank offering it); (NOTHING, 0)
    when no rank has anything. Every rank must call it (two collectives). ``xp``:
    the array module of the communicator's buffers (default numpy)."""
    import numpy as np  # here: the node agent imports this module, and needs no numpy

    xp = np if xp is None else xp
    buf = xp.array([offered], dtype=np.int64)
    comm.all_reduce(buf, ReduceOp.MAX)
    best = int(buf[0])
    if best == NOTHING:
        return NOTHING, 0
    holder = xp.array([comm.rank if offered == best else comm.world_size], dtype=np.int64)
    comm.all_reduce(holder, ReduceOp.MIN)
    return best, int(holder[0])
