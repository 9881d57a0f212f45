"""Fake CuPy device arrays: host memory underneath, but no implicit way to reach it.

Like real device arrays where it matters for correctness: they are not numpy
arrays, ``np.asarray``/``np.array``/numpy functions on them raise ``TypeError``
(CuPy: "Implicit conversion to a NumPy array is not allowed"), and arithmetic
refuses numpy operands. So code that runs against them provably crosses between
host and device only through ``asnumpy``/``asarray``/``get``, which copy (and
are counted in ``world.counts``). Element copies (``a[...] = b``) and ``divide``
are recorded in the world's trace with the stream they ran on; ``data.ptr`` is
the host address of the memory underneath.
"""

from __future__ import annotations

import ctypes
import operator
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np

from .streams import World, current_stream


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


def _wrap(value: Any, world: World, device: int | None = None) -> Any:
    if isinstance(value, np.generic):  # CuPy reductions return 0-d device arrays
        value = np.asarray(value)
    if isinstance(value, np.ndarray):
        return ndarray(value, world.device if device is None else device, world)
    return value


def _operator(op: Callable[[Any, Any], Any], reflected: bool = False) -> Any:
    """An arithmetic operator of ``ndarray``: both operands on one device, the result on it."""

    def method(self: ndarray, other: Any) -> Any:
        return self._binary(other, op, reflected)

    return method


def _in_place(op: Callable[[Any, Any], Any]) -> Any:
    """An in-place operator of ``ndarray`` (``+=``, ...): the memory underneath changes."""

    def method(self: ndarray, other: Any) -> ndarray:
        return self._inplace(other, op)

    return method


class ndarray:
    """A device array of one fake machine (``world``) on one device."""

    __module__ = "cupy._fake"  # what nccl.is_cupy_array recognises
    __array_ufunc__ = None  # numpy ufuncs and ndarray operators refuse it

    def __init__(self, host: np.ndarray, device: int, world: World) -> None:
        self._host = host
        self._device = device
        self._world = world

    def _same(self, host: np.ndarray) -> ndarray:
        return ndarray(host, self._device, self._world)

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
    strides = property(lambda self: self._host.strides)
    itemsize = property(lambda self: self._host.itemsize)
    ndim = property(lambda self: self._host.ndim)
    flags = property(lambda self: self._host.flags)
    T = property(lambda self: self._same(self._host.T))

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
        return self._same(self._host[_unwrap(key)])

    def __setitem__(self, key: Any, value: Any) -> None:
        self._world.add("copy", current_stream(self._world).name)
        self._host[_unwrap(key)] = _unwrap(value)

    def get(self) -> np.ndarray:
        self._world.counts["asnumpy"] += 1
        return self._host.copy()

    def astype(self, dtype: Any, copy: bool = True) -> ndarray:
        return self._same(self._host.astype(dtype, copy=copy))

    def sum(self, axis: Any = None) -> ndarray:
        return _wrap(self._host.sum(axis=axis), self._world, self._device)  # type: ignore[no-any-return]

    def reshape(self, *shape: Any) -> ndarray:
        return self._same(self._host.reshape(*shape))

    def copy(self) -> ndarray:
        return self._same(self._host.copy())

    def _binary(self, other: Any, op: Callable[[Any, Any], Any], reflected: bool) -> Any:
        if isinstance(other, ndarray) and other._device != self._device:
            raise ValueError(f"arrays on devices {self._device} and {other._device}")
        a, b = self._host, _unwrap(other)
        return _wrap(op(b, a) if reflected else op(a, b), self._world, self._device)

    def _inplace(self, other: Any, op: Callable[[Any, Any], Any]) -> ndarray:
        op(self._host, _unwrap(other))
        return self

    def __neg__(self) -> ndarray:
        return self._same(-self._host)

    __add__ = _operator(operator.add)
    __radd__ = _operator(operator.add, reflected=True)
    __sub__ = _operator(operator.sub)
    __rsub__ = _operator(operator.sub, reflected=True)
    __mul__ = _operator(operator.mul)
    __rmul__ = _operator(operator.mul, reflected=True)
    __truediv__ = _operator(operator.truediv)
    __rtruediv__ = _operator(operator.truediv, reflected=True)
    __matmul__ = _operator(operator.matmul)
    __pow__ = _operator(operator.pow)
    __iadd__ = _in_place(operator.iadd)
    __isub__ = _in_place(operator.isub)
    __itruediv__ = _in_place(operator.itruediv)
    __ifloordiv__ = _in_place(operator.ifloordiv)


