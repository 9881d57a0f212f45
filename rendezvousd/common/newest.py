"""A dict kept as a bounded table of its newest entries.

Dicts keep insertion order, so a table whose every put moves its key to the end is its
own age order, and what goes past its bound is the entry put longest ago. The daemon's
tables that any caller can grow (hosts refused for their token, their log lines, a
job's used ids, the joins whose deadlines freed their seats) are bounded so."""

from __future__ import annotations

from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


def keep_newest(table: dict[K, V], key: K, value: V, most: int) -> None:
    """``table[key] = value`` as its newest entry (a key put again moves to the end),
    dropping the entries put longest ago beyond ``most``."""
    table.pop(key, None)
    table[key] = value
    while len(table) > most:
        del table[next(iter(table))]
