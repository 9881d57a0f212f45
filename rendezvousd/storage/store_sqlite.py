"""The ``--state-dir`` database: ``state.db``, SQLite in WAL mode (no I/O policy here).

Schema (``schema_version`` 3 in ``meta``; documented in docs/operations.md):

    meta(key TEXT PRIMARY KEY, value TEXT)
    jobs(job_id TEXT PRIMARY KEY, generation INTEGER, state TEXT,
         num_nodes INTEGER, gpus_per_node INTEGER, detail TEXT)   -- detail: JSON
    kv(job_id TEXT, key TEXT, value BLOB, PRIMARY KEY (job_id, key))
    used_ids(job_id TEXT, digest TEXT, PRIMARY KEY (job_id, digest))  -- oldest first by rowid
    job_ends(job_id TEXT PRIMARY KEY, ended_at REAL)  -- Unix seconds; meta: job_ends_floor

``job_ends`` is when the last job of each id was forgotten (``job_ends.py``), written
in the commit that deletes that job's row. A version 3 database without it gets the
table empty (no end known), and one written here is still read by a daemon that
does not know the table (it ignores it).

The used-id history has a table of its own, not the job's row: the row is rewritten on
every commit of its job (a KvSet, a barrier), the history changes only when a
generation opens. Version 2 kept it in ``detail``; such a database is read as it is
and moves the history to ``used_ids`` as each job's row is next written.

One ``commit`` is one transaction: a job's row, the KV rows that changed and the
deletions of expired jobs become durable together or not at all, and survive power
loss, not only a process crash. It is two steps, so that the daemon can run them on
different threads: ``write`` (the transaction, ``synchronous=NORMAL``: SQLite does not
fsync) and ``sync`` (an fsync of the -wal file, which holds every committed frame, and
a checkpoint when the WAL has outgrown ``WAL_SIZE_LIMIT``; SQLite's own checkpoints are
off, so none runs inside a ``write``). A ``write`` waits for another connection's write
lock only when asked to (``wait``); otherwise it says it could not start
(``check_same_thread=False``: the Persister runs a ``write`` on the event loop and
``sync`` on its writer thread, one commit at a time).
"""

from __future__ import annotations

import json
import os
import sqlite3
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rendezvousd.common import open_files
from rendezvousd.errors import DaemonError
from rendezvousd.storage.job_ends import EndsWrite

DB_FILE = "state.db"
SCHEMA_VERSION = 3
_MIGRATES = ("2",)  # versions this one reads and upgrades in place
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS jobs (job_id TEXT PRIMARY KEY, generation INTEGER NOT NULL, "
    "state TEXT NOT NULL, num_nodes INTEGER NOT NULL, gpus_per_node INTEGER NOT NULL, "
    "detail TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS kv (job_id TEXT NOT NULL, key TEXT NOT NULL, "
    "value BLOB NOT NULL, PRIMARY KEY (job_id, key))",
    "CREATE TABLE IF NOT EXISTS used_ids (job_id TEXT NOT NULL, digest TEXT NOT NULL, "
    "PRIMARY KEY (job_id, digest))",
    "CREATE TABLE IF NOT EXISTS job_ends (job_id TEXT PRIMARY KEY, ended_at REAL NOT NULL)",
)
_FLOOR = "job_ends_floor"
_IDS = "used_id_digests"
# The -wal file's size once a checkpoint has copied it into the database: without a
# limit SQLite reuses the file from its start but never shrinks it, so one long reader
# (a `sqlite3` shell left open) that held checkpoints back left it at its high-water
# mark (699 MB seen) for good. The first commit after a complete checkpoint truncates
# it to this. 4 MiB: just above one auto-checkpoint cycle (1000 pages of 4 KiB plus
# frame headers), so a WAL of normal size is reused, never truncated and regrown.
WAL_SIZE_LIMIT = 4 * 1024 * 1024
# How long the connection waits for another connection's lock (an operator's `sqlite3`
# shell in a transaction): sqlite3.connect's default. Except a ``write`` not asked to
# wait, which runs on the event loop and must not.
BUSY_TIMEOUT_MS = 5000
_SCALARS = ("generation", "state", "num_nodes", "gpus_per_node")


