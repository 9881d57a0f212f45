"""A worker under rendezvous-run that reports which of this project's modules it
imported after its agent assigned it (from the assignment to a working
communicator and its bucketed all-reducer): none, if the spare imported them
while it waited."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
from report import emit

from rendezvousd.trainer.agent.agent_worker import AgentLink
from rendezvousd.trainer.distributed import init_distributed

waiting = AgentLink.wait_assignment
seen: set[str] = set()


def wait_assignment(self: AgentLink) -> Any:
    assigned = waiting(self)
    seen.update(sys.modules)
    return assigned


AgentLink.wait_assignment = wait_assignment  # type: ignore[method-assign]

with init_distributed() as ctx:
    ctx.reducer([np.zeros(4, dtype=np.float32)])
    late = sorted(m for m in set(sys.modules) - seen if m.startswith("rendezvousd"))
    emit("assigned-imports", rank=ctx.rank, waited=bool(seen), late=late)
