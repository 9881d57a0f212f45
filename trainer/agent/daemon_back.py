"""A node's last goodbye to a daemon that may be restarting.

The SDK's ``leave()`` makes one try within its leave timeout (2 s) and does not wait
for a daemon that went away, where joins and barriers wait for it within the
reconnect window. A job whose last step came while its daemon restarted (SIGKILL or
SIGTERM, ``--state-dir``) therefore finished, its goodbye unheard, and the restored
daemon, which never heard from the node again, recorded it FAILED at its heartbeat
timeout ("node unreachable") (h139 F1). ``await_daemon`` is waited on before that
goodbye: it returns at once where a daemon serves, and otherwise asks again until one
does or the reconnect window (the daemon's heartbeat timeout, which a restored daemon
counts anew for each restored node) is over."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rendezvousd.client.connection import TlsConfig

# Each look: a daemon that is up answers a health check within a round trip; at one
# that is down the look waits this long for it to come up (gRPC redials meanwhile).
# Short, so the window is kept to: a look never ends more than this past it.
LOOK_S = 1.0
# Between looks: a restart takes about a second (state restored, port bound).
RECHECK_S = 0.25


def daemon_serves(
    endpoint: str,
    job_id: str,
    within: float,
    *,
    token: str | None,
    token_file: str | None,
    tls: TlsConfig | None,
) -> bool:
    """Whether a daemon serves (health SERVING) at ``endpoint`` within ``within``: a
    client of its own, without retries, so a look is bounded whatever the caller's
    client is set to (``connect_timeout`` 30 s, its retries) and leaves its stream
    alone. A draining daemon does not serve: its successor is the one to tell."""
    from rendezvousd.client.errors import RendezvousError
    from rendezvousd.trainer.agent.root_cause import bounded_client

    limit = max(within, 0.05)
    try:
        with bounded_client(
            endpoint, job_id, limit, token=token, token_file=token_file, tls=tls
        ) as client:
            client.check_health()
    except (RendezvousError, OSError, ValueError):
        return False
    return True


def await_daemon(
    serves: Callable[[float], bool],
    window_s: float,
    say: Callable[[str], None],
    waiting: str,
) -> bool:
    """Return True once ``serves(look_s)`` does, False once ``window_s`` has passed
    without it (never later than ``window_s`` plus one look). ``waiting`` is said once,
    with the window appended, when the first look finds no daemon serving: the node's
    exit waits on it, and a silent wait reads as a hang."""
    end = time.monotonic() + window_s
    told = False
    while True:
        left = end - time.monotonic()
        if serves(min(LOOK_S, max(left, 0.0))):
            return True
        if time.monotonic() >= end:
            return False
        if not told:
            say(f"{waiting} (up to {window_s:g} s, the daemon's heartbeat timeout)")
            told = True
        time.sleep(min(RECHECK_S, max(end - time.monotonic(), 0.0)))
