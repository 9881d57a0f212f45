"""A real training worker for tests: init_distributed, then all-reduce in a loop
until told to stop (a file appears) or a collective fails. Prints JSON lines:
"ready" (rank, node rank, transport, pid), "reducing" after the first all-reduce, then
"done" or "error". ``--ready-only`` (second argument) leaves after "ready"."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
from report import emit

from rendezvousd.client.errors import RendezvousError
from rendezvousd.trainer.distributed import init_distributed
from rendezvousd.trainer.errors import TrainerError


def main() -> int:
    stop = Path(sys.argv[1])
    ctx = init_distributed()
    transport = getattr(ctx.communicator, "transport", None)
    emit(
        "ready",
        rank=ctx.rank,
        node_rank=ctx.topology.node_rank,
        generation=ctx.generation,
        transport=transport,
        env_rank=os.environ.get("RANK"),
        threads=os.environ.get("OMP_NUM_THREADS"),
        pid=os.getpid(),
    )
    if len(sys.argv) > 2 and sys.argv[2] == "--ready-only":
        ctx.close()
        return 0
    buf = np.ones(1 << 20, dtype=np.float32)
    try:
        reduced = 0
        while not stop.exists():
            ctx.communicator.all_reduce(buf)
            buf[:] = 1.0
            reduced += 1
            if reduced == 1:
                # Tests wait for this line instead of sleeping: the loop is running.
                emit("reducing")
        ctx.close()
        emit("done")
        return 0
    except (TrainerError, RendezvousError) as exc:
        emit("error", type=type(exc).__name__, message=str(exc), at=time.time())
        ctx.close(clean=False, error=exc)
        return 3


if __name__ == "__main__":
    sys.exit(main())
