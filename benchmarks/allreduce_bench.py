"""All-reduce bus bandwidth of the CPU ring (and torch gloo, when importable) on loopback.

Prints one JSON document: per-size results for every backend and world size, the
targets with pass/fail, and the machine it ran on. Figures follow nccl-tests:
algbw = bytes / time and busbw = algbw * 2(n-1)/n, in GB/s (1e9 bytes per second).

    python benchmarks/allreduce_bench.py --sizes 1,4,16,64 --worlds 2,4 --json-out out.json

Workers are spawned processes; they exchange ring addresses and report timings as
JSON lines over a loopback control socket (nothing is pickled but the entry arguments).
torch is never a dependency: gloo runs only if ``import torch`` works in this interpreter.

**How both sides are timed** (the same code, ``_time_sizes``, for every backend). Start-up,
imports and connects (our ring's sockets and shared memory; gloo's
``init_process_group`` over a TCPStore) are outside the clock on both sides. Per size,
each rank all-reduces (sum, in place) a float32 array of ones: 2 untimed warm-up calls,
then one barrier (our communicator's, or ``dist.barrier``) so that no rank's first timed
call waits for a slower peer's warm-up; there is no barrier between the timed calls,
which run back to back (so a rank's call can include waiting for a peer still in the one
before). Each rank times each call on its own with ``time.perf_counter`` (both
all-reduces return only when done); calls per size: ``--iters``, or by size
(``default_iters``: 20 to 40, ~256 MiB per rank at small sizes and at least 20 at large
ones: with 5 timed calls at 64 MiB, two of three runs on the shared 2-core machine put
gloo ahead of our TCP ring and the next run the other way round, the ring's figure
moving 2.6x from run to run). Iteration k's time is the slowest rank's k-th time;
``time_s`` is the mean of those and gives ``algbw_gbps`` and ``busbw_gbps``;
``best_time_s`` (the fastest iteration) gives ``best_busbw_gbps``. The spread of the
iterations is in every row, so one mean is never read as the whole story:
``time_spread_s`` and ``busbw_spread_gbps`` give min, p10, median, p90 and max (the
bandwidth's min is the slowest iteration's). Quote a comparison only where the two
sides' p10-p90 ranges do not overlap, or say that they do.
gloo's workers call ``torch.set_num_threads(1)`` before joining and otherwise run gloo
at its defaults (its own all-reduce algorithm, default device); ours use numpy, with
``--chunk-bytes`` as the ring's largest chunk.

**Transports.** gloo has no shared-memory transport: on one host its ranks exchange
over TCP sockets, through the kernel's loopback. Our one-host figure (``cpu_shm``, the
``measured_busbw_gbps`` judged against the targets) uses shared memory between the
ranks' processes, a transport gloo does not have here, so ours vs gloo on one host is
shared memory vs loopback TCP. Our ``cpu_ring`` figure (``tcp_ring_busbw_gbps``) is the
TCP ring that ranks on different hosts use; on one machine it runs over loopback
(127.0.0.1: no NIC, no network), the transport gloo uses here, and is the like-for-like
figure beside gloo's. Neither loopback figure is a network measurement. The targets'
``gloo_reference_gbps`` were measured earlier on the 2-core development machine;
``gloo_measured_busbw_gbps`` is gloo in this run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import sys
from typing import Any

import numpy as np
from _report import emit
from _timing import timed_calls

MiB = 1 << 20
# (world, size in MiB) -> minimum busbw in GB/s; gloo's figures measured on the 2-core
# development machine (see shared ANCHORS.md section 2) are kept for comparison.
TARGETS = [
    {"world": 2, "size_mib": 64, "min_busbw_gbps": 1.3, "gloo_reference_gbps": 1.01},
    {"world": 4, "size_mib": 64, "min_busbw_gbps": 1.0, "gloo_reference_gbps": 0.85},
]
WORKER_DEADLINE_S = 300.0
SECRET = b"allreduce-bench-secret-not-a-real-job-id-0123456789abcdef"


MIN_ITERS = 20


def default_iters(size_bytes: int) -> int:
    # Bounded work per size (~256 MiB reduced per rank) where that gives more calls, but
    # never fewer than MIN_ITERS: 5 calls at 64 MiB left the ordering against gloo to
    # chance on a shared machine (docstring).
    return max(MIN_ITERS, min(40, (256 * MiB) // max(size_bytes, 1)))


def _quantile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of sorted values, linearly interpolated (numpy's default)."""
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _row(backend: str, world: int, size: int, times: list[float]) -> dict[str, Any]:
    """One size's figures from its iterations' times (each the slowest rank's)."""
    mean, best = sum(times) / len(times), min(times)
    factor = 2 * (world - 1) / world
    ordered = sorted(times)
    spread = {
        name: _quantile(ordered, q)
        for name, q in (("min", 0.0), ("p10", 0.1), ("median", 0.5), ("p90", 0.9), ("max", 1.0))
    }
    # A bandwidth's low end is the time's high end.
    flipped = {"min": "max", "p10": "p90", "median": "median", "p90": "p10", "max": "min"}
    return {
        "backend": backend,
        "world": world,
        "size_bytes": size,
        "iters": len(times),
        "time_s": mean,
        "best_time_s": best,
        "algbw_gbps": size / mean / 1e9,
        "busbw_gbps": size / mean / 1e9 * factor,
        "best_busbw_gbps": size / best / 1e9 * factor,
        "time_spread_s": spread,
        "busbw_spread_gbps": {
            name: size / spread[of] / 1e9 * factor for name, of in flipped.items()
        },
    }


