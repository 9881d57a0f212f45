"""Seats of a forming per-rank generation that an undo (a failed commit) left held by no
call: a worker's retry takes its own again, and seats nobody takes are freed after the
longest wait, so the job can form or expire (a model-based fuzz of the state machine)."""

from __future__ import annotations

from pathlib import Path

from rendezvousd.common.model import JobState, Parked, Wake
from rendezvousd.state.machine import JoinArgs, RendezvousState
from rendezvousd.storage.persistence import Persister


def _rank(rank: int) -> JoinArgs:
    return JoinArgs.worker("j", 1, 3, 0, rank, "h", "", b"", f"i{rank}")


def _undone(tmp_path: Path) -> RendezvousState:
    """Rank 1 parked and committed; rank 2's join then fails to commit (a full disk):
    the job is put back with rank 1's seat, whose parked Join is released."""
    sm = RendezvousState()
    persister = Persister(tmp_path / "state", sm)
    persister.restore()
    assert isinstance(sm.join(_rank(1), 0.0), Parked)
    sm.take_effects()
    persister.touch("j")
    persister._commit_sync()
    assert isinstance(sm.join(_rank(2), 1.0), Parked)
    persister.touch("j")
    cut = persister._collect()
    persister._fail(cut.writes, OSError(28, "No space left on device"))
    woken = [e for e in sm.take_effects() if isinstance(e, Wake)]
    assert {e.fault.reason for e in woken if e.fault} == {"STORAGE_UNAVAILABLE"}
    persister.close()
    job = sm.jobs["j"]
    assert job.state is JobState.FORMING and set(job.gen.members) == {1}
    assert not job.gen.join_waiters
    return sm


def test_a_seat_no_call_holds_is_freed_after_the_longest_wait_and_the_job_expires(
    tmp_path: Path,
) -> None:
    # Rank 1's worker died during the outage: its seat stayed for good, the job never
    # formed and never expired.
    sm = _undone(tmp_path)
    longest = sm.timing.max_wait_s
    sm.tick(2.0)
    sm.tick(2.0 + longest / 2)
    assert set(sm.jobs["j"].gen.members) == {1}  # a retry may still come
    sm.tick(3.0 + longest)
    assert not sm.jobs["j"].gen.members
    sm.tick(4.0 + longest + sm.timing.job_ttl_s)
    assert "j" not in sm.jobs


def test_a_retry_of_the_released_join_holds_its_seat_again(tmp_path: Path) -> None:
    sm = _undone(tmp_path)
    sm.tick(2.0)
    assert isinstance(sm.join(_rank(1), 3.0), Parked)  # its SDK's retry, same instance
    sm.tick(10.0 + 2 * sm.timing.max_wait_s)
    assert set(sm.jobs["j"].gen.members) == {1}
