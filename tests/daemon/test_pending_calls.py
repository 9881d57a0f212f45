"""gRPC core cancels a call that waited 30 s (its default) to be handed to its
handler. The daemon hands calls over one at a time, in arrival order, and in a
per-rank join storm (4,096 clients, each a health check, a Calls stream and a
heartbeat stream) the last ones waited longer: 488 of 4,096 Joins failed with
CANCELLED in one soak run once the heartbeat streams were opened before the joins
(issue 21). The queue's length stays bounded by ``max_pending_requests``.

A test that makes gRPC hold a call for 30 s would take that long; this one checks
the option the daemon gives gRPC."""

from __future__ import annotations

from rendezvousd.config import DaemonConfig
from rendezvousd.daemon import Daemon


def test_a_queued_call_waits_longer_than_grpcs_default_30_s() -> None:
    options = dict(Daemon(DaemonConfig(listen="127.0.0.1:0"), ["t" * 32])._options())
    assert options["grpc.server_max_unrequested_time_in_server"] >= 300
    # ...and the queue's length is still bounded.
    assert options["grpc.server.max_pending_requests_hard_limit"] <= 100_000
