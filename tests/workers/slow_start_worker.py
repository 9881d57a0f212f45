"""A worker under rendezvous-run that is slow to start: ``started`` as its script
begins, ``warm`` once it waits for its assignment (after ``argv[1]`` seconds, as a
cold process on a loaded node would be), then one step's progress and a little
training time (``argv[2]`` seconds) before it exits 0."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from report import emit

from rendezvousd.trainer.agent.agent_worker import AgentLink
from rendezvousd.trainer.distributed import init_distributed

emit("started", pid=os.getpid())
time.sleep(float(sys.argv[1]))
waiting = AgentLink.wait_assignment


def wait_assignment(self: AgentLink) -> Any:
    emit("warm", pid=os.getpid())  # before it tells its agent it is ready
    return waiting(self)


AgentLink.wait_assignment = wait_assignment  # type: ignore[method-assign]

with init_distributed() as ctx:
    ctx.progress(1)
    time.sleep(float(sys.argv[2]))
