"""The ``--state-dir`` database's files as docs/operations.md describes them: a link at
any of their names refused at start, the -wal and -shm files 0600, a newer schema
refused untouched, and the job-end history (at most 65,536 ids, then a floor) kept
across a restart."""

from __future__ import annotations

import os
import sqlite3
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from rendezvousd.client import RendezvousClient
from rendezvousd.storage.job_ends import JobEnds
from rendezvousd.storage.store_sqlite import SqliteStore
from tests.support import DaemonProcess, serve_refused


def _private_dir(tmp_path: Path) -> Path:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    return state


@pytest.mark.parametrize("name", ["state.db", "state.db-wal", "state.db-shm"])
def test_a_link_at_any_database_file_is_refused_at_start(tmp_path: Path, name: str) -> None:
    """operations.md: "a symbolic link at any of those names is refused at start"."""
    state = _private_dir(tmp_path)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious\n")
    victim.chmod(0o644)
    (state / name).symlink_to(victim)
    done = serve_refused(tmp_path, state)
    assert done.returncode == 2, done.stderr
    assert "serving" not in done.stdout
    assert f"{state / name} is a symbolic link" in done.stderr, done.stderr
    assert "move it aside" in done.stderr, done.stderr
    assert victim.read_bytes() == b"precious\n"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o644
    assert (state / name).is_symlink()


def test_the_database_and_its_wal_and_shm_files_are_0600(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path, job_id: str
) -> None:
    """The daemon makes them 0600 whatever umask it was started with (022 here, which
    would leave SQLite's files 0644)."""
    state = tmp_path / "state"
    before = os.umask(0o022)
    try:
        d = start_daemon("--state-dir", str(state))
    finally:
        os.umask(before)
    with RendezvousClient(d.endpoint, job_id, token=d.token) as c:
        c.join(num_nodes=1, gpus_per_node=1, node_rank=0, local_rank=0, timeout=20)
        c.kv_set("k", b"v")  # a commit: the -wal file holds it
    for name in ("state.db", "state.db-wal", "state.db-shm"):
        assert stat.S_IMODE((state / name).stat().st_mode) == 0o600, name


def _schema_and_rows(path: Path) -> list[tuple[object, ...]]:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        found: list[tuple[object, ...]] = list(
            db.execute("SELECT type, name, sql FROM sqlite_master ORDER BY name")
        )
        tables = [name for kind, name, _ in found if kind == "table"]
        for table in tables:
            found += [(table, *row) for row in db.execute(f"SELECT * FROM {table}")]
        return found
    finally:
        db.close()


def test_a_database_of_a_newer_schema_is_refused_untouched(tmp_path: Path) -> None:
    """operations.md: "a newer schema is refused" (exit 2, the version named), and
    nothing of it is changed: its rows, nor its tables (a later schema may have
    renamed or dropped ours)."""
    state = _private_dir(tmp_path)
    path = state / "state.db"
    db = sqlite3.connect(path)
    db.executescript(
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"
        "INSERT INTO meta VALUES ('schema_version', '4');"
        "CREATE TABLE jobs4 (job_id TEXT PRIMARY KEY, record TEXT NOT NULL);"
        "INSERT INTO jobs4 VALUES ('train', '{\"generation\": 7}');"
    )
    db.close()
    path.chmod(0o600)
    before, raw = _schema_and_rows(path), path.read_bytes()
    done = serve_refused(tmp_path, state)
    assert done.returncode == 2, done.stderr
    assert "serving" not in done.stdout
    assert f"state database {path} has schema_version '4', this daemon reads 3" in done.stderr
    assert "use the matching rendezvousd or move it aside" in done.stderr
    assert _schema_and_rows(path) == before
    assert path.read_bytes() == raw  # its journal mode too
    assert sorted(p.name for p in state.iterdir()) == ["rendezvousd.lock", "state.db"]


def test_the_job_end_history_keeps_65536_ids_and_its_floor_across_a_restart(
    tmp_path: Path,
) -> None:
    """operations.md: "At most 65,536 job ids are kept, the oldest dropped first; a
    dropped end moves a floor", kept in state.db (``job_ends``, and ``meta`` key
    ``job_ends_floor``), so a restart forgets none."""
    store = SqliteStore(tmp_path)
    store.open()
    ends = JobEnds()
    for i in range(65_536):
        ends.record(f"job-{i}", 1_000_000.0 + i)
    assert len(ends.ends) == 65_536 and ends.floor == 0.0  # none dropped yet
    store.commit([], ends=ends.take())
    ends.record("one-more", 2_000_000.0)  # the 65,537th: job-0, the oldest, goes
    assert len(ends.ends) == 65_536 and "job-0" not in ends.ends
    assert ends.floor == 1_000_000.0
    store.commit([], ends=ends.take())
    store.close()

    reopened = SqliteStore(tmp_path)
    reopened.open()
    try:
        rows, floor = reopened.load_ends()
    finally:
        reopened.close()
    assert floor == 1_000_000.0
    assert len(rows) == 65_536
    assert rows[0] == ("job-1", 1_000_001.0) and rows[-1] == ("one-more", 2_000_000.0)
    restored = JobEnds()
    restored.restore(rows, floor)
    # The dropped id, and one never seen, count as ended at the floor (unless held).
    assert restored.ended("job-0", held=False) == 1_000_000.0
    assert restored.ended("never-seen", held=False) == 1_000_000.0
    assert restored.ended("never-seen", held=True) is None
    assert restored.ended("job-65535", held=False) == 1_000_000.0 + 65_535
    db = sqlite3.connect(tmp_path / "state.db")
    try:
        assert db.execute("SELECT value FROM meta WHERE key='job_ends_floor'").fetchone() == (
            "1000000.0",
        )
    finally:
        db.close()
