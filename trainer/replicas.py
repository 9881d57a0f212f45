"""Whether every rank's parameter replica is still the same bytes.

Data-parallel ranks must hold bit-identical parameters after every step. Nothing
in the all-reduce can see a rank that averaged the wrong tensors: two gradients
of one shape registered in another order on one rank pass ``verify_layout`` (its
fingerprint is of shapes and dtypes, as DDP's is), and the ranks then drift apart
silently. Comparing a digest of the parameters across ranks, now and then (the
example does at each checkpoint), names the ranks that drifted.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from rendezvousd.trainer.comm import devices
from rendezvousd.trainer.comm.communicator import Communicator, ReduceOp
from rendezvousd.trainer.errors import ReplicasDiverged

# Ranks named one by one in the error; the rest are counted.
_NAMED = 8


def replica_digest(arrays: Mapping[str, Any]) -> int:
    """A 56-bit digest of ``arrays``' names, dtypes, shapes and host bytes (positive,
    so that it fits an int64 all-reduce whatever the backend)."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        host = np.ascontiguousarray(devices.to_host(arrays[name]))
        digest.update(f"{name}\0{host.dtype.str}\0{host.shape}\0".encode())
        digest.update(host.tobytes())
    return int.from_bytes(digest.digest()[:7], "big")


def check_replicas(
    comm: Communicator, arrays: Mapping[str, Any], xp: Any = np, *, what: str = "parameters"
) -> None:
    """Compare ``arrays``' digest across all ranks (every rank must call it, outside a
    reducer's step: one all-reduce of ``world_size`` integers). ``ReplicasDiverged``
    on every rank, naming the ranks that differ from the most common replica (ties:
    rank 0's), when they are not all equal."""
    world = comm.world_size
    slots = xp.zeros(world, dtype=np.int64)
    slots[comm.rank] = replica_digest(arrays)
    # One slot per rank, set only by that rank: a sum gathers every rank's digest.
    comm.all_reduce(slots, ReduceOp.SUM)
    digests = [int(v) for v in devices.to_host(slots)]
    if len(set(digests)) == 1:
        return
    counts: dict[int, int] = {}
    for d in digests:
        counts[d] = counts.get(d, 0) + 1
    common = max(counts, key=lambda d: (counts[d], d == digests[0]))
    odd = [r for r, d in enumerate(digests) if d != common]
    agree = [r for r, d in enumerate(digests) if d == common]
    raise ReplicasDiverged(
        f"the {what} of rank(s) {_ranks(odd)} differ from those of rank(s) {_ranks(agree)} "
        f"(of {world}): the replicas drifted apart, so a rank averaged other gradients "
        "than its peers (e.g. two gradients of one shape registered in another order, "
        "which verify_layout cannot see) or changed its copy alone; fix the registration "
        "order and resume from a checkpoint saved before they drifted",
        ranks=odd,
    )


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:_NAMED])
    return shown if len(ranks) <= _NAMED else f"{shown} and {len(ranks) - _NAMED} more"
