"""NCCL timings on one GPU, as JSON: raw vs bucketed all-reduce at world 2, and
pack/unpack bandwidth next to a device-to-device copy.

    python benchmarks/gpu_check.py [--world 2] [--sizes-mib 1 16 64 256] [--json-out F]

At world 1 NCCL's all-reduce is a copy (or nothing), so it measures no
communication. Stock NCCL refuses two ranks on one device ("Duplicate GPU
detected"), but processes with different ``NCCL_HOSTID`` (and sockets on
loopback, no InfiniBand) are treated as two hosts: this script starts ``--world``
such processes on device 0, bootstrapped through a standalone rendezvousd like any
job. For each total size rank 0 reports:

- raw: one ``all_reduce`` over a single contiguous buffer of that size;
- bucketed: ``BucketedAllReducer.all_reduce_all()`` over the same bytes split
  into ``--tensor-kib`` gradients (pack + all-reduce + unpack per bucket);
- bus bandwidth of both (nccl-tests' formula: S / t x 2(n-1)/n);
- pack / unpack bandwidth (bytes read + written per second) of what the reducer runs
  (``CupyBufferOps.pack``/``unpack``: one launch each way for many small contiguous
  gradients) next to a plain device-to-device copy of the same size, the ceiling they
  can reach, and the time of a copy per gradient (``bucketing.pack``/``unpack``).

Times are wall-clock medians with the stream synchronised, in milliseconds.
Targets (issue "CuPy-NCCL training"): bucketed <= 1.05 x raw at world 2;
pack + unpack >= 50 % of the copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _timing import timed_calls

from rendezvousd.trainer.bucketing import BucketedAllReducer, pack, unpack
from rendezvousd.trainer.comm import nccl
from rendezvousd.trainer.comm.communicator import ReduceOp

MIB = 1 << 20
BUCKETED_OVER_RAW_TARGET = 1.05
PACK_OVER_COPY_TARGET = 0.5


def median_ms(fn: Callable[[], None], sync: Callable[[], None], iters: int, warmup: int) -> float:
    times = timed_calls(fn, iters, warmup, after_warmup=sync, after_each=sync)
    return round(statistics.median(times) * 1e3, 4)


def gbps(nbytes: float, ms: float) -> float:
    return round(nbytes / (ms * 1e-3) / 1e9, 2)


def measure(
    cp: Any, comm: nccl.NcclCommunicator, total: int, args: argparse.Namespace
) -> dict[str, Any]:
    sync = cp.cuda.get_current_stream().synchronize
    world = comm.world_size
    count = total // 4
    per = max(1, min(count, args.tensor_kib * 1024 // 4))
    sizes = [per] * (count // per) + ([count % per] if count % per else [])
    grads = [cp.ones(n, dtype=cp.float32) for n in sizes]
    flat = cp.ones(count, dtype=cp.float32)
    copy_src = cp.ones(count, dtype=cp.float32)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    row: dict[str, Any] = {"bytes": total, "tensors": len(sizes)}
    bus = 2 * (world - 1) / world if world > 1 else 1.0

    row["raw_ms"] = median_ms(lambda: comm.all_reduce(flat, ReduceOp.SUM), sync, args.iters, 3)
    with BucketedAllReducer(grads, comm, cap_bytes=args.cap_mib * MIB) as reducer:
        row["buckets"] = len(reducer.buckets)
        row["bucketed_ms"] = median_ms(reducer.all_reduce_all, sync, args.iters, 3)
    row["bucketed_over_raw"] = round(row["bucketed_ms"] / row["raw_ms"], 3)
    row["raw_busbw_gbps"] = gbps(total * bus, row["raw_ms"])
    row["bucketed_busbw_gbps"] = gbps(total * bus, row["bucketed_ms"])
    # What the reducer runs (one launch each way for many small contiguous gradients)
    # and, beside it, a copy per gradient (bucketing.pack/unpack, the fallback).
    ops = nccl.CupyBufferOps(0)
    pack_ms = median_ms(lambda: ops.pack(flat, grads, offsets, 1), sync, args.iters, 3)
    unpack_ms = median_ms(lambda: ops.unpack(flat, grads, offsets), sync, args.iters, 3)
    loop_pack_ms = median_ms(lambda: pack(flat, grads, offsets, 1, cp), sync, args.iters, 3)
    loop_unpack_ms = median_ms(lambda: unpack(flat, grads, offsets), sync, args.iters, 3)

    def d2d() -> None:
        flat[...] = copy_src

    copy_ms = median_ms(d2d, sync, args.iters, 3)
    row.update(
        pack_ms=pack_ms,
        unpack_ms=unpack_ms,
        copy_ms=copy_ms,
        pack_gbps=gbps(2 * total, pack_ms),
        unpack_gbps=gbps(2 * total, unpack_ms),
        per_gradient_pack_ms=loop_pack_ms,
        per_gradient_unpack_ms=loop_unpack_ms,
        copy_gbps=gbps(2 * total, copy_ms),
    )
    return row


def targets(rows: list[dict[str, Any]], world: int) -> dict[str, Any]:
    """Each target with the largest size's figure (the steady state) and whether it is met."""
    big = max(rows, key=lambda r: r["bytes"])
    pack_unpack = min(big["pack_gbps"], big["unpack_gbps"]) / big["copy_gbps"]
    return {
        "bucketed_over_raw": {
            "target": f"<= {BUCKETED_OVER_RAW_TARGET} at world 2",
            "measured": big["bucketed_over_raw"],
            "met": world >= 2 and big["bucketed_over_raw"] <= BUCKETED_OVER_RAW_TARGET,
        },
        "pack_unpack_over_copy": {
            "target": f">= {PACK_OVER_COPY_TARGET}",
            "measured": round(pack_unpack, 3),
            "met": pack_unpack >= PACK_OVER_COPY_TARGET,
        },
    }


