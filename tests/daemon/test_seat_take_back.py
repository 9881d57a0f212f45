"""A survivor's kept seat, claimed by host, is taken back (over the wire): a JoinNode
without ``previous_instance_id`` (any token holder can send one; so does a client
older than the field) used to take a survivor's kept seat by its host, which every
token holder can read, and the generation formed on it at once; the survivor, naming
its seat, was refused WORLD_FULL. The state-machine cases are in test_kept_seats.py;
this one checks the field's absence reaches the daemon as "not said"."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from tests.support import DaemonProcess


def _request(
    job_id: str, inst: str, host: str, previous: str | None, uid: bytes = b""
) -> pb.JoinNodeRequest:
    request = pb.JoinNodeRequest(
        job_id=job_id, min_nodes=2, max_nodes=2, gpus_per_node=1, host=host,
        instance_id=inst, wait_timeout_ms=20_000, unique_id=uid,
    )  # fmt: skip
    if previous is not None:
        request.previous_instance_id = previous
    return request


def test_a_survivor_takes_back_the_seat_a_join_without_previous_id_claimed(
    start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    daemon = start_daemon("--heartbeat-timeout-s", "60", "--seat-hold-s", "30")
    md = [("authorization", f"Bearer {daemon.token}")]
    with grpc.insecure_channel(daemon.endpoint) as channel:
        stub = pb_grpc.RendezvousStub(channel)

        def join(request: pb.JoinNodeRequest) -> pb.JoinNodeResponse:
            answer = stub.JoinNode(request, metadata=md, timeout=30)
            if answer.id_required:  # node 0: asked for the id, the SDK sends it
                request.unique_id = bytes([answer.generation]) * 128
                answer = stub.JoinNode(request, metadata=md, timeout=30)
            return answer  # type: ignore[no-any-return]

        assert stub.JoinNode(
            _request(job_id, "a", "host-a", ""), metadata=md, timeout=30
        ).id_required
        a = stub.JoinNode.future(
            _request(job_id, "a", "host-a", "", b"\x01" * 128), metadata=md, timeout=30
        )
        b = join(_request(job_id, "b", "host-b", ""))
        assert a.result().generation == b.generation
        stub.AbortJob(
            pb.AbortJobRequest(job_id=job_id, generation=b.generation, reason="a restart"),
            metadata=md,
            timeout=30,
        )
        # The claim by host: node 0 of the next generation, asked for the id.
        claim = stub.JoinNode(_request(job_id, "x", "host-a", None), metadata=md, timeout=30)
        assert claim.id_required
        squatter = stub.JoinNode.future(
            _request(job_id, "x", "host-a", None, b"\x07" * 128), metadata=md, timeout=30
        )
        b2 = stub.JoinNode.future(_request(job_id, "b2", "host-b", "b"), metadata=md, timeout=30)
        a2 = stub.JoinNode.future(_request(job_id, "a2", "host-a", "a"), metadata=md, timeout=30)
        with pytest.raises(grpc.RpcError) as told:
            squatter.result()
        assert told.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "was taken back by that node agent" in str(told.value.details())
        # a2 is node 0 again, as a was (x held it with a's seat, and its id went with
        # it): asked for the id. (b2, node 0 for the moment between x's leaving and a2's
        # seat, may have been asked too: its id is not taken from a node not node 0.)
        assert a2.result().id_required
        if b2.result().id_required:
            b2 = stub.JoinNode.future(
                _request(job_id, "b2", "host-b", "b", b"\x08" * 128), metadata=md, timeout=30
            )
        answer = stub.JoinNode(
            _request(job_id, "a2", "host-a", "a", b"\x09" * 128), metadata=md, timeout=30
        )
        assert answer.generation == b2.result().generation == b.generation + 1
        assert answer.node_rank == 0 and b2.result().node_rank == 1
        assert answer.num_nodes == 2  # a2 and b2: max_nodes, x refused above
        job = stub.GetJob(pb.GetJobRequest(job_id=job_id), metadata=md, timeout=30)
        assert job.summary.state == pb.JOB_STATE_RUNNING
        assert sorted({m.member.host for m in job.members}) == ["host-a", "host-b"]
