"""Job tokens as docs/operations.md, "Tokens", words them: an expiring token's heartbeat
stream opened before its date "runs on", while a new call after it is refused; a
token of the earlier form is accepted "with a warning in the daemon's log (once per
job id)"."""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable

import pytest

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client import AuthenticationError, RendezvousClient
from rendezvousd.server.scope import admin_key, derive_job_token
from tests.support import DaemonProcess

HEARTBEAT_TIMEOUT_S = 1.0  # not less: a loaded machine must not lose the member


def test_a_heartbeat_stream_opened_before_its_tokens_expiry_runs_on_after_it(
    start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    d = start_daemon("--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S))
    until = int(time.time()) + 2  # tokens carry whole seconds
    token = derive_job_token(d.token, job_id, until=until)
    with RendezvousClient(d.endpoint, job_id, token=token) as member:
        member.join(num_nodes=1, gpus_per_node=1, node_rank=0, local_rank=0, timeout=10)
        member.start_heartbeat(HEARTBEAT_TIMEOUT_S / 5)
        # The point is the clock: past the expiry by several heartbeat timeouts, each of
        # which would have lost the member had its stream ended.
        time.sleep(max(0.0, until - time.time()) + 4 * HEARTBEAT_TIMEOUT_S)
        with RendezvousClient(d.endpoint, job_id, token=d.token) as admin:
            job = admin.get_job()
        assert job.summary.state == pb.JOB_STATE_RUNNING, job
        assert not job.failed, job.failed
        (seat,) = job.members
        assert seat.state == pb.MEMBER_STATE_ACTIVE and seat.heartbeat_stream_open, seat
        # A call started now, on a new client, is refused naming the expiry.
        with (
            RendezvousClient(d.endpoint, job_id, token=token) as late,
            pytest.raises(AuthenticationError, match=rf"job token for job '{job_id}' expired at"),
        ):
            late.get_job()
    assert token not in d.log()


def _legacy_token(admin: str, job_id: str) -> str:
    """A job token as rendezvousd before minting times made it: no minting time."""
    mac = hmac.new(admin_key(admin), f"job:{job_id}".encode(), hashlib.sha256).hexdigest()
    return f"rdzv-job.{job_id}.{mac}"


def test_a_legacy_job_token_is_warned_about_once_per_job_id(
    daemon: DaemonProcess, job_id: str
) -> None:
    warning = "a job token without a minting time (made by an earlier rendezvousd)"
    other = job_id + "-other"
    for job in (job_id, other):
        token = _legacy_token(daemon.token, job)
        for _ in range(2):  # two clients, each with its own connection and calls
            with RendezvousClient(daemon.endpoint, job, token=token) as c:
                c.join(num_nodes=1, gpus_per_node=1, node_rank=0, local_rank=0, timeout=10)
                c.kv_set("k", b"v")
                c.get_job()
                c.leave()
    # Every call above was answered: its token was read (and the warning said) before.
    lines = [line for line in daemon.log().splitlines() if warning in line]
    for job in (job_id, other):
        said = [line for line in lines if f" job {job}: " in line]
        assert len(said) == 1, said
        assert " WARNING " in said[0], said[0]
