"""A worker under rendezvous-run that reports step 40 + its local rank to its node
agent (``ctx.progress``), then waits for the file ``argv[1]`` before it exits 0."""

from __future__ import annotations

import os
import sys
import time

from rendezvousd.trainer.distributed import init_distributed

with init_distributed() as ctx:
    ctx.progress(40 + int(os.environ["LOCAL_RANK"]))
    deadline = time.monotonic() + 60
    while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
        time.sleep(0.05)
