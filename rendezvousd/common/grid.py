"""The node x local-rank grid that the status page and ``rendezvousd status JOB``
both draw: one letter per seat, so a glance reads the same in a browser and a
terminal (and 1,024 nodes x 8 stay small on the wire)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

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
LEGEND = "A active, H late heartbeat, X lost, J joining, D left, - empty"


# One member as the grid needs it: node rank, local rank, host, state, heartbeat
# age (s), last step (None before its first).
GridSeat = tuple[int, int, str, MemberState, float, int | None]


@dataclass
class NodeRow:
    """One node's row: its host, a letter per local rank, its oldest heartbeat and
    its slowest rank's step."""

    host: str
    seats: list[str]
    age_s: float = 0.0
    step: int | None = None


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
    for node, local, host, state, age, step in members:
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
    return rows
