"""The Calls stream's messages without I/O (``client/_multiplex.py``): the method <->
field table, Call building, and every Reply read into what a unary call would have
returned or raised, so the call core cannot tell the two transports apart."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client import NotFound, StaleGeneration
from rendezvousd.client._multiplex import (
    FIELDS,
    Pending,
    call_message,
    cancel_message,
    copy_error,
    deadline_error,
    draining,
    lost_error,
    probed,
    rich_status,
    rpc_error,
    status_error,
    status_lost,
    stream_full,
    unsupported,
)
from rendezvousd.client.errors import error_info, from_rpc_error
from rendezvousd.common.calls import STATUS_TRAILER

SERVICE = pb.DESCRIPTOR.services_by_name["Rendezvous"]


def test_every_unary_method_has_its_field_of_its_types_and_no_stream_does() -> None:
    unary = {m.name for m in SERVICE.methods if not m.client_streaming}
    assert set(FIELDS) == unary
    assert {"Heartbeat", "Calls", "CallBatches"} & set(FIELDS) == set()
    for method in SERVICE.methods:
        if method.name in FIELDS:
            field = FIELDS[method.name]
            assert pb.Call.DESCRIPTOR.fields_by_name[field].message_type is method.input_type
            assert pb.Reply.DESCRIPTOR.fields_by_name[field].message_type is method.output_type
    assert FIELDS["KvCompareAndSet"] == "kv_compare_and_set"
    assert FIELDS["PublishId"] == "publish_id"


def test_a_call_carries_its_id_request_and_deadline_rounded_up_never_zero() -> None:
    request = pb.KvGetRequest(job_id="j", key="k", wait=True)
    call = call_message(7, "KvGet", request, 2.0001)
    assert (call.id, call.timeout_ms, call.WhichOneof("request")) == (7, 2001, "kv_get")
    assert call.kv_get == request
    # 0 would ask for the daemon's default deadline instead of an immediate one.
    assert call_message(8, "GetJob", pb.GetJobRequest(), 0.0).timeout_ms == 1
    assert cancel_message(7).WhichOneof("request") == "cancel"
    assert cancel_message(7).id == 7


def _status(code: grpc.StatusCode, message: str, reason: str, **metadata: str) -> bytes:
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.ErrorInfo(reason=reason, domain="rendezvousd", metadata=metadata))
    status = status_pb2.Status(code=code.value[0], message=message, details=[detail])
    return status.SerializeToString()


def test_an_error_reply_is_the_unary_calls_error_with_its_error_info() -> None:
    raw = _status(
        grpc.StatusCode.ABORTED,
        "job 'j' is at generation 3",
        "STALE_GENERATION",
        current_generation="3",
    )
    pending: Pending[str] = Pending()
    call_id, _ = pending.add("Barrier", pb.BarrierRequest(), 5.0, "waiter")
    settled = pending.settle(pb.Reply(id=call_id, error=raw))
    assert settled is not None
    waiter, exc = settled
    assert waiter == "waiter"
    assert isinstance(exc, grpc.RpcError)
    assert exc.code() is grpc.StatusCode.ABORTED
    assert exc.details() == "job 'j' is at generation 3"
    assert dict(exc.trailing_metadata())[STATUS_TRAILER] == raw
    # The seam the core reads unary errors through reads it alike: reason, class, metadata.
    assert error_info(exc) == ("STALE_GENERATION", {"current_generation": "3"})
    error = from_rpc_error(exc, endpoint="e:1", method="Barrier", job_id="j", rank=2)
    assert isinstance(error, StaleGeneration)
    assert (error.reason, error.code, error.current_generation) == (
        "STALE_GENERATION",
        "ABORTED",
        3,
    )
    assert (
        str(error) == "Barrier on rendezvousd at e:1 (job 'j', rank 2): job 'j' is at generation 3"
    )


def test_replies_reach_their_own_callers_in_any_order() -> None:
    pending: Pending[str] = Pending()
    first, _ = pending.add("Barrier", pb.BarrierRequest(), 5.0, "barrier")
    second, _ = pending.add("KvGet", pb.KvGetRequest(), 5.0, "kv_get")
    assert first != second
    assert pending.settle(pb.Reply(id=second, kv_get=pb.KvGetResponse(value=b"v"))) == (
        "kv_get",
        pb.KvGetResponse(value=b"v"),
    )
    assert pending.settle(pb.Reply(id=first, barrier=pb.BarrierResponse(sequence=4))) == (
        "barrier",
        pb.BarrierResponse(sequence=4),
    )
    # Answered once: a second Reply of the same id has nobody waiting.
    assert pending.settle(pb.Reply(id=first, barrier=pb.BarrierResponse())) is None


def test_a_reply_of_another_methods_field_is_an_internal_error_not_a_wrong_answer() -> None:
    pending: Pending[str] = Pending()
    call_id, _ = pending.add("KvGet", pb.KvGetRequest(), 5.0, "w")
    settled = pending.settle(pb.Reply(id=call_id, kv_set=pb.KvSetResponse()))
    assert settled is not None
    assert isinstance(settled[1], grpc.RpcError)
    assert settled[1].code() is grpc.StatusCode.INTERNAL
    assert "KvGet" in settled[1].details()


def test_a_call_given_up_is_cancelled_once_and_its_late_reply_dropped() -> None:
    pending: Pending[str] = Pending()
    call_id, _ = pending.add("KvGet", pb.KvGetRequest(wait=True), 1.0, "w")
    assert pending.waiting(call_id)
    assert pending.drop(call_id) is True  # tell the daemon
    assert not pending.waiting(call_id)
    assert pending.drop(call_id) is False  # already gone: nothing to tell
    assert pending.settle(pb.Reply(id=call_id, kv_get=pb.KvGetResponse())) is None
    assert deadline_error().code() is grpc.StatusCode.DEADLINE_EXCEEDED


def test_the_streams_end_fails_every_call_in_flight_and_every_later_one() -> None:
    pending: Pending[str] = Pending()
    pending.add("KvGet", pb.KvGetRequest(), 5.0, "a")
    pending.add("Barrier", pb.BarrierRequest(), 5.0, "b")
    broken = copy_error(status_error(_status(grpc.StatusCode.UNAVAILABLE, "gone", "")))
    assert sorted(pending.end(broken)) == ["a", "b"]
    with pytest.raises(grpc.RpcError) as later:
        pending.add("KvSet", pb.KvSetRequest(), 5.0, "c")
    assert later.value is not broken  # one exception object per caller
    assert (later.value.code(), later.value.details()) == (grpc.StatusCode.UNAVAILABLE, "gone")
    assert dict(later.value.trailing_metadata()) == dict(broken.trailing_metadata())


def test_unimplemented_means_an_older_daemon_only_before_any_reply() -> None:
    no_method = status_error(
        status_pb2.Status(code=12, message="Method not found!").SerializeToString()
    )
    assert no_method.code() is grpc.StatusCode.UNIMPLEMENTED
    assert unsupported(no_method, replied=False)
    assert not unsupported(no_method, replied=True)
    other = status_error(_status(grpc.StatusCode.NOT_FOUND, "no job 'j'", "JOB_NOT_FOUND"))
    assert not unsupported(other, replied=False)
    assert isinstance(from_rpc_error(other, endpoint="e:1", method="GetJob"), NotFound)


def test_a_draining_answer_retires_the_stream_and_nothing_else_does() -> None:
    drains = status_error(_status(grpc.StatusCode.UNAVAILABLE, "shutting down", "DRAINING"))
    assert draining(drains)
    assert not draining(status_error(_status(grpc.StatusCode.UNAVAILABLE, "gone", "")))
    assert not draining(status_error(_status(grpc.StatusCode.NOT_FOUND, "x", "JOB_NOT_FOUND")))
    assert not draining(pb.KvGetResponse())


def test_only_the_streams_own_cap_sends_a_call_unary() -> None:
    full = status_error(
        _status(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "2 in flight",
            "LIMIT_EXCEEDED",
            limit="max_concurrent_streams",
        )
    )
    assert stream_full(full)
    other_limit = status_error(
        _status(
            grpc.StatusCode.RESOURCE_EXHAUSTED, "too many", "LIMIT_EXCEEDED", limit="max_waiters"
        )
    )
    assert not stream_full(other_limit)
    assert not stream_full(pb.KvGetResponse())


def test_a_status_grpc_aio_lost_is_told_apart_and_recovered_from_a_probe() -> None:
    lost = rpc_error(grpc.StatusCode.INTERNAL, "Internal error from Core")
    assert status_lost(lost)
    assert not status_lost(rpc_error(grpc.StatusCode.INTERNAL, "the daemon's own bug"))
    # The probe stream ended OK: the daemon serves Calls, the stream was lost with it.
    assert lost_error().code() is grpc.StatusCode.UNAVAILABLE
    assert probed(grpc.StatusCode.OK, "", ()).code() is grpc.StatusCode.UNAVAILABLE
    older = probed(grpc.StatusCode.UNIMPLEMENTED, "Method not found!", ())
    assert unsupported(older, replied=False)
    refused = probed(grpc.StatusCode.UNAUTHENTICATED, "bad token", ())
    assert (refused.code(), refused.details()) == (grpc.StatusCode.UNAUTHENTICATED, "bad token")


def test_a_probe_a_draining_daemon_ended_drained_says_nothing_of_the_lost_streams_calls() -> None:
    """A draining daemon ends every stream UNAVAILABLE / DRAINING, run: no, a probe
    too: of the probe's own calls (none). The lost stream's calls may have run (its
    daemon drained it, it would have said so in it: ReplyBatch.drained), so they stay
    of unknown outcome, never re-sent as not run."""
    why = "the daemon is shutting down and ended this call stream"
    drained = rich_status(grpc.StatusCode.UNAVAILABLE, "DRAINING", why, {"run": "no"})
    got = probed(grpc.StatusCode.UNAVAILABLE, why, ((STATUS_TRAILER, drained),))
    assert got.code() is grpc.StatusCode.UNAVAILABLE
    assert error_info(got) == ("", {})
    assert got.details() == lost_error().details()


def test_queued_calls_go_as_batches_within_the_daemons_request_limit() -> None:
    """What the stream sends when several calls are queued (``_batches``): one
    CallBatch while they fit in CALL_BATCH_BYTES, a new one after; a call whose caller
    gave up is left out, a cancel is not; the half-close ends the stream."""
    from rendezvousd.client._call_stream import CALL_BATCH_BYTES, _batches

    pending: Pending[object] = Pending()
    value = b"x" * (CALL_BATCH_BYTES // 3 - 64)
    calls = [
        pending.add("KvSet", pb.KvSetRequest(job_id="j", key=f"k{i}", value=value), 5, object())[1]
        for i in range(5)
    ]
    small = [pending.add("KvGet", pb.KvGetRequest(job_id="j", key="k"), 5, object())[1]]
    pending.drop(calls[4].id)
    queued: list[pb.Call | None] = [*calls, cancel_message(99), *small, None, *small]
    batches, ended = _batches(queued, pending)
    assert ended
    assert [[c.id for c in b.calls] for b in batches] == [
        [1, 2, 3],
        [4, 99, 6],
    ]
    assert all(b.ByteSize() <= CALL_BATCH_BYTES + 64 for b in batches)
    alone = pending.add("KvSet", pb.KvSetRequest(job_id="j", value=b"y" * 40_000), 5, object())
    assert [len(b.calls) for b in _batches([small[0], alone[1], small[0]], pending)[0]] == [1, 1, 1]
