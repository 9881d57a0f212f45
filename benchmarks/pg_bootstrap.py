"""The workers' process-group bootstrap: torch's TCPStore against the daemon's KV store.

    $(scripts/torch_venv.sh) benchmarks/pg_bootstrap.py --worlds 4 8 16 --json-out out.json

Why this exists: ``torchrun --rdzv-backend rendezvousd`` could hand its workers a store
over the daemon's authenticated key-value store instead of torch's unauthenticated
TCPStore. gloo's full mesh makes O(world²) store reads at start-up, so the choice
depends on what each read costs; this measures it (docs/trainer.md, "From torchrun",
records the choice).

W worker processes each: import torch, open its store (TCPStore: rank 0 serves it;
daemon: the SDK joins rank r of a W-rank job and wraps the member's KV store in
``rendezvousd.trainer.torchrun.handler.DaemonStore``), report ready; once every worker is
ready the parent sends one start instant, and each times
``init_process_group("gloo", store=PrefixStore(...))`` plus one all-reduce. Imports,
daemon start, joins and connects are outside the clock on both sides; the daemon runs
with default settings, and TCPStore with its defaults (libuv). Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from _report import emit

from rendezvousd.cli.embedded import spawn


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    rank, world = args.rank, args.world
    if args.store == "tcpstore":
        store: Any = dist.TCPStore(
            "127.0.0.1", args.port, world, rank == 0, timeout=timedelta(seconds=120)
        )
    else:
        from rendezvousd.client import RendezvousClient
        from rendezvousd.trainer.torchrun.handler import DaemonStore

        client = RendezvousClient(args.endpoint, args.job, token_file=args.token_file)
        client.join(num_nodes=world, gpus_per_node=1, node_rank=rank, local_rank=0)
        client.start_heartbeat()
        store = DaemonStore(client, timedelta(seconds=120))
    print(json.dumps({"ready": True}), flush=True)
    start_at = float(sys.stdin.readline())
    time.sleep(max(0.0, start_at - time.time()))
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=world
    )
    t = torch.ones(4)
    dist.all_reduce(t)
    done = time.time()
    print(json.dumps({"rank": rank, "s": done - start_at}), flush=True)
    dist.destroy_process_group()
    os._exit(0)


def run(store: str, world: int, endpoint: str, token_file: str) -> dict[str, Any]:
    port = 0
    if store == "tcpstore":
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    job = f"pg-{world}-{secrets.token_hex(3)}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                "--store",
                store,
                "--rank",
                str(r),
                "--world",
                str(world),
                "--port",
                str(port),
                "--endpoint",
                endpoint,
                "--token-file",
                token_file,
                "--job",
                job,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for r in range(world)
    ]
    for p in procs:
        assert p.stdout is not None
        if '"ready"' not in p.stdout.readline():
            for q in procs:
                q.kill()
            raise RuntimeError(f"{store} world {world}: a worker failed before it was ready")
    start_at = time.time() + 0.5
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(f"{start_at!r}\n")
        p.stdin.flush()
    times = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1])["s"] for p in procs]
    return {"store": store, "world": world, "wall_s": round(max(times), 4)}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--worlds", type=int, nargs="*", default=[4, 8, 16])
    p.add_argument("--json-out", type=Path)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--store", default="tcpstore", help=argparse.SUPPRESS)
    for hidden in ("--rank", "--world", "--port"):
        p.add_argument(hidden, type=int, default=0, help=argparse.SUPPRESS)
    for hidden in ("--endpoint", "--token-file", "--job"):
        p.add_argument(hidden, default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return _worker(args)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        daemon = spawn(Path(tmp), "--log-level", "WARNING", exit_with_parent=True)
        try:
            for world in args.worlds:
                for store in ("tcpstore", "daemon"):
                    results.append(run(store, world, daemon.endpoint, str(daemon.token_file)))
                    print(json.dumps(results[-1]), file=sys.stderr, flush=True)
        finally:
            daemon.stop()
    emit(
        {
            "benchmark": "pg_bootstrap",
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "results": results,
        },
        args.json_out,
    )


if __name__ == "__main__":
    main()
