"""Where a worker sits in the world: node/local rank to global rank, and device needs.

A world is ``num_nodes`` nodes of ``gpus_per_node`` workers each. A single node
(``num_nodes == 1``) is the same arithmetic with ``node_rank == 0``, so the
world size and rank it yields are exactly the configured single-node values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from rendezvousd.trainer.errors import ConfigError

if TYPE_CHECKING:
    from rendezvousd.trainer.config import DistributedConfig


def _require_int(name: str, value: object) -> int:
    # bool is an int subclass; True as a rank is always a bug upstream.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be an integer")
    return value


def check_rank(name: str, rank: int, size_name: str, size: int) -> None:
    """Raise ``ConfigError`` unless ``size >= 1`` and ``rank`` is one of its ``size`` places."""
    if size < 1:
        raise ConfigError(f"{size_name}={size} must be at least 1")
    if not 0 <= rank < size:
        raise ConfigError(
            f"{name}={rank} is out of range for {size_name}={size} (expected 0..{size - 1})"
        )


@dataclass(frozen=True, slots=True)
class MultiNodeTopology:
    """One worker's coordinates; validated on construction."""

    num_nodes: int
    gpus_per_node: int
    node_rank: int
    local_rank: int

    def __post_init__(self) -> None:
        num_nodes = _require_int("num_nodes", self.num_nodes)
        gpus = _require_int("gpus_per_node", self.gpus_per_node)
        node_rank = _require_int("node_rank", self.node_rank)
        local_rank = _require_int("local_rank", self.local_rank)
        check_rank("node_rank", node_rank, "num_nodes", num_nodes)
        check_rank("local_rank", local_rank, "gpus_per_node", gpus)

    @classmethod
    def from_global_rank(cls, rank: int, num_nodes: int, gpus_per_node: int) -> MultiNodeTopology:
        """Invert ``rank = node_rank * gpus_per_node + local_rank``."""
        rank = _require_int("rank", rank)
        world_size = cls(num_nodes, gpus_per_node, 0, 0).world_size  # names a bad count
        if not 0 <= rank < world_size:
            raise ConfigError(
                f"rank={rank} is out of range for num_nodes={num_nodes} x "
                f"gpus_per_node={gpus_per_node} (expected 0..{world_size - 1})"
            )
        node_rank, local_rank = divmod(rank, gpus_per_node)
        return cls(num_nodes, gpus_per_node, node_rank, local_rank)

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def rank(self) -> int:
        return self.node_rank * self.gpus_per_node + self.local_rank

    @property
    def is_global_rank_zero(self) -> bool:
        """True only on node 0's local rank 0: the one process that logs and checkpoints."""
        return self.node_rank == 0 and self.local_rank == 0

    @property
    def is_multi_node(self) -> bool:
        return self.num_nodes >= 2


#: What the device-count rule reads: a topology, or a config (whose counts may be unset).
DeviceLayout = Union[MultiNodeTopology, "DistributedConfig"]


def required_local_devices(layout: DeviceLayout) -> int:
    """Devices one worker's machine must expose for ``layout``.

    Multi-node: only this node's ``gpus_per_node`` (the others live elsewhere).
    Single node: the whole world runs here, so ``world_size``.
    """
    if layout.num_nodes >= 2:
        if layout.gpus_per_node is None:
            raise ConfigError(
                f"num_nodes={layout.num_nodes} needs gpus_per_node to be set "
                "to count the devices each node must have"
            )
        return layout.gpus_per_node
    world_size = layout.world_size
    if world_size is None:
        # An unset single-node world size means one worker.
        return 1
    return world_size
