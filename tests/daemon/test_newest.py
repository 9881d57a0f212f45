"""``keep_newest``, the one bounded table of the daemon's newest entries (hosts refused
for their token and their log lines, a job's used ids, joins whose deadlines ended)."""

from __future__ import annotations

from rendezvousd.common.newest import keep_newest


def test_a_table_keeps_its_newest_entries_and_a_key_put_again_is_the_newest() -> None:
    table: dict[str, int] = {}
    for key, value in (("a", 1), ("b", 2), ("c", 3)):
        keep_newest(table, key, value, 3)
    keep_newest(table, "a", 4, 3)  # put again: the newest, and nothing dropped
    assert list(table.items()) == [("b", 2), ("c", 3), ("a", 4)]
    keep_newest(table, "d", 5, 3)  # past the bound: "b", put longest ago, goes
    assert list(table.items()) == [("c", 3), ("a", 4), ("d", 5)]


def test_a_smaller_bound_drops_every_entry_beyond_it() -> None:
    table = {"a": 1, "b": 2, "c": 3}
    keep_newest(table, "d", 4, 2)
    assert list(table) == ["c", "d"]
