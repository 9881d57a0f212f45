"""Milestones of a node's recovery, for ``benchmarks/recovery.py``'s breakdown.

With ``RENDEZVOUSD_TRACE_FILE`` set, the launcher, its agent and its workers append
one JSON line per milestone to that file: the wall clock (comparable across the
node's processes and with the daemon's log), the process and its parent (which
ties a worker to its node: for a worker the fork server forked, its agent), the
event and a few numbers (a generation, a rank).
Unset, ``mark`` is one dictionary lookup: the variable is read once per process.
A line is one ``O_APPEND`` write, so the processes of every node can share one file.
Nothing secret is written: the events carry no id, token or address.
"""

from __future__ import annotations

import os
import time

TRACE_ENV = "RENDEZVOUSD_TRACE_FILE"
_PATH = os.environ.get(TRACE_ENV) or None
# A worker forked by the fork server: its agent, traced as its parent (the server
# is its real one), so that the lines still tie it to its node.
_agent: int | None = None


def set_agent(pid: int) -> None:
    """This process is a worker of the agent ``pid``, though not its child."""
    global _agent
    _agent = pid


def mark(event: str, **numbers: int) -> None:
    """Append ``event`` with the time now, if this process traces."""
    if _PATH is None:
        return
    # json only when tracing: a node's start imports nothing for this.
    import json

    line = {"t": time.time(), "pid": os.getpid(), "ppid": _agent or os.getppid(), "event": event}
    line.update(numbers)
    fd = os.open(_PATH, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (json.dumps(line) + "\n").encode())
    finally:
        os.close(fd)
