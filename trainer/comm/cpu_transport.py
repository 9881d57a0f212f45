"""Which transport the cpu backend's all_reduce takes, agreed by all ranks, and why.

Shared memory (``shm_group``) when every rank runs on this host and node and the
machine passes ``shm_group.unsupported_reason``; the TCP ring otherwise. Each rank
publishes its claim through the job store and all read the same values, so every rank
takes the same decision: a single rank that cannot or may not share memory keeps the
whole job on the ring.
"""

from __future__ import annotations

import logging
import time

from rendezvousd.trainer.comm import peer_auth, shm_group
from rendezvousd.trainer.comm.shm_group import SharedMemoryPeers
from rendezvousd.trainer.comm.store import JobStore

__all__ = ["build_shm_group", "shared_memory_plan"]

log = logging.getLogger("rendezvousd.trainer")


def shared_memory_plan(
    store: JobStore,
    rank: int,
    world_size: int,
    node_rank: int | None,
    enabled: bool,
    deadline: float,
) -> SharedMemoryPeers | None:
    """Agree through ``store`` whether every rank shares this host (and node).

    Each rank publishes its host identity and listener name (or nothing when it opts
    out), and all read the same values, so every rank takes the same decision.
    """
    identity = _local_identity(rank, world_size, enabled)
    listener, name = shm_group.create_listener() if identity else (None, "")
    try:
        node = "" if node_rank is None else str(node_rank)
        mine = f"{identity}|{node}|{name}" if identity else ""
        store.kv_set(f"cpu-ring/shm/{rank}", mine.encode())
        entries = []
        for peer in range(world_size):
            remaining = max(0.001, deadline - time.monotonic())
            value = store.kv_get(f"cpu-ring/shm/{peer}", wait=True, timeout=remaining)
            entries.append(value.decode("ascii", "replace").split("|"))
    except BaseException:
        if listener is not None:
            listener.close()
        raise
    together = all(len(e) == 3 and e[:2] == [identity, node] and e[2] for e in entries)
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


def _local_identity(rank: int, world_size: int, enabled: bool) -> str:
    """This rank's host identity if it may share memory, else "" (opting out)."""
    if not enabled or world_size < 2:
        return ""
    # The shared-memory group is correct only where its unfenced hand-off is (x86-64,
    # see shm_group's docstring); anywhere else, e.g. on ARM, it could return wrong sums
    # without an error. Opting out here keeps every rank of the job on the TCP ring.
    reason = shm_group.unsupported_reason()
    if reason is not None:
        log.info("rank %d: all_reduce uses the TCP ring, not shared memory: %s", rank, reason)
        return ""
    return shm_group.host_identity()


def build_shm_group(
    rank: int, world: int, peers: SharedMemoryPeers, secret: bytes, timeout: float
) -> shm_group.ShmGroup:
    """Join this host's group; takes ownership of ``peers.listener``."""
    try:
        key = peer_auth.derive_key(secret)
        return shm_group.ShmGroup(
            rank, range(world), peers.listener, peers.names, key, timeout, peers.slot_bytes
        )
    finally:
        peers.listener.close()
