"""Ending a failed worker so that the daemon blames the right rank.

The daemon records lost members in the order it loses them, and every launcher
reports the first as the job's root cause (``GetJob``). Two orders matter:

- A worker that failed by itself (a corrupt checkpoint, a bug) leaves the
  rendezvous *before* closing its ring connections; closing the ring first lets
  a peer fail on the closed connection and be lost first.
- A worker whose ring connection to a peer broke is most likely the victim of
  that peer's death, which it often notices before the daemon does. It waits,
  bounded, until the daemon has recorded a failure before it drops out itself.
"""

from __future__ import annotations

import time

from rendezvousd.client.errors import RendezvousError
from rendezvousd.trainer.distributed import DistributedContext
from rendezvousd.trainer.errors import CommunicatorAborted, CommunicatorError

# Enough for the daemon to see a dead process's heartbeat stream close; a host
# that vanished silently takes the daemon's heartbeat timeout, which no worker
# should wait out.
PEER_SETTLE_S = 2.0


def close_after_failure(
    ctx: DistributedContext, error: BaseException, *, settle_s: float = PEER_SETTLE_S
) -> None:
    """Drop out of the job after ``error``: rendezvous first, then the communicator."""
    # Aborted: the daemon already told us about a failure, nothing to wait for.
    if isinstance(error, CommunicatorError) and not isinstance(error, CommunicatorAborted):
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline:
            try:
                ctx.rendezvous.raise_if_failed()
            except RendezvousError:
                break
            time.sleep(0.02)  # poll interval while the daemon records the loss
    try:
        ctx.rendezvous.close()
    finally:
        ctx.close(clean=False)
