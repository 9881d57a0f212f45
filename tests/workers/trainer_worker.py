"""A real training worker for tests: init_distributed, then all-reduce in a loop
until told to stop (a file appears) or a collective fails. Prints JSON lines:
"ready" (rank, node rank, transport, pid), "reducing" after the first all-reduce, then
"done" or "error". ``--ready-only`` (second argument) leaves after "ready"."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from rendezvousd.client.errors import RendezvousError
from rendezvousd.trainer.distributed import init_distributed
from rendezvousd.trainer.errors import TrainerError


def emit(event: dict[str, object]) -> None:
    # One write per line: the workers of a node share the launcher's stdout, and
    # print()'s separate newline write could interleave with a sibling's line.
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def main() -> int:
    stop = Path(sys.argv[1])
    ctx = init_distributed()
    transport = getattr(ctx.communicator, "transport", None)
    ready = {
        "event": "ready",
        "rank": ctx.rank,
        "node_rank": ctx.topology.node_rank,
        "transport": transport,
        "env_rank": os.environ.get("RANK"),
        "pid": os.getpid(),
    }
    emit(ready)
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
                emit({"event": "reducing"})
        ctx.close()
        emit({"event": "done"})
        return 0
    except (TrainerError, RendezvousError) as exc:
        emit({"event": "error", "type": type(exc).__name__, "message": str(exc), "at": time.time()})
        ctx.close(clean=False, error=exc)
        return 3


if __name__ == "__main__":
    sys.exit(main())
