"""A worker in the documented ``with init_distributed() as ctx:`` form whose rank
RAISER raises a RuntimeError with a multi-line, 5,000-character message after a few
all-reduces; the others all-reduce until their ring breaks. Prints "ready" (rank,
pid) and "reducing" after the first all-reduce."""

from __future__ import annotations

import os
import sys

import numpy as np
from report import emit

from rendezvousd.trainer.distributed import init_distributed

MESSAGE = "line1\nline2" + "x" * 5000


def main() -> int:
    raiser = int(sys.argv[1])
    with init_distributed() as ctx:
        emit("ready", rank=ctx.rank, pid=os.getpid())
        buf = np.ones(1024, dtype=np.float32)
        for step in range(1 << 30):
            ctx.communicator.all_reduce(buf)
            if step == 0:
                emit("reducing")
            if step == 3 and ctx.rank == raiser:
                raise RuntimeError(MESSAGE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