def _send_line(sock: socket.socket, doc: dict[str, Any]) -> None:
    sock.sendall(json.dumps(doc).encode() + b"\n")


def _recv_line(reader: Any) -> dict[str, Any]:
    line = reader.readline()
    if not line:
        raise ConnectionError("control connection closed")
    doc: dict[str, Any] = json.loads(line)
    return doc


def _time_sizes(
    sizes: str, iters: int, ones: Any, all_reduce: Any, barrier: Any
) -> list[dict[str, Any]]:
    """Per size (bytes, comma-separated): the times of all-reducing ``ones(size // 4)``
    float32 values, ``iters`` times (default: ``default_iters``) after 2 warm-ups."""
    results = []
    for size in (int(s) for s in sizes.split(",")):
        data = ones(size // 4)
        n = iters or default_iters(size)
        times = timed_calls(lambda d=data: all_reduce(d), n, 2, after_warmup=barrier)
        results.append({"size_bytes": size, "times": times})
    return results


def _ring_worker(
    rank: int,
    world: int,
    control_port: int,
    sizes: str,
    iters: int,
    chunk: int,
    shared: int = 0,
) -> None:
    from rendezvousd.trainer.comm import shm_group
    from rendezvousd.trainer.comm.cpu_ring import CpuRingCommunicator

    control = socket.create_connection(("127.0.0.1", control_port))
    reader = control.makefile("rb")
    listener = socket.create_server(("127.0.0.1", 0))
    shm_listener, shm_name = shm_group.create_listener() if shared else (None, "")
    _send_line(control, {"rank": rank, "port": listener.getsockname()[1], "shm": shm_name})
    plan = _recv_line(reader)
    addresses = [(host, int(port)) for host, port in plan["addresses"]]
    peers = None
    if shm_listener is not None:
        peers = shm_group.SharedMemoryPeers(shm_listener, plan["shm_names"])
    comm = CpuRingCommunicator(
        rank,
        world,
        listener,
        addresses,
        SECRET,
        60.0,
        chunk_bytes=chunk,
        shared_memory=peers,
    )
    results = _time_sizes(
        sizes, iters, lambda n: np.ones(n, np.float32), comm.all_reduce, comm.barrier
    )
    comm.close()
    _send_line(control, {"rank": rank, "results": results})


def _gloo_worker(
    rank: int, world: int, control_port: int, sizes: str, iters: int, chunk: int
) -> None:
    import torch
    import torch.distributed as dist

    control = socket.create_connection(("127.0.0.1", control_port))
    reader = control.makefile("rb")
    probe = socket.create_server(("127.0.0.1", 0))
    _send_line(control, {"rank": rank, "port": probe.getsockname()[1]})
    store_port = int(_recv_line(reader)["addresses"][0][1])
    probe.close()  # rank 0's probe port becomes the TCPStore port
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{store_port}", rank=rank, world_size=world
    )
    results = _time_sizes(
        sizes, iters, lambda n: torch.ones(n, dtype=torch.float32), dist.all_reduce, dist.barrier
    )
    dist.destroy_process_group()
    _send_line(control, {"rank": rank, "results": results})


