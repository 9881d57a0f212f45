"""The storage retry's reopening of ``state.db`` and its state dir lock, on a real
Persister and SQLite database: whatever closed the database is undone by the next
try, and the lock is let go only for a directory that is not the one locked."""

from __future__ import annotations

import asyncio
import os
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from rendezvousd.errors import DaemonError, RendezvousFault
from rendezvousd.state.machine import JoinArgs, RendezvousState
from rendezvousd.storage import persistence
from rendezvousd.storage.persistence import Persister, StateDirLock

ID = b"\x07" * 128


@pytest.fixture
def persister(tmp_path: Path) -> Any:
    """A one-rank running job, committed to ``tmp_path/state``."""
    sm = RendezvousState()
    sm.join(JoinArgs.worker("j", 1, 1, 0, 0, "h", "", ID, "i0"), 0.0)
    p = Persister(tmp_path / "state", sm)
    p.restore()
    try:
        yield p
    finally:
        p.close()


def _kv_set(p: Persister, value: bytes) -> None:
    """A KvSet of rank 0 made durable (raises the fault when its commit fails)."""
    p.before_kv("j", "k")
    p.state.kv_set("j", 1, 0, "k", value, instance_id="i0")
    p.touch("j", "k")
    asyncio.run(p.durable("j"))


def _recover(p: Persister) -> bool:
    return asyncio.run(p.recover())


def test_the_same_dir_put_back_after_a_try_that_closed_the_database_is_written_again(
    tmp_path: Path, persister: Persister
) -> None:
    state, away = tmp_path / "state", tmp_path / "away"
    state.rename(away)
    with pytest.raises(RendezvousFault):
        _kv_set(persister, b"lost")
    assert not _recover(persister)  # the directory is gone: the try closes the database
    assert persister.store is not None and not persister.store.is_open
    away.rename(state)  # the same files, the same inodes
    assert _recover(persister)
    assert persister.healthy and persister.store.is_open
    _kv_set(persister, b"kept")
    db = sqlite3.connect(state / "state.db")
    try:
        assert db.execute("SELECT value FROM kv WHERE key='k'").fetchone() == (b"kept",)
    finally:
        db.close()
    # The lock never let go: it still keeps another daemon off the directory.
    with pytest.raises(DaemonError, match="in use by another rendezvousd"):
        StateDirLock(state).acquire()


def test_the_lock_is_kept_while_its_file_cannot_be_looked_at(
    tmp_path: Path, persister: Persister, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory unreadable for a moment (EACCES for a daemon not run as root) is no
    sign of another directory: letting go then would let a second daemon in."""
    lock = persister.lock
    assert lock is not None
    real_stat = os.stat

    def stat(path: Any, *args: Any, **kw: Any) -> os.stat_result:
        if Path(path) == lock.path:
            raise PermissionError(13, "Permission denied", str(path))
        return real_stat(path, *args, **kw)

    monkeypatch.setattr(persistence.os, "stat", stat)
    with pytest.raises(PermissionError):
        lock.reacquire()
    with pytest.raises(DaemonError, match="in use by another rendezvousd"):
        StateDirLock(tmp_path / "state").acquire()
    monkeypatch.setattr(persistence.os, "stat", real_stat)
    lock.reacquire()  # the same file: nothing to do
    with pytest.raises(DaemonError, match="in use by another rendezvousd"):
        StateDirLock(tmp_path / "state").acquire()


def test_a_dir_recreated_in_place_is_locked_anew(tmp_path: Path, persister: Persister) -> None:
    state = tmp_path / "state"
    state.rename(tmp_path / "old")
    state.mkdir(mode=0o700)
    lock = persister.lock
    assert lock is not None
    lock.reacquire()
    assert (state / "rendezvousd.lock").read_text().strip() == str(os.getpid())
    # The old directory's lock was let go: another daemon may have it now.
    other = StateDirLock(tmp_path / "old")
    other.acquire()
    other.release()


def test_a_dir_put_back_writable_by_others_is_refused_as_at_start_up(
    tmp_path: Path, persister: Persister
) -> None:
    """The retry took a directory put back 0777 as it was, where start-up refuses it:
    another user could plant the files the daemon then writes through."""
    state, away = tmp_path / "state", tmp_path / "away"
    state.rename(away)
    with pytest.raises(RendezvousFault):
        _kv_set(persister, b"lost")
    assert not _recover(persister)
    away.chmod(0o777)
    away.rename(state)
    assert not _recover(persister) and not persister.healthy
    state.chmod(0o700)
    assert _recover(persister) and persister.healthy


def test_a_commit_during_an_outage_is_refused_without_a_second_error_line(
    tmp_path: Path, persister: Persister, caplog: pytest.LogCaptureFixture
) -> None:
    """A change the daemon cannot refuse up front (a member lost, a goodbye) still
    commits during an outage. Once a retry had closed the database, that commit logged
    a second ERROR, "RuntimeError: state database used before open()", as if the
    daemon had a bug; the outage's first line already said what fails and what the
    daemon does meanwhile."""
    (tmp_path / "state").rename(tmp_path / "away")
    with caplog.at_level("DEBUG", logger="rendezvousd"):
        with pytest.raises(RendezvousFault):
            _kv_set(persister, b"lost")
        assert not _recover(persister)
        persister.touch("j")  # the tick's loss of a silent member, say
        with pytest.raises(RendezvousFault):
            asyncio.run(persister.durable("j"))
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "refusing changes" in errors[0], errors
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "before open()" not in said, said
