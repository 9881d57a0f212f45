"""The state machine's plumbing: the calls it parked, and the effects it queued.

A parked call is a ``waits.Waiter`` under a number the adapter awaits; waking one
queues a ``Wake``. A job's parked calls are counted in two shares: its members' own
(joins of its forming generation, barriers, key-value waits: ``max_waiters_per_job``),
and the node joins parked for a later generation (standbys, scale-ups, the job id's
next run: ``Limits.parked_joins_per_job``), which anyone with the job's token can
start as many of as they like and which must never take its members' room. Effects (``Wake``, ``Notify``, ``Transition``) wait here until
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
        # job id -> its SCALEUP entries in waiting (parked node joins), counted apart.
        self.joins_per_job: dict[str, int] = {}
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
        joins = self.joins_per_job.get(job.job_id, 0)
        parks_join = kind is waits.WaitKind.SCALEUP
        if parks_join and joins >= self.limits.parked_joins_per_job:
            # Beyond max_nodes, standbys have no bound of their own: one token holder (or
            # a spare pool started too large) would park them until the members' own
            # barriers were refused.
            raise validation.limit_exceeded(
                "max_waiters_per_job",
                f"job {job.job_id!r} already holds {joins} node joins parked for a later "
                f"generation ({_parked_joins(job)}), the most it may: "
                f"{self.limits.parked_joins_per_job}, half of max_waiters_per_job="
                f"{self.limits.max_waiters_per_job}, kept apart so that the job's members "
                "always have room for their own calls; start fewer standby nodes, retry "
                "once some end, or start the daemon with a larger --max-waiters-per-job",
                job_id=job.job_id,
                # As data: a standby's agent ends on it at once (exit 2), no restart spent.
                share="parked_joins",
            )
        if not parks_join and held - joins >= self.limits.max_waiters_per_job:
            # One job (one buggy or hostile token holder) must not take every slot.
            raise validation.limit_exceeded(
                "max_waiters_per_job",
                f"job {job.job_id!r} already holds max_waiters_per_job="
                f"{self.limits.max_waiters_per_job} waiting calls of its members "
                f"({self._members_calls(job.job_id)}; the {joins} node joins parked for a "
                "later generation are counted apart); retry once some end, or start the "
                "daemon with a larger --max-waiters-per-job (and --max-waiters)",
                job_id=job.job_id,
            )
        waiter = next(self._next)
        self.waiting[waiter] = waits.Waiter(job.job_id, job.generation, kind, rank, key, now)
        self.per_job[job.job_id] = held + 1
        if parks_join:
            self.joins_per_job[job.job_id] = joins + 1
        return Parked(waiter)

    def members_held(self, job_id: str) -> int:
        """The job's parked calls counted against ``max_waiters_per_job``."""
        return self.per_job.get(job_id, 0) - self.joins_per_job.get(job_id, 0)

    def _members_calls(self, job_id: str) -> str:
        """What the job's members' parked calls wait for, counted: what a refusal for
        ``max_waiters_per_job`` names as holding the slots. Runs only when refusing."""
        kinds = [w.kind for w in self.waiting.values() if w.job_id == job_id]
        counted = [
            f"{n} in {what}"
            for kind, what in _MEMBER_WAITS.items()
            if (n := sum(1 for k in kinds if k is kind))
        ]
        return "waiting: " + ", ".join(counted)

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
            _count_down(self.per_job, w.job_id)
            if w.kind is waits.WaitKind.SCALEUP:
                _count_down(self.joins_per_job, w.job_id)
        return w

    def wake(self, waiter: int, value: object = None, fault: RendezvousFault | None = None) -> None:
        if self.unpark(waiter) is not None:
            self._effects.append(Wake(waiter, value, fault))


_MEMBER_WAITS = {
    waits.WaitKind.JOIN: "a join of its forming generation",
    waits.WaitKind.BARRIER: "a barrier",
    waits.WaitKind.KV: "a key-value get",
}


def _count_down(counts: dict[str, int], job_id: str) -> None:
    left = counts.pop(job_id) - 1
    if left:
        counts[job_id] = left


def _parked_joins(job: Job) -> str:
    """The node joins a job holds parked for a later generation, by kind."""
    standbys = len(job.standby_waiters)
    next_run = len(job.next_run_waiters - job.standby_waiters)
    scaleups = max(0, len(job.scaleup_waiters) - standbys - next_run)
    counted = [
        f"{n} of them {what}"
        for n, what in (
            (standbys, "parked standby joins"),
            (scaleups, "scale-up joins"),
            (next_run, "joins of the job id's next run"),
        )
        if n
    ]
    return ", ".join(counted)
