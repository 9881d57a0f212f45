"""A cold per-rank client's CPU, phase by phase, on its side and the daemon's.

    python benchmarks/cold_client.py                                  # 512 clients, 7 rounds
    python benchmarks/cold_client.py --clients 256 --rounds 9 --bare --json-out out.json

``rendezvous_scale.py --ranks N --conditions cold`` times N ranks that each make their
``AsyncRendezvousClient`` and join inside the clock; this splits one such client's CPU
into where it goes. One process makes ``--clients`` clients of one job, in phases, each
timed by this process's CPU clock (``time.process_time()``: all its threads) and the
daemon's, read from /proc per thread (its event loop's thread, and the others: gRPC
core's):

- ``build``: the constructors (the token file's read, the channel, its stubs);
- ``connect``: every channel READY (TCP and HTTP/2), ``channel_ready()``;
- ``streams``: ``connect()``, which opens the call stream and the heartbeat stream;
- ``join``: one Join each, a world of ``--clients`` ranks;
- ``cold``: then, in a fresh job, the same clients made and joined in one go, as
  rendezvous_scale.py's cold ranks are (every step above in one task per rank).

Each round is a fresh job on the same daemon (started here, as rendezvous_scale.py
starts it); each figure is the median of the rounds, in µs per client, with every
round's value. ``gc_us`` is this process's time in the cyclic garbage collector per
client over the cold phase (``gc.callbacks``, the collecting thread's CPU): gRPC's and
asyncio's objects count toward its thresholds as much as the SDK's. The daemon's CPU
comes in /proc's 10 ms ticks: 20 µs per client at 512 clients, so its figures resolve
tens of µs, not single ones. ``--bare`` also runs ``connect`` and ``streams`` against
``_bare_grpc.py``'s bare grpc.aio server (no daemon behind it): gRPC's own cost of a
connection and two streams, beside the daemon's.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from _report import emit

from rendezvousd.cli.embedded import spawn

TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def _ticks(path: str) -> float:
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S


class _Server:
    """A server process's CPU seconds so far: all its threads, and its main thread's."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def cpu(self) -> tuple[float, float]:
        return _ticks(f"/proc/{self.pid}/stat"), _ticks(f"/proc/{self.pid}/task/{self.pid}/stat")


class _Gc:
    """The collecting thread's CPU in the cyclic collector while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.seconds = 0.0
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.thread_time()
        elif self.on:
            self.seconds += time.thread_time() - self._started


async def _phase(
    rows: dict[str, list[dict[str, float]]],
    name: str,
    n: int,
    server: _Server,
    work: Callable[[], Awaitable[Any]],
    collector: _Gc | None = None,
) -> None:
    await asyncio.sleep(0.3)  # the server idle again
    (all0, main0), cpu0 = server.cpu(), time.process_time()
    if collector is not None:
        collector.on, collector.seconds = True, 0.0
    await work()
    cpu1 = time.process_time()
    if collector is not None:
        collector.on = False
    await asyncio.sleep(0.05)  # the server's last answers' own work
    all1, main1 = server.cpu()
    row = {
        "client_us": (cpu1 - cpu0) / n * 1e6,
        "server_us": (all1 - all0) / n * 1e6,
        "server_loop_thread_us": (main1 - main0) / n * 1e6,
        "server_other_threads_us": ((all1 - all0) - (main1 - main0)) / n * 1e6,
    }
    if collector is not None:
        row["gc_us"] = collector.seconds / n * 1e6
    rows.setdefault(name, []).append(row)


async def _rounds(args: argparse.Namespace, endpoint: str, server: _Server, bare: bool) -> Any:
    from rendezvousd.client import AsyncRendezvousClient

    n = args.clients
    rows: dict[str, list[dict[str, float]]] = {}
    collector = _Gc()

    def make(job: str) -> AsyncRendezvousClient:
        return AsyncRendezvousClient(
            endpoint, job, token_file=args.token_file, connect_timeout=60, call_timeout=120
        )

    async def join(client: AsyncRendezvousClient, rank: int) -> None:
        await client.join(
            num_nodes=n, gpus_per_node=1, node_rank=rank, local_rank=0, host=f"n{rank}", timeout=60
        )

    for round_ in range(args.rounds):
        job = f"cold-{os.getpid()}-{round_}"
        clients: list[AsyncRendezvousClient] = []

        async def build(job: str = job, clients: list[AsyncRendezvousClient] = clients) -> None:
            clients.extend(make(job) for _ in range(n))

        async def ready(clients: list[AsyncRendezvousClient] = clients) -> None:
            await asyncio.gather(*(c._channel.channel_ready() for c in clients))

        async def streams(clients: list[AsyncRendezvousClient] = clients) -> None:
            await asyncio.gather(*(c.connect() for c in clients))

        async def joins(clients: list[AsyncRendezvousClient] = clients) -> None:
            await asyncio.gather(*(join(c, r) for r, c in enumerate(clients)))

        await _phase(rows, "build", n, server, build)
        await _phase(rows, "connect", n, server, ready)
        await _phase(rows, "streams", n, server, streams)
        if not bare:
            await _phase(rows, "join", n, server, joins)
        await asyncio.gather(*(c.close() for c in clients))
        if bare:
            continue
        cold: list[AsyncRendezvousClient] = []

        async def one(rank: int, job: str = f"{job}-cold", cold: list[Any] = cold) -> None:
            client = make(job)
            cold.append(client)
            await join(client, rank)

        await _phase(
            rows, "cold", n, server, lambda: asyncio.gather(*(one(r) for r in range(n))), collector
        )
        await asyncio.gather(*(c.close() for c in cold))
    summary: dict[str, dict[str, Any]] = {}
    for phase, runs in rows.items():
        summary[phase] = {}
        for key in runs[0]:
            values = [round(r[key], 1) for r in runs]
            summary[phase][key] = round(statistics.median(values), 1)
            summary[phase][key + "_rounds"] = values
        figures = ", ".join(f"{k} {v:g}" for k, v in summary[phase].items() if "_rounds" not in k)
        print(
            f"{'bare' if bare else 'rendezvousd'} {phase}: {figures} (µs per client, median)",
            file=sys.stderr,
        )
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--bare", action="store_true", help="also against a bare grpc.aio server")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    report: dict[str, Any] = {
        "benchmark": "cold_client",
        "clients": args.clients,
        "rounds": args.rounds,
        "load_average_before": list(os.getloadavg()),
    }
    with tempfile.TemporaryDirectory() as tmp:
        daemon = spawn(
            Path(tmp),
            "--log-level",
            "WARNING",
            "--max-members-per-job",
            str(max(args.clients, 1024)),
            exit_with_parent=True,
        )
        args.token_file = daemon.token_file
        try:
            report["rendezvousd"] = asyncio.run(
                _rounds(args, daemon.endpoint, _Server(daemon.proc.pid), bare=False)
            )
        finally:
            daemon.stop()
        if args.bare:
            here = Path(__file__).resolve().parent
            bare = subprocess.Popen(
                [sys.executable, str(here / "_bare_grpc.py"), "asyncio"],
                stdout=subprocess.PIPE,
                text=True,
            )
            try:
                assert bare.stdout is not None
                port = int(bare.stdout.readline())
                report["bare_grpc_aio"] = asyncio.run(
                    _rounds(args, f"127.0.0.1:{port}", _Server(bare.pid), bare=True)
                )
            finally:
                bare.kill()
                bare.wait()
    report["load_average_after"] = list(os.getloadavg())
    emit(report, args.json_out)


if __name__ == "__main__":
    main()
