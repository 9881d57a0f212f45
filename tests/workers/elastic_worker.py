"""A worker for the agent's recovery tests (started by rendezvous-run): all-reduces
for ``--steps`` steps, handing each step to the agent, and prints JSON lines
"ready" (rank, generation, restart count, world, pid, torchrun env) and "done".
Faults: ``--exit-rank R`` exits 3 at ``--fault-step`` (in the first generation
only, or always with ``--always``); ``--hang-rank R`` stops making progress
there; ``--exit-ranks`` / ``--hang`` act on the first generation unless
``--always``. ``--hurry-file F``: once F exists, steps no longer sleep ``--step-s``."""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import numpy as np
from report import emit

from rendezvousd.trainer.agent.state_copy import NOTHING, agree_on_step
from rendezvousd.trainer.distributed import init_distributed


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--step-s", type=float, default=0.02, help="pretend compute per step")
    p.add_argument("--exit-rank", type=int, default=-1)
    p.add_argument("--hang-rank", type=int, default=-1)
    p.add_argument("--fault-step", type=int, default=3)
    p.add_argument("--always", action="store_true")
    p.add_argument("--state-mib", type=int, default=0, help="extra state saved each step")
    # A test's job trains long enough to still run when what it waits for happens on a
    # loaded machine; once that happened, the rest of its steps prove nothing more by
    # their pace, and the test touches this file to have them run (still all-reduced,
    # saved and reported) without the pretend compute.
    p.add_argument("--hurry-file", default="")
    args = p.parse_args()
    ctx = init_distributed()
    emit(
        "ready",
        rank=ctx.rank,
        generation=ctx.generation,
        restart_count=ctx.restart_count,
        world_size=ctx.world_size,
        pid=os.getpid(),
        env_rank=os.environ.get("RANK"),
        restored=None if ctx.restored is None else ctx.restored.step,
    )
    faulty = args.always or ctx.restart_count == 0
    buf = np.ones(4, dtype=np.float64)
    extra = np.zeros(args.state_mib << 20, dtype=np.uint8)
    offered = NOTHING if ctx.restored is None else ctx.restored.step
    start, _root = agree_on_step(ctx.communicator, offered)
    start = max(start, 0)
    emit("resumed", rank=ctx.rank, step=start, generation=ctx.generation)
    for step in range(start, args.steps):
        if faulty and step == args.fault_step and ctx.rank == args.exit_rank:
            return 3
        if faulty and step == args.fault_step and ctx.rank == args.hang_rank:
            threading.Event().wait(60)  # hung: alive, but no progress
        ctx.communicator.all_reduce(buf)
        buf[:] = 1.0
        ctx.save_state(step + 1, {"buf": buf, "extra": extra})
        if (step + 1) % 5 == 0:
            emit("step", rank=ctx.rank, step=step + 1)
        if not (args.hurry_file and os.path.exists(args.hurry_file)):
            time.sleep(args.step_s)  # stands in for the step's compute
    emit("done", rank=ctx.rank, world_size=ctx.world_size)
    ctx.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
