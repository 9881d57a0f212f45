"""The one seam where state-machine faults become gRPC statuses.

A fault travels as a standard google.rpc.Status (in the ``grpc-status-details-bin``
trailer) holding one google.rpc.ErrorInfo, so any gRPC client, grpcurl included,
can read the reason and metadata without our SDK. A PEER_FAILED fault adds one
``FailedMember`` detail per loss, in the order of loss (rank and host stay paired).
"""

from __future__ import annotations

import time

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from rendezvousd.errors import Reason, RendezvousFault
from rendezvousd.server.answers import failed_member

DOMAIN = "rendezvous.v1"
# A status travels in a trailer, which gRPC caps at 8 KiB by default: the first
# losses with their causes cut short; GetJob has the whole record.
DETAILED_LOSSES = 8
DETAIL_CAUSE_BYTES = 120


def to_grpc_status(fault: RendezvousFault) -> grpc.Status:
    info = error_details_pb2.ErrorInfo(reason=fault.reason, domain=DOMAIN, metadata=fault.metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    details = [detail]
    now = time.monotonic()  # the state machine's clock (servicer._now)
    for f in fault.failed[:DETAILED_LOSSES]:
        details.append(any_pb2.Any())
        details[-1].Pack(failed_member(f, now, DETAIL_CAUSE_BYTES))
    status = status_pb2.Status(
        code=code_pb2.Code.Value(fault.code.value), message=fault.message, details=details
    )
    grpc_status = rpc_status.to_status(status)
    if fault.reason == Reason.DRAINING:
        # gRFC A6 pushback: tell clients' channel-level retries not to re-send to a
        # daemon that is shutting down (the SDK raises DaemonUnavailable instead).
        return _WithTrailers(grpc_status, (("grpc-retry-pushback-ms", "-1"),))
    return grpc_status


class _WithTrailers(grpc.Status):  # type: ignore[misc]
    def __init__(self, base: grpc.Status, extra: tuple[tuple[str, str], ...]) -> None:
        self.code = base.code
        self.details = base.details
        self.trailing_metadata = tuple(base.trailing_metadata) + extra
