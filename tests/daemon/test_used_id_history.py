"""The used-id history is bounded (the last USED_ID_HISTORY generations' digests) and
kept out of the job's row: a KvSet rewrites the row, never the history."""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from rendezvousd.client import RendezvousClient, RendezvousError
from rendezvousd.common.model import JoinResult
from rendezvousd.state.id_history import USED_ID_HISTORY
from rendezvousd.state.machine import JoinArgs, RendezvousState
from rendezvousd.storage.persistence import Persister
from tests.support import DaemonProcess


def _id(i: int) -> bytes:
    return hashlib.sha512(b"id %d" % i).digest() * 2  # 128 bytes, never all zero


def _join_as_rank_0(sm: RendezvousState, uid: bytes, now: float) -> object:
    return sm.join(JoinArgs.worker("j", 1, 1, 0, 0, "h", "", uid, f"inst-{now}"), now)


def test_the_history_keeps_the_last_generations_and_refuses_their_ids() -> None:
    sm = RendezvousState()
    generations = USED_ID_HISTORY + 40
    for g in range(generations):
        assert isinstance(_join_as_rank_0(sm, _id(g), float(g)), JoinResult)
        sm.abort("j", 0, "next generation", float(g))
    job = sm.jobs["j"]
    assert len(job.used_id_digests) == USED_ID_HISTORY
    # The newest and the oldest id still within the window are refused...
    for g in (generations - 1, generations - USED_ID_HISTORY):
        with pytest.raises(Exception) as info:
            _join_as_rank_0(sm, _id(g), 1e6)
        assert getattr(info.value, "reason", "") == "ID_REUSED", info.value
    # ...one older than the window is forgotten.
    assert isinstance(_join_as_rank_0(sm, _id(0), 1e6), JoinResult)


def _rows(state: Path) -> tuple[int, list[tuple[int, str]]]:
    db = sqlite3.connect(state / "state.db")
    try:
        (detail_len,) = db.execute("SELECT length(detail) FROM jobs WHERE job_id='j'").fetchone()
        ids = db.execute("SELECT rowid, digest FROM used_ids WHERE job_id='j' ORDER BY rowid")
        return detail_len, ids.fetchall()
    finally:
        db.close()


@pytest.mark.slow
def test_a_long_lived_job_keeps_a_bounded_history_out_of_its_row(
    tmp_path: Path, start_daemon: Callable[..., DaemonProcess]
) -> None:
    state = tmp_path / "state"
    d = start_daemon("--state-dir", str(state))
    generations = USED_ID_HISTORY + 20
    with RendezvousClient(d.endpoint, "j", token=d.token) as c:
        for g in range(generations):
            c.join(num_nodes=1, gpus_per_node=1, local_rank=0, unique_id=_id(g), timeout=10)
            c.abort("next generation")
        detail_len, ids = _rows(state)
        assert len(ids) == USED_ID_HISTORY
        # Newest last: the one before the current generation (whose id is its id_digest).
        assert ids[-1][1] == hashlib.sha256(_id(generations - 2)).hexdigest()
        assert detail_len < 2048, detail_len  # the row does not grow with the generations
        c.join(num_nodes=1, gpus_per_node=1, local_rank=0, unique_id=_id(10**6), timeout=10)
        after_join = _rows(state)[1]
        # A new generation writes one row and drops the oldest; the others stay as written.
        assert after_join[:-1] == ids[1:] and len(after_join) == USED_ID_HISTORY
        c.kv_set("k", b"v")  # rewrites the job's row...
        assert _rows(state)[1] == after_join  # ...not its history
    d.terminate()
    again = start_daemon("--state-dir", str(state))
    with RendezvousClient(again.endpoint, "j", token=again.token) as c:
        c.abort("next generation")
        with pytest.raises(RendezvousError) as info:
            c.join(num_nodes=1, gpus_per_node=1, local_rank=0, unique_id=_id(30), timeout=10)
        assert info.value.reason == "ID_REUSED"  # the history survived the restart


def test_a_version_2_database_keeps_its_history_and_moves_it_out_of_the_row(
    tmp_path: Path,
) -> None:
    sm = RendezvousState()
    for g in range(5):
        _join_as_rank_0(sm, _id(g), float(g))
        sm.abort("j", 0, "next generation", float(g))
    saver = Persister(tmp_path, sm)
    saver.restore()
    saver.close()
    db = sqlite3.connect(tmp_path / "state.db")
    # The layout version 2 wrote: the history in the row's detail, no used_ids table.
    db.executescript(
        "UPDATE jobs SET detail = json_set(detail, '$.used_id_digests', (SELECT "
        "json_group_array(digest) FROM used_ids WHERE job_id = jobs.job_id));"
        "DROP TABLE used_ids; UPDATE meta SET value = '2' WHERE key = 'schema_version';"
    )
    db.close()
    back = RendezvousState()
    reader = Persister(tmp_path, back)
    reader.restore()  # rewrites every job's row: the history moves to used_ids
    reader.close()
    # Version 2 kept them sorted, so their order is lost; the current generation's is
    # added on restore (as the next generation will refuse it).
    history = list(back.jobs["j"].used_id_digests)
    assert set(history) == {hashlib.sha256(_id(g)).digest() for g in range(5)}
    _, ids = _rows(tmp_path)
    assert [d for _, d in ids] == [d.hex() for d in history]
    db = sqlite3.connect(tmp_path / "state.db")
    try:
        assert db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == ("3",)
        (detail,) = db.execute("SELECT detail FROM jobs").fetchone()
        assert "used_id_digests" not in detail
    finally:
        db.close()
