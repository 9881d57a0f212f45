"""The member values the daemon, the SDK and the node agent all use: a member of a
generation (``MemberInfo``, the SDK's ``Member``), a lost one (``FailedInfo``, the
SDK's ``FailedMember``) and the one way losses are named (``describe``,
``named_losses``, ``failed_text``), a joiner's seat (``Seat``) and whether a lost
rank is its own (``Seat.holds``), and the wording of two causes every agent
recognises.

Apart from ``model.py`` (which re-exports them with the state machine's own values)
because every node process imports these and none of the daemon's: each frozen
dataclass costs ~1.5 ms of CPU to create, paid by each process of a node that
replaces a lost one (docs/benchmarks.md, "Recovery").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
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
    # The rank whose first-hand report this loss relays (ReportFailure's
    # ``witness_rank``): the daemon's own, for ``rounds._witness_first``; not on the
    # wire, nor kept across a restart (its window is a second).
    witness: int | None = field(default=None, repr=False, compare=False)

    @property
    def node(self) -> int:
        """Its node rank; where the daemon did not say (a record from before node ranks),
        its rank, which is the node rank of a node of one rank (a torchrun agent)."""
        return self.rank if self.node_rank is None else self.node_rank

    def describe(
        self, *, as_node: bool = False, in_round: int | None = None, joining: bool = False
    ) -> str:
        """The one way every layer words a loss: "rank R on HOST (cause)", the host
        escaped and the cause shortened. ``as_node``: the member is a node of one rank
        (a torchrun agent), named "node N", its node rank: its "rank R" read as a
        worker's global rank; ``joining``: a node lost before its round formed, which
        had no node rank the user saw yet, named by its host; ``in_round``: named with
        the generation (torchrun's round) it was lost in."""
        host = escape(self.host)
        if joining:
            who = f"the node joining from {host}"
        else:
            who = f"node {self.node} on {host}" if as_node else f"rank {self.rank} on {host}"
        when = "" if in_round is None else f" in round {in_round}"
        return f"{who}{when} ({shortened(self.cause, LOSS_CAUSE_CHARS)})"


# How much of a loss's cause a failure sentence shows (``escape.shortened``, its middle
# cut past it). A silent ring link's cause, the one a cut between two hosts shows, runs
# ~200 characters with its bucket ("PeerConnectionError: rank 0: lost rank 5: its host
# answered nothing for 10 s (...) [bucket 0 of 2: ...]"); at the 120 of other shown
# text, the words saying what happened were the middle cut out (a CI run).
LOSS_CAUSE_CHARS = 240

# How many losses a failure sentence names; the rest are counted.
NAMED_LOSSES = 8

#: How long after a rank's report of a break it heard of from a neighbour (its
#: ReportFailure's ``witness_rank``: R) rank R's own report of it still takes its place
#: as the root cause (the daemon's ``rounds._witness_first``): a record younger than this
#: may still change, which the node agent and the launcher's root cause wait out.
WITNESS_WINDOW_S = 1.0


def named_losses(failed: Sequence[FailedInfo], *, as_nodes: bool = False) -> str:
    """The losses of one failure, as every layer names them: the first
    ``NAMED_LOSSES`` described (``FailedInfo.describe``), in the order of loss, the
    rest counted: "rank R on HOST (cause), ... and N more"."""
    lost = ", ".join(f.describe(as_node=as_nodes) for f in failed[:NAMED_LOSSES])
    more = len(failed) - NAMED_LOSSES
    return f"{lost} and {more} more" if more > 0 else lost


def failed_text(named: str, failed: Sequence[FailedInfo]) -> str:
    """The failure sentence the daemon, the SDK and the node agent all say:
    "<job J generation G> failed: lost rank R on HOST (cause), ... and N more"."""
    return f"{named} failed: lost {named_losses(failed)}"


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

    def holds(self, generation: int, rank: int) -> bool:
        """Whether global ``rank`` of ``generation`` is this seat's: a worker's own rank,
        or any of a node agent's ranks (a loss the daemon names by rank is then this
        node's own: its agent stopped, or cut off). The one rule of "is this loss
        ours" for the node agent, the launcher's root cause and the torchrun handler."""
        if generation != self.generation:
            return False
        if self.local_rank is not None:
            return rank == self.rank
        return self.rank <= rank < self.rank + self.gpus_per_node


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