def functions(world: World) -> dict[str, Any]:
    """The array half of a fake ``cupy`` module whose arrays live in ``world``."""

    def lift(fn: Callable[..., Any], traced: str = "") -> Callable[..., Any]:
        """A numpy function as a CuPy one: device arrays in, device arrays out."""

        def call(*args: Any, **kwargs: Any) -> Any:
            if traced:
                world.add(traced, current_stream(world).name)
            out = kwargs.get("out")
            result = fn(*(_unwrap(a) for a in args), **{k: _unwrap(v) for k, v in kwargs.items()})
            if out is not None:
                return out
            if isinstance(result, np.ndarray | np.generic):
                world.allocate(result.nbytes)  # a new device array: CuPy's pool may refuse
            return _wrap(result, world)

        return call

    def asarray(value: Any, dtype: Any = None) -> ndarray:
        """Host to device: a copy, as on a real GPU."""
        if isinstance(value, ndarray):
            return value if dtype is None else value.astype(dtype)
        host = np.array(value, dtype=dtype, copy=True)
        world.allocate(host.nbytes)
        world.counts["asarray"] += 1
        return ndarray(host, world.device, world)

    def concatenate(arrays: Any, axis: int = 0, out: Any = None) -> Any:
        world.add("copy", current_stream(world).name)
        result = np.concatenate([_unwrap(a) for a in arrays], axis=axis)
        if out is None:
            return _wrap(result, world)
        if out.shape != result.shape:
            raise ValueError("Output array is the wrong shape")
        out._host[...] = result
        return out

    class RawModule:
        """Compiles nothing: the one kernel our code builds (``nccl.py``'s scatter) is
        run on the host by its name, through the addresses its table holds."""

        def __init__(self, code: str = "", name_expressions: Any = None, **_: Any) -> None:
            self.names = list(name_expressions or [])

        def get_function(self, name: str) -> RawKernel:
            if name not in self.names:
                raise KeyError(name)
            return RawKernel(name)

    class RawKernel:
        WORDS = {
            "unsigned char": 1,
            "unsigned short": 2,
            "unsigned int": 4,
            "unsigned long long": 8,
        }

        def __init__(self, name: str) -> None:
            base, _, word = name.partition("<")
            if base != "rendezvousd_scatter":
                raise NotImplementedError(f"the fake runs no kernel {name}")
            self.itemsize = self.WORDS[word.rstrip(">")]

        def __call__(self, grid: Any, block: Any, args: Any) -> None:
            flat, pointers, starts, count, total = args
            world.add("copy", current_stream(world).name)
            size = self.itemsize
            assert flat._host.dtype.itemsize == size and flat.flags.c_contiguous
            ends = [*starts._host[1:count].tolist(), int(total)]
            for dst, start, end in zip(
                pointers._host.tolist(), starts._host.tolist(), ends, strict=True
            ):
                if end > start:
                    src = flat._host.ctypes.data + start * size
                    ctypes.memmove(dst, src, (end - start) * size)

    def asnumpy(value: Any) -> np.ndarray:
        if isinstance(value, ndarray):
            return value.get()
        return np.asarray(value)

    return {
        "ndarray": ndarray,
        "asarray": asarray,
        "array": asarray,
        "asnumpy": asnumpy,
        "concatenate": concatenate,
        "RawModule": RawModule,
        "tanh": lift(np.tanh),
        "mean": lift(np.mean),
        "max": lift(np.max),
        "abs": lift(np.abs),
        "divide": lift(np.divide, traced="divide"),
        "fmod": lift(np.fmod),
        "zeros": lift(np.zeros),
        "ones": lift(np.ones),
        "empty": lift(np.empty),
        "zeros_like": lift(np.zeros_like),
        "ascontiguousarray": lift(np.ascontiguousarray),
    }