@dataclass
class JobWrite:
    """What one commit writes for one job: its row, and KV rows to put or delete."""

    job_id: str
    record: dict[str, Any] | None  # None: the job is gone (expired)
    kv_put: dict[str, bytes] = field(default_factory=dict)
    kv_delete: set[str] = field(default_factory=set)
    kv_replace: bool = False  # a new generation: drop every old KV row first
    # The row is what the last commit wrote (a KvSet changes only KV rows): not written
    # again, unless the commit replaces everything.
    row_unchanged: bool = False


def read_only_filesystem(path: Path) -> bool:
    """Whether ``path`` lies on a filesystem mounted read-only: ``os.access`` says only
    "not writable" for it, which read as an owner to chown, even for root."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


#: Free space below which a failed write is put down to a full filesystem: SQLite
#: grows the -shm file 32 KiB at a time and the -wal by pages, and on a tmpfs a -shm
#: that cannot grow is reported as an I/O error (SQLITE_IOERR_SHMSIZE), not as full.
NEARLY_FULL_BYTES = 1024 * 1024


def full_filesystem(path: Path) -> str | None:
    """How full ``path``'s filesystem is ("12 KiB free", "no inodes free") when it is
    too full for SQLite to write, else None (or when statvfs cannot say)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    if st.f_files and not st.f_favail:
        return "no inodes free"
    free = st.f_bavail * st.f_frsize
    if free < NEARLY_FULL_BYTES:
        return f"{free // 1024} KiB free"
    return None


@dataclass
class StoredJob:
    record: dict[str, Any]
    kv: dict[str, bytes]


