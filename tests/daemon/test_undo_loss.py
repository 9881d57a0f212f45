"""A worker dies as storage fails: the loss its stream's end made cannot be committed
and is undone, yet the worker is still dead, and its survivor alive.

The daemon pushed PEER_FAILED as it decided the loss, before the commit that then
failed: the survivor heard of a failure that was undone, stopped heartbeating, and
the undone generation, RUNNING again, failed later blaming the survivor ("no
heartbeat ... (worker unreachable)"), the killed rank's death recorded nowhere. A
loss's push now waits for its commit, and an undone loss waits in memory for storage.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client import RendezvousClient
from rendezvousd.common.model import EventKind, JobState, Notify, Parked, Wake
from rendezvousd.state.machine import JoinArgs, RendezvousState
from rendezvousd.storage import rollback, snapshot
from rendezvousd.storage.faults import storage_unavailable
from tests.daemon.test_storage import NOT_SERVING, SERVING, _health, _start
from tests.support import DaemonProcess, members, wait_for, worker_cmd

TIMEOUT_S = 4


def _status(d: DaemonProcess, job_id: str) -> str:
    """`rendezvousd status JOB`'s output."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("RENDEZVOUSD_")}
    done = subprocess.run(
        [sys.executable, "-m", "rendezvousd.cli", "status", job_id, "--endpoint", d.endpoint],
        capture_output=True,
        text=True,
        timeout=60,
        env={**base, "RENDEZVOUSD_TOKEN": d.token},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _stored_failed(state: Path, job_id: str) -> list[dict[str, Any]]:
    db = sqlite3.connect(state / "state.db")
    try:
        row = db.execute("SELECT detail FROM jobs WHERE job_id=?", (job_id,)).fetchone()
    finally:
        db.close()
    failed: list[dict[str, Any]] = json.loads(row[0])["failed"]
    return failed


def test_losses_kept_through_an_outage_are_made_in_the_order_they_went_at_their_times() -> None:
    """Two workers die while storage fails, rank 1 first: once it is back, both
    losses are made together, and rank 1, the first to go, is the root cause, each at
    the time its stream ended. Sorted by rank, rank 0 (which went 0.5 s later) was
    named the root cause, and both read as lost when storage came back."""
    sm = RendezvousState()
    for rank in range(3):
        sm.join(
            JoinArgs.worker(
                "j", 1, 3, 0, rank, "h", "", b"\x07" * 128 if rank == 0 else b"", f"i{rank}"
            ),
            0.0,
        )
    tokens = [sm.attach_stream("j", 1, rank, f"i{rank}", 0.0) for rank in range(3)]
    sm.take_effects()
    sm.storage_failing = True  # as the Persister says once a commit failed
    sm.detach_stream("j", 1, 1, tokens[1], 1.0)
    sm.detach_stream("j", 1, 0, tokens[0], 1.5)
    sm.heartbeat("j", 1, 2, 1.9)
    sm.tick(2.0)
    assert sm.jobs["j"].state is JobState.RUNNING
    assert not [e for e in sm.take_effects() if isinstance(e, Notify)]
    sm.storage_failing = False
    sm.tick(3.0)
    job = sm.jobs["j"]
    assert job.state is JobState.FAILED
    closed = "heartbeat stream closed"
    assert [(f.rank, f.cause, f.lost_at) for f in job.gen.failed] == [
        (1, closed, 1.0),
        (0, closed, 1.5),
    ]
    assert job.last_failure is not None
    assert job.last_failure.cause.startswith("rank 1 on h (heartbeat stream closed)")
    assert job.last_failure.at == 1.0
    notes = [e for e in sm.take_effects() if isinstance(e, Notify)]
    assert [(n.kind, n.to) for n in notes] == [(EventKind.PEER_FAILED, (2,))]
    assert [f.rank for f in notes[0].failed] == [1, 0]


def _parked(sm: RendezvousState, rank: int, now: float) -> int:
    """Rank ``rank`` of a forming 3-rank job "f" joins and parks; its waiter."""
    parked = sm.join(JoinArgs.worker("f", 1, 3, 0, rank, "h", "", b"", f"i{rank}", 30.0), now)
    assert isinstance(parked, Parked)
    return parked.waiter


def _woken(sm: RendezvousState) -> list[tuple[int, str | None]]:
    return [
        (e.waiter, e.fault and e.fault.reason) for e in sm.take_effects() if isinstance(e, Wake)
    ]


def test_a_forming_joiner_dead_while_storage_fails_fails_its_generation_once_it_is_back() -> None:
    """A parked joiner's Join cancelled (its process killed) while storage fails: made
    then, the other parked joiners were released (STORAGE_UNAVAILABLE), and the outage's
    next failed commit (a goodbye) undid the failure. It is kept, the others stay
    parked, and once storage takes writes it fails the generation at its own time,
    naming the joiner."""
    sm = RendezvousState()
    one, two = _parked(sm, 1, 0.0), _parked(sm, 2, 0.1)
    sm.take_effects()
    sm.storage_failing = True
    sm.cancel_wait(one, 1.0, timed_out=False)
    sm.tick(2.0)
    assert sm.jobs["f"].state is JobState.FORMING
    assert not _woken(sm)
    sm.storage_failing = False
    sm.tick(3.0)
    job = sm.jobs["f"]
    assert job.state is JobState.FAILED
    assert [(f.rank, f.lost_at) for f in job.gen.failed] == [(1, 1.0)]
    assert "its Join was cancelled" in job.gen.failed[0].cause
    assert _woken(sm) == [(two, "PEER_FAILED")]


def test_a_forming_joiners_death_undone_by_a_failed_commit_is_kept_and_made_again() -> None:
    """The commit of a forming joiner's death failed: the undo put the generation back
    to forming with the dead joiner's seat held by nobody, and the others' retries
    waited for it. Its death is kept and made once storage takes writes; a retry of
    the joiner itself (it was only disconnected) holds its seat again, alive."""
    sm = RendezvousState()
    one, _ = _parked(sm, 1, 0.0), _parked(sm, 2, 0.1)
    sm.take_effects()
    committed = snapshot.job_record(sm.jobs["f"])
    sm.cancel_wait(one, 1.0, timed_out=False)  # its commit fails
    live = sm.jobs["f"]
    assert live.state is JobState.FAILED
    undone = rollback.durable_job(committed, {}, live, 1.1, hold_s=sm.timing.hold_s)
    sm.put_back("f", undone, storage_unavailable("f", waiting=True), "undone")
    sm.storage_failing = True
    sm.take_effects()
    sm.tick(2.0)
    assert sm.jobs["f"].state is JobState.FORMING
    sm.storage_failing = False
    again = _parked(sm, 2, 2.5)  # rank 2's SDK sends its Join again
    sm.tick(3.0)
    job = sm.jobs["f"]
    assert job.state is JobState.FAILED
    assert [(f.rank, f.lost_at) for f in job.gen.failed] == [(1, 1.0)]
    assert _woken(sm) == [(again, "PEER_FAILED")]

    # Had rank 1 itself sent its Join again, it would be alive, not failed.
    sm = RendezvousState()
    one, _ = _parked(sm, 1, 0.0), _parked(sm, 2, 0.1)
    sm.storage_failing = True
    sm.cancel_wait(one, 1.0, timed_out=False)
    sm.storage_failing = False
    _parked(sm, 1, 2.0)
    sm.tick(3.0)
    assert sm.jobs["f"].state is JobState.FORMING


def test_a_killed_worker_whose_loss_was_undone_is_the_root_cause_not_its_survivor(
    tmp_path: Path,
) -> None:
    d, state = _start(tmp_path, TIMEOUT_S)
    job_id = "undone-loss"
    procs = [
        subprocess.Popen(
            worker_cmd(d, job_id, 1, 2, 0, rank, "--hold-s", "120"),
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            assert json.loads(p.stdout.readline())["event"] == "joined"
        wait_for(
            "both heartbeat streams",
            lambda: sum(m.heartbeat_stream_open for m in members(d, job_id)) == 2,
        )
        shutil.rmtree(state)  # every commit fails from here
        procs[1].send_signal(signal.SIGKILL)
        wait_for("the loss's commit to fail", lambda: _health(d) == NOT_SERVING)
        # Down for longer than the heartbeat timeout: the undone generation runs on.
        time.sleep(TIMEOUT_S + 1.5)
        assert procs[0].poll() is None, procs[0].communicate(timeout=5)[0]
        with RendezvousClient(d.endpoint, job_id, token=d.token) as probe:
            during = probe.get_job()
        assert during.summary.state == pb.JOB_STATE_RUNNING, during
        # Dead, yet ACTIVE until its loss is written: GetJob and `status` say so.
        assert [(m.member.rank, m.state, m.loss_pending) for m in during.members] == [
            (0, pb.MEMBER_STATE_ACTIVE, ""),
            (1, pb.MEMBER_STATE_ACTIVE, "heartbeat stream closed"),
        ]
        shown = _status(d, job_id)
        pending = f"lost, pending until storage takes writes: rank 1 on {socket.gethostname()}"
        assert f"{pending} (heartbeat stream closed)" in shown, shown

        state.mkdir(mode=0o700)
        wait_for("health SERVING once storage is back", lambda: _health(d) == SERVING)
        out, _ = procs[0].communicate(timeout=20)
        heard = json.loads(out.strip().splitlines()[-1])
        assert heard["type"] == "PeerFailed", heard
        lost = f"lost rank 1 on {socket.gethostname()} (heartbeat stream closed)"
        assert lost in str(heard["message"]), heard

        with RendezvousClient(d.endpoint, job_id, token=d.token) as probe:
            job = probe.get_job()
        assert job.summary.state == pb.JOB_STATE_FAILED, job
        assert not any(m.loss_pending for m in job.members), job
        assert [(f.rank, f.cause) for f in job.failed] == [(1, "heartbeat stream closed")]
        assert job.last_failure.cause.startswith("rank 1 on "), job.last_failure
        assert "heartbeat stream closed" in job.last_failure.cause, job.last_failure
        wait_for("the failure written", lambda: bool(_stored_failed(state, job_id)))
        assert [(f["rank"], f["cause"]) for f in _stored_failed(state, job_id)] == [
            (1, "heartbeat stream closed")
        ]
        failed_lines = [line for line in d.log().splitlines() if "-> FAILED" in line]
        assert not any("rank 0 on" in line for line in failed_lines), failed_lines
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
        d.kill()


def test_two_workers_killed_in_an_outage_name_the_first_killed_as_the_root_cause(
    tmp_path: Path,
) -> None:
    """Rank 1 is killed as storage fails, rank 0 half a second later: once storage is
    back, the record, the survivor and GetJob name rank 1 first, lost before rank 0."""
    d, state = _start(tmp_path, TIMEOUT_S)
    job_id = "kept-order"
    procs = [
        subprocess.Popen(
            worker_cmd(d, job_id, 1, 3, 0, rank, "--hold-s", "120"),
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(3)
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            assert json.loads(p.stdout.readline())["event"] == "joined"
        wait_for(
            "three heartbeat streams",
            lambda: sum(m.heartbeat_stream_open for m in members(d, job_id)) == 3,
        )
        shutil.rmtree(state)
        procs[1].send_signal(signal.SIGKILL)
        wait_for("the loss's commit to fail", lambda: _health(d) == NOT_SERVING)
        time.sleep(0.5)
        procs[0].send_signal(signal.SIGKILL)
        wait_for(
            "rank 0's stream to end",
            lambda: sum(m.heartbeat_stream_open for m in members(d, job_id)) == 1,
        )
        state.mkdir(mode=0o700)
        wait_for("health SERVING once storage is back", lambda: _health(d) == SERVING)
        out, _ = procs[2].communicate(timeout=20)
        heard = json.loads(out.strip().splitlines()[-1])
        assert heard["type"] == "PeerFailed", heard
        said = str(heard["message"])
        assert 0 <= said.find("rank 1 on") < said.find("rank 0 on"), said

        with RendezvousClient(d.endpoint, job_id, token=d.token) as probe:
            job = probe.get_job()
        assert [(f.rank, f.cause) for f in job.failed] == [
            (1, "heartbeat stream closed"),
            (0, "heartbeat stream closed"),
        ]
        # Each at the time its stream ended: rank 1's loss is the older.
        assert job.failed[0].age_ms > job.failed[1].age_ms, job.failed
        assert job.last_failure.cause.startswith("rank 1 on "), job.last_failure
        wait_for("the failure written", lambda: len(_stored_failed(state, job_id)) == 2)
        assert [f["rank"] for f in _stored_failed(state, job_id)] == [1, 0]
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
        d.kill()
