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

from rendezvousd.common.version import installed_version
from rendezvousd.errors import Reason, RendezvousFault
from rendezvousd.server.answers import failed_member

DOMAIN = "rendezvous.v1"
# A status travels in a trailer, which gRPC caps at 8 KiB by default (the message names
# the same losses, their hosts too): the first losses with their causes cut short;
# GetJob and the heartbeat's event have the whole record.
DETAILED_LOSSES = 8
# The causes' bytes in all, shared evenly by the losses detailed: 120 each when 8 are,
# as before, and the whole of a lone loss's cause (a cut between two nodes: one ring
# link's words, ~150 bytes with its rank, whose end says why) in the same trailer size.
# Each is cut in its middle (``cut_middle``): its end is the exception, or the words
# that say why; cut at its end, "... (the network between the two hosts is cut, or
# that host is down)" reached the survivors without what was cut.
DETAIL_CAUSE_BYTES = DETAILED_LOSSES * 120


def to_grpc_status(fault: RendezvousFault) -> grpc.Status:
    # Every fault says which rendezvousd answered it: the SDK's errors name the daemon's
    # version where versions are the question (VersionMismatch, a draining daemon).
    metadata = {**fault.metadata, "daemon_version": installed_version()}
    info = error_details_pb2.ErrorInfo(reason=fault.reason, domain=DOMAIN, metadata=metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    details = [detail]
    now = time.monotonic()  # the state machine's clock (servicer._now)
    detailed = fault.failed[:DETAILED_LOSSES]
    for f in detailed:
        details.append(any_pb2.Any())
        details[-1].Pack(failed_member(f, now, DETAIL_CAUSE_BYTES // len(detailed)))
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
