"""``rendezvous-run``: start this node's workers, torchrun-style.

    rendezvous-run --nnodes 2 --node-rank 0 --nproc-per-node 4 \\
        --rdzv-endpoint head:29420 --token-file /etc/rendezvousd/token train.py --lr 0.1
    rendezvous-run --standalone --nproc-per-node 4 -m mypkg.train

Each worker gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK and the
RENDEZVOUSD_* variables the SDK and ``init_distributed`` read. If one worker
fails, the others on this node are stopped, and the exit status is non-zero with
a message naming the rank. ``--standalone`` runs an embedded daemon with a fresh
token for single-machine jobs.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from rendezvousd.embedded import EmbeddedDaemon, spawn
from rendezvousd.trainer.config import (
    ENV_ENDPOINT,
    ENV_GPUS_PER_NODE,
    ENV_NODE_RANK,
    ENV_NUM_NODES,
    ENV_RETRIES,
)
from rendezvousd.trainer.distributed import BACKEND_ENV, CONFIG_ENV, JOB_ENV

TOKEN_FILE_ENV = "RENDEZVOUSD_TOKEN_FILE"
STOP_GRACE_S = 10.0


def _env_int(env: dict[str, str] | os._Environ[str], name: str, default: int | None) -> int | None:
    raw = env.get(name, "")
    if raw.strip().isdigit():
        return int(raw)
    return default


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rendezvous-run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    env = os.environ
    p.add_argument(
        "--nnodes",
        type=int,
        default=_env_int(env, ENV_NUM_NODES, 1),
        help=f"number of nodes (env {ENV_NUM_NODES}, default 1)",
    )
    p.add_argument(
        "--node-rank",
        type=int,
        default=_env_int(env, ENV_NODE_RANK, None),
        help=f"this node's rank, 0..nnodes-1 (env {ENV_NODE_RANK})",
    )
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=_env_int(env, ENV_GPUS_PER_NODE, 1),
        help=f"workers (GPUs) on this node (env {ENV_GPUS_PER_NODE}, default 1)",
    )
    p.add_argument(
        "--rdzv-endpoint", default=None, help="rendezvousd HOST:PORT (env RENDEZVOUSD_ENDPOINT)"
    )
    p.add_argument(
        "--token-file", default=None, help="daemon token file (env RENDEZVOUSD_TOKEN_FILE)"
    )
    p.add_argument(
        "--job-id", default=None, help="job id shared by every node (default: 'default')"
    )
    p.add_argument("--backend", choices=("cpu", "nccl"), default=None)
    p.add_argument("--config", default=None, help="trainer TOML config passed to workers")
    p.add_argument(
        "--retries", type=int, default=None, help="retry attempts (env RENDEZVOUSD_RETRIES)"
    )
    p.add_argument(
        "--standalone", action="store_true", help="run an embedded daemon (single machine)"
    )
    p.add_argument("-m", dest="module", action="store_true", help="run the target as a module")
    p.add_argument("target", help="script path (or module with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the target")
    return p


def _fail(message: str) -> int:
    print(f"rendezvous-run: error: {message}", file=sys.stderr, flush=True)
    return 2


def worker_env(
    args: argparse.Namespace,
    local_rank: int,
    endpoint: str | None,
    token_file: str | None,
    base: dict[str, str],
) -> dict[str, str]:
    node_rank = args.node_rank or 0
    env = dict(base)
    env.update(
        {
            "RANK": str(node_rank * args.nproc_per_node + local_rank),
            "WORLD_SIZE": str(args.nnodes * args.nproc_per_node),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(args.nproc_per_node),
            "NODE_RANK": str(node_rank),
            ENV_NUM_NODES: str(args.nnodes),
            ENV_GPUS_PER_NODE: str(args.nproc_per_node),
            ENV_NODE_RANK: str(node_rank),
            JOB_ENV: args.job_id or base.get(JOB_ENV, "default"),
        }
    )
    if endpoint:
        env[ENV_ENDPOINT] = endpoint
    if token_file:
        env[TOKEN_FILE_ENV] = token_file
    if args.backend:
        env[BACKEND_ENV] = args.backend
    if args.config:
        env[CONFIG_ENV] = args.config
    if args.retries is not None:
        env[ENV_RETRIES] = str(args.retries)
    return env


def supervise(procs: Sequence[subprocess.Popen[bytes]], ranks: Sequence[int]) -> int:
    """Wait for every worker; on the first failure stop the rest and name the rank."""
    while True:
        running = False
        for proc, rank in zip(procs, ranks, strict=True):
            code = proc.poll()
            if code is None:
                running = True
            elif code != 0:
                how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                print(
                    f"rendezvous-run: worker rank {rank} (pid {proc.pid}) failed with {how}; "
                    "stopping the other workers on this node",
                    file=sys.stderr,
                    flush=True,
                )
                _stop(procs)
                return code if code > 0 else 128 - code
        if not running:
            return 0
        time.sleep(0.05)


def _stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.nnodes < 1 or args.nproc_per_node < 1:
        return _fail(
            f"--nnodes={args.nnodes} and --nproc-per-node={args.nproc_per_node} must be >= 1"
        )
    if args.nnodes > 1 and args.node_rank is None:
        return _fail("--node-rank is required when --nnodes > 1")
    if args.node_rank is not None and not 0 <= args.node_rank < args.nnodes:
        return _fail(f"--node-rank={args.node_rank} is out of range for --nnodes={args.nnodes}")
    if args.standalone and args.nnodes != 1:
        return _fail("--standalone runs a single-machine job: use --nnodes 1")
    base = dict(os.environ)
    endpoint = args.rdzv_endpoint or base.get(ENV_ENDPOINT)
    token_file = args.token_file or base.get(TOKEN_FILE_ENV)
    daemon: EmbeddedDaemon | None = None
    with tempfile.TemporaryDirectory(prefix="rendezvous-run-") as tmp:
        if args.standalone:
            daemon = spawn(Path(tmp), "--log-level", "WARNING")
            endpoint, token_file = daemon.endpoint, str(daemon.token_file)
        elif not endpoint:
            return _fail(
                "no rendezvous endpoint: pass --rdzv-endpoint, set RENDEZVOUSD_ENDPOINT, or use --standalone"
            )
        cmd = [sys.executable, "-m", args.target] if args.module else [sys.executable, args.target]
        cmd += [a for a in args.args if a != "--"]
        ranks = [
            (args.node_rank or 0) * args.nproc_per_node + i for i in range(args.nproc_per_node)
        ]
        procs = [
            subprocess.Popen(cmd, env=worker_env(args, i, endpoint, token_file, base))
            for i in range(args.nproc_per_node)
        ]
        previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

        def forward(signum: int, _frame: object) -> None:
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signum)

        for s in previous:
            signal.signal(s, forward)
        try:
            return supervise(procs, ranks)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            if daemon is not None:
                daemon.stop()


if __name__ == "__main__":
    sys.exit(main())
