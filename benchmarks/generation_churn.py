"""What a job's generations leave behind in the daemon: its RSS and its state files.

    python benchmarks/generation_churn.py --generations 20000 --json-out out.json

A crash-looping elastic job, or a job restarted for hours, opens one generation after
another. Each generation's id is remembered (the used-id history, bounded), and with
``--state-dir`` each commit rewrites the job's row. This drives one job of a fresh
daemon through ``--generations`` rounds of Join then AbortJob, on one connected SDK
client (connects excluded), per rank (``Join``, a world of 1) and per node
(``JoinNode``, 1 node of 1 GPU), in memory and with ``--state-dir`` (``--modes``).
Every ``--every`` generations it samples the daemon's RSS and the state directory's
size on disk.

Printed per mode: the samples, and the growth from the first sample after the
warm-up (``--warmup`` generations, where allocator pools and caches fill) to the
last, in bytes per generation. A bound history keeps both near 0: a leak of N bytes
per generation shows as N. There is no anchor: TCPStore keeps no generations (torch's
c10d rendezvous keeps its state in one store key, rewritten whole each round).
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from _proc import status_kib
from _report import emit

from rendezvousd.cli.embedded import spawn
from rendezvousd.client import RendezvousClient

MODES = ("rank", "node", "rank-state", "node-state")


def _disk_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def _one_generation(client: RendezvousClient, node: bool) -> None:
    if node:
        joined = client.join_node(min_nodes=1, max_nodes=1, gpus_per_node=1, node_rank=0)
        generation = joined.generation
    else:
        generation = client.join(num_nodes=1, gpus_per_node=1, local_rank=0, node_rank=0).generation
    client.abort("generation_churn: the next generation", generation=generation)


def run_mode(mode: str, generations: int, every: int, warmup: int) -> dict[str, Any]:
    node = mode.startswith("node")
    with tempfile.TemporaryDirectory(prefix="churn-") as tmp:
        work = Path(tmp)
        state = work / "state"
        flags = ["--state-dir", str(state)] if mode.endswith("-state") else []
        # Its log (three lines a generation) is not what is measured.
        daemon = spawn(work, *flags, stderr=subprocess.DEVNULL, exit_with_parent=True)
        token = (work / "token").read_text().strip()
        client = RendezvousClient(daemon.endpoint, "churn", token=token)
        samples: list[dict[str, float]] = []
        began = time.perf_counter()
        try:
            for done in range(1, generations + 1):
                _one_generation(client, node)
                if done % every == 0 or done == generations:
                    samples.append(
                        {
                            "generations": done,
                            "rss_kib": status_kib(daemon.proc.pid),
                            "state_bytes": _disk_bytes(state),
                            "elapsed_s": round(time.perf_counter() - began, 2),
                        }
                    )
        finally:
            client.close()
            daemon.stop()
    warm = [s for s in samples if s["generations"] >= warmup] or samples[-1:]
    first, last = warm[0], samples[-1]
    span = last["generations"] - first["generations"]
    return {
        "mode": mode,
        "generations": generations,
        "per_second": round(generations / samples[-1]["elapsed_s"], 1),
        "rss_bytes_per_generation": (
            round((last["rss_kib"] - first["rss_kib"]) * 1024 / span, 3) if span else None
        ),
        "state_bytes_per_generation": (
            round((last["state_bytes"] - first["state_bytes"]) / span, 3) if span else None
        ),
        "peak_rss_kib": max(s["rss_kib"] for s in samples),
        "samples": samples,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--generations", type=int, default=20_000)
    ap.add_argument("--every", type=int, default=2_000, help="sample every N generations")
    ap.add_argument("--warmup", type=int, default=4_000, help="growth counted from here")
    ap.add_argument("--modes", default=",".join(MODES), help=f"any of {', '.join(MODES)}")
    ap.add_argument("--json-out")
    a = ap.parse_args()
    modes = [m for m in a.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        ap.error(f"unknown mode(s) {', '.join(unknown)}: choose from {', '.join(MODES)}")
    if a.generations < 1 or a.every < 1:
        ap.error("--generations and --every must be at least 1")
    report = {
        "benchmark": "generation_churn",
        "runs": [run_mode(m, a.generations, a.every, a.warmup) for m in modes],
    }
    emit(report, a.json_out)


if __name__ == "__main__":
    main()
