"""The ``Calls`` stream's table, read by both its ends: which Call/Reply field carries
which unary Rendezvous method, and the trailer a unary call's rich status travels in
(an error Reply carries the same bytes)."""

from __future__ import annotations

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb

#: The trailer a unary call's google.rpc.Status travels in (grpcio-status reads it there).
STATUS_TRAILER = "grpc-status-details-bin"

#: The initial metadata a daemon sends as it starts serving a call stream, before it
#: reads a call: a stream that ends without it (refused by a daemon shutting down) ran
#: none of its calls, and one that ends OK ran exactly those it answered, so a call
#: unsafe to repeat (KvAdd) is re-sent then, not failed as of unknown outcome.
SERVED_METADATA = ("rendezvous-stream-served", "1")

#: The trailer a daemon ends a call stream with as it drains (the status stays OK, as
#: older clients expect): a google.rpc.Status, UNAVAILABLE / DRAINING, run: no. Every
#: call of the stream without a Reply was not read, so not run. CallBatches says it in
#: its last ReplyBatch too (``drained``), which a client holds even when gRPC loses the
#: stream's status and trailers (grpc.aio, when a write races the end).
DRAINED_TRAILER = "rendezvous-stream-drained-bin"


def _fields() -> dict[str, str]:
    """Method name -> the Call/Reply field carrying it, matched by the request type
    and checked against the response type, for every unary method of the service."""
    service = pb.DESCRIPTOR.services_by_name["Rendezvous"]
    requests = pb.Call.DESCRIPTOR.oneofs_by_name["request"].fields
    responses = {f.name: f for f in pb.Reply.DESCRIPTOR.oneofs_by_name["response"].fields}
    table: dict[str, str] = {}
    for method in service.methods:
        if method.client_streaming or method.server_streaming:
            continue
        (field,) = [f for f in requests if f.message_type is method.input_type]
        answer = responses[field.name].message_type
        if answer is not method.output_type:
            raise RuntimeError(
                f"Reply.{field.name} is a {answer.name if answer else 'scalar'}, but "
                f"{method.name} answers {method.output_type.name}: the proto's Calls "
                "messages disagree with its methods"
            )
        table[method.name] = field.name
    return table


#: Every unary method the Calls stream carries, by its name ("KvGet" -> "kv_get").
FIELDS: dict[str, str] = _fields()
