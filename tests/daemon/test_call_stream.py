"""The Calls stream on the wire: every unary method as messages on one stream,
answered by id in any order, with the same answers and statuses as the unary calls.
Raw gRPC (not the SDK), against a real daemon process."""

from __future__ import annotations

import asyncio
import contextvars
import queue
import signal
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.common.calls import DRAINED_TRAILER
from rendezvousd.common.version import installed_version
from rendezvousd.server.call_stream import CallStream, method_fields
from rendezvousd.server.scope import derive_job_token
from tests.daemon.raw_calls import SERVICE, UNARY, assert_healthy
from tests.daemon.test_scoped_tokens import job_token
from tests.support import DaemonProcess, scrape, wait_for


def _identity(data: bytes) -> bytes:
    return data


class Stream:
    """One raw stream, ``Calls`` or ``CallBatches``: send Calls, read Replies by id.
    On CallBatches every Call queued when gRPC asks for the next message goes in one
    CallBatch (``hold()`` queues calls to go together), and ``batches`` records how
    many Replies each ReplyBatch held."""

    def __init__(self, d: DaemonProcess, token: str | None = None, method: str = "Calls") -> None:
        self.channel = grpc.insecure_channel(d.endpoint)
        self.batched = method == "CallBatches"
        self._out: queue.Queue[pb.Call | None] = queue.Queue()
        self._replies: dict[int, pb.Reply] = {}
        self._order: list[int] = []
        self._cond = threading.Condition()
        self._held = threading.Lock()
        self.batches: list[int] = []
        self.ended: grpc.RpcError | None = None
        # A ReplyBatch's ``drained``, once one said it, and the Replies read before it.
        self.drained = b""
        self.drained_after: list[int] = []
        # The stream ended, OK or not.
        self.finished = threading.Event()
        call = self.channel.stream_stream(
            f"/{SERVICE}/{method}",
            request_serializer=_identity,
            response_deserializer=(pb.ReplyBatch if self.batched else pb.Reply).FromString,
        )
        self._call = call(
            self._requests(),
            metadata=[("authorization", f"Bearer {token or d.token}")],
            timeout=60,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def hold(self) -> Any:
        """``with stream.hold(): ...``: the calls sent inside go as one CallBatch."""
        return self._held

    def _requests(self) -> Iterator[bytes]:
        while (call := self._out.get()) is not None:
            if not self.batched:
                yield call.SerializeToString()
                continue
            calls, ended = [call], False
            with self._held:  # every call sent under hold() is queued by now
                while not self._out.empty():
                    if (more := self._out.get()) is None:
                        ended = True
                        break
                    calls.append(more)
            yield pb.CallBatch(calls=calls).SerializeToString()
            if ended:
                return

    def _read(self) -> None:
        try:
            for message in self._call:
                got = list(message.replies) if self.batched else [message]
                with self._cond:
                    self.batches.append(len(got))
                    for r in got:
                        self._replies[r.id] = r
                        self._order.append(r.id)
                    if self.batched and message.drained:
                        self.drained, self.drained_after = message.drained, list(self._order)
                    self._cond.notify_all()
        except grpc.RpcError as exc:
            with self._cond:
                self.ended = exc
                self._cond.notify_all()
        finally:
            self.finished.set()

    def send(self, call_id: int, field: str, request: Any, timeout_ms: int = 0) -> None:
        call = pb.Call(id=call_id, timeout_ms=timeout_ms)
        getattr(call, field).CopyFrom(request)
        self._out.put(call)

    def reply(self, call_id: int, timeout: float = 20) -> pb.Reply:
        with self._cond:
            if not self._cond.wait_for(
                lambda: call_id in self._replies or self.ended is not None, timeout
            ):
                raise AssertionError(f"no reply to call {call_id} within {timeout} s")
            if call_id not in self._replies:
                raise AssertionError(f"the stream ended: {self.ended}")
            return self._replies[call_id]

    def trailing_metadata(self) -> Any:
        return self._call.trailing_metadata()

    def order(self) -> list[int]:
        with self._cond:
            return list(self._order)

    def wait_ended(self, timeout: float = 20) -> grpc.RpcError:
        with self._cond:
            assert self._cond.wait_for(lambda: self.ended is not None, timeout)
            assert self.ended is not None
            return self.ended

    def close(self) -> None:
        self._out.put(None)
        self._reader.join(20)
        self.channel.close()


@pytest.fixture(params=["Calls", "CallBatches"])
def stream(daemon: DaemonProcess, request: pytest.FixtureRequest) -> Iterator[Stream]:
    s = Stream(daemon, method=request.param)
    yield s
    s.close()


def status_of(r: pb.Reply) -> status_pb2.Status:
    assert r.WhichOneof("response") == "error", r
    return status_pb2.Status.FromString(r.error)


def unary(d: DaemonProcess, method: str, request: Any) -> Any:
    with grpc.insecure_channel(d.endpoint) as ch:
        out = getattr(pb, method + "Response", None) or pb.JoinResponse
        return ch.unary_unary(
            f"/{SERVICE}/{method}",
            request_serializer=type(request).SerializeToString,
            response_deserializer=out.FromString,
        )(request, metadata=[("authorization", f"Bearer {d.token}")], timeout=20)


def join_one(job_id: str) -> pb.JoinRequest:
    return pb.JoinRequest(
        job_id=job_id,
        topology=pb.Topology(num_nodes=1, gpus_per_node=1),
        node_rank=0,
        local_rank=0,
        host="h0",
        unique_id=b"\x01" * 128,
        instance_id="i0",
    )


def test_every_unary_method_has_a_call_and_a_reply_field_of_its_types() -> None:
    fields = method_fields()
    assert sorted(fields.values()) == sorted(UNARY)
    methods = pb.DESCRIPTOR.services_by_name["Rendezvous"].methods_by_name
    for field, method in fields.items():
        reply_field = pb.Reply.DESCRIPTOR.fields_by_name[field]
        assert reply_field.message_type is methods[method].output_type, field


def test_calls_answer_as_the_unary_methods_do(stream: Stream, job_id: str) -> None:
    stream.send(1, "join", join_one(job_id))
    joined = stream.reply(1).join
    assert (joined.rank, joined.world_size, joined.generation) == (0, 1, 1)
    member = {"job_id": job_id, "generation": 1, "rank": 0, "instance_id": "i0"}
    stream.send(2, "kv_set", pb.KvSetRequest(**member, key="k", value=b"v"))
    assert stream.reply(2).WhichOneof("response") == "kv_set"
    stream.send(3, "kv_add", pb.KvAddRequest(**member, key="n", delta=5))
    assert stream.reply(3).kv_add.value == 5
    stream.send(4, "kv_get", pb.KvGetRequest(**member, key="k"))
    assert stream.reply(4).kv_get.value == b"v"
    stream.send(5, "barrier", pb.BarrierRequest(**member, name="b", sequence=1))
    assert stream.reply(5).WhichOneof("response") == "barrier"
    stream.send(6, "get_job", pb.GetJobRequest(job_id=job_id))
    assert stream.reply(6).get_job.summary.world_size == 1
    stream.send(7, "list_jobs", pb.ListJobsRequest())
    assert job_id in [j.job_id for j in stream.reply(7).list_jobs.jobs]


def test_an_error_is_the_unary_calls_status_and_the_stream_goes_on(
    daemon: DaemonProcess, stream: Stream, job_id: str
) -> None:
    unary(daemon, "Join", join_one(job_id))
    missing = pb.KvGetRequest(
        job_id=job_id, generation=1, rank=0, instance_id="i0", key="absent", wait=False
    )
    with pytest.raises(grpc.RpcError) as raised:
        unary(daemon, "KvGet", missing)
    trailer = dict(raised.value.trailing_metadata())["grpc-status-details-bin"]
    stream.send(1, "kv_get", missing)
    got = status_of(stream.reply(1))
    assert got == status_pb2.Status.FromString(trailer)
    assert got.code == raised.value.code().value[0]  # NOT_FOUND
    stream.send(2, "get_job", pb.GetJobRequest(job_id=job_id))
    assert stream.reply(2).get_job.summary.job_id == job_id


def _parked(d: DaemonProcess) -> float:
    return scrape(d.metrics_url)["rendezvousd_waiters"]


def _two_rank_job(d: DaemonProcess, stream: Stream, job_id: str) -> dict[str, Any]:
    two = pb.Topology(num_nodes=2, gpus_per_node=1)
    stream.send(
        100,
        "join",
        pb.JoinRequest(
            job_id=job_id,
            topology=two,
            node_rank=0,
            local_rank=0,
            host="h0",
            unique_id=b"\x03" * 128,
            instance_id="i0",
        ),
    )
    unary(
        d,
        "Join",
        pb.JoinRequest(
            job_id=job_id, topology=two, node_rank=1, local_rank=0, host="h1", instance_id="i1"
        ),
    )
    stream.reply(100)
    return {"job_id": job_id, "generation": 1, "rank": 0, "instance_id": "i0"}


def _rank_1_enters_barrier_b(d: DaemonProcess, job_id: str) -> None:
    """``_two_rank_job``'s rank 1 enters barrier "b" (unary, from outside the stream)."""
    unary(
        d,
        "Barrier",
        pb.BarrierRequest(
            job_id=job_id, generation=1, rank=1, instance_id="i1", name="b", sequence=1
        ),
    )


def test_a_parked_call_does_not_hold_up_the_calls_behind_it(
    daemon: DaemonProcess, stream: Stream, job_id: str
) -> None:
    member = _two_rank_job(daemon, stream, job_id)
    stream.send(2, "barrier", pb.BarrierRequest(**member, name="b", sequence=1))
    stream.send(3, "kv_set", pb.KvSetRequest(**member, key="k", value=b"v"))
    stream.reply(3)
    assert 2 not in stream.order()  # rank 1 has not arrived: the barrier waits
    _rank_1_enters_barrier_b(daemon, job_id)
    assert stream.reply(2).WhichOneof("response") == "barrier"
    assert stream.order().index(3) < stream.order().index(2)


def test_a_batchs_calls_are_answered_together_in_one_reply_batch(
    daemon: DaemonProcess, job_id: str
) -> None:
    """What CallBatches is for: 16 calls in one message are answered in one or two
    messages (the daemon writes every reply ready), not one message each."""
    s = Stream(daemon, method="CallBatches")
    try:
        member = _two_rank_job(daemon, s, job_id)
        s.send(1, "kv_set", pb.KvSetRequest(**member, key="k", value=b"v"))
        s.reply(1)
        before = len(s.batches)
        with s.hold():
            for i in range(16):
                s.send(10 + i, "kv_get", pb.KvGetRequest(**member, key="k"))
        assert all(s.reply(10 + i).kv_get.value == b"v" for i in range(16))
        assert sum(s.batches[before:]) == 16
        assert len(s.batches) - before <= 2, f"16 replies in messages of {s.batches[before:]}"
    finally:
        s.close()


def test_a_parked_call_in_a_batch_holds_up_neither_the_batch_nor_its_errors(
    daemon: DaemonProcess, job_id: str
) -> None:
    """A batch is its calls one by one: a Barrier that waits, a call with an error
    and a KvSet in one message; the KvSet and the error are answered at once, the
    Barrier when its peer comes, and a cancel in a later batch ends a parked call."""
    s = Stream(daemon, method="CallBatches")
    try:
        member = _two_rank_job(daemon, s, job_id)
        before = _parked(daemon)
        with s.hold():
            s.send(1, "barrier", pb.BarrierRequest(**member, name="b", sequence=1))
            s.send(2, "get_job", pb.GetJobRequest(job_id="bad id with spaces"))
            s.send(3, "kv_set", pb.KvSetRequest(**member, key="k", value=b"v"))
            s.send(4, "kv_get", pb.KvGetRequest(**member, key="never", wait=True))
        assert s.reply(3).WhichOneof("response") == "kv_set"
        assert status_of(s.reply(2)).code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        wait_for("both calls parked", lambda: _parked(daemon) == before + 2)
        s.send(4, "cancel", pb.CancelCall())
        wait_for("the KvGet released", lambda: _parked(daemon) == before + 1)
        _rank_1_enters_barrier_b(daemon, job_id)
        assert s.reply(1).WhichOneof("response") == "barrier"
        assert 4 not in s.order()
    finally:
        s.close()


def test_cancel_releases_a_parked_call_and_sends_no_reply(
    daemon: DaemonProcess, stream: Stream, job_id: str
) -> None:
    member = _two_rank_job(daemon, stream, job_id)
    before = _parked(daemon)
    stream.send(1, "kv_get", pb.KvGetRequest(**member, key="later", wait=True))
    wait_for("the KvGet parked", lambda: _parked(daemon) == before + 1)
    stream.send(1, "cancel", pb.CancelCall())
    wait_for("the KvGet released", lambda: _parked(daemon) == before)
    stream.send(2, "get_job", pb.GetJobRequest(job_id=job_id))
    stream.reply(2)
    assert 1 not in stream.order()


def test_a_calls_deadline_answers_it_naming_what_was_missing(
    daemon: DaemonProcess, stream: Stream, job_id: str
) -> None:
    member = _two_rank_job(daemon, stream, job_id)
    # The wait is answered min(0.25 s, a tenth of the time left) before the deadline
    # (servicer._wait_s): at 800 ms, 80 ms, which a loaded CI machine's event loop lag
    # passed once, the stream's own deadline answer coming first; at 3 s, 250 ms.
    stream.send(1, "kv_get", pb.KvGetRequest(**member, key="never", wait=True), timeout_ms=3000)
    got = status_of(stream.reply(1))
    assert got.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert "never" in got.message


def test_the_streams_end_cancels_its_parked_calls(daemon: DaemonProcess, job_id: str) -> None:
    s = Stream(daemon)
    member = _two_rank_job(daemon, s, job_id)
    before = _parked(daemon)
    s.send(1, "kv_get", pb.KvGetRequest(**member, key="later", wait=True))
    wait_for("the KvGet parked", lambda: _parked(daemon) == before + 1)
    s.close()
    wait_for("the KvGet released", lambda: _parked(daemon) == before)


def test_a_call_without_a_request_or_with_an_id_in_flight_is_refused(
    daemon: DaemonProcess, stream: Stream, job_id: str
) -> None:
    stream._out.put(pb.Call(id=1))
    assert "sets no request field" in status_of(stream.reply(1)).message
    member = _two_rank_job(daemon, stream, job_id)
    stream.send(2, "kv_get", pb.KvGetRequest(**member, key="later", wait=True))
    stream.send(2, "get_job", pb.GetJobRequest(job_id=job_id))
    refused = status_of(stream.reply(2))
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "already in flight" in refused.message


def test_a_streams_calls_in_flight_are_capped(start_daemon: Any, job_id: str) -> None:
    d = start_daemon(env={"RENDEZVOUSD_MAX_CONCURRENT_STREAMS": "2"})
    s = Stream(d)
    try:
        member = _two_rank_job(d, s, job_id)
        s.send(1, "kv_get", pb.KvGetRequest(**member, key="a", wait=True))
        s.send(2, "kv_get", pb.KvGetRequest(**member, key="b", wait=True))
        s.send(3, "kv_get", pb.KvGetRequest(**member, key="c", wait=True))
        refused = status_of(s.reply(3))
        assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert "max_concurrent_streams=2" in refused.message
    finally:
        s.close()


def test_a_job_token_is_checked_per_call(
    daemon: DaemonProcess, tmp_path: Path, job_id: str
) -> None:
    token = job_token(daemon, tmp_path, job_id).read_text().strip()
    s = Stream(daemon, token)
    try:
        s.send(1, "get_job", pb.GetJobRequest(job_id=job_id + "-other"))
        denied = status_of(s.reply(1))
        assert denied.code == grpc.StatusCode.PERMISSION_DENIED.value[0]
        s.send(2, "join", join_one(job_id))
        assert s.reply(2).join.world_size == 1
    finally:
        s.close()


def test_a_wrong_token_ends_the_stream(daemon: DaemonProcess) -> None:
    s = Stream(daemon, "x" * 40)
    try:
        s.send(1, "list_jobs", pb.ListJobsRequest())
        assert s.wait_ended().code() is grpc.StatusCode.UNAUTHENTICATED
    finally:
        s.close()


def test_a_garbled_call_ends_the_stream_as_invalid_and_the_daemon_serves_on(
    daemon: DaemonProcess, job_id: str
) -> None:
    with grpc.insecure_channel(daemon.endpoint) as ch:
        calls = ch.stream_stream(f"/{SERVICE}/Calls")
        with pytest.raises(grpc.RpcError) as raised:
            list(
                calls(
                    iter([b"\xff\xff\xff\xff"]),
                    metadata=[("authorization", f"Bearer {daemon.token}")],
                    timeout=10,
                )
            )
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert_healthy(daemon, job_id)


def test_a_bad_request_inside_a_call_is_that_calls_error(stream: Stream) -> None:
    stream.send(1, "get_job", pb.GetJobRequest(job_id="bad id with spaces"))
    refused = status_of(stream.reply(1))
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "bad id with spaces" in refused.message


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _served(d: DaemonProcess, method: str) -> float:
    return scrape(d.metrics_url).get(
        f'rendezvousd_rpc_duration_seconds_count{{code="OK",method="{method}"}}', 0.0
    )


def _answered_unread(d: DaemonProcess, member: dict[str, Any], total: int) -> tuple[float, int]:
    """KvGets of ``member``'s key "big" sent on a Calls stream whose replies are never
    read: how many the daemon answered before it stopped reading them, and its RSS
    (KiB) then, the stream still open."""
    before = _served(d, "KvGet")

    def calls() -> Iterator[pb.Call]:
        for i in range(total):
            call = pb.Call(id=i + 1)
            call.kv_get.CopyFrom(pb.KvGetRequest(**member, key="big"))
            yield call

    with grpc.insecure_channel(d.endpoint) as ch:
        call = ch.stream_stream(
            f"/{SERVICE}/Calls",
            request_serializer=pb.Call.SerializeToString,
            response_deserializer=pb.Reply.FromString,
        )(calls(), metadata=[("authorization", f"Bearer {d.token}")], timeout=60)
        # Never read: wait until the daemon stops answering.
        last, served = -1.0, 0.0
        while served != last:
            last = served
            threading.Event().wait(1.0)  # progress check interval, not a synchronisation
            served = _served(d, "KvGet") - before
        rss = _rss_kib(d.proc.pid)
        call.cancel()
    return served, rss


def test_a_caller_that_reads_no_replies_is_stopped_not_buffered(
    daemon: DaemonProcess, stream: Stream, job_id: str
) -> None:
    """The daemon reads the next call only while its replies have room, so a caller
    that never reads them is held back by flow control; the replies are not queued
    in the daemon's memory (20,000 replies of 8 KiB would be ~160 MiB)."""
    stream.send(1, "join", join_one(job_id))
    stream.reply(1)
    member = {"job_id": job_id, "generation": 1, "rank": 0, "instance_id": "i0"}
    stream.send(2, "kv_set", pb.KvSetRequest(**member, key="big", value=b"x" * 8192))
    stream.reply(2)
    before_rss, total = _rss_kib(daemon.proc.pid), 20_000
    served, rss = _answered_unread(daemon, member, total)
    grown_mib = (rss - before_rss) / 1024
    assert 0 < served < total / 4, f"{served:.0f} of {total} calls answered, none read"
    assert grown_mib < 64, f"the daemon grew {grown_mib:.0f} MiB holding unread replies"


def test_a_stopping_daemon_answers_the_calls_in_flight_and_ends_the_stream(
    start_daemon: Any, job_id: str
) -> None:
    """Graceful stop: a parked call on the stream is answered (DRAINING), then the
    stream ends, so the daemon exits without waiting out its 60 s grace for it."""
    d = start_daemon("--metrics-listen", "127.0.0.1:0", env={"RENDEZVOUSD_DRAIN_GRACE_S": "60"})
    s = Stream(d)
    try:
        member = _two_rank_job(d, s, job_id)
        s.send(1, "kv_get", pb.KvGetRequest(**member, key="never", wait=True))
        wait_for("the KvGet parked", lambda: _parked(d) == 1)
        d.proc.send_signal(signal.SIGTERM)
        refused = status_of(s.reply(1))
        assert refused.code == grpc.StatusCode.UNAVAILABLE.value[0]
        assert b"DRAINING" in refused.details[0].value
        assert d.proc.wait(30) == 0
    finally:
        s.close()


@pytest.mark.parametrize("method", ["Calls", "CallBatches"])
def test_a_stream_the_drain_ends_says_that_no_call_it_did_not_answer_was_read(
    start_daemon: Any, job_id: str, method: str
) -> None:
    """A draining daemon answers the calls it read, stops reading a stream whose client
    does not half-close, and ends it OK with a trailer, rendezvous-stream-drained-bin:
    UNAVAILABLE / DRAINING, run: no. A call of the stream it did not answer was not
    read, so not run, and is re-sent. On CallBatches its last ReplyBatch says so first
    (``drained``, the same status), which a client still holds when gRPC loses the
    stream's status and trailers (grpc.aio: "Internal error from Core", when a write
    races the end). Nothing said it: an asyncio client that lost the status could not
    tell an unread KvAdd from one whose answer was lost ("not repeated", CI, load)."""
    d = start_daemon(env={"RENDEZVOUSD_DRAIN_GRACE_S": "60"})
    s = Stream(d, method=method)
    try:
        member = _two_rank_job(d, s, job_id)
        s.send(1, "kv_add", pb.KvAddRequest(**member, key="n", delta=1))
        assert s.reply(1).kv_add.value == 1
        d.proc.send_signal(signal.SIGTERM)
        assert s.finished.wait(30)  # never half-closed by this client
        # OK, as a client from before the trailer expects of a drain.
        assert s.ended is None, s.ended
        trailers = dict(s.trailing_metadata())
        assert DRAINED_TRAILER in trailers, trailers
        status = status_pb2.Status.FromString(trailers[DRAINED_TRAILER])
        info = error_details_pb2.ErrorInfo()
        assert status.code == grpc.StatusCode.UNAVAILABLE.value[0]
        assert status.details[0].Unpack(info)
        version = installed_version()  # said with every fault
        assert (info.reason, dict(info.metadata)) == (
            "DRAINING",
            {"run": "no", "daemon_version": version},
        )
        assert "read none of the stream's calls it did not answer" in status.message
        if s.batched:
            assert s.drained == trailers[DRAINED_TRAILER]
            assert s.drained_after == [100, 1]  # after every Reply
        assert d.proc.wait(30) == 0
    finally:
        s.close()


def test_a_batch_over_the_request_limit_ends_its_stream_and_the_daemon_serves_on(
    daemon: DaemonProcess, job_id: str
) -> None:
    """A CallBatch is one request message: over the 64 KiB limit (three 30 KiB KvSets)
    its stream ends RESOURCE_EXHAUSTED, as docs/protocol.md says; nothing of it ran."""
    s = Stream(daemon, method="CallBatches")
    try:
        member = _two_rank_job(daemon, s, job_id)
        with s.hold():
            for i in range(3):
                s.send(
                    10 + i, "kv_set", pb.KvSetRequest(**member, key=f"k{i}", value=b"x" * 30_000)
                )
        assert s.wait_ended().code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        s.close()
    got = unary(daemon, "GetJob", pb.GetJobRequest(job_id=job_id))
    assert got.kv_keys == 0  # none of the batch ran
    assert_healthy(daemon, job_id + "-after")


def test_a_job_token_that_expires_is_refused_for_the_calls_after_on_its_open_stream(
    daemon: DaemonProcess, job_id: str
) -> None:
    until = int(time.time()) + 2
    s = Stream(daemon, derive_job_token(daemon.token, job_id, until=until), "CallBatches")
    try:
        s.send(1, "join", join_one(job_id))
        assert s.reply(1).join.world_size == 1
        wait_for("the token's expiry", lambda: time.time() >= until + 0.1, timeout=10)
        member = {"job_id": job_id, "generation": 1, "rank": 0, "instance_id": "i0"}
        s.send(2, "kv_set", pb.KvSetRequest(**member, key="k", value=b"v"))
        refused = status_of(s.reply(2))
        assert refused.code == grpc.StatusCode.UNAUTHENTICATED.value[0]
        assert f"the job token for job {job_id!r} expired at" in refused.message
        s.send(3, "list_jobs", pb.ListJobsRequest())
        assert status_of(s.reply(3)).code == grpc.StatusCode.UNAUTHENTICATED.value[0]
    finally:
        s.close()
    assert unary(daemon, "GetJob", pb.GetJobRequest(job_id=job_id)).kv_keys == 0


@pytest.mark.parametrize("method", ["Calls", "CallBatches"])
def test_a_call_that_outlasts_its_deadline_ends_deadline_exceeded_as_a_unary_call(
    start_daemon: Any, tmp_path: Path, job_id: str, method: str
) -> None:
    """A KvSet waiting for its commit, which another process's lock on the state
    database holds up (the daemon's writer waits up to 5 s for it)."""
    d = start_daemon("--state-dir", str(tmp_path / "state"))
    s = Stream(d, method=method)
    locker = None
    try:
        s.send(1, "join", join_one(job_id))
        assert s.reply(1).join.world_size == 1
        locker = sqlite3.connect(tmp_path / "state" / "state.db", isolation_level=None)
        locker.execute("BEGIN IMMEDIATE")
        member = {"job_id": job_id, "generation": 1, "rank": 0, "instance_id": "i0"}
        s.send(2, "kv_set", pb.KvSetRequest(**member, key="k", value=b"v"), timeout_ms=300)
        got = status_of(s.reply(2))
        # Not the STORAGE_UNAVAILABLE the commit ends with once the writer gives up.
        assert got.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], got
        assert "not answered within its timeout_ms=300" in got.message
    finally:
        if locker is not None:
            locker.execute("COMMIT")
            locker.close()
        s.close()


