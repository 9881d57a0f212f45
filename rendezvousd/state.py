"""The daemon's decisions, as a pure state machine.

Every method takes the current monotonic time, mutates in-memory state, and
either returns a value, returns ``Parked`` (the caller must wait), or raises
``RendezvousFault``. Side effects for other callers (wake a parked call, push
an event to a heartbeat stream, log a transition) are queued and collected
with ``take_effects()``. There is no I/O, no clock and no asyncio here, which
is what lets tests and the Hypothesis model drive it directly.
"""

from __future__ import annotations

from collections.abc import Iterator

from rendezvousd import barriers, fences, kv, nodes, placement, validation, waits
from rendezvousd.errors import Code, Reason, RendezvousFault
from rendezvousd.job import Job, Member
from rendezvousd.model import (
    EventKind,
    JobState,
    JobView,
    JoinMode,
    JoinResult,
    MemberInfo,
    MemberState,
    Notify,
    Parked,
    Transition,
)
from rendezvousd.node_state import NodeJoins
from rendezvousd.nodes import NodeJoinArgs
from rendezvousd.placement import JoinArgs
from rendezvousd.state_core import TERMINAL
from rendezvousd.views import job_view

# JoinArgs/NodeJoinArgs are part of this module's interface: callers build the requests
# they pass to join() and join_node().
__all__ = ["JoinArgs", "NodeJoinArgs", "RendezvousState"]


