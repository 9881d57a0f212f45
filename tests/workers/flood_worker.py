"""A worker that floods its node agent with relayed daemon calls (raw ``call`` frames
of a GetJob) and never reads a reply: only the agent's bound on replies unread can
end it (it keeps its alive beats going, so it is not silent)."""

from __future__ import annotations

import os
import sys
import threading

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.trainer.agent.agent_worker import AgentLink

link = AgentLink.from_env(os.environ)
assert link is not None
assignment, _ = link.wait_assignment()


def beat() -> None:
    while True:
        link.channel.send("alive")
        threading.Event().wait(0.5)


threading.Thread(target=beat, daemon=True).start()
get_job = pb.GetJobRequest(job_id=assignment.job_id)
for i in range(1, 200_000):
    call = pb.Call(id=i, timeout_ms=30_000, get_job=get_job)
    link.channel.send("call", None, call.SerializeToString())
threading.Event().wait(60)
sys.exit(3)