def device_report(cp: Any, comm: nccl.NcclCommunicator, args: argparse.Namespace) -> dict[str, Any]:
    rows = [measure(cp, comm, mib * MIB, args) for mib in args.sizes_mib]
    name = cp.cuda.runtime.getDeviceProperties(0)["name"]
    return {
        "device": name.decode() if isinstance(name, bytes) else str(name),
        "cupy": cp.__version__,
        "nccl_version": comm.nccl_version,
        "world_size": comm.world_size,
        "cap_mib": args.cap_mib,
        "tensor_kib": args.tensor_kib,
        "iters": args.iters,
        "results": rows,
        "targets": targets(rows, comm.world_size),
    }


def child(args: argparse.Namespace) -> int:
    """One rank: join through the daemon (rank 0 makes the NCCL id), then measure."""
    from rendezvousd.client import RendezvousClient

    cp = nccl._import_cupy()  # through the seam: nccl.py is the only CuPy importer
    cp.cuda.Device(0).use()
    with RendezvousClient(args.endpoint, "gpu-check", token_file=args.token_file) as rdzv:
        m = rdzv.join(
            num_nodes=args.world,
            gpus_per_node=1,
            node_rank=args.rank,
            local_rank=0,
            id_factory=nccl.create_unique_id,
            timeout=60,
        )
        comm = nccl.NcclCommunicator(m.rank, m.world_size, m.unique_id, 0, timeout=120)
        try:
            report = device_report(cp, comm, args)
        finally:
            comm.close()
        rdzv.leave()
    if m.rank == 0:
        print(json.dumps(report), flush=True)
    return 0


def shared_device_env(rank: int) -> dict[str, str]:
    """What makes NCCL treat processes on one GPU as separate hosts."""
    return {
        **os.environ,
        "NCCL_HOSTID": f"rendezvousd-gpu-check-{rank}",
        "NCCL_SOCKET_IFNAME": "lo",
        "NCCL_IB_DISABLE": "1",
    }


def parent(args: argparse.Namespace) -> dict[str, Any]:
    from rendezvousd.cli.embedded import spawn

    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        daemon = spawn(Path(tmp), "--log-level", "WARNING", exit_with_parent=True)
        try:
            flags = [
                "--sizes-mib", *map(str, args.sizes_mib),
                "--tensor-kib", str(args.tensor_kib),
                "--cap-mib", str(args.cap_mib),
                "--iters", str(args.iters),
                "--world", str(args.world),
                "--endpoint", daemon.endpoint,
                "--token-file", str(daemon.token_file),
            ]  # fmt: skip
            procs = [
                subprocess.Popen(
                    [sys.executable, __file__, "--child", "--rank", str(r), *flags],
                    env=shared_device_env(r),
                    stdout=subprocess.PIPE,
                    text=True,
                )
                for r in range(args.world)
            ]
            outs = [p.communicate(timeout=240)[0] for p in procs]
        finally:
            daemon.stop()
    codes = [p.returncode for p in procs]
    if codes != [0] * args.world:
        raise SystemExit(f"gpu_check: ranks exited with {codes}")
    report: dict[str, Any] = json.loads(outs[0].strip().splitlines()[-1])
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--tensor-kib", type=int, default=1024, help="size of each gradient")
    parser.add_argument("--cap-mib", type=int, default=25, help="bucket cap")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--world", type=int, default=2, help="ranks, all on device 0")
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    parser.add_argument("--token-file", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    missing = nccl.unavailable_reason()
    if missing is not None:
        print(f"gpu_check: needs CuPy with NCCL and a CUDA device: {missing}", file=sys.stderr)
        return 1
    if args.child:
        return child(args)
    if args.world == 1:
        cp = nccl._import_cupy()
        comm = nccl.NcclCommunicator(0, 1, nccl.create_unique_id(), 0, timeout=120)
        try:
            report = device_report(cp, comm, args)
        finally:
            comm.close()
    else:
        report = parent(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json_out is not None:
        args.json_out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
