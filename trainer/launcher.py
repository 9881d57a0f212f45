"""``rendezvous-run``: start this node's workers, torchrun-style.

    rendezvous-run --nnodes 2 --node-rank 0 --nproc-per-node 4 \\
        --rdzv-endpoint head:29420 --token-file /etc/rendezvousd/token train.py --lr 0.1
    rendezvous-run --standalone --nproc-per-node 4 -m mypkg.train

Settings come from ``--config`` (the trainer TOML), the ``RENDEZVOUSD_*`` env vars
and the flags below, exactly as in the workers (``load_config``). ``--node-rank
auto`` lets the daemon assign node ranks at join; global ranks are then unknown
until the workers have joined. Each worker gets the resolved settings as
``RENDEZVOUSD_*`` variables plus ``RENDEZVOUSD_LOCAL_RANK``, and, for user
scripts, torchrun's LOCAL_RANK, LOCAL_WORLD_SIZE, WORLD_SIZE and (when the node
rank is known) RANK and NODE_RANK. Workers die with the launcher (parent-death
signal). If one worker fails, the others on this node are stopped, and the exit
status is non-zero with a message naming the worker that failed first and the
root cause the daemon recorded (the first rank it lost, on any node).
``--standalone`` runs an embedded daemon with a fresh token for single-machine jobs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from rendezvousd.embedded import EmbeddedDaemon, spawn
from rendezvousd.trainer.config import (
    CONFIG_ENV,
    ENV_LOCAL_RANK,
    SCHEMA,
    DistributedConfig,
    RendezvousTransport,
    config_env,
    load_layers,
)
from rendezvousd.trainer.errors import ConfigError
from rendezvousd.trainer.root_cause import lost_member
from rendezvousd.trainer.supervisor import Workers

TOKEN_FILE_ENV = "RENDEZVOUSD_TOKEN_FILE"
STOP_GRACE_S = 10.0
# torchrun's spellings, kept as aliases of the config's own flags.
ALIASES = {
    "num_nodes": ["--nnodes"],
    "gpus_per_node": ["--nproc-per-node"],
    "rendezvous.endpoint": ["--rdzv-endpoint"],
    "retry_attempts": ["--retries"],
}
# Per-worker settings: the launcher assigns them, never inherits them.
PER_WORKER = ("rank", "local_rank")
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rendezvous-run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config", default=None, help=f"trainer TOML config, also passed to workers ({CONFIG_ENV})"
    )
    SCHEMA.add_arguments(p.add_argument_group("distributed"), aliases=ALIASES, exclude=PER_WORKER)
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


def _note(message: str) -> None:
    print(f"rendezvous-run: {message}", file=sys.stderr, flush=True)


def resolve(args: argparse.Namespace, env: Mapping[str, str]) -> DistributedConfig:
    """The node's config, as its workers will load it; ConfigError if unusable."""
    shared_env = {k: v for k, v in env.items() if k not in _per_worker_env()}
    layers = load_layers(args.config, env=shared_env)
    layers.update(SCHEMA.from_cli(args, ALIASES))
    config = SCHEMA.build([layers])
    if config.is_multi_node and "node_rank" not in layers:
        # The default 0 would put every node on node 0.
        raise ConfigError(
            f"num_nodes={config.num_nodes} needs this node's rank: pass --node-rank "
            "(0..num_nodes-1, or 'auto' to let the daemon assign it), or set "
            "RENDEZVOUSD_NODE_RANK or node_rank in the config file"
        )
    if args.standalone and config.is_multi_node:
        raise ConfigError("--standalone runs a single-machine job: use --nnodes 1")
    if not args.standalone and config.rendezvous.kind != "daemon":
        raise ConfigError(
            "no rendezvous endpoint: pass --rdzv-endpoint, set RENDEZVOUSD_ENDPOINT, "
            "or use --standalone"
        )
    return config


def _per_worker_env() -> set[str]:
    return {o.env for k, o in SCHEMA.options.items() if k in PER_WORKER and o.env is not None}


def worker_env(
    config: DistributedConfig, local_rank: int, config_path: str | None, base: Mapping[str, str]
) -> dict[str, str]:
    """Env for one worker: the resolved settings, its local rank, and torchrun's names."""
    worker = dataclasses.replace(config, local_rank=local_rank)
    env = {k: v for k, v in base.items() if k not in _per_worker_env() and k not in TORCHRUN_ENV}
    env.update(config_env(worker))
    env[ENV_LOCAL_RANK] = str(local_rank)
    if config.rendezvous.token_file is not None:
        env[TOKEN_FILE_ENV] = config.rendezvous.token_file
    if config_path is not None:
        env[CONFIG_ENV] = config_path
    env.update(
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(config.local_world_size),
        WORLD_SIZE=str(config.effective_world_size),
    )
    if (topo := worker.topology()) is not None:
        env.update(RANK=str(topo.rank), NODE_RANK=str(topo.node_rank))
    return env


def supervise(workers: Workers, config: DistributedConfig) -> int:
    """Wait for every worker; on the first failure stop the rest and name the cause."""
    failed = workers.wait()
    if failed is None:
        return 0
    _note(
        f"worker {failed.name} (pid {failed.pid}) failed first, with {failed.how}; "
        "stopping the other workers on this node"
    )
    transport = config.rendezvous
    # Asked while the siblings still run: stopping them first would add their
    # losses to the daemon's record, possibly ahead of a loss it has not seen yet.
    lost = (
        lost_member(transport.endpoint, config.job_id, transport.token_file, tls=transport.tls())
        if transport.kind == "daemon" and transport.endpoint is not None
        else None
    )
    workers.stop(STOP_GRACE_S)
    if lost is not None:
        _note(f"root cause: {lost.describe()}")
    else:
        _note(
            f"root cause: worker {failed.name} on this node ({failed.how}), the first to "
            "fail here; the daemon recorded no lost rank or could not be asked"
        )
    return failed.exit_status


def _names(config: DistributedConfig) -> list[str]:
    """How failures name each worker: global rank when known, else local rank."""
    names = []
    for i in range(config.local_world_size):
        topo = dataclasses.replace(config, local_rank=i).topology()
        names.append(f"rank {topo.rank}" if topo is not None else f"local rank {i}")
    return names


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    base = dict(os.environ)
    try:
        config = resolve(args, base)
    except ConfigError as exc:
        return _fail(str(exc))
    if config.is_multi_node and config.node_rank is None:
        _note(
            "node rank 'auto': the daemon assigns this node's rank at join, so global "
            "ranks are not known here; workers get no RANK/NODE_RANK variables "
            "(use ctx.rank after init_distributed) and failures name local ranks"
        )
    daemon: EmbeddedDaemon | None = None
    with tempfile.TemporaryDirectory(prefix="rendezvous-run-") as tmp:
        if args.standalone:
            daemon = spawn(Path(tmp), "--log-level", "WARNING")
            transport = RendezvousTransport.daemon(daemon.endpoint, str(daemon.token_file))
            config = dataclasses.replace(config, rendezvous=transport)
        cmd = [sys.executable, "-m", args.target] if args.module else [sys.executable, args.target]
        cmd += [a for a in args.args if a != "--"]
        workers = Workers(
            cmd,
            [worker_env(config, i, args.config, base) for i in range(config.local_world_size)],
            _names(config),
        )
        previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

        def forward(signum: int, _frame: object) -> None:
            workers.send(signum)

        for s in previous:
            signal.signal(s, forward)
        try:
            return supervise(workers, config)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            if daemon is not None:
                daemon.stop()


if __name__ == "__main__":
    sys.exit(main())
