"""How the state machine words its refusals: each names the job, the seat (rank and
host) it is about where it knows them, and what to do next."""

from __future__ import annotations

import pytest

from rendezvousd.common import validation
from rendezvousd.common.limits import Limits
from rendezvousd.common.model import JoinResult, Parked
from rendezvousd.errors import Code, RendezvousFault
from rendezvousd.state.machine import JoinArgs, RendezvousState

ID = b"\x01" * 128
ID2 = b"\x02" * 128


def worker(
    node: int, local: int, *, job: str = "j", nodes: int = 2, gpus: int = 2, uid: bytes = b""
) -> JoinArgs:
    return JoinArgs.worker(job, nodes, gpus, node, local, f"h{node}", "", uid, f"i{node}-{local}")


def fault(fn: object, *a: object, **kw: object) -> RendezvousFault:
    with pytest.raises(RendezvousFault) as info:
        fn(*a, **kw)  # type: ignore[operator]
    return info.value


def test_an_id_from_a_seat_other_than_rank_zero_is_refused_alike_naming_the_seat() -> None:
    """A Join carrying one and a PublishId: the same words, each keeping its code."""
    sm = RendezvousState()
    by_join = fault(sm.join, worker(1, 0, uid=ID), 0.0)
    assert by_join.code is Code.INVALID_ARGUMENT and by_join.reason == "INVALID_ID"
    assert by_join.message == (
        "only global rank 0 (node 0's) supplies the unique id of job 'j' generation 1; "
        "rank 2 on 'h1' sent Join with one"
    )
    sm = RendezvousState()
    first = sm.join(worker(0, 0, nodes=1), 0.0)
    assert isinstance(first, JoinResult) and first.id_required
    assert isinstance(sm.join(worker(0, 1, nodes=1), 0.0), Parked)
    generation = sm.jobs["j"].generation
    by_publish = fault(sm.publish_id, "j", generation, 1, "i0-1", ID, 0.0)
    assert by_publish.code is Code.PERMISSION_DENIED and by_publish.reason == "NOT_RANK_ZERO"
    assert by_publish.message == (
        f"only global rank 0 (node 0's) supplies the unique id of job 'j' generation "
        f"{generation}; rank 1 on 'h0' sent PublishId"
    )
    assert by_publish.metadata == {"job_id": "j", "ranks": "1"}


def test_a_second_unique_id_names_its_sender_and_says_to_join_again() -> None:
    sm = RendezvousState()
    sm.join(worker(0, 0, uid=ID), 0.0)
    f = fault(sm.join, worker(0, 0, uid=ID2), 0.0)
    assert f.code is Code.ALREADY_EXISTS and f.reason == "ID_CONFLICT"
    assert "rank 0 on 'h0' sent a unique id other than the one job 'j' generation 1" in f.message
    assert "a restarted rank 0 must join again, not re-publish" in f.message
    assert ID2.hex() not in f.message and ID.hex() not in f.message


def test_min_nodes_above_max_nodes_is_worded_for_join_node_callers() -> None:
    bad = JoinArgs("j", 3, 2, 1, None, "h", (), b"", "a", 60.0)
    f = fault(RendezvousState().join, bad, 0.0)
    assert f.reason == "INVALID_TOPOLOGY"
    assert "give 1 <= min_nodes <= max_nodes to join_node()" in f.message
    assert "(rendezvous-run/torchrun: --nnodes MIN:MAX)" in f.message


def test_limit_refusals_name_the_job_and_the_setting_to_raise() -> None:
    sm = RendezvousState(Limits(max_jobs=1, max_waiters=1))
    assert isinstance(sm.join(worker(0, 1, job="a", nodes=1, gpus=3), 0.0), Parked)
    jobs = fault(sm.join, worker(0, 0, job="b", nodes=1, gpus=1, uid=ID), 0.0)
    assert jobs.metadata == {"limit": "max_jobs", "job_id": "b"}
    assert jobs.message.startswith("job 'b' cannot start: the daemon already holds max_jobs=1")
    assert "wait for one to end" in jobs.message and "a larger --max-jobs" in jobs.message
    waiters = fault(sm.join, worker(0, 2, job="a", nodes=1, gpus=3), 0.0)
    assert waiters.metadata == {"limit": "max_waiters", "job_id": "a"}
    assert "job 'a' cannot park this call" in waiters.message
    assert "a larger --max-waiters" in waiters.message

    sm = RendezvousState(Limits(max_waiters=64, max_waiters_per_job=1))
    assert isinstance(sm.join(worker(0, 1, job="a", nodes=1, gpus=3), 0.0), Parked)
    per_job = fault(sm.join, worker(0, 2, job="a", nodes=1, gpus=3), 0.0)
    assert per_job.metadata["limit"] == "max_waiters_per_job"
    assert "job 'a' already holds max_waiters_per_job=1 waiting calls" in per_job.message
    assert "a larger --max-waiters-per-job" in per_job.message
    # It names what holds the slots, and that parked node joins are counted apart.
    assert "(waiting: 1 in a join of its forming generation; the 0 node joins" in (per_job.message)


def test_a_rank_with_no_seat_is_told_to_join_again() -> None:
    sm = RendezvousState()
    assert isinstance(sm.join(worker(0, 0), 0.0), JoinResult)
    f = fault(sm.kv_get, "j", 1, 3, "k", False, 0.0, instance_id="i1-1")
    # One code for the reason, as a left member's and a replayed join's (it was
    # NOT_FOUND here, FAILED_PRECONDITION there).
    assert (f.code, f.reason) == (Code.FAILED_PRECONDITION, "NOT_A_MEMBER")
    assert f.message == (
        "rank 3 is not a member of job 'j' generation 1; "
        "join again to take part in the job's current generation"
    )


def test_a_refused_key_is_shown_cut_and_escaped_with_what_to_do() -> None:
    limits = Limits(max_key_bytes=16)
    key = "k\u00e9" * 50
    long = fault(validation.kv_key, key, limits)
    assert long.metadata["limit"] == "max_key_bytes"
    # As every client string a message names (escape.quoted): printable text as it
    # is (a key may hold any; it showed 'k\xe9'), cut with the one marker saying how
    # much was left out (it showed "'..." alone).
    shown = "'" + "k\u00e9" * 20 + "'... (60 more characters)"
    assert f"key {shown} is 150 bytes, longer than max_key_bytes=16" in long.message
    assert "use a shorter key" in long.message
    bad = fault(validation.kv_key, "run\x1b[2J/step\n", limits)
    assert bad.reason == "INVALID_ARGUMENT"
    # A newline as \x0a, as the log and `rendezvousd status` show one (it was \n here).
    assert "key 'run\\x1b[2J/step\\x0a' contains control characters" in bad.message
    assert "\x1b" not in bad.message and "encode such bytes" in bad.message
