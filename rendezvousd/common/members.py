"""The member values the daemon, the SDK and the node agent all use: a member of a
generation (``MemberInfo``, the SDK's ``Member``), a lost one (``FailedInfo``, the
SDK's ``FailedMember``) and the one sentence that names losses, a joiner's seat
(``Seat``), and the wording of two causes every agent recognises.

Apart from ``model.py`` (which re-exports them with the state machine's own values)
because every node process imports these and none of the daemon's: each frozen
dataclass costs ~1.5 ms of CPU to create, paid by each process of a node that
replaces a lost one (docs/benchmarks.md, "Recovery").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from rendezvousd.common.escape import escape, shortened


@dataclass(frozen=True)
class MemberInfo:
    rank: int
    node_rank: int
    local_rank: int
    host: str
    address: str


@dataclass(frozen=True)
class FailedInfo:
    """A member the daemon lost, and why: its record, a ``FailedMember`` on the wire,
    and the SDK's ``FailedMember``. Lists of them keep the order of loss, so the
    first is the root cause."""

    rank: int
    host: str
    # Whole (the daemon keeps up to escape.MAX_CAUSE_BYTES): any text, so shown
    # only through ``describe``.
    cause: str
    node_rank: int | None = None
    local_rank: int | None = None
    # When it was lost: the daemon's monotonic clock in the daemon; in the SDK,
    # time.time() on the receiving host, from the age the daemon sent. None: not
    # known (a loss recorded before the daemon restarted).
    lost_at: float | None = None

    def describe(self) -> str:
        """The one way every layer words a loss: rank, host and the cause shortened."""
        return f"rank {self.rank} on {escape(self.host)} ({shortened(self.cause)})"


# How many losses a failure sentence names; the rest are counted.
NAMED_LOSSES = 8


def failed_text(named: str, failed: Sequence[FailedInfo]) -> str:
    """The failure sentence the daemon, the SDK and the node agent all say:
    "<job J generation G> failed: lost rank R on HOST (cause), ... and N more"."""
    lost = ", ".join(f.describe() for f in failed[:NAMED_LOSSES])
    more = f" and {len(failed) - NAMED_LOSSES} more" if len(failed) > NAMED_LOSSES else ""
    return f"{named} failed: lost {lost}{more}"


@dataclass(frozen=True)
class Seat:
    """Where a joiner sits in a generation: node ``node_rank`` of ``num_nodes``, each of
    ``gpus_per_node`` ranks, and on it a worker's one rank (``local_rank``) or, None, a
    node agent's every rank. A join's answer (``JoinResult``), Join's and JoinNode's
    on the wire, and the SDK's ``Membership`` and ``NodeMembership`` are this one seat."""

    job_id: str
    generation: int
    node_rank: int
    num_nodes: int
    gpus_per_node: int
    local_rank: int | None

    @property
    def rank(self) -> int:
        """A worker's global rank; a node agent's first."""
        return self.node_rank * self.gpus_per_node + (self.local_rank or 0)

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node


def seat_of(source: object, **given: Any) -> dict[str, Any]:
    """The fields of a ``Seat`` as keyword arguments: the ``given`` ones, the rest
    copied from ``source`` (a node agent's assignment to its worker)."""
    return {
        f.name: given[f.name] if f.name in given else getattr(source, f.name) for f in fields(Seat)
    }


#: How the daemon words the loss of a node agent that was placed in a generation and
#: never attached its heartbeat stream (a stray JoinNode by a token holder, or an agent
#: that died at once): the survivors' agents re-form without using a restart, since
#: nothing of theirs failed.
NEVER_ATTACHED = "placed, then never attached its heartbeat stream"


def never_attached(cause: str) -> bool:
    """Whether a loss's ``cause`` is a node that never attached (``NEVER_ATTACHED``)."""
    return cause.startswith(NEVER_ATTACHED)


#: The AbortJob reason a node agent gives when it ends a running generation for nodes
#: waiting to join (NODES_WAITING): a membership change, not a failure. Both agents
#: (rendezvous-run's and the torchrun handler) say it, so that the other agents and
#: the daemon's status page tell it apart from a failure.
SCALE_UP_REASON = "scale-up"
