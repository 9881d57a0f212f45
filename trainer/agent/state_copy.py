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

import enum
import threading
from dataclasses import dataclass, field
from typing import Any

from rendezvousd.trainer.agent.agent_channel import (
    MAX_STATE_BYTES,
    Frame,
    FrameError,
    HostArrays,
    unpack_arrays,
)
from rendezvousd.trainer.comm.communicator import Communicator, ReduceOp

NOTHING = -1
#: The largest step a state may carry: the largest integer every JSON reader keeps
#: exactly (and far below the int64 that ``agree_on_step`` reduces).
MAX_STEP = (1 << 53) - 1
#: How far a state may be ahead of the same worker's previous one, and of the agent's
#: copy: a step this far ahead is a broken counter, and kept it would pin the copy (no
#: later state, being older, could ever replace it, and every node resumes from the
#: largest step any node holds). Only a worker's first state while the agent holds no
#: copy may carry any step: it may resume from a checkpoint.
MAX_STEP_ADVANCE = 1 << 20
# What an agent accepts as an array's dtype string (numpy's ``dtype.str``); the
# worker that restores the state checks it is a plain numeric dtype.
_MAX_DTYPE_CHARS = 32


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


class Offer(enum.Enum):
    """What ``StateCopy.offer`` did with a state."""

    KEPT = "kept"
    #: Not newer than the copy (a restarted worker re-sending an older step).
    OLDER = "older"
    #: More than ``MAX_STEP_ADVANCE`` past the copy: refused, the copy stays.
    PAST_COPY = "past the copy"


class StateCopy:
    """The agent's copy: the newest step state any of its workers handed over.

    Kept as the raw frame (no decode in the agent), replaced only by a newer
    step: a restarted worker re-sending an older step cannot roll it back, and
    one whose step is wildly ahead cannot pin it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest: StepState | None = None

    def offer(self, frame: Frame, after: int | None = None) -> Offer:
        """Keep ``frame`` if its step is newer than the copy's and at most
        ``MAX_STEP_ADVANCE`` past it. ``after``: the step of the sender's previous
        state, if any. ``FrameError`` for a state no worker should send (a step out
        of range or too far past its own previous one, an array list that does not
        describe the payload), which would otherwise be handed to every restarted
        worker. A state too far past the copy is refused but is no failure of its
        worker: the first state of a fresh process (a restarted local rank 0) has no
        previous one of its own to be judged against, and the copy is what every
        restart of this node offers."""
        state = checked_state(frame, after)
        with self._lock:
            if self._latest is not None:
                if self._latest.step >= state.step:
                    return Offer.OLDER
                if state.step > self._latest.step + MAX_STEP_ADVANCE:
                    return Offer.PAST_COPY
            self._latest = state
        return Offer.KEPT

    def latest(self) -> StepState | None:
        with self._lock:
            return self._latest


def checked_state(frame: Frame, after: int | None = None) -> StepState:
    """The step state a ``state`` frame carries, checked as far as the agent can
    without numpy: ``FrameError`` if it is out of range or malformed."""
    header = frame.header
    step = header.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise FrameError(f"state step {_shown(step)} is not an integer in 0..{MAX_STEP}")
    if after is not None and step > after + MAX_STEP_ADVANCE:
        raise FrameError(
            f"state step {step} is {step - after} past the same worker's previous state "
            f"(step {after}); at most {MAX_STEP_ADVANCE} is accepted"
        )
    meta = header.get("meta")
    if meta is not None and not isinstance(meta, dict):
        raise FrameError(f"state frame's meta is a {type(meta).__name__}, not an object")
    entries = header.get("arrays")
    if entries is None:
        entries = []
    if not isinstance(entries, list):
        raise FrameError(f"state frame's array list is a {type(entries).__name__}, not a list")
    if len(frame.payload) > MAX_STATE_BYTES:
        raise FrameError(
            f"state frame of {len(frame.payload)} bytes exceeds MAX_STATE_BYTES={MAX_STATE_BYTES}"
        )
    total = 0
    for i, entry in enumerate(entries):
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("name"), str)
            and isinstance(entry.get("dtype"), str)
            and 0 < len(entry["dtype"]) <= _MAX_DTYPE_CHARS
            and isinstance(entry.get("shape"), list)
            and all(_count(d) for d in entry["shape"])
            and _count(entry.get("nbytes"))
        ):
            raise FrameError(
                f"state frame's array {i} is not {{name, dtype, shape, nbytes}} "
                "with a dtype string and non-negative integer sizes"
            )
        total += entry["nbytes"]
    if total != len(frame.payload):
        raise FrameError(
            f"state frame's array list describes {total} bytes, its payload has "
            f"{len(frame.payload)}"
        )
    return StepState(step, meta or {}, entries, frame.payload)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:40]}..."


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
