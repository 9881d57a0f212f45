"""``--state-dir``: SQLite persistence, snapshots and the undo of a failed commit."""
