"""Durable job state in ``--state-dir``: incremental, group-committed SQLite writes.

The state machine stays pure: callers tell the Persister what they touched (a job,
and for key-value calls the key), and ``durable()`` writes the touched jobs' rows
and keys in one transaction on a worker thread, shared by every change made
meanwhile (group commit). An RPC answers only after its change is committed.

Storage failure (disk full, state dir removed): the design is *undo on failure*.
When the commit carrying a change fails, everything not yet durable is undone in
memory: each key changed since its last commit gets its committed value back (the
Persister remembers it before a key-value call runs), and each job changed since its
last commit is put back to the record that commit wrote (``rollback``), or removed if
it has none. Every caller of an undone change gets UNAVAILABLE / STORAGE_UNAVAILABLE,
so do the calls parked on a job put back and the calls a change woke (never the
answer it would have had), heartbeat streams of members that exist no more end with
it, and the daemon refuses every further change up front (nothing applied) and
reports NOT_SERVING until a probe rewrites the whole, now durable, state. Undo rather
than write-ahead because the state machine decides and mutates in one step (limits,
counters, waiters): undo needs only what is already durable, not a second state
machine. A retry after the fault (same instance id, sequence number) applies the
change once. A change made by time or by a stream's end (a member lost) is told once
committed too (the servicer's ``decided``); an undone loss is kept on its attendee and
made again once storage takes writes (``Attendee.lost_as``), as is one found while
storage fails. Reads wait for the commit of their job's pending changes
(``settled``), so none answers with a value that is undone a moment later.

``StateStore`` is the pre-SQLite ``state.json`` format, kept only to import it once.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import secrets
import sqlite3
import stat
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from rendezvousd.common import open_files
from rendezvousd.errors import DaemonError
from rendezvousd.state import kv as kvrules
from rendezvousd.state.machine import RendezvousState
from rendezvousd.storage import rollback, snapshot
from rendezvousd.storage.faults import storage_unavailable
from rendezvousd.storage.job_ends import EndsWrite, JobEnds
from rendezvousd.storage.store_sqlite import (
    JobWrite,
    SqliteStore,
    full_filesystem,
    read_only_filesystem,
)

log = logging.getLogger("rendezvousd")
STATE_FILE = "state.json"
IMPORTED_SUFFIX = ".imported"
LOCK_FILE = "rendezvousd.lock"
#: What follows the pid in the lock file of a holder that marks the file's mtime each
#: tick (``StateDirLock.mark_alive``): an empty line, which every reader of the pid
#: (``strip()``, a shell's ``$(cat …)``) drops. A file without it (an older daemon's)
#: has the mtime of that daemon's start, no time it was alive at.
ALIVE_MARKED = "\n\n"
_MISSING = object()
_UndoKey = tuple[str, str]


@dataclass
class _Cut:
    """One commit's pending changes, cut on the event loop."""

    writes: list[JobWrite] = field(default_factory=list)
    # (job, key) -> the value written (None: deleted).
    written: dict[_UndoKey, bytes | None] = field(default_factory=dict)
    # job id -> its key-value store (the dict itself) when its record was cut.
    stores: dict[str, dict[str, bytes]] = field(default_factory=dict)
    ends: EndsWrite = field(default_factory=EndsWrite)


def check_private(directory: Path) -> None:
    """Refuse a state dir others could write into: another user could plant a symlink
    or file the daemon (often root) then writes through, and the job state is nobody
    else's to touch either. At start-up, and for a directory put back under a running
    daemon (the storage retry)."""
    try:
        mode = directory.stat().st_mode
    except OSError as exc:
        raise DaemonError(f"cannot look at state dir {directory}: {exc.strerror}") from exc
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise DaemonError(
            f"state dir {directory} is writable by group/others (mode "
            f"{stat.filemode(mode)}); run: chmod 700 {directory}"
        )


