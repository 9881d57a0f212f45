"""Bucketed, overlapped gradient all-reduce over any ``Communicator``.

Layout (DDP's rules): gradients are grouped by dtype and packed into buckets
in *reverse* registration order, because backward produces the last layers'
gradients first. A gradient is never split, so a bucket may overshoot the cap
by one gradient; a gradient of at least ``cap_bytes`` always gets a bucket of
its own. Each dtype's first bucket may use the smaller ``first_bucket_bytes``
cap so the first collective starts early. Zero-size gradients take part in no
bucket. Buckets are launched strictly in index order on every rank: launching
in readiness order would let ranks disagree and hang or mix up buffers.

Reduction: each gradient is copied into its bucket's slice of a flat
per-dtype buffer, divided by the world size on the way in when averaging,
then the bucket is all-reduced with SUM and copied back into the gradient in
place (through the original view, so non-contiguous gradients work). Dividing
before the sum rather than after keeps fp16 sums of large gradients from
overflowing to inf.

Determinism: for a fixed layout and world size the result is bitwise
reproducible, but the floating-point summation grouping depends on the
layout, so changing ``cap_bytes``, ``first_bucket_bytes`` or the gradient
order can change the low bits of the result.

CuPy gradients are handled through helpers in ``nccl.py``; this module never
imports CuPy.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import queue
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from rendezvousd.trainer.comm.communicator import (
    Communicator,
    RankedCommunicator,
    ReduceOp,
    act_for,
)
from rendezvousd.trainer.comm.store import JobStore
from rendezvousd.trainer.errors import (
    BucketingError,
    BucketLayoutMismatch,
    CollectiveArgumentError,
    CommunicatorError,
    ConfigError,
    ReducerClosed,
)

if TYPE_CHECKING:
    from rendezvousd.trainer.comm import nccl
    from rendezvousd.trainer.config import DistributedConfig

MiB = 1 << 20
DEFAULT_CAP_BYTES = 25 * MiB
DEFAULT_FIRST_BUCKET_BYTES = 1 * MiB
_LAYOUT_VERSION = 1
# 256-byte bucket starts keep every bucket aligned for vectorised copies and NCCL.
_ALIGN_BYTES = 256


@dataclass(frozen=True, slots=True)
class GradSpec:
    shape: tuple[int, ...]
    dtype: str
    itemsize: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @classmethod
    def of(cls, array: Any) -> GradSpec:
        dtype = np.dtype(array.dtype)
        return cls(tuple(int(d) for d in array.shape), dtype.name, dtype.itemsize)


@dataclass(frozen=True, slots=True)
class Bucket:
    dtype: str
    grads: tuple[int, ...]  # registration indices, in fill (reverse) order
    offsets: tuple[int, ...]  # element offset of each gradient inside the bucket
    numel: int
    nbytes: int
    buffer_offset: int  # element offset of the bucket inside its dtype's flat buffer


def plan_buckets(
    specs: Sequence[GradSpec],
    *,
    cap_bytes: int = DEFAULT_CAP_BYTES,
    first_bucket_bytes: int | None = DEFAULT_FIRST_BUCKET_BYTES,
) -> tuple[Bucket, ...]:
    """Assign gradients to buckets; pure, so every rank computes the same plan."""
    if cap_bytes <= 0:
        raise ConfigError(f"cap_bytes={cap_bytes} must be a positive number of bytes")
    if first_bucket_bytes is not None and first_bucket_bytes <= 0:
        raise ConfigError(
            f"first_bucket_bytes={first_bucket_bytes} must be positive, or None for no "
            "smaller first bucket"
        )
    # A first-bucket cap above the main cap would make the "small" bucket the large one.
    first_limit = cap_bytes if first_bucket_bytes is None else min(first_bucket_bytes, cap_bytes)
    open_: dict[str, list[int]] = {}
    filled: dict[str, int] = {}
    emitted: dict[str, int] = {}
    groups: list[tuple[str, list[int]]] = []

    def close(dtype: str) -> None:
        groups.append((dtype, open_.pop(dtype)))
        filled.pop(dtype)
        emitted[dtype] = emitted.get(dtype, 0) + 1

    for index in reversed(range(len(specs))):
        spec = specs[index]
        if spec.nbytes == 0:
            continue
        if spec.nbytes >= cap_bytes and open_.get(spec.dtype):
            close(spec.dtype)
        open_.setdefault(spec.dtype, []).append(index)
        filled[spec.dtype] = filled.get(spec.dtype, 0) + spec.nbytes
        limit = first_limit if emitted.get(spec.dtype, 0) == 0 else cap_bytes
        if filled[spec.dtype] >= limit:
            close(spec.dtype)
    for dtype in list(open_):
        close(dtype)

    # Launch order = order in which a bucket's first gradient appears in backward.
    groups.sort(key=lambda group: -group[1][0])
    buckets: list[Bucket] = []
    cursor: dict[str, int] = {}
    for dtype, members in groups:
        itemsize = specs[members[0]].itemsize
        align = max(1, _ALIGN_BYTES // itemsize)
        offsets, numel = [], 0
        for index in members:
            offsets.append(numel)
            numel += specs[index].numel
        start = -(-cursor.get(dtype, 0) // align) * align
        cursor[dtype] = start + numel
        buckets.append(
            Bucket(dtype, tuple(members), tuple(offsets), numel, numel * itemsize, start)
        )
    return tuple(buckets)


def buffer_sizes(buckets: Sequence[Bucket]) -> dict[str, int]:
    """Elements each dtype's flat buffer needs to hold every bucket of that dtype."""
    sizes: dict[str, int] = {}
    for bucket in buckets:
        sizes[bucket.dtype] = max(sizes.get(bucket.dtype, 0), bucket.buffer_offset + bucket.numel)
    return sizes


