"""When the last job of each id ended: what binds a job token to the job created after it
was minted.

A job token names only its job id and the time it was minted. Without a record of
ends, the token of a job long finished would still open a new job with the same id;
with it, the daemon refuses a token minted before the last job of its id ended (see
``rendezvousd/server/auth.py``). A job ends, here, when the daemon forgets it (idle past
``job_ttl_s``): until then a rejoin is the same job's next generation.

Bounded: ``KEPT`` ids, the oldest dropped first. A dropped end is folded into
``floor``, the latest end no longer listed, which then stands for every id the table
does not name and the daemon does not hold: a token minted before the floor is refused
for a new job of any such id (a false refusal, which says to mint a new token, rather
than a forgotten end letting an old token in). A job the daemon holds keeps its tokens
working: its creation came after any end of its id the table still lists.

Times are Unix seconds in the snapshot's frame (``snapshot.unix``: the daemon's wall
clock read at start-up, counted on by its monotonic clock), so a step of the wall clock
while the daemon runs moves no end; tokens carry the minting machine's clock. One behind
the daemon's makes a token minted just after an end look older than it, which is
refused; one ahead is refused beyond ``scope.MINTED_AHEAD_S``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rendezvousd.common import validation
from rendezvousd.errors import RendezvousFault

#: Job ids whose end is kept (about 200 bytes each in memory and in state.db at most).
KEPT = 65536


@dataclass
class EndsWrite:
    """What one commit writes of the history: ends to put, ids dropped, the floor."""

    put: dict[str, float] = field(default_factory=dict)
    drop: set[str] = field(default_factory=set)
    floor: float | None = None  # None: unchanged
    replace_all: bool = False  # the whole history: every other row goes

    def __bool__(self) -> bool:
        return bool(self.put or self.drop or self.floor is not None or self.replace_all)


@dataclass
class JobEnds:
    kept: int = KEPT
    # job id -> when its last job ended; insertion order is the order ends were heard.
    ends: dict[str, float] = field(default_factory=dict)
    floor: float = 0.0
    _pending: EndsWrite = field(default_factory=EndsWrite)

    def record(self, job_id: str, at: float) -> None:
        """The job ``job_id`` ended (was forgotten) at ``at``."""
        self.ends.pop(job_id, None)
        self.ends[job_id] = at
        self._pending.put[job_id] = at
        self._pending.drop.discard(job_id)
        self._drop_oldest()

    def ended(self, job_id: str, *, held: bool) -> float | None:
        """When the last job of ``job_id`` ended (None: never, as far as is known);
        ``held``: whether the daemon holds a job of that id now (the floor does not
        apply to it)."""
        at = self.ends.get(job_id)
        if at is None and not held and self.floor > 0:
            return self.floor
        return at

    def take(self) -> EndsWrite:
        """The changes not yet handed to a commit."""
        pending, self._pending = self._pending, EndsWrite()
        return pending

    def whole(self) -> EndsWrite:
        """The whole history as one write (the database is rewritten from memory)."""
        self._pending = EndsWrite()
        return EndsWrite(dict(self.ends), set(), self.floor, replace_all=True)

    def unsent(self, write: EndsWrite) -> None:
        """``write``'s commit failed: its changes are pending again (newer ones win)."""
        for job_id, at in write.put.items():
            if job_id in self.ends and job_id not in self._pending.drop:
                self._pending.put.setdefault(job_id, at)
        self._pending.drop |= {j for j in write.drop if j not in self.ends}
        if write.floor is not None and self._pending.floor is None:
            self._pending.floor = self.floor
        self._pending.replace_all = self._pending.replace_all or write.replace_all

    def restore(self, rows: list[tuple[object, object]], floor: object) -> None:
        """Load the stored history (``rows`` oldest first); raises ValueError naming
        the first bad value."""
        self.floor = _time("the floor", floor)
        for job_id, at in rows:
            try:
                validation.job_id(job_id if isinstance(job_id, str) else "")
            except RendezvousFault:
                raise ValueError(f"job id {job_id!r} is not a valid job id") from None
            assert isinstance(job_id, str)
            self.ends[job_id] = _time(f"the end of job {job_id!r}", at)
        self._drop_oldest()

    def _drop_oldest(self) -> None:
        """Beyond ``kept`` ends, the oldest go into the floor (and from the next commit)."""
        while len(self.ends) > self.kept:
            oldest = next(iter(self.ends))
            self.floor = max(self.floor, self.ends.pop(oldest))
            self._pending.put.pop(oldest, None)
            self._pending.drop.add(oldest)
            self._pending.floor = self.floor


def _time(what: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} is {value!r}, not a number of Unix seconds")
    if not math.isfinite(value) or value < 0 or value > 2**40:
        raise ValueError(f"{what} is {value!r}, not a time in Unix seconds")
    return float(value)
