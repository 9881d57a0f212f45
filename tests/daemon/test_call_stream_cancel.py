"""A cancel on the call stream ends its call before the daemon reads the next one, as
a unary call's cancellation would: a client's re-join sent in the same CallBatch as
its cancelled join's cancel (asyncio.timeout around join(), retried at once) was
refused DuplicateRank by the seat its own cancelled join still held (every other
attempt). A retry of the cancelled join itself (its instance id: the SDK's resume of
a join it gave up) in that batch parks before the cancelled join ends, which then
fails nobody; a join cancelled in its own batch frees its seat too. A cancel sent
alone frees the join's seat, as the join's deadline does: the caller sent it, so it
is alive (a dead one's stream ends, which fails the forming generation). Many
cancels of one held join in a batch cost each O(1) (the batch's joins indexed once),
not a search of the batch's rest each: one 60 KB batch held the event loop, every
job's calls, for 7-11 s. Raw gRPC against a real daemon process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.server import call_stream
from rendezvousd.server.call_stream import CallStream
from tests.daemon.raw_calls import SERVICE
from tests.daemon.test_call_stream import Stream, status_of
from tests.support import DaemonProcess, scrape, wait_for


def _reason(status: status_pb2.Status) -> str:
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info.reason
    return ""


def _rank_zero(
    job_id: str, instance_id: str, wait_ms: int, id_byte: int, gpus: int = 2, local_rank: int = 0
) -> pb.JoinRequest:
    return pb.JoinRequest(
        job_id=job_id,
        topology=pb.Topology(num_nodes=1, gpus_per_node=gpus),
        node_rank=0,
        local_rank=local_rank,
        host="h0",
        unique_id=bytes([id_byte]) * 128 if local_rank == 0 else b"",
        instance_id=instance_id,
        wait_timeout_ms=wait_ms,
        slim=True,
    )


def test_a_join_in_the_batch_of_a_cancel_finds_the_cancelled_seat_free(
    daemon: DaemonProcess, job_id: str
) -> None:
    s = Stream(daemon, method="CallBatches")
    try:
        before = scrape(daemon.metrics_url)["rendezvousd_waiters"]
        s.send(1, "join", _rank_zero(job_id, "first", 30_000, 5), timeout_ms=35_000)
        wait_for(
            "the first join parked",
            lambda: scrape(daemon.metrics_url)["rendezvousd_waiters"] == before + 1,
        )
        with s.hold():  # one CallBatch: the cancel, then the re-join
            s.send(1, "cancel", pb.CancelCall())
            # Another id: a failed generation's id is used (ID_REUSED for a new one).
            s.send(2, "join", _rank_zero(job_id, "second", 300, 6), timeout_ms=5_300)
        got = status_of(s.reply(2))
        # Not DUPLICATE_RANK: the cancelled joiner's seat was free (its caller gave it
        # up, as at its deadline), so the re-join waited in generation 1 for the
        # missing rank until its own wait ended.
        assert (_reason(got), "generation 1" in got.message) == ("WORLD_INCOMPLETE", True), got
        assert 1 not in s.order()
    finally:
        s.close()


def test_a_join_cancelled_in_its_own_batch_frees_its_seat(
    daemon: DaemonProcess, job_id: str
) -> None:
    """The join, its cancel and a re-join in one CallBatch: the join's task was cancelled
    before it first ran, so its handler never saw the cancel and its seat stayed parked
    (the re-join refused DUPLICATE_RANK, the waiter counted until its deadline)."""
    s = Stream(daemon, method="CallBatches")
    try:
        before = scrape(daemon.metrics_url)["rendezvousd_waiters"]
        with s.hold():
            s.send(1, "join", _rank_zero(job_id, "first", 30_000, 5), timeout_ms=35_000)
            s.send(1, "cancel", pb.CancelCall())
            s.send(2, "join", _rank_zero(job_id, "second", 300, 6), timeout_ms=5_300)
        got = status_of(s.reply(2))
        assert (_reason(got), "generation 1" in got.message) == ("WORLD_INCOMPLETE", True), got
        wait_for(
            "the cancelled join's waiter gone",
            lambda: scrape(daemon.metrics_url)["rendezvousd_waiters"] == before,
        )
        assert 1 not in s.order()
    finally:
        s.close()


def test_a_retry_of_the_cancelled_join_in_its_batch_keeps_the_generation(
    daemon: DaemonProcess, job_id: str
) -> None:
    s = Stream(daemon, method="CallBatches")
    early = Stream(daemon, method="CallBatches")
    late = Stream(daemon, method="CallBatches")
    try:
        waiters = scrape(daemon.metrics_url)["rendezvousd_waiters"]
        early.send(1, "join", _rank_zero(job_id, "one", 30_000, 0, 3, 1), timeout_ms=35_000)
        wait_for(
            "rank 1 parked",
            lambda: scrape(daemon.metrics_url)["rendezvousd_waiters"] == waiters + 1,
        )
        zero = _rank_zero(job_id, "zero", 30_000, 5, 3)
        s.send(1, "join", zero, timeout_ms=35_000)
        wait_for(
            "rank 0 parked",
            lambda: scrape(daemon.metrics_url)["rendezvousd_waiters"] == waiters + 2,
        )
        with s.hold():  # one CallBatch: the cancel, then the same join again (resumed)
            s.send(1, "cancel", pb.CancelCall())
            s.send(2, "join", zero, timeout_ms=35_000)
        # Answered only once the batch before it was read: rank 2 then comes after
        # the retry, not before the cancel (it would form the world with call 1).
        s.send(3, "get_job", pb.GetJobRequest(job_id=job_id))
        assert s.reply(3).WhichOneof("response") == "get_job"
        late.send(1, "join", _rank_zero(job_id, "two", 30_000, 0, 3, 2), timeout_ms=35_000)
        # Cancelled before its retry parked, rank 0's join failed generation 1 as a
        # dead joiner's: every parked rank was answered PEER_FAILED.
        # (The latecomer then waited alone in generation 2.)
        for stream, call_id in ((early, 1), (s, 2), (late, 1)):
            answer = stream.reply(call_id)
            assert answer.WhichOneof("response") == "join", _reason(status_of(answer))
            assert answer.join.generation == 1
        assert 1 not in s.order()  # the cancelled call is not answered
    finally:
        for stream in (s, early, late):
            stream.close()


def test_a_cancel_alone_frees_the_seat_and_fails_nobody(daemon: DaemonProcess, job_id: str) -> None:
    """Ctrl-C in the blocking client's join: its cancel goes alone, the retry later.
    The cancel failed generation 1 as a dead joiner's (the peer parked was answered
    PEER_FAILED), and each such retry moved the job one generation on; the asyncio
    client's cancel, sent with its retry, kept it (client/test_twins.py)."""
    s = Stream(daemon, method="CallBatches")
    peer = Stream(daemon, method="CallBatches")
    try:
        waiters = scrape(daemon.metrics_url)["rendezvousd_waiters"]
        # A world of 3: rank 2 comes once the retry is in. Rank 1 gives up (rank 0's
        # id leaves with its seat, and its retry would be refused ID_REUSED).
        peer.send(1, "join", _rank_zero(job_id, "zero", 30_000, 5, 3), timeout_ms=35_000)
        one = _rank_zero(job_id, "one", 30_000, 0, 3, 1)
        s.send(1, "join", one, timeout_ms=35_000)
        wait_for(
            "both parked",
            lambda: scrape(daemon.metrics_url)["rendezvousd_waiters"] == waiters + 2,
        )
        s.send(1, "cancel", pb.CancelCall())
        # The cancel was read: the stream reads its next call only after it.
        s.send(2, "get_job", pb.GetJobRequest(job_id=job_id))
        job = s.reply(2).get_job
        assert (job.summary.generation, [m.member.rank for m in job.members]) == (1, [0])
        s.send(3, "join", one, timeout_ms=35_000)  # the retry, later: the same join
        s.send(4, "get_job", pb.GetJobRequest(job_id=job_id))  # read once the retry ran
        assert s.reply(4).WhichOneof("response") == "get_job"
        peer.send(2, "join", _rank_zero(job_id, "two", 30_000, 0, 3, 2), timeout_ms=35_000)
        for stream, call_id in ((peer, 1), (s, 3), (peer, 2)):
            answer = stream.reply(call_id)
            assert answer.WhichOneof("response") == "join", _reason(status_of(answer))
            assert answer.join.generation == 1
        assert 1 not in s.order()
    finally:
        s.close()
        peer.close()


