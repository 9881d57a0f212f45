"""The trainer's exception tree.

    TrainerError
    ├── ConfigError            bad topology, config file, env override or CLI value
    │   └── DeviceCountError   too few local devices for the topology
    ├── CommunicatorError      a collective failed
    │   ├── CommunicatorAborted    abort() was called (e.g. a peer died)
    │   ├── CommunicatorTimeout    a peer did not answer within the timeout
    │   └── PeerConnectionError    a peer's connection broke or was refused
    ├── CollectiveArgumentError  an array or argument a collective cannot use
    ├── BucketLayoutMismatch   ranks registered different gradient layouts
    └── CheckpointError        a checkpoint could not be written or read

Errors raised by the client SDK (``rendezvousd.client.errors``), such as the
peer-failed error, pass through unchanged.
"""

from __future__ import annotations


class TrainerError(Exception):
    """Base of every error the trainer raises itself."""


class ConfigError(TrainerError, ValueError):
    """A topology/config value is invalid; the message quotes the bad value."""


class DeviceCountError(ConfigError):
    """Fewer local accelerator devices than the topology needs."""


class CommunicatorError(TrainerError):
    """A collective operation failed on this rank."""


class CommunicatorAborted(CommunicatorError):
    """The communicator was aborted; the message carries the abort reason."""


class CommunicatorTimeout(CommunicatorError):
    """A peer did not send or receive within the communicator's timeout."""


class PeerConnectionError(CommunicatorError):
    """A connection to a peer rank was refused, reset or closed."""


class CollectiveArgumentError(TrainerError, ValueError):
    """A collective was given an unusable array (dtype, layout, read-only) or argument."""


class BucketLayoutMismatch(TrainerError):
    """Two ranks built different bucket layouts; launching would hang or corrupt."""


class CheckpointError(TrainerError):
    """A checkpoint could not be written, read or validated."""
