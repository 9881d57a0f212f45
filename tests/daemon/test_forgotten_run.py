"""A daemon without --state-dir that restarted forgot every job; the first caller of a
forgotten run hears JOB_NOT_FOUND and joins again, which starts the job's generation 1
anew. Every later caller of the forgotten run hears why (``seats.forgotten``), not only
that its seat is another's; and an instance that joined in this process (a real
duplicate agent, a replaced worker) still hears what it did. The pure state machine, a
restart being a fresh one told it keeps no state."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from rendezvousd.common.limits import Timing
from rendezvousd.common.model import JobState, JoinMode
from rendezvousd.errors import RendezvousFault
from rendezvousd.state.machine import JoinArgs, RendezvousState
from rendezvousd.state.placement import member_instance_id

ID = b"\x05" * 128
STARTED = 1_796_000_000.0  # the restarted daemon's start, Unix seconds
NODE = JoinMode.NODE


def restarted(*, stateless: bool = True) -> RendezvousState:
    sm = RendezvousState(timing=Timing(job_ttl_s=5.0))
    sm.stateless_since = STARTED if stateless else None
    return sm


def node(inst: str, *, rank: int | None = None, uid: bytes = b"") -> JoinArgs:
    # Room for a third node: a second agent for a node rank is told it is held, not
    # that the world is full.
    return JoinArgs("j", 2, 3, 1, rank, f"host-{inst}", (), uid, inst, 60.0, last_call_s=1.0)


def two_nodes(sm: RendezvousState, now: float = 0.0) -> None:
    """Nodes "a" (node 0, the id) and "b" run the job's generation 1 (its last call
    over)."""
    sm.join(node("a", rank=0, uid=ID), now)
    sm.join(node("b", rank=1), now)
    sm.tick(now + 2.0)
    assert sm.jobs["j"].state is JobState.RUNNING


def refusal(call: Callable[[], object]) -> RendezvousFault:
    with pytest.raises(RendezvousFault) as info:
        call()
    return info.value


def _forgotten(fault: RendezvousFault, reason: str, generation: int = 1) -> None:
    """``fault`` says the daemon forgot the caller's run; its reason is the refusal's."""
    assert fault.reason == reason, fault
    assert (
        "on this daemon, which started at 2026-11-30T00:53:20.000Z without --state-dir: if "
        "this caller joined before then, that restart forgot its run" in fault.message
    ), fault.message
    if generation == 1:
        assert "the job's generation 1 now is a new run of it" in fault.message, fault
    else:
        assert f"the call named generation {generation}: the job never reached it" in (
            fault.message
        ), fault
    assert "join again" in fault.message, fault


def test_a_node_agent_of_the_forgotten_run_hears_it_whatever_it_calls() -> None:
    sm = restarted()
    two_nodes(sm)  # joined again since the restart, with new instance ids
    # The old run's node agent "old", for its node rank 0 or 1 of generation 1, and
    # for a generation this job never reached.
    for rank in (0, 1):
        _forgotten(
            refusal(lambda rank=rank: sm.attach_stream("j", 1, rank, "old", 1.0, mode=NODE)),
            "DUPLICATE_RANK",
        )
        _forgotten(
            refusal(lambda rank=rank: sm.report_failure("j", 1, rank, "old", 0, "x", 3.0)),
            "DUPLICATE_RANK",
        )
        _forgotten(
            refusal(lambda rank=rank: sm.leave("j", 1, rank, "old", 3.0, mode=NODE)),
            "DUPLICATE_RANK",
        )
    _forgotten(
        refusal(lambda: sm.attach_stream("j", 3, 0, "old", 1.0, mode=NODE)), "STALE_GENERATION", 3
    )
    _forgotten(refusal(lambda: sm.abort("j", 3, "stop", 1.0)), "STALE_GENERATION", 3)
    # ... and its workers, under ids derived from its node's.
    _forgotten(
        refusal(lambda: sm.kv_set("j", 1, 0, "k", b"v", instance_id=member_instance_id("old", 0))),
        "DUPLICATE_RANK",
    )


def test_the_forming_generation_a_rejoin_started_is_not_the_old_runs() -> None:
    """Its ReportFailure read "refused: the generation is still forming"."""
    sm = restarted()
    sm.join(node("a", uid=ID), 0.0)  # parked: the job waits for its second node
    assert sm.jobs["j"].state is JobState.FORMING
    _forgotten(refusal(lambda: sm.report_failure("j", 1, 1, "old", 0, "x", 1.0)), "NOT_RUNNING")


def test_a_duplicate_that_joined_this_daemon_still_hears_of_the_seats_holder() -> None:
    """A second live agent for node 0 (it joined this daemon process) is told the
    seat is another's, as before: no restart is said where none is certain."""
    sm = restarted()
    two_nodes(sm)
    dup = refusal(lambda: sm.join(node("dup", rank=0), 3.0))
    assert dup.reason == "DUPLICATE_RANK", dup
    for call in (
        lambda: sm.report_failure("j", 1, 0, "dup", 0, "x", 3.0),
        lambda: sm.attach_stream("j", 1, 0, "dup", 3.0, mode=NODE),
    ):
        fault = refusal(call)
        assert fault.reason == "DUPLICATE_RANK", fault
        assert "belongs to another node agent instance" in fault.message, fault
    worker = member_instance_id("dup", 0)  # a worker of that duplicate
    fault = refusal(lambda: sm.kv_set("j", 1, 0, "k", b"v", instance_id=worker))
    assert fault.reason == "DUPLICATE_RANK", fault


