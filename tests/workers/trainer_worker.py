"""A real training worker for tests: init_distributed, then all-reduce in a loop
until told to stop (a file appears) or a collective fails. Prints one JSON line."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from rendezvousd.client.errors import RendezvousError
from rendezvousd.trainer.distributed import init_distributed
from rendezvousd.trainer.errors import TrainerError


def main() -> int:
    stop = Path(sys.argv[1])
    ctx = init_distributed()
    transport = getattr(ctx.communicator, "transport", None)
    print(json.dumps({"event": "ready", "rank": ctx.rank, "transport": transport}), flush=True)
    buf = np.ones(1 << 20, dtype=np.float32)
    try:
        while not stop.exists():
            ctx.communicator.all_reduce(buf)
            buf[:] = 1.0
        ctx.close()
        print(json.dumps({"event": "done"}), flush=True)
        return 0
    except (TrainerError, RendezvousError) as exc:
        print(
            json.dumps(
                {
                    "event": "error",
                    "type": type(exc).__name__,
                    "message": str(exc),
                    "at": time.time(),
                }
            ),
            flush=True,
        )
        ctx.close(clean=False)
        return 3


if __name__ == "__main__":
    sys.exit(main())