def test_a_caller_that_reads_no_large_replies_is_stopped_by_their_bytes(
    start_daemon: Any, job_id: str
) -> None:
    """The unsent replies a stream holds are bounded in bytes, not only in count: a
    caller that read none made the daemon hold 256 replies of any size (GetJob of an
    8,192-member job: 155 KB each, 40 MB a stream, more with each stream it opened)."""
    # Replies of 1 MiB: what gRPC and the kernel buffer outside the daemon is bytes too
    # (4 MiB here, 8 MiB on the CI machine), and at 48 KiB a reply that was 86 or 171
    # replies, enough to blur a bound of 43 against one of 256.
    size = 1024 * 1024
    d = start_daemon("--metrics-listen", "127.0.0.1:0", "--max-value-bytes", str(size))
    s = Stream(d)
    try:
        s.send(1, "join", join_one(job_id))
        s.reply(1)
        member = {"job_id": job_id, "generation": 1, "rank": 0, "instance_id": "i0"}
        s.send(2, "kv_set", pb.KvSetRequest(**member, key="big", value=b"x" * size))
        s.reply(2)
    finally:
        s.close()
    served, _ = _answered_unread(d, member, 1_000)
    # 2 MiB of held replies is 2 of these, and the buffers outside take a few more
    # (measured: 6 to 10 in all; 260 with a count alone): under half the count bound leaves
    # room for 100 MiB of buffers the daemon does not own.
    assert 0 < served < 128, f"{served:.0f} replies of 1 MiB answered, none read"


