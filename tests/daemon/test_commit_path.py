"""Where a group commit's work runs, and what it writes.

The daemon's event loop is busy whenever there is load. Python's sqlite3 lets go of
the GIL around every statement and every row, and a thread that wants it back waits
out the busy thread's switch interval (5 ms) each time: a commit of 256 KV rows run on
the writer thread took 1.5 s next to a busy loop instead of 2 ms. So the transaction
runs on the loop, and the writer thread only makes it durable (an fsync of the -wal
file). These tests drive a real Persister and SQLite database from a real event loop
and record, per statement and per fsync, the thread that ran it.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest

from rendezvousd.state.machine import JoinArgs, RendezvousState
from rendezvousd.storage import store_sqlite
from rendezvousd.storage.persistence import Persister

ID = b"\x07" * 128


def _running_job(ranks: int) -> RendezvousState:
    sm = RendezvousState()
    for rank in range(ranks):
        sm.join(
            JoinArgs.worker("j", 1, ranks, 0, rank, "h", "", ID if rank == 0 else b"", f"i{rank}"),
            0.0,
        )
    return sm


class _Trace:
    """Each SQL statement and each fsync, with the name of the thread that ran it."""

    def __init__(self, persister: Persister, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, str]] = []
        assert persister.store is not None
        db = persister.store._conn()
        db.set_trace_callback(
            lambda sql: self.events.append((threading.current_thread().name, sql))
        )
        real_fsync = os.fsync

        def fsync(fd: int) -> None:
            target = os.readlink(f"/proc/self/fd/{fd}")
            self.events.append((threading.current_thread().name, f"fsync {target}"))
            real_fsync(fd)

        monkeypatch.setattr(store_sqlite.os, "fsync", fsync)

    def clear(self) -> None:
        self.events.clear()

    def on(self, thread_prefix: str) -> list[str]:
        return [what for who, what in self.events if who.startswith(thread_prefix)]


def _kv_sets(persister: Persister, keys: int) -> None:
    """What the servicer does for ``keys`` KvSets of rank 0, before their commit."""
    sm = persister.state
    for n in range(keys):
        persister.before_kv("j", f"k{n}")
        sm.kv_set("j", 1, 0, f"k{n}", bytes([n % 256]) * 64, instance_id="i0")
        persister.touch("j", f"k{n}")


def _commit(persister: Persister) -> None:
    async def main() -> None:
        await persister.durable("j")

    asyncio.run(main())


def _query(persister: Persister, sql: str) -> Any:
    """One row, read through a connection of its own (as the next start would)."""
    db = sqlite3.connect(persister.store.path)
    try:
        return db.execute(sql).fetchone()
    finally:
        db.close()


@pytest.fixture
def persisted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A running job of 8 ranks, committed; then every statement and fsync traced."""
    tmp_path.chmod(0o700)
    sm = _running_job(8)
    persister = Persister(tmp_path, sm)
    persister.restore()
    try:
        yield sm, persister, _Trace(persister, monkeypatch)
    finally:
        persister.close()


def test_the_transaction_runs_on_the_event_loop_and_the_writer_thread_only_fsyncs_the_wal(
    persisted: Any,
) -> None:
    _, persister, trace = persisted
    _kv_sets(persister, 256)
    _commit(persister)
    loop_sql = trace.on("MainThread")
    assert sum(s.startswith("INSERT OR REPLACE INTO kv") for s in loop_sql) == 256
    assert "BEGIN IMMEDIATE" in loop_sql and loop_sql[-1] == "COMMIT"
    # The writer thread touched no row: one fsync of the -wal file, after the COMMIT.
    assert trace.on("state-writer") == [f"fsync {persister.store.path}-wal"]
    assert _query(persister, "SELECT count(*) FROM kv WHERE job_id='j'") == (256,)


