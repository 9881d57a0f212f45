"""The daemon's exception tree.

    DaemonError                   startup/configuration problems (never sent on the wire)
    └── ConfigError               a bad flag, env var, config or token file
    RendezvousFault               a request the state machine refuses; carries a
                                  status Code, a Reason (the proto's ErrorReason) and metadata

``RendezvousFault`` is pure (no gRPC import): the servicer maps it to a gRPC
status with a google.rpc.ErrorInfo detail in one place (``rendezvousd.server.fault_status``).
Messages never contain the unique id or a token.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rendezvousd.common.members import FailedInfo


class DaemonError(Exception):
    """The daemon cannot start or continue."""


class ConfigError(DaemonError, ValueError):
    """A configuration value is invalid; the message quotes it and says what to do.
    ``keys``: the settings a refusal of several together is about, whose origins
    (flag, env, file) the error then names (``Schema.build``)."""

    def __init__(self, message: str, *, keys: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.keys = tuple(keys)


class Code(enum.Enum):
    """The gRPC status codes the state machine uses, by name."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    NOT_FOUND = "NOT_FOUND"
    ABORTED = "ABORTED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"


class Reason(enum.StrEnum):
    """Why a call was refused: the proto's ``ErrorReason`` names (a test pins the two
    lists together), sent as the ErrorInfo's reason. A ``StrEnum``, so a reason read
    back from the wire (a string) compares equal to its member."""

    INVALID_JOB_ID = "INVALID_JOB_ID"
    INVALID_TOPOLOGY = "INVALID_TOPOLOGY"
    RANK_OUT_OF_RANGE = "RANK_OUT_OF_RANGE"
    TOPOLOGY_MISMATCH = "TOPOLOGY_MISMATCH"
    DUPLICATE_RANK = "DUPLICATE_RANK"
    INVALID_ID = "INVALID_ID"
    ID_CONFLICT = "ID_CONFLICT"
    ID_REUSED = "ID_REUSED"
    NOT_RANK_ZERO = "NOT_RANK_ZERO"
    STALE_GENERATION = "STALE_GENERATION"
    PEER_FAILED = "PEER_FAILED"
    JOB_ABORTED = "JOB_ABORTED"
    WORLD_INCOMPLETE = "WORLD_INCOMPLETE"
    WORLD_FULL = "WORLD_FULL"
    BARRIER_TIMEOUT = "BARRIER_TIMEOUT"
    BARRIER_MISMATCH = "BARRIER_MISMATCH"
    KEY_NOT_FOUND = "KEY_NOT_FOUND"
    KEY_WAIT_TIMEOUT = "KEY_WAIT_TIMEOUT"
    NOT_A_COUNTER = "NOT_A_COUNTER"
    JOB_NOT_FOUND = "JOB_NOT_FOUND"
    NOT_A_MEMBER = "NOT_A_MEMBER"
    LIMIT_EXCEEDED = "LIMIT_EXCEEDED"
    DRAINING = "DRAINING"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    JOB_ENDED = "JOB_ENDED"
    NOT_RUNNING = "NOT_RUNNING"
    STORAGE_UNAVAILABLE = "STORAGE_UNAVAILABLE"
    SCOPE_DENIED = "SCOPE_DENIED"
    JOIN_MODE_MISMATCH = "JOIN_MODE_MISMATCH"
    VERSION_MISMATCH = "VERSION_MISMATCH"


class RendezvousFault(Exception):
    """A refused request: what failed, for which job/rank, and what to do."""

    def __init__(
        self,
        code: Code,
        reason: Reason,
        message: str,
        metadata: Mapping[str, str] | None = None,
        failed: Sequence[FailedInfo] = (),
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.metadata: dict[str, str] = dict(metadata or {})
        # PEER_FAILED: the losses, in order, as structured details beside the ErrorInfo.
        self.failed = tuple(failed)


def shown(names: Sequence[str], most: int = 8) -> str:
    """The first ``most`` names, quoted, for a message; " ..." when there are more."""
    return ", ".join(repr(n) for n in names[:most]) + (" ..." if len(names) > most else "")


def ranks_text(ranks: Iterable[int]) -> str:
    """Comma-separated ranks for ErrorInfo metadata (a string map)."""
    return ",".join(str(r) for r in sorted(ranks))
