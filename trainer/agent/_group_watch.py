"""A node's watcher of its cold workers' process groups: what a cold worker started
(DataLoader workers, a helper process) must not outlive a SIGKILLed agent.

A cold worker (``_agent_boot``) dies with its agent by its parent-death signal, but
the processes it started have none: reparented to init, they ran on for good,
holding ports, memory or a GPU. The fork server kills its forked workers' groups
itself when its agent dies (``_fork_server``); for cold workers the agent starts
this process with its first one and names each worker on a pipe:

    python -m rendezvousd.trainer.agent._group_watch

stdin, one line per cold worker started: ``+PID``. The watcher holds a pidfd of each
and, when the worker exits (for any reason: the agent kills the same group then,
whichever comes first), kills its group and forgets it, so no number it holds can
be reused under it for long. End of file is the agent gone, however it ended (the
kernel closes the pipe on SIGKILL too): every group still held is SIGKILLed and the
watcher exits. It imports nothing of the package, so it starts in milliseconds.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal


def kill_group(pid: int) -> None:
    """SIGKILL worker ``pid``'s group: only the group, never the pid alone (a worker
    not yet in a group of its own has started nothing, and dies of its parent-death
    signal). Called at most moments after the worker ran: its number stays taken while
    its zombie or any process of its group lives, and pids are handed out in turn."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def main() -> None:
    # A job-wide signal (a terminal's Ctrl-C to the launcher's group) is its workers'
    # to handle: ending here would leave nothing to kill their groups.
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(s, signal.SIG_IGN)
    poller = select.poll()
    poller.register(0, select.POLLIN)
    workers: dict[int, int] = {}  # pidfd -> pid
    pending = b""
    while True:
        for fd, _ in poller.poll():
            if fd != 0:
                kill_group(workers.pop(fd))
                poller.unregister(fd)
                os.close(fd)
                continue
            data = os.read(0, 4096)
            if not data:  # the agent is gone
                for pid in workers.values():
                    kill_group(pid)
                return
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                text = line.strip()
                # Not 0 nor 1: killpg(0) is this process's own group, the launcher's.
                if text[:1] == b"+" and text[1:].isdigit() and int(text[1:]) > 1:
                    with contextlib.suppress(ProcessLookupError):
                        pidfd = os.pidfd_open(int(text[1:]))
                        workers[pidfd] = int(text[1:])
                        poller.register(pidfd, select.POLLIN)


if __name__ == "__main__":
    main()
