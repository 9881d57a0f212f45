"""GetMembers over a blocking channel of its own, for the fetches ``Membership.members``
makes when the client's channel cannot serve them: the asyncio client's (a plain
property cannot await), or a sync client already closed. With the call core's retry
policy and errors, so that a fetch fails alike whichever client makes it."""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from rendezvousd.client._calls import Blocking, Calls, Renew, Rpc, Run, Sleep
from rendezvousd.client._stubs import lazy_stub
from rendezvousd.client.connection import connected


class BlockingMembers:
    def __init__(self, calls: Calls) -> None:
        self._c = calls
        self._s = calls.s
        self._channel: grpc.Channel | None = None
        self._stubs: tuple[pb_grpc.RendezvousStub, health_pb2_grpc.HealthStub]
        # The TLS files' renewal the channel was made at: made once, it showed the
        # certificate of that moment for the client's life, and after a renewal and a
        # daemon trusting only the new CA every fetch was refused at the handshake.
        self._made = 0
        # Closed with this holder, as the clients' are (``RendezvousClient._replaced``).
        self._replaced: list[grpc.Channel] = []
        self._lock = threading.Lock()

    def _open(self, made: int, credentials: Any = None) -> None:
        self._channel = channel = self._c.channel(
            grpc.secure_channel, grpc.insecure_channel, credentials
        )
        self._made = made
        # Kept with their channel, made as the clients' are (``_stubs``).
        self._stubs = (
            lazy_stub(pb_grpc.RendezvousStub, channel),
            lazy_stub(health_pb2_grpc.HealthStub, channel),
        )

    def _renew(self) -> bool:
        """``steps.Renew``, as the clients' channels take it: the same decision
        (``Calls.renewed``), for this channel's own renewal."""
        with self._lock:
            if self._channel is None or connected(self._channel):
                return False
            renewal = self._c.renewed(self._made)
            if renewal is None:
                return False
            self._replaced.append(self._channel)
            self._open(*renewal)
        return True

    def __call__(self, request: pb.GetMembersRequest) -> pb.GetMembersResponse:
        with self._lock:
            if self._channel is None:
                # At the renewal the client's files were last taken at, if any.
                files = self._c.files
                self._open(0 if files is None else files.renewals)
        run = Run(self._c.call("GetMembers", request, look=False))
        for step in run:  # the call's, its retries' and, should it fail, the TLS probe's
            try:
                if isinstance(step, Rpc):
                    with self._lock:
                        stub, health = self._stubs
                    run.answer = step.invoke(stub, health, self._s.metadata)
                elif isinstance(step, Sleep):
                    time.sleep(step.seconds)
                elif isinstance(step, Blocking):
                    run.answer = step.work()
                elif isinstance(step, Renew):
                    run.answer = self._renew()
                else:  # Reachable: not asked; a failed fetch then probes for TLS (seconds)
                    run.answer = False
            except grpc.RpcError as exc:
                run.error = exc
        response: pb.GetMembersResponse = run.value
        return response

    def close(self) -> None:
        with self._lock:
            channels, self._replaced = self._replaced, []
            if self._channel is not None:
                channels.append(self._channel)
                self._channel = None
        for channel in channels:
            channel.close()
