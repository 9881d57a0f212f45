"""A tiny stand-in for ``cupy``, installed at the package's one CuPy seam.

Its arrays behave like real device arrays where it matters for correctness:
they are not numpy arrays, ``np.asarray``/``np.array``/numpy functions on them
raise ``TypeError`` (CuPy: "Implicit conversion to a NumPy array is not
allowed"), and arithmetic refuses numpy operands. So code that runs against it
provably crosses between host and device only through ``asnumpy``/``asarray``.
Memory is separate too: ``asarray`` copies, ``asnumpy`` copies back.

The NCCL part serves a world of one rank (collectives leave the data as it is),
enough for the example to run end to end on the nccl backend without a GPU.
``install(monkeypatch)`` for in-process tests; ``install_globally()`` for a
worker process.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np

UNIQUE_ID = bytes(range(1, 129))
_state = threading.local()
counts: dict[str, int] = {"asnumpy": 0, "asarray": 0}


def current_device() -> int:
    return int(getattr(_state, "device", 0))


def _refuse(what: str) -> TypeError:
    return TypeError(
        f"Implicit conversion to a NumPy array is not allowed ({what}); "
        "use .get() or cupy.asnumpy() to copy to the host explicitly"
    )


def _unwrap(value: Any) -> Any:
    if isinstance(value, ndarray):
        return value._host
    if isinstance(value, np.ndarray):
        raise TypeError(f"Unsupported type {type(value)}: a host array mixed with device arrays")
    if isinstance(value, tuple):
        return tuple(_unwrap(v) for v in value)
    return value


def _wrap(value: Any, device: int | None = None) -> Any:
    if isinstance(value, np.generic):  # CuPy reductions return 0-d device arrays
        value = np.asarray(value)
    if isinstance(value, np.ndarray):
        return ndarray(value, current_device() if device is None else device)
    return value


class ndarray:
    """A device array: host memory underneath, but no implicit way to reach it."""

    __module__ = "cupy._fake"  # what nccl.is_cupy_array recognises
    __array_ufunc__ = None  # numpy ufuncs and ndarray operators refuse it

    def __init__(self, host: np.ndarray, device: int) -> None:
        self._host = host
        self._device = device

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse("__array__")

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        raise _refuse(f"numpy.{func.__name__}")

    def __repr__(self) -> str:
        return f"fake_cupy.ndarray(device={self._device}, shape={self.shape}, dtype={self.dtype})"

    # -- attributes NCCL, the reducer and the example read --
    shape = property(lambda self: self._host.shape)
    dtype = property(lambda self: self._host.dtype)
    size = property(lambda self: self._host.size)
    nbytes = property(lambda self: self._host.nbytes)
    ndim = property(lambda self: self._host.ndim)
    flags = property(lambda self: self._host.flags)
    T = property(lambda self: ndarray(self._host.T, self._device))

    @property
    def data(self) -> Any:
        return SimpleNamespace(ptr=self._host.ctypes.data)

    @property
    def device(self) -> Any:
        return SimpleNamespace(id=self._device)

    def __len__(self) -> int:
        return len(self._host)

    def __float__(self) -> float:
        return float(self._host)

    def __int__(self) -> int:
        return int(self._host)

    def __getitem__(self, key: Any) -> ndarray:
        return ndarray(self._host[_unwrap(key)], self._device)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._host[_unwrap(key)] = _unwrap(value)

    def get(self) -> np.ndarray:
        counts["asnumpy"] += 1
        return self._host.copy()

    def astype(self, dtype: Any, copy: bool = True) -> ndarray:
        return ndarray(self._host.astype(dtype, copy=copy), self._device)

    def sum(self, axis: Any = None) -> ndarray:
        return _wrap(self._host.sum(axis=axis), self._device)  # type: ignore[no-any-return]

    def reshape(self, *shape: Any) -> ndarray:
        return ndarray(self._host.reshape(*shape), self._device)

    def copy(self) -> ndarray:
        return ndarray(self._host.copy(), self._device)

    def _binary(self, other: Any, op: Callable[[Any, Any], Any], reflected: bool) -> Any:
        if isinstance(other, ndarray) and other._device != self._device:
            raise ValueError(f"arrays on devices {self._device} and {other._device}")
        a, b = self._host, _unwrap(other)
        return _wrap(op(b, a) if reflected else op(a, b), self._device)

    def _inplace(self, other: Any, op: Callable[[Any, Any], Any]) -> ndarray:
        op(self._host, _unwrap(other))
        return self

    def __add__(self, o: Any) -> Any:
        return self._binary(o, operator.add, False)

    def __radd__(self, o: Any) -> Any:
        return self._binary(o, operator.add, True)

    def __sub__(self, o: Any) -> Any:
        return self._binary(o, operator.sub, False)

    def __rsub__(self, o: Any) -> Any:
        return self._binary(o, operator.sub, True)

    def __mul__(self, o: Any) -> Any:
        return self._binary(o, operator.mul, False)

    def __rmul__(self, o: Any) -> Any:
        return self._binary(o, operator.mul, True)

    def __truediv__(self, o: Any) -> Any:
        return self._binary(o, operator.truediv, False)

    def __rtruediv__(self, o: Any) -> Any:
        return self._binary(o, operator.truediv, True)

    def __matmul__(self, o: Any) -> Any:
        return self._binary(o, operator.matmul, False)

    def __pow__(self, o: Any) -> Any:
        return self._binary(o, operator.pow, False)

    def __neg__(self) -> ndarray:
        return ndarray(-self._host, self._device)

    def __iadd__(self, o: Any) -> ndarray:
        return self._inplace(o, operator.iadd)

    def __isub__(self, o: Any) -> ndarray:
        return self._inplace(o, operator.isub)

    def __itruediv__(self, o: Any) -> ndarray:
        return self._inplace(o, operator.itruediv)

    def __ifloordiv__(self, o: Any) -> ndarray:
        return self._inplace(o, operator.ifloordiv)


def _lift(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A numpy function as a CuPy one: device arrays in, device arrays out."""

    def call(*args: Any, **kwargs: Any) -> Any:
        out = kwargs.get("out")
        result = fn(*(_unwrap(a) for a in args), **{k: _unwrap(v) for k, v in kwargs.items()})
        return out if out is not None else _wrap(result)

    return call