class SqliteStore:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / DB_FILE
        self._db: sqlite3.Connection | None = None
        self._file = (0, 0)  # (st_dev, st_ino) of the file opened
        # job id -> its history as the used_ids table holds it (what is committed), so
        # that a commit writes the history only when it changed, and then only the
        # difference. Used by whichever thread commits (one at a time).
        self._ids_written: dict[str, list[str]] = {}
        self._wal_fd: int | None = None

    def open(self) -> None:
        for suffix in ("", "-wal", "-shm"):
            if Path(f"{self.path}{suffix}").is_symlink():
                # The directory is ours alone (checked by the caller), so a link here
                # was planted or left by hand: never let SQLite write through it.
                raise DaemonError(
                    f"{self.path}{suffix} is a symbolic link; the daemon refuses to write "
                    "through it: move it aside"
                )
        refusal = self._not_ours()
        if refusal:
            raise DaemonError(refusal)
        old_umask = os.umask(0o077)  # the database and its -wal/-shm are 0600
        try:
            db = sqlite3.connect(
                self.path,
                isolation_level=None,
                check_same_thread=False,
                timeout=BUSY_TIMEOUT_MS / 1000,
            )
            try:
                self._prepare(db)
                st = self.path.stat()
                self._open_wal()
            except BaseException:
                # The storage retry opens it once a tick while the disk is failing: a
                # connection per failed try would stay open until the GC found it.
                db.close()
                raise
        except (sqlite3.Error, OSError) as exc:
            raise DaemonError(
                f"cannot open state database {self.path}: {exc}; {self._open_advice(exc)}"
            ) from exc
        finally:
            os.umask(old_umask)
        self._db = db
        self._file = (st.st_dev, st.st_ino)
        self._ids_written = {}

    def _not_ours(self) -> str | None:
        """Why this daemon's user cannot use the database's files (their owner or mode),
        or None. SQLite says only "unable to open database file", which read as damage,
        and moving the file aside, the remedy for damage, loses every job (an operator
        review: a state.db restored from a backup as root, the daemon running as 10001)."""
        if read_only_filesystem(self.directory):
            # os.access below says "no" for it too, even to root: no chown helps.
            return (
                f"state database {self.path} is on a read-only filesystem: remount "
                f"{self.directory} read-write, then start again (it holds the jobs to restore)"
            )
        for suffix in ("", "-wal", "-shm"):
            path = Path(f"{self.path}{suffix}")
            try:
                st = path.stat()
            except OSError:
                continue  # absent (SQLite creates it), or the dir's own fault: check_dir's
            if os.access(path, os.R_OK | os.W_OK):
                continue
            uid, gid = os.geteuid(), os.getegid()
            if st.st_uid != uid:
                fix = f"chown {uid}:{gid} {self._present()}"
            else:
                fix = f"chmod 600 {self._present()}"
            return (
                f"state database file {path} is owned by uid {st.st_uid} (mode "
                f"{stat.filemode(st.st_mode)}), and this daemon's user (uid {uid}) cannot "
                f"read and write it; run: {fix}, then start again. Do not move it aside: it "
                "is not damaged, and it holds the jobs to restore"
            )
        return None

    def _open_advice(self, exc: sqlite3.Error | OSError) -> str:
        """What to do about a failed open. Moving the database aside loses every job,
        so it is offered only for a file SQLite finds damaged or not a database."""
        code = getattr(exc, "sqlite_errorcode", None)
        primary = code & 0xFF if isinstance(code, int) else None
        if primary in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB):
            return "it is damaged: move it (and its -wal/-shm files) aside to start with no jobs"
        if open_files.ran_out(exc):
            return f"{open_files.ran_out_text()}, then start again"
        full = full_filesystem(self.directory)
        writing = primary in (sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR) or isinstance(exc, OSError)
        if writing and (primary == sqlite3.SQLITE_FULL or full is not None):
            return (
                f"its filesystem is full ({full or 'no space left'}): free space there, "
                "then start again (it holds the jobs to restore)"
            )
        if primary == sqlite3.SQLITE_IOERR:
            return (
                "check the disk it is on (dmesg), then start again (it holds the jobs to restore)"
            )
        return (
            "fix that and start again (it holds the jobs to restore); only a database "
            "SQLite reports damaged should be moved aside, which starts with no jobs"
        )

    def _present(self) -> str:
        """The database's files that exist, as one shell argument list."""
        return " ".join(
            str(p)
            for p in (Path(f"{self.path}{suffix}") for suffix in ("", "-wal", "-shm"))
            if p.exists() or p.is_symlink()
        )

    def _prepare(self, db: sqlite3.Connection) -> None:
        # The version first, before anything is written: a database this daemon refuses
        # (a newer one's) is left as it was, not given our tables or journal mode.
        version = _schema_version(db)
        if version is not None and version not in (str(SCHEMA_VERSION), *_MIGRATES):
            raise DaemonError(
                f"state database {self.path} has schema_version {version!r}, this daemon "
                f"reads {SCHEMA_VERSION}; use the matching rendezvousd or move it aside"
            )
        db.execute("PRAGMA journal_mode=WAL")
        # Durability is ``sync``'s fsync; SQLite's own would run inside ``write``.
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("PRAGMA wal_autocheckpoint=0")  # ``sync`` checkpoints instead
        db.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
        for statement in _SCHEMA:
            db.execute(statement)
        if version is None:
            db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        elif version in _MIGRATES:
            db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION),))

    @property
    def is_open(self) -> bool:
        return self._db is not None

    def replaced(self) -> bool:
        """Whether the open database file is no longer the one at ``path``: SQLite
        would keep writing into a deleted file, and nothing would survive a restart."""
        try:
            st = self.path.stat()
        except OSError:
            return True
        # The device too: another filesystem mounted in the directory's place can hold
        # a file of the same inode number.
        return (st.st_dev, st.st_ino) != self._file

    def close(self) -> None:
        if self._wal_fd is not None:
            os.close(self._wal_fd)
            self._wal_fd = None
        if self._db is not None:
            self._db.close()
            self._db = None

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            # Closed by a storage retry that found the directory gone (reopened by the
            # next one that finds it back), or not opened yet.
            raise sqlite3.OperationalError(f"state database {self.path} is not open")
        return self._db

    def load(self) -> dict[str, StoredJob]:
        """Every stored job; a row that does not parse is a DaemonError naming it."""
        db = self._conn()
        jobs: dict[str, StoredJob] = {}
        try:
            for job_id, generation, state, num_nodes, gpus, detail in db.execute(
                "SELECT job_id, generation, state, num_nodes, gpus_per_node, detail FROM jobs"
            ):
                where = f"table jobs, row job_id={job_id!r}"
                try:
                    record = json.loads(detail)
                    if not isinstance(record, dict):
                        raise ValueError("detail is not a JSON object")
                except ValueError as exc:
                    raise self.bad_row(where, f"detail: {exc}") from exc
                record.update(
                    job_id=job_id,
                    generation=generation,
                    state=state,
                    num_nodes=num_nodes,
                    gpus_per_node=gpus,
                )
                record.setdefault(_IDS, [])  # a version 2 row holds it, else used_ids
                jobs[str(job_id)] = StoredJob(record, {})
            for job_id, key, value in db.execute("SELECT job_id, key, value FROM kv"):
                where = f"table kv, row (job_id={job_id!r}, key={key!r})"
                stored = jobs.get(job_id)
                if stored is None:
                    raise self.bad_row(where, "no job with this job_id in table jobs")
                if not isinstance(key, str) or not isinstance(value, bytes):
                    raise self.bad_row(where, "key must be TEXT and value a BLOB")
                stored.kv[key] = value
            tables: dict[str, list[str]] = {}
            for job_id, digest in db.execute("SELECT job_id, digest FROM used_ids ORDER BY rowid"):
                where = f"table used_ids, row (job_id={job_id!r})"
                if job_id not in jobs:
                    raise self.bad_row(where, "no job with this job_id in table jobs")
                tables.setdefault(job_id, []).append(digest)  # restore checks each digest
            for job_id, ids in tables.items():
                jobs[job_id].record[_IDS] = ids
            self._ids_written = {job_id: list(ids) for job_id, ids in tables.items()}
        except sqlite3.Error as exc:
            raise self._unreadable(exc) from exc
        return jobs

    def load_ends(self) -> tuple[list[tuple[object, object]], object]:
        """The stored job ends, oldest first, and the floor (0 when none is stored)."""
        db = self._conn()
        try:
            rows = db.execute("SELECT job_id, ended_at FROM job_ends ORDER BY ended_at, rowid")
            ends: list[tuple[object, object]] = [(j, t) for j, t in rows]
            floor = db.execute("SELECT value FROM meta WHERE key=?", (_FLOOR,)).fetchone()
        except sqlite3.Error as exc:
            raise self._unreadable(exc) from exc
        if floor is None:
            return ends, 0.0
        try:
            return ends, float(floor[0])
        except ValueError:
            return ends, floor[0]

    def _unreadable(self, exc: sqlite3.Error) -> DaemonError:
        return DaemonError(
            f"cannot read state database {self.path}: {exc}; move it aside to start with no jobs"
        )

    def bad_row(self, where: str, problem: str) -> DaemonError:
        return DaemonError(
            f"state database {self.path}, {where} is invalid: {problem}; fix or delete "
            "that row (sqlite3 CLI), or move the database aside to start with no jobs"
        )

    def commit(
        self,
        writes: list[JobWrite],
        *,
        replace_all: bool = False,
        ends: EndsWrite | None = None,
    ) -> None:
        """``write`` (waiting out another connection's write lock), then ``sync``."""
        self.write(writes, replace_all=replace_all, ends=ends, wait=True)
        self.sync(checkpoint=self.checkpoint_due())

    def write(
        self,
        writes: list[JobWrite],
        *,
        replace_all: bool = False,
        ends: EndsWrite | None = None,
        wait: bool = False,
    ) -> bool:
        """One transaction for the whole batch (``replace_all``: the batch is the whole
        state, drop every other row) and the job ends heard meanwhile, committed but not
        yet durable (``sync``). False, having written nothing, when another connection
        holds the write lock and ``wait`` is not set; raises sqlite3.Error/OSError on
        failure."""
        db = self._conn()
        # What used_ids holds once this commits (None: nothing for that job).
        ids_after: dict[str, list[str] | None] = {}
        if not wait:
            db.execute("PRAGMA busy_timeout=0")
        try:
            db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            # The primary code: SQLITE_BUSY_RECOVERY and the like are busy too.
            if not wait and exc.sqlite_errorcode & 0xFF == sqlite3.SQLITE_BUSY:
                return False
            raise
        finally:
            if not wait:
                db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        try:
            if replace_all:
                db.execute("DELETE FROM kv")
                db.execute("DELETE FROM jobs")
                db.execute("DELETE FROM used_ids")
            for w in writes:
                if w.record is None or w.kv_replace:
                    db.execute("DELETE FROM kv WHERE job_id=?", (w.job_id,))
                if w.record is None:
                    db.execute("DELETE FROM jobs WHERE job_id=?", (w.job_id,))
                    db.execute("DELETE FROM used_ids WHERE job_id=?", (w.job_id,))
                    ids_after[w.job_id] = None
                    continue
                if w.row_unchanged and not replace_all:
                    _write_kv(db, w)
                    continue
                ids = list(w.record.get(_IDS, ()))
                before = ids_after.get(w.job_id, self._ids_written.get(w.job_id))
                before = None if replace_all and w.job_id not in ids_after else before
                if ids != (before or []):
                    _write_ids(db, w.job_id, before or [], ids)
                ids_after[w.job_id] = ids
                detail = {k: v for k, v in w.record.items() if k not in (*_SCALARS, "job_id", _IDS)}
                db.execute(
                    "INSERT OR REPLACE INTO jobs VALUES (?, ?, ?, ?, ?, ?)",
                    (
                        w.job_id,
                        *(w.record[k] for k in _SCALARS),
                        json.dumps(detail, sort_keys=True),
                    ),
                )
                _write_kv(db, w)
            if ends:
                _write_ends(db, ends)
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        if replace_all:
            self._ids_written = {}
        for job_id, after in ids_after.items():
            if after is None:
                self._ids_written.pop(job_id, None)
            else:
                self._ids_written[job_id] = after
        if self.replaced():
            # Checked after the commit: a removal during it left it in a dead file.
            raise OSError(f"{self.path} was removed or replaced")
        return True

    def checkpoint_due(self) -> bool:
        """Whether the WAL has outgrown ``WAL_SIZE_LIMIT`` (about SQLite's own 1,000-page
        auto-checkpoint): after a complete checkpoint the next ``write`` starts the file
        over and truncates it to that size, so it grows past it only with new frames."""
        try:
            return os.stat(f"{self.path}-wal").st_size > WAL_SIZE_LIMIT
        except FileNotFoundError:
            return False

    def _open_wal(self) -> None:
        """The -wal file's descriptor ``sync`` fsyncs, taken when the database is opened:
        taken at the first commit, it failed there on a daemon whose connections had
        used up its open-file limit (EMFILE), and every change was refused. Opened once:
        SQLite keeps the -wal file (same inode) while its connection is open; a
        checkpoint's restart truncates it, never replaces it. SQLite created it: its
        directory entry is made durable once, here."""
        if self._wal_fd is not None:
            return
        wal = os.open(f"{self.path}-wal", os.O_RDONLY | os.O_CLOEXEC)
        try:
            directory = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
        except BaseException:
            os.close(wal)
            raise
        self._wal_fd = wal

    def sync(self, *, checkpoint: bool = False) -> None:
        """Makes every ``write`` so far durable: an fsync of the -wal file, where WAL mode
        keeps each committed frame until a checkpoint (whose own fsyncs, of the WAL and
        then the database, SQLite makes at ``synchronous=NORMAL``); raises OSError or
        sqlite3.Error on failure."""
        if self._wal_fd is None:
            self._open_wal()
        assert self._wal_fd is not None
        os.fsync(self._wal_fd)
        if checkpoint:
            self._conn().execute("PRAGMA wal_checkpoint(PASSIVE)")


