"""A worker under rendezvous-run whose own calls the daemon refuses for their token:
its calls go on its own channel, as they do once its agent's link is gone or took
none of a call (``client/relay.py``), with a token the daemon never issued (as after
the daemon's was rotated while its agent's stream, opened before, stayed open).
Prints what its ``init_distributed`` raised, as a ``refused`` event, and exits 3."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from report import emit

from rendezvousd.trainer.agent.agent_worker import AgentLink
from rendezvousd.trainer.distributed import init_distributed

waiting = AgentLink.wait_assignment


def wait_assignment(self: AgentLink) -> Any:
    assignment, restored = waiting(self)
    return dataclasses.replace(assignment, token="not-the-daemons-token-" + "x" * 20), restored


AgentLink.wait_assignment = wait_assignment  # type: ignore[method-assign]
AgentLink.relay = lambda self, client: None  # type: ignore[method-assign]

try:
    init_distributed()
except Exception as exc:
    emit("refused", kind=type(exc).__name__, message=str(exc))
    sys.exit(3)
emit("not refused")
