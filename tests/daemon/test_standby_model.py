"""Hypothesis drives node agents and standbys (``--nnodes 2:3``) through random joins,
node losses, worker failures, cancelled and timed-out waits, aborts, leaves and time,
re-issuing every call a Rejoin wakes as the gRPC adapter does, and checks after every
step: never more than max_nodes nodes, never more expected back than fit, no standby
in a launch's first generation, no plain scale-up left parked on an ended
generation and no standby on a job that ended while it waited, every parked call
accounted for (the job's records of parked calls too)."""

from __future__ import annotations

import os
from dataclasses import replace

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rendezvousd.common.model import (
    JobState,
    JoinMode,
    JoinResult,
    MemberState,
    Parked,
    Rejoin,
    Wake,
)
from rendezvousd.errors import RendezvousFault
from rendezvousd.state.machine import JoinArgs, RendezvousState
from rendezvousd.state.rounds import TERMINAL

JOB, LOW, HIGH, GPUS = "spares", 2, 3, 1


class StandbyModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sm = RendezvousState()
        self.now = 0.0
        self.count = 0
        self.parked: dict[int, JoinArgs] = {}  # waiter -> the call it parks
        self.standbys: set[str] = set()  # every standby instance id
        self.tokens: dict[tuple[int, str], int] = {}  # (generation, instance) -> stream
        # Calls parked while the job had not ended (a standby that parks on an ended
        # job waits for its relaunch).
        self.parked_live: set[int] = set()

    def _job(self):  # type: ignore[no-untyped-def]
        return self.sm.jobs.get(JOB)

    def _call(self, args: JoinArgs) -> RendezvousFault | None:
        """The join, as the adapter makes it; the fault it was refused with, if any."""
        try:
            out = self.sm.join(args, self.now)
        except RendezvousFault as fault:
            assert fault.code is not None and fault.reason
            return fault
        else:
            if isinstance(out, Parked):
                self.parked[out.waiter] = args
                if self._job().state is not JobState.ENDED:
                    self.parked_live.add(out.waiter)
            elif out.id_required:  # node 0 sends the id with the same call again
                self._call(replace(args, unique_id=os.urandom(128)))
        self._apply()
        return None

    def _apply(self) -> None:
        for effect in self.sm.take_effects():
            if not isinstance(effect, Wake):
                continue
            args = self.parked.pop(effect.waiter, None)
            if args is None:
                continue
            if isinstance(effect.value, Rejoin):
                self._call(args)  # the adapter's loop: the same request again
            elif isinstance(effect.value, JoinResult) and effect.value.id_required:
                self._call(replace(args, unique_id=os.urandom(128)))

    def _new(self, standby: bool, previous: str = "") -> JoinArgs:
        self.count += 1
        inst = f"{'s' if standby else 'n'}{self.count}"
        if standby:
            self.standbys.add(inst)
        return JoinArgs(
            JOB,
            LOW,
            HIGH,
            GPUS,
            None,
            f"h{inst}",
            (),
            b"",
            inst,
            30.0,
            1.0,
            standby=standby,
            previous=previous,
        )

    def _running_nodes(self) -> list[tuple[int, str]]:
        job = self._job()
        if job is None or job.state is not JobState.RUNNING:
            return []
        return [
            (rank, n.instance_id)
            for rank, n in sorted(job.gen.node_at.items())
            if n.state is MemberState.ACTIVE
        ]

    @rule(standby=st.booleans())
    def join(self, standby: bool) -> None:
        self._call(self._new(standby))

    @rule()
    def survivors_rejoin(self) -> None:
        """Every agent whose node was not lost joins the next generation (a fresh
        instance id, as the SDK gives each join, naming the one it held), and none of
        them is refused WORLD_FULL: newcomers cannot take a survivor's seat."""
        job = self._job()
        if job is None or job.state not in (JobState.FAILED, JobState.ABORTED):
            return
        kept = [n.instance_id for n in job.gen.nodes.values() if n.state is not MemberState.LOST]
        for held in kept:
            fault = self._call(self._new(standby=False, previous=held))
            assert fault is None or fault.reason != "WORLD_FULL", f"{held} refused: {fault}"

    @rule()
    def attach(self) -> None:
        job = self._job()
        for rank, inst in self._running_nodes():
            key = (job.generation, inst)
            if key not in self.tokens:
                self.tokens[key] = self.sm.attach_stream(
                    JOB, job.generation, rank, inst, self.now, mode=JoinMode.NODE
                )
        self._apply()

    @rule(pick=st.integers(0, HIGH - 1))
    def lose_node(self, pick: int) -> None:
        job, nodes = self._job(), self._running_nodes()
        if not nodes:
            return
        rank, inst = nodes[pick % len(nodes)]
        token = self.tokens.get((job.generation, inst))
        if token is None:
            return
        self.sm.detach_stream(JOB, job.generation, rank, token, self.now, mode=JoinMode.NODE)
        self._apply()

    @rule(pick=st.integers(0, HIGH - 1))
    def worker_fails(self, pick: int) -> None:
        job, nodes = self._job(), self._running_nodes()
        if not nodes:
            return
        rank, inst = nodes[pick % len(nodes)]
        self.sm.report_failure(JOB, job.generation, rank, inst, 0, "exit code 1", self.now)
        self._apply()

    @rule()
    def everyone_leaves(self) -> None:
        job = self._job()
        for rank, inst in self._running_nodes():
            self.sm.leave(JOB, job.generation, rank, inst, self.now, mode=JoinMode.NODE)
        self._apply()

    @rule()
    def scale_up_abort(self) -> None:
        job = self._job()
        if job is not None and job.state is JobState.RUNNING:
            self.sm.abort(JOB, job.generation, "scale-up", self.now)
            self._apply()

    @rule(pick=st.integers(0, 50), timed_out=st.booleans())
    @precondition(lambda self: bool(self.parked))
    def a_wait_ends(self, pick: int, timed_out: bool) -> None:
        waiter = sorted(self.parked)[pick % len(self.parked)]
        del self.parked[waiter]
        self.sm.cancel_wait(waiter, self.now, timed_out=timed_out)
        self._apply()

    @rule(seconds=st.floats(0.1, 20.0))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds
        self.sm.tick(self.now)
        self._apply()

    @invariant()
    def never_more_nodes_than_max(self) -> None:
        job = self._job()
        if job is not None:
            assert len(job.gen.nodes) <= HIGH
            assert job.gen.rejoin_expected <= HIGH, "more nodes called back than fit"
            kept = len(job.gen.owed) if self.now < job.gen.owed_until else 0
            assert len(job.gen.nodes) + kept <= HIGH, "seats kept beyond max_nodes"

    @invariant()
    def no_standby_in_a_launchs_first_generation(self) -> None:
        job = self._job()
        if job is not None and job.generation == 1:
            assert not self.standbys & set(job.gen.nodes)

    @invariant()
    def only_standbys_stay_parked_on_an_ended_generation(self) -> None:
        job = self._job()
        if job is None:
            return
        assert job.standby_waiters <= job.scaleup_waiters.keys()
        if job.state in TERMINAL:
            assert job.scaleup_waiters.keys() == job.standby_waiters
            assert all(inst in self.standbys for inst in job.scaleup_waiters.values())
        if job.state is JobState.ENDED:
            assert not job.scaleup_waiters.keys() & self.parked_live, (
                "a standby parked on a running job outlived its end"
            )

    @invariant()
    def every_parked_call_is_accounted_for(self) -> None:
        assert self.sm.waiter_count == len(self.parked)
        job = self._job()
        if job is not None:  # the job's records of parked calls name live calls only
            assert job.scaleup_waiters.keys() <= self.sm.calls.waiting.keys()
            assert job.gen.join_waiters.keys() <= self.sm.calls.waiting.keys()


StandbyModel.TestCase.settings = settings(
    max_examples=int(os.environ.get("RENDEZVOUSD_MODEL_EXAMPLES", "150")),
    stateful_step_count=40,
    deadline=None,
)
test_standby_model = StandbyModel.TestCase