def _write_kv(db: sqlite3.Connection, w: JobWrite) -> None:
    db.executemany("DELETE FROM kv WHERE job_id=? AND key=?", ((w.job_id, k) for k in w.kv_delete))
    db.executemany(
        "INSERT OR REPLACE INTO kv VALUES (?, ?, ?)",
        ((w.job_id, k, v) for k, v in w.kv_put.items()),
    )


def _write_ids(db: sqlite3.Connection, job_id: str, before: list[str], after: list[str]) -> None:
    """Turns ``job_id``'s rows in used_ids from ``before`` into ``after`` (both oldest
    first): usually the oldest few go and a new one comes, so only those are written."""
    wanted = set(after)
    kept = [d for d in before if d in wanted]
    if after[: len(kept)] != kept:
        # Reordered (an old id used again moved to the newest): write the job's afresh.
        db.execute("DELETE FROM used_ids WHERE job_id=?", (job_id,))
        kept, before = [], []
    db.executemany(
        "DELETE FROM used_ids WHERE job_id=? AND digest=?",
        ((job_id, d) for d in before if d not in wanted),
    )
    db.executemany("INSERT INTO used_ids VALUES (?, ?)", ((job_id, d) for d in after[len(kept) :]))


def _schema_version(db: sqlite3.Connection) -> str | None:
    """The database's ``schema_version`` (None: a new database, written by no daemon)."""
    meta = "SELECT 1 FROM sqlite_master WHERE type='table' AND name='meta'"
    if db.execute(meta).fetchone() is None:
        return None
    row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    return None if row is None else str(row[0])


def _write_ends(db: sqlite3.Connection, ends: EndsWrite) -> None:
    if ends.replace_all:
        db.execute("DELETE FROM job_ends")
    db.executemany("DELETE FROM job_ends WHERE job_id=?", ((j,) for j in ends.drop))
    db.executemany("INSERT OR REPLACE INTO job_ends VALUES (?, ?)", ends.put.items())
    if ends.floor is not None:
        db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (_FLOOR, repr(ends.floor)))