def run_world(backend: str, world: int, sizes: list[int], args: argparse.Namespace) -> list[Any]:
    target = _gloo_worker if backend == "gloo" else _ring_worker
    extra = (int(backend == "cpu_shm"),) if backend != "gloo" else ()
    ctx = mp.get_context("spawn")
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(WORKER_DEADLINE_S)
    size_arg = ",".join(str(s) for s in sizes)
    procs = [
        ctx.Process(
            target=target,
            args=(
                r,
                world,
                server.getsockname()[1],
                size_arg,
                args.iters,
                args.chunk_bytes,
                *extra,
            ),
        )
        for r in range(world)
    ]
    for proc in procs:
        proc.start()
    try:
        conns = [server.accept()[0] for _ in range(world)]
        readers = [c.makefile("rb") for c in conns]
        hellos = [_recv_line(r) for r in readers]
        ports = {h["rank"]: h["port"] for h in hellos}
        addresses = [["127.0.0.1", ports[r]] for r in range(world)]
        names = {h["rank"]: h.get("shm", "") for h in hellos}
        plan = {"addresses": addresses, "shm_names": [names[r] for r in range(world)]}
        for conn in conns:
            _send_line(conn, plan)
        reports = [_recv_line(r) for r in readers]
    finally:
        for proc in procs:
            proc.join(WORKER_DEADLINE_S)
            if proc.is_alive():
                proc.kill()
        server.close()
    per_rank = [r["results"] for r in reports]
    rows = []
    for i, size in enumerate(sizes):
        # The slowest rank defines each iteration's time.
        times = [
            max(ranks[i]["times"][k] for ranks in per_rank)
            for k in range(len(per_rank[0][i]["times"]))
        ]
        rows.append(_row(backend, world, size, times))
        bw = rows[-1]["busbw_spread_gbps"]
        print(
            f"{backend:8s} world {world} {size / MiB:6.0f} MiB  busbw {rows[-1]['busbw_gbps']:.2f}"
            f" GB/s (p10 {bw['p10']:.2f}, median {bw['median']:.2f}, p90 {bw['p90']:.2f},"
            f" best {rows[-1]['best_busbw_gbps']:.2f}; {len(times)} calls)",
            file=sys.stderr,
        )
    return rows


