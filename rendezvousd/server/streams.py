"""Heartbeat streams: one per member (node agent), carrying its heartbeats in and the
job's events and acks out, and how each ends.

The state machine decides what a heartbeat, a stream's attach and its end mean; this
module only keeps the open streams, pushes ``Notify`` effects onto them, and ends a
stream whose member a failed commit undid.

A member may say goodbye on its stream (``HeartbeatRequest.leave``) rather than by a
``Leave`` call (issue 21). Messages on one stream are read in order, so the goodbye is
applied before the stream's end is seen, and that end is not read as a death however
late the daemon reads it, as long as the client keeps the stream until LEFT (the SDK
does; a reset right behind an unread message may drop it inside gRPC). A job's end at
scale (4,096 Leaves at once) outlasted the SDK's leave deadline, and each stream the
SDK then closed lost its member: nothing orders a unary Leave against the stream's
end, and its deadline may cancel it before it is read. The goodbye is also cheaper:
one message on an open stream, not a call.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import grpc

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.common.model import Effect, EventKind, JoinMode, Notify, Progress
from rendezvousd.errors import RendezvousFault
from rendezvousd.server.answers import failed_member
from rendezvousd.server.metrics import Metrics
from rendezvousd.state.machine import RendezvousState
from rendezvousd.storage.faults import kept_goodbye

# (job, generation, the mode its attendee joined in, its rank): workers and node agents
# stream alike.
_StreamKey = tuple[str, int, JoinMode, int]
# What a stream's writer takes: an event, a fault that ends the stream, or None (its end).
_Item = pb.JobEvent | RendezvousFault | None


class HeartbeatStreams:
    def __init__(
        self,
        state: RendezvousState,
        metrics: Metrics,
        apply: Callable[[], None],
        now: Callable[[], float],
        durably: Callable[[str, list[Effect]], Coroutine[Any, Any, None]],
        decided: Callable[[], None],
    ) -> None:
        self.state = state
        self.metrics = metrics
        self._apply = apply
        self._now = now
        # The servicer's: a change's wakes and events go out once it is durable.
        self._durably = durably
        # ...and what a stream's end decided (a loss): out once durable, not awaited.
        self._decided = decided
        self._open: dict[_StreamKey, tuple[int, asyncio.Queue[_Item]]] = {}

    def push(self, effect: Notify) -> None:
        now = self._now()
        event = pb.JobEvent(
            kind=pb.JobEvent.Kind.ValueType(effect.kind.value),
            job_id=effect.job_id,
            generation=effect.generation,
            failed=[failed_member(f, now) for f in effect.failed],
            reason=effect.reason,
            nodes_waiting=effect.nodes_waiting,
            abort_cause=pb.AbortCause.ValueType(effect.abort_cause.value),
        )
        if effect.kind is EventKind.JOB_ABORTED:
            # Always said, so a reader tells "not a close" from a daemon from before.
            event.closed = effect.closed
        for who in effect.to:
            stream = self._open.get((effect.job_id, effect.generation, effect.mode, who))
            if stream is not None:
                stream[1].put_nowait(event)

    def end_all(self) -> None:
        """The daemon drains: every stream ends once it has sent what it holds (its
        ``DAEMON_DRAINING`` last), which is no member's loss while the daemon drains
        (``seats.stream_job``). A client that hears the drain closes its stream anyway;
        one stopped or cut off held the drain for its whole grace period, and grpc then
        cancelled its handler with an "Exception not handled ... CancelledError"
        traceback after "rendezvousd stopped"."""
        for _token, queue in self._open.values():
            queue.put_nowait(None)

    def end_undone(self, job_id: str, fault: RendezvousFault) -> None:
        """``job_id`` was put back to its durable state: a stream whose member (node
        agent) is no longer in it ends with ``fault``; the others go on."""
        for key, (token, queue) in list(self._open.items()):
            if key[0] == job_id and not self.state.stream_current(
                job_id, key[1], key[3], token, key[2]
            ):
                queue.put_nowait(fault)

    async def serve(
        self,
        first: pb.HeartbeatRequest,
        iterator: AsyncIterator[pb.HeartbeatRequest],
        peer: str = "",
        connection: str = "",
    ) -> AsyncIterator[pb.JobEvent]:
        """The stream whose first request is ``first`` (from host ``peer``, over the
        gRPC peer ``connection``): events until it ends."""
        mode = JoinMode.of_caller(first.node)
        key = (first.job_id, first.generation, mode, first.rank)
        token = self.state.attach_stream(
            first.job_id,
            first.generation,
            first.rank,
            first.instance_id,
            self._now(),
            mode=mode,
            peer=peer,
            connection=connection,
        )
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        # Acknowledge the attach at once: a client reattaching after a restart
        # knows it is heard again without waiting for the next heartbeat.
        queue.put_nowait(
            pb.JobEvent(
                kind=pb.JobEvent.HEARTBEAT_ACK,
                job_id=key[0],
                generation=key[1],
                stream_leave=True,
            )
        )
        if first.HasField("progress"):
            self.state.report_progress(*key[:2], key[3], _progress(first.progress), mode=mode)
        entry = (token, queue)
        self._open[key] = entry
        self._apply()  # events owed to a stream as it attaches (NODES_WAITING)
        reader = asyncio.create_task(self._read(key, first, iterator, queue))
        self.metrics.streams.inc()
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, RendezvousFault):
                    raise item
                yield item
        finally:
            reader.cancel()
            self.metrics.streams.dec()
            if self._open.get(key) is entry:
                del self._open[key]
            # Its connection may have been reset under it: gRPC ends its requests
            # then as it does for a client that closed them (h165, on namespace hosts).
            self.state.detach_stream(*key[:2], first.rank, token, self._now(), mode=mode, cut=True)
            self._decided()

    async def _read(
        self,
        key: _StreamKey,
        first: pb.HeartbeatRequest,
        iterator: AsyncIterator[pb.HeartbeatRequest],
        queue: asyncio.Queue[_Item],
    ) -> None:
        # Acks let the client tell "the daemon hears me" from a silent network; a
        # tenth of the timeout bounds their cost when clients heartbeat often.
        ack_every = self.state.timing.heartbeat_timeout_s / 10
        ack = pb.JobEvent(kind=pb.JobEvent.HEARTBEAT_ACK, job_id=key[0], generation=key[1])
        acked = self._now()
        reported: pb.Progress | None = None
        try:
            if first.leave:
                await self._leave(key, first.instance_id, queue)
                return
            async for request in iterator:
                if request.leave:
                    # The goodbye carries the last steps: what GetJob and `status` then
                    # show of the ended job (it showed the beat before's).
                    with contextlib.suppress(RendezvousFault):
                        self._report(key, request, reported)
                    await self._leave(key, first.instance_id, queue)
                    return
                now = self._now()
                try:
                    self.state.heartbeat(key[0], key[1], key[3], now, mode=key[2])
                    reported = self._report(key, request, reported)
                except RendezvousFault:
                    break  # the generation ended; its events were already pushed
                if now - acked >= ack_every:
                    acked = now
                    queue.put_nowait(ack)
        except (asyncio.CancelledError, grpc.RpcError, grpc.aio.AioRpcError):
            pass
        finally:
            queue.put_nowait(None)

    def _report(
        self, key: _StreamKey, request: pb.HeartbeatRequest, reported: pb.Progress | None
    ) -> pb.Progress | None:
        """``request``'s progress given to the state when it differs from ``reported``
        (converted only then: most beats repeat the last one); the progress reported."""
        if not request.HasField("progress") or request.progress == reported:
            return reported
        self.state.report_progress(*key[:2], key[3], _progress(request.progress), mode=key[2])
        return request.progress

    async def _leave(self, key: _StreamKey, instance_id: str, queue: asyncio.Queue[_Item]) -> None:
        """The stream's goodbye: applied at once, before anything can end the stream
        (so its end, read next, finds the member LEFT), then LEFT once durable."""
        try:
            kept = self.state.leave(*key[:2], key[3], instance_id, self._now(), mode=key[2])
        except RendezvousFault as refused:
            self._apply()
            queue.put_nowait(refused)  # Leave's own error, as the call would give it
            return
        # The client may close the stream before the commit: the leave's events
        # (JOB_ENDED, a barrier it completed) still go out (``_durably``).
        try:
            await self._durably(key[0], self.state.take_effects())
        except RendezvousFault as fault:  # storage failed: undone, kept as a goodbye
            queue.put_nowait(kept_goodbye(fault, key[0]) if kept else fault)
            return
        queue.put_nowait(pb.JobEvent(kind=pb.JobEvent.LEFT, job_id=key[0], generation=key[1]))


def _progress(message: pb.Progress) -> Progress:
    """A beat's Progress as the state machine keeps it (-1: no step yet)."""
    return Progress(
        tuple(None if s < 0 else s for s in message.steps),
        message.restarts_used,
        message.max_restarts,
    )
