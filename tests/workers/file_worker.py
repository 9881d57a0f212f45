"""One worker process for tests/client/test_file_transport.py.

Usage: ``python file_worker.py '<json config>'``. The test drives it through
stdin: rank 0 may read its id there as hex (a pipe, never a file), and a worker
waits there for a "go" line wherever the test needs to order the ranks. Reports
one JSON object per line on stdout, with the id only as a SHA-256 so that files
can be scanned for leaks, and times from the system-wide monotonic clock.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from typing import Any

from report import emit, joined

from rendezvousd.client.errors import RendezvousError
from rendezvousd.client.transport import FileRendezvous, connect


def wait_for_test() -> None:
    sys.stdin.readline()


def error_fields(exc: RendezvousError) -> dict[str, Any]:
    return {"kind": type(exc).__name__, "message": exc.message, "ranks": exc.metadata.get("ranks")}


def main() -> None:
    cfg: dict[str, Any] = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
    rank, mode = int(cfg["local_rank"]), str(cfg["mode"])
    unique_id = bytes.fromhex(sys.stdin.readline().strip()) if cfg.get("id_on_stdin") else None
    rv = connect("file", path=cfg["path"], job_id=cfg["job_id"])
    assert isinstance(rv, FileRendezvous)
    with rv:
        try:
            m = rv.join(
                num_nodes=1,
                gpus_per_node=int(cfg["gpus_per_node"]),
                local_rank=rank,
                unique_id=unique_id,
                timeout=float(cfg.get("timeout", 30.0)),
            )
        except RendezvousError as exc:
            emit("join_error", **error_fields(exc))
            return
        joined(
            m,
            members=[[p.rank, p.node_rank, p.local_rank, p.host] for p in m.members],
            daemon_pid=rv.daemon.proc.pid if rv.daemon else None,
        )
        if mode == "roundtrip":
            roundtrip(rv, m.rank, m.world_size)
        elif mode == "hold":
            hold(rv)
        elif mode == "victim":
            if cfg.get("heartbeat"):
                rv.start_heartbeat(0.2)
            wait_for_test()  # killed while blocked here
        emit("done")


def roundtrip(rv: FileRendezvous, rank: int, world: int) -> None:
    # Rank 0 enters the barrier, and sets "late", only once the test has seen
    # every other rank start waiting for it.
    if rank == 0:
        wait_for_test()
    emit("barrier_enter")
    rv.barrier("slow", timeout=30.0)
    emit("barrier_pass")
    rv.kv_set(f"from/{rank}", f"value-{rank}".encode())
    if rank == 0:
        wait_for_test()
        emit("kv_set_late")
        rv.kv_set("late", b"\x00\xffpayload")
    else:
        emit("kv_ask_late")
    late = rv.kv_get("late", wait=True, timeout=30.0)
    values = {str(r): rv.kv_get(f"from/{r}", timeout=30.0).decode() for r in range(world)}
    emit("kv", values=values, late=late.hex())
    rv.barrier("end", timeout=30.0)


def hold(rv: FileRendezvous) -> None:
    seen: list[RendezvousError] = []
    called = threading.Event()

    def on_failure(exc: RendezvousError) -> None:
        seen.append(exc)
        called.set()

    rv.start_heartbeat(0.2, on_failure)
    emit("holding")
    started = time.monotonic()
    try:
        rv.barrier("after", timeout=30.0)  # the victim never arrives
        emit("barrier_passed")
    except RendezvousError as exc:
        emit("barrier_error", after=time.monotonic() - started, **error_fields(exc))
    if called.wait(10.0):
        emit("callback", **error_fields(seen[0]))
    else:
        emit("no_callback")
    wait_for_test()  # rank 0 must not take its daemon away while others still ask it


if __name__ == "__main__":
    main()
