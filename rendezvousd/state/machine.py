"""The daemon's decisions, as a pure state machine.

Every method takes the current monotonic time, mutates in-memory state, and
either returns a value, returns ``Parked`` (the caller must wait), or raises
``RendezvousFault``. Side effects for other callers (wake a parked call, push
an event to a heartbeat stream, log a transition) are queued on ``calls`` and
collected with ``take_effects()``. There is no I/O, no clock and no asyncio here,
which is what lets tests and the Hypothesis model drive it directly.

One class, its decisions split by concept into modules of functions over it:
``joins`` (a join, per rank or per node, PublishId, forming), ``liveness`` (streams, heartbeats,
silence, Leave, ReportFailure), ``rounds`` (a generation's life), ``seats`` (who may
call); barriers, the key-value store, aborts and draining are here.
"""

from __future__ import annotations

from collections.abc import Iterator

from rendezvousd.common import validation
from rendezvousd.common.escape import quoted
from rendezvousd.common.limits import Limits, Timing
from rendezvousd.common.model import (
    AbortCause,
    Effect,
    EventKind,
    JobState,
    JobView,
    MemberInfo,
    Parked,
)
from rendezvousd.errors import Code, Reason
from rendezvousd.state import barriers, fences, joins, kv, liveness, rounds, seats, waits
from rendezvousd.state.calls import Calls
from rendezvousd.state.job import Closed, Job
from rendezvousd.state.placement import JoinArgs
from rendezvousd.state.views import job_view

# JoinArgs is part of this module's interface: callers build the requests they pass to join().
__all__ = ["JoinArgs", "RendezvousState"]


