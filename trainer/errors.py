"""The trainer's exception tree.

    TrainerError
    ├── ConfigError                bad topology, config file, env override or CLI value
    │   └── DeviceCountError       too few local devices for the topology
    ├── CommunicatorError          a collective failed
    │   ├── CommunicatorAborted    abort() was called (e.g. a peer died)
    │   ├── CommunicatorTimeout    a peer did not answer within the timeout
    │   ├── PeerConnectionError    a peer's connection broke or was refused
    │   │   ├── TransientInitError communicator init failed on an unreachable peer:
    │   │   │                      a fresh id (the next generation) may succeed
    │   │   └── PeerVersionMismatch a peer runs another rendezvousd version: no retry
    │   │                          or restart changes it
    │   └── DeviceError            this rank's own GPU failed the call (out of memory,
    │                              a CUDA error): no peer is at fault
    ├── RetriesExhausted           a transient bootstrap failure outlasted every retry
    ├── CollectiveArgumentError    an array or argument a collective cannot use
    │                              (also a ValueError)
    ├── BucketingError             the bucketed all-reduce cannot go on
    │   ├── BucketLayoutMismatch   ranks registered different gradient layouts
    │   └── ReducerClosed          the reducer was used after close()
    ├── CheckpointError            a checkpoint could not be written or read
    ├── ReplicasDiverged           ranks' parameter replicas are not the same bytes
    └── AgentError                 the node agent (rendezvous-run) cannot go on
        ├── AgentChannelError      the agent <-> worker channel broke or is corrupt
        └── RestartsExhausted      every allowed restart was used; lists each failure

Errors raised by the client SDK (``rendezvousd.client.errors``), such as the
peer-failed error, pass through unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping


class TrainerError(Exception):
    """Base of every error the trainer raises itself."""


class ConfigError(TrainerError, ValueError):
    """A topology/config value is invalid; the message quotes the bad value.
    ``if_unset``: advice per setting the refusal names, added (``Schema.build``) when
    that setting was never given, its default the value refused."""

    def __init__(self, message: str, *, if_unset: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.if_unset = dict(if_unset or {})


class DeviceCountError(ConfigError):
    """Fewer local accelerator devices than the topology needs."""


class CommunicatorError(TrainerError):
    """A collective operation failed on this rank. ``reported_by``: the rank whose
    notice this rank learned it from, where it did not see the failure itself."""

    reported_by: int | None = None


class CommunicatorAborted(CommunicatorError):
    """The communicator was aborted; the message carries the abort reason."""


class CommunicatorTimeout(CommunicatorError):
    """A peer did not send or receive within the communicator's timeout."""


class PeerConnectionError(CommunicatorError):
    """A connection to a peer rank was refused, reset or closed."""


class PeerVersionMismatch(PeerConnectionError):
    """A peer rank's transport speaks another wire version (the handshake's magic): it
    runs another rendezvousd version. Not retried (a fresh generation meets the same
    peer), and reported at once as this rank's own failure, so that the daemon and the
    launchers name it rather than the rank that exited first."""


class TransientInitError(PeerConnectionError):
    """Communicator init (NCCL's) failed because a peer was unreachable. Its id is
    used up; a retry needs a fresh generation and id. Raised by the backend's
    error seam (``NcclCommunicator._failure``), so no caller reads error text."""


class DeviceError(CommunicatorError):
    """This rank's own GPU failed a communicator call: out of memory, or a CUDA error
    (a sticky one, such as an illegal address, leaves the process's CUDA context
    unusable). The rank failed by itself; its peers are victims, not causes."""


class CollectiveArgumentError(TrainerError, ValueError):
    """A collective was given an unusable array (dtype, layout, read-only) or argument."""


class RetriesExhausted(TrainerError):
    """A transient failure repeated after every allowed retry; ``.last`` is the final one."""

    def __init__(self, what: str, attempts: int, last: BaseException) -> None:
        super().__init__(
            f"{what} failed {attempts} time{'s' if attempts > 1 else ''} "
            f"(retry_attempts={attempts - 1}); last error: {last}"
        )
        self.attempts = attempts
        self.last = last


class BucketingError(TrainerError):
    """The bucketed all-reduce's layout or state forbids the call."""


class BucketLayoutMismatch(BucketingError):
    """Two ranks built different bucket layouts; launching would hang or corrupt."""


class ReducerClosed(BucketingError):
    """A ``BucketedAllReducer`` was used after ``close()``."""


class CheckpointError(TrainerError):
    """A checkpoint could not be written, read or validated."""


class ReplicasDiverged(TrainerError):
    """Ranks' parameter replicas differ (``check_replicas``); ``ranks``: those that
    differ from the most common replica."""

    def __init__(self, message: str, *, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


class AgentError(TrainerError):
    """The node agent (``rendezvous-run``) or its link to a worker cannot go on."""


class AgentChannelError(AgentError):
    """The private agent <-> worker channel broke, or carried a malformed frame."""


class RestartsExhausted(AgentError):
    """``max_restarts`` restarts were used up; the message names every failure.
    ``exit_status``: the launcher's, from the last failure (128+N for a signal)."""

    def __init__(self, message: str, exit_status: int) -> None:
        super().__init__(message)
        self.exit_status = exit_status
