"""The main job: a daemon plus a simulated 2-node x 2-worker CPU training run.

    python -m rendezvousd.trainer.demo [--steps 40] [--out artifacts/multinode_smoke.json]
    python -m rendezvousd.trainer.demo --hosts 3     # as root: 3 real network hosts
    python -m rendezvousd.trainer.demo --backend nccl  # on GPUs, one per rank

Starts rendezvousd on loopback with a fresh token, runs one ``rendezvous-run``
per simulated node (the seed's multinode_smoke config: cpu backend, world 4),
or, with ``--hosts N``, the daemon and N nodes on their own network hosts
(namespaces with their own addresses, ``rendezvousd.trainer.demo.netns``),
shows rank 0's progress, then writes and prints a scorecard: topology, steps,
final loss, max |gradient - single-process full-batch gradient|, rendezvous
time, all-reduce bus bandwidth, and whether exactly one checkpoint was written.

With ``--backend nccl`` the same example trains on GPUs with CuPy and NCCL, one
GPU per rank: 2 simulated nodes each given its own half of the visible GPUs
(``CUDA_VISIBLE_DEVICES``) when there are at least 2, else one node.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

from rendezvousd.cli.embedded import EmbeddedDaemon, spawn
from rendezvousd.errors import DaemonError
from rendezvousd.trainer.comm import nccl
from rendezvousd.trainer.demo.netns import Host, Hosts, unavailable_reason

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "multinode_smoke.toml"
NODES, WORKERS = 2, 2
GRAD_TOLERANCE = 1e-5


def _pump(stream: IO[str], prefix: str, sink: list[str]) -> None:
    for line in stream:
        sink.append(line)
        print(f"{prefix} {line}", end="", file=sys.stderr, flush=True)


def _start_daemon(tmp: Path, head: Host | None) -> EmbeddedDaemon:
    flags = ["--heartbeat-timeout-s", "5"]
    listen = "127.0.0.1:0"
    if head is not None:
        # A private namespace network: plaintext is this demo's choice, not a default.
        flags.append("--insecure-plaintext")
        listen = f"{head.address}:0"
    try:
        daemon = spawn(
            tmp,
            *flags,
            stderr=subprocess.PIPE,
            listen=listen,
            prefix=head.command([]) if head is not None else (),
            # A demo ended by its terminal's close (SIGHUP) must not leave its daemon
            # serving, which since SIGHUP reloads tokens it would.
            exit_with_parent=True,
        )
    except DaemonError as exc:
        raise SystemExit(f"demo: {exc}") from exc
    assert daemon.proc.stderr is not None
    threading.Thread(
        target=_pump, args=(daemon.proc.stderr, "[rendezvousd]", []), daemon=True
    ).start()
    return daemon


def _flags(values: dict[str, Any]) -> list[str]:
    """``--flag value`` pairs, the values as text."""
    return [text for flag, value in values.items() for text in (flag, str(value))]


def gpu_layout(visible: list[str]) -> list[list[str]]:
    """The GPUs each simulated node gets: NODES equal disjoint slices if there are
    enough, else one node with all of them (two ranks must never share a GPU)."""
    nodes_n = NODES if len(visible) >= NODES else 1
    per_node = min(WORKERS, len(visible) // nodes_n)
    return [visible[n * per_node : (n + 1) * per_node] for n in range(nodes_n)]


def _visible_gpus() -> list[str]:
    missing = nccl.unavailable_reason()
    if missing is not None:
        install = (
            ""
            if missing.startswith("no CUDA device")
            else "install rendezvousd[gpu-cuda12] or rendezvousd[gpu-cuda13], or "
        )
        raise SystemExit(
            f"demo: --backend nccl needs CuPy with NCCL and a CUDA device: {missing}; "
            f"{install}use --backend cpu"
        )
    count = nccl.device_count()
    # Ordinals relative to the parent's own restriction, if it has one.
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = inherited.split(",") if inherited else [str(i) for i in range(count)]
    return names[:count]


def run(
    steps: int, out: Path, workdir: Path, hosts: int = 0, backend: str = "cpu"
) -> dict[str, Any]:
    """The demo on loopback, or with ``hosts`` > 0 on that many network hosts;
    ``backend`` "nccl" trains on this machine's GPUs (loopback only)."""
    if backend == "nccl":
        if hosts:
            raise SystemExit("demo: --hosts runs the cpu backend only; drop --hosts for nccl")
        return _run(steps, out, workdir, None, gpu_layout(_visible_gpus()))
    if hosts == 0:
        return _run(steps, out, workdir, None)
    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"demo: --hosts {hosts} builds network namespaces, but {reason}")
    cluster = Hosts(hosts + 1)
    try:
        cluster.build()
        return _run(steps, out, workdir, cluster)
    finally:
        cluster.teardown()


