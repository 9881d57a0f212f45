"""How the benchmarks time a call: warm-ups first, then each call on its own."""

from __future__ import annotations

import time
from collections.abc import Callable


def _nothing() -> None:
    pass


def timed_calls(
    fn: Callable[[], object],
    iters: int,
    warmup: int,
    *,
    after_warmup: Callable[[], object] = _nothing,
    after_each: Callable[[], object] = _nothing,
) -> list[float]:
    """Seconds each of ``iters`` calls of ``fn`` took, after ``warmup`` untimed ones.

    ``after_warmup`` runs once before timing (a barrier, so no rank's first timed
    call waits for a slower peer's warm-up); ``after_each`` runs inside each timed
    span (a device sync, so asynchronous work is counted when it ends).
    """
    for _ in range(warmup):
        fn()
    after_warmup()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        after_each()
        times.append(time.perf_counter() - start)
    return times
