"""A heartbeat speaks for the member it was started for, whatever its thread does when."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client import RendezvousClient, RendezvousError
from tests.support import DaemonProcess


def test_a_join_right_after_start_heartbeat_leaves_the_kept_member_beating(
    daemon: DaemonProcess, job_id: str
) -> None:
    """The stream's first beat was made by the heartbeat's thread when gRPC first
    pulled a request; a second join() called right after start_heartbeat() clears the
    membership until it is answered (its new identity), so a thread slow to start (a
    loaded host: 1 run in 5 of the twins' "a second join of a live member") made it
    raise "not joined", the stream broke (UNKNOWN: Exception iterating requests), and
    the kept member failed: its next call raised ProtocolError. Here the thread is held
    until the second join has cleared the membership, and the join until the thread
    has made its first beat."""
    client = RendezvousClient(daemon.endpoint, job_id, token=daemon.token)
    begun, first_made = threading.Event(), threading.Event()
    real_begin, real_request = client._s.begin, client._s.heartbeat_request
    real_stream = client._heartbeat_stream

    def begin(*args: Any, **kwargs: Any) -> None:
        real_begin(*args, **kwargs)
        begun.set()
        first_made.wait(5)

    def heartbeat_request() -> pb.HeartbeatRequest:
        try:
            return real_request()
        finally:
            first_made.set()

    def held_stream(requests: Any) -> Any:
        begun.wait(5)
        return real_stream(requests)

    with client:
        client.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        client._s.begin = begin  # type: ignore[method-assign]
        client._s.heartbeat_request = heartbeat_request  # type: ignore[method-assign]
        client._heartbeat_stream = held_stream  # type: ignore[method-assign]
        client.start_heartbeat(0.2)
        with pytest.raises(RendezvousError, match="this client still holds rank 0"):
            client.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        assert begun.is_set() and first_made.is_set()
        client.kv_set("k", b"v")
        assert client.kv_get("k") == b"v"
        client.leave()
    with RendezvousClient(daemon.endpoint, token=daemon.token) as admin:
        assert admin.get_job(job_id).summary.state == pb.JOB_STATE_ENDED
