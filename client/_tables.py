"""GetMembers over a blocking channel of its own, for the fetches ``Membership.members``
makes when the client's channel cannot serve them: the asyncio client's (a plain
property cannot await), or a sync client already closed. With the call core's retry
policy and errors, so that a fetch fails alike whichever client makes it."""

from __future__ import annotations

import threading
import time

import grpc
from grpc_health.v1 import health_pb2_grpc

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from rendezvousd.client._calls import Blocking, Calls, Rpc, Run, Sleep
from rendezvousd.client._stubs import lazy_stub


class BlockingMembers:
    def __init__(self, calls: Calls) -> None:
        self._c = calls
        self._s = calls.s
        self._channel: grpc.Channel | None = None
        self._stubs: tuple[pb_grpc.RendezvousStub, health_pb2_grpc.HealthStub]
        self._lock = threading.Lock()

    def __call__(self, request: pb.GetMembersRequest) -> pb.GetMembersResponse:
        with self._lock:
            if self._channel is None:
                self._channel = self._c.channel(grpc.secure_channel, grpc.insecure_channel)
                # Kept with their channel, made as the clients' are (``_stubs``).
                self._stubs = (
                    lazy_stub(pb_grpc.RendezvousStub, self._channel),
                    lazy_stub(health_pb2_grpc.HealthStub, self._channel),
                )
            stub, health = self._stubs
        run = Run(self._c.call("GetMembers", request))
        for step in run:  # the call's, its retries' and, should it fail, the TLS probe's
            try:
                if isinstance(step, Rpc):
                    run.answer = step.invoke(stub, health, self._s.metadata)
                elif isinstance(step, Sleep):
                    time.sleep(step.seconds)
                elif isinstance(step, Blocking):
                    run.answer = step.work()
                else:  # Reachable: not asked; a failed fetch then probes for TLS (seconds)
                    run.answer = False
            except grpc.RpcError as exc:
                run.error = exc
        response: pb.GetMembersResponse = run.value
        return response

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()
                self._channel = None
