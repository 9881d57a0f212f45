"""Each job's recent generations as the status page shows them: formed, failed (with
the root cause), aborted, re-formed, with wall-clock times.

Heard from the state machine's ``Transition`` effects (through ``Metrics``), not
kept in the job record: it is for looking at, it is not durable, and a daemon
restart starts it afresh from each job's restored state.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from rendezvousd.common.escape import shortened
from rendezvousd.common.model import Transition

# Transitions kept per job: a few dozen generations, whatever a job's restart budget.
KEPT = 64


@dataclass(frozen=True)
class Entry:
    at: float  # time.time()
    generation: int
    old: str
    new: str
    detail: str


class Timeline:
    def __init__(self) -> None:
        self._jobs: dict[str, deque[Entry]] = {}

    def record(self, t: Transition) -> None:
        if t.new is None:
            # The job expired or was forgotten: so is its history.
            self._jobs.pop(t.job_id, None)
            return
        entries = self._jobs.setdefault(t.job_id, deque(maxlen=KEPT))
        entries.append(
            Entry(
                time.time(),
                t.generation,
                t.old.name if t.old is not None else "",
                t.new.name,
                # The detail may quote a worker's failure text: shortened and escaped
                # like every client-provided text shown.
                shortened(t.detail),
            )
        )

    def of(self, job_id: str) -> list[Entry]:
        return list(self._jobs.get(job_id, ()))

    def last_failure(self, job_id: str) -> str:
        """What failed the job's latest failed generation (kept after it re-formed)."""
        failed = [e for e in self._jobs.get(job_id, ()) if e.new == "FAILED"]
        return f"generation {failed[-1].generation}: {failed[-1].detail}" if failed else ""

    def restarts(self, job_id: str) -> int:
        """Generations that ended in failure or abort while this daemon watched."""
        return sum(e.new in ("FAILED", "ABORTED") for e in self._jobs.get(job_id, ()))
