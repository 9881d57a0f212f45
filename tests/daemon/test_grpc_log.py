"""gRPC's ERROR for an answer sent to a client that went away (h147 F5): a daemon
makes it one DEBUG line. The line comes from grpc.aio's Cython server when a send
races the client's exit (6 in 11 min of churn in h147's run), which no test can time:
the record is logged here as that code logs it, on its logger, beside a live daemon."""

from __future__ import annotations

import logging

import pytest
from grpc._cython.cygrpc import ExecuteBatchError

from tests.support import InProcessDaemon

GRPC = logging.getLogger("grpc._cython.cygrpc")
METHOD = "/rendezvous.v1.Rendezvous/Heartbeat"


def _grpc_logs_a_failed_send() -> None:
    try:
        raise ExecuteBatchError('Failed "execute_batch": (<SendMessageOperation>,)')
    except ExecuteBatchError:
        # As server.pyx.pxi's _handle_exceptions logs it (the message formatted first).
        GRPC.exception(f"ExecuteBatchError raised in core by servicer method [{METHOD}]")


async def test_grpcs_error_for_a_client_gone_is_one_debug_line(
    inproc_daemon: InProcessDaemon, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    _grpc_logs_a_failed_send()
    GRPC.error("another gRPC error")
    mine = [r for r in caplog.records if r.name == GRPC.name]
    # The failed send is not shown at INFO; any other gRPC error still is, as it was.
    assert [(r.levelname, r.getMessage()) for r in mine] == [("ERROR", "another gRPC error")]
    caplog.clear()
    caplog.set_level(logging.DEBUG)
    _grpc_logs_a_failed_send()
    (line,) = [r for r in caplog.records if r.name == GRPC.name]
    assert line.levelname == "DEBUG" and line.exc_info is None, line
    assert METHOD in line.getMessage() and "went away" in line.getMessage(), line.getMessage()
