"""GetJob of a big job is built once per JOB_ANSWER_TTL_S and dropped by the job's next
transition: 256 GetJobs of an 8,192-member job in one CallBatch took 13 s of the
daemon's CPU (each ~50 ms), and a token holder could repeat them."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from rendezvousd.server.servicer import BIG_JOB_MEMBERS, JOB_ANSWER_TTL_S
from tests.support import DaemonProcess

UID = b"\x05" * 128


@pytest.fixture
def daemon(start_daemon: Callable[..., DaemonProcess]) -> Iterator[DaemonProcess]:
    """Its node sends no heartbeat: a timeout the test cannot reach keeps the job as
    it formed."""
    yield start_daemon("--heartbeat-timeout-s", "120")


def _raw_get_job(stub: pb_grpc.RendezvousStub, d: DaemonProcess, job_id: str) -> bytes:
    call = stub.GetJob.with_call(
        pb.GetJobRequest(job_id=job_id),
        metadata=[("authorization", f"Bearer {d.token}")],
        timeout=30,
    )
    return call[0].SerializeToString()  # type: ignore[no-any-return]


def _form(stub: pb_grpc.RendezvousStub, d: DaemonProcess, job_id: str, gpus: int) -> None:
    request = pb.JoinNodeRequest(
        job_id=job_id, min_nodes=1, max_nodes=1, gpus_per_node=gpus, host="h",
        instance_id="node-0", wait_timeout_ms=10_000,
    )  # fmt: skip
    metadata = [("authorization", f"Bearer {d.token}")]
    stub.JoinNode(request, metadata=metadata, timeout=30)
    request.unique_id = UID  # node 0 is asked for the id, then forms the job
    stub.JoinNode(request, metadata=metadata, timeout=30)


def test_a_big_jobs_answer_is_reused_briefly_and_dropped_by_a_transition(
    daemon: DaemonProcess, job_id: str
) -> None:
    with grpc.insecure_channel(daemon.endpoint) as channel:
        stub = pb_grpc.RendezvousStub(channel)
        _form(stub, daemon, job_id, BIG_JOB_MEMBERS)
        first = _raw_get_job(stub, daemon, job_id)
        started = time.monotonic()
        again = _raw_get_job(stub, daemon, job_id)
        if time.monotonic() - started < JOB_ANSWER_TTL_S / 2:
            assert again == first, "the same answer, heartbeat ages and all"
        time.sleep(JOB_ANSWER_TTL_S + 0.1)
        later = pb.GetJobResponse.FromString(_raw_get_job(stub, daemon, job_id))
        assert later.SerializeToString() != first, "made again after its time"
        assert max(m.heartbeat_age_ms for m in later.members) >= JOB_ANSWER_TTL_S * 1000
        # A transition drops it at once, whatever its age.
        _raw_get_job(stub, daemon, job_id)
        stub.AbortJob(
            pb.AbortJobRequest(job_id=job_id, reason="the test is done"),
            metadata=[("authorization", f"Bearer {daemon.token}")],
            timeout=30,
        )
        aborted = pb.GetJobResponse.FromString(_raw_get_job(stub, daemon, job_id))
        assert aborted.summary.state == pb.JOB_STATE_ABORTED


def test_a_small_jobs_answer_is_made_fresh_each_time(daemon: DaemonProcess, job_id: str) -> None:
    with grpc.insecure_channel(daemon.endpoint) as channel:
        stub = pb_grpc.RendezvousStub(channel)
        _form(stub, daemon, job_id, 4)
        first = pb.GetJobResponse.FromString(_raw_get_job(stub, daemon, job_id))
        time.sleep(0.05)
        again = pb.GetJobResponse.FromString(_raw_get_job(stub, daemon, job_id))
        assert again.members[0].heartbeat_age_ms > first.members[0].heartbeat_age_ms
