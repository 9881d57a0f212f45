"""Fake ``cupy.cuda.nccl``: what broke on GPUs, after CuPy's ``cupy_backends/cuda/libs/nccl.pyx``.

* NCCL ops complete at once unless ``world.hang`` is set; ``world.async_error``
  makes the next enqueued op never complete and ``check_async_error`` raise afterwards;
  ``world.kernel_fault`` makes it fault on the GPU: it never completes and the CUDA
  status stays as the context's sticky error (``streams.py``), which NCCL's own
  ``check_async_error`` does not report.
  Collectives leave the data as it is (a sum over one rank, or a test that checks
  calls rather than results).
* ``abort()`` zeroes the handle (later calls raise status 4, as NCCL does on a
  null communicator) and completes pending ops; a call into NCCL running
  while another thread aborts is recorded in ``races`` (a use-after-free on a GPU).
* ``NcclError(status)`` is worded with CuPy's name for the status (``STATUS_NAMES``)
  and raises ``KeyError(status)`` for a status CuPy cannot name, as CuPy does (7,
  ncclInProgress, in 14.2); with ``old_table`` that includes 6, like CuPy < 13.4.
* NCCL >= 2.22 makes its connections on first use, inside the first collective's
  enqueue, unless ``NCCL_RUNTIME_CONNECT=0`` (read at init) has them made inside init;
  either way they are logged as ``("connect", where)`` and block on ``connect_gate``
  (a peer that never answers);
* init can block on ``init_gate`` or fail with the errors queued in ``init_errors``;
  ``solo`` refuses any world but one rank (where leaving data as it is is right);
  every ``get_unique_id`` returns a fresh id.
* ``meet``: the ranks of one id are threads of this process, and a collective
  completes once every rank enqueued it, with NCCL's results written through the
  buffers' addresses (``_Group``): sums in rank order, MAX/MIN, AVG as NCCL computes
  it (floats: each input times 1/n; integers: the sum divided towards zero), a
  broadcast from ``root``. Ranks that disagree on a collective (its kind, count,
  type, op or root) never complete, as NCCL's may hang.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
from typing import Any

import numpy as np

from .streams import World

#: CuPy's names for NCCL statuses, 13.4 to 14.2 (tests/trainer/test_cupy_api.py compares
#: them with the installed CuPy's).
STATUS_NAMES = {
    0: "NCCL_ERROR_SUCCESS",
    1: "NCCL_ERROR_UNHANDLED_CUDA_ERROR",
    2: "NCCL_ERROR_SYSTEM_ERROR",
    3: "NCCL_ERROR_INTERNAL_ERROR",
    4: "NCCL_ERROR_INVALID_ARGUMENT",
    5: "NCCL_ERROR_INVALID_USAGE",
    6: "NCCL_ERROR_REMOTE_ERROR",
}


class FakeNcclError(RuntimeError):
    old_table = False

    def __init__(self, status: int, detail: str = "fake") -> None:
        if status not in STATUS_NAMES or (status == 6 and FakeNcclError.old_table):
            # CuPy looks the name up in a dict; < 13.4 had no entry for ncclRemoteError.
            raise KeyError(status)
        self.status = status
        super().__init__(f"{STATUS_NAMES[status]}: {detail}")


#: cudaGetErrorName and cudaGetErrorString of the statuses the tests raise.
CUDA_ERRORS = {
    2: "cudaErrorMemoryAllocation: out of memory",
    35: "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version",
    100: "cudaErrorNoDevice: no CUDA-capable device is detected",
    101: "cudaErrorInvalidDevice: invalid device ordinal",
    600: "cudaErrorNotReady: device not ready",
    700: "cudaErrorIllegalAddress: an illegal memory access was encountered",
}


class FakeCudaError(RuntimeError):
    """CuPy's ``CUDARuntimeError``: built from a CUDA status, which it keeps as
    ``.status`` (CUDA's numbering, not NCCL's: 2 is cudaErrorMemoryAllocation)."""

    def __init__(self, status: int) -> None:
        self.status = status
        super().__init__(CUDA_ERRORS.get(status, f"cudaError{status}: unknown error"))


class FakeOutOfMemoryError(MemoryError):
    """``cupy.cuda.memory.OutOfMemoryError``: CuPy's allocator's, a MemoryError (not a
    CUDARuntimeError), worded as CuPy words it."""

    def __init__(self, size: int, total: int, limit: int = 0) -> None:
        super().__init__(
            f"Out of memory allocating {size:,} bytes (allocated so far: {total:,} bytes)."
        )


# nccl.h's ncclDataType_t and ncclRedOp_t, written out here (not read from the code
# under test) so that a wrong code of ours gives a wrong result.
_NCCL_TYPES = {
    0: np.int8,
    1: np.uint8,
    2: np.int32,
    3: np.uint32,
    4: np.int64,
    5: np.uint64,
    6: np.float16,
    7: np.float32,
    8: np.float64,
}
try:  # ncclBfloat16, as CuPy (>= 14) holds it: ml_dtypes' type, where installed
    import ml_dtypes

    _NCCL_TYPES[9] = ml_dtypes.bfloat16
except ImportError:
    pass
_SUM, _PROD, _MAX, _MIN, _AVG = range(5)


def _buffer(ptr: int, count: int, code: int) -> np.ndarray:
    """The ``count`` elements of NCCL type ``code`` at ``ptr`` (a fake device array's
    memory is its host array's), writable in place."""
    dtype = np.dtype(_NCCL_TYPES[code])
    raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(ptr)
    return np.frombuffer(raw, dtype=dtype)


def _reduce(inputs: list[np.ndarray], op: int) -> np.ndarray:
    n, dtype = len(inputs), inputs[0].dtype
    floating = dtype.kind == "f" or dtype.name == "bfloat16"  # ml_dtypes' kind is 'V'
    if op == _MAX:
        return np.maximum.reduce(inputs)
    if op == _MIN:
        return np.minimum.reduce(inputs)
    if op == _AVG and floating:
        # ncclDevPreMulSum: each input times 1/n (float32(1/n) for 16- and 32-bit types).
        scale = dtype.type(np.float32(1.0 / n) if dtype.itemsize <= 4 else 1.0 / n)
        inputs = [x * scale for x in inputs]
    with np.errstate(over="ignore"):
        total = inputs[0].copy()
        for x in inputs[1:]:
            total += x  # rank order; integers wrap, as on the GPU
    if op == _AVG and not floating:
        # FuncSumPostDiv: the quotient of |sum| and n, negated back: towards zero.
        # The magnitude as unsigned, as NCCL takes it: -(-2**63) wraps to itself.
        negative = total < 0 if dtype.kind == "i" else np.zeros(total.shape, bool)
        magnitude = np.where(negative, -total, total).view(f"u{dtype.itemsize}")
        quotient = (magnitude // n).astype(dtype)
        return np.where(negative, -quotient, quotient)
    if op not in (_SUM, _AVG):
        raise NotImplementedError(f"fake NCCL op {op}")
    return total


class _Group:
    """The ranks of one NCCL id in this process: each collective completes when every
    rank has enqueued it (``meet``)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.lock = threading.Lock()
        self.sequence = [0] * size
        self.calls: dict[int, dict[int, tuple[Any, ...]]] = {}

    def arrive(self, rank: int, name: str, args: tuple[Any, ...], flag: list[bool]) -> None:
        with self.lock:
            seq = self.sequence[rank]
            self.sequence[rank] += 1
            calls = self.calls.setdefault(seq, {})
            calls[rank] = (name, args, flag)
            if len(calls) < self.size:
                return
            del self.calls[seq]
        ordered = [calls[r] for r in range(self.size)]
        # (name, count, type, op or root): the stream and the addresses may differ.
        if len({(c[0], *c[1][2:5]) for c in ordered}) != 1:
            return  # ranks that disagree: never completes
        name, (_, _, count, code, arg, _) = ordered[0][0], ordered[0][1]
        if count:
            if name == "allReduce":
                result = _reduce([_buffer(c[1][0], count, code).copy() for c in ordered], arg)
            else:  # broadcast
                result = _buffer(ordered[arg][1][0], count, code).copy()
            for c in ordered:
                _buffer(c[1][1], count, code)[:] = result
        for c in ordered:
            c[2][0] = True


class FakeNccl:
    NcclError = FakeNcclError
    available = True

    def __init__(self, world: World, version: int, solo: bool = False, meet: bool = False) -> None:
        self.world = world
        self.solo = solo
        self.meet = meet
        self.groups: dict[bytes, _Group] = {}
        self.log: list[tuple[Any, ...]] = []
        self.version = version
        self.fail: BaseException | None = None
        self.reject_bytes_id = False
        self.init_gate: threading.Event | None = None
        self.init_errors: list[BaseException] = []
        self.enqueue_gate: threading.Event | None = None
        self.connect_gate: threading.Event | None = None
        self.entered = threading.Event()
        self.races: list[str] = []
        self.inside = 0
        self.ids = itertools.count(1)
        self.comms: list[Any] = []
        self.NcclCommunicator = self._comm_class()

    def _comm_class(self) -> type:
        fake = self

        class Comm:
            def __init__(self, ndev: int, comm_id: Any, rank: int) -> None:
                if fake.reject_bytes_id and isinstance(comm_id, bytes):
                    raise TypeError("Argument 'commId' has incorrect type")
                fake.log.append(("NcclCommunicator", ndev, comm_id, rank))
                if fake.solo and (ndev, rank) != (1, 0):
                    raise FakeNcclError(4, "this fake NCCL serves a world of one rank")
                if fake.init_gate is not None:
                    fake.init_gate.wait()
                if fake.init_errors:
                    raise fake.init_errors.pop(0)
                if fake.fail is not None:
                    raise fake.fail
                self.handle = 1
                self.async_status: int | None = None
                self.rank = rank
                # NCCL_PARAM(RuntimeConnect, "RUNTIME_CONNECT", 1), from 2.22 on.
                self.connected = False
                lazy = os.environ.get("NCCL_RUNTIME_CONNECT", "1") != "0"
                if fake.version < 22200 or not lazy:
                    self._connect("init")
                self.group: _Group | None = None
                if fake.meet and ndev > 1:
                    key = bytes(b & 0xFF for b in comm_id)
                    self.group = fake.groups.setdefault(key, _Group(ndev))
                fake.comms.append(self)

            def _connect(self, where: str) -> None:
                fake.log.append(("connect", where))
                if fake.connect_gate is not None:
                    fake.entered.set()
                    fake.connect_gate.wait(10)
                self.connected = True

            def _enter(self, name: str, *args: Any) -> None:
                fake.log.append((name, *args))
                fake.inside += 1

            def _leave(self) -> None:
                fake.inside -= 1

            def _enqueue(self, name: str, *args: Any) -> None:
                self._enter(name, *args)
                try:
                    if not self.connected and self.handle:
                        self._connect(name)
                    if fake.enqueue_gate is not None:
                        fake.entered.set()
                        fake.enqueue_gate.wait(10)
                    if not self.handle:
                        raise FakeNcclError(4)  # ncclInvalidArgument: null communicator
                    if fake.fail is not None:
                        raise fake.fail
                    stream = next(s for s in fake.world.streams if s.ptr == args[-1])
                    fake.world.add(name, stream.name)
                    # The op's kernel faults on this GPU once it runs, after the host
                    # went on (the event after it records): it never completes.
                    fault = fake.world.kernel_fault
                    fake.world.faulting = fault
                    healthy = (
                        not fake.world.hang
                        and fake.world.async_error is None
                        and fault is None
                        and fake.world.sticky_error is None
                    )
                    flag = [healthy and self.group is None]
                    if fake.world.async_error is not None:
                        self.async_status = fake.world.async_error
                    if not healthy:
                        fake.world.pending.append(flag)
                    stream.queue([flag])
                    if healthy and self.group is not None:
                        self.group.arrive(self.rank, name, args, flag)
                finally:
                    self._leave()

            def allReduce(self, *args: Any) -> None:
                self._enqueue("allReduce", *args)

            def broadcast(self, *args: Any) -> None:
                self._enqueue("broadcast", *args)

            def check_async_error(self) -> None:
                self._enter("check_async_error")
                try:
                    if not self.handle:
                        raise FakeNcclError(4)
                    if self.async_status is not None:
                        raise FakeNcclError(self.async_status)
                finally:
                    self._leave()

            def abort(self) -> None:
                fake.log.append(("abort",))
                if fake.inside:
                    fake.races.append("abort() while another thread was inside NCCL")
                if self.handle:
                    self.handle = 0
                    fake.world.complete_all()

            def destroy(self) -> None:
                fake.log.append(("destroy",))
                if fake.inside:
                    fake.races.append("destroy() while another thread was inside NCCL")
                self.handle = 0

        return Comm

    def get_unique_id(self) -> bytes:
        self.log.append(("get_unique_id",))
        n = next(self.ids)
        return bytes((n + i) % 255 + 1 for i in range(128))

    def get_version(self) -> int:
        return self.version

    def names(self) -> list[str]:
        return [entry[0] for entry in self.log]
