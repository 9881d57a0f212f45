"""A deadline for a call that nothing can interrupt: NCCL communicator init, and a
collective's enqueue (``end_process``, which ``NcclCommunicator`` calls).

CuPy's ``NcclCommunicator(...)`` runs ``ncclCommInitRank`` in blocking mode
(CuPy cannot ask for a non-blocking communicator), with no timeout of its own:
a peer that never arrives keeps it waiting forever, holding the GIL-free C
call where no Python exception can reach it. The only way out is to end the
process, so the watchdog does that, after logging what it waited for and
telling whoever must know (the rendezvous, so peers stop waiting too).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable

log = logging.getLogger("rendezvousd.trainer")

# Distinct from Python's 1 (an exception) and the shell's 124/137 (timeout/kill),
# so launchers and scripts can tell "NCCL init hung" from other deaths.
INIT_TIMEOUT_EXIT_CODE = 86
# An NCCL call after init (a collective's enqueue) that did not return in time, or
# that abort() could not wait out: freeing the communicator under it would crash.
CALL_HANG_EXIT_CODE = 87


def end_process(
    message: str,
    code: int,
    *,
    on_report: Callable[[str], None] | None = None,
    exit: Callable[[int], object] = os._exit,
) -> None:
    """Log ``message`` as an ERROR, hand it to ``on_report`` (its errors are logged and
    ignored: the exit must happen), write it to stderr and ``exit(code)``; ``os._exit``
    by default, since a normal exit would wait for the thread stuck in NCCL."""
    log.error("%s", message)
    if on_report is not None:
        try:
            on_report(message)
        except Exception:
            log.exception("could not report why this process ends")
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    exit(code)


class InitWatchdog:
    """``with InitWatchdog(...):`` ends the process if the block outlives ``timeout``.

    On expiry: log ERROR, call ``on_timeout(message)`` (errors in it are logged
    and ignored: the exit must happen), write the message to stderr, then
    ``exit(INIT_TIMEOUT_EXIT_CODE)`` (``os._exit``: a normal exit would wait for
    the thread stuck in NCCL). ``exit`` is injectable for tests.
    """

    def __init__(
        self,
        timeout: float,
        what: str,
        *,
        on_timeout: Callable[[str], None] | None = None,
        exit: Callable[[int], object] = os._exit,
    ) -> None:
        self._timeout = timeout
        self._what = what
        self._on_timeout = on_timeout
        self._exit = exit
        self._finished = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired = False

    def __enter__(self) -> InitWatchdog:
        self._thread = threading.Thread(target=self._watch, name="nccl-init-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._finished.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)

    def _watch(self) -> None:
        if self._finished.wait(self._timeout):
            return
        self.fired = True
        message = (
            f"{self._what} did not finish within setup_timeout_s={self._timeout:g} s; NCCL "
            "init cannot be interrupted, so this process exits with code "
            f"{INIT_TIMEOUT_EXIT_CODE}. Check that every rank started, that the nodes reach "
            "each other (NCCL_SOCKET_IFNAME, firewalls) and raise setup_timeout_s if "
            "nodes start slowly"
        )
        end_process(message, INIT_TIMEOUT_EXIT_CODE, on_report=self._on_timeout, exit=self._exit)