async def test_a_batch_of_slow_inline_calls_gives_the_event_loop_turns() -> None:
    """A stream's calls that do not wait run inline, and a batch's calls are at hand,
    so the reader never waited between them: 256 GetJobs of an 8,192-member job in one
    4 KB message held every other caller, health checks included, for 13 s."""

    async def slow(_request: Any, _context: Any) -> pb.GetJobResponse:
        time.sleep(0.002)  # a big answer built without an await
        seen.append(ticks)
        return pb.GetJobResponse()

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    async def batch() -> AsyncIterator[pb.CallBatch]:
        calls = [pb.Call(id=i + 1, get_job=pb.GetJobRequest(job_id="j")) for i in range(100)]
        yield pb.CallBatch(calls=calls)

    ticks, seen = 0, []
    beside = asyncio.create_task(ticker())
    try:
        stream = CallStream({"get_job": slow}, max_in_flight=256)
        replies = [r async for r in stream.serve(batch(), batched=True)]
    finally:
        beside.cancel()
    assert replies and len(seen) == 100
    # Others ran while the batch was served: at least once per few calls (5 ms inline).
    assert len(set(seen)) >= 20, seen


async def test_each_call_ends_at_its_own_deadline_whatever_the_order_they_came_in() -> None:
    """One timer serves a stream's deadlines: a later call with an earlier deadline
    moves it forward, a call that ended before its deadline leaves it to the next, and
    the calls still held (commits the storage holds up, here never answered) end
    DEADLINE_EXCEEDED each at its own timeout_ms, not at another call's."""
    held = asyncio.Event()  # never set

    async def hangs(_request: Any, _context: Any) -> Any:
        await held.wait()

    async def quick(_request: Any, _context: Any) -> pb.KvGetResponse:
        await asyncio.sleep(0.01)
        return pb.KvGetResponse()

    timeouts = {1: 1500, 2: 200, 3: 100, 4: 400}  # call 3 ends at 10 ms, before its own

    async def calls() -> AsyncIterator[pb.CallBatch]:
        kv = pb.KvSetRequest(key="k")
        yield pb.CallBatch(
            calls=[
                pb.Call(id=1, timeout_ms=timeouts[1], barrier=pb.BarrierRequest(name="b")),
                pb.Call(id=2, timeout_ms=timeouts[2], kv_set=kv),
                pb.Call(id=3, timeout_ms=timeouts[3], kv_get=pb.KvGetRequest(key="k")),
                pb.Call(id=4, timeout_ms=timeouts[4], kv_set=kv),
            ]
        )

    stream = CallStream({"barrier": hangs, "kv_set": hangs, "kv_get": quick}, max_in_flight=8)
    started = time.monotonic()
    answered: dict[int, tuple[float, pb.Reply]] = {}
    async with asyncio.timeout(5):  # a deadline never served would hold the stream
        async for message in stream.serve(calls(), batched=True):
            for r in pb.ReplyBatch.FromString(message).replies:
                answered[r.id] = (time.monotonic() - started, r)
    assert sorted(answered, key=lambda i: answered[i][0]) == [3, 2, 4, 1], answered
    assert answered[3][1].WhichOneof("response") == "kv_get"
    for call_id in (1, 2, 4):
        at, r = answered[call_id]
        assert r.WhichOneof("response") == "error", r
        assert status_of(r).code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        assert f"within its timeout_ms={timeouts[call_id]}" in status_of(r).message
        assert timeouts[call_id] / 1000 <= at < timeouts[call_id] / 1000 + 0.25, (call_id, at)


