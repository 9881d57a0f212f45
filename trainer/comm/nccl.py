"""NCCL communicator over CuPy, and the package's only CuPy import.

Everything CuPy-specific lives here so the rest of the trainer imports on
machines without CuPy or a GPU: ``import cupy`` happens only inside
``_import_cupy`` (the test seam), never at module import time. CuPy and NCCL
exceptions are translated into the trainer's exception tree in exactly one
place, ``NcclCommunicator._failure``.

The NCCL unique id is a bearer credential (whoever holds it while the
group forms can claim a rank), so it is never logged, never put into an error
message or repr, and not kept after the communicator is built.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from rendezvousd.trainer import errors as errs
from rendezvousd.trainer.comm.communicator import RankedCommunicator, ReduceOp
from rendezvousd.trainer.comm.nccl_id import unique_id_to_bytes, unique_id_to_tuple
from rendezvousd.trainer.comm.nccl_watchdog import CALL_HANG_EXIT_CODE, InitWatchdog, end_process

__all__ = [
    "CupyBufferOps",
    "NcclCommunicator",
    "create_unique_id",
    "device_count",
    "is_cupy_array",
    "unavailable_reason",
    "unique_id_to_bytes",
    "unique_id_to_tuple",
]


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

# ncclRemoteError: a peer went away, or its connection broke or was refused. Not
# ncclSystemError (2): that is a system call failing on this rank (a socket, shared
# memory: a container's 64 MB /dev/shm), which says nothing of a peer.
_PEER_STATUSES = frozenset({6})
_NCCL_SYSTEM_ERROR = 2
_NCCL_INVALID_USAGE = 5
# CUDA's numbering (a CUDARuntimeError's .status), unrelated to NCCL's.
_CUDA_OUT_OF_MEMORY = 2  # cudaErrorMemoryAllocation
_CUDA_INVALID_DEVICE = 101  # cudaErrorInvalidDevice
_CUDA_NOT_READY = 600  # cudaErrorNotReady: what cudaEventQuery says of pending work

_POLL_S = 0.0005
# How long abort() waits for a thread inside an NCCL call to leave it; past that the
# call is taken as stuck and the process ends (ncclCommAbort would free the
# communicator under it).
_ABORT_GRACE_S = 2.0
# NCCL >= 2.22 makes each algorithm's connections on first use, inside the first
# collective's enqueue (NCCL_RUNTIME_CONNECT=1, its default): on a blocking
# communicator, with no timeout, before our wait's deadline starts. 0 has them made
# inside ncclCommInitRank, which InitWatchdog bounds.
_RUNTIME_CONNECT = "NCCL_RUNTIME_CONNECT"
# devices.SHARED_DEVICE_ENV, named here (devices.py imports this module).
SHARED_DEVICE_ENV = "RENDEZVOUSD_NCCL_SHARED_DEVICE"
# CuPy < 13.4 has no name for ncclRemoteError (6): building its NcclError raises
# KeyError(6) instead, which the error seam maps like the status it stands for.
_MIN_CUPY = (13, 4)
# The first CuPy that loads NCCL from its pip wheels (nvidia-nccl-cu12/cu13).
_WHEEL_NCCL_CUPY = (13, 5)


def _status_of(exc: BaseException, nccl_error: type[BaseException] | None = None) -> int | None:
    """NCCL's status for an NCCL error: CuPy's ``nccl_error``, or the KeyError older CuPy
    raises building one. None for anything else: a CUDARuntimeError has a ``.status``
    too, in CUDA's numbering (2 is out of memory there, a system error in NCCL's)."""
    if isinstance(exc, KeyError):
        key = exc.args[0] if exc.args else None
        return key if isinstance(key, int) and 0 <= key < 16 else None
    if nccl_error is None or not isinstance(exc, nccl_error):
        return None
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) else None


def _error_text(exc: BaseException, status: int | None) -> str:
    if isinstance(exc, KeyError):
        return f"NCCL status {status} (CuPy could not name it)"
    return f"{type(exc).__name__}: {exc}"


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


# CuPy's wheels bring no NCCL: cupy.cuda.nccl imports anyway and says
# available = False when it cannot load libnccl, which a pip install fixes.
_NO_NCCL = (
    "CuPy cannot load the NCCL library (libnccl.so.2); install nvidia-nccl-cu12 or "
    "nvidia-nccl-cu13 to match CuPy's CUDA (the rendezvousd[gpu-cuda12] and "
    "rendezvousd[gpu-cuda13] extras include it), or a system NCCL"
)


def _no_nccl(cp: Any) -> str:
    """Why CuPy has no NCCL, and the cure for this CuPy: before 13.5.0 it finds no
    NCCL pip wheel, so installing one does not help."""
    version = _cupy_version(cp)
    if version is not None and version < _WHEEL_NCCL_CUPY:
        return (
            f"CuPy {cp.__version__} cannot load the NCCL library (libnccl.so.2) and finds "
            "none in the nvidia-nccl-cu12/cu13 wheels (CuPy does from 13.5.0 on); upgrade "
            "CuPy (the rendezvousd[gpu-cuda12] and [gpu-cuda13] extras ask for >= 13.5) "
            "or install a system NCCL"
        )
    return _NO_NCCL


def unavailable_reason() -> str | None:
    """None when the nccl backend can run here, else what is missing, in words:
    CuPy, its NCCL library, or a CUDA device (with CUDA's own error)."""
    try:
        cp = _import_cupy()
    except Exception as exc:  # ImportError, or a CUDA library failing to load
        return f"CuPy does not import ({type(exc).__name__}: {exc})"
    if not getattr(cp.cuda.nccl, "available", True):
        return _no_nccl(cp)
    try:
        count = int(cp.cuda.runtime.getDeviceCount())
    except Exception as exc:  # CUDARuntimeError: no driver, or one too old for CuPy
        return f"no CUDA device ({type(exc).__name__}: {exc})"
    return None if count > 0 else "no CUDA device (CuPy sees none)"


def device_count() -> int:
    """Number of visible CUDA devices; 0 without CuPy, a driver or a GPU."""
    try:
        return int(_import_cupy().cuda.runtime.getDeviceCount())
    except Exception:  # no CuPy, or CUDARuntimeError when no driver or device is present
        return 0


def _require_cupy() -> Any:
    cp = _cupy_or_none()
    if cp is None:
        raise errs.ConfigError(
            "backend 'nccl' needs CuPy with NCCL; install the extra matching the CUDA "
            "driver: rendezvousd[gpu-cuda12] (cupy-cuda12x) or rendezvousd[gpu-cuda13] "
            "(cupy-cuda13x)"
        )
    if not getattr(cp.cuda.nccl, "available", True):
        raise errs.ConfigError(f"backend 'nccl': {_no_nccl(cp)}")
    version = _cupy_version(cp)
    if version is not None and version < _MIN_CUPY:
        raise errs.ConfigError(
            f"backend 'nccl' needs CuPy >= 13.4 (older releases cannot report NCCL's "
            f"remote error), but CuPy {cp.__version__} is installed; upgrade CuPy"
        )
    return cp


def _cupy_version(cp: Any) -> tuple[int, int] | None:
    """(major, minor), or None for a version string that does not parse (dev builds)."""
    parts = str(getattr(cp, "__version__", "")).split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def is_cupy_array(array: object) -> bool:
    """Recognise a CuPy array without importing CuPy (none exist if it is not loaded)."""
    module = type(array).__module__
    return module == "cupy" or module.startswith("cupy.")


# --- the unique id ---------------------------------------------------------


def create_unique_id() -> bytes:
    """Create a fresh id on global rank 0; it serves exactly one communicator init."""
    cp = _require_cupy()
    try:
        raw = cp.cuda.nccl.get_unique_id()
    except Exception as exc:
        raise errs.CommunicatorError(f"rank 0: NCCL get_unique_id failed: {exc}") from exc
    return unique_id_to_bytes(raw)


# --- type and op mapping ---------------------------------------------------


def nccl_dtype(dtype: Any, version: int) -> int:
    """NCCL datatype code for a numpy/CuPy dtype; CollectiveArgumentError when NCCL has none."""
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    code = _DTYPE_CODES.get(name)
    if code is None:
        supported = ", ".join(_DTYPE_CODES)
        raise errs.CollectiveArgumentError(
            f"NCCL cannot reduce dtype {name}; supported: {supported}"
        )
    if name == "bfloat16" and version < _AVG_MIN_VERSION:
        raise errs.CollectiveArgumentError(
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


def _peers_text(rank: int, world_size: int) -> str:
    """The peer set named in errors; long worlds are summarised, not listed."""
    if world_size <= 9:
        others = [str(r) for r in range(world_size) if r != rank]
        return "ranks " + ", ".join(others) if others else "no peers"
    return f"ranks 0..{world_size - 1} except {rank}"


class NcclCommunicator(RankedCommunicator):
    """One rank of an NCCL group on one GPU (backend ``"nccl"``).

    Collectives run on a dedicated non-blocking stream, ordered after the
    caller's current stream through an event. Every collective then waits on
    the host until NCCL has finished it, polling the completion event and
    NCCL's asynchronous error state instead of blocking in CUDA, so a dead peer,
    ``abort()`` from another thread or ``timeout`` ends the wait with an error;
    the caller's stream is made to wait for the collective before returning.

    NCCL errors are asynchronous: after one the communicator is ``abort()``ed
    (never destroyed, which can block forever on a failed group) and every
    later call raises ``CommunicatorAborted``.
    """

    backend: Final = "nccl"
    _label = "NCCL"

    def __init__(
        self,
        rank: int,
        world_size: int,
        unique_id: bytes,
        device: int,
        *,
        timeout: float | None = None,
        setup_timeout: float | None = None,
        on_setup_timeout: Callable[[str], None] | None = None,
        check_collectives: bool = False,
    ) -> None:
        super().__init__(rank, world_size)
        self.device: Final = device
        self._timeout = timeout
        # Every all-reduce compared across ranks first (``_agree``), as broadcasts are.
        self._check_collectives = check_collectives
        self._cp = _require_cupy()
        self._nccl = self._cp.cuda.nccl
        # CuPy's error classes, each looked up once: NCCL's, CUDA's (a ``.status`` in
        # CUDA's numbering), and its allocator's (a MemoryError, not a CUDARuntimeError).
        self._nccl_error = _error_class(getattr(self._nccl, "NcclError", None))
        self._cuda_errors = tuple(
            c
            for c in (
                _error_class(getattr(self._cp.cuda.runtime, "CUDARuntimeError", None)),
                _error_class(
                    getattr(getattr(self._cp.cuda, "driver", None), "CUDADriverError", None)
                ),
            )
            if c is not None
        )
        self._oom_error = _error_class(
            getattr(getattr(self._cp.cuda, "memory", None), "OutOfMemoryError", None)
        )
        # What _failure maps; KeyError: CuPy < 13.4 building NcclError(6) (_status_of).
        self._errors = tuple(
            c
            for c in (self._nccl_error, *self._cuda_errors, self._oom_error, KeyError)
            if c is not None
        )
        # _lock serialises collectives (they share the events); _handle_lock
        # serialises calls into the NCCL handle against abort()/destroy(), which
        # free it: CuPy zeroes the handle on abort, but a call already inside
        # NCCL would still use the freed one.
        self._lock = threading.Lock()
        self._handle_lock = threading.Lock()
        self._aborted: str | None = None
        self._closed = False
        self._comm: Any = None
        # When the NCCL call now running began (None: none is), for _watch_calls.
        self._inside_since: float | None = None
        self._watching = False
        # What ends the process when an NCCL call is stuck (tests replace it).
        self._exit: Callable[[int], object] = os._exit
        uid = unique_id_to_bytes(unique_id)
        try:
            self.nccl_version: Final = int(self._nccl.get_version())
            with self._cp.cuda.Device(device):
                self._stream = self._cp.cuda.Stream(non_blocking=True)
                self._ready = self._cp.cuda.Event(disable_timing=True)
                self._done = self._cp.cuda.Event(disable_timing=True)
                self._token = self._cp.zeros(1, dtype=np.float32)
                if setup_timeout is None:
                    self._comm = self._init_comm(uid)
                else:
                    what = f"rank {rank}/{world_size}: NCCL init on device {device}"
                    with InitWatchdog(setup_timeout, what, on_timeout=on_setup_timeout):
                        self._comm = self._init_comm(uid)
        except self._errors as exc:
            raise self._failure("init", exc) from exc

    def _init_comm(self, uid: bytes) -> Any:
        # NCCL reads it at its first init in this process; a value the user set stays.
        os.environ.setdefault(_RUNTIME_CONNECT, "0")
        tuple_form = unique_id_to_tuple(uid)
        first: Any = uid if (_cupy_version(self._cp) or (0, 0)) >= (14, 0) else tuple_form
        second: Any = tuple_form if first is uid else uid
        try:
            return self._nccl.NcclCommunicator(self.world_size, first, self.rank)
        except TypeError:
            # The constructor's Cython signature rejects the other form before
            # NCCL sees anything, so retrying with it is safe.
            return self._nccl.NcclCommunicator(self.world_size, second, self.rank)

    @property
    def aborted(self) -> str | None:
        """The abort reason once ``abort()`` ran, else None."""
        return self._aborted

    def __repr__(self) -> str:
        state = "aborted" if self._aborted is not None else "closed" if self._closed else "open"
        return (
            f"NcclCommunicator(rank={self.rank}, world_size={self.world_size}, "
            f"device={self.device}, {state})"
        )

    # -- error seam --

    def _failure(self, operation: str, exc: BaseException) -> errs.CommunicatorError:
        where = f"rank {self.rank}/{self.world_size}: NCCL {operation}"
        if self._aborted is not None:
            return errs.CommunicatorAborted(f"{where} failed after abort: {self._aborted}")
        status = _status_of(exc, self._nccl_error)
        if isinstance(exc, KeyError) and status is None:
            return errs.CommunicatorError(f"{where} failed: KeyError: {exc}")
        text = _error_text(exc, status)
        if operation != "init":
            # An NCCL error leaves the communicator unusable; abort frees it
            # without the hang destroy() risks on a failed group.
            self.abort(f"NCCL {operation} failed: {text}")
        local = self._device_failure(where, exc)
        if local is not None:
            return local
        if status in _PEER_STATUSES:
            peers = _peers_text(self.rank, self.world_size)
            kind = errs.TransientInitError if operation == "init" else errs.PeerConnectionError
            return kind(f"{where} failed, a peer ({peers}) is unreachable: {text}")
        if status == _NCCL_INVALID_USAGE and operation == "init":
            return errs.CommunicatorError(
                f"{where} failed: {text}. Most likely two ranks of this communicator "
                f"drive one GPU (device {self.device} here), which NCCL refuses within "
                "one host: run at most one worker per visible GPU. Ranks sharing a GPU on "
                f"purpose (a test) need {SHARED_DEVICE_ENV}=1, which gives each process "
                "its own NCCL_HOSTID; an NCCL_HOSTID set by hand must differ between "
                "them. Run with NCCL_DEBUG=WARN for NCCL's reason"
            )
        if status == _NCCL_SYSTEM_ERROR:
            return errs.CommunicatorError(
                f"{where} failed: {text}. A system call failed on this rank (a socket, or "
                "shared memory: a container's /dev/shm is often too small, raise it with "
                "docker's --shm-size), not at a peer; run with NCCL_DEBUG=WARN for NCCL's "
                "reason"
            )
        return errs.CommunicatorError(f"{where} failed: {text}")

    def _device_failure(self, where: str, exc: BaseException) -> errs.DeviceError | None:
        """This rank's own GPU failing (out of memory, a CUDA error), in words that
        blame no peer; None for an error of another kind."""
        status = getattr(exc, "status", None) if isinstance(exc, self._cuda_errors) else None
        text = f"{type(exc).__name__}: {exc}"
        if (self._oom_error is not None and isinstance(exc, self._oom_error)) or (
            status == _CUDA_OUT_OF_MEMORY
        ):
            return errs.DeviceError(
                f"{where} failed: GPU {self.device} is out of memory ({text}). This rank "
                "failed by itself, not a peer: free device memory (a smaller batch or "
                "bucket_cap_mib, another process on the GPU) and restart"
            )
        if status == _CUDA_INVALID_DEVICE:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            return errs.DeviceError(
                f"{where} failed: CUDA has no device {self.device} here ({text}; "
                f"CUDA_VISIBLE_DEVICES={visible if visible is not None else '(unset)'}). "
                "Run at most as many workers per node as it has visible GPUs"
            )
        if isinstance(exc, self._cuda_errors):
            return errs.DeviceError(
                f"{where} failed with a CUDA error on this rank's GPU {self.device} "
                f"({text}). This rank failed by itself, not a peer; a sticky error (an "
                "illegal address, a launch failure, an ECC error) leaves this process's "
                "CUDA context unusable, so the process must restart (rendezvous-run "
                "restarts it); check the GPU (nvidia-smi) if it repeats"
            )
        return None

    def _check_usable(self, operation: str) -> None:
        if self._aborted is not None:
            raise errs.CommunicatorAborted(
                f"rank {self.rank}: NCCL {operation} after abort: {self._aborted}"
            )
        if self._closed:
            raise errs.CommunicatorError(
                f"rank {self.rank}: NCCL {operation} on a closed communicator"
            )

    @contextlib.contextmanager
    def _mapped(self, operation: str) -> Iterator[None]:
        """CuPy's, CUDA's and NCCL's errors raised in the block, as ours (``_failure``)."""
        try:
            yield
        except self._errors as exc:
            raise self._failure(operation, exc) from exc

    @contextlib.contextmanager
    def _in_nccl(self, operation: str) -> Iterator[Any]:
        """The live handle, held against a concurrent abort for one NCCL call."""
        with self._handle_lock:
            self._check_usable(operation)
            yield self._comm

    @contextlib.contextmanager
    def _enqueueing(self, operation: str) -> Iterator[Any]:
        """``_in_nccl`` for a collective's enqueue, which can block inside NCCL (a
        connection NCCL still makes on first use, to a peer that never answers) where
        no Python exception reaches it: with a ``timeout``, a call inside for longer
        ends the process (``_watch_calls``)."""
        with self._in_nccl(operation) as comm:
            if self._timeout is not None and not self._watching:
                self._watching = True
                threading.Thread(
                    target=_watch_calls,
                    args=(weakref.ref(self), self._timeout),
                    name=f"nccl-call-watchdog-rank{self.rank}",
                    daemon=True,
                ).start()
            self._inside_since = time.monotonic()
            try:
                yield comm
            finally:
                self._inside_since = None

    def _stuck(self, what: str) -> None:
        """End the process: a thread is stuck inside an NCCL call, which nothing can
        interrupt, and freeing the communicator under it would crash the process."""
        if self._aborted is None:
            self._aborted = what
        end_process(
            f"rank {self.rank}/{self.world_size}: {what}; an NCCL call cannot be "
            "interrupted, and aborting the communicator under it would free memory it "
            f"still uses, so this process exits with code {CALL_HANG_EXIT_CODE}. A peer "
            "is most likely gone or unreachable (check every rank's log, and that the "
            "nodes reach each other: NCCL_SOCKET_IFNAME, firewalls)",
            CALL_HANG_EXIT_CODE,
            exit=self._exit,
        )

    def _run(self, operation: str, count: int, enqueue: Callable[[Any, Any], None]) -> None:
        """Order after the caller's stream, enqueue, wait abortably, order the caller after.

        An empty buffer (``count`` 0) makes no NCCL call: only the state is checked.
        """
        if count == 0:
            self._check_usable(operation)
            return
        with self._lock:
            self._check_usable(operation)
            with self._mapped(operation):
                with self._cp.cuda.Device(self.device):
                    caller = self._cp.cuda.get_current_stream()
                    self._ready.record(caller)
                    self._stream.wait_event(self._ready)
                    with self._enqueueing(operation) as comm:
                        enqueue(comm, self._stream)
                    self._done.record(self._stream)
                self._wait_done(operation)
                with self._cp.cuda.Device(self.device):
                    caller.wait_event(self._done)

    def _wait_done(self, operation: str) -> None:
        # Polling instead of synchronize() keeps the wait abortable: a blocked
        # cudaEventSynchronize would notice neither abort() nor a timeout.
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        # cudaEventQuery's own status, not Event.done (== 0): after a sticky CUDA error
        # done stays False for ever, and the wait blamed a peer at the timeout (or
        # never ended without one) for this GPU's fault.
        query = self._cp.cuda.runtime.eventQuery
        with self._cp.cuda.Device(self.device):
            while (status := int(query(self._done.ptr))) != 0:
                if status != _CUDA_NOT_READY:
                    raise self._cp.cuda.runtime.CUDARuntimeError(status)
                with self._in_nccl(operation) as comm:
                    comm.check_async_error()
                if deadline is not None and time.monotonic() > deadline:
                    peers = _peers_text(self.rank, self.world_size)
                    reason = f"{operation} timed out after {self._timeout:g} s waiting for {peers}"
                    self.abort(reason)
                    raise errs.CommunicatorTimeout(
                        f"rank {self.rank}/{self.world_size}: NCCL {operation} did not "
                        f"finish within collective_timeout_s={self._timeout:g} s (peers: "
                        f"{peers}); communicator aborted. A peer is stuck or its host "
                        "unreachable, or the ranks disagree on this collective (its size, "
                        "type or op: NCCL cannot tell them apart, unlike the CPU ring). "
                        "Under init_distributed a dead peer is reported by the daemon first"
                    )
                time.sleep(_POLL_S)
        self._check_usable(operation)

    def _buffer_args(self, array: Any, operation: str) -> tuple[int, int, int]:
        if not isinstance(array, self._cp.ndarray):
            raise errs.CollectiveArgumentError(
                f"rank {self.rank}: NCCL {operation} needs a CuPy array, not {type(array).__name__}"
            )
        # Either order is one run of memory, reduced element by element, as the CPU
        # ring takes it: only a strided view is refused.
        if not (array.flags.c_contiguous or array.flags.f_contiguous):
            raise errs.CollectiveArgumentError(
                f"rank {self.rank}: NCCL {operation} needs a contiguous array (C or "
                f"Fortran order), not a strided view of shape {array.shape}; pass "
                "cupy.ascontiguousarray(array) and copy the result back"
            )
        if array.device.id != self.device:
            raise errs.CollectiveArgumentError(
                f"rank {self.rank}: NCCL {operation}: array is on device {array.device.id}, "
                f"communicator on device {self.device}"
            )
        return int(array.data.ptr), int(array.size), nccl_dtype(array.dtype, self.nccl_version)

    # -- collectives --

    def all_reduce(self, array: Any, op: ReduceOp = ReduceOp.SUM) -> None:
        ptr, count, dtype = self._buffer_args(array, "all_reduce")
        code, divide = nccl_op(op, self.nccl_version)
        if self._check_collectives:
            self._agree("all_reduce", {"NCCL op": code, "element count": count, "NCCL type": dtype})

        def enqueue(comm: Any, stream: Any) -> None:
            comm.allReduce(ptr, ptr, count, dtype, code, stream.ptr)

        self._run("all_reduce", count, enqueue)
        if divide and count:
            # On the caller's stream, which _run ordered after the sum.
            with self._mapped("all_reduce"):
                if array.dtype.kind in "iu":
                    if array.dtype.kind == "i":
                        # Towards zero, as NCCL's own AVG divides integers (and the CPU
                        # ring): less the C remainder, the sum divides exactly. Unsigned
                        # sums need nothing: floor and towards zero are one there.
                        array -= self._cp.fmod(array, self.world_size)
                    array //= self.world_size
                else:
                    array /= self.world_size

    def broadcast(self, array: Any, root: int = 0) -> None:
        ptr, count, dtype = self._buffer_args(array, "broadcast")
        self._check_root(root)
        self._agree("broadcast", {"root": root, "element count": count, "NCCL type": dtype})

        def enqueue(comm: Any, stream: Any) -> None:
            comm.broadcast(ptr, ptr, count, dtype, root, stream.ptr)

        self._run("broadcast", count, enqueue)

    def _max_across_ranks(
        self, values: npt.NDArray[np.int64], operation: str
    ) -> npt.NDArray[np.int64]:
        # Broadcasts are compared always (they are rare: a 48-byte all-reduce more
        # costs a step nothing); all-reduces with ``check_collectives``, for debugging.
        n = len(values)
        self._check_usable(operation)
        with self._mapped(operation), self._cp.cuda.Device(self.device):
            both = self._cp.asarray(values)
        code = _DTYPE_CODES["int64"]

        def enqueue(comm: Any, stream: Any) -> None:
            ptr = both.data.ptr
            comm.allReduce(ptr, ptr, n, code, _OP_CODES[ReduceOp.MAX], stream.ptr)

        self._run(operation, n, enqueue)
        with self._mapped(operation), self._cp.cuda.Device(self.device):
            return np.asarray(self._cp.asnumpy(both), dtype=np.int64)

    def barrier(self) -> None:
        ptr, count, dtype = self._buffer_args(self._token, "barrier")

        def enqueue(comm: Any, stream: Any) -> None:
            comm.allReduce(ptr, ptr, count, dtype, _OP_CODES[ReduceOp.SUM], stream.ptr)

        self._run("barrier", count, enqueue)

    def abort(self, reason: str) -> None:
        # Not self._lock: abort must get through while a collective waits on it.
        if self._aborted is not None:
            return
        self._aborted = reason
        # A thread inside an NCCL call holds _handle_lock for that call only. One
        # still inside after the grace is stuck there (a blocking communicator waiting
        # on a peer): ncclCommAbort would free the communicator while that call uses
        # it, a crash at best, so the process ends instead, saying why.
        locked = self._handle_lock.acquire(timeout=_ABORT_GRACE_S)
        if not locked:
            self._stuck(
                f"abort ({reason}) waited {_ABORT_GRACE_S:g} s for a thread inside an "
                "NCCL call to leave it"
            )
            return
        try:
            comm = None if self._closed else self._comm
            if comm is not None:
                # The communicator is unusable whatever abort() reports.
                with contextlib.suppress(Exception), self._cp.cuda.Device(self.device):
                    comm.abort()
        finally:
            self._handle_lock.release()

    def close(self) -> None:
        if self._forked():
            # A forked child's copy: the NCCL communicator, its stream and the CUDA
            # context are the parent's (CUDA does not survive a fork), so destroying or
            # aborting it here, or waiting on it, is not this process's to do. No lock:
            # one held by another of the parent's threads at the fork stays held.
            self._closed = True
            self._comm = None
            return
        with self._lock:
            if self._closed:
                return
            try:
                if self._comm is not None and self._aborted is None:
                    # Drain first, abortably: destroying a communicator with work
                    # in flight can block forever on a dead peer.
                    with self._cp.cuda.Device(self.device):
                        self._done.record(self._stream)
                    self._wait_done("close")
                    with self._in_nccl("close") as comm, self._cp.cuda.Device(self.device):
                        comm.destroy()
            except errs.CommunicatorAborted:
                pass  # abort() has already released NCCL's resources
            except self._errors as exc:
                raise self._failure("close", exc) from exc
            finally:
                with self._handle_lock:
                    self._closed = True
                    self._comm = None


def _error_class(found: object) -> type[BaseException] | None:
    """``found`` where it is an exception class (CuPy's differ between releases and
    its fakes), else None."""
    return found if isinstance(found, type) and issubclass(found, BaseException) else None


def _watch_calls(ref: weakref.ReferenceType[NcclCommunicator], timeout: float) -> None:
    """A communicator's NCCL calls, each bounded by ``timeout`` (its collective
    timeout): one inside for longer is stuck, and ends the process. Returns once the
    communicator is closed, aborted or collected."""
    interval = min(1.0, timeout / 4)
    while True:
        comm = ref()
        if comm is None or comm._closed or comm._aborted is not None:
            return
        since = comm._inside_since
        if since is not None and time.monotonic() - since > timeout:
            comm._stuck(
                f"an NCCL call (a collective's enqueue) did not return within "
                f"collective_timeout_s={timeout:g} s"
            )
            return
        del comm  # no strong reference while asleep: the communicator may be collected
        time.sleep(interval)


# --- helpers for bucketing.py (it must not import CuPy itself) -------------


class CupyBufferOps:
    """The bucketed reducer's device side for CuPy gradients on one device (DDP's scheme).

    At a bucket's launch, on the caller's thread, an event is recorded on the
    caller's *current* stream (whatever it is: legacy, per-thread default or a
    user stream). The reducer's worker makes its own communication stream wait
    on that event and packs, all-reduces and unpacks there, so backward
    kernels queued after the launch never wait on communication. ``join_caller``
    (from ``wait()``) makes the caller's stream wait once, on the communication
    stream's final event.
    """

    def __init__(self, device: int) -> None:
        self.xp: Final = _require_cupy()
        self.device: Final = device
        with self.xp.cuda.Device(device):
            # The communication stream packs, all-reduces and unpacks run on.
            self.stream: Final = self.xp.cuda.Stream(non_blocking=True)
            self._final = self.xp.cuda.Event(disable_timing=True)
        self._ready: dict[int, Any] = {}
        # Per bucket (its buffer and its gradients' addresses): unpack's table on the device.
        self._tables: dict[tuple[int, tuple[int, ...]], tuple[Any, Any]] = {}

    @staticmethod
    def device_of(array: Any) -> int:
        return int(array.device.id)

    def empty(self, count: int, dtype: np.dtype[Any]) -> Any:
        with self.xp.cuda.Device(self.device):
            return self.xp.empty(count, dtype=dtype)

    def mark_launch(self, number: int) -> None:
        with self.xp.cuda.Device(self.device):
            event = self._ready.get(number)
            if event is None:
                event = self._ready[number] = self.xp.cuda.Event(disable_timing=True)
            event.record(self.xp.cuda.get_current_stream())

    @contextlib.contextmanager
    def worker_scope(self, number: int) -> Iterator[None]:
        # CuPy's current device and stream are thread-local: the worker sets both.
        with self.xp.cuda.Device(self.device), self.stream:
            self.stream.wait_event(self._ready[number])
            yield

    def join_caller(self) -> None:
        with self.xp.cuda.Device(self.device):
            self._final.record(self.stream)
            self.xp.cuda.get_current_stream().wait_event(self._final)

    # A bucket of many small gradients costs a launch per gradient when each is copied
    # on its own: 9 us each on an H200 from Python, where copying a 1 MiB gradient takes
    # under 1 us (docs/benchmarks.md, "The GPU path on an H200"). So a bucket's gradients
    # go in and out in one launch each way, where they are contiguous.

    def pack(self, flat: Any, grads: Sequence[Any], offsets: Sequence[int], divisor: int) -> None:
        """``bucketing.pack`` on the communication stream; contiguous gradients through
        CuPy's ``concatenate``, which copies many small arrays in one kernel."""
        if divisor == 1 and all(g.flags.c_contiguous for g in grads):
            self.xp.concatenate([g.reshape(-1) for g in grads], out=flat)
            return
        from rendezvousd.trainer.bucketing import pack

        pack(flat, grads, offsets, divisor, self.xp)

    def unpack(self, flat: Any, grads: Sequence[Any], offsets: Sequence[int]) -> None:
        """``bucketing.unpack``; many small contiguous gradients in one kernel of ours
        (CuPy has no scatter into many arrays), with the table of where each goes made
        once per bucket and kept on the device."""
        word = _SCATTER_WORDS.get(flat.dtype.itemsize)
        if (
            word is None
            or len(grads) <= _SCATTER_MIN_ARRAYS
            or flat.size * flat.dtype.itemsize >= _SCATTER_MAX_AVERAGE_BYTES * len(grads)
            or not all(g.flags.c_contiguous for g in grads)
        ):
            from rendezvousd.trainer.bucketing import unpack

            unpack(flat, grads, offsets)
            return
        pointers = tuple(int(g.data.ptr) for g in grads)
        table = self._tables.get((int(flat.data.ptr), pointers))
        if table is None:
            table = self._tables[(int(flat.data.ptr), pointers)] = (
                self.xp.asarray(np.array(pointers, dtype=np.uint64)),
                self.xp.asarray(np.array(offsets, dtype=np.int64)),
            )
        total = int(flat.size)
        blocks = min(-(-total // _SCATTER_THREADS), _SCATTER_MAX_BLOCKS)
        kernel = self._scatter_kernel(word)
        kernel(
            (blocks,),
            (_SCATTER_THREADS,),
            (flat, table[0], table[1], np.int32(len(grads)), np.int64(total)),
        )

    def _scatter_kernel(self, word: str) -> Any:
        with _SCATTER_LOCK:
            kernel = _SCATTER_KERNELS.get((self.device, word))
            if kernel is None:
                module = self.xp.RawModule(
                    code=_SCATTER_SOURCE, name_expressions=[f"rendezvousd_scatter<{word}>"]
                )
                kernel = module.get_function(f"rendezvousd_scatter<{word}>")
                _SCATTER_KERNELS[(self.device, word)] = kernel
            return kernel


# Elements are moved as words of their size: the scatter copies bits, whatever the dtype.
_SCATTER_WORDS = {
    1: "unsigned char",
    2: "unsigned short",
    4: "unsigned int",
    8: "unsigned long long",
}
# CuPy's own thresholds for one-kernel concatenation: more than 8 arrays, averaging
# under 2 MiB (larger ones copy at full bandwidth on their own).
_SCATTER_MIN_ARRAYS = 8
_SCATTER_MAX_AVERAGE_BYTES = 2 << 20
_SCATTER_THREADS = 256
_SCATTER_MAX_BLOCKS = 4096
_SCATTER_LOCK = threading.Lock()
_SCATTER_KERNELS: dict[tuple[int, str], Any] = {}
# Element i of the bucket goes to gradient j where starts[j] <= i < starts[j + 1]
# (a binary search over the bucket's offsets), at its offset i - starts[j].
_SCATTER_SOURCE = r"""
template <typename T>
__global__ void rendezvousd_scatter(const T* flat, const unsigned long long* pointers,
                                    const long long* starts, int count, long long total) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    int lo = 0, hi = count;
    while (hi - lo > 1) {
      int mid = (lo + hi) / 2;
      if (i < starts[mid]) {
        hi = mid;
      } else {
        lo = mid;
      }
    }
    reinterpret_cast<T*>(pointers[lo])[i - starts[lo]] = flat[i];
  }
}
"""
