"""KvSet latency and health-check stalls with a big key-value store on ``--state-dir``.

    python benchmarks/state_write_latency.py --big-mb 39 --sets 200 --json-out out.json

One daemon with a state dir; job "big" gets ``--big-mb`` MiB of key-value data
(60 KiB values: the message limit is 64 KiB), then job "small" times ``--sets`` 1-byte KvSets while a thread
times health Checks back to back. Prints one JSON document: p50/p99/max of each.
Run it against another checkout (PYTHONPATH=that/checkout) for a before/after.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
from _report import emit
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rendezvousd.cli.embedded import spawn
from rendezvousd.client import RendezvousClient

MIB = 1024 * 1024
VALUE = 60 * 1024


def _summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "count": len(ordered),
        "p50_ms": round(statistics.median(ordered) * 1000, 3),
        "p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000, 3),
        "max_ms": round(ordered[-1] * 1000, 3),
    }


def run(big_mb: int, sets: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        flags = ("--state-dir", str(work / "state"), "--max-value-bytes", str(VALUE))
        flags += ("--heartbeat-timeout-s", "600")  # the old whole-state writes stall the loop
        daemon = spawn(
            work, *flags, "--max-kv-bytes", str(4 * big_mb * MIB + MIB), exit_with_parent=True
        )
        token = daemon.token_file.read_text().strip()
        big = RendezvousClient(daemon.endpoint, "big", token=token)
        small = RendezvousClient(daemon.endpoint, "small", token=token)
        try:
            for c in (big, small):
                c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=30)
            value = b"x" * VALUE
            fill_started = time.perf_counter()
            for i in range(big_mb * MIB // VALUE):
                big.kv_set(f"blob-{i}", value)
            fill_s = time.perf_counter() - fill_started
            health: list[float] = []
            stop = threading.Event()

            def probe() -> None:
                with grpc.insecure_channel(daemon.endpoint) as ch:
                    stub = health_pb2_grpc.HealthStub(ch)
                    while not stop.is_set():
                        t0 = time.perf_counter()
                        stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
                        health.append(time.perf_counter() - t0)

            prober = threading.Thread(target=probe)
            prober.start()
            kv_set: list[float] = []
            for i in range(sets):
                t0 = time.perf_counter()
                small.kv_set(f"k{i % 16}", b"1")
                kv_set.append(time.perf_counter() - t0)
            big_set: list[float] = []
            for i in range(min(sets, 20)):
                t0 = time.perf_counter()
                big.kv_set(f"blob-{i}", value)
                big_set.append(time.perf_counter() - t0)
            stop.set()
            prober.join()
        finally:
            big.close()
            small.close()
            daemon.stop()
        return {
            "big_mb": big_mb,
            "fill_s": round(fill_s, 2),
            "kv_set_1_byte_other_job": _summary(kv_set),
            "kv_set_60_kib_big_job": _summary(big_set),
            "health_check_during_writes": _summary(health),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--big-mb", type=int, default=39)
    parser.add_argument("--sets", type=int, default=200)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    result = run(args.big_mb, args.sets)
    emit(result, args.json_out)


if __name__ == "__main__":
    main()
