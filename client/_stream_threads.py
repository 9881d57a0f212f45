"""The threads behind a blocking gRPC stream end before the process does.

A blocking stream-stream call runs two threads of gRPC's own besides ours: one feeds
the request iterator to the wire, one (per channel) handles completions. After the
iterator ends, the feeding thread takes the call's lock once more. A process that
exits while it is on its way there has it killed by interpreter finalization, which
ends daemon threads where they stand, holding the lock; the call's own ``__del__``,
run later in that finalization, then waits for the lock forever, and the process
never exits. A CI probe (one call, close, exit) hung that way; right after
``close()`` the feeding thread was still alive in about 3 % of calls.

So a closed stream waits for the thread that consumed its requests (recorded by the
iterator itself: gRPC gives no handle to it), and then frees the call, whose
``__del__`` runs at once, while every thread can still release what it holds.
Dropping the last reference is not enough: gRPC raises the call object itself as the
stream's error, and its traceback holds the frame that holds the call, a cycle only a
garbage collection (or the interpreter's exit) would break.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class RequestFeed:
    """A request iterator that knows which thread gRPC runs it on."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._started = threading.Event()

    def wrap(self, requests: Iterator[T]) -> Iterator[T]:
        """``requests``, recording the consuming thread at its first step."""
        self._thread = threading.current_thread()
        self._started.set()
        yield from requests

    def join(self, deadline: float) -> bool:
        """Wait, until the ``time.monotonic()`` deadline, for the consuming thread to
        end; whether it has."""
        if not self._started.wait(max(0.0, deadline - time.monotonic())):
            return False
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return thread is not None
        thread.join(max(0.0, deadline - time.monotonic()))
        return not thread.is_alive()


def unraise(call: Any) -> None:
    """Break the cycle a raised ``call`` is in, so that dropping it frees it now."""
    if isinstance(call, BaseException):
        call.__traceback__ = None