def test_a_change_of_kv_alone_leaves_the_jobs_row_as_it_was(
    persisted: Any,
) -> None:
    sm, persister, trace = persisted
    _kv_sets(persister, 3)
    _commit(persister)
    assert not [s for s in trace.on("") if "INTO jobs" in s]
    # A barrier round completes: the row (which records completed rounds) is written.
    trace.clear()
    for rank in range(8):
        sm.barrier("j", 1, rank, "b", 1, 0.0, instance_id=f"i{rank}")
    persister.touch("j")
    _commit(persister)
    assert [s for s in trace.on("MainThread") if s.startswith("INSERT OR REPLACE INTO jobs")]
    (detail,) = _query(persister, "SELECT detail FROM jobs WHERE job_id='j'")
    assert '"barriers": {"b": 1}' in detail


def test_a_write_lock_held_elsewhere_is_waited_for_on_the_writer_thread_not_the_loop(
    persisted: Any,
) -> None:
    _, persister, trace = persisted
    locker = sqlite3.connect(persister.store.path, isolation_level=None)
    locker.execute("BEGIN IMMEDIATE")
    _kv_sets(persister, 2)
    ticks = 0

    async def main() -> None:
        nonlocal ticks
        commit = asyncio.ensure_future(persister.durable("j"))
        await asyncio.sleep(0.3)  # the loop runs on while the writer waits for the lock
        ticks = 1
        assert not commit.done()
        locker.execute("COMMIT")
        await commit

    asyncio.run(main())
    locker.close()
    assert ticks == 1
    # The loop tried once without waiting; the writer thread then did the whole commit.
    writer = trace.on("state-writer")
    assert sum(s.startswith("INSERT OR REPLACE INTO kv") for s in writer) == 2
    assert writer[-1] == f"fsync {persister.store.path}-wal"
    assert not [s for s in trace.on("MainThread") if s.startswith("INSERT")]


async def _durable_kv_set(persister: Persister, n: int, done: list[int]) -> None:
    """What the servicer does for one KvSet of rank 0, until it is answered (``done``)."""
    persister.before_kv("j", f"k{n}")
    persister.state.kv_set("j", 1, 0, f"k{n}", b"v", instance_id="i0")
    persister.touch("j", f"k{n}")
    await persister.durable("j")
    done.append(n)


def test_changes_made_in_one_loop_pass_share_one_commit(persisted: Any) -> None:
    """The group commit waits one loop pass before its cut: 8 KvSets whose handlers
    run in the same pass (one CallBatch of a node's workers) are one commit, one fsync,
    and are all answered when it is durable (the first no longer goes alone)."""
    _, persister, trace = persisted
    done: list[int] = []

    async def main() -> None:
        await asyncio.gather(*(_durable_kv_set(persister, n, done) for n in range(8)))

    asyncio.run(main())
    assert sorted(done) == list(range(8))
    assert trace.on("state-writer") == [f"fsync {persister.store.path}-wal"]
    assert _query(persister, "SELECT count(*) FROM kv WHERE job_id='j'") == (8,)


def test_the_waiters_of_a_commit_all_wake_with_it(persisted: Any) -> None:
    """64 KvSets wait for one group commit: all are answered within a loop pass or two
    of it, not one pass each (waiters queued on a lock, taken in turn only to find
    their change committed: ~50 ms for a burst of 256 on a busy daemon)."""
    _, persister, _ = persisted
    passes = 0
    answered: list[int] = []
    answered_at: list[int] = []

    async def ticker(stop: asyncio.Event) -> None:
        nonlocal passes
        while not stop.is_set():
            await asyncio.sleep(0)
            passes += 1
            answered_at.extend([passes] * (len(answered) - len(answered_at)))

    async def main() -> None:
        stop = asyncio.Event()
        ticking = asyncio.create_task(ticker(stop))
        await asyncio.gather(*(_durable_kv_set(persister, n, answered) for n in range(64)))
        stop.set()
        await ticking

    asyncio.run(main())
    assert len(answered_at) == 64
    assert max(answered_at) - min(answered_at) <= 2, answered_at
