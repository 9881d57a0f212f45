"""The goodbye on the heartbeat stream, on the wire (protocol.md, "Leave on the stream"):
the attach's ack offers it, ``HeartbeatRequest.leave`` leaves the member (a node's: all
of its members), the daemon answers LEFT and ends the stream with OK; a member that
calls ``Leave`` instead (an older client) is unaffected."""

from __future__ import annotations

import queue
from collections.abc import Iterator

import grpc

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from rendezvousd.client import RendezvousClient
from tests.daemon.raw_calls import bearer
from tests.support import DaemonProcess, members, parallel


def _requests(sent: queue.Queue[pb.HeartbeatRequest | None]) -> Iterator[pb.HeartbeatRequest]:
    while (request := sent.get()) is not None:
        yield request


def _states(d: DaemonProcess, job_id: str) -> dict[int, int]:
    return {m.member.rank: m.state for m in members(d, job_id)}


def test_a_goodbye_on_the_stream_is_answered_left_and_ends_the_stream(
    daemon: DaemonProcess, job_id: str
) -> None:
    clients = [RendezvousClient(daemon.endpoint, job_id, token=daemon.token) for _ in range(2)]
    try:
        parallel(
            [
                lambda c=c, r=r: c.join(num_nodes=2, gpus_per_node=1, node_rank=r, local_rank=0)
                for r, c in enumerate(clients)
            ]
        )
        sent: queue.Queue[pb.HeartbeatRequest | None] = queue.Queue()
        first = pb.HeartbeatRequest(**clients[1]._kv_scope())
        with grpc.insecure_channel(daemon.endpoint) as channel:
            stream = pb_grpc.RendezvousStub(channel).Heartbeat(
                _requests(sent), metadata=bearer(daemon), timeout=30
            )
            sent.put(first)
            ack = next(stream)
            assert ack.kind == pb.JobEvent.HEARTBEAT_ACK and ack.stream_leave
            goodbye = pb.HeartbeatRequest()
            goodbye.CopyFrom(first)
            goodbye.leave = True
            sent.put(goodbye)
            events = [e.kind for e in stream]  # until the daemon ends the stream
            sent.put(None)
            assert events[-1:] == [pb.JobEvent.LEFT], events
            assert stream.code() == grpc.StatusCode.OK
        assert _states(daemon, job_id)[1] == pb.MEMBER_STATE_LEFT
        with RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as probe:
            assert probe.get_job().summary.state == pb.JOB_STATE_RUNNING
        # The other member, without a stream, leaves by the Leave call, as before.
        clients[0].leave()
        with RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as probe:
            assert probe.get_job().summary.state == pb.JOB_STATE_ENDED
    finally:
        for c in clients:
            c.close()