def _run(
    steps: int,
    out: Path,
    workdir: Path,
    cluster: Hosts | None,
    gpus: list[list[str]] | None = None,
) -> dict[str, Any]:
    """``gpus`` None: the cpu backend; else the nccl backend, node n on ``gpus[n]``."""
    results_dir, ckpt_dir = workdir / "results", workdir / "checkpoints"
    backend = "cpu" if gpus is None else "nccl"
    nodes_n, workers = NODES, WORKERS
    if gpus is not None:
        nodes_n, workers = len(gpus), len(gpus[0])
    elif cluster is not None:
        nodes_n = cluster.count - 1
    daemon = _start_daemon(workdir, cluster[0] if cluster is not None else None)
    endpoint, token_file = daemon.endpoint, daemon.token_file
    where = (
        f"its own network host ({', '.join(h.address for h in cluster.hosts[1:])})"
        if cluster is not None
        else "this machine (loopback)"
    )
    print(
        f"demo: rendezvousd on {endpoint}; starting {nodes_n} nodes x {workers} workers "
        f"({backend} backend), each node on {where}",
        file=sys.stderr,
        flush=True,
    )
    started = time.monotonic()
    nodes: list[subprocess.Popen[str]] = []
    pumps = []
    try:
        launcher = {
            "--nnodes": nodes_n,
            "--nproc-per-node": workers,
            "--rdzv-endpoint": endpoint,
            "--token-file": token_file,
            "--backend": backend,
            "--config": CONFIG,
            "--job-id": "multinode-smoke",
        }
        example = {
            "--steps": steps,
            "--result-dir": results_dir,
            "--checkpoint-dir": ckpt_dir,
            # The scorecard checks for exactly one checkpoint, the final one.
            "--checkpoint-every": 0,
        }
        target = ["-m", "rendezvousd.trainer.example", *_flags(example)]
        for node in range(nodes_n):
            flags = _flags({**launcher, "--node-rank": node})
            cmd = [sys.executable, "-m", "rendezvousd.trainer.agent.launcher", *flags, *target]
            if cluster is not None:
                cmd = cluster[1 + node].command(cmd)
            env = None
            if gpus is not None:
                # Local rank i uses device i: each node must see only its own GPUs.
                env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(gpus[node])}
            proc = subprocess.Popen(
                cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
            )
            assert proc.stderr is not None
            sink: list[str] = []
            t = threading.Thread(
                target=_pump, args=(proc.stderr, f"[node{node}]", sink), daemon=True
            )
            t.start()
            nodes.append(proc)
            pumps.append(t)
        codes = [p.wait(timeout=600) for p in nodes]
        for t in pumps:
            t.join(5)
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
        daemon_code = daemon.stop()
    ranks = sorted(results_dir.glob("rank-*.json")) if results_dir.exists() else []
    per_rank = [json.loads(p.read_text()) for p in ranks]
    checkpoints = sorted(p.name for p in ckpt_dir.glob("*.npz")) if ckpt_dir.exists() else []
    r0: dict[str, Any] = next((r for r in per_rank if r["rank"] == 0), {})
    max_diff = r0.get("max_abs_grad_diff_vs_single_process", float("inf"))
    success = (
        codes == [0] * nodes_n
        and len(per_rank) == nodes_n * workers
        and max_diff <= GRAD_TOLERANCE
        and len(checkpoints) == 1
        and sum(r["checkpoint_written"] for r in per_rank) == 1
        and daemon_code == 0
    )
    card = {
        "scorecard": "multinode_smoke",
        "success": success,
        "topology": {
            "num_nodes": nodes_n,
            "gpus_per_node": workers,
            "world_size": nodes_n * workers,
            "backend": r0.get("backend", backend),
            "transport": "daemon (loopback)"
            if cluster is None
            else f"daemon over {nodes_n + 1} network hosts",
            # Simulated nodes keep inter-node traffic on the TCP ring, as real ones would.
            "collective_transport": r0.get("collective_transport"),
            # Each rank's daemon calls: relayed through its node's agent (client.relay).
            "daemon_calls": sorted({str(r.get("daemon_calls")) for r in per_rank}),
        },
        "steps": r0.get("steps"),
        "final_loss": r0.get("final_loss"),
        "max_abs_grad_diff_vs_single_process": max_diff,
        "grad_tolerance": GRAD_TOLERANCE,
        "rendezvous_s_max": max((r["rendezvous_s"] for r in per_rank), default=None),
        "allreduce_busbw_gbps": r0.get("allreduce_busbw_gbps"),
        "buckets": r0.get("buckets"),
        "checkpoints_written": checkpoints,
        # The generation trained in and the node agents' restarts (0 in a clean run).
        "recovery": {
            "generation": r0.get("generation"),
            "restarts": max((r.get("restart_count", 0) for r in per_rank), default=None),
        },
        "node_exit_codes": codes,
        "daemon_exit_code": daemon_code,
        "wall_s": round(time.monotonic() - started, 2),
        "validation_path": (
            f"single-machine loopback simulation on {nodes_n * workers} GPUs "
            "(not real multi-node hardware)"
            if gpus is not None
            else "single-machine loopback simulation (not real multi-node hardware)"
            if cluster is None
            else "network hosts as Linux namespaces on one machine, with their own "
            "addresses and hostnames (not real multi-node hardware)"
        ),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(card, indent=2) + "\n")
    return card


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        # Run through the package's __main__.py, whose file name argparse would show.
        prog="python -m rendezvousd.trainer.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", type=Path, default=Path("artifacts/multinode_smoke.json"))
    p.add_argument(
        "--hosts",
        type=int,
        default=0,
        help="run the nodes on N real network hosts (namespaces; needs root), not loopback",
    )
    p.add_argument(
        "--backend",
        choices=("cpu", "nccl"),
        default="cpu",
        help="nccl: train on this machine's GPUs with CuPy, one GPU per rank",
    )
    args = p.parse_args(argv)
    if args.hosts < 0:
        p.error(f"--hosts={args.hosts} must be >= 0")
    with tempfile.TemporaryDirectory(prefix="rendezvousd-demo-") as tmp:
        card = run(args.steps, args.out, Path(tmp), args.hosts, args.backend)
    print(json.dumps(card, indent=2))
    print(
        f"demo: scorecard written to {args.out} — {'SUCCESS' if card['success'] else 'FAILED'}",
        file=sys.stderr,
    )
    return 0 if card["success"] else 1
