"""A worker whose node's state copy a wild step would pin (``--mode``), on a node of
two workers run with ``--max-restarts 2``. Generation 1's local rank 0 saves steps 5
and 6 and fails; then:

- ``restart``: generation 2's fresh local rank 0 saves step 2**52 as its first state
  and fails; generation 3 prints what each worker is handed back;
- ``other``: in generation 1, local rank 1 writes a raw state frame of step 2**53-1
  (``save_state`` sends only from local rank 0); generation 2 prints what it gets.

A failing worker waits, before it fails, for the file ``--marker`` names: written
once every state of its generation was sent (the agent reads them before it learns
of the exit, which comes after).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

from rendezvousd.trainer.agent.agent_channel import pack_arrays
from rendezvousd.trainer.agent.agent_worker import AgentLink


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["restart", "other"], required=True)
    p.add_argument("--marker", type=Path, required=True)
    args = p.parse_args()
    link = AgentLink.from_env(os.environ)
    assert link is not None
    assignment, restored = link.wait_assignment()
    stopped = threading.Event()
    link.start(lambda cause: stopped.set())
    last = 2 if args.mode == "other" else 3
    gen, local = assignment.generation, assignment.local_rank
    if gen < last:
        sent = args.marker.parent / f"{args.marker.name}.{gen}"
        if local == 1:
            if args.mode == "other":
                entries, payload = pack_arrays({"w": np.full(2, 666.0)})
                header = {"step": (1 << 53) - 1, "meta": {"who": "rank1"}, "arrays": entries}
                link.channel.send("state", header, payload, within=10)
            sent.touch()
            stopped.wait(30)
            return 3
        if gen == 1:
            for step in (5, 6):
                link.save_state(step, {"w": np.full(2, float(step))}, {"who": "rank0"})
        else:
            link.save_state(1 << 52, {"w": np.full(2, 777.0)}, {"who": "wild"})
        deadline = time.monotonic() + 20
        while not sent.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the agent's reader takes rank 1's frame, already sent
        return 1
    step = None if restored is None else restored.step
    meta = None if restored is None else restored.meta
    print(f"GEN {gen} local_rank {local} restored step {step} meta {meta}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
