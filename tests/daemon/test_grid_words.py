"""``grid``'s words that ``rendezvousd status`` and a waiting node agent share: an age,
as both say it, and a forming generation's joined nodes."""

from __future__ import annotations

from rendezvousd.common import grid


def test_an_age_is_seconds_to_a_tenth_with_no_space() -> None:
    assert [grid.age(s) for s in (0.0, 0.04, 12.345, 42.0, 720.0)] == [
        "0.0s",
        "0.0s",
        "12.3s",
        "42.0s",
        "720.0s",
    ]


def test_joined_nodes_say_each_nodes_age_as_status_does() -> None:
    said = grid.joined_nodes([(0, "n0", 12.34), (None, "n2", 11.9)])
    assert said == "node 0 on n0 (12.3s ago), a node on n2 (11.9s ago)"
