"""Training side: topology, communicators, bucketed all-reduce, data, checkpoints.

``init_distributed()`` joins the rendezvous and returns the communicator; the NCCL
backend (``rendezvousd.trainer.comm.nccl``) loads CuPy only when it is chosen, so
importing this package never imports CuPy. Every public name is imported on
first use: a worker or the node agent pays only for the modules it touches.
"""

import os
from typing import TYPE_CHECKING

from rendezvousd._lazy import lazy_exports

# gRPC core logs at INFO "fork_posix.cc ... Other threads are currently calling into
# gRPC, skipping fork() handlers" on every fork of a process whose client beats, so a
# worker started without rendezvous-run (srun, a plain python) printed it per
# DataLoader worker and epoch (a review: 12 lines per rank for 3 epochs). The threshold
# is read when grpc is first imported: here, before any of the trainer's modules
# imports the SDK. As rendezvous-run and the torchrun handler do; a value the user set
# stands (one that imports grpc before the trainer sets it itself, docs/trainer.md).
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

if TYPE_CHECKING:
    from rendezvousd.trainer.agent.state_copy import StepState, agree_on_step
    from rendezvousd.trainer.bucketing import BucketedAllReducer
    from rendezvousd.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from rendezvousd.trainer.comm.communicator import Communicator, ReduceOp
    from rendezvousd.trainer.config import DistributedConfig
    from rendezvousd.trainer.data import DataCursor, ShardedLoader
    from rendezvousd.trainer.distributed import DistributedContext, init_distributed
    from rendezvousd.trainer.errors import (
        AgentChannelError,
        AgentError,
        BucketingError,
        BucketLayoutMismatch,
        CheckpointError,
        CollectiveArgumentError,
        CommunicatorAborted,
        CommunicatorError,
        CommunicatorTimeout,
        ConfigError,
        DeviceCountError,
        DeviceError,
        PeerConnectionError,
        PeerVersionMismatch,
        ReducerClosed,
        ReplicasDiverged,
        RestartsExhausted,
        RetriesExhausted,
        TrainerError,
        TransientInitError,
    )
    from rendezvousd.trainer.topology import MultiNodeTopology

__all__ = [
    "AgentChannelError",
    "AgentError",
    "BucketLayoutMismatch",
    "BucketedAllReducer",
    "BucketingError",
    "CheckpointError",
    "CollectiveArgumentError",
    "Communicator",
    "CommunicatorAborted",
    "CommunicatorError",
    "CommunicatorTimeout",
    "ConfigError",
    "DataCursor",
    "DeviceCountError",
    "DeviceError",
    "DistributedConfig",
    "DistributedContext",
    "MultiNodeTopology",
    "PeerConnectionError",
    "PeerVersionMismatch",
    "ReduceOp",
    "ReducerClosed",
    "ReplicasDiverged",
    "RestartsExhausted",
    "RetriesExhausted",
    "ShardedLoader",
    "StepState",
    "TrainerError",
    "TransientInitError",
    "agree_on_step",
    "init_distributed",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    __all__,
    {
        "rendezvousd.trainer.bucketing": ("BucketedAllReducer",),
        "rendezvousd.trainer.checkpoint": (
            "latest_checkpoint",
            "load_checkpoint",
            "save_checkpoint",
        ),
        "rendezvousd.trainer.comm.communicator": (
            "Communicator",
            "ReduceOp",
        ),
        "rendezvousd.trainer.config": ("DistributedConfig",),
        "rendezvousd.trainer.data": ("DataCursor", "ShardedLoader"),
        "rendezvousd.trainer.distributed": (
            "DistributedContext",
            "init_distributed",
        ),
        "rendezvousd.trainer.agent.state_copy": (
            "StepState",
            "agree_on_step",
        ),
        "rendezvousd.trainer.topology": ("MultiNodeTopology",),
    },
    errors="rendezvousd.trainer.errors",
)
