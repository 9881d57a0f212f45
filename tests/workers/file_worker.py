"""One worker process for tests/test_file_transport.py.

Usage: ``python file_worker.py '<json config>'``; rank 0 may read its id as hex
on stdin (a pipe, never a file), and any worker may wait there for a "go" line. Reports one JSON object per line on stdout,
with the id only as a SHA-256 so the logs can be scanned for leaks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import threading
import time
from typing import Any

from rendezvousd.client.errors import RendezvousError
from rendezvousd.client.file_transport import FileRendezvous


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def error_fields(exc: RendezvousError) -> dict[str, Any]:
    return {"kind": type(exc).__name__, "message": exc.message, "ranks": exc.metadata.get("ranks")}


def main() -> None:
    cfg: dict[str, Any] = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
    rank, mode = int(cfg["local_rank"]), str(cfg["mode"])
    unique_id = bytes.fromhex(sys.stdin.readline().strip()) if cfg.get("id_on_stdin") else None
    with FileRendezvous(cfg["path"], cfg.get("job_id", "")) as rv:
        try:
            m = rv.join(
                num_nodes=int(cfg.get("num_nodes", 1)),
                gpus_per_node=int(cfg["gpus_per_node"]),
                local_rank=rank,
                unique_id=unique_id,
                timeout=float(cfg.get("timeout", 20.0)),
            )
        except RendezvousError as exc:
            emit(event="join_error", **error_fields(exc))
            return
        emit(
            event="joined",
            rank=m.rank,
            world_size=m.world_size,
            generation=m.generation,
            id_sha256=hashlib.sha256(m.unique_id).hexdigest(),
            id_len=len(m.unique_id),
            members=[[p.rank, p.node_rank, p.local_rank, p.host] for p in m.members],
        )
        if cfg.get("wait_for_go"):
            sys.stdin.readline()  # the test says when the world may move on
        if mode == "roundtrip":
            roundtrip(rv, m.rank, m.world_size)
        elif mode == "join":
            rv.barrier("joined", timeout=20.0)
        elif mode == "hold":
            hold(rv)
        elif mode == "victim":
            time.sleep(60.0)  # until the test kills us
        emit(event="done")


def roundtrip(rv: FileRendezvous, rank: int, world: int) -> None:
    # Rank 0 arrives late, so the others' barrier must really wait for it.
    if rank == 0:
        time.sleep(0.5)
    started = time.monotonic()
    rv.barrier("slow", timeout=20.0)
    emit(event="barrier", waited=time.monotonic() - started)
    rv.kv_set(f"from/{rank}", f"value-{rank}".encode())
    # Set only after a pause, so every other rank is already waiting for it.
    if rank == 0:
        time.sleep(0.3)
        rv.kv_set("late", b"\x00\xffpayload")
    values = {str(r): rv.kv_get(f"from/{r}", timeout=20.0).decode() for r in range(world)}
    late = rv.kv_get("late", wait=True, timeout=20.0)
    emit(event="kv", values=values, late=late.hex())
    rv.barrier("end", timeout=20.0)


def hold(rv: FileRendezvous) -> None:
    seen: list[RendezvousError] = []
    called = threading.Event()

    def on_failure(exc: RendezvousError) -> None:
        seen.append(exc)
        called.set()

    rv.start_heartbeat(0.1, on_failure)
    started = time.monotonic()
    try:
        rv.barrier("after", timeout=30.0)  # the victim never arrives
        emit(event="barrier_passed")
    except RendezvousError as exc:
        emit(event="barrier_error", after=time.monotonic() - started, **error_fields(exc))
    if called.wait(10.0):
        emit(event="callback", **error_fields(seen[0]))
    else:
        emit(event="no_callback")


if __name__ == "__main__":
    main()
