"""What the status page costs at scale (issue 22): how long a 1,024-node x 8 job's page
takes to render in headless Chromium, and how much of the daemon's CPU the page's
polling takes at 4,096 members.

    python benchmarks/status_page.py [--json-out out.json]

An in-process daemon (its event loop on a thread of its own) holds a RUNNING job
made through the state machine itself (``join`` for every rank, a heartbeat stream
attached for each), which is what the page reads; no worker processes are needed
for that. Render: from navigation to the grid holding every seat, three fresh
loads (five; the median is judged), and one steady-state update (both fetches and the redraw). CPU: the daemon
loop thread's CPU time over a window with the page open and polling, minus a window
without it, per second of wall time (a share of one core). Needs /usr/bin/chromium.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from _report import emit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rendezvousd.config import DaemonConfig  # noqa: E402
from rendezvousd.daemon import Daemon  # noqa: E402
from rendezvousd.state.placement import JoinArgs  # noqa: E402
from tests.daemon.browser import Chromium, chromium_missing  # noqa: E402

UID = b"\x33" * 128


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 300) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def cpu_s(self) -> float:
        assert self.thread.ident is not None
        return time.clock_gettime(time.pthread_getcpuclockid(self.thread.ident))


def _populate(daemon: Daemon, job: str, nodes: int, gpus: int) -> None:
    state, now = daemon.state, time.monotonic()
    for node in range(nodes):
        for local in range(gpus):
            rank = node * gpus + local
            args = JoinArgs.worker(
                job,
                nodes,
                gpus,
                node,
                local,
                f"gpu-node-{node:04d}.cluster.example",
                f"10.{node // 256}.{node % 256}.1:{29500 + local}",
                UID if rank == 0 else b"",
                f"instance-{rank}",
            )
            state.join(args, now)
    daemon._servicer.apply()
    job_record = state.jobs[job]
    for rank in range(nodes * gpus):
        state.attach_stream(job, job_record.generation, rank, f"instance-{rank}", now)
    daemon._servicer.apply()


async def _start(token: str) -> Daemon:
    config = DaemonConfig(
        listen="127.0.0.1:0",
        metrics_listen="127.0.0.1:0",
        heartbeat_timeout_s=3600.0,
        max_members_per_job=8192,
    )
    daemon = Daemon(config, [token])
    await daemon.start()
    return daemon


# Resolves, in the page, once the grid holds every seat: ms since navigation began.
_SEATS_DRAWN = """new Promise(resolve => {
  const want = %d;
  const check = () => document.querySelectorAll('#grid .seat').length >= want
    ? resolve(performance.now()) : requestAnimationFrame(check);
  check();
})"""
_ONE_UPDATE = "(async () => { const t = performance.now(); await refresh(); return performance.now() - t; })()"


def render(loop: LoopThread, daemon: Daemon, token: str, nodes: int, gpus: int) -> dict[str, Any]:
    loop.loop.call_soon_threadsafe(_populate, daemon, "big", nodes, gpus)
    loop.run(asyncio.sleep(0))
    base = f"http://127.0.0.1:{daemon.metrics_port}"
    loads = []
    with Chromium() as b:
        b.log_in(base, token)
        for _ in range(5):
            b.navigate(f"{base}/?fresh={secrets.token_hex(4)}#job=big")
            b.wait_for("the new document", "document.readyState !== 'loading'")
            loads.append(b.evaluate(_SEATS_DRAWN % (nodes * gpus)))
        updates = [b.evaluate(_ONE_UPDATE) for _ in range(5)]
        size = b.evaluate("fetch('/api/jobs/big').then(r => r.text()).then(t => t.length)")
    return {
        "nodes": nodes,
        "ranks_per_node": gpus,
        "first_render_ms": [round(x) for x in loads],
        "first_render_median_ms": round(statistics.median(loads)),
        "first_render_max_ms": round(max(loads)),
        "update_ms_median": round(statistics.median(updates)),
        "update_ms_max": round(max(updates)),
        "job_json_bytes": size,
        # The median: on a shared machine a load's wall time also measures the neighbours.
        "within_2s": statistics.median(loads) < 2000,
    }


def cpu_share(
    loop: LoopThread, daemon: Daemon, token: str, nodes: int, gpus: int, window_s: float
) -> dict[str, Any]:
    loop.loop.call_soon_threadsafe(_populate, daemon, "members4096", nodes, gpus)
    loop.run(asyncio.sleep(0))

    def window() -> float:
        cpu0, t0 = loop.cpu_s(), time.monotonic()
        time.sleep(window_s)  # the measurement window itself
        return (loop.cpu_s() - cpu0) / (time.monotonic() - t0)

    idle = window()
    base = f"http://127.0.0.1:{daemon.metrics_port}"
    with Chromium() as b:
        b.log_in(base, token)
        b.navigate(f"{base}/#job=members4096")
        b.wait_for("the grid", f"document.querySelectorAll('#grid .seat').length >= {nodes * gpus}")
        poll_s = b.evaluate("pollMs") / 1000
        polled = window()
    added = polled - idle
    return {
        "members": nodes * gpus,
        "window_s": window_s,
        "page_poll_s": poll_s,
        "daemon_cpu_idle": round(idle, 4),
        "daemon_cpu_with_page": round(polled, 4),
        "polling_cpu_share_of_one_core": round(added, 4),
        "under_5_percent": added < 0.05,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json-out", default=None)
    p.add_argument("--window-s", type=float, default=20.0)
    args = p.parse_args()
    missing = chromium_missing()
    if missing:
        print(f"status_page benchmark: {missing}", file=sys.stderr)
        return 2
    token = secrets.token_urlsafe(32)
    loop = LoopThread()
    report: dict[str, Any] = {"benchmark": "status_page", "load_average": os.getloadavg()[0]}
    daemon = loop.run(_start(token))
    try:
        report["render_1024x8"] = render(loop, daemon, token, 1024, 8)
    finally:
        loop.run(daemon.stop(grace=0))
    daemon = loop.run(_start(token))
    try:
        report["polling_cpu_4096"] = cpu_share(loop, daemon, token, 512, 8, args.window_s)
    finally:
        loop.run(daemon.stop(grace=0))
    emit(report, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
