"""Each job's recent generations as the status page shows them: formed, failed (with
the root cause), aborted, re-formed, scaled up, grown or shrunk, with wall-clock times.

Heard from the state machine's ``Transition`` effects (through ``Metrics``), not
kept in the job record: it is for looking at, it is not durable, and a daemon
restart starts it afresh from each job's restored state (stamped with when the job
entered that state, its cause said). What outlives a restart, the job's last failure
and how many generations failed, the job record keeps (``JobView.last_failure``).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from rendezvousd.common.escape import shortened
from rendezvousd.common.model import SCALE_UP_REASON, JobState, Transition

# Transitions kept per job: a few dozen generations, whatever a job's restart budget.
KEPT = 64


@dataclass(frozen=True)
class Entry:
    at: float  # time.time()
    generation: int
    old: str
    new: str
    detail: str
    # What the change means for the job, beyond its state: "scale-up" (an agent ended
    # the generation for nodes waiting to join: not a failure), "grew 4 -> 6 ranks",
    # "shrank 6 -> 4 ranks", "re-formed" (the same world again); "" otherwise.
    change: str = ""


class Timeline:
    def __init__(self) -> None:
        self._jobs: dict[str, deque[Entry]] = {}
        # Each job's world when it last formed: what the next formation is compared to.
        self._formed: dict[str, int] = {}

    def record(self, t: Transition) -> None:
        if t.new is None:
            # The job expired or was forgotten: so is its history.
            self._jobs.pop(t.job_id, None)
            self._formed.pop(t.job_id, None)
            return
        entries = self._jobs.setdefault(t.job_id, deque(maxlen=KEPT))
        # A restored job's entry is stamped with when it entered its state before the
        # restart (a failure's time), not with the restart's.
        if t.since_unix is not None:
            at = t.since_unix  # a drained restart's ``since`` leaves its downtime out
        elif t.since is None:
            at = time.time()
        else:
            at = time.time() - (time.monotonic() - t.since)
        entries.append(
            Entry(
                at,
                t.generation,
                t.old.name if t.old is not None else "",
                t.new.name,
                # The detail may quote a worker's failure text: shortened and escaped
                # like every client-provided text shown.
                shortened(t.detail),
                _change(t, self._formed.get(t.job_id)),
            )
        )
        if t.new is JobState.RUNNING:
            self._formed[t.job_id] = t.world_size

    def of(self, job_id: str) -> list[Entry]:
        return list(self._jobs.get(job_id, ()))


def _change(t: Transition, formed_before: int | None) -> str:
    if t.new is JobState.ABORTED and t.detail == SCALE_UP_REASON:
        return "scale-up"
    if t.new is not JobState.RUNNING or formed_before is None or t.restored:
        # Put back (a failed commit undone): no formation, and the undone transition had
        # no world, which read as "shrank 2 -> 0 ranks".
        return ""
    if t.world_size > formed_before:
        return f"grew {formed_before} -> {t.world_size} ranks"
    if t.world_size < formed_before:
        return f"shrank {formed_before} -> {t.world_size} ranks"
    return "re-formed"
