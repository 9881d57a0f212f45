"""The seed's fault policy for communicator bootstrap: exactly ``attempts``
retries on a transient error (timeout, refused connection), then a loud error.
Elastic recovery is out of scope; this only absorbs one blip."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from rendezvousd.trainer.errors import CommunicatorTimeout, PeerConnectionError, RetriesExhausted

T = TypeVar("T")
TRANSIENT: tuple[type[BaseException], ...] = (
    CommunicatorTimeout,
    PeerConnectionError,
    TimeoutError,
    ConnectionRefusedError,
)
log = logging.getLogger("rendezvousd.trainer")


def with_retry(what: str, fn: Callable[[], T], *, attempts: int = 1, backoff_s: float = 0.5) -> T:
    """Run ``fn``; on a transient error run it again up to ``attempts`` more times."""
    for attempt in range(1, attempts + 2):
        try:
            return fn()
        except TRANSIENT as exc:
            if attempt > attempts:
                raise RetriesExhausted(what, attempt, exc) from exc
            log.warning("%s: transient failure (%s); retry %d of %d", what, exc, attempt, attempts)
            time.sleep(backoff_s * attempt)
    raise AssertionError("unreachable")  # pragma: no cover
