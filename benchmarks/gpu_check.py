"""Single-GPU timings for the NCCL communicator and the bucketed reducer, as JSON.

World size is 1, so no bytes cross a link: the numbers measure what the
trainer adds around NCCL (stream hand-offs, the worker thread, pack/unpack
copies), not network bandwidth. For each total size it reports:

- raw: one ``all_reduce`` over a single contiguous buffer of that size;
- bucketed: ``BucketedAllReducer.all_reduce_all()`` over the same bytes split
  into ``--tensor-kib`` gradients (pack + all-reduce + unpack per bucket);
- pack / unpack bandwidth (bytes read + written per second) next to a plain
  device-to-device copy of the same size, the ceiling they can reach.

Times are wall-clock medians with the stream synchronised, in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from rendezvousd.trainer import nccl
from rendezvousd.trainer.bucketing import BucketedAllReducer, pack, unpack
from rendezvousd.trainer.communicator import ReduceOp

MIB = 1 << 20


def median_ms(fn: Callable[[], None], sync: Callable[[], None], iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(samples), 4)


def gbps(nbytes: int, ms: float) -> float:
    return round(nbytes / (ms * 1e-3) / 1e9, 2)


def measure(
    cp: Any, comm: nccl.NcclCommunicator, total: int, args: argparse.Namespace
) -> dict[str, Any]:
    sync = cp.cuda.get_current_stream().synchronize
    count = total // 4
    per = max(1, min(count, args.tensor_kib * 1024 // 4))
    sizes = [per] * (count // per) + ([count % per] if count % per else [])
    grads = [cp.ones(n, dtype=cp.float32) for n in sizes]
    flat = cp.ones(count, dtype=cp.float32)
    copy_src = cp.ones(count, dtype=cp.float32)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    row: dict[str, Any] = {"bytes": total, "tensors": len(sizes)}

    row["raw_ms"] = median_ms(lambda: comm.all_reduce(flat, ReduceOp.SUM), sync, args.iters, 3)
    with BucketedAllReducer(grads, comm, cap_bytes=args.cap_mib * MIB) as reducer:
        row["buckets"] = len(reducer.buckets)
        row["bucketed_ms"] = median_ms(reducer.all_reduce_all, sync, args.iters, 3)
    row["bucketed_over_raw"] = round(row["bucketed_ms"] / row["raw_ms"], 2)
    pack_ms = median_ms(lambda: pack(flat, grads, offsets, 1, cp), sync, args.iters, 3)
    unpack_ms = median_ms(lambda: unpack(flat, grads, offsets), sync, args.iters, 3)

    def d2d() -> None:
        flat[...] = copy_src

    copy_ms = median_ms(d2d, sync, args.iters, 3)
    row.update(
        pack_ms=pack_ms,
        unpack_ms=unpack_ms,
        copy_ms=copy_ms,
        pack_gbps=gbps(2 * total, pack_ms),
        unpack_gbps=gbps(2 * total, unpack_ms),
        copy_gbps=gbps(2 * total, copy_ms),
    )
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--tensor-kib", type=int, default=1024, help="size of each gradient")
    parser.add_argument("--cap-mib", type=int, default=25, help="bucket cap")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    if not nccl.cupy_available() or nccl.device_count() == 0:
        print("gpu_check: no CuPy with a CUDA device here", file=sys.stderr)
        return 1
    cp = nccl._import_cupy()  # through the seam: nccl.py is the only CuPy importer
    comm = nccl.NcclCommunicator(0, 1, nccl.create_unique_id(), 0, timeout=120)
    try:
        rows = [measure(cp, comm, mib * MIB, args) for mib in args.sizes_mib]
        props = cp.cuda.runtime.getDeviceProperties(0)
        name = props["name"]
        report = {
            "device": name.decode() if isinstance(name, bytes) else str(name),
            "cupy": cp.__version__,
            "nccl_version": comm.nccl_version,
            "world_size": 1,
            "cap_mib": args.cap_mib,
            "tensor_kib": args.tensor_kib,
            "iters": args.iters,
            "results": rows,
        }
    finally:
        comm.close()
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