def layout_fingerprint(
    specs: Sequence[GradSpec],
    buckets: Sequence[Bucket],
    *,
    cap_bytes: int,
    first_bucket_bytes: int | None,
    average: bool,
) -> str:
    """SHA-256 hex over everything ranks must agree on before launching buckets."""
    document = {
        "version": _LAYOUT_VERSION,
        "cap_bytes": cap_bytes,
        "first_bucket_bytes": first_bucket_bytes,
        "average": average,
        "grads": [[s.dtype, list(s.shape)] for s in specs],
        "buckets": [[b.dtype, list(b.grads)] for b in buckets],
    }
    text = json.dumps(document, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def pack(flat: Any, grads: Sequence[Any], offsets: Sequence[int], divisor: int, xp: Any) -> None:
    """Copy ``grads`` into the contiguous ``flat`` at ``offsets``, dividing if asked.

    Strided sources are read by the copy itself, so no contiguous temporary is made.
    """
    for grad, offset in zip(grads, offsets, strict=True):
        dst = flat[offset : offset + grad.size].reshape(grad.shape)
        if divisor != 1:
            xp.divide(grad, divisor, out=dst)
        else:
            dst[...] = grad


def unpack(flat: Any, grads: Sequence[Any], offsets: Sequence[int]) -> None:
    """Write ``flat`` back into ``grads`` through their own (possibly strided) views."""
    for grad, offset in zip(grads, offsets, strict=True):
        grad[...] = flat[offset : offset + grad.size].reshape(grad.shape)


class _NumpyOps:
    """Where a bucket's pack, all-reduce and unpack run: inline for numpy; on a
    communication stream for CuPy (``nccl.CupyBufferOps``, the same methods)."""

    xp: Any = np

    def empty(self, count: int, dtype: np.dtype[Any]) -> Any:
        return np.empty(count, dtype=dtype)

    def mark_launch(self, number: int) -> None:
        """On the caller's thread when bucket ``number`` launches (host arrays: the
        data is final when mark_ready is called)."""

    def worker_scope(self, number: int) -> contextlib.AbstractContextManager[None]:
        """On the worker thread around bucket ``number``'s pack/all-reduce/unpack."""
        return contextlib.nullcontext()

    def join_caller(self) -> None:
        """On the caller's thread in ``wait()`` once every bucket completed."""

    def pack(self, flat: Any, grads: Sequence[Any], offsets: Sequence[int], divisor: int) -> None:
        pack(flat, grads, offsets, divisor, self.xp)

    def unpack(self, flat: Any, grads: Sequence[Any], offsets: Sequence[int]) -> None:
        unpack(flat, grads, offsets)


def _buffer_ops(grads: Sequence[Any], rank: int) -> _NumpyOps | nccl.CupyBufferOps:
    # Imports fine without CuPy; CuPy itself loads only for CuPy arrays.
    from rendezvousd.trainer.comm import nccl

    kinds = {nccl.is_cupy_array(g) for g in grads}
    if kinds == {True, False}:
        raise CollectiveArgumentError(
            f"rank {rank}: gradients mix numpy and CuPy arrays; register one kind"
        )
    if kinds == {True}:
        devices = {nccl.CupyBufferOps.device_of(g) for g in grads}
        if len(devices) != 1:
            raise CollectiveArgumentError(
                f"rank {rank}: CuPy gradients span devices {sorted(devices)}; "
                "keep every gradient on the communicator's device"
            )
        return nccl.CupyBufferOps(devices.pop())
    for index, grad in enumerate(grads):
        if not isinstance(grad, np.ndarray):
            raise CollectiveArgumentError(
                f"rank {rank}: gradient {index} is a {type(grad).__name__}; "
                "gradients must be numpy or CuPy arrays"
            )
        if not grad.flags.writeable:
            raise CollectiveArgumentError(
                f"rank {rank}: gradient {index} is read-only; gradients must be writeable "
                "because results are written back in place"
            )
    return _NumpyOps()


def _extent(grad: Any) -> tuple[int, int]:
    """The bytes ``grad`` spans, [low, high), whatever its strides (numpy or CuPy)."""
    address = grad.ctypes.data if isinstance(grad, np.ndarray) else grad.data.ptr
    low = high = int(address)
    for size, stride in zip(grad.shape, grad.strides, strict=True):
        reach = (size - 1) * stride
        low, high = (low + reach, high) if reach < 0 else (low, high + reach)
    return low, high + grad.itemsize


def _overlap(a: Any, b: Any) -> bool:
    """Whether two gradients whose spans overlap share an element: numpy's exact test
    (bounded; too hard to tell counts as shared), and the spans alone for CuPy."""
    if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
        return True
    try:
        # A bound on the search numpy documents; its stub names only its two constants.
        return bool(np.shares_memory(a, b, max_work=10_000))  # type: ignore[arg-type]
    except np.exceptions.TooHardError:
        return True


def _refuse_aliases(grads: Sequence[Any], rank: int) -> None:
    """Refuse gradients that share memory (a tied weight's registered twice, or two
    views of one buffer that overlap: ``g`` and ``g.T``, ``g[1:]``, ``g[::-1]``): in two
    buckets the shared elements would be reduced twice, the second time from the
    first's result, so a sum came out ``world_size`` times too large. DDP, too, reduces
    a shared parameter once. Disjoint views of one flat buffer are separate gradients,
    also interleaved ones (``g[::2]``, ``g[1::2]``), told apart by numpy's exact test."""
    spans = sorted(
        (*_extent(grad), index) for index, grad in enumerate(grads) if grad.size
    )  # an empty gradient takes part in no bucket: its address means nothing
    open_: list[tuple[int, int]] = []  # (high, index) of the spans not yet passed
    for low, high, index in spans:
        open_ = [(h, i) for h, i in open_ if h > low]
        for _, other in open_:
            if not _overlap(grads[other], grads[index]):
                continue
            first, second = sorted((other, index))
            raise CollectiveArgumentError(
                f"rank {rank}: gradients {first} and {second} share memory; register a "
                "shared (tied) parameter's gradient once, and views of one buffer only "
                "where they do not overlap"
            )
        open_.append((high, index))


# Backends that cannot reduce bfloat16: the CPU ring's wire has no type for it.
_NO_BFLOAT16 = frozenset({"cpu"})


def _is_bfloat16(dtype: str) -> bool:
    """ml_dtypes' bfloat16, which CuPy (>= 14) holds and NCCL reduces (ncclBfloat16): a
    floating type, though numpy calls its kind 'V' (void), not 'f'."""
    return dtype == "bfloat16"


class BucketedAllReducer:
    """All-reduce a fixed list of gradients in buckets, overlapping with backward.

    Call ``mark_ready(i)`` as gradient ``i`` becomes final; a bucket is handed to
    a background worker as soon as it and every earlier bucket are complete.
    ``wait()`` then blocks until everything is reduced and written back. Any
    gradient not marked by then is marked by ``wait()`` and reduced with its
    current contents, so every rank always launches every bucket and an unused
    parameter cannot hang the job (zero it if it must not contribute).

    A failure (typically a ``CommunicatorError``) stops the step: ``wait()``
    re-raises it and the reducer stays broken, re-raising it on every later
    call, since ranks can no longer agree on which buckets were reduced.
    """

    def __init__(
        self,
        grads: Sequence[Any],
        communicator: Communicator,
        *,
        cap_bytes: int = DEFAULT_CAP_BYTES,
        first_bucket_bytes: int | None = DEFAULT_FIRST_BUCKET_BYTES,
        average: bool = True,
    ) -> None:
        self._grads = list(grads)
        self._comm = communicator
        self._cap = cap_bytes
        self._first = first_bucket_bytes
        self._average = average
        rank = communicator.rank
        self._ops = _buffer_ops(self._grads, rank) if self._grads else _NumpyOps()
        _refuse_aliases(self._grads, rank)
        self._specs = tuple(GradSpec.of(g) for g in self._grads)
        complex_ = sorted({s.dtype for s in self._specs if np.dtype(s.dtype).kind == "c"})
        if complex_:
            # Neither backend reduces them (NCCL has no complex type): refused here, not
            # by the first bucket's all-reduce on the worker thread, a step later.
            raise CollectiveArgumentError(
                f"rank {rank}: no communicator reduces complex gradients ({complex_}); "
                "register their real view instead (g.view(np.float32) for complex64)"
            )
        odd = sorted(
            {
                s.dtype
                for s in self._specs
                if np.dtype(s.dtype).kind in "bOSUMm"
                or (np.dtype(s.dtype).kind == "f" and np.dtype(s.dtype).itemsize > 8)
            }
        )
        if odd:
            # bool and float128 too were refused only by the first bucket's all-reduce,
            # on the worker thread, a step later (a differential review). A void kind
            # is left to the backend: NCCL reduces bfloat16 (ml_dtypes' is one).
            raise CollectiveArgumentError(
                f"rank {rank}: no communicator reduces gradients of {odd}: register a "
                "copy cast to a floating type (float32, say)"
            )
        bfloat16 = sorted({s.dtype for s in self._specs if _is_bfloat16(s.dtype)})
        if bfloat16 and getattr(communicator, "backend", None) in _NO_BFLOAT16:
            # Refused here, not by the first bucket's all-reduce on the worker thread.
            raise CollectiveArgumentError(
                f"rank {rank}: the {communicator.backend} backend cannot reduce bfloat16 "
                "gradients (its ring has no bfloat16 type; NCCL has); register float32 "
                "copies (g.astype(numpy.float32)) or use backend 'nccl'"
            )
        if average:
            bad = sorted(
                {
                    s.dtype
                    for s in self._specs
                    if np.dtype(s.dtype).kind != "f" and not _is_bfloat16(s.dtype)
                }
            )
            if bad:
                raise CollectiveArgumentError(
                    f"rank {rank}: average=True needs floating gradients, got {bad}; "
                    "pass average=False to sum integer gradients"
                )
        self._buckets = plan_buckets(
            self._specs, cap_bytes=cap_bytes, first_bucket_bytes=first_bucket_bytes
        )
        self._divisor = communicator.world_size if average else 1
        # One flat buffer per dtype, allocated once here and reused every step.
        self._buffers: dict[str, Any] = {
            dtype: self._ops.empty(count, np.dtype(dtype))
            for dtype, count in buffer_sizes(self._buckets).items()
        }
        self._views = [
            self._buffers[b.dtype][b.buffer_offset : b.buffer_offset + b.numel]
            for b in self._buckets
        ]
        self._bucket_of: list[int | None] = [None] * len(self._grads)
        for number, bucket in enumerate(self._buckets):
            for index in bucket.grads:
                self._bucket_of[index] = number
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._queue: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._reset_step()

    @classmethod
    def from_config(
        cls,
        grads: Sequence[Any],
        communicator: Communicator,
        config: DistributedConfig,
        *,
        average: bool = True,
    ) -> BucketedAllReducer:
        """A reducer whose caps are ``config.bucket_cap_mib`` and ``config.first_bucket_mib``.

        Every rank must pass the same values: they are part of the layout that
        ``verify_layout`` compares.
        """
        first = int(config.first_bucket_mib * MiB)
        return cls(
            grads,
            communicator,
            cap_bytes=int(config.bucket_cap_mib * MiB),
            first_bucket_bytes=first or None,
            average=average,
        )

    def _reset_step(self) -> None:
        self._open = False
        self._ready = [False] * len(self._grads)
        self._pending = [len(b.grads) for b in self._buckets]
        self._next_launch = 0
        self._completed = 0

    def __str__(self) -> str:
        return f"a bucketed reducer's step ({len(self._grads)} gradients)"

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        return self._buckets

    @property
    def specs(self) -> tuple[GradSpec, ...]:
        return self._specs

    def layout_fingerprint(self) -> str:
        return layout_fingerprint(
            self._specs,
            self._buckets,
            cap_bytes=self._cap,
            first_bucket_bytes=self._first,
            average=self._average,
        )

    # -- the step --

    def mark_ready(self, index: int) -> None:
        """Declare gradient ``index`` final for this step; may launch buckets."""
        if not 0 <= index < len(self._grads):
            raise CollectiveArgumentError(
                f"rank {self._comm.rank}: gradient index {index} is out of range "
                f"0..{len(self._grads) - 1}; pass the gradient's registration index"
            )
        with self._lock:
            self._raise_if_broken()
            if self._ready[index]:
                raise BucketingError(
                    f"rank {self._comm.rank}: gradient {index} was already marked ready "
                    "this step; call wait() before marking it again"
                )
            self._mark_locked(index)

    def _mark_locked(self, index: int) -> None:
        if not self._open:
            if isinstance(self._comm, RankedCommunicator):
                # The step opens: its buckets are this communicator's only collectives
                # until wait() (RankedCommunicator.hold says why).
                self._comm.hold(self)
            self._open = True
        self._ready[index] = True
        number = self._bucket_of[index]
        if number is None:
            return
        self._pending[number] -= 1
        while self._next_launch < len(self._buckets) and self._pending[self._next_launch] == 0:
            self._launch_locked(self._next_launch)
            self._next_launch += 1

    def _launch_locked(self, number: int) -> None:
        if self._worker is None:
            self._worker = threading.Thread(
                target=self._run, name="bucketed-allreduce", daemon=True
            )
            self._worker.start()
        # Marks the bucket's data on the caller's current stream; the worker's
        # communication stream waits on the mark, never the other way round.
        self._ops.mark_launch(number)
        self._queue.put(number)

    def wait(self) -> None:
        """Block until every bucket is reduced and unpacked; re-raise any failure."""
        with self._lock:
            self._raise_if_broken()
            for index, ready in enumerate(self._ready):
                if not ready:
                    self._mark_locked(index)
            total = len(self._buckets)
            self._done.wait_for(lambda: self._error is not None or self._completed == total)
            self._release()
            self._raise_if_broken()
            self._reset_step()
            if total:
                self._ops.join_caller()

    def _release(self) -> None:
        """The step is over (reduced, or failed for good): others' collectives may go."""
        if isinstance(self._comm, RankedCommunicator):
            self._comm.release(self)

    def all_reduce_all(self) -> None:
        """Reduce every gradient now (no overlap): mark all ready and wait."""
        self.wait()

    def _raise_if_broken(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise ReducerClosed(
                f"rank {self._comm.rank}: BucketedAllReducer is closed; build a new one"
            )

    def _run(self) -> None:
        act_for(self)
        while (number := self._queue.get()) is not None:
            with self._lock:
                if self._error is not None:
                    continue  # later buckets of a failed step must not run
            try:
                with self._ops.worker_scope(number):
                    self._reduce_bucket(number)
            except BaseException as exc:  # handed to wait(), which re-raises it
                with self._lock:
                    self._error = exc
                    self._done.notify_all()
                continue
            with self._lock:
                self._completed += 1
                self._done.notify_all()

    def _reduce_bucket(self, number: int) -> None:
        bucket = self._buckets[number]
        flat = self._views[number]
        grads = [self._grads[i] for i in bucket.grads]
        self._ops.pack(flat, grads, bucket.offsets, self._divisor)
        try:
            self._comm.all_reduce(flat, ReduceOp.SUM)
        except CommunicatorError as exc:
            # Same class, so callers' except clauses still match; the bucket
            # says which gradients were lost.
            raise type(exc)(
                f"{exc} [bucket {number} of {len(self._buckets)}: gradients "
                f"{list(bucket.grads)}, {bucket.nbytes} bytes of {bucket.dtype}]"
            ) from exc
        self._ops.unpack(flat, grads, bucket.offsets)

    def close(self) -> None:
        """Stop the worker thread; idempotent. Does not close the communicator."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            worker = self._worker
            self._release()
        if worker is not None:
            self._queue.put(None)
            worker.join()

    def __enter__(self) -> BucketedAllReducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- cross-rank check --

    def verify_layout(
        self,
        store: JobStore,
        rank: int,
        world_size: int,
        timeout: float | None,
        *,
        name: str = "default",
    ) -> None:
        """Fail on every rank, naming the odd ranks, if layouts differ.

        Each rank counts its fingerprint (``bucket-layout/{name}/count/{fp}``);
        once every rank has (a barrier), a count of ``world_size`` means every
        layout matches: one add, one barrier and one read per rank, all in
        parallel. Otherwise every rank publishes ``bucket-layout/{name}/{rank}``;
        rank 0 reads them all, takes the most common fingerprint as the reference
        (rank 0's wins a tie) and publishes a verdict that every other rank
        reads, so all ranks raise together instead of the matching ones hanging
        in the first collective. One verification per ``name`` per job generation.
        """
        mine = self.layout_fingerprint()
        prefix = f"bucket-layout/{name}"
        deadline = None if timeout is None else time.monotonic() + timeout

        def remaining() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        # Why a count first: rank 0 reading every rank's fingerprint is world_size - 1
        # sequential round trips through the daemon on every start and restart (1,023
        # at 1,024 ranks); only a mismatch needs them, to name the odd ranks.
        tally = f"{prefix}/count/{mine}"
        store.kv_add(tally, 1)
        store.barrier(f"{prefix}/counted", timeout=remaining())
        if int(store.kv_get(tally, wait=False)) == world_size:
            return
        store.kv_set(f"{prefix}/{rank}", mine.encode("ascii"))
        if rank == 0:
            seen = {0: mine}
            for r in range(1, world_size):
                raw = store.kv_get(f"{prefix}/{r}", wait=True, timeout=remaining())
                seen[r] = raw.decode("ascii", errors="replace")
            reference, mismatched = layout_verdict(seen)
            verdict = {"reference": reference, "mismatched": mismatched}
            store.kv_set(f"{prefix}/verdict", json.dumps(verdict).encode("ascii"))
        else:
            raw = store.kv_get(f"{prefix}/verdict", wait=True, timeout=remaining())
            verdict = _parse_verdict(raw)
        odd = verdict["mismatched"]
        if odd:
            raise BucketLayoutMismatch(
                f"bucket layout of rank(s) {odd} differs from the majority's "
                f"(majority {str(verdict['reference'])[:16]}, rank {rank} {mine[:16]}); "
                "all ranks must register the same gradients (dtypes, shapes, order) "
                "with the same cap_bytes, first_bucket_bytes and average"
            )


def layout_verdict(fingerprints: Mapping[int, str]) -> tuple[str, list[int]]:
    """(reference fingerprint, ranks that differ from it) for rank -> fingerprint.

    The most common fingerprint is the reference, rank 0's winning a tie, so a
    single odd rank is the one named even when it is rank 0.
    """
    counts = Counter(fingerprints.values())
    best = max(counts.values())
    if counts[fingerprints[0]] == best:
        reference = fingerprints[0]
    else:
        reference = min(fp for fp, n in counts.items() if n == best)
    return reference, sorted(r for r, fp in fingerprints.items() if fp != reference)


def _parse_verdict(raw: bytes) -> dict[str, Any]:
    try:
        verdict = json.loads(raw.decode("ascii"))
        reference, mismatched = verdict["reference"], verdict["mismatched"]
        if isinstance(reference, str) and all(isinstance(r, int) for r in mismatched):
            return {"reference": reference, "mismatched": list(mismatched)}
    except (UnicodeDecodeError, ValueError, KeyError, TypeError):
        pass
    raise BucketLayoutMismatch("rank 0 published a malformed layout verdict")