def _unreadable(path: Path, exc: OSError) -> str:
    """Why the state file cannot be opened, and what to do: moving it aside loses every
    job it holds, the remedy only for a file the daemon must not follow."""
    said = f"cannot read state file {path}: {exc.strerror}"
    if exc.errno == errno.ELOOP:
        return f"{said} (a symlink is refused); move it aside to start with no jobs"
    if exc.errno in (errno.EACCES, errno.EPERM):
        fix = "give the daemon's user read access"
    elif exc.errno == errno.EIO:
        fix = "check the disk it is on (dmesg) and restart"
    else:
        fix = "fix that and restart"
    return f"{said}; {fix} (it holds the jobs to restore), or move it aside to start with no jobs"


class StateStore:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / STATE_FILE

    def check_dir(self) -> None:
        """Creates the directory 0700; refuses one that others could write into."""
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            said = f"cannot create state dir {self.directory}: {exc.strerror}"
            if exc.errno == errno.EROFS:
                said += (
                    " (its parent is on a read-only filesystem); remount it read-write, or "
                    "give a --state-dir on a writable one"
                )
            raise DaemonError(said) from exc
        check_private(self.directory)
        if not os.access(self.directory, os.W_OK):
            if read_only_filesystem(self.directory):
                # A chown cannot help here, and root reads the same refusal.
                raise DaemonError(
                    f"state dir {self.directory} is on a read-only filesystem (mounted "
                    "read-only); remount it read-write, or give a --state-dir on a "
                    "writable one"
                )
            raise DaemonError(
                f"state dir {self.directory} is not writable by this daemon's user (uid "
                f"{os.getuid()}); chown it to that user, or give another --state-dir"
            )

    def remove_stale(self) -> None:
        for stale in self.directory.glob(f".{STATE_FILE}.*.tmp"):
            # Left by a crash mid-write; unlink removes a link itself, never its target.
            stale.unlink(missing_ok=True)

    def read(self) -> dict[str, Any] | None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise DaemonError(_unreadable(self.path, exc)) from exc
        with os.fdopen(fd, "rb") as f:
            raw = f.read()
        try:
            envelope = json.loads(raw)
            payload = envelope["payload"]
            digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
            if digest != envelope["sha256"]:
                raise ValueError("checksum mismatch")
        except (ValueError, KeyError, TypeError) as exc:
            raise DaemonError(
                f"state file {self.path} is torn or corrupt ({exc}); refusing to start rather than "
                "lose jobs silently. Move it aside to start with no jobs."
            ) from exc
        if not isinstance(payload, dict):
            raise DaemonError(
                f"state file {self.path} does not hold a state document (its payload is a "
                f"JSON {type(payload).__name__}, not an object); refusing to start rather than "
                "lose jobs silently. Move it aside to start with no jobs."
            )
        return payload

    def write(self, payload: dict[str, Any]) -> None:
        body = json.dumps(payload, sort_keys=True)
        envelope = {"sha256": hashlib.sha256(body.encode()).hexdigest(), "payload": payload}
        tmp = self.path.with_name(f".{STATE_FILE}.{secrets.token_hex(8)}.tmp")
        # A fresh name that must not exist: never write through a planted file or link.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(envelope, f, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        dir_fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