# A waiting call's steps after its first wait are driven by hand (call_stream._finish:
# the first step runs inline, the rest in a task): what follows holds that driver to
# what a plain task per call gives, and to a call answered exactly once.


async def _replies(stream: CallStream, calls: AsyncIterator[pb.CallBatch]) -> list[pb.Reply]:
    """Every reply of ``stream`` serving ``calls`` (CallBatches), in order, once it
    ended; a stream that never ends (a call never ended or never counted) fails."""
    got: list[pb.Reply] = []
    async with asyncio.timeout(5):
        async for message in stream.serve(calls, batched=True):
            got.extend(pb.ReplyBatch.FromString(message).replies)
    return got


_STREAMS_OWN: contextvars.ContextVar[str] = contextvars.ContextVar("streams_own", default="")


async def test_a_call_goes_on_past_each_wait_in_turn_in_its_streams_context() -> None:
    """Futures, a bare yield, a shielded task and an event, one after another: the call
    is answered after the last, and still sees the context its stream was opened in
    (the daemon's auth interceptor leaves the caller's scope there)."""
    later = asyncio.Event()

    async def waits(_request: Any, _context: Any) -> pb.KvGetResponse:
        await asyncio.sleep(0.01)
        await asyncio.sleep(0)
        await asyncio.shield(asyncio.sleep(0.01))
        await later.wait()
        await asyncio.sleep(0)
        return pb.KvGetResponse(value=_STREAMS_OWN.get().encode())

    async def wakes(_request: Any, _context: Any) -> pb.GetJobResponse:
        later.set()
        return pb.GetJobResponse()

    async def calls() -> AsyncIterator[pb.CallBatch]:
        yield pb.CallBatch(calls=[pb.Call(id=1, kv_get=pb.KvGetRequest(key="k"))])
        await asyncio.sleep(0.05)
        yield pb.CallBatch(calls=[pb.Call(id=2, get_job=pb.GetJobRequest(job_id="j"))])

    _STREAMS_OWN.set("the stream's caller")
    stream = CallStream({"kv_get": waits, "get_job": wakes}, max_in_flight=8)
    got = await _replies(stream, calls())
    assert [r.id for r in got] == [2, 1]
    assert got[1].kv_get.value == b"the stream's caller"


