"""The node x local-rank grid that the status page and ``rendezvousd status JOB``
both draw: one letter per seat, so a glance reads the same in a browser and a
terminal (and 1,024 nodes x 8 stay small on the wire)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from rendezvousd.common.escape import escape
from rendezvousd.common.model import MemberState

# A member is drawn late once its heartbeat is this share of the timeout old.
LATE_SHARE = 0.5
SEAT = {
    MemberState.JOINING: "J",
    MemberState.ACTIVE: "A",
    MemberState.LEFT: "D",
    MemberState.LOST: "X",
}
LATE, EMPTY = "H", "-"
# A node's distinct addresses shown (its ranks' agree but for a misconfiguration).
MAX_ADDRESSES = 4
LEGEND = "A active, H late heartbeat, X lost, J joining, D left, - empty"


# One member as the grid needs it: node rank, local rank, host, state, heartbeat
# age (s), last step (None before its first), the address it advertised.
GridSeat = tuple[int, int, str, MemberState, float, int | None, str]


@dataclass
class NodeRow:
    """One node's row: its host, a letter per local rank, its oldest heartbeat, its
    slowest rank's step, and the addresses its members advertised (the one peers dial:
    a multi-homed host's wrong pick shows here, h145 F5)."""

    host: str
    seats: list[str]
    age_s: float = 0.0
    step: int | None = None
    addresses: list[str] = field(default_factory=list)

    @property
    def address(self) -> str:
        """The node's advertised address; its ranks' several, comma-separated, where
        they differ (each worker of a per-rank job advertises its own); "" for none."""
        return ",".join(self.addresses)


def job_step(
    members: Iterable[tuple[MemberState, int | None]], *, ended: bool = False
) -> int | None:
    """The job's step: its slowest active rank's (None until one reported a step).
    A lost or departed rank's last step is history, not where training stands: the
    one definition the daemon's views (``JobView.step``, the status page) and
    ``rendezvousd status JOB`` share. An ``ended`` job (every member left, each
    goodbye carrying its last steps) stands where its ranks left it: the slowest
    one's (it showed none, its ranks being no longer active)."""
    counted = (MemberState.ACTIVE, MemberState.LEFT) if ended else (MemberState.ACTIVE,)
    steps = (s for state, s in members if state in counted and s is not None)
    return min(steps, default=None)


def node_rows(
    members: Iterable[GridSeat], per_node: int, late_after_s: float, nodes: range | None = None
) -> dict[int, NodeRow]:
    """The rows of the nodes in ``nodes`` (every node when None), by node rank."""
    rows: dict[int, NodeRow] = {}
    for node, local, host, state, age, step, address in members:
        if nodes is not None and node not in nodes:
            continue
        row = rows.get(node)
        if row is None:
            row = rows[node] = NodeRow(host, [EMPTY] * per_node)
        if 0 <= local < per_node:
            late = state is MemberState.ACTIVE and age > late_after_s
            row.seats[local] = LATE if late else SEAT[state]
        row.age_s = max(row.age_s, age)
        if step is not None:
            row.step = step if row.step is None else min(row.step, step)
        if address and address not in row.addresses and len(row.addresses) < MAX_ADDRESSES:
            row.addresses.append(address)
    return rows


def age(seconds: float) -> str:
    """How long ago, as ``rendezvousd status`` says every age and a waiting node agent
    a joined node's: "12.3s"."""
    return f"{seconds:.1f}s"


#: How many joined nodes a line names; the rest are counted.
NODES_NAMED = 16


def joined_nodes(nodes: Iterable[tuple[int | None, str, float]]) -> str:
    """A forming generation's joined nodes (node rank or None, host, seconds since it
    joined) as ``rendezvousd status`` and a waiting node agent say them: "node 0 on
    n0 (12.3s ago), a node on n2 (11.9s ago)"; a node that named no rank is "a node".
    The first ``NODES_NAMED``, the rest counted; hosts escaped."""
    said = [
        f"{'a node' if rank is None else f'node {rank}'} on {escape(host)} ({age(s)} ago)"
        for rank, host, s in nodes
    ]
    more = len(said) - NODES_NAMED
    return ", ".join(said[:NODES_NAMED]) + (f" and {more} more" if more > 0 else "")


def missing_nodes(missing: Iterable[int], needed: int, min_nodes: int) -> str:
    """What a forming node generation still lacks: the node ranks no node took, where
    the daemon knows them (a fixed-size job whose nodes name their ranks), else how
    many more nodes reach min_nodes; "" when it lacks none."""
    ranks = list(missing)
    if ranks:
        shown = ", ".join(str(r) for r in ranks[:NODES_NAMED])
        more = f" and {len(ranks) - NODES_NAMED} more" if len(ranks) > NODES_NAMED else ""
        if len(ranks) == 1:
            return f"node rank {shown} (no node agent joined with that node rank)"
        return f"node ranks {shown}{more} (no node agent joined with those node ranks)"
    if needed:
        return f"{needed} more node(s) to reach min_nodes={min_nodes}"
    return ""


def missing_ranks(world_size: int, joined: Iterable[int]) -> str:
    """A forming per-rank generation's ranks no worker joined as (its members are the
    ranks that did): "ranks 2, 3" (the first ``NODES_NAMED``, the rest counted); ""
    when none is missing."""
    have = set(joined)
    missing = [r for r in range(world_size) if r not in have]
    if not missing:
        return ""
    shown = ", ".join(str(r) for r in missing[:NODES_NAMED])
    more = f" and {len(missing) - NODES_NAMED} more" if len(missing) > NODES_NAMED else ""
    if len(missing) == 1:
        return f"rank {shown} (no worker joined as it)"
    return f"ranks {shown}{more} (no worker joined as them)"
