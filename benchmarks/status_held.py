"""What ``rendezvousd status`` and the status page's ``/api/jobs`` cost while the daemon
holds many finished jobs (kept until --job-ttl-s), and the live few among them.

    python benchmarks/status_held.py [--finished 1000] [--live 2] [--runs 3] [--json-out out.json]

A fresh daemon (--job-ttl-s 3600, --max-jobs above what is made, so nothing is forgotten)
gets ``--finished`` one-rank jobs that finish (every 10th aborted, every 5th failed by its
own rank's report, the rest ended by a Leave), then ``--live`` running ones. Each
figure is the median of ``--runs``:

- ``status``: ``rendezvousd status`` as a new process, its wall time (Python's start-up,
  ~0.3-0.5 s, included) and the bytes it prints: the live jobs, the finished counted;
- ``status --all``: every job listed, one GetJob each: what ``status`` printed before
  2026-12-07;
- ``api``: ``/api/jobs`` as the page polls it (the live jobs, the first 20 finished);
- ``api all``: ``/api/jobs?finished_limit=1024``, every job: what it answered before.

No anchor: torchrun's c10d rendezvous has no view of past jobs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from _report import emit

from rendezvousd.cli.embedded import spawn
from rendezvousd.client import AsyncRendezvousClient, RendezvousClient, RendezvousError
from rendezvousd.web.status_page import VIEW_TTL_S

UID = b"\x5b" * 128
ONE: dict[str, Any] = dict(num_nodes=1, gpus_per_node=1, node_rank=0, local_rank=0)


async def _finish(endpoint: str, token: str, i: int, gate: asyncio.Semaphore) -> None:
    async with gate, AsyncRendezvousClient(endpoint, f"done-{i:05}", token=token) as c:
        await c.join(**ONE, unique_id=UID, timeout=60)
        if i % 10 == 0:
            await c.abort("status_held: aborted")
        elif i % 5 == 0:
            with contextlib.suppress(RendezvousError):  # the failure it reported
                await c.report_failure(0, "status_held: failed")
        else:
            await c.leave()


async def _finish_all(endpoint: str, token: str, n: int) -> None:
    gate = asyncio.Semaphore(32)
    await asyncio.gather(*(_finish(endpoint, token, i, gate) for i in range(n)))


def _median_run(cmd: list[str], runs: int) -> dict[str, Any]:
    times, sizes, last = [], [], ""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RENDEZVOUSD_")}
    for _ in range(runs):
        began = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, timeout=300, env=env, check=True)
        times.append(time.perf_counter() - began)
        sizes.append(len(done.stdout))
        last = done.stdout.decode().rstrip().rpartition("\n")[2]
    return {
        "wall_s": round(statistics.median(times), 3),
        "bytes": int(statistics.median(sizes)),
        "last_line": last,
    }


def _median_get(url: str, token: str, runs: int) -> dict[str, Any]:
    times, sizes = [], []
    for _ in range(runs):
        # Past the page's view cache (VIEW_TTL_S), so that each run builds its views.
        time.sleep(VIEW_TTL_S + 0.1)
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
        began = time.perf_counter()
        with urllib.request.urlopen(request, timeout=60) as answer:
            body = answer.read()
        times.append(time.perf_counter() - began)
        sizes.append(len(body))
    return {"wall_s": round(statistics.median(times), 3), "bytes": int(statistics.median(sizes))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--finished", type=int, default=1000)
    parser.add_argument("--live", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="status-held-") as tmp:
        work = Path(tmp)
        held = str(args.finished + args.live + 16)
        daemon = spawn(
            work, "--job-ttl-s", "3600", "--max-jobs", held, "--log-level", "WARNING",
            stderr=subprocess.DEVNULL, metrics=True, exit_with_parent=True,
        )  # fmt: skip
        token = (work / "token").read_text().strip()
        live: list[RendezvousClient] = []
        try:
            began = time.perf_counter()
            asyncio.run(_finish_all(daemon.endpoint, token, args.finished))
            made_s = time.perf_counter() - began
            for i in range(args.live):
                c = RendezvousClient(daemon.endpoint, f"live-{i}", token=token)
                live.append(c)
                c.join(**ONE, unique_id=UID, timeout=60)
                c.start_heartbeat(1.0)
            status = [
                sys.executable, "-m", "rendezvousd.cli", "status", "--endpoint",
                daemon.endpoint, "--token-file", str(daemon.token_file), "--timeout", "60",
            ]  # fmt: skip
            base = daemon.metrics_url.removesuffix("/metrics")
            report = {
                "finished": args.finished,
                "live": args.live,
                "runs": args.runs,
                "made_s": round(made_s, 1),
                "cpus": os.cpu_count(),
                "load_1m": round(os.getloadavg()[0], 1),
                "status": _median_run(status, args.runs),
                "status --all": _median_run([*status, "--all"], args.runs),
                "api": _median_get(base + "/api/jobs", token, args.runs),
                "api all": _median_get(base + "/api/jobs?finished_limit=1024", token, args.runs),
            }
        finally:
            for c in live:
                c.close()
            daemon.stop()
    emit(report, args.json_out)


if __name__ == "__main__":
    main()
