"""Rendezvous at scale: N ranks join one job and pass one barrier.

    python benchmarks/rendezvous_scale.py --ranks 64 256 1024 4096 --json-out out.json
    python benchmarks/rendezvous_scale.py --ranks --agents 1024 --gpus-per-node 8

Agent mode (``--agents N``): N simulated node agents each make one JoinNode for
``--gpus-per-node`` ranks (N x 8 = 8,192 ranks for 1,024 agents) and the clock stops
when the last agent has its answer. Each case prints a verdict against its target.

One daemon process; ranks are asyncio clients spread over a few processes. Each
rank runs the SDK's real path: health check, Join (long-poll for the world, id
and member table), Barrier. The clock starts when every client process is
connected and released at one agreed instant, and stops when the last rank has
passed the barrier. With torch importable, the same scenario runs against
PyTorch's TCPStore (rank 0 sets the id, others get it, add+wait barrier) in the
same run, side by side. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import secrets
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from _report import emit

from rendezvousd.embedded import spawn

TARGETS_S = {64: 0.060, 1024: 0.8, 4096: 4.0}
# Agent mode, by node count: 1,024 agents x 8 ranks within 1 s.
AGENT_TARGETS_S = {1024: 1.0}
ANCHOR_TCPSTORE_S = {64: 10.1, 1024: 110.0}  # shared/ANCHORS.md, measured on these machines


def _rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


async def _client_process(
    endpoint: str,
    token_file: str,
    job: str,
    ranks: list[int],
    world: int,
    start_at: float,
    gpus_per_node: int = 0,
) -> dict[str, Any]:
    from rendezvousd.client import AsyncRendezvousClient, RendezvousError

    clients = [
        AsyncRendezvousClient(
            endpoint, job, token_file=token_file, connect_timeout=60, call_timeout=120
        )
        for _ in ranks
    ]
    # Connect before the clock starts: we measure rendezvous, not TCP handshakes.
    # (A connected channel also lets the SDK skip its health probe: see rpcs_per_rank.)
    await asyncio.gather(*[c._channel.channel_ready() for c in clients])
    await asyncio.sleep(max(0.0, start_at - time.time()))
    errors: dict[str, int] = {}
    done: list[float] = []

    async def one(client: Any, rank: int) -> None:
        try:
            if gpus_per_node:  # agent mode: ``rank`` is a node, ``world`` the node count
                await client.join_node(
                    min_nodes=world,
                    max_nodes=world,
                    gpus_per_node=gpus_per_node,
                    node_rank=rank,
                    host=f"n{rank}",
                    timeout=120,
                )
                done.append(time.time())
                return
            await client.join(
                num_nodes=world,
                gpus_per_node=1,
                node_rank=rank,
                local_rank=0,
                host=f"n{rank}",
                timeout=120,
            )
            await client.barrier("bench", timeout=120)
            done.append(time.time())
        except RendezvousError as exc:
            errors[exc.code or type(exc).__name__] = (
                errors.get(exc.code or type(exc).__name__, 0) + 1
            )

    await asyncio.gather(*[one(c, r) for c, r in zip(clients, ranks, strict=True)])
    await asyncio.gather(*[c.close() for c in clients])
    return {"done": max(done) if done else 0.0, "ok": len(done), "errors": errors}


def _child(args: argparse.Namespace) -> None:
    ranks = list(range(args.first, args.first + args.count))
    out = asyncio.run(
        _client_process(
            args.endpoint,
            args.token_file,
            args.job,
            ranks,
            args.world,
            args.start_at,
            args.gpus_per_node,
        )
    )
    print(json.dumps(out), flush=True)


def _rpc_count(metrics_url: str) -> int:
    """RPCs the daemon answered, from its own Prometheus counters."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return int(
        sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("rendezvousd_rpc_duration_seconds_count")
        )
    )