class StateDirLock:
    """One daemon per state dir: an exclusive ``flock`` on ``DIR/rendezvousd.lock``.

    Two daemons on one directory would serve the same jobs with different state and
    interleave their rows, which the next restart then restores. ``flock`` rather
    than a pid file alone: the kernel drops it when the holder dies however it dies
    (SIGKILL, OOM), so a stale file never blocks a restart. The file holds the
    holder's pid only to name it in the refusal."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / LOCK_FILE
        self._fd: int | None = None
        #: When the daemon that held the lock before this one was last seen alive
        #: (Unix seconds: the file's mtime, ``mark_alive``); None for a new file.
        self.previous_alive: float | None = None

    def acquire(self) -> None:
        try:
            # O_NOFOLLOW: a link planted here must not make us create or lock its target.
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise DaemonError(
                f"cannot open the state dir lock file {self.path}: {exc.strerror}"
                + (
                    " (a symbolic link is refused: move it aside)"
                    if exc.errno == errno.ELOOP
                    else ""
                )
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_pid(fd)
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise DaemonError(f"cannot lock {self.path}: {exc.strerror}") from exc
            who = f"pid {holder}" if holder else "a process that has not written its pid yet"
            raise DaemonError(
                f"state dir {self.path.parent} is in use by another rendezvousd ({who}, "
                f"holding {self.path}); two daemons on one state dir would serve the same "
                "jobs with different state: stop that daemon first, or give this one "
                "another --state-dir"
            ) from None
        with contextlib.suppress(OSError):
            mtime = os.fstat(fd).st_mtime
            if os.pread(fd, 64, 0).decode("ascii", "replace").endswith(ALIVE_MARKED):
                self.previous_alive = mtime
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}{ALIVE_MARKED}".encode(), 0)
        except OSError as exc:
            # The first write of a start: a full (or read-only) state volume meets it
            # before the database does.
            os.close(fd)
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            raise DaemonError(
                f"cannot write the state dir lock file {self.path}: {exc.strerror}; "
                + (
                    "the state dir's filesystem is full: free space there or give "
                    "another --state-dir"
                    if full
                    else "make the state dir writable or give another --state-dir"
                )
            ) from exc
        self._fd = fd

    def reacquire(self) -> None:
        """Make sure the lock held is that of the directory now at ``path``'s parent.

        Kept while ``path`` is still the file locked (the same directory back after a
        rename or a remount). The directory removed or replaced, the lock went with
        the old one: let go of it and lock the new one, refused (DaemonError) while
        another daemon holds it. Not when ``path`` cannot be looked at (OSError other
        than its absence: the directory unreadable for a moment), which raises with
        the lock still held: the file may well be ours still, and letting go would
        let another daemon in."""
        if self._fd is not None:
            try:
                st = os.stat(self.path, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            ours = os.fstat(self._fd)
            if st is not None and (st.st_dev, st.st_ino) == (ours.st_dev, ours.st_ino):
                return
            self.release()
        self.acquire()

    def mark_alive(self) -> None:
        """The lock file's mtime set to now, each tick: after a crash or a SIGKILL,
        which leave no drain time in the rows, the next start reads from it how long
        the daemon was down (``previous_alive``). A metadata write, no fsync."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.utime(self._fd)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None


def _read_pid(fd: int) -> int:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return 0
    return int(text) if text.isdigit() else 0