Handler = Callable[[Any, Any], Awaitable[Any]]


def _cancellable_handlers(cancelled: list[str]) -> tuple[Handler, Handler, Handler]:
    """A handler that spins at bare yields and one parked on a future, each noting in
    ``cancelled`` where a cancel reached it, and one that answers at once."""

    async def spins(_request: Any, _context: Any) -> Any:
        try:
            while True:
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            cancelled.append("at a bare yield")
            raise

    async def parks(_request: Any, _context: Any) -> Any:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append("awaiting a future")
            raise

    async def quick(_request: Any, _context: Any) -> pb.GetJobResponse:
        return pb.GetJobResponse()

    return spins, parks, quick


async def test_a_cancel_reaches_a_call_awaiting_a_future_and_one_at_a_bare_yield() -> None:
    """Each reads its await cancelled, neither is answered, and the stream's end,
    which waits for its calls in flight, then comes."""
    cancelled: list[str] = []
    spins, parks, quick = _cancellable_handlers(cancelled)

    async def calls() -> AsyncIterator[pb.CallBatch]:
        yield pb.CallBatch(
            calls=[
                pb.Call(id=1, kv_get=pb.KvGetRequest(key="k")),
                pb.Call(id=2, barrier=pb.BarrierRequest(name="b")),
            ]
        )
        await asyncio.sleep(0.02)
        yield pb.CallBatch(
            calls=[
                pb.Call(id=1, cancel=pb.CancelCall()),
                pb.Call(id=2, cancel=pb.CancelCall()),
                pb.Call(id=3, get_job=pb.GetJobRequest(job_id="j")),
            ]
        )

    stream = CallStream({"kv_get": spins, "barrier": parks, "get_job": quick}, max_in_flight=8)
    got = await _replies(stream, calls())
    assert [r.id for r in got] == [3]
    assert sorted(cancelled) == ["at a bare yield", "awaiting a future"]


