"""Ask the daemon which member of a failed generation was lost first, and why.

A launcher only sees its own node: when a worker on another node dies, every
local worker fails with ``PeerFailed`` and the local exit order names a victim,
not the cause. The daemon records lost members in the order it lost them, so
``GetJob``'s first ``failed`` entry is the root cause for every node alike.

Best effort by design: a short deadline, no retries, and any error (daemon gone,
bad token, unknown job) yields None, so a diagnostic can never hang the launcher
or turn a worker's failure into a launcher crash.
"""

from __future__ import annotations

import time

from rendezvousd.client import RendezvousClient, TlsConfig
from rendezvousd.client.errors import FailedMember, RendezvousError, failed_members
from rendezvousd.common.escape import escape, shortened
from rendezvousd.common.members import WITNESS_WINDOW_S

# How long to wait for the daemon to record a loss the launcher already saw: a
# SIGKILLed worker is reaped locally a moment before the daemon notices its
# heartbeat stream closing.
SETTLE_S = 1.0
CALL_TIMEOUT_S = 1.0


def bounded_client(
    endpoint: str,
    job_id: str,
    within: float = CALL_TIMEOUT_S,
    *,
    token: str | None = None,
    token_file: str | None = None,
    tls: TlsConfig | None = None,
) -> RendezvousClient:
    """A client of its own for one look at the daemon, without retries, each call and
    connect bounded by ``within``: whatever the caller's client is set to (its
    ``connect_timeout`` 30 s, its retries: 28 s for a GetJob in an outage), a look
    ends in ``within``, and the caller's stream is left alone."""
    return RendezvousClient(
        endpoint,
        job_id,
        token=token,
        token_file=token_file,
        tls=tls,
        retry_attempts=0,
        call_timeout=within,
        connect_timeout=within,
    )


def settled(first: FailedMember) -> bool:
    """Whether the daemon's first loss is its root cause for good: older than
    ``WITNESS_WINDOW_S``, within which a relayed report's witness still takes its
    place (asked at once, node 0's launcher named the relay 0.1 s before the witness's
    report came). A loss of unknown age (recorded before a restart) is settled."""
    return first.lost_at is None or time.time() - first.lost_at >= WITNESS_WINDOW_S


def describe(lost: FailedMember, *, here: bool = False) -> str:
    """The root cause in the launcher's words; ``cause`` is whatever the worker or
    its agent reported: shown escaped, shortened. ``here``: the member is one of this
    launcher's own node (its agent lost while stopped read as another node's loss)."""
    where = f"rank {lost.rank} (node {lost.node_rank}, local rank {lost.local_rank})"
    where += f" on host {escape(lost.host)}" + (", this node," if here else "")
    return f"{where} was lost ({shortened(lost.cause)})"


def lost_member(
    endpoint: str,
    job_id: str,
    token_file: str | None,
    *,
    tls: TlsConfig | None = None,
) -> tuple[int, FailedMember] | None:
    """The first member the daemon recorded as lost in ``job_id``'s current
    generation, once ``settled``, and that generation; None if there is none within
    ``SETTLE_S`` or the daemon cannot say (unreachable, unknown job, no token)."""
    deadline = time.monotonic() + SETTLE_S
    settle_by = deadline + WITNESS_WINDOW_S
    try:
        with bounded_client(endpoint, job_id, token_file=token_file, tls=tls) as client:
            # A daemon that speaks TLS to this plaintext client ends the query at once,
            # where the call below would reconnect until its deadline: each attempt
            # one more "Handshake failed" line in the daemon's log.
            client.check_health()
            while True:
                job = client.get_job()
                now = time.monotonic()
                if job.failed:
                    first = failed_members(job.failed[:1])[0]
                    if settled(first) or now >= settle_by:
                        return job.summary.generation, first
                elif now >= deadline:
                    return None
                time.sleep(0.05)  # poll interval while the daemon catches up
    except (RendezvousError, OSError, ValueError):
        return None
