"""State-machine rules from the hardening issue: calls bound to the member that made
them, rank 0's id deadline, and the daemon-wide key-value budget."""

from __future__ import annotations

import dataclasses

import pytest

from rendezvousd.common.limits import Limits, Timing
from rendezvousd.common.model import JobState, JoinResult, Parked, Transition, Wake
from rendezvousd.errors import Code
from rendezvousd.state.machine import JoinArgs, RendezvousState
from tests.daemon.test_state_machine import ID, args, fault, form, inst


def test_a_non_member_cannot_complete_a_barrier_for_rank_zero() -> None:
    sm = RendezvousState()
    gen = form(sm, nodes=1, gpus=2)[0].generation
    # The token holder knows job, generation and rank, but not rank 0's instance.
    f = fault(sm.barrier, "j", gen, 0, "b", 1, 0.0, instance_id="intruder")
    assert f.code is Code.ALREADY_EXISTS and f.reason == "DUPLICATE_RANK"
    assert "another worker instance" in f.message
    # So the real rank 1 still waits for the real rank 0.
    assert isinstance(sm.barrier("j", gen, 1, "b", 1, 0.0, instance_id=inst(sm, 1)), Parked)
    assert sm.barrier("j", gen, 0, "b", 1, 0.0, instance_id=inst(sm, 0)) == 1


def test_an_empty_instance_id_is_refused_with_a_hint() -> None:
    sm = RendezvousState()
    gen = form(sm, nodes=1, gpus=1)[0].generation
    f = fault(sm.kv_set, "j", gen, 0, "k", b"v", instance_id="")
    assert f.reason == "DUPLICATE_RANK" and "names no instance_id" in f.message
    # An SDK that old cannot help it by rejoining (found by review: it was told to).
    assert "upgrade the worker's rendezvousd SDK" in f.message
    assert "rejoin" not in f.message


@pytest.mark.parametrize(
    ("call", "extra"),
    [
        ("kv_set", ("k", b"evil")),
        ("kv_get", ("k", False, 0.0)),
        ("kv_add", ("n", 1)),
        ("kv_compare_and_set", ("k", b"v", b"evil")),
        ("kv_delete", ("k",)),
    ],
)
def test_key_value_calls_of_another_instance_are_refused(
    call: str, extra: tuple[object, ...]
) -> None:
    sm = RendezvousState()
    gen = form(sm, nodes=1, gpus=1)[0].generation
    sm.kv_set("j", gen, 0, "k", b"v", instance_id=inst(sm, 0))
    f = fault(getattr(sm, call), "j", gen, 0, *extra, instance_id="other-job-worker")
    assert f.reason == "DUPLICATE_RANK"
    assert sm.jobs["j"].gen.kv == {"k": b"v"}  # nothing read, changed or deleted


def test_a_stale_instance_of_an_earlier_generation_is_refused() -> None:
    sm = RendezvousState()
    form(sm, nodes=1, gpus=1)
    old = inst(sm, 0)
    sm.abort("j", 0, "restart", 1.0)
    sm.join(args(0, 0, nodes=1, gpus=1, uid=b"\x02" * 128, inst="new"), 2.0)
    gen = sm.jobs["j"].generation
    assert gen == 2 and sm.jobs["j"].state is JobState.RUNNING
    # The old process names the current generation (it read it somewhere): refused.
    assert fault(sm.kv_set, "j", gen, 0, "k", b"v", instance_id=old).reason == "DUPLICATE_RANK"
    assert fault(sm.kv_set, "j", 1, 0, "k", b"v", instance_id=old).reason == "STALE_GENERATION"
    sm.kv_set("j", gen, 0, "k", b"v", instance_id="new")


def _rank_zero_without_id(sm: RendezvousState, wait_s: float, inst: str = "r0") -> JoinResult:
    a = args(None, 0, nodes=1, gpus=2, host="h0", inst=inst)
    out = sm.join(dataclasses.replace(a, wait_s=wait_s), 0.0)
    assert isinstance(out, JoinResult) and out.id_required and out.rank == 0
    return out


