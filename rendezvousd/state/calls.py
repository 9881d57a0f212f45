"""The state machine's plumbing: the calls it parked, and the effects it queued.

A parked call is a ``waits.Waiter`` under a number the adapter awaits; waking one
queues a ``Wake``. Effects (``Wake``, ``Notify``, ``Transition``) wait here until
the adapter takes them. Pure: no I/O, no clock.
"""

from __future__ import annotations

import itertools
from typing import TypeVar

from rendezvousd.common import validation
from rendezvousd.common.limits import Limits
from rendezvousd.common.model import Effect, Parked, Wake
from rendezvousd.errors import RendezvousFault
from rendezvousd.state import waits
from rendezvousd.state.job import Job

_K = TypeVar("_K")


class Calls:
    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.waiting: dict[int, waits.Waiter] = {}
        self.per_job: dict[str, int] = {}  # job id -> its entries in waiting
        self._next = itertools.count(1)
        self._effects: list[Effect] = []

    def emit(self, effect: Effect) -> None:
        self._effects.append(effect)

    def take(self) -> list[Effect]:
        effects, self._effects = self._effects, []
        return effects

    def park(self, job: Job, kind: waits.WaitKind, rank: int, key: str, now: float) -> Parked:
        if len(self.waiting) >= self.limits.max_waiters:
            raise validation.limit_exceeded(
                "max_waiters",
                f"job {job.job_id!r} cannot park this call: the daemon already holds "
                f"max_waiters={self.limits.max_waiters} waiting calls; retry once some "
                "end, or start the daemon with a larger --max-waiters",
                job_id=job.job_id,
            )
        held = self.per_job.get(job.job_id, 0)
        reserve = self.limits.waiters_reserve
        if held >= reserve and len(self.waiting) >= self.limits.max_waiters - reserve:
            # Fair share: jobs already holding many parked calls leave the last slots to
            # jobs holding few, so that two big jobs cannot take every slot between them
            # (max_waiters_per_job alone lets two jobs fill the daemon).
            raise validation.limit_exceeded(
                "max_waiters",
                f"the daemon holds {len(self.waiting)} of max_waiters="
                f"{self.limits.max_waiters} waiting calls and keeps the last {reserve} for "
                f"jobs holding fewer than {reserve}; job {job.job_id!r} holds {held}",
                job_id=job.job_id,
            )
        if held >= self.limits.max_waiters_per_job:
            # One job (one buggy or hostile token holder) must not take every slot.
            raise validation.limit_exceeded(
                "max_waiters_per_job",
                f"job {job.job_id!r} already holds max_waiters_per_job="
                f"{self.limits.max_waiters_per_job} waiting calls; retry once some end, or "
                "start the daemon with a larger --max-waiters-per-job (and --max-waiters)",
                job_id=job.job_id,
            )
        waiter = next(self._next)
        self.waiting[waiter] = waits.Waiter(job.job_id, job.generation, kind, rank, key, now)
        self.per_job[job.job_id] = held + 1
        return Parked(waiter)

    def park_under(
        self,
        waiters: dict[_K, set[int]],
        under: _K,
        job: Job,
        kind: waits.WaitKind,
        rank: int,
        key: str,
        now: float,
    ) -> Parked:
        """``park``, and list the waiter in ``waiters[under]`` once it is admitted."""
        parked = self.park(job, kind, rank, key, now)
        waiters.setdefault(under, set()).add(parked.waiter)
        return parked

    def unpark(self, waiter: int) -> waits.Waiter | None:
        w = self.waiting.pop(waiter, None)
        if w is not None:
            held = self.per_job.pop(w.job_id) - 1
            if held:
                self.per_job[w.job_id] = held
        return w

    def wake(self, waiter: int, value: object = None, fault: RendezvousFault | None = None) -> None:
        if self.unpark(waiter) is not None:
            self._effects.append(Wake(waiter, value, fault))
