"""GetMembers over a blocking channel of its own, for the fetches ``Membership.members``
makes when the client's channel cannot serve them: the asyncio client's (a plain
property cannot await), or a sync client already closed."""

from __future__ import annotations

import threading

import grpc

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from rendezvousd.client._calls import Calls
from rendezvousd.client.errors import from_rpc_error


class BlockingMembers:
    def __init__(self, calls: Calls) -> None:
        self._c = calls
        self._s = calls.s
        self._channel: grpc.Channel | None = None
        self._lock = threading.Lock()

    def __call__(self, request: pb.GetMembersRequest) -> pb.GetMembersResponse:
        with self._lock:
            if self._channel is None:
                self._channel = self._c.channel(grpc.secure_channel, grpc.insecure_channel)
            stub = pb_grpc.RendezvousStub(self._channel)
        try:
            response: pb.GetMembersResponse = stub.GetMembers(
                request, timeout=self._s.call_timeout, metadata=self._s.metadata
            )
            return response
        except grpc.RpcError as exc:
            raise from_rpc_error(
                exc,
                endpoint=self._s.endpoint,
                method="GetMembers",
                job_id=request.job_id,
                rank=request.rank,
            ) from None

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()
                self._channel = None
