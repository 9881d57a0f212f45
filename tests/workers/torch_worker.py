"""A stock torchrun training script: ``init_process_group("gloo")`` from the environment
torchrun sets, then steps of one all-reduce each. Nothing in it knows rendezvousd.
``--backend nccl`` all-reduces on GPU 0 instead, every rank its own NCCL host (as
devices.prepare_nccl does for rendezvous-run): world > 1 on a machine with one GPU.

    torchrun ... tests/workers/torch_worker.py --steps 20 --step-log steps.jsonl

Each step appends one line to ``--step-log`` (rank, world, restart count, step, wall
time, pid, and ``warm``: torch was already imported when the script started, as in a
worker forked by ``rendezvous-python``'s warm server), which tests and benchmarks/recovery.py read. ``--hang-after K`` makes every
worker of a world of ``--hang-world`` ranks sleep after step K, as if stuck in a
collective whose peer is gone: only its agent can get it out (by restarting it).
``--stop-file F`` ends the run after the first step that finds F; once ``--hurry-file
F`` exists, steps no longer sleep ``--step-sleep``. ``--stop-delay S``
makes a worker take S seconds to exit when signalled (SIGINT, SIGTERM), as one that
writes a checkpoint on preemption does. The last line on stdout is a "done" event.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from types import FrameType

WARM = "torch" in sys.modules  # before this script's own import of it

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--step-log", required=True)
    p.add_argument("--hang-after", type=int, default=-1)
    p.add_argument("--hang-world", type=int, default=0)
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    # Ends the run (as if its steps were done) at the first step after this file exists.
    p.add_argument("--stop-file", default="")
    p.add_argument("--stop-delay", type=float, default=0.0)
    # Steps pace a run long enough to outlast what a test waits for on a loaded machine;
    # once that happened the test touches this file, and the steps left (all-reduced and
    # logged as before) run without the pause. Each rank alone: no collective depends on it.
    p.add_argument("--hurry-file", default="")
    a = p.parse_args()
    if a.stop_delay:

        def slow_stop(signum: int, frame: FrameType | None) -> None:
            time.sleep(a.stop_delay)
            raise SystemExit(128 + signum)

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, slow_stop)
    device = torch.device("cpu")
    if a.backend == "nccl":
        # Stock NCCL refuses two ranks on one GPU unless they are told they are hosts apart.
        os.environ["NCCL_HOSTID"] = f"torch-worker-{os.environ['RANK']}"
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_IB_DISABLE", "1")
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    dist.init_process_group(a.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for step in range(1, a.steps + 1):
        t = torch.ones(4, device=device) * (rank + 1)
        dist.all_reduce(t)
        # Every rank must see the sum over the whole world: 1 + 2 + ... + world.
        assert t[0].item() == world * (world + 1) / 2, (t, world)
        line = {
            "rank": rank,
            "world": world,
            "restart": restart,
            "step": step,
            "t": time.time(),
            "pid": os.getpid(),
            "warm": WARM,
            "master_port": int(os.environ["MASTER_PORT"]),
        }
        with open(a.step_log, "a") as fh:
            fh.write(json.dumps(line) + "\n")
        if step == a.hang_after and world == a.hang_world:
            time.sleep(3600)
        if a.stop_file:
            # Agreed, not looked at by each rank alone: a rank that saw the file a step
            # before its peer left that peer's next all_reduce without a partner
            # ("Connection closed by peer"), failing the run the test ends.
            stop = torch.tensor([float(os.path.exists(a.stop_file))], device=device)
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item():
                break
        if not (a.hurry_file and os.path.exists(a.hurry_file)):
            time.sleep(a.step_sleep)
    dist.destroy_process_group()
    print(
        json.dumps({"event": "done", "rank": rank, "world": world, "restart": restart}), flush=True
    )


if __name__ == "__main__":
    main()
