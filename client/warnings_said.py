"""Where the SDK's warnings go when a program says its own notes: a daemon not reached
yet, said by rendezvous-run and the torchrun backend as their notes and by
``rendezvousd status`` as its message, not by Python's bare last-resort line without
the program's name."""

from __future__ import annotations

import logging
from collections.abc import Callable


class _Said(logging.Handler):
    def __init__(self, say: Callable[[str], None]) -> None:
        super().__init__(logging.WARNING)
        self.say = say

    def emit(self, record: logging.LogRecord) -> None:
        self.say(record.getMessage())


def say_client_warnings(say: Callable[[str], None]) -> None:
    """The SDK's warnings said by ``say``. A later call's ``say`` replaces the earlier."""
    client = logging.getLogger("rendezvousd.client")
    for old in [h for h in client.handlers if isinstance(h, _Said)]:
        client.removeHandler(old)
    client.addHandler(_Said(say))
    client.propagate = False