async def test_a_call_whose_wait_ends_as_its_deadline_passes_is_answered_once() -> None:
    """The deadline's cancel finds what the call awaits done and the call due to
    resume: the cancel is thrown in as it resumes, so the call ends DEADLINE_EXCEEDED
    alone, not that and then its answer, two replies to one id."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[bytes] = loop.create_future()
    seen: list[str] = []

    async def waits(_request: Any, _context: Any) -> pb.KvGetResponse:
        try:
            value = await ready
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        seen.append("answered")
        return pb.KvGetResponse(value=value)

    async def holds_the_loop(_request: Any, _context: Any) -> pb.GetJobResponse:
        # The wait's end (20 ms) and call 1's deadline (50 ms) then come due in the
        # same turn of the loop, the wait's first: the call's resumption is queued
        # behind the deadline's timer.
        loop.call_later(0.02, ready.set_result, b"late")
        time.sleep(0.1)
        return pb.GetJobResponse()

    async def calls() -> AsyncIterator[pb.CallBatch]:
        yield pb.CallBatch(
            calls=[
                pb.Call(id=1, timeout_ms=50, kv_get=pb.KvGetRequest(key="k")),
                pb.Call(id=2, get_job=pb.GetJobRequest(job_id="j")),
            ]
        )

    stream = CallStream({"kv_get": waits, "get_job": holds_the_loop}, max_in_flight=8)
    got = await _replies(stream, calls())
    assert [r.id for r in got] == [2, 1], got
    assert status_of(got[1]).code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert seen == ["cancelled"]


async def test_the_streams_end_cancels_its_calls_awaiting_and_at_a_bare_yield() -> None:
    cancelled: list[str] = []
    spins, parks, quick = _cancellable_handlers(cancelled)

    async def calls() -> AsyncIterator[pb.CallBatch]:
        yield pb.CallBatch(
            calls=[
                pb.Call(id=1, kv_get=pb.KvGetRequest(key="k")),
                pb.Call(id=2, barrier=pb.BarrierRequest(name="b")),
                pb.Call(id=3, get_job=pb.GetJobRequest(job_id="j")),
            ]
        )
        await asyncio.Event().wait()  # the caller sends no more, and keeps the stream

    stream = CallStream({"kv_get": spins, "barrier": parks, "get_job": quick}, max_in_flight=8)
    served = stream.serve(calls(), batched=True)
    first = pb.ReplyBatch.FromString(await anext(served))
    assert [r.id for r in first.replies] == [3]
    await served.aclose()  # the caller went away
    for _ in range(10):
        await asyncio.sleep(0)
    assert sorted(cancelled) == ["at a bare yield", "awaiting a future"]


class _Escapes(BaseException):
    """Not an Exception: a call's ``_run`` lets it through."""