class RendezvousState:
    def __init__(self, limits: Limits | None = None, timing: Timing | None = None) -> None:
        self.limits = limits or Limits()
        self.timing = timing or Timing()
        self.jobs: dict[str, Job] = {}
        self.draining = False
        # Set by the Persister while its commits fail: losses an undo took back wait
        # for storage (``liveness.tick``).
        self.storage_failing = False
        self.calls = Calls(self.limits)
        # When this daemon started (Unix seconds), if it keeps no state (no
        # --state-dir): every job it holds was made since, and a call of a seat no
        # join of this process took is from a run of the job it forgot
        # (``seats.forgotten``). None: it keeps state, or was not told.
        self.stateless_since: float | None = None
        # The ids of the jobs this process forgot (idle past job_ttl_s), whose old
        # runs' callers are not the restart's (``FORGOT_KEPT``, then ``forgot_many``).
        self.forgot: set[str] = set()
        self.forgot_many = False
        # When the runs of jobs forgotten early for a new job's max_jobs slot ended
        # (``rounds.make_room``), by job id, oldest first: a node agent launched for
        # one is still told it ended (``joins.launched_for_run_forgotten``) until its TTL.
        self.early_ends: dict[str, float] = {}
        # The hosts whose calls were refused for their token, and when last (the
        # daemon's clock): a member of such a host silent since is lost for that, not
        # as unreachable (``liveness.token_refused``). Bounded, the oldest dropped.
        self.token_refused: dict[str, float] = {}

    def take_effects(self) -> list[Effect]:
        return self.calls.take()

    @property
    def waiter_count(self) -> int:
        return len(self.calls.waiting)

    # joins.py
    join = joins.join
    publish_id = joins.publish_id
    cancel_wait = joins.cancel_wait

    # liveness.py
    attach_stream = liveness.attach_stream
    heartbeat = liveness.heartbeat
    report_progress = liveness.report_progress
    detach_stream = liveness.detach_stream
    tick = liveness.tick
    stalled = liveness.stalled
    leave = liveness.leave
    leave_given_up = liveness.leave_given_up
    report_failure = liveness.report_failure
    oldest_silence = liveness.oldest_silence
    live_members = liveness.live_members
    refused_token = liveness.refused_token

    # rounds.py
    put_back = rounds.put_back

    # seats.py
    stream_current = seats.stream_current

    def member_table(
        self, job_id: str, generation: int, rank: int, instance_id: str, *, connection: str = ""
    ) -> tuple[MemberInfo, ...]:
        """A formed generation's member table, for one of its members (GetMembers); a
        generation that ended keeps it, so a worker may read it after its peers left.
        ``connection``, here and in the members' other calls: the gRPC peer the call came
        over (``seats.seated``)."""
        job, _ = seats.caller(
            self, job_id, generation, rank, instance_id, running=False, connection=connection
        )
        if not job.gen.member_table:
            raise job.generation_fault()  # still forming: NOT_RUNNING
        return job.gen.member_table

    def barrier(
        self,
        job_id: str,
        generation: int,
        rank: int,
        name: str,
        sequence: int,
        now: float,
        *,
        instance_id: str,
        connection: str = "",
    ) -> int | Parked:
        job, member = seats.caller(
            self, job_id, generation, rank, instance_id, connection=connection
        )
        barrier, done = barriers.enter(job, member, name, sequence, self.limits)
        if done:
            return sequence
        if job.barrier_complete(len(barrier.arrived) + (rank not in barrier.arrived)):
            for w in barriers.release(barrier):
                self.calls.wake(w, barrier.completed)
            return sequence
        return self.calls.park_under(
            barrier.arrived, rank, job, waits.WaitKind.BARRIER, rank, name, now
        )

    def kv_set(
        self,
        job_id: str,
        generation: int,
        rank: int,
        key: str,
        value: bytes,
        *,
        instance_id: str,
        connection: str = "",
    ) -> None:
        job = self._kv_job(job_id, generation, rank, key, instance_id, connection)
        self._store(job, key, validation.kv_value(value, self.limits))

    def kv_get(
        self,
        job_id: str,
        generation: int,
        rank: int,
        key: str,
        wait: bool,
        now: float,
        *,
        instance_id: str,
        connection: str = "",
    ) -> bytes | Parked:
        job = self._kv_job(job_id, generation, rank, key, instance_id, connection)
        value = job.gen.kv.get(key)
        if value is not None:
            return value
        if not wait:
            raise job.fault(
                Code.NOT_FOUND, Reason.KEY_NOT_FOUND, f"key {quoted(key)} is not set in {job.named}"
            )
        return self.calls.park_under(
            job.gen.kv_waiters, key, job, waits.WaitKind.KV, rank, key, now
        )

    def kv_add(
        self,
        job_id: str,
        generation: int,
        rank: int,
        key: str,
        delta: int,
        *,
        instance_id: str,
        connection: str = "",
    ) -> int:
        job = self._kv_job(job_id, generation, rank, key, instance_id, connection)
        value = kv.counter(job, key, delta)
        self._store(job, key, value)
        return int(value)

    def kv_compare_and_set(
        self,
        job_id: str,
        generation: int,
        rank: int,
        key: str,
        expected: bytes | None,
        desired: bytes,
        *,
        instance_id: str,
        connection: str = "",
    ) -> tuple[bool, bytes | None]:
        job = self._kv_job(job_id, generation, rank, key, instance_id, connection)
        validation.kv_value(desired, self.limits)
        current = job.gen.kv.get(key)
        if current != expected:
            return False, current
        self._store(job, key, desired)
        return True, desired

    def kv_delete(
        self,
        job_id: str,
        generation: int,
        rank: int,
        key: str,
        *,
        instance_id: str,
        connection: str = "",
    ) -> bool:
        job = self._kv_job(job_id, generation, rank, key, instance_id, connection)
        return kv.delete(job, key)

    def _kv_job(
        self, job_id: str, generation: int, rank: int, key: str, instance_id: str, connection: str
    ) -> Job:
        """The calling member's job, once ``key`` is a valid key."""
        job, _ = seats.caller(self, job_id, generation, rank, instance_id, connection=connection)
        validation.kv_key(key, self.limits)
        return job

    @property
    def kv_bytes(self) -> int:
        """Key-value bytes held across every job (the ``max_kv_bytes`` budget), summed so
        that it can never drift from the stores."""
        return sum(job.gen.kv_bytes for job in self.jobs.values())

    def _store(self, job: Job, key: str, value: bytes) -> None:
        for w in kv.put(job, key, value, self.limits, self.kv_bytes):
            self.calls.wake(w, value)

    def abort(
        self,
        job_id: str,
        generation: int,
        reason: str,
        now: float,
        *,
        close: bool = False,
        cause: AbortCause = AbortCause.UNSPECIFIED,
    ) -> int:
        """Abort the job's generation (a terminal one is left as it is); ``close``: and
        close the job's run, which node agents launched before now are then refused
        (``joins.launched_before_close``), the failed generation's survivors too, and
        the standbys parked on it are told at once. ``cause``: what the abort is, told
        with it as data (its peers act on it, never on the reason's words)."""
        validation.text_field("reason", reason, self.limits.max_reason_bytes, required=False)
        job = seats.find_job(self, job_id)
        if generation not in (0, job.generation):
            seats.seat(self, job_id, generation, 0)  # raises STALE_GENERATION
        if close and job.state is not JobState.ENDED:
            job.closed = Closed(now, reason or "closed by request", job.generation, cause)
            joins.standbys_closed_out(self, job)
        if job.state in (JobState.FORMING, JobState.RUNNING):
            job.gen.abort_reason = reason or "aborted by request"
            job.gen.abort_cause = cause
            rounds.set_state(self, job, JobState.ABORTED, now, job.gen.abort_reason)
            rounds.fail_waiters(self, job)
            rounds.notify(
                self,
                job,
                EventKind.JOB_ABORTED,
                reason=job.gen.abort_reason,
                abort_cause=cause,
                closed=close,
            )
        return job.generation

    def drain(self, now: float) -> None:
        """Shutdown began: refuse new joins, release every waiter, tell every member."""
        self.draining = True
        fault = fences.draining()
        for waiter in list(self.calls.waiting):
            self.calls.wake(waiter, fault=fault)
        for job in self.jobs.values():
            job.gen.join_waiters.clear()
            job.scaleup_waiters.clear()
            job.standby_waiters.clear()
            job.next_run_waiters.clear()
            job.gen.kv_waiters.clear()
            for barrier in job.gen.barriers.values():
                barrier.arrived.clear()
            job.state_age_at_drain = max(0.0, now - job.state_since)
            if job.state is JobState.RUNNING:
                job.drained_at = now
                rounds.notify(self, job, EventKind.DAEMON_DRAINING, reason="daemon shutting down")

    def views(self, now: float, *, with_members: bool = True) -> Iterator[JobView]:
        for job_id in sorted(self.jobs):
            yield self.view(job_id, now, with_members=with_members)

    def view(self, job_id: str, now: float, *, with_members: bool = True) -> JobView:
        return job_view(seats.find_job(self, job_id), now, with_members=with_members)