# --- bucketing pack/unpack throughput ----------------------------------------------------
def pack_unpack(args: argparse.Namespace) -> dict[str, Any] | None:
    """Pack + unpack of a realistic gradient set against a plain numpy copy.

    Bandwidth counts bytes touched (read + write): a copy of S bytes touches 2S;
    pack + unpack touch 4S. Target: pack+unpack >= 50 % of copy bandwidth.
    """
    import numpy as np

    from rendezvousd.trainer.bucketing import GradSpec, buffer_sizes, pack, plan_buckets, unpack

    rng = np.random.default_rng(0)
    # ~64 MiB of float32 in 96 tensors of mixed sizes, like a small transformer.
    sizes = [int(s) for s in rng.integers(1 << 10, 1 << 20, size=96)]
    scale = (64 * MiB // 4) / sum(sizes)
    grads = [rng.standard_normal(max(1, int(n * scale))).astype(np.float32) for n in sizes]
    total = sum(g.nbytes for g in grads)
    buckets = plan_buckets(
        [GradSpec.of(g) for g in grads], cap_bytes=25 * MiB, first_bucket_bytes=MiB
    )
    flat = np.empty(max(buffer_sizes(buckets).values()), dtype=np.float32)

    def layout() -> list[tuple[list[Any], list[int]]]:
        out = []
        for b in buckets:
            out.append(([grads[i] for i in b.grads], [b.buffer_offset + o for o in b.offsets]))
        return out

    plan = layout()

    def best(fn: Any, iters: int = 5) -> float:
        return min(timed_calls(fn, iters, 1))

    def pack_unpack_once(divisor: int) -> None:
        for gs, offs in plan:
            pack(flat, gs, offs, divisor, np)
        for gs, offs in plan:
            unpack(flat, gs, offs)

    src = np.ones(total // 4, dtype=np.float32)
    dst = np.empty_like(src)
    copy_s = best(lambda: np.copyto(dst, src))
    copy_gbps = 2 * src.nbytes / copy_s / 1e9
    sum_s = best(lambda: pack_unpack_once(1))
    avg_s = best(lambda: pack_unpack_once(4))
    result = {
        "bytes": total,
        "tensors": len(grads),
        "buckets": len(buckets),
        "numpy_copy_gbps": round(copy_gbps, 2),
        "pack_unpack_gbps": round(4 * total / sum_s / 1e9, 2),
        "pack_unpack_avg_prediv_gbps": round(4 * total / avg_s / 1e9, 2),
    }
    result["ratio_vs_copy"] = round(result["pack_unpack_gbps"] / copy_gbps, 3)
    result["ratio_vs_copy_prediv"] = round(result["pack_unpack_avg_prediv_gbps"] / copy_gbps, 3)
    result["target_ratio"] = 0.5
    result["meets_target"] = result["ratio_vs_copy"] >= 0.5
    print(
        f"pack+unpack {result['pack_unpack_gbps']} GB/s vs numpy copy {copy_gbps:.2f} GB/s "
        f"(ratio {result['ratio_vs_copy']}; with pre-divide {result['ratio_vs_copy_prediv']})",
        file=sys.stderr,
    )
    return result


def _find(results: list[Any], backend: str, world: int, size: int) -> Any:
    rows = [
        r for r in results if (r["backend"], r["world"], r["size_bytes"]) == (backend, world, size)
    ]
    return rows[0] if rows else None


def _judge(target: dict[str, Any], results: list[Any]) -> dict[str, Any]:
    size = int(target["size_mib"] * MiB)
    # The cpu backend's transport on one host is shared memory; the TCP ring is what
    # ranks on different hosts use, reported beside it.
    ours = _find(results, "cpu_shm", target["world"], size)
    ring = _find(results, "cpu_ring", target["world"], size)
    gloo = _find(results, "gloo", target["world"], size)
    measured = ours["busbw_gbps"] if ours else None
    return {
        **target,
        "measured_busbw_gbps": measured,
        "tcp_ring_busbw_gbps": ring["busbw_gbps"] if ring else None,
        "gloo_measured_busbw_gbps": gloo["busbw_gbps"] if gloo else None,
        # Each mean's spread beside it: a difference inside the spread is no ordering.
        "busbw_spread_gbps": {
            row["backend"]: row["busbw_spread_gbps"] for row in (ours, ring, gloo) if row
        },
        "pass": None if measured is None else measured >= target["min_busbw_gbps"],
    }


def _torch_available() -> bool:
    try:
        import torch.distributed  # noqa: F401
    except Exception:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,4,16,64", help="sizes in MiB, comma-separated")
    parser.add_argument("--worlds", default="2,4", help="world sizes, comma-separated")
    parser.add_argument("--iters", type=int, default=0, help="timed iterations (0: by size)")
    parser.add_argument("--json-out", help="also write the JSON document to this file")
    parser.add_argument(
        "--backends",
        default="cpu_shm,cpu_ring,gloo",
        help="any of cpu_shm (one-host shared memory), cpu_ring (TCP ring), gloo",
    )
    parser.add_argument(
        "--chunk-bytes", type=int, default=4 << 20, help="largest ring chunk (bytes)"
    )
    args = parser.parse_args(argv)
    sizes = [int(float(s) * MiB) for s in args.sizes.split(",")]
    worlds = [int(w) for w in args.worlds.split(",")]
    backends = [b for b in args.backends.split(",") if b]
    from rendezvousd.trainer.comm.shm_group import unsupported_reason

    shm_off = unsupported_reason()
    if "cpu_shm" in backends and shm_off is not None:
        # The cpu backend itself never uses shared memory here; measuring it would lie.
        print(f"skipping cpu_shm: {shm_off}", file=sys.stderr)
        backends.remove("cpu_shm")
    gloo = "gloo" in backends and _torch_available()
    results: list[Any] = []
    for world in worlds:
        for ours in ("cpu_shm", "cpu_ring"):
            if ours in backends:
                results += run_world(ours, world, sizes, args)
        if gloo:
            results += run_world("gloo", world, sizes, args)
    targets = [_judge(target, results) for target in TARGETS]
    doc = {
        "benchmark": "allreduce_bench",
        "formula": "algbw = bytes/time; busbw = algbw * 2(n-1)/n; GB = 1e9 bytes",
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "platform": platform.platform(),
            "load_average": list(os.getloadavg()),
        },
        "params": {
            "sizes_bytes": sizes,
            "worlds": worlds,
            "iters": args.iters or f"by size (default_iters: at least {MIN_ITERS})",
            "chunk_bytes": args.chunk_bytes,
            "dtype": "float32",
            "op": "sum",
            "gloo": gloo,
        },
        "results": results,
        "targets": targets,
        "pack_unpack": pack_unpack(args),
    }
    emit(doc, args.json_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