class RendezvousState(NodeJoins):
    # -- join -------------------------------------------------------------

    def join(self, args: JoinArgs, now: float) -> JoinResult | Parked:
        self._check_not_draining()
        placement.check(args, self.limits)
        job = self._job_for_join(args, now)
        node_rank = placement.node_rank(job, args)
        rank = job.rank_of(node_rank, args.local_rank)
        member = job.gen.members.get(rank)
        if member is not None and member.instance_id != args.instance_id:
            if not placement.abandoned(job, member):
                raise placement.duplicate_rank(job, args, rank, node_rank, member)
            placement.unplace(job, rank, now)
            member = None
        if args.unique_id:
            placement.accept_id(job, rank, args.unique_id)
        added = member is None
        if member is None:
            if job.state is not JobState.FORMING:
                raise job.generation_fault()
            member = Member(
                rank, node_rank, args.local_rank, args.host, args.address, args.instance_id
            )
            job.gen.members[rank] = member
            if args.node_rank is None:
                job.gen.host_nodes.setdefault(args.host, node_rank)
        try:
            outcome = self._join_outcome(job, member, now)
        except RendezvousFault as fault:
            if added and fault.reason == Reason.LIMIT_EXCEEDED:
                # Refused for capacity: the rank must stay free for the retry.
                placement.unplace(job, rank, now)
            raise
        if isinstance(outcome, JoinResult) and outcome.id_required:
            # A rank 0 that crashes before PublishId must not keep the job forming
            # forever: it is freed at the Join's own (capped) deadline. Its restart
            # need not wait for that: no call holds the rank (placement.abandoned).
            wait = min(args.wait_s or self.timing.default_wait_s, self.timing.max_wait_s)
            job.gen.id_deadline = now + wait
        return outcome

    def publish_id(
        self,
        job_id: str,
        generation: int,
        rank: int,
        instance_id: str,
        unique_id: bytes,
        now: float,
    ) -> JoinResult | Parked:
        validation.unique_id(unique_id)
        job, member = self._seat(job_id, generation, rank)
        assert isinstance(member, Member)  # RANK seats are members
        if job.state in TERMINAL:
            raise job.generation_fault()
        if rank == 0 and member.instance_id != instance_id:
            # Rank 0 was taken by a restarted worker while this one owed the id.
            raise fences.other_instance(job, generation, rank, instance_id)
        if rank != 0:
            raise RendezvousFault(
                Code.PERMISSION_DENIED,
                Reason.NOT_RANK_ZERO,
                f"only the worker holding global rank 0 publishes the id of job {job_id!r}",
                {"job_id": job_id, "ranks": str(rank)},
            )
        placement.accept_id(job, rank, unique_id)
        job.gen.id_deadline = None
        return self._join_outcome(job, member, now)

    def _job_for_join(self, args: JoinArgs, now: float) -> Job:
        job = self.jobs.get(args.job_id)
        if job is None:
            job = self._open_job(args.job_id, args.num_nodes, args.gpus_per_node, now)
            job.gen.join_mode = JoinMode.RANK
            return job
        if job.state in TERMINAL and not placement.rejoin_of_current(job, args):
            self._next_generation(job, now)
            # A new generation may change the topology: it starts from scratch.
            job.num_nodes, job.gpus_per_node = args.num_nodes, args.gpus_per_node
        if job.state is JobState.FORMING and not job.gen.members and not job.gen.nodes:
            job.gen.join_mode = JoinMode.RANK
        elif job.gen.join_mode is not JoinMode.RANK:
            raise nodes.mode_mismatch(job, JoinMode.RANK, args.host)
        if (job.num_nodes, job.gpus_per_node) != (args.num_nodes, args.gpus_per_node):
            if job.state is JobState.FORMING and not job.gen.members:
                # Nobody is waiting on the old topology: the next joiner sets it.
                job.num_nodes, job.gpus_per_node = args.num_nodes, args.gpus_per_node
                return job
            fault = job.topology_conflict(args.host, (args.num_nodes, args.gpus_per_node))
            raise self._conflict(job, fault, now)
        return job

    def _join_outcome(self, job: Job, member: Member, now: float) -> JoinResult | Parked:
        if (
            job.state is JobState.FORMING
            and len(job.gen.members) == job.world_size
            and job.gen.unique_id
        ):
            self._form(job, now, f"all {job.world_size} ranks joined")
        if job.state is JobState.RUNNING:
            if job.gen.unique_id is None:
                # Restored after a restart: the id was never on disk, so this
                # rank can no longer be given it. Fence the generation.
                self._lose(job, [member], "daemon restarted before this rank received the id", now)
                raise job.generation_fault()
            return placement.result(job, member)
        if job.state in TERMINAL:
            raise job.generation_fault()
        if member.rank == 0 and job.gen.unique_id is None:
            return placement.id_required(job, member)
        parked = self._park(job, waits.WaitKind.JOIN, member.rank, "", now)
        job.gen.join_waiters[parked.waiter] = member.rank
        return parked

    # -- waiting calls that end ------------------------------------------

    def cancel_wait(self, waiter: int, now: float, *, timed_out: bool) -> RendezvousFault | None:
        """A parked call ended without a wake (deadline, cancel). Returns its fault."""
        w = self._unpark(waiter)
        if w is None:
            return None
        job = self.jobs.get(w.job_id)
        if job is None or job.generation != w.generation:
            return None
        if w.kind in (waits.WaitKind.NODE, waits.WaitKind.SCALEUP):
            return self._node_wait_ended(job, w, waiter, now, timed_out=timed_out)
        waited = f"{now - w.since:.1f} s"
        if w.kind is waits.WaitKind.JOIN:
            job.gen.join_waiters.pop(waiter, None)
            if not timed_out:
                self._abandon_join(job, w.rank, now)
                return None
            missing = job.missing_ranks()
            placement.unplace(job, w.rank, now)
            return waits.world_incomplete(job, missing, waited)
        if w.kind is waits.WaitKind.BARRIER:
            meta = {"job_id": job.job_id, "generation": str(job.generation)}
            return barriers.timed_out(job, w.key, w.rank, waiter, waited, meta)
        return waits.key_wait_timeout(job, w.key, waiter, waited)

    def _abandon_join(self, job: Job, rank: int, now: float) -> None:
        member = job.gen.members.get(rank)
        if (
            job.state is not JobState.FORMING
            or member is None
            or rank in job.gen.join_waiters.values()
        ):
            return
        cause = "its Join was cancelled (worker died or disconnected)"
        self._joiner_died(
            job, member, member.loss(cause, now), f"rank {rank} on {member.host}", now
        )

    def member_table(
        self, job_id: str, generation: int, rank: int, instance_id: str
    ) -> tuple[MemberInfo, ...]:
        """A formed generation's member table, for one of its members (GetMembers); a
        generation that ended keeps it, so a worker may read it after its peers left."""
        job, _ = self._caller(job_id, generation, rank, instance_id, running=False)
        if not job.gen.member_table:
            raise job.generation_fault()  # still forming: NOT_RUNNING
        return job.gen.member_table

    # -- barrier ----------------------------------------------------------

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
    ) -> int | Parked:
        job, member = self._caller(job_id, generation, rank, instance_id)
        barrier, done = barriers.enter(job, member, name, sequence, self.limits)
        if done:
            return sequence
        if job.barrier_complete(len(barrier.arrived) + (rank not in barrier.arrived)):
            for w in barriers.release(barrier):
                self._wake(w, barrier.completed)
            return sequence
        return self._park_under(barrier.arrived, rank, job, waits.WaitKind.BARRIER, rank, name, now)

    # -- key-value store --------------------------------------------------

    def kv_set(
        self, job_id: str, generation: int, rank: int, key: str, value: bytes, *, instance_id: str
    ) -> None:
        job = self._kv_job(job_id, generation, rank, key, instance_id)
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
    ) -> bytes | Parked:
        job = self._kv_job(job_id, generation, rank, key, instance_id)
        value = job.gen.kv.get(key)
        if value is not None:
            return value
        if not wait:
            raise job.fault(
                Code.NOT_FOUND, Reason.KEY_NOT_FOUND, f"key {key!r} is not set in {job.named}"
            )
        return self._park_under(job.gen.kv_waiters, key, job, waits.WaitKind.KV, rank, key, now)

    def kv_add(
        self, job_id: str, generation: int, rank: int, key: str, delta: int, *, instance_id: str
    ) -> int:
        job = self._kv_job(job_id, generation, rank, key, instance_id)
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
    ) -> tuple[bool, bytes | None]:
        job = self._kv_job(job_id, generation, rank, key, instance_id)
        validation.kv_value(desired, self.limits)
        current = job.gen.kv.get(key)
        if current != expected:
            return False, current
        self._store(job, key, desired)
        return True, desired

    def kv_delete(
        self, job_id: str, generation: int, rank: int, key: str, *, instance_id: str
    ) -> bool:
        return kv.delete(self._kv_job(job_id, generation, rank, key, instance_id), key)

    def _kv_job(self, job_id: str, generation: int, rank: int, key: str, instance_id: str) -> Job:
        """The calling member's job, once ``key`` is a valid key."""
        job, _ = self._caller(job_id, generation, rank, instance_id)
        validation.kv_key(key, self.limits)
        return job

    @property
    def kv_bytes(self) -> int:
        """Key-value bytes held across every job (the ``max_kv_bytes`` budget)."""
        return kv.daemon_bytes(self.jobs.values())

    def _store(self, job: Job, key: str, value: bytes) -> None:
        for w in kv.put(job, key, value, self.limits, self.kv_bytes):
            self._wake(w, value)

    # -- liveness ---------------------------------------------------------

    def attach_stream(
        self,
        job_id: str,
        generation: int,
        who: int,
        instance_id: str,
        now: float,
        *,
        mode: JoinMode = JoinMode.RANK,
    ) -> int:
        """A heartbeat stream of attendee ``who`` opened; returns its token for
        ``detach_stream``."""
        job, seated = self._seated(job_id, generation, who, instance_id, mode)
        if mode is not job.gen.join_mode:
            # Its node agent's stream is this rank's liveness: a stream of the rank's own
            # would fail the whole generation when it closed (the worker exiting).
            raise fences.rank_stream_in_node_job(job, who)
        token = seated.attach(now)
        if job.scaleup_waiters:
            # Nodes parked before this stream (re)attached: it would miss the event.
            waiting = len(set(job.scaleup_waiters.values()))
            self._effects.append(
                Notify(
                    job.job_id,
                    job.generation,
                    mode,
                    (who,),
                    EventKind.NODES_WAITING,
                    nodes_waiting=waiting,
                )
            )
        return token

    def heartbeat(
        self, job_id: str, generation: int, who: int, now: float, *, mode: JoinMode = JoinMode.RANK
    ) -> None:
        job, seated = self._seat(job_id, generation, who, mode)
        if job.state is not JobState.RUNNING:
            raise job.generation_fault()
        seated.last_seen = now
        for m in job.covered(seated):
            m.last_seen = now  # what GetJob shows as each member's heartbeat age

    def detach_stream(
        self,
        job_id: str,
        generation: int,
        who: int,
        token: int,
        now: float,
        *,
        mode: JoinMode = JoinMode.RANK,
    ) -> None:
        """A heartbeat stream ended. Without a Leave first, its attendee is lost. Once
        the generation failed, the survivors' streams end as a matter of course: that is
        no loss (it would also count them out of the nodes expected back)."""
        job = self._stream_job(job_id, generation)
        seated = job.attendees(mode).get(who) if job else None
        if job and seated and seated.detach(token) and job.state is JobState.RUNNING:
            self._lose_seated(job, seated, self._stream_end_cause(seated, now), now)

    def tick(self, now: float) -> None:
        """Time-driven decisions: an id owed too long, a node generation's last call,
        silent attendees lost, old jobs forgotten."""
        timeout = self.timing.heartbeat_timeout_s
        for job in list(self.jobs.values()):
            if job.gen.id_deadline is not None and now > job.gen.id_deadline:
                self._id_overdue(job, now)
            if job.state is JobState.FORMING:
                self._try_form(job, now)
            elif job.state is JobState.RUNNING:
                self._tell_waiting(job, now)
                for seated in list(job.attendees(job.gen.join_mode).values()):
                    if seated.state is MemberState.ACTIVE and now - seated.last_seen > timeout:
                        self._lose_seated(job, seated, self._silent(seated.who), now)
            idle = job.state in TERMINAL or (
                job.state is JobState.FORMING and not job.gen.members and not job.gen.nodes
            )
            if idle and now - job.state_since > self.timing.job_ttl_s and not job.all_waiters():
                del self.jobs[job.job_id]
                self._effects.append(
                    Transition(job.job_id, job.generation, job.state, None, "expired")
                )

    def _id_overdue(self, job: Job, now: float) -> None:
        """Rank 0 (node 0) was told id_required and neither published nor waited since:
        its seat is free for a restarted worker (node agent)."""
        job.gen.id_deadline = None
        if job.state is not JobState.FORMING or job.gen.unique_id is not None:
            return
        if job.gen.join_mode is JoinMode.NODE:
            if (head := nodes.holder(job)) is not None:
                self._remove_node(job, head, now)
            return
        rank_zero = job.gen.members.get(0)
        if rank_zero is None or 0 in job.gen.join_waiters.values():
            return  # its PublishId is parked: that call's own deadline applies
        placement.unplace(job, 0, now)
        self._effects.append(
            Transition(
                job.job_id,
                job.generation,
                JobState.FORMING,
                JobState.FORMING,
                f"rank 0 on {rank_zero.host} did not publish the id within its Join's wait; "
                "rank 0 is free for a restarted worker",
            )
        )

    # -- endings ----------------------------------------------------------

    def leave(
        self,
        job_id: str,
        generation: int,
        who: int,
        instance_id: str,
        now: float,
        *,
        mode: JoinMode = JoinMode.RANK,
    ) -> None:
        job, seated = self._seated(job_id, generation, who, instance_id, mode, running=False)
        if job.state is JobState.FORMING:
            # Only a worker holds a seat while forming (a node's comes as it forms).
            for waiter, r in list(job.gen.join_waiters.items()):
                if r == who:
                    job.gen.join_waiters.pop(waiter)
                    self._wake(
                        waiter,
                        fault=RendezvousFault(
                            Code.ABORTED,
                            Reason.JOB_ABORTED,
                            f"rank {who} left job {job_id!r} before it formed",
                        ),
                    )
            placement.unplace(job, who, now)
            return
        for member in job.covered(seated):
            self._member_left(job, member, now)
        if seated.state is MemberState.ACTIVE:
            seated.state = MemberState.LEFT

    def abort(self, job_id: str, generation: int, reason: str, now: float) -> int:
        validation.text_field("reason", reason, self.limits.max_reason_bytes, required=False)
        job = self._job(job_id)
        if generation not in (0, job.generation):
            self._seat(job_id, generation, 0)  # raises STALE_GENERATION
        if job.state in (JobState.FORMING, JobState.RUNNING):
            job.gen.abort_reason = reason or "aborted by request"
            self._set_state(job, JobState.ABORTED, now, job.gen.abort_reason)
            self._fail_waiters(job)
            self._notify(job, EventKind.JOB_ABORTED, reason=job.gen.abort_reason)
        return job.generation

    def drain(self) -> None:
        """Shutdown began: refuse new joins, release every waiter, tell every member."""
        self.draining = True
        fault = fences.draining()
        for waiter in list(self._waiters):
            self._wake(waiter, fault=fault)
        for job in self.jobs.values():
            job.gen.join_waiters.clear()
            job.gen.node_waiters.clear()
            job.scaleup_waiters.clear()
            job.gen.kv_waiters.clear()
            for barrier in job.gen.barriers.values():
                barrier.arrived.clear()
            if job.state is JobState.RUNNING:
                self._notify(job, EventKind.DAEMON_DRAINING, reason="daemon shutting down")

    # -- inspection -------------------------------------------------------

    def views(self, now: float) -> Iterator[JobView]:
        for job_id in sorted(self.jobs):
            yield self.view(job_id, now)

    def view(self, job_id: str, now: float) -> JobView:
        return job_view(self._job(job_id), now)
