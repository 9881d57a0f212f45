"""A per-rank ReportFailure naming a generation still forming, sent by a raw gRPC client
(the SDK reports only after its join returned): refused, naming the job, the seat and
what to do, and recorded nowhere. It marked the rank LOST without failing anything, and
a later failure named that healthy rank its root cause."""

from __future__ import annotations

import grpc

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from rendezvousd.client import RendezvousClient
from tests.daemon.raw_calls import bearer, park_joins, reason_of, wait_members
from tests.support import DaemonProcess


def test_a_raw_report_failure_of_a_forming_rank_is_refused_and_fails_nothing(
    daemon: DaemonProcess, job_id: str
) -> None:
    (parked,) = park_joins(daemon, job_id, [1], 2)  # rank 1 waits; rank 0 not yet come
    try:
        wait_members(daemon, job_id, 1)
        with grpc.insecure_channel(daemon.endpoint) as channel:
            report = pb.ReportFailureRequest(
                job_id=job_id,
                generation=1,
                node_rank=0,
                local_rank=1,
                instance_id="parked-1",
                cause="raw: this rank failed",
            )
            try:
                pb_grpc.RendezvousStub(channel).ReportFailure(
                    report, metadata=bearer(daemon), timeout=5
                )
                raise AssertionError("a ReportFailure while forming was taken")
            except grpc.RpcError as exc:
                refused = exc
        assert refused.code() is grpc.StatusCode.FAILED_PRECONDITION, refused
        reason, metadata = reason_of(refused)
        assert (reason, metadata["ranks"], metadata["generation"]) == ("NOT_RUNNING", "1", "1")
        said = refused.details() or ""
        assert f"ReportFailure for rank 1 of job '{job_id}' generation 1 refused" in said, said
        assert "reports a failure only once its Join has returned" in said, said
        with RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as c:
            job = c.get_job()
            # Nothing recorded: rank 1 still joining, no loss to name later.
            assert job.summary.state == pb.JOB_STATE_FORMING and not job.failed
            assert [m.state for m in job.members] == [pb.MEMBER_STATE_JOINING]
            m = c.join(num_nodes=1, gpus_per_node=2, node_rank=0, local_rank=0, timeout=10)
            assert m.generation == 1 and parked.result(10).generation == 1
            job = c.get_job()
            assert job.summary.state == pb.JOB_STATE_RUNNING and not job.failed
    finally:
        parked.cancel()
