"""Drifted parameter replicas are named: ``ctx.check_replicas`` over real workers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from rendezvousd.trainer.replicas import replica_digest

# Rank 1 registers two gradients of one shape in the other order: verify_layout
# passes (it fingerprints shapes and dtypes), and each step averages rank 1's "a"
# with the others' "b". Only a comparison of the parameters can see it.
WORKER = """
import json, sys
import numpy as np
from rendezvousd.trainer.distributed import init_distributed
from rendezvousd.trainer.errors import ReplicasDiverged

with init_distributed() as ctx:
    params = {"a": np.zeros(4, np.float32), "b": np.zeros(4, np.float32)}
    grads = {"a": np.zeros(4, np.float32), "b": np.zeros(4, np.float32)}
    ctx.check_replicas(params)  # equal at the start: no error
    order = ["b", "a"] if ctx.rank == 1 else ["a", "b"]
    reducer = ctx.reducer([grads[k] for k in order])
    reducer.verify_layout(ctx.rendezvous, ctx.rank, ctx.world_size, timeout=30)
    grads["a"][...] = ctx.rank + 1.0
    grads["b"][...] = 10.0 * (ctx.rank + 1)
    for i in range(2):
        reducer.mark_ready(i)
    reducer.wait()
    reducer.close()
    for k in params:
        params[k] -= grads[k]
    try:
        ctx.check_replicas(params)
        said = None
    except ReplicasDiverged as exc:
        said = [str(exc), exc.ranks]
    with open(f"{sys.argv[1]}/rank-{ctx.rank}.json", "w") as fh:
        json.dump(said, fh)
"""


def test_gradients_swapped_on_one_rank_are_named_by_check_replicas(tmp_path: Path) -> None:
    script = tmp_path / "swap.py"
    script.write_text(WORKER)
    run = subprocess.run(
        [
            sys.executable, "-m", "rendezvousd.trainer.agent.launcher", "--standalone",
            "--nproc-per-node", "3", "--backend", "cpu", str(script), str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    said = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(3)]
    # Every rank is told, and the one that drifted is named against the two that agree.
    for message, ranks in said:
        assert ranks == [1], message
        assert message.startswith(
            "the parameters of rank(s) 1 differ from those of rank(s) 0, 2 (of 3)"
        ), message
        assert "verify_layout cannot see" in message


def test_the_digest_covers_names_dtypes_shapes_and_bytes() -> None:
    base = {"w": np.zeros((2, 3), np.float32)}
    assert replica_digest(base) == replica_digest({"w": np.zeros((2, 3), np.float32)})
    others = [
        {"v": np.zeros((2, 3), np.float32)},
        {"w": np.zeros((3, 2), np.float32)},
        {"w": np.zeros((2, 3), np.int32)},
        {"w": np.full((2, 3), -0.0, np.float32)},
    ]
    assert all(replica_digest(o) != replica_digest(base) for o in others)
    assert 0 <= replica_digest(base) < 2**56
