"""torch_worker.py's rendezvous side without torch: the same arguments and step lines,
its rank, world and restart count read from the variables torchrun sets (RANK,
WORLD_SIZE, TORCHELASTIC_RESTART_COUNT, MASTER_PORT), and no collective.

For torchrun tests whose assertions are about the rendezvous (ranks, worlds, restarts,
what the agents say, exit codes) and whose workers hang (``--hang-after``) where a
collective with a lost peer would: importing torch in every worker was most of those
tests' CPU (~1.3 s a worker, 6-10 workers a test). A test that asserts torch trains
across the world it formed keeps torch_worker.py. Not for a test in which a peer's
death must fail a survivor's worker: with no collective, nothing here notices it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from types import FrameType

WARM = "torch" in sys.modules


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--step-log", required=True)
    p.add_argument("--hang-after", type=int, default=-1)
    p.add_argument("--hang-world", type=int, default=0)
    # Each rank alone: torch_worker.py agrees on it with a collective only so that no
    # rank leaves a peer's all_reduce without a partner, and there is none here.
    p.add_argument("--stop-file", default="")
    p.add_argument("--stop-delay", type=float, default=0.0)
    p.add_argument("--hurry-file", default="")
    a = p.parse_args()
    if a.stop_delay:

        def slow_stop(signum: int, frame: FrameType | None) -> None:
            time.sleep(a.stop_delay)
            raise SystemExit(128 + signum)

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, slow_stop)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for step in range(1, a.steps + 1):
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
        if a.stop_file and os.path.exists(a.stop_file):
            break
        if not (a.hurry_file and os.path.exists(a.hurry_file)):
            time.sleep(a.step_sleep)
    print(
        json.dumps({"event": "done", "rank": rank, "world": world, "restart": restart}), flush=True
    )


if __name__ == "__main__":
    main()