def _spawn_children(
    world: int, procs: int, start_at: float, *flags: str
) -> list[subprocess.Popen[str]]:
    """``procs`` copies of this script run with ``flags``, sharing ``world``'s ranks,
    each starting its ranks at ``start_at``."""
    per = [world // procs + (1 if i < world % procs else 0) for i in range(procs)]
    children, first = [], 0
    for count in per:
        argv = [sys.executable, __file__, *flags, "--first", str(first), "--count", str(count)]
        argv += ["--world", str(world), "--start-at", repr(start_at)]
        children.append(subprocess.Popen(argv, stdout=subprocess.PIPE, text=True))
        first += count
    return children


def _results(children: list[subprocess.Popen[str]]) -> list[dict[str, Any]]:
    """What each child printed last: its JSON result."""
    return [json.loads(c.communicate(timeout=600)[0].strip().splitlines()[-1]) for c in children]


def run_ours(world: int, procs: int, gpus_per_node: int = 0) -> dict[str, Any]:
    """Per-rank mode; with ``gpus_per_node``, agent mode (``world`` = node agents)."""
    with tempfile.TemporaryDirectory() as tmp:
        embedded = spawn(Path(tmp), "--log-level", "WARNING", metrics=True)
        daemon, endpoint, metrics_url = embedded.proc, embedded.endpoint, embedded.metrics_url
        try:
            procs = max(1, min(procs, world))
            start_at = time.time() + 2.0 + world / 1000
            job = f"scale-{world}-{secrets.token_hex(3)}"
            children = _spawn_children(
                world,
                procs,
                start_at,
                "--child",
                "--endpoint",
                endpoint,
                "--token-file",
                str(embedded.token_file),
                "--job",
                job,
                "--gpus-per-node",
                str(gpus_per_node),
            )
            results = _results(children)
            errors: dict[str, int] = {}
            for r in results:
                for k, v in r["errors"].items():
                    errors[k] = errors.get(k, 0) + v
            ok = sum(r["ok"] for r in results)
            # Only a run in which every rank finished has a wall time.
            wall = max(r["done"] for r in results) - start_at if ok == world else None
            targets = AGENT_TARGETS_S if gpus_per_node else TARGETS_S
            return {
                "system": "rendezvousd",
                "mode": "agents" if gpus_per_node else "per-rank",
                "ranks": world * (gpus_per_node or 1),
                "agents": world if gpus_per_node else None,
                "client_processes": procs,
                "wall_s": round(wall, 4) if wall is not None else None,
                "ok_ranks": ok,
                "errors": errors,
                "rpcs_per_rank": round(_rpc_count(metrics_url) / world, 2),
                "daemon_peak_rss_mib": round(_rss_kib(daemon.pid) / 1024, 1),
                "target_s": targets.get(world),
                "anchor_tcpstore_s": None if gpus_per_node else ANCHOR_TCPSTORE_S.get(world),
                "meets_target": (wall is not None and wall <= targets[world] and not errors)
                if world in targets
                else None,
            }
        finally:
            embedded.stop()


def _tcpstore_child(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    stores = [
        dist.TCPStore(
            "127.0.0.1",
            args.port,
            args.world,
            False,
            timeout=__import__("datetime").timedelta(seconds=300),
        )
        for _ in range(args.count)
    ]
    time.sleep(max(0.0, args.start_at - time.time()))

    async def one(store: Any, rank: int) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, store.get, "nccl_id")
        await loop.run_in_executor(None, store.add, "arrived", 1)
        await loop.run_in_executor(None, store.wait, ["go"])

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(
            __import__("concurrent.futures").futures.ThreadPoolExecutor(args.count)
        )
        await asyncio.gather(*[one(s, args.first + i) for i, s in enumerate(stores)])

    asyncio.run(main())
    print(json.dumps({"done": time.time()}), flush=True)


def run_tcpstore(world: int, procs: int) -> dict[str, Any] | None:
    try:
        import datetime

        import torch.distributed as dist
    except ImportError:
        return None
    server = dist.TCPStore(
        "127.0.0.1",
        0,
        world + 1,
        True,
        timeout=datetime.timedelta(seconds=300),
        wait_for_workers=False,
    )
    server.set("nccl_id", os.urandom(128))
    start_at = time.time() + 2.0 + world / 200
    children = _spawn_children(
        world, procs, start_at, "--tcpstore-child", "--port", str(server.port)
    )
    deadline = time.time() + 600
    while int(server.add("arrived", 0)) < world and time.time() < deadline:
        time.sleep(0.001)
    server.set("go", b"1")
    done = [r["done"] for r in _results(children)]
    return {
        "system": "torch.TCPStore",
        "ranks": world,
        "client_processes": procs,
        "wall_s": round(max(done) - start_at, 4),
    }


def _verdict(r: dict[str, Any]) -> str:
    """One line per case: the wall time against its target, MET or MISSED."""
    what = (
        f"{r['agents']} agents x {r['ranks'] // r['agents']} = {r['ranks']} ranks"
        if r.get("agents")
        else f"{r['ranks']} ranks"
    )
    wall = "no wall time (errors)" if r["wall_s"] is None else f"{r['wall_s']:.3f} s"
    if r["target_s"] is None:
        return f"{what}: {wall} (no target)"
    verdict = "MET" if r["meets_target"] else "MISSED"
    return f"{what}: {wall}, target <= {r['target_s']:g} s: {verdict}"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ranks", type=int, nargs="*", default=[64, 256, 1024, 4096])
    p.add_argument(
        "--agents", type=int, nargs="*", default=[], help="agent mode: node agent counts"
    )
    p.add_argument("--processes", type=int, default=4, help="client processes")
    p.add_argument(
        "--no-anchor", action="store_true", help="skip TCPStore even if torch is importable"
    )
    p.add_argument(
        "--anchor-max-ranks", type=int, default=64, help="TCPStore is slow: cap its sizes"
    )
    p.add_argument("--json-out", type=Path)
    for hidden in ("--endpoint", "--token-file", "--job"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    p.add_argument("--gpus-per-node", type=int, default=8, help="agent mode: ranks per node")
    for hidden in ("--first", "--count", "--world", "--port"):
        p.add_argument(hidden, type=int, help=argparse.SUPPRESS)
    p.add_argument("--start-at", type=float, help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tcpstore-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return _child(args)
    if args.tcpstore_child:
        return _tcpstore_child(args)
    results: list[dict[str, Any]] = []
    for world in args.ranks:
        results.append(run_ours(world, args.processes))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
        print(_verdict(results[-1]), file=sys.stderr, flush=True)
        if not args.no_anchor and world <= args.anchor_max_ranks:
            anchor = run_tcpstore(world, args.processes)
            if anchor is not None:
                results.append(anchor)
                print(json.dumps(anchor), file=sys.stderr, flush=True)
    for agents in args.agents:
        results.append(run_ours(agents, args.processes, args.gpus_per_node))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
        print(_verdict(results[-1]), file=sys.stderr, flush=True)
    doc = {
        "benchmark": "rendezvous_scale",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "results": results,
        "self_peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    emit(doc, args.json_out)


if __name__ == "__main__":
    main()
