"""Workers started as srun starts them (one process per GPU, no launcher): what they
are told when srun's numbering is translated only in part."""

from __future__ import annotations

import pytest

from rendezvousd.trainer.config import load_config
from rendezvousd.trainer.errors import ConfigError


def test_a_srun_rank_without_the_nodes_says_node_rank_was_never_set() -> None:
    base = {
        "RENDEZVOUSD_RANK": "3",
        "RENDEZVOUSD_NUM_NODES": "3",
        "RENDEZVOUSD_GPUS_PER_NODE": "2",
        "RENDEZVOUSD_ENDPOINT": "127.0.0.1:29420",
    }
    with pytest.raises(ConfigError) as unset:
        load_config(None, env=base)
    said = str(unset.value)
    assert "rank=3 lies on node 1, not node_rank=0 (rank from $RENDEZVOUSD_RANK)" in said
    assert "node_rank was never set (0 is its default)" in said, said
    assert "RENDEZVOUSD_NODE_RANK=$SLURM_NODEID" in said and "'auto'" in said, said
    # Set, it is named with its origin, and the advice for a default is not given.
    with pytest.raises(ConfigError) as given:
        load_config(None, env={**base, "RENDEZVOUSD_NODE_RANK": "0"})
    said = str(given.value)
    assert "node_rank from $RENDEZVOUSD_NODE_RANK" in said and "never set" not in said, said
    # The suggested fixes are taken.
    assert load_config(None, env={**base, "RENDEZVOUSD_NODE_RANK": "1"}).node_rank == 1
    assert load_config(None, env={**base, "RENDEZVOUSD_NODE_RANK": "auto"}).node_rank is None
