"""A worker as srun starts one: ``init_distributed()`` from the environment alone, its
log at INFO on stderr (as a training script that configures logging shows it), then
a "ready" line with where it was placed, and a clean leave.

``--logging none``: the script configures no logging (a plain ``python train.py``);
``--logging warning``: it configures logging at WARNING."""

from __future__ import annotations

import argparse
import logging
import sys

from report import emit

from rendezvousd.trainer.distributed import init_distributed


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--logging", choices=["info", "warning", "none"], default="info")
    level = p.parse_args().logging
    if level != "none":
        logging.basicConfig(level=level.upper(), stream=sys.stderr)
    with init_distributed() as ctx:
        emit(
            "ready",
            rank=ctx.rank,
            node_rank=ctx.topology.node_rank,
            local_rank=ctx.topology.local_rank,
            world_size=ctx.world_size,
            job_id=ctx.config.job_id,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
