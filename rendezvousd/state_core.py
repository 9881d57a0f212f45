"""The state machine's plumbing: parking and waking calls, queued effects, the
lookups that fence a caller off, and failing a generation.

``RendezvousState`` (per-rank joins, barriers, key-value, liveness) and
``NodeJoins`` (node agents) make the decisions on top of it. Pure, like them.
"""

from __future__ import annotations

import itertools
from typing import TypeVar

from rendezvousd import barriers, fences, nodes, placement, validation, waits
from rendezvousd.errors import RendezvousFault
from rendezvousd.escape import shortened
from rendezvousd.job import Attendee, Job, Member, Node
from rendezvousd.limits import Limits, Timing
from rendezvousd.model import (
    Effect,
    EventKind,
    FailedInfo,
    JobState,
    JoinMode,
    MemberState,
    Notify,
    Parked,
    Rejoin,
    Transition,
    Wake,
)

TERMINAL = (JobState.FAILED, JobState.ABORTED, JobState.ENDED)

_K = TypeVar("_K")


class StateCore:
    def __init__(self, limits: Limits | None = None, timing: Timing | None = None) -> None:
        self.limits = limits or Limits()
        self.timing = timing or Timing()
        self.jobs: dict[str, Job] = {}
        self.draining = False
        self._waiters: dict[int, waits.Waiter] = {}
        self._job_waiters: dict[str, int] = {}  # job id -> its entries in _waiters
        self._next_waiter = itertools.count(1)
        self._effects: list[Effect] = []

    # -- plumbing ---------------------------------------------------------

    def take_effects(self) -> list[Effect]:
        effects, self._effects = self._effects, []
        return effects

    @property
    def waiter_count(self) -> int:
        return len(self._waiters)

    def _check_not_draining(self) -> None:
        """A daemon shutting down refuses joins as UNAVAILABLE: clients retry once it is back."""
        if self.draining:
            raise fences.draining()

    def _park(self, job: Job, kind: waits.WaitKind, rank: int, key: str, now: float) -> Parked:
        if len(self._waiters) >= self.limits.max_waiters:
            raise validation.limit_exceeded(
                "max_waiters",
                f"the daemon already holds max_waiters={self.limits.max_waiters} waiting calls",
            )
        held = self._job_waiters.get(job.job_id, 0)
        if held >= self.limits.max_waiters_per_job:
            # One job (one buggy or hostile token holder) must not take every slot.
            raise validation.limit_exceeded(
                "max_waiters_per_job",
                f"job {job.job_id!r} already holds max_waiters_per_job="
                f"{self.limits.max_waiters_per_job} waiting calls",
                job_id=job.job_id,
            )
        waiter = next(self._next_waiter)
        self._waiters[waiter] = waits.Waiter(job.job_id, job.generation, kind, rank, key, now)
        self._job_waiters[job.job_id] = held + 1
        return Parked(waiter)

    def _park_under(
        self,
        waiters: dict[_K, set[int]],
        under: _K,
        job: Job,
        kind: waits.WaitKind,
        rank: int,
        key: str,
        now: float,
    ) -> Parked:
        """``_park``, and list the waiter in ``waiters[under]`` once it is admitted."""
        parked = self._park(job, kind, rank, key, now)
        waiters.setdefault(under, set()).add(parked.waiter)
        return parked

    def _unpark(self, waiter: int) -> waits.Waiter | None:
        w = self._waiters.pop(waiter, None)
        if w is not None:
            held = self._job_waiters.pop(w.job_id) - 1
            if held:
                self._job_waiters[w.job_id] = held
        return w

    def _wake(
        self, waiter: int, value: object = None, fault: RendezvousFault | None = None
    ) -> None:
        if self._unpark(waiter) is not None:
            self._effects.append(Wake(waiter, value, fault))

    def put_back(self, job_id: str, job: Job | None, fault: RendezvousFault, detail: str) -> None:
        """``job`` (None: no job) replaces ``job_id``'s job: the durable form it had
        before changes that are undone. What a call parked on it waited for may be gone,
        so each wakes with ``fault``."""
        if self._job_waiters.get(job_id):
            for waiter in [w for w, rec in self._waiters.items() if rec.job_id == job_id]:
                self._wake(waiter, fault=fault)
        old = self.jobs.pop(job_id, None)
        if job is not None:
            self.jobs[job_id] = job
        shown = job or old
        if shown is not None:
            self._effects.append(
                Transition(
                    job_id,
                    shown.generation,
                    old.state if old else None,
                    job.state if job else None,
                    detail,
                )
            )

    def stream_current(
        self, job_id: str, generation: int, who: int, token: int, mode: JoinMode
    ) -> bool:
        """Whether the heartbeat stream ``token`` of attendee ``who`` still serves one:
        false once the job put back has no such attendee of that generation."""
        job = self.jobs.get(job_id)
        if job is None or job.generation != generation:
            return False
        attendee = job.attendees(mode).get(who)
        return attendee is not None and attendee.stream_token == token

    def _set_state(self, job: Job, new: JobState, now: float, detail: str) -> None:
        old = job.state
        job.state = new
        job.state_since = now
        self._effects.append(Transition(job.job_id, job.generation, old, new, detail))
        if new in TERMINAL:
            # Nodes parked for a scale-up wanted the next generation, not this one:
            # they ask again and open it, instead of hearing this one's fault.
            job.gen.scaleups_woken = len(set(job.scaleup_waiters.values()))
            for waiter in list(job.scaleup_waiters):
                self._wake(waiter, Rejoin())
            job.scaleup_waiters.clear()

    def _open_job(self, job_id: str, num_nodes: int, gpus_per_node: int, now: float) -> Job:
        """A job's first joiner creates it, FORMING its first generation."""
        if len(self.jobs) >= self.limits.max_jobs:
            raise validation.limit_exceeded(
                "max_jobs", f"the daemon already holds max_jobs={self.limits.max_jobs} jobs"
            )
        job = Job(job_id, num_nodes, gpus_per_node, 0, JobState.FORMING, now)
        self.jobs[job_id] = job
        job.open_generation(now)
        self._effects.append(
            Transition(job.job_id, job.generation, None, JobState.FORMING, "created")
        )
        return job

    def _next_generation(self, job: Job, now: float) -> None:
        """A newcomer to an ended generation opens the next one."""
        if job.gen.conflict is not None and now - job.state_since < self.timing.heartbeat_timeout_s:
            # Late workers of the launch that had the conflict hear about it too,
            # instead of opening a generation nobody else will join.
            raise job.gen.conflict
        old = job.state
        job.open_generation(now)
        self._effects.append(
            Transition(job.job_id, job.generation, old, JobState.FORMING, "new generation")
        )

    def _conflict(self, job: Job, fault: RendezvousFault, now: float) -> RendezvousFault:
        """``fault``, a joiner's conflict with the job's topology, to raise. Either side
        may be the wrong one: a forming generation fails, so that every waiter learns
        now, not at its join timeout, and late joiners of the launch hear it too."""
        if job.state is JobState.FORMING:
            job.gen.conflict = fault
            self._set_state(job, JobState.FAILED, now, fault.message)
            self._fail_waiters(job)
        return fault

    def _job(self, job_id: str) -> Job:
        job = self.jobs.get(validation.job_id(job_id))
        if job is None:
            raise fences.no_such_job(job_id)
        return job

    def _stream_job(self, job_id: str, generation: int) -> Job | None:
        """The job a heartbeat stream that just ended served, unless its generation moved
        on (the stream's end says nothing about the new one) or the daemon is draining."""
        job = self.jobs.get(job_id)
        if job is None or job.generation != generation or self.draining:
            return None
        return job

    def _seat(
        self, job_id: str, generation: int, who: int, mode: JoinMode = JoinMode.RANK
    ) -> tuple[Job, Member | Node]:
        """The caller's job and seat (``Job.attendees``), or the fault that fences it off."""
        job = self._job(job_id)
        if generation != job.generation:
            raise fences.stale_generation(job, generation)
        seated = job.attendees(mode).get(who)
        if seated is None:
            raise fences.not_seated(job, generation, who, mode)
        return job, seated

    def _seated(
        self,
        job_id: str,
        generation: int,
        who: int,
        instance_id: str,
        mode: JoinMode = JoinMode.RANK,
        *,
        running: bool = True,
    ) -> tuple[Job, Member | Node]:
        """``_seat``, and the caller must be the instance that took it: holding the token
        is not enough to act for another job's or another process's seat."""
        job, seated = self._seat(job_id, generation, who, mode)
        if mode is JoinMode.NODE and seated.instance_id != instance_id:
            raise fences.not_seated(job, generation, who, mode)
        if running and job.state is not JobState.RUNNING:
            raise job.generation_fault()
        if seated.instance_id != instance_id:
            raise fences.other_instance(job, generation, who, instance_id)
        return job, seated

    def _caller(
        self, job_id: str, generation: int, rank: int, instance_id: str, *, running: bool = True
    ) -> tuple[Job, Member]:
        """``_seated`` for a worker's own call (barrier, key-value, its table, its id)."""
        job, member = self._seated(job_id, generation, rank, instance_id, running=running)
        assert isinstance(member, Member)  # RANK seats are members
        return job, member

    def _silent(self, who: str) -> str:
        """The cause of losing an attendee to the heartbeat timeout; ``who``: "node" or
        "worker". Worded apart from a closed stream: survivors can tell a host that went
        silent (partition, power loss, a stopped process) from a process that died."""
        return f"no heartbeat for {self.timing.heartbeat_timeout_s:.1f} s ({who} unreachable)"

    def _stream_end_cause(self, attendee: Attendee, now: float) -> str:
        """Why the end of ``attendee``'s stream loses it: its stream closed, unless it had
        been silent for the heartbeat timeout by then. The daemon's own keepalive ends the
        connection of a peer that stopped answering (``server.py``), which may come a
        moment before the tick that would have named the silence: the silence is still
        the cause, not the cut that followed it."""
        if now - attendee.last_seen >= self.timing.heartbeat_timeout_s:
            return self._silent(attendee.who)
        return attendee.stream_closed

    def _lose_seated(self, job: Job, seated: Member | Node, cause: str, now: float) -> None:
        """``seated`` is gone (silent, its stream closed), and with it the active members
        it attends for."""
        lost = [m for m in job.covered(seated) if m.state is MemberState.ACTIVE]
        seated.state = MemberState.LOST
        seated.stream_open = False
        self._lose(job, lost, cause, now)

    def _lose(
        self, job: Job, lost: list[Member], cause: str, now: float, *, told: int | None = None
    ) -> None:
        """``lost`` members are gone: the generation fails, every other member (node
        agent in a JoinNode generation; but the node ``told``, which reported it) hears."""
        for member in lost:
            member.state = MemberState.LOST
            member.stream_open = False
            job.gen.failed.append(member.loss(cause, now))
        if job.state is not JobState.RUNNING or not lost:
            return  # the generation already ended: survivors were told once
        first = job.gen.failed[-len(lost)]
        more = f" (and {len(lost) - 1} more of its node)" if len(lost) > 1 else ""
        self._set_state(job, JobState.FAILED, now, f"{first.describe()}{more}")
        self._fail_waiters(job)
        # The event's failed list holds the whole cause; its reason only shows it.
        self._notify(job, EventKind.PEER_FAILED, reason=shortened(cause), skip=told)

    def _fail_waiters(self, job: Job) -> None:
        fault = job.generation_fault()
        for w in job.all_waiters():
            self._wake(w, fault=fault)
        job.gen.join_waiters.clear()
        job.gen.node_waiters.clear()
        job.gen.kv_waiters.clear()
        for barrier in job.gen.barriers.values():
            barrier.arrived.clear()

    def _notify(
        self,
        job: Job,
        kind: EventKind,
        reason: str = "",
        *,
        skip: int | None = None,
        nodes_waiting: int = 0,
    ) -> None:
        # Attendees hear it on their streams: a node agent's covers its ranks, which
        # have none of their own.
        to = tuple(
            r
            for r, a in job.attendees(job.gen.join_mode).items()
            if a.state is MemberState.ACTIVE and r != skip
        )
        if to:
            self._effects.append(
                Notify(
                    job.job_id,
                    job.generation,
                    job.gen.join_mode,
                    to,
                    kind,
                    tuple(job.gen.failed),
                    reason,
                    nodes_waiting,
                )
            )

    def _member_left(self, job: Job, member: Member, now: float) -> None:
        """A member of a formed generation is done; the last one ends the job."""
        if member.state is MemberState.ACTIVE:
            member.state = MemberState.LEFT
            job.gen.left += 1
        if job.state is JobState.RUNNING:
            if job.gen.left == len(job.gen.members):
                self._set_state(job, JobState.ENDED, now, "every member left")
                return
            for barrier in job.gen.barriers.values():
                if barrier.arrived and job.barrier_complete(len(barrier.arrived)):
                    for w in barriers.release(barrier):
                        self._wake(w, barrier.completed)

    def _form(self, job: Job, now: float, detail: str) -> None:
        """Every rank is placed and the id known: the generation runs, each attendee and
        member is live, and every parked join gets its answer."""
        for seated in (*job.gen.nodes.values(), *job.gen.members.values()):
            seated.state = MemberState.ACTIVE
            seated.last_seen = now
        job.gen.member_table = tuple(job.gen.members[r].info() for r in range(job.world_size))
        self._set_state(job, JobState.RUNNING, now, detail)
        for waiter, rank in job.gen.join_waiters.items():
            self._wake(waiter, placement.result(job, job.gen.members[rank]))
        for waiter, instance in job.gen.node_waiters.items():
            self._wake(waiter, nodes.result(job, job.gen.nodes[instance]))
        job.gen.join_waiters.clear()
        job.gen.node_waiters.clear()

    def _joiner_died(
        self, job: Job, seated: Attendee, loss: FailedInfo, whom: str, now: float
    ) -> None:
        """A forming joiner's parked call vanished (its process died or disconnected):
        everyone waiting for this world is told at once, rather than at their timeout."""
        seated.state = MemberState.LOST
        job.gen.failed.append(loss)
        self._set_state(job, JobState.FAILED, now, f"{whom}: {loss.cause}")
        self._fail_waiters(job)