def test_no_restart_is_said_by_a_daemon_that_keeps_state_or_for_a_job_it_forgot() -> None:
    keeps = restarted(stateless=False)
    two_nodes(keeps)
    fault = refusal(lambda: keeps.report_failure("j", 1, 0, "old", 0, "x", 1.0))
    assert fault.reason == "DUPLICATE_RANK", fault
    # A job this process forgot after it ended: a caller of that run is one of an
    # ended job, whose id a new launch took since, not one a restart forgot.
    sm = restarted()
    two_nodes(sm)
    sm.abort("j", 0, "stop", 1.0)
    sm.tick(10.0)
    assert "j" not in sm.jobs
    two_nodes(sm, 11.0)
    fault = refusal(lambda: sm.report_failure("j", 1, 0, "a-of-before", 0, "x", 12.0))
    assert fault.reason == "DUPLICATE_RANK", fault


def test_a_worker_joined_by_rank_of_the_forgotten_run_hears_it() -> None:
    """Per-rank Join: the new run's rank 0 joined, rank 1 of the old run calls."""
    sm = restarted()
    sm.join(JoinArgs.worker("j", 1, 2, 0, 0, "h0", "", ID, "w0-new"), 0.0)
    _forgotten(
        refusal(lambda: sm.kv_set("j", 1, 1, "k", b"v", instance_id="w1-old")), "NOT_A_MEMBER"
    )
    _forgotten(refusal(lambda: sm.report_failure("j", 1, 0, "w1-old", 1, "x", 1.0)), "NOT_RUNNING")
    # Rank 0 of the old run, whose seat the new run's rank 0 holds.
    _forgotten(
        refusal(lambda: sm.kv_set("j", 1, 0, "k", b"v", instance_id="w0-old")), "DUPLICATE_RANK"
    )
    # A worker that joined here and was replaced hears of the other instance.
    sm.join(JoinArgs.worker("j", 1, 2, 0, 1, "h1", "", b"", "w1-new"), 0.0)
    assert sm.jobs["j"].state is JobState.RUNNING
    fault = refusal(lambda: sm.kv_set("j", 1, 1, "k", b"v", instance_id="w0-new"))
    assert fault.reason == "DUPLICATE_RANK", fault