def test_rank_zero_that_never_publishes_frees_its_rank_at_its_join_deadline() -> None:
    sm = RendezvousState(timing=Timing(job_ttl_s=30.0))
    _rank_zero_without_id(sm, wait_s=5.0)
    peer = sm.join(args(None, 1, nodes=1, gpus=2, host="h0", inst="r1"), 0.0)
    assert isinstance(peer, Parked)
    sm.take_effects()
    sm.tick(4.0)
    assert 0 in sm.jobs["j"].gen.members  # not yet
    sm.tick(5.5)
    job = sm.jobs["j"]
    assert 0 not in job.gen.members and job.state is JobState.FORMING
    effects = sm.take_effects()
    assert not any(isinstance(e, Wake) for e in effects), "the peer keeps waiting"
    assert any(isinstance(e, Transition) and "did not publish" in e.detail for e in effects)
    # The restarted rank 0 (a new instance) gets the rank instead of DUPLICATE_RANK.
    out = sm.join(args(None, 0, nodes=1, gpus=2, host="h0", inst="r0-restarted", uid=ID), 6.0)
    assert isinstance(out, JoinResult) and out.rank == 0 and not out.id_required
    assert sm.jobs["j"].state is JobState.RUNNING


def test_the_default_wait_bounds_rank_zero_when_the_join_named_none() -> None:
    sm = RendezvousState(timing=Timing(default_wait_s=7.0))
    _rank_zero_without_id(sm, wait_s=0.0)
    sm.tick(6.9)
    assert 0 in sm.jobs["j"].gen.members
    sm.tick(7.1)
    assert 0 not in sm.jobs["j"].gen.members


def test_an_abandoned_single_rank_job_expires_instead_of_filling_max_jobs() -> None:
    sm = RendezvousState(Limits(max_jobs=1), Timing(job_ttl_s=10.0))
    sm.join(
        JoinArgs.worker("j", 1, 1, None, 0, "h", "", b"", "r0", wait_s=2.0), 0.0
    )  # id_required, then crashed
    sm.tick(3.0)
    sm.tick(14.0)
    assert "j" not in sm.jobs
    assert isinstance(
        sm.join(JoinArgs.worker("k", 1, 1, None, 0, "h", "", ID, "x"), 15.0), JoinResult
    )


def test_a_parked_publish_id_keeps_the_rank_past_the_join_deadline() -> None:
    sm = RendezvousState()
    out = _rank_zero_without_id(sm, wait_s=1.0)
    parked = sm.publish_id("j", out.generation, 0, "r0", ID, 0.5)
    assert isinstance(parked, Parked)
    sm.tick(5.0)
    assert 0 in sm.jobs["j"].gen.members


def test_a_job_over_a_kv_limit_lowered_since_may_write_what_does_not_grow_it() -> None:
    """A job restored holding more than a limit added or lowered since (a release's
    max_kv_bytes_per_job, a restart with a smaller --max-kv-bytes) could not even
    overwrite a key with a value as long, nor write after deleting one (found by an
    upgrade review): only a write that grows it past the limit is refused."""
    sm = RendezvousState(Limits(max_kv_bytes=400))
    form(sm, nodes=1, gpus=1)
    me = inst(sm, 0)
    sm.kv_set("j", 1, 0, "a", b"x" * 79, instance_id=me)
    sm.kv_set("j", 1, 0, "b", b"x" * 69, instance_id=me)  # 150 bytes of its 200
    sm.limits = Limits(max_kv_bytes=200)  # restarted with half: it may hold 100
    sm.kv_set("j", 1, 0, "a", b"y" * 79, instance_id=me)  # as long: 150 still
    sm.kv_set("j", 1, 0, "b", b"y" * 9, instance_id=me)  # shorter: 90
    sm.kv_set("j", 1, 0, "b", b"y" * 19, instance_id=me)  # 100: at the limit
    f = fault(sm.kv_set, "j", 1, 0, "c", b"", instance_id=me)
    assert f.metadata["limit"] == "max_kv_bytes_per_job" and "over the 100" in f.message
    assert sm.kv_get("j", 1, 0, "a", False, 0.0, instance_id=me) == b"y" * 79


