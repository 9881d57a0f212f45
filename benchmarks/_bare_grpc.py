"""rpc_cost.py's anchors: a bare grpc.aio server, its floor client's call stream, and the
messages a client process has sent and received.

Run as a script (``python benchmarks/_bare_grpc.py asyncio|uvloop``) it is the bare
server, in its own process, on that event loop; it prints its port. It holds nothing of
the daemon: grpcio-health-checking's servicer (the unary floor), and two stream methods
under the daemon's method names, answering on the wire as the daemon does with the least
work a server of that protocol can do:

- ``CallBatches``: each CallBatch (decoded by gRPC's request deserializer,
  ``CallBatch.FromString``, as the daemon's is) is answered at once by one ReplyBatch
  holding, per call, a Reply with the call's id and a canned response of the call's own
  field (KvGet: the 64-byte value the benchmark stores; KvSet: empty; Barrier: a
  sequence), written by hand as the daemon writes its replies. Per call: its id and its
  field read, a few bytes joined; no state, no authentication, no deadline.
- ``Heartbeat``: every HeartbeatRequest is read (decoded by gRPC, as the daemon's are);
  the first is acknowledged (HEARTBEAT_ACK with stream_leave, the daemon's attach ack)
  and then one beat a second at most (the daemon's tenth of its default 10 s timeout);
  the stream ends when the client half-closes it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

CALLS_METHOD = "/rendezvous.v1.Rendezvous/CallBatches"
# The daemon acknowledges beats at most every tenth of its heartbeat timeout (10 s).
ACK_EVERY_S = 1.0
# The value rpc_cost.py's KvGet reads (its KvSet stores it).
KV_VALUE = b"v" * 64


def _server_handler() -> Any:
    import grpc

    from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb

    # The daemon's own varint encoder: a varint costs the same on both sides.
    from rendezvousd.server.call_stream import _varint

    bodies = {
        "kv_get": pb.KvGetResponse(value=KV_VALUE).SerializeToString(),
        "kv_set": pb.KvSetResponse().SerializeToString(),
        "barrier": pb.BarrierResponse(sequence=200).SerializeToString(),
    }
    number = {f.name: f.number for f in pb.Reply.DESCRIPTOR.fields}
    # Each Reply's tail after its id: the response as a length-delimited field.
    tails = {k: _varint(number[k] << 3 | 2) + _varint(len(v)) + v for k, v in bodies.items()}

    async def call_batches(batches: AsyncIterator[Any], context: Any) -> AsyncIterator[bytes]:
        async for batch in batches:
            entries = []
            for call in batch.calls:
                one = b"\x08" + _varint(call.id) + tails[call.WhichOneof("request")]
                entries.append(b"\x0a" + _varint(len(one)) + one)  # ReplyBatch.replies
            yield b"".join(entries)

    async def heartbeat(beats: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        acked = None
        ack = None
        async for beat in beats:
            now = time.monotonic()
            if acked is None:
                acked = now
                yield pb.JobEvent(
                    kind=pb.JobEvent.HEARTBEAT_ACK,
                    job_id=beat.job_id,
                    generation=beat.generation,
                    stream_leave=True,
                )
                ack = pb.JobEvent(
                    kind=pb.JobEvent.HEARTBEAT_ACK, job_id=beat.job_id, generation=beat.generation
                )
            elif now - acked >= ACK_EVERY_S:
                acked = now
                yield ack

    return grpc.method_handlers_generic_handler(
        "rendezvous.v1.Rendezvous",
        {
            "CallBatches": grpc.stream_stream_rpc_method_handler(
                call_batches, request_deserializer=pb.CallBatch.FromString
            ),
            "Heartbeat": grpc.stream_stream_rpc_method_handler(
                heartbeat,
                request_deserializer=pb.HeartbeatRequest.FromString,
                response_serializer=pb.JobEvent.SerializeToString,
            ),
        },
    )


async def _serve() -> None:
    import grpc
    from grpc_health.v1 import _async as health
    from grpc_health.v1 import health_pb2_grpc

    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    server.add_generic_rpc_handlers((_server_handler(),))
    print(server.add_insecure_port("127.0.0.1:0"), flush=True)
    await server.start()
    await server.wait_for_termination()


def serve(event_loop: str) -> None:
    factory = None
    if event_loop == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(_serve())


# -- the floor's client --------------------------------------------------------------


def message_sizes(calls: int, messages: int, concurrency: int) -> list[int]:
    """``calls`` spread as evenly as can be over ``messages`` messages (none above
    ``concurrency``, the calls a client has in flight)."""
    messages = max(messages, -(-calls // concurrency), 1)
    messages = min(messages, max(calls, 1))
    return [calls * (i + 1) // messages - calls * i // messages for i in range(messages)]


class BatchedCalls:
    """One CallBatches stream, opened before any round, fed whole CallBatches of a
    given size while at most ``concurrency`` calls are unanswered: the server sees
    what the SDK's stream sent it (the same messages, the same number of calls in each,
    the same calls in flight), from a client that does nothing else."""

    def __init__(self, channel: Any, metadata: Any, concurrency: int) -> None:
        from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb

        self._pb = pb
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._free = concurrency
        self._answered = 0
        self._wake = asyncio.Event()
        self._ids = itertools.count(1)
        multi = channel.stream_stream(
            CALLS_METHOD,
            request_serializer=pb.CallBatch.SerializeToString,
            response_deserializer=pb.ReplyBatch.FromString,
        )
        self._call = multi(self._requests(), metadata=metadata, wait_for_ready=True)
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _requests(self) -> AsyncIterator[Any]:
        while (batch := await self._queue.get()) is not None:
            yield batch

    async def _read(self) -> None:
        try:
            async for batch in self._call:
                self._free += len(batch.replies)
                self._answered += len(batch.replies)
                self._wake.set()
        finally:
            self._wake.set()

    async def _woken(self) -> None:
        self._wake.clear()
        await self._wake.wait()
        if self._reader.done():
            self._reader.result()
            raise RuntimeError("the bare server ended the CallBatches stream")

    async def round(self, field: str, request: Any, sizes: list[int]) -> int:
        """Send ``sizes`` CallBatches of ``request`` (a ``field`` call); once all are
        answered, the number of calls."""
        target = self._answered + sum(sizes)
        for n in sizes:
            while self._free < n:
                await self._woken()
            self._free -= n
            calls = []
            for _ in range(n):
                call = self._pb.Call(id=next(self._ids), timeout_ms=30_000)
                getattr(call, field).CopyFrom(request)
                calls.append(call)
            self._queue.put_nowait(self._pb.CallBatch(calls=calls))
        while self._answered < target:
            await self._woken()
        return sum(sizes)

    async def close(self) -> None:
        self._queue.put_nowait(None)
        await self._reader


def messages() -> tuple[int, int]:
    """Messages this process's gRPC channels have sent and received so far, over every
    connection (gRPC core's channelz counters: what went on the wire, whoever sent it)."""
    from grpc._cython import cygrpc

    sent = received = 0
    start = 0
    while True:
        page = json.loads(cygrpc.channelz_get_top_channels(start))
        for channel in page.get("channel", []):
            start = max(start, int(channel["ref"]["channelId"]) + 1)
            for ref in channel.get("subchannelRef", []):
                sub = json.loads(cygrpc.channelz_get_subchannel(int(ref["subchannelId"])))
                for sock in sub["subchannel"].get("socketRef", []):
                    data = json.loads(cygrpc.channelz_get_socket(int(sock["socketId"])))
                    data = data["socket"].get("data", {})
                    sent += int(data.get("messagesSent", 0))
                    received += int(data.get("messagesReceived", 0))
        if page.get("end", False) or not page.get("channel"):
            return sent, received


if __name__ == "__main__":
    serve(sys.argv[1])