class _NotAFuture:
    def __await__(self) -> Iterator[Any]:
        yield "not a future"


async def test_what_escapes_a_call_is_logged_and_answered_unknown_and_the_stream_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Raised before its first wait or after it, or awaiting what is not a future: the
    call is answered UNKNOWN (not left to its deadline, nor the stream ended), the
    daemon's log has it, and the calls beside it are answered."""

    async def after_a_wait(_request: Any, _context: Any) -> Any:
        await asyncio.sleep(0.01)
        raise _Escapes("after a wait")

    async def at_once(_request: Any, _context: Any) -> Any:
        raise _Escapes("before any wait")

    async def awaits_no_future(_request: Any, _context: Any) -> Any:
        await asyncio.sleep(0)
        await _NotAFuture()

    async def waits(_request: Any, _context: Any) -> pb.GetJobResponse:
        await asyncio.sleep(0.05)
        return pb.GetJobResponse()

    async def calls() -> AsyncIterator[pb.CallBatch]:
        yield pb.CallBatch(
            calls=[
                pb.Call(id=1, kv_get=pb.KvGetRequest(key="k")),
                pb.Call(id=2, kv_set=pb.KvSetRequest(key="k")),
                pb.Call(id=3, barrier=pb.BarrierRequest(name="b")),
                pb.Call(id=4, get_job=pb.GetJobRequest(job_id="j")),
            ]
        )

    handlers = {
        "kv_get": after_a_wait,
        "kv_set": at_once,
        "barrier": awaits_no_future,
        "get_job": waits,
    }
    loop = asyncio.get_running_loop()
    unhandled: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: unhandled.append(context))
    try:
        with caplog.at_level("ERROR", logger="rendezvousd"):
            got = await _replies(CallStream(handlers, max_in_flight=8), calls())
    finally:
        loop.set_exception_handler(None)
    assert unhandled == []  # nothing left to the loop's handler, a log line at best
    by_id = {r.id: r for r in got}
    assert sorted(by_id) == [1, 2, 3, 4] and len(got) == 4, got
    for call_id in (1, 2, 3):
        failed = status_of(by_id[call_id])
        assert failed.code == grpc.StatusCode.UNKNOWN.value[0]
        assert "its log has the traceback" in failed.message
    assert by_id[4].WhichOneof("response") == "get_job"
    logged = "\n".join(r.getMessage() + str(r.exc_info and r.exc_info[1]) for r in caplog.records)
    for call_id, why in ((1, "after a wait"), (2, "before any wait"), (3, "not a future")):
        assert f"call {call_id}" in logged and why in logged, logged


