"""The state database's -wal file shrinks back once a checkpoint can run again.

A reader that holds a snapshot (an operator's ``sqlite3`` shell in a transaction) keeps
checkpoints from completing, so the WAL grows with every commit; without a
journal_size_limit it then stayed at that size for good."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

from rendezvousd.client import RendezvousClient
from rendezvousd.storage.store_sqlite import WAL_SIZE_LIMIT
from tests.support import DaemonProcess, wait_for

MIB = 1024 * 1024


def test_the_wal_shrinks_after_a_reader_that_held_it_back_goes(
    tmp_path: Path, start_daemon: Callable[..., DaemonProcess]
) -> None:
    state = tmp_path / "state"
    # No heartbeats here: a timeout longer than the test keeps the member.
    d = start_daemon("--state-dir", str(state), "--heartbeat-timeout-s", "60")
    wal = state / "state.db-wal"
    value = b"x" * (32 * 1024)  # the default largest value
    with RendezvousClient(d.endpoint, "w", token=d.token) as c:
        c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        reader = sqlite3.connect(state / "state.db", isolation_level=None)
        try:
            reader.execute("BEGIN")
            reader.execute("SELECT count(*) FROM kv").fetchone()  # holds its snapshot
            n = 0
            while wal.stat().st_size < 3 * WAL_SIZE_LIMIT:
                c.kv_set(f"k{n % 64}", value)
                n += 1
            high = wal.stat().st_size
        finally:
            reader.execute("COMMIT")
            reader.close()

        def shrunk() -> bool:
            c.kv_set("after", value)  # a commit: checkpoints, then restarts the WAL
            return wal.stat().st_size <= WAL_SIZE_LIMIT

        wait_for(f"the -wal file ({high / MIB:.1f} MiB) to shrink", shrunk, timeout=5)
        assert c.kv_get("k0", wait=False) == value  # nothing lost in the checkpoint