class Persister:
    def __init__(self, directory: Path | None, state: RendezvousState) -> None:
        self.directory = directory
        self.store = SqliteStore(directory) if directory is not None else None
        self.lock = StateDirLock(directory) if directory is not None else None
        self.state = state
        # When the last job of each id ended: job tokens minted before it are refused.
        self.job_ends = JobEnds()
        self.healthy = True
        # While unhealthy: since when (wall clock, for `status` and the page) and the
        # cause in the words a refused caller hears, where one is known.
        self.failing_since: float | None = None
        self.cause: str | None = None
        self.on_health: Callable[[bool], None] | None = None
        #: How long the daemon was down before this start, where its state dir says
        #: (``StateDirLock.previous_alive``); None otherwise.
        self.down_s: float | None = None
        self._version = 0  # bumped by every touch
        self._job_version: dict[str, int] = {}  # job id -> version of its newest touch
        self._saved = 0  # every change up to this version is committed
        self._failed = 0  # every change up to this version was refused and undone
        self._dirty: dict[str, set[str]] = {}  # job id -> touched KV keys
        self._written_gen: dict[str, int] = {}  # job id -> generation its KV rows hold
        # job id -> its last committed record, and that generation's key-value store.
        # The record rather than a copy taken before a job's first change after a commit:
        # it is by construction what is durable, whichever path changed the job (an RPC,
        # a tick, a stream's end, a parked call's deadline), where a copy would need a
        # hook on every one of them. The store is the job's own dict (a new generation
        # gets a new one), kept at its committed values by the key-value undo.
        self._durable: dict[str, tuple[dict[str, Any], dict[str, bytes]]] = {}
        # Told which jobs a failed commit put back (the servicer releases their calls).
        self.on_undo: Callable[[set[str]], None] | None = None
        # Each commit's duration and whether it took (the daemon's metrics).
        self.on_commit: Callable[[float, bool], None] | None = None
        # (job, key) -> (version recorded, generation, durable value or None)
        self._undo: dict[_UndoKey, tuple[int, int, bytes | None]] = {}
        # (version, what to do) once the changes up to that version are committed;
        # dropped when their commit fails (``when_durable``).
        self._once_durable: list[tuple[int, Callable[[], None]]] = []
        self._lock = asyncio.Lock()
        # The group commit in flight (``_take_part``): what its waiters wait on.
        self._committing: asyncio.Task[None] | None = None
        # One writer thread, always the same: SQLite's connection (and the malloc
        # arena its allocations land in) stays with one thread, where the default
        # executor would spread commits over up to min(32, cpus + 4) threads.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="state-writer")

    async def _in_writer(self, fn: Callable[..., None], *args: Any) -> None:
        await asyncio.get_running_loop().run_in_executor(self._writer, fn, *args)

    # -- start ------------------------------------------------------------

    def restore(self) -> int:
        """Load the database (importing an old state.json once); returns the job count."""
        if self.store is None or self.directory is None:
            return 0
        legacy = StateStore(self.directory)
        legacy.check_dir()
        assert self.lock is not None
        self.lock.acquire()  # before anything in the directory is read or changed
        try:
            return self._restore(legacy)
        except BaseException:
            # Refused to start: let go of the directory (a daemon in this process, or a
            # fixed restart, may take it).
            self.store.close()
            self.lock.release()
            raise

    def _restore(self, legacy: StateStore) -> int:
        assert self.store is not None
        legacy.remove_stale()
        self.store.open()
        now = time.monotonic()
        stored = self.store.load()
        rows, floor = self.store.load_ends()
        try:
            self.job_ends.restore(rows, floor)
        except ValueError as exc:
            raise self.store.bad_row("table job_ends", str(exc)) from exc
        alive = None if self.lock is None else self.lock.previous_alive
        if alive is not None:
            self.down_s = max(0.0, time.time() - alive)
        for job_id, job in stored.items():
            try:
                snapshot.restore_job(self.state, job.record, job.kv, now, alive_unix=alive)
            except (ValueError, TypeError) as exc:
                raise self.store.bad_row(f"table jobs, row job_id={job_id!r}", str(exc)) from exc
            self._written_gen[job_id] = int(job.record["generation"])
        doc = legacy.read()
        if doc is not None:
            self._import(legacy, doc, bool(stored), now)
        for job_id in self.state.jobs:
            self.touch(job_id)  # fenced jobs got a new generation: write them now
        self._commit_sync()
        return len(self.state.jobs)

    def _import(
        self, legacy: StateStore, doc: dict[str, object], have_jobs: bool, now: float
    ) -> None:
        if have_jobs:
            raise DaemonError(
                f"{legacy.path} and {self.store.path if self.store else ''} both hold jobs; "
                f"the database is authoritative: move {legacy.path} aside"
            )
        try:
            snapshot.load(self.state, doc, now)
        except (KeyError, ValueError, TypeError) as exc:
            raise DaemonError(f"state file {legacy.path} is not a valid snapshot: {exc}") from exc
        for job_id in self.state.jobs:
            self.touch(job_id)
        self._commit_sync()
        legacy.path.rename(legacy.path.with_name(STATE_FILE + IMPORTED_SUFFIX))
        log.info(
            "imported %d job(s) from %s into the state database",
            len(self.state.jobs),
            legacy.path,
        )

    def _commit_sync(self) -> None:
        if self.store is None or not self._dirty:
            return
        version, cut = self._version, self._collect()
        try:
            self.store.commit(cut.writes, ends=cut.ends)
        except Exception as exc:  # any failure is a start-up error naming it, not a traceback
            raise DaemonError(
                f"cannot write state database {self.store.path}: {_described(exc)}"
            ) from exc
        self._committed(version, cut)

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        if self.store is not None:
            self.store.close()
        if self.lock is not None:
            self.lock.release()  # last: the database is closed before another may open it

    # -- what changed -------------------------------------------------------

    def job_ended(self, job_id: str, at: float) -> None:
        """The daemon forgot ``job_id``'s job at ``at`` (Unix seconds): the commit that
        deletes its row records the end with it."""
        self.job_ends.record(job_id, at)

    def ended(self, job_id: str) -> float | None:
        """When the last job of ``job_id`` ended, as the token check asks: None when
        none is known (the history's floor applies to an id the daemon does not hold)."""
        return self.job_ends.ended(job_id, held=job_id in self.state.jobs)

    def check(self, job_id: str) -> None:
        """Refuse a change up front while storage is known to be failing."""
        if self.store is not None and not self.healthy:
            raise storage_unavailable(job_id, cause=self.cause)

    def before_kv(self, job_id: str, key: str) -> None:
        """Call before a key-value change: remembers the durable value to undo to."""
        job = self.state.jobs.get(job_id)
        if self.store is None or job is None or (job_id, key) in self._undo:
            return
        self._undo[(job_id, key)] = (self._version, job.generation, job.gen.kv.get(key))

    def touch(self, job_id: str, key: str | None = None) -> None:
        """``job_id`` changed (and its key ``key``): the next commit writes it."""
        if self.store is None:
            return
        keys = self._dirty.setdefault(job_id, set())
        if key is not None:
            keys.add(key)
        self._version += 1
        self._job_version[job_id] = self._version

    def when_durable(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once every change made so far is committed (at once without
        storage); never, if the commit carrying them fails and they are undone. What
        counts an event of the state (a job transition in the metrics) waits for it:
        counted when made, an undone failure stayed counted as one."""
        if self.store is None or self._saved >= self._version:
            fn()
            return
        self._once_durable.append((self._version, fn))

    def _collect(self) -> _Cut:
        """The pending changes as rows, cut on the event loop (a consistent cut)."""
        cut = _Cut()
        writes, written = cut.writes, cut.written
        for job_id, keys in self._dirty.items():
            job = self.state.jobs.get(job_id)
            if job is None:
                if job_id in self._written_gen:
                    writes.append(JobWrite(job_id, None))
                continue
            record = snapshot.job_record(job)
            durable = self._durable.get(job_id)
            w = JobWrite(job_id, record, row_unchanged=durable is not None and durable[0] == record)
            cut.stores[job_id] = job.gen.kv
            if self._written_gen.get(job_id) != job.generation:
                w.kv_replace, w.kv_put = True, dict(job.gen.kv)
                written.update(((job_id, k), v) for k, v in job.gen.kv.items())
            for k in keys:
                value = job.gen.kv.get(k)
                written[(job_id, k)] = value
                if value is None:
                    w.kv_delete.add(k)
                elif not w.kv_replace:
                    w.kv_put[k] = value
            writes.append(w)
        self._dirty = {}
        cut.ends = self.job_ends.take()
        return cut

    # -- commit -------------------------------------------------------------

    async def durable(self, job_id: str = "") -> None:
        """Return once every change made so far is committed; raises STORAGE_UNAVAILABLE
        (after undoing it) when the commit carrying one of them failed."""
        if self.store is None:
            return
        target = self._version
        while True:
            if self._failed >= target:
                raise storage_unavailable(job_id, cause=self.cause)
            if self._saved >= target:
                return
            await self._take_part(lambda: self._saved < target and self._failed < target)

    def is_settled(self, job_id: str | None = None) -> bool:
        """Whether the changes made so far (to ``job_id``, or to any job) are committed
        (or there is no storage): ``settled``'s answer when it need not wait, without
        making a coroutine for every read (most find nothing in flight)."""
        return self.store is None or self._saved >= self._target(job_id)

    def _target(self, job_id: str | None) -> int:
        """The version holding every change made so far (to ``job_id``, or to any job)."""
        return self._version if job_id is None else self._job_version.get(job_id, 0)

    async def settled(self, job_id: str | None = None) -> bool:
        """Wait until the changes made so far (to ``job_id``, or to any job) are
        committed or refused; False when the commit carrying one of them failed.

        Reads call it so that they never answer with a value whose commit is still in
        flight: a refused change is undone, and a value read before the refusal would
        be one that never existed. It never raises, so reads keep working (from the
        undone, durable state) while storage is down."""
        if self.store is None:
            return True
        target = self._target(job_id)
        while True:
            if self._saved >= target:
                return True
            if self._failed >= target or not self.healthy:
                return False
            await self._take_part(
                lambda: self._saved < target and self._failed < target and self.healthy
            )

    async def _take_part(self, needed: Callable[[], bool]) -> None:
        """Wait for the commit in flight, or make the next one if ``needed()`` still.

        The callers re-check their own change afterwards. Waiters wait on the commit
        itself, not on the lock: every waiter of a commit wakes with it, in one loop
        pass. Queued on the lock, each took it in turn only to find its change
        committed, one loop pass each: a burst of 256 KvSets spent ~50 ms handing the
        lock along after the one commit that covered them all."""
        if self._committing is None:
            # A task of its own, not its first waiter's: that caller may give up (its
            # deadline, a cancel) mid-commit, which would leave the commit written but
            # never recorded as durable (the undo would then go back past it). The task
            # starts on the next loop pass: the changes the rest of this pass makes (the
            # other calls of a CallBatch, other streams' messages read with it) share
            # this commit, instead of the first change going alone and the rest waiting
            # out its fsync for the next. A node's calls then also get their replies
            # together.
            self._committing = asyncio.create_task(self._group_commit(needed))
        await asyncio.shield(self._committing)

    async def _group_commit(self, needed: Callable[[], bool]) -> None:
        try:
            async with self._lock:  # recover() may hold it
                if needed():
                    await self._commit()
        finally:
            self._committing = None

    async def _commit(self) -> None:
        assert self.store is not None
        version = self._version
        cut = self._collect()
        started = time.perf_counter()
        try:
            # The transaction runs here, on the event loop, and only its fsync (and a
            # checkpoint now and then) on the writer thread. Python's sqlite3 lets go of
            # the GIL around every statement and every row, and a thread that wants it
            # back waits out the busy loop's switch interval (5 ms) each time: done on
            # the writer thread, a commit of 256 KV rows took 1.5 s on a busy daemon
            # instead of 2 ms (docs/benchmarks.md, "Commits under load"). A write lock
            # held by another connection is never waited for here: that commit goes to
            # the writer thread whole, which waits it out as before.
            if self.store.write(cut.writes, ends=cut.ends):
                await self._in_writer(
                    partial(self.store.sync, checkpoint=self.store.checkpoint_due())
                )
            else:
                await self._in_writer(partial(self.store.commit, cut.writes, ends=cut.ends))
        except Exception as exc:
            # Not only sqlite3.Error/OSError: whatever stopped the commit (a value SQLite
            # cannot bind raises OverflowError), the change is not durable and must be
            # undone, or it stays applied, its caller gets UNKNOWN, and the exception
            # escapes into the tick task and kills it.
            self._observe(started, ok=False)
            self.job_ends.unsent(cut.ends)
            self._fail(cut.writes, exc)
            return
        self._observe(started, ok=True)
        self._committed(version, cut)

    def _observe(self, started: float, *, ok: bool) -> None:
        if self.on_commit is not None:
            self.on_commit(time.perf_counter() - started, ok)

    def unchanged(self, job_id: str) -> bool:
        """Whether ``job_id`` is as its last commit left it (a refused call that changed
        nothing then needs no commit: one fsync per refusal was a token holder's lever).
        Compares the job's record with the durable one; pending changes count as some."""
        if self.store is None:
            return True
        if job_id in self._dirty or job_id in self._job_version:
            return False
        job = self.state.jobs.get(job_id)
        durable = self._durable.get(job_id)
        if job is None or durable is None:
            return job is None and durable is None
        return durable[0] == snapshot.job_record(job)

    def _committed(self, version: int, cut: _Cut) -> None:
        self._saved = max(self._saved, version)
        if self._once_durable:
            due = [fn for v, fn in self._once_durable if v <= self._saved]
            self._once_durable = [(v, fn) for v, fn in self._once_durable if v > self._saved]
            for fn in due:
                fn()
        for job_id in [j for j, v in self._job_version.items() if v <= self._saved]:
            del self._job_version[job_id]
        written = cut.written
        for w in cut.writes:
            if w.record is None:
                self._written_gen.pop(w.job_id, None)
                self._durable.pop(w.job_id, None)
            else:
                self._written_gen[w.job_id] = int(w.record["generation"])
                self._durable[w.job_id] = (w.record, cut.stores[w.job_id])
        for k, (recorded, generation, _) in list(self._undo.items()):
            if recorded >= version:
                continue  # touched after the cut: its change is still pending
            store = self._store_of(k[0], generation)
            value = written.get(k, _MISSING)
            if store is None or value is _MISSING or store.get(k[1]) is value:
                del self._undo[k]
            else:  # changed again since the cut: the committed value is what to undo to
                self._undo[k] = (self._version, generation, written[k])

    def _fail(self, writes: list[JobWrite], exc: BaseException) -> None:
        # One ERROR per outage: it says what fails and what the daemon does until
        # storage is back; a commit during it (a goodbye: a change not
        # refused up front) fails the same way, and recover() logs its tries as these.
        self._name_cause(exc)
        log.log(
            logging.ERROR if self.healthy else logging.DEBUG,
            "cannot write the state database %s: %s; refusing changes (health NOT_SERVING) "
            "until it takes writes again",
            self.store.path if self.store else "",
            self._advised(exc),
        )
        for w in writes:  # still to be written once storage is back
            self._dirty.setdefault(w.job_id, set()).update(w.kv_put, w.kv_delete)
        self._failed = self._version
        self._once_durable.clear()  # every change they waited for is undone
        self._undo_kv()
        undone = self._put_back()
        self._set_health(False)
        if undone and self.on_undo is not None:
            self.on_undo(undone)

    def _undo_kv(self) -> None:
        """Every key changed since its last commit gets its committed value back."""
        for (job_id, key), (_, generation, before) in self._undo.items():
            store = self._store_of(job_id, generation)
            if store is None:
                continue
            current = store.pop(key, None)
            if before is not None:
                store[key] = before
            job = self.state.jobs.get(job_id)
            if job is not None and store is job.gen.kv:
                job.gen.kv_bytes -= kvrules.entry_bytes(key, current) if current is not None else 0
                job.gen.kv_bytes += kvrules.entry_bytes(key, before) if before is not None else 0
        self._undo.clear()

    def _store_of(self, job_id: str, generation: int) -> dict[str, bytes] | None:
        """The key-value store of ``job_id``'s ``generation``: the job's own while it is at
        that generation, else the committed one of a job that moved on since."""
        job = self.state.jobs.get(job_id)
        if job is not None and job.generation == generation:
            return job.gen.kv
        durable = self._durable.get(job_id)
        if durable is not None and durable[0]["generation"] == generation:
            return durable[1]
        return None

    def _put_back(self) -> set[str]:
        """Every job changed since its last commit goes back to that commit's record (a
        job with none goes); returns the ones that changed."""
        now = time.monotonic()
        undone: set[str] = set()
        for job_id in list(self._dirty):
            live = self.state.jobs.get(job_id)
            durable = self._durable.get(job_id)
            record = durable[0] if durable is not None else None
            if (snapshot.job_record(live) if live is not None else None) == record:
                continue  # only keys changed, or nothing: the key-value undo did it
            job = None
            if durable is not None:
                job = rollback.durable_job(
                    durable[0], durable[1], live, now, hold_s=self.state.timing.hold_s
                )
                self._durable[job_id] = (durable[0], job.gen.kv)
            self.state.put_back(
                job_id,
                job,
                storage_unavailable(job_id, waiting=True, cause=self.cause),
                "undone: the commit of its changes failed; back to its last durable state",
            )
            undone.add(job_id)
        return undone

    def _name_cause(self, exc: BaseException) -> None:
        """What a refused caller is told the failure is: its job's operator, not the
        disk, must act on a daemon out of open files (they read "cannot write its state
        storage" and looked at the disk)."""
        self.cause = "it ran out of open files" if open_files.ran_out(exc) else None

    def _advised(self, exc: BaseException) -> str:
        """The failure as the log says it, with what to do where that is known."""
        said = _described(exc)
        if open_files.ran_out(exc):
            return f"{said}; {open_files.ran_out_text()}"
        if self.directory is not None and not self.directory.is_dir():
            # It does not make the directory itself: the operator may have moved it on
            # purpose, and a new empty one on the wrong mount would take the writes.
            return (
                f"{said}; the state dir {self.directory} is gone: put it back (or create it, "
                "mode 0700) and the daemon writes its whole state there again, or restart "
                "the daemon (which then starts with no jobs)"
            )
        full = None if self.directory is None else full_filesystem(self.directory)
        if full is not None and isinstance(exc, (sqlite3.Error, OSError)):
            # A -shm that cannot grow says "disk I/O error": the disk is not at fault.
            return f"{said}; its filesystem is full ({full}): free space there"
        return said

    def _set_health(self, healthy: bool) -> None:
        if healthy != self.healthy:
            self.healthy = healthy
            self.state.storage_failing = not healthy
            self.failing_since = None if healthy else time.time()
            if healthy:
                self.cause = None
            if self.on_health is not None:
                self.on_health(healthy)

    async def recover(self) -> bool:
        """While unhealthy: try to write the whole state again (reopening the database
        if it was removed); True once storage takes writes."""
        if self.store is None or self.healthy:
            return True
        async with self._lock:
            store = self.store
            for job_id in self.state.jobs:
                self.touch(job_id)
            self._written_gen.clear()  # rewrite every KV row: the old file may be gone
            version = self._version
            cut = self._collect()
            cut.ends = self.job_ends.whole()
            started = time.perf_counter()
            try:
                await self._in_writer(_reopen_and_commit, store, self.lock, cut.writes, cut.ends)
            except Exception as exc:
                # Each failed try is a failed commit: changes are refused up front
                # meanwhile, so these are the outage's only commits: a count standing
                # still through it would leave an alert on its increase() nothing to see.
                self._observe(started, ok=False)
                self.job_ends.unsent(cut.ends)
                for w in cut.writes:
                    self._dirty.setdefault(w.job_id, set())
                self._name_cause(exc)
                log.debug("state storage still failing: %s", self._advised(exc))
                return False
            self._observe(started, ok=True)
            self._committed(version, cut)
        log.info("state storage %s takes writes again; serving", store.path)
        self._set_health(True)
        return True


def _described(exc: BaseException) -> str:
    """The storage error as a log line names it; a type other than the expected
    sqlite3/OS errors is named too (it points at a bad value, not a bad disk)."""
    if isinstance(exc, (sqlite3.Error, OSError, DaemonError)):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _reopen_and_commit(
    store: SqliteStore, lock: StateDirLock | None, writes: list[JobWrite], ends: EndsWrite
) -> None:
    # Closed by an earlier try (that found the directory gone) or by a failed open, the
    # database is opened again whatever its file: the same directory put back (renamed
    # back, remounted, readable again) holds the very file opened before, so
    # ``replaced()`` alone finds nothing changed and every tick's try fails on the
    # closed connection until a restart.
    if not store.is_open or store.replaced():
        store.close()
        if not store.directory.is_dir():
            raise OSError(f"{store.directory} does not exist")
        check_private(store.directory)  # as at start-up: put back 0777, it is refused
        if lock is not None:
            # A recreated directory: our lock went with the old one, and another daemon
            # may have started on the new one meanwhile (then this refuses).
            lock.reacquire()
        store.open()
    store.commit(writes, replace_all=True, ends=ends)