# A cancel of call id 0 is 4 bytes on the wire (the id is not written): this many fill
# ~48 KB, under the daemon's 64 KiB request limit. Searched again per cancel, they were
# 72 M key comparisons on the event loop (h121 measured 7-11 s for 9,000 of 7 bytes).
_CANCELS = 12_000


def test_a_batch_of_many_cancels_of_a_held_join_does_not_stall_the_daemon(
    daemon: DaemonProcess, job_id: str
) -> None:
    """A job token's holder sends one CallBatch: a join that parks, thousands of cancels
    of it and its retry. Other callers, on other connections, are answered meanwhile
    (each within a generous 3 s; before, the loop was gone for over 7 s); the retry
    still holds the seat (the cancelled join ends as given up, failing nobody)."""
    s = Stream(daemon, method="CallBatches")
    other = grpc.insecure_channel(daemon.endpoint)
    get_job = other.unary_unary(
        f"/{SERVICE}/GetJob",
        request_serializer=pb.GetJobRequest.SerializeToString,
        response_deserializer=pb.GetJobResponse.FromString,
    )
    try:
        one = _rank_zero(job_id, "one", 30_000, 0, 2, 1)
        with s.hold():  # one CallBatch
            s.send(0, "join", one, timeout_ms=35_000)
            for _ in range(_CANCELS):
                s.send(0, "cancel", pb.CancelCall())
            s.send(1, "join", one, timeout_ms=35_000)
        s.send(2, "get_job", pb.GetJobRequest(job_id=job_id))  # read once the batch was
        end = time.monotonic() + 60
        probes = 0
        while 2 not in s.order():
            assert time.monotonic() < end, "the batch was not read within 60 s"
            try:
                get_job(
                    pb.GetJobRequest(job_id=job_id),
                    metadata=[("authorization", f"Bearer {daemon.token}")],
                    timeout=3,
                )
            except grpc.RpcError as e:
                assert e.code() != grpc.StatusCode.DEADLINE_EXCEEDED, (
                    f"another connection's GetJob waited over 3 s after {probes} answered: "
                    "the batch of cancels held the daemon's event loop"
                )
                # NOT_FOUND until the join is in: the daemon answered, which is the point.
                assert e.code() == grpc.StatusCode.NOT_FOUND, e
            probes += 1
        job = s.reply(2).get_job
        assert (job.summary.generation, [m.member.rank for m in job.members]) == (1, [1])
        s.send(3, "join", _rank_zero(job_id, "zero", 30_000, 5, 2), timeout_ms=35_000)
        for call_id in (1, 3):
            answer = s.reply(call_id)
            assert answer.WhichOneof("response") == "join", _reason(status_of(answer))
            assert answer.join.generation == 1
        assert 0 not in s.order()  # the cancelled join is not answered
    finally:
        other.close()
        s.close()


