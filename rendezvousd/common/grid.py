"""The node x local-rank grid that the status page and ``rendezvousd status JOB``
both draw: one letter per seat, so a glance reads the same in a browser and a
terminal (and 1,024 nodes x 8 stay small on the wire)."""

from __future__ import annotations

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


def seat(state: MemberState, heartbeat_age_s: float, late_after_s: float) -> str:
    """The letter of a member in ``state`` whose heartbeat is ``heartbeat_age_s`` old."""
    if state is MemberState.ACTIVE and heartbeat_age_s > late_after_s:
        return LATE
    return SEAT[state]
