"""NCCL communicator over CuPy, and the package's only CuPy import.

Everything CuPy-specific lives here so the rest of the trainer imports on
machines without CuPy or a GPU: ``import cupy`` happens only inside
``_import_cupy`` (the test seam), never at module import time. CuPy and NCCL
exceptions are translated into the trainer's exception tree in exactly one
place, ``NcclCommunicator._failure``.

The 128-byte NCCL unique id is a bearer credential (whoever holds it while the
group forms can claim a rank), so it is never logged, never put into an error
message or repr, and not kept after the communicator is built.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .communicator import ReduceOp
from .errors import (
    CollectiveArgumentError,
    CommunicatorAborted,
    CommunicatorError,
    CommunicatorTimeout,
    ConfigError,
    PeerConnectionError,
)

NCCL_ID_BYTES = 128

# NCCL encodes versions as major*10000 + minor*100 + patch from 2.9 on.
_AVG_MIN_VERSION = 21003
_NCCL_AVG = 4

# ncclDataType_t values are part of NCCL's ABI, so the table does not depend on
# which constants a given CuPy release happens to re-export.
_DTYPE_CODES: dict[str, int] = {
    "int8": 0,
    "uint8": 1,
    "int32": 2,
    "uint32": 3,
    "int64": 4,
    "uint64": 5,
    "float16": 6,
    "float32": 7,
    "float64": 8,
    "bfloat16": 9,
}
_OP_CODES: dict[ReduceOp, int] = {ReduceOp.SUM: 0, ReduceOp.MAX: 2, ReduceOp.MIN: 3}

# ncclSystemError (sockets, shared memory) and ncclRemoteError (a peer went away)
# are what a dead or unreachable peer produces.
_PEER_STATUSES = frozenset({2, 6})

_POLL_S = 0.0005


def _import_cupy() -> Any:
    """Import CuPy with its NCCL bindings; tests replace this function."""
    # Importing the submodule explicitly: older CuPy does not load it with cupy.
    import cupy.cuda.nccl

    return cupy


def _cupy_or_none() -> Any | None:
    try:
        return _import_cupy()
    except Exception:  # ImportError, or a CUDA library failing to load
        return None


def cupy_available() -> bool:
    """True when CuPy (with NCCL bindings) imports on this machine."""
    return _cupy_or_none() is not None


def device_count() -> int:
    """Number of visible CUDA devices; 0 without CuPy, a driver or a GPU."""
    cp = _cupy_or_none()
    if cp is None:
        return 0
    try:
        return int(cp.cuda.runtime.getDeviceCount())
    except Exception:  # CUDARuntimeError when no driver or device is present
        return 0


def _require_cupy() -> Any:
    cp = _cupy_or_none()
    if cp is None:
        raise ConfigError(
            "backend 'nccl' needs CuPy with NCCL; install the extra matching the CUDA "
            "driver: rendezvousd[gpu-cuda12] (cupy-cuda12x) or rendezvousd[gpu-cuda13] "
            "(cupy-cuda13x)"
        )
    if not getattr(cp.cuda.nccl, "available", True):
        raise ConfigError("backend 'nccl': CuPy was built without NCCL support")
    return cp


def is_cupy_array(array: object) -> bool:
    """Recognise a CuPy array without importing CuPy (none exist if it is not loaded)."""
    module = type(array).__module__
    return module == "cupy" or module.startswith("cupy.")


# --- the unique id ---------------------------------------------------------


def unique_id_to_bytes(raw: object) -> bytes:
    """Normalise ``get_unique_id()``'s result to exactly 128 bytes.

    CuPy >= 14 returns ``bytes``; older releases return a tuple of C ``char``
    values (signed, -128..127 on x86). All-zero ids are rejected: NCCL never
    produces one, and accepting it would hide an uninitialised buffer.
    """
    if isinstance(raw, bytes | bytearray):
        out = bytes(raw)
    elif isinstance(raw, tuple | list):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in raw):
            raise CollectiveArgumentError("NCCL unique id tuple must hold integers")
        if not all(-128 <= v <= 255 for v in raw):
            raise CollectiveArgumentError("NCCL unique id tuple values must fit in one byte")
        out = bytes(v & 0xFF for v in raw)
    else:
        raise CollectiveArgumentError(
            f"NCCL unique id must be bytes or a tuple of ints, not {type(raw).__name__}"
        )
    if len(out) != NCCL_ID_BYTES:
        raise CollectiveArgumentError(
            f"NCCL unique id must be {NCCL_ID_BYTES} bytes, got {len(out)}"
        )
    if not any(out):
        raise CollectiveArgumentError("NCCL unique id is all zero")
    return out


def unique_id_to_tuple(uid: bytes) -> tuple[int, ...]:
    """The pre-14 CuPy form: signed chars, so bytes >= 128 become negative."""
    checked = unique_id_to_bytes(uid)
    return tuple(b - 256 if b > 127 else b for b in checked)


def _cupy_major(cp: Any) -> int:
    try:
        return int(str(cp.__version__).split(".", 1)[0])
    except (AttributeError, ValueError):
        return 0


def create_unique_id() -> bytes:
    """Create a fresh id on global rank 0; it serves exactly one communicator init."""
    cp = _require_cupy()
    try:
        raw = cp.cuda.nccl.get_unique_id()
    except Exception as exc:
        raise CommunicatorError(f"rank 0: NCCL get_unique_id failed: {exc}") from exc
    return unique_id_to_bytes(raw)


def exchange_unique_id(
    rank: int, publish: Callable[[bytes], None], fetch: Callable[[], bytes]
) -> bytes:
    """Rank 0 creates and publishes the id; every other rank fetches it.

    ``publish``/``fetch`` are the daemon's id RPCs; keeping them as callables
    means only rank 0 ever starts NCCL's bootstrap listener.
    """
    if rank == 0:
        uid = create_unique_id()
        publish(uid)
        return uid
    return unique_id_to_bytes(fetch())


# --- type and op mapping ---------------------------------------------------


def nccl_dtype(dtype: Any, version: int) -> int:
    """NCCL datatype code for a numpy/CuPy dtype; CollectiveArgumentError when NCCL has none."""
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    code = _DTYPE_CODES.get(name)
    if code is None:
        supported = ", ".join(_DTYPE_CODES)
        raise CollectiveArgumentError(f"NCCL cannot reduce dtype {name}; supported: {supported}")
    if name == "bfloat16" and version < _AVG_MIN_VERSION:
        raise CollectiveArgumentError(
            "NCCL bfloat16 needs NCCL >= 2.10.3; upgrade NCCL or reduce in float32"
        )
    return code


def nccl_op(op: ReduceOp, version: int) -> tuple[int, bool]:
    """(op code, divide afterwards); AVG falls back to SUM + division on old NCCL."""
    if op is ReduceOp.AVG:
        if version >= _AVG_MIN_VERSION:
            return _NCCL_AVG, False
        return _OP_CODES[ReduceOp.SUM], True
    return _OP_CODES[op], False


# --- the communicator ------------------------------------------------------


class NcclCommunicator:
    """One rank of an NCCL group on one GPU (backend ``"nccl"``).

    Collectives run on a dedicated non-blocking stream. They are ordered after
    the caller's current stream through an event and the caller's stream is
    made to wait for them, so results are visible to later work on that stream
    without blocking the host. ``barrier`` blocks the host; it polls NCCL's async
    error state so ``abort()`` from another thread or ``timeout`` ends the wait.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        unique_id: bytes,
        device: int,
        *,
        timeout: float | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank={rank} is out of range for world_size={world_size}")
        self._rank = rank
        self._world_size = world_size
        self._device = device
        self._timeout = timeout
        self._cp = _require_cupy()
        self._nccl = self._cp.cuda.nccl
        self._errors = self._foreign_error_types()
        self._lock = threading.Lock()
        self._aborted: str | None = None
        self._closed = False
        self._comm: Any = None
        uid = unique_id_to_bytes(unique_id)
        try:
            self._version = int(self._nccl.get_version())
            with self._cp.cuda.Device(device):
                self._stream = self._cp.cuda.Stream(non_blocking=True)
                self._ready = self._cp.cuda.Event(disable_timing=True)
                self._done = self._cp.cuda.Event(disable_timing=True)
                self._token = self._cp.zeros(1, dtype=np.float32)
                self._comm = self._init_comm(uid)
        except self._errors as exc:
            raise self._failure("init", exc) from exc

    def _init_comm(self, uid: bytes) -> Any:
        tuple_form = unique_id_to_tuple(uid)
        first: Any = uid if _cupy_major(self._cp) >= 14 else tuple_form
        second: Any = tuple_form if first is uid else uid
        try:
            return self._nccl.NcclCommunicator(self._world_size, first, self._rank)
        except TypeError:
            # The constructor's Cython signature rejects the other form before
            # NCCL sees anything, so retrying with it is safe.
            return self._nccl.NcclCommunicator(self._world_size, second, self._rank)

    def _foreign_error_types(self) -> tuple[type[BaseException], ...]:
        candidates = (
            getattr(self._nccl, "NcclError", None),
            getattr(self._cp.cuda.runtime, "CUDARuntimeError", None),
            getattr(getattr(self._cp.cuda, "driver", None), "CUDADriverError", None),
        )
        return tuple(c for c in candidates if isinstance(c, type) and issubclass(c, BaseException))

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def backend(self) -> str:
        return "nccl"

    @property
    def device(self) -> int:
        return self._device

    @property
    def nccl_version(self) -> int:
        return self._version

    def __repr__(self) -> str:
        state = "aborted" if self._aborted is not None else "closed" if self._closed else "open"
        return (
            f"NcclCommunicator(rank={self._rank}, world_size={self._world_size}, "
            f"device={self._device}, {state})"
        )

    # -- error seam --

    def _failure(self, operation: str, exc: BaseException) -> CommunicatorError:
        where = f"rank {self._rank}/{self._world_size}: NCCL {operation}"
        if self._aborted is not None:
            return CommunicatorAborted(f"{where} failed after abort: {self._aborted}")
        status = getattr(exc, "status", None)
        if status in _PEER_STATUSES:
            return PeerConnectionError(f"{where} failed, a peer is unreachable: {exc}")
        return CommunicatorError(f"{where} failed: {type(exc).__name__}: {exc}")

    def _check_usable(self, operation: str) -> None:
        if self._aborted is not None:
            raise CommunicatorAborted(
                f"rank {self._rank}: NCCL {operation} after abort: {self._aborted}"
            )
        if self._closed:
            raise CommunicatorError(f"rank {self._rank}: NCCL {operation} on a closed communicator")

    @contextlib.contextmanager
    def _collective(self, operation: str) -> Iterator[None]:
        with self._lock:
            self._check_usable(operation)
            try:
                with self._cp.cuda.Device(self._device):
                    caller = self._cp.cuda.get_current_stream()
                    self._ready.record(caller)
                    self._stream.wait_event(self._ready)
                    yield
                    self._done.record(self._stream)
                    caller.wait_event(self._done)
            except self._errors as exc:
                raise self._failure(operation, exc) from exc

    def _buffer_args(self, array: Any, operation: str) -> tuple[int, int, int]:
        if not isinstance(array, self._cp.ndarray):
            raise CollectiveArgumentError(
                f"rank {self._rank}: NCCL {operation} needs a CuPy array, "
                f"not {type(array).__name__}"
            )
        if not array.flags.c_contiguous:
            raise CollectiveArgumentError(
                f"rank {self._rank}: NCCL {operation} needs a C-contiguous array; "
                "pass cupy.ascontiguousarray(array) and copy the result back"
            )
        if array.device.id != self._device:
            raise CollectiveArgumentError(
                f"rank {self._rank}: NCCL {operation}: array is on device {array.device.id}, "
                f"communicator on device {self._device}"
            )
        return int(array.data.ptr), int(array.size), nccl_dtype(array.dtype, self._version)

    # -- collectives --

    def all_reduce(self, array: Any, op: ReduceOp = ReduceOp.SUM) -> None:
        ptr, count, dtype = self._buffer_args(array, "all_reduce")
        code, divide = nccl_op(op, self._version)
        if count == 0:
            self._check_usable("all_reduce")
            return
        with self._collective("all_reduce"), self._stream:
            self._comm.allReduce(ptr, ptr, count, dtype, code, self._stream.ptr)
            if divide:
                if array.dtype.kind in "iu":
                    array //= self._world_size
                else:
                    array /= self._world_size

    def broadcast(self, array: Any, root: int = 0) -> None:
        ptr, count, dtype = self._buffer_args(array, "broadcast")
        if not 0 <= root < self._world_size:
            raise CollectiveArgumentError(
                f"rank {self._rank}: broadcast root={root} is out of range [0, {self._world_size})"
            )
        if count == 0:
            self._check_usable("broadcast")
            return
        with self._collective("broadcast"):
            self._comm.broadcast(ptr, ptr, count, dtype, root, self._stream.ptr)

    def barrier(self) -> None:
        ptr, count, dtype = self._buffer_args(self._token, "barrier")
        with self._collective("barrier"):
            self._comm.allReduce(ptr, ptr, count, dtype, _OP_CODES[ReduceOp.SUM], self._stream.ptr)
        self._wait_stream("barrier")

    def _wait_stream(self, operation: str) -> None:
        # Polling instead of stream.synchronize() keeps the wait abortable: a
        # blocked cudaStreamSynchronize would not notice abort() or a timeout.
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        try:
            with self._cp.cuda.Device(self._device):
                while not self._done.done:
                    if self._aborted is not None:
                        break
                    self._comm.check_async_error()
                    if deadline is not None and time.monotonic() > deadline:
                        self.abort(f"{operation} timed out after {self._timeout} s")
                        raise CommunicatorTimeout(
                            f"rank {self._rank}: NCCL {operation} did not finish within "
                            f"{self._timeout} s; communicator aborted"
                        )
                    time.sleep(_POLL_S)
        except self._errors as exc:
            raise self._failure(operation, exc) from exc
        self._check_usable(operation)

    def abort(self, reason: str) -> None:
        # No self._lock here: abort must get through while a collective holds it.
        if self._aborted is not None:
            return
        self._aborted = reason
        comm = None if self._closed else self._comm
        if comm is not None:
            # The communicator is unusable whatever abort() reports.
            with contextlib.suppress(Exception), self._cp.cuda.Device(self._device):
                comm.abort()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            comm = self._comm
            try:
                if comm is not None and self._aborted is None:
                    # Drain first, abortably: destroying a communicator with work
                    # in flight can block forever on a dead peer.
                    with self._cp.cuda.Device(self._device):
                        self._done.record(self._stream)
                    self._wait_stream("close")
                    with self._cp.cuda.Device(self._device):
                        comm.destroy()
            except CommunicatorAborted:
                pass  # abort() has already released NCCL's resources
            except self._errors as exc:
                raise self._failure("close", exc) from exc
            finally:
                self._closed = True
                self._comm = None


# --- helpers for bucketing.py (it must not import CuPy itself) -------------


@contextlib.contextmanager
def _gpu_scope(cp: Any, device: int, stream: Any) -> Iterator[None]:
    # CuPy's current device and stream are thread-local: without re-entering the
    # caller's, the bucketing worker's copies would land on device 0's null stream.
    with cp.cuda.Device(device), stream:
        yield


class CupyBufferOps:
    """What the bucketed reducer needs for CuPy gradients on one device."""

    def __init__(self, device: int) -> None:
        self._cp = _require_cupy()
        self._device = device

    @staticmethod
    def device_of(array: Any) -> int:
        return int(array.device.id)

    @property
    def xp(self) -> Any:
        return self._cp

    def empty(self, count: int, dtype: np.dtype[Any]) -> Any:
        with self._cp.cuda.Device(self._device):
            return self._cp.empty(count, dtype=dtype)

    def capture(self) -> contextlib.AbstractContextManager[None]:
        with self._cp.cuda.Device(self._device):
            stream = self._cp.cuda.get_current_stream()
        return _gpu_scope(self._cp, self._device, stream)