async def test_each_cancel_of_a_held_join_looks_for_its_retry_once_per_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Structural, in process: the identities of the batch's calls are read a bounded
    number of times per call (before: each cancel read those of every call after it),
    and the held join is cancelled only once its retry ran."""
    reads = 0
    key_of = call_stream._join_key

    def counted(call: pb.Call, field: str) -> Any:
        nonlocal reads
        reads += 1
        return key_of(call, field)

    monkeypatch.setattr(call_stream, "_join_key", counted)
    events: list[str] = []
    go = asyncio.Event()

    async def join(_request: Any, _context: Any) -> pb.JoinResponse:
        events.append("joined")
        try:
            await go.wait()
        except asyncio.CancelledError:
            events.append("cancelled")
            raise
        return pb.JoinResponse(generation=1)

    async def get_job(_request: Any, _context: Any) -> pb.GetJobResponse:
        go.set()  # read after the whole batch: the retry may be answered now
        return pb.GetJobResponse()

    request = pb.JoinRequest(job_id="j", instance_id="i")
    n = 2_000
    calls = [pb.Call(id=0, cancel=pb.CancelCall())] * n + [
        pb.Call(id=1, join=request),
        pb.Call(id=2, get_job=pb.GetJobRequest(job_id="j")),
    ]

    async def batches() -> AsyncIterator[pb.CallBatch]:
        yield pb.CallBatch(calls=[pb.Call(id=0, join=request)])
        while not events:  # parked: its task runs (a cancelled one never did)
            await asyncio.sleep(0)
        await asyncio.sleep(0.01)
        yield pb.CallBatch(calls=calls)

    got: list[pb.Reply] = []
    stream = CallStream({"join": join, "get_job": get_job}, max_in_flight=8)
    async with asyncio.timeout(30):
        async for message in stream.serve(batches(), batched=True):
            got.extend(pb.ReplyBatch.FromString(message).replies)
    assert reads <= 2 * len(calls), f"{reads} identity reads for a batch of {len(calls)}"
    assert events == ["joined", "joined", "cancelled"], events
    assert sorted(r.id for r in got) == [1, 2], got