async def test_the_callers_end_of_sending_waits_for_each_call_in_flight() -> None:
    """The caller sends its last call with three in flight, each ending at its own
    time: all three are answered before the stream ends."""

    async def waits(request: Any, _context: Any) -> pb.KvGetResponse:
        await asyncio.sleep(int(request.key) / 1000)
        return pb.KvGetResponse(value=request.key.encode())

    async def calls() -> AsyncIterator[pb.CallBatch]:
        keys = {1: "30", 2: "10", 3: "60"}
        yield pb.CallBatch(
            calls=[pb.Call(id=i, kv_get=pb.KvGetRequest(key=k)) for i, k in keys.items()]
        )

    got = await _replies(CallStream({"kv_get": waits}, max_in_flight=8), calls())
    assert [(r.id, r.kv_get.value) for r in got] == [(2, b"10"), (1, b"30"), (3, b"60")]


async def test_a_drain_after_the_caller_stopped_sending_still_answers_its_calls() -> None:
    """The daemon drains (its parked calls released with an answer) while a stream's
    caller has sent its last call and waits for the answers: they arrive. The drain
    cancelled the stream's reader there, which cancelled the calls it waited for, and
    their answers were lost."""
    released = asyncio.Event()
    parked = asyncio.Event()

    async def waits(request: Any, _context: Any) -> pb.KvGetResponse:
        parked.set()
        await released.wait()
        return pb.KvGetResponse(value=b"released")

    async def calls() -> AsyncIterator[pb.CallBatch]:
        yield pb.CallBatch(calls=[pb.Call(id=1, kv_get=pb.KvGetRequest(key="k"))])

    stream = CallStream({"kv_get": waits}, max_in_flight=8)
    serving = asyncio.ensure_future(_replies(stream, calls()))
    await asyncio.wait_for(parked.wait(), 5)
    await asyncio.sleep(0.05)  # the reader past the caller's last call, waiting for it
    stream.drain()
    released.set()  # as the daemon's drain answers its parked calls
    got = await serving
    assert [(r.id, r.kv_get.value) for r in got] == [(1, b"released")]


def test_replies_varints_are_protobufs_at_every_length() -> None:
    """The hand-written Reply encoding (its fast paths for one and two bytes included)
    decodes as protobuf's own, across each varint length's boundaries."""
    from rendezvousd.server.call_stream import reply

    field = "kv_get"
    number = pb.Reply.DESCRIPTOR.fields_by_name[field].number
    for size in (0, 1, 127, 128, 16383, 16384, 70000):
        body = pb.KvGetResponse(value=b"v" * size).SerializeToString()
        for call_id in (1, 127, 128, 300, 16383, 16384, 2**21 - 1, 2**21, 2**35, 2**64 - 1):
            encoded = reply(call_id, number, body)
            decoded = pb.Reply.FromString(encoded)
            assert (decoded.id, decoded.WhichOneof("response")) == (call_id, field)
            assert decoded.kv_get.value == b"v" * size
            assert decoded.SerializeToString() == encoded