def asarray(value: Any, dtype: Any = None) -> ndarray:
    """Host to device: a copy, as on a real GPU."""
    if isinstance(value, ndarray):
        return value if dtype is None else value.astype(dtype)
    counts["asarray"] += 1
    return ndarray(np.array(value, dtype=dtype, copy=True), current_device())


def asnumpy(value: Any) -> np.ndarray:
    if isinstance(value, ndarray):
        return value.get()
    return np.asarray(value)


def get_array_module(*args: Any) -> Any:
    import sys

    return sys.modules[__name__] if any(isinstance(a, ndarray) for a in args) else np


tanh = _lift(np.tanh)
mean = _lift(np.mean)
max = _lift(np.max)
abs = _lift(np.abs)
divide = _lift(np.divide)
zeros = _lift(np.zeros)
ones = _lift(np.ones)
empty = _lift(np.empty)
zeros_like = _lift(np.zeros_like)
ascontiguousarray = _lift(np.ascontiguousarray)
array = asarray
__version__ = "14.0.0-fake"


# -- cupy.cuda ---------------------------------------------------------------


class Device:
    def __init__(self, device: int = 0) -> None:
        self.id = device
        self._saved: list[int] = []

    def use(self) -> None:
        _state.device = self.id

    def __enter__(self) -> Device:
        self._saved.append(current_device())
        _state.device = self.id
        return self

    def __exit__(self, *exc: object) -> None:
        _state.device = self._saved.pop()


class Stream:
    def __init__(self, non_blocking: bool = False) -> None:
        self.ptr = id(self)

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


_NULL_STREAM = Stream()


class Event:
    done = True

    def __init__(self, disable_timing: bool = False) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass


class NcclError(RuntimeError):
    status = 0


class CUDARuntimeError(RuntimeError):
    pass


class NcclCommunicator:
    """One rank alone: every collective leaves its buffer as it is."""

    def __init__(self, world_size: int, unique_id: Any, rank: int) -> None:
        if (world_size, rank) != (1, 0):
            raise NcclError("the fake NCCL serves a world of one rank")

    def allReduce(self, *args: Any) -> None:
        pass

    def broadcast(self, *args: Any) -> None:
        pass

    def check_async_error(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def destroy(self) -> None:
        pass


device_count = 1
cuda = SimpleNamespace(
    Device=Device,
    Stream=Stream,
    Event=Event,
    get_current_stream=lambda: _NULL_STREAM,
    runtime=SimpleNamespace(getDeviceCount=lambda: device_count, CUDARuntimeError=CUDARuntimeError),
    nccl=SimpleNamespace(
        available=True,
        NcclError=NcclError,
        NcclCommunicator=NcclCommunicator,
        get_version=lambda: 22000,
        get_unique_id=lambda: UNIQUE_ID,
    ),
)


def module() -> Any:
    import sys

    return sys.modules[__name__]


def install(monkeypatch: Any) -> Any:
    """Make ``nccl._import_cupy`` return this module for one test."""
    from rendezvousd.trainer import nccl

    monkeypatch.setattr(nccl, "_import_cupy", module)
    return module()


def install_globally() -> None:
    """For a worker process: every later CuPy import through the seam gets the fake."""
    from rendezvousd.trainer import nccl

    nccl._import_cupy = module
