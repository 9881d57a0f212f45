"""What a join gives a worker: its ``Membership`` and the ``Member`` table of its generation."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.address import is_loopback

__all__ = ["Member", "Membership", "from_join_response", "loopback_conflict"]


@dataclass(frozen=True)
class Member:
    """One worker of a formed generation: its ranks, host and advertised address."""

    rank: int
    node_rank: int
    local_rank: int
    host: str
    address: str


@dataclass(frozen=True)
class Membership:
    """What a join gives a worker. ``unique_id`` is kept out of repr and logs."""

    job_id: str
    generation: int
    rank: int
    world_size: int
    node_rank: int
    local_rank: int
    unique_id: bytes = field(repr=False)
    # Decoded on first use: at thousands of ranks, building every rank's copy
    # of the table eagerly costs more than the whole rendezvous.
    _table: Any = field(repr=False, compare=False, default=())

    @functools.cached_property
    def members(self) -> tuple[Member, ...]:
        return tuple(
            Member(m.rank, m.node_rank, m.local_rank, m.host, m.address) for m in self._table
        )

    @property
    def num_nodes(self) -> int:
        return len({m.node_rank for m in self.members}) or 1


def from_join_response(response: pb.JoinResponse) -> Membership:
    """The ``Membership`` a JoinResponse (or PublishId's) describes."""
    return Membership(
        job_id=response.job_id,
        generation=response.generation,
        rank=response.rank,
        world_size=response.world_size,
        node_rank=response.node_rank,
        local_rank=response.local_rank,
        unique_id=response.unique_id,
        _table=response.members,
    )


def loopback_conflict(m: Membership, address: str) -> str | None:
    """Why this rank's advertised ``address`` cannot serve ``m``'s job, or None.

    A loopback address is only reachable from its own host: in a job with ranks on
    other hosts the peers would dial themselves and hang until their timeout. Only
    a rank advertising loopback decodes the table (the common case stays O(1)).
    """
    host = address.rsplit(":", 1)[0] if address.count(":") == 1 else address
    if not address or not is_loopback(host.strip("[]")):
        return None
    mine = m.members[m.rank].host
    others = sorted({x.host for x in m.members} - {mine})
    if not others:
        return None
    shown = ", ".join(repr(h) for h in others[:3]) + (" ..." if len(others) > 3 else "")
    return (
        f"rank {m.rank} on host {mine!r} advertises the loopback address {address!r}, but "
        f"job {m.job_id!r} also has ranks on {shown}, which cannot reach it. Advertise an "
        f"address of {mine!r} that the other hosts can reach (rendezvousd.trainer: unset "
        "RENDEZVOUSD_RING_HOST, and workers advertise their address towards the daemon)"
    )
