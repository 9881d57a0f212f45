"""Hypothesis drives the pure state machine through random joins (some with a wrong
topology), id publishes, barriers, key-value waits and sets, parked calls timing out or
cancelled, heartbeat loss, leaves, aborts and restarts, checking invariants after every
step: one id per generation, ranks unique and dense, no waiter left behind once a job
ends or listed once its call is gone, stale generations always rejected."""

from __future__ import annotations

import contextlib
import os

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from rendezvousd.common.model import JobState, JoinResult, MemberState, Parked, Wake
from rendezvousd.errors import Code, RendezvousFault
from rendezvousd.state.machine import JoinArgs, RendezvousState
from rendezvousd.storage import snapshot

NODES, GPUS = 2, 2
JOB = "model"


class RendezvousModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sm = RendezvousState()
        self.now = 0.0
        self.ids_by_generation: dict[int, set[bytes]] = {}
        self.parked: dict[int, int] = {}  # waiter -> generation
        self.instances = 0

    def _apply(self) -> None:
        for effect in self.sm.take_effects():
            if isinstance(effect, Wake):
                self.parked.pop(effect.waiter, None)
                if isinstance(effect.value, JoinResult):
                    self._saw(effect.value)

    def _saw(self, result: JoinResult) -> None:
        if result.unique_id:
            self.ids_by_generation.setdefault(result.generation, set()).add(result.unique_id)

    def _job(self):  # type: ignore[no-untyped-def]
        return self.sm.jobs.get(JOB)

    @initialize(formed=st.booleans())
    def start(self, formed: bool) -> None:
        """Half the runs start from a running job: the rules that need one (barriers, key
        waits, losses) are then reached in most runs, not in a few."""
        if formed:
            for node in range(NODES):
                for local in range(GPUS):
                    self.join(node, local, with_id=True)
            assert self._job().state is JobState.RUNNING

    @rule(node=st.integers(0, NODES - 1), local=st.integers(0, GPUS - 1), with_id=st.booleans())
    def join(self, node: int, local: int, with_id: bool) -> None:
        self.instances += 1
        uid = os.urandom(128) if with_id and (node, local) == (0, 0) else b""
        try:
            out = self.sm.join(
                JoinArgs.worker(
                    JOB, NODES, GPUS, node, local, f"h{node}", "", uid, f"inst{self.instances}"
                ),
                self.now,
            )
        except RendezvousFault as fault:
            assert fault.code is not None and fault.reason
            self._apply()
            return
        if isinstance(out, Parked):
            self.parked[out.waiter] = self.sm.jobs[JOB].generation
        else:
            self._saw(out)
        self._apply()

    @rule()
    @precondition(
        lambda self: (
            self._job() is not None
            and self._job().gen.unique_id is None
            and 0 in self._job().gen.members
        )
    )
    def publish(self) -> None:
        job = self._job()
        member = job.gen.members[0]
        try:
            out = self.sm.publish_id(
                JOB, job.generation, 0, member.instance_id, os.urandom(128), self.now
            )
        except RendezvousFault:
            self._apply()
            return
        if isinstance(out, Parked):
            self.parked[out.waiter] = job.generation
        else:
            self._saw(out)
        self._apply()

    @rule(local=st.integers(0, GPUS - 1))
    def join_with_another_topology(self, local: int) -> None:
        """A node started with a wrong --nnodes: while forming, it fails the generation
        for everyone at once (the invariants check that no waiter is left behind)."""
        job = self._job()
        conflict = (
            job is not None
            and job.state is JobState.FORMING
            and bool(job.gen.members)
            and (job.num_nodes, job.gpus_per_node) != (NODES + 1, GPUS)
        )
        self.instances += 1
        try:
            out = self.sm.join(
                JoinArgs.worker(
                    JOB, NODES + 1, GPUS, None, local, "odd", "", b"", f"inst{self.instances}"
                ),
                self.now,
            )
        except RendezvousFault as fault:
            self._apply()
            if conflict:
                assert fault.reason == "TOPOLOGY_MISMATCH" and "'odd'" in fault.message
                assert self.sm.jobs[JOB].state is JobState.FAILED
            return
        assert not conflict, "a conflicting topology was accepted while forming"
        if isinstance(out, Parked):
            self.parked[out.waiter] = self.sm.jobs[JOB].generation
        else:
            self._saw(out)
        self._apply()

    @rule(rank=st.integers(0, NODES * GPUS - 1))
    @precondition(lambda self: self._job() is not None and self._job().state is JobState.RUNNING)
    def barrier(self, rank: int) -> None:
        job = self._job()
        seq = job.gen.barriers["b"].completed + 1 if "b" in job.gen.barriers else 1
        try:
            member = job.gen.members.get(rank)
            out = self.sm.barrier(
                JOB,
                job.generation,
                rank,
                "b",
                seq,
                self.now,
                instance_id=member.instance_id if member else "",
            )
        except RendezvousFault:
            self._apply()
            return
        if isinstance(out, Parked):
            self.parked[out.waiter] = job.generation
        self._apply()

    @rule(
        rank=st.integers(0, NODES * GPUS - 1), key=st.sampled_from(["a", "b"]), wait=st.booleans()
    )
    @precondition(lambda self: self._job() is not None and self._job().state is JobState.RUNNING)
    def kv(self, rank: int, key: str, wait: bool) -> None:
        """A KvGet that waits for its key, or the KvSet that wakes it."""
        job = self._job()
        member = job.gen.members[rank]
        scope = (JOB, job.generation, rank, key)
        try:
            if wait:
                out = self.sm.kv_get(*scope, True, self.now, instance_id=member.instance_id)
                if isinstance(out, Parked):
                    self.parked[out.waiter] = job.generation
            else:
                self.sm.kv_set(*scope, b"v", instance_id=member.instance_id)
        except RendezvousFault:
            pass
        self._apply()

    @rule(data=st.data(), timed_out=st.booleans())
    @precondition(lambda self: bool(self.parked))
    def call_ends(self, data: st.DataObject, timed_out: bool) -> None:
        """A parked call's deadline passes, or its caller goes away."""
        waiter = data.draw(st.sampled_from(sorted(self.parked)))
        self.sm.cancel_wait(waiter, self.now, timed_out=timed_out)
        self.parked.pop(waiter)
        self._apply()

    @rule(rank=st.integers(0, NODES * GPUS - 1))
    @precondition(lambda self: self._job() is not None and self._job().state is JobState.RUNNING)
    def lose_stream(self, rank: int) -> None:
        job = self._job()
        member = job.gen.members[rank]
        token = (
            self.sm.attach_stream(JOB, job.generation, rank, member.instance_id, self.now)
            if member.state is MemberState.ACTIVE
            else 0
        )
        self.sm.detach_stream(JOB, job.generation, rank, token, self.now)
        self._apply()

    @rule(seconds=st.floats(0.1, 30.0))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds
        self.sm.tick(self.now)
        self._apply()

    @rule(rank=st.integers(0, NODES * GPUS - 1))
    @precondition(lambda self: self._job() is not None)
    def leave(self, rank: int) -> None:
        job = self._job()
        member = job.gen.members.get(rank)
        if member is None:
            return
        with contextlib.suppress(RendezvousFault):
            self.sm.leave(JOB, job.generation, rank, member.instance_id, self.now)
        self._apply()

    @rule()
    @precondition(lambda self: self._job() is not None)
    def abort(self) -> None:
        self.sm.abort(JOB, 0, "model abort", self.now)
        self._apply()

    @rule()
    def restart(self) -> None:
        """Crash and restore from a snapshot: parked calls die with the process."""
        doc = snapshot.dump(self.sm)
        self.sm = RendezvousState()
        snapshot.load(self.sm, doc, self.now)
        self.sm.take_effects()
        self.parked.clear()

    @rule(stale=st.integers(1, 5))
    @precondition(lambda self: self._job() is not None)
    def stale_generation_is_rejected(self, stale: int) -> None:
        job = self._job()
        old = job.generation - stale
        if old < 1:
            return
        try:
            self.sm.kv_set(JOB, old, 0, "k", b"v", instance_id="any")
        except RendezvousFault as fault:
            assert fault.code is Code.ABORTED and fault.reason == "STALE_GENERATION"
            assert fault.metadata["current_generation"] == str(job.generation)
        else:
            raise AssertionError("a stale generation was accepted")

    @invariant()
    def one_id_per_generation(self) -> None:
        for generation, ids in self.ids_by_generation.items():
            assert len(ids) == 1, f"generation {generation} handed out {len(ids)} ids"
        handed = [i for ids in self.ids_by_generation.values() for i in ids]
        assert len(handed) == len(set(handed)), "an id was handed out in two generations"

    @invariant()
    def ranks_unique_and_dense(self) -> None:
        job = self._job()
        if job is None:
            return
        for rank, member in job.gen.members.items():
            assert member.rank == rank == member.node_rank * GPUS + member.local_rank
            assert 0 <= rank < job.world_size
        if job.state is JobState.RUNNING:
            assert sorted(job.gen.members) == list(range(job.world_size))
            assert [m.rank for m in job.gen.member_table] == list(range(job.world_size))

    @invariant()
    def the_members_gauge_counts_the_live_generations_present(self) -> None:
        """``live_members`` (the members gauge, read on every tick) counts a running
        generation without looking at its members: it must agree with looking."""
        live = [j for j in self.sm.jobs.values() if j.state in (JobState.FORMING, JobState.RUNNING)]
        assert self.sm.live_members() == sum(len(j.present()) for j in live)

    @invariant()
    def no_waiter_outlives_its_generation(self) -> None:
        job = self._job()
        if job is not None and job.state in (JobState.FAILED, JobState.ABORTED, JobState.ENDED):
            assert not job.all_waiters()
            assert job.generation not in self.parked.values()

    @invariant()
    def every_parked_call_is_accounted_for(self) -> None:
        assert self.sm.waiter_count == len(self.parked)
        held: dict[str, int] = {}
        for w in self.sm.calls.waiting.values():
            held[w.job_id] = held.get(w.job_id, 0) + 1
        assert held == self.sm.calls.per_job
        job = self._job()
        if job is not None:
            # Whatever the job lists as waiting is a live call, and every live call of
            # its generation is listed where a change will wake it.
            listed = job.all_waiters()
            assert listed <= set(self.sm.calls.waiting)
            for waiter, w in self.sm.calls.waiting.items():
                assert w.generation != job.generation or waiter in listed


TestRendezvousModel = RendezvousModel.TestCase
TestRendezvousModel.settings = settings(max_examples=300, stateful_step_count=80, deadline=None)
