"""A process's open-file limit (RLIMIT_NOFILE): the daemon's raised at start, checked
against what ``--max-connections`` may take, watched while serving, and named wherever
running out of it shows (a refused connection, a failed storage write), because "Too
many open files" alone sent operators to the disk (an operator review); a node's
(the SDK's connect diagnosis) named with how to raise it."""

from __future__ import annotations

import errno
import logging
import os
import resource
import time

from rendezvousd.common.log_throttle import LogThrottle

log = logging.getLogger("rendezvousd")

#: Descriptors the daemon holds besides its connections (the state database, its
#: -wal and -shm, the lock, the listeners, gRPC's own): operations.md's "+ 100".
HEADROOM = 100

#: What raises the limit, said in every line that names it.
HOW_TO_RAISE = "raise it (LimitNOFILE= in its systemd unit, or ulimit -n before starting it)"

#: How near the limit the watch starts to warn: gRPC retries a failed accept, and a
#: storage write that needs a descriptor fails, only within this of it.
_NEAR = 8

#: How often the watch counts the open descriptors (a directory read of up to
#: ``--max-connections`` entries), and how often a line about them is said.
_COUNT_EVERY_S = 2.0
_SAY_EVERY_S = 60.0


def soft_limit() -> int:
    """The soft limit now (RLIM_INFINITY as a very large number)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 2**62 if soft == resource.RLIM_INFINITY else soft


def shown(limit: int) -> str:
    return "unlimited" if limit >= 2**62 else str(limit)


def raise_at_start(max_connections: int) -> None:
    """Raise the soft limit to the hard one (each member holds a connection; the usual
    soft default, 1024, is too low) and say so; warn when even that is below what
    ``max_connections`` may need."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (OSError, ValueError) as exc:
            log.warning("cannot raise the open-file soft limit %d to the hard one: %s", soft, exc)
        else:
            log.info(
                "raised the open-file soft limit from %d to its hard limit %s",
                soft,
                shown(soft_limit()),
            )
    limit = soft_limit()
    need = max_connections + HEADROOM
    if limit < need:
        log.warning(
            "the open-file limit is %s, below the %d this daemon may need (--max-connections "
            "%d + %d): past it new connections are refused and state storage writes fail "
            "with 'Too many open files'; %s, or lower --max-connections",
            shown(limit),
            need,
            max_connections,
            HEADROOM,
            HOW_TO_RAISE,
        )


def open_count() -> int | None:
    """How many descriptors this process has open (None where /proc cannot say)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError as exc:
        # Reading the directory takes a descriptor too: none left is the answer.
        return soft_limit() if exc.errno in (errno.EMFILE, errno.ENFILE) else None


def near_limit() -> bool:
    """Whether this process's open descriptors are within ``_NEAR`` of its limit."""
    count = open_count()
    return count is not None and count >= soft_limit() - _NEAR


def ran_out(exc: BaseException) -> bool:
    """Whether ``exc`` is, or likely is, this process running out of descriptors:
    EMFILE/ENFILE, or SQLite's "unable to open" (it keeps the errno to itself) while
    the open descriptors are at the limit."""
    if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
        return True
    cause = exc.__cause__ or exc.__context__
    if cause is not None and cause is not exc and ran_out(cause):
        return True
    import sqlite3  # here: the SDK imports this module and never loads sqlite3

    return isinstance(exc, sqlite3.OperationalError) and near_limit()


def ran_out_text() -> str:
    """The cause as the log and the operator hear it."""
    return f"this daemon ran out of open files (its open-file limit is {shown(soft_limit())}); {HOW_TO_RAISE}"


class Watch:
    """A throttled ERROR while the open descriptors are at the limit: gRPC's core then
    refuses new connections ("File descriptor limit reached. Retrying.") and no line
    of ours said why or what to do."""

    def __init__(self, max_connections: int) -> None:
        self.max_connections = max_connections
        self._counted = 0.0
        self._throttle: LogThrottle[str] = LogThrottle(_SAY_EVERY_S)

    def check(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if now - self._counted < _COUNT_EVERY_S:
            return
        self._counted = now
        count = open_count()
        limit = soft_limit()
        if count is None or count < limit - _NEAR:
            return
        due = self._throttle.due("fds", now)
        if due is None:
            return
        log.error(
            "%s files open of this daemon's open-file limit %s: new connections are refused "
            "(clients hear that no gRPC server answered) and state storage writes may fail; "
            "%s (at least --max-connections %d + %d)%s",
            "all" if count >= limit else count,
            shown(limit),
            HOW_TO_RAISE,
            self.max_connections,
            HEADROOM,
            "" if not due.skipped else f" (found at the limit {due.skipped} more times since)",
        )
