"""A worker under rendezvous-run on the nccl backend of a fake GPU whose NCCL spans
processes without moving a byte (tests/trainer/fake_cupy, not solo: a collective
completes at once on each rank). As real NCCL's sockets, its traffic is invisible to
rendezvousd: only the node agents' own links can tell that two nodes no longer reach
each other. It all-reduces and reports a step every 20 ms until it is stopped."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.trainer import fake_cupy

fake = fake_cupy.make_cupy(devices=1)

from rendezvousd.trainer.comm import nccl  # noqa: E402

nccl._import_cupy = lambda: fake

from rendezvousd.trainer.distributed import init_distributed  # noqa: E402

with init_distributed() as ctx:
    gradient = fake_cupy.device_array(fake, [1.0, 2.0, 3.0])
    step = 0
    while True:
        ctx.communicator.all_reduce(gradient)
        step += 1
        ctx.progress(step)
        time.sleep(0.02)
