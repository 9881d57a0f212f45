"""A warm spare for the agent-side tests: waits for its assignment over the agent
channel, reports it on stdout as JSON (never the secrets themselves, only their
lengths), sends ``--states`` step states, then exits with ``--exit`` or waits
for an abort frame (``--wait``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

import numpy as np

from rendezvousd.trainer.agent.agent_worker import AgentLink


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--states", type=int, default=0)
    p.add_argument("--exit", type=int, default=0)
    p.add_argument("--wait", action="store_true")
    args = p.parse_args()
    link = AgentLink.from_env(os.environ)
    assert link is not None
    assignment, restored = link.wait_assignment()
    report = {
        "event": "assigned",
        "pid": os.getpid(),
        "rank": assignment.rank,
        "generation": assignment.generation,
        "id_len": len(assignment.unique_id),
        "instance_id_len": len(assignment.instance_id),
        "restored_step": None if restored is None else restored.step,
        "restored_w": None if restored is None else restored.arrays()["w"].tolist(),
        "env_has_fd": "RENDEZVOUSD_AGENT_FD" in os.environ,
    }
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()
    for step in range(1, args.states + 1):
        link.save_state(step, {"w": np.full(3, step, dtype=np.float32)}, {"loss": step / 10})
    aborted = threading.Event()
    link.start(lambda cause: aborted.set())
    if args.wait:
        aborted.wait(30)
    return args.exit


if __name__ == "__main__":
    sys.exit(main())
