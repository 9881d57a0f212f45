"""A worker under rendezvous-run whose own calls the daemon refuses for their token:
its calls go on its own channel, as they do once its agent's link is gone or took
none of a call (``client/relay.py``), with a token the daemon never issued, which its
token file holds too (as after the daemon's was rotated while its agent's stream,
opened before, stayed open, and the node's file was not switched: a client reads its
file again when refused, and a file holding the daemon's token would let it through).
Prints what its ``init_distributed`` raised, as a ``refused`` event, and exits 3."""

from __future__ import annotations

import atexit
import dataclasses
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from report import emit

from rendezvousd.trainer.agent.agent_worker import AgentLink
from rendezvousd.trainer.distributed import init_distributed

waiting = AgentLink.wait_assignment


WRONG = "not-the-daemons-token-" + "x" * 20


def wait_assignment(self: AgentLink) -> Any:
    assignment, restored = waiting(self)
    directory = tempfile.mkdtemp()
    atexit.register(shutil.rmtree, directory, True)
    stale = Path(directory) / "token"
    stale.write_text(WRONG + "\n")
    stale.chmod(0o600)
    config = assignment.config
    rendezvous = dataclasses.replace(config.rendezvous, token_file=str(stale))
    config = dataclasses.replace(config, rendezvous=rendezvous)
    return dataclasses.replace(assignment, token=WRONG, config=config), restored


AgentLink.wait_assignment = wait_assignment  # type: ignore[method-assign]
AgentLink.relay = lambda self, client: None  # type: ignore[method-assign]

try:
    init_distributed()
except Exception as exc:
    emit("refused", kind=type(exc).__name__, message=str(exc))
    sys.exit(3)
emit("not refused")
