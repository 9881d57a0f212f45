"""What the communicator contract suite (tests/contract) asserts through threads and a
fake NCCL, here with ranks as processes under ``rendezvous-run`` on any backend:
scripts/gpu_check.sh runs it on the real NCCL (2 ranks on one GPU), and
tests/trainer/test_launcher.py on the CPU ring.

* A broadcast whose ranks disagree on the root fails on every rank at once (not at
  the collective timeout) with an error naming the root, and the communicator stays
  usable (nothing was sent): a broadcast after it gives every rank the root's data.
* An integer AVG divides towards zero: -7 over 2 ranks is -3, not numpy's -4.

Emits one JSON line (``report.emit``) with what it saw; exits 1 when either does not hold.
"""

from __future__ import annotations

import sys
import time

from report import emit  # this folder's: one write per line, never interleaved

from rendezvousd.trainer import ReduceOp
from rendezvousd.trainer.comm.devices import array_module
from rendezvousd.trainer.distributed import init_distributed
from rendezvousd.trainer.errors import CommunicatorError, CommunicatorTimeout

with init_distributed() as ctx:
    comm, rank, world = ctx.communicator, ctx.topology.rank, ctx.topology.world_size
    xp = array_module(ctx.config.backend)
    values = [-(3 + r) for r in range(world)]  # -3, -4: a sum of -7 at world 2
    total = sum(values)
    want = -(-total // world) if total < 0 else total // world  # towards zero
    averaged = xp.full(3, values[rank], dtype=xp.int32)
    comm.all_reduce(averaged, ReduceOp.AVG)
    got = [int(v) for v in (averaged.get() if hasattr(averaged, "get") else averaged)]

    started = time.monotonic()
    try:
        comm.broadcast(xp.ones(4, dtype=xp.float32), root=rank % world)
        told, timed_out = "", False
    except CommunicatorError as exc:
        told, timed_out = str(exc), isinstance(exc, CommunicatorTimeout)
    took = time.monotonic() - started

    after = xp.full(2, 10 + rank, dtype=xp.int64)
    try:
        comm.broadcast(after, root=world - 1)
        went_on = [int(v) for v in (after.get() if hasattr(after, "get") else after)]
    except CommunicatorError as exc:
        went_on = [str(exc)[:200]]

    ok = got == [want] * 3 and "root" in told and not timed_out and took < 10
    ok = ok and went_on == [10 + world - 1] * 2
    emit(
        "semantics",
        rank=rank,
        backend=ctx.config.backend,
        avg=got,
        avg_wanted=want,
        broadcast_error=told[:300],
        broadcast_s=round(took, 3),
        after=went_on,
        ok=ok,
    )
    if not ok:
        sys.exit(1)