def test_the_daemon_wide_kv_budget_is_shared_by_jobs_and_freed_on_delete_and_expiry() -> None:
    """max_kv_bytes=120: a job may hold 60 (half), and the last 15 (an eighth) are kept
    for jobs holding less than 15. One job could fill the whole budget (its own limit,
    64 MiB, was not clamped to a smaller total), and two filled it between them."""
    sm = RendezvousState(Limits(max_kv_bytes=120), Timing(job_ttl_s=1.0))
    form(sm, nodes=1, gpus=1, job="a")
    sm.join(JoinArgs.worker("b", 1, 1, 0, 0, "h", "", b"\x03" * 128, "ib"), 0.0)
    sm.join(JoinArgs.worker("c", 1, 1, 0, 0, "h", "", b"\x04" * 128, "ic"), 0.0)
    sm.kv_set("a", 1, 0, "k", b"x" * 59, instance_id=inst(sm, 0, "a"))  # 60 bytes: its half
    f = fault(sm.kv_set, "a", 1, 0, "k2", b"", instance_id=inst(sm, 0, "a"))
    assert f.metadata["limit"] == "max_kv_bytes_per_job" and "over the 60" in f.message
    sm.kv_set("b", 1, 0, "k", b"x" * 44, instance_id="ib")  # 105 in all
    # b holds 45, more than the reserve: the last 15 bytes are not for it.
    f = fault(sm.kv_set, "b", 1, 0, "k2", b"x" * 4, instance_id="ib")  # 111 > 120 - 15
    assert f.code is Code.RESOURCE_EXHAUSTED and f.metadata["limit"] == "max_kv_bytes"
    assert "max_kv_bytes=120" in f.message and "'b'" in f.message
    assert "105" not in f.message, "another job's bytes are not b's to know"
    sm.kv_set("c", 1, 0, "k", b"x" * 14, instance_id="ic")  # c held nothing: 120 fits
    assert sm.kv_bytes == 120
    f = fault(sm.kv_set, "c", 1, 0, "k2", b"", instance_id="ic")  # 122 > 120
    assert f.metadata["limit"] == "max_kv_bytes"
    # Shrinking a value is allowed even at the budget.
    sm.kv_set("b", 1, 0, "k", b"x", instance_id="ib")
    assert sm.kv_delete("a", 1, 0, "k", instance_id=inst(sm, 0, "a"))
    sm.kv_set("b", 1, 0, "k2", b"x" * 55, instance_id="ib")
    # A forgotten job gives its bytes back.
    sm.leave("b", 1, 0, "ib", 1.0)
    sm.tick(5.0)
    assert "b" not in sm.jobs and sm.kv_bytes == 15


@pytest.mark.parametrize("bad", [b" 7 ", b"+5", b"1_000", b"\xd9\xa3", b"", b"0x10", b"7\n"])
def test_kv_add_accepts_only_plain_decimal_counters(bad: bytes) -> None:
    sm = RendezvousState()
    gen = form(sm, nodes=1, gpus=1)[0].generation
    sm.kv_set("j", gen, 0, "n", bad, instance_id=inst(sm, 0))
    f = fault(sm.kv_add, "j", gen, 0, "n", 1, instance_id=inst(sm, 0))
    assert f.reason == "NOT_A_COUNTER" and sm.jobs["j"].gen.kv["n"] == bad
    sm.kv_set("j", gen, 0, "n", b"-12", instance_id=inst(sm, 0))
    assert sm.kv_add("j", gen, 0, "n", 5, instance_id=inst(sm, 0)) == -7


@pytest.mark.parametrize("sneaky", ["\u202eexe.txt", "h\x85ost", "a\u2066b", "x\u200fy", "\x9b31m"])
def test_c1_controls_and_bidi_overrides_never_reach_logs_or_status(sneaky: str) -> None:
    sm = RendezvousState()
    f = fault(sm.join, args(0, 0, nodes=1, gpus=1, host=sneaky, uid=ID), 0.0)
    assert f.code is Code.INVALID_ARGUMENT and "control characters" in f.message
    gen = form(sm, nodes=1, gpus=1)[0].generation
    assert fault(sm.abort, "j", gen, sneaky, 1.0).code is Code.INVALID_ARGUMENT
    key = fault(sm.kv_set, "j", gen, 0, sneaky, b"v", instance_id=inst(sm, 0))
    assert key.code is Code.INVALID_ARGUMENT
