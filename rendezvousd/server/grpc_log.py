"""gRPC's own ERROR for an answer sent to a client that went away, made one DEBUG line.

grpc.aio logs ``ExecuteBatchError raised in core by servicer method [M]`` at ERROR,
with an 8-line Cython traceback, when it cannot send a streamed message or a call's
final status because the peer's connection is gone and gRPC has not yet marked the
call as closed by the client (it drops the failure silently once it has): a worker
killed, or a client that exits without Leave, in the instant the daemon answers it.
The send happens in gRPC's code after our handler yielded or returned, so no handler
of ours can catch it; what the client's loss means (a member lost, a parked call
freed) the daemon already says in its own words. Left at ERROR it trips every "ERROR
in the log" alert for an ordinary exit (h147 F5)."""

from __future__ import annotations

import logging

# The logger grpc.aio's server (Cython) logs through.
GRPC_LOGGER = "grpc._cython.cygrpc"
_GONE = "ExecuteBatchError raised in core by servicer method"


class ClientGoneFilter(logging.Filter):
    """Rewrites gRPC's failed-send ERROR into one DEBUG line (no traceback), shown
    only where DEBUG is enabled; every other gRPC line passes as it was."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or not record.getMessage().startswith(_GONE):
            return True
        method = record.getMessage().removeprefix(_GONE).strip(" []")
        record.msg = "a client went away while its answer was being sent (%s): answer dropped"
        record.args = (method,)
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        record.exc_info = record.exc_text = record.stack_info = None
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def quiet_gone_clients() -> None:
    """Installs the filter on gRPC's server logger, once per process (several daemons
    may run in one: tests, an embedded daemon)."""
    logger = logging.getLogger(GRPC_LOGGER)
    if not any(isinstance(f, ClientGoneFilter) for f in logger.filters):
        logger.addFilter(ClientGoneFilter())
