"""Two ranks all-reducing step after step until the file named by argv[1] exists (said
through the all-reduce itself, so both ranks stop at the same step), while the test
stops one of them (SIGSTOP) and lets it go on (SIGCONT): a gray failure, a peer alive
to the kernel and the daemon but sending nothing.

Events: ``ready`` (rank, pid, transport) after the first step; ``done`` (rank, steps).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
from report import emit

from rendezvousd.trainer.distributed import init_distributed


def main() -> int:
    stop = Path(sys.argv[1])
    with init_distributed() as ctx:
        comm = ctx.communicator
        step = 0
        while True:
            step += 1
            flags = np.array([float(stop.exists()), 1.0])
            comm.all_reduce(flags)
            assert flags[1] == comm.world_size, flags
            ctx.progress(step)
            if step == 1:
                emit("ready", rank=comm.rank, pid=os.getpid(), transport=comm.transport)
            if flags[0]:
                break
        emit("done", rank=comm.rank, steps=step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
