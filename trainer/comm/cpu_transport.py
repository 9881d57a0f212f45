"""Which transport the cpu backend's all_reduce takes, agreed by all ranks, and why.

Shared memory (``shm_group``) when every rank runs on this host and node and the
machine passes ``shm_group.unsupported_reason``; the TCP ring otherwise. Each rank
publishes its claim (with its ring address, ``cpu_ring.connect_cpu_ring``) through the
job store and all read the same values, so every rank takes the same decision: a
single rank that cannot or may not share memory keeps the whole job on the ring. A job
known to span several nodes skips the claims altogether (``connect_cpu_ring(nodes=)``).
"""

from __future__ import annotations

import logging
import socket

from rendezvousd.trainer.comm import shm_group
from rendezvousd.trainer.comm.shm_group import SharedMemoryPeers

__all__ = ["local_claim", "shared_memory_plan"]

log = logging.getLogger("rendezvousd.trainer")


def local_claim(
    rank: int, world_size: int, node_rank: int | None, enabled: bool
) -> tuple[socket.socket | None, str]:
    """This rank's listener for the shared-memory group, if it may share memory, and
    its claim to publish: "identity|node|listener name", or "" (it opts out)."""
    if not enabled or world_size < 2:
        return None, ""
    # The shared-memory group is correct only where its unfenced hand-off is (x86-64,
    # see shm_group's docstring); anywhere else, e.g. on ARM, it could return wrong sums
    # without an error. Opting out here keeps every rank of the job on the TCP ring.
    reason = shm_group.unsupported_reason()
    if reason is not None:
        log.info("rank %d: all_reduce uses the TCP ring, not shared memory: %s", rank, reason)
        return None, ""
    identity = shm_group.host_identity()
    if not identity:
        return None, ""  # not Linux: never share memory
    listener, name = shm_group.create_listener()
    node = "" if node_rank is None else str(node_rank)
    return listener, f"{identity}|{node}|{name}"


def shared_memory_plan(
    listener: socket.socket | None, claims: list[str], rank: int
) -> SharedMemoryPeers | None:
    """Whether every rank shares this host (and node), from every rank's claim
    (``local_claim``), read by all alike so that every rank takes the same decision.
    Takes ownership of ``listener``: handed on in the plan, or closed."""
    entries = [claim.split("|") for claim in claims]
    mine = entries[rank]
    together = all(len(e) == 3 and e[:2] == mine[:2] and e[2] for e in entries)
    if listener is None or not together:
        if listener is not None:
            listener.close()
            log.info(
                "rank %d: all_reduce uses the TCP ring: not every rank shares this host "
                "and node, or a rank opted out of shared memory",
                rank,
            )
        return None
    return SharedMemoryPeers(listener, [e[2] for e in entries])
