"""A fake ``cupy`` for the trainer's one CuPy seam, ``nccl._import_cupy``.

``make_cupy()`` builds one fake machine with:

* device arrays that refuse implicit host conversion, as CuPy's do
  (``arrays.py``): host and device meet only through ``asnumpy``/``asarray``;
* streams and events whose ordering is recorded in ``world.trace``, and a
  thread-local current stream and device (``streams.py``);
* NCCL with its error table, asynchronous errors, abort, init failures and
  races recorded (``nccl.py``), in ``cuda.nccl``.

``install(monkeypatch)`` puts a fresh one at the seam for one test;
``install_globally()`` does it for a worker process (a world of one rank).
Tests read results through ``asnumpy``; the fake's knobs are on ``.world``
(``hang``, ``async_error``, ``kernel_fault``, ``out_of_memory``, ``trace``, ``counts``) and ``.cuda.nccl``, and
``NOT_CUPY`` lists them: every other name the fake has is checked against the real
CuPy by tests/trainer/test_cupy_api.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from .arrays import functions, ndarray
from .nccl import FakeCudaError, FakeNccl, FakeNcclError, FakeOutOfMemoryError
from .streams import FakeEvent, FakeStream, World, current_stream, device_class

__all__ = [
    "NOT_CUPY",
    "FakeCudaError",
    "FakeEvent",
    "FakeNccl",
    "FakeNcclError",
    "FakeOutOfMemoryError",
    "FakeStream",
    "World",
    "current_stream",
    "device_array",
    "install",
    "install_globally",
    "make_cupy",
    "ndarray",
]

#: What the fake has that CuPy has not: knobs, records and helpers, as paths from the
#: module ("X()" is an instance of X, "X(name=)" a keyword of X's); the numpy hook the
#: fake sets to None refuses numpy ufuncs on device arrays, which CuPy would convert.
NOT_CUPY = frozenset(
    {
        "world",
        "counts",
        *(
            f"cuda.nccl.{name}"
            for name in [
                "world",
                "solo",
                "log",
                "version",
                "fail",
                "reject_bytes_id",
                "init_gate",
                "init_errors",
                "enqueue_gate",
                "connect_gate",
                "entered",
                "races",
                "inside",
                "ids",
                "comms",
                "names",
                "meet",
                "groups",
            ]
        ),
        "cuda.nccl.NcclCommunicator().handle",
        "cuda.nccl.NcclCommunicator().async_status",
        "cuda.nccl.NcclCommunicator().rank",
        "cuda.nccl.NcclCommunicator().group",
        "cuda.nccl.NcclCommunicator().connected",
        "cuda.nccl.NcclError().old_table",
        "cuda.nccl.NcclError(detail=)",
        "cuda.Stream().world",
        "cuda.Stream().non_blocking",
        "cuda.Stream().name",
        "cuda.Stream().work",
        "cuda.Stream().queue",
        "cuda.Event().world",
        "cuda.Event().name",
        "cuda.Event().covers",
        "ndarray().__array_ufunc__",
    }
)


def make_cupy(
    version: int = 21805,
    cupy_version: str = "14.0.0",
    old_table: bool = False,
    *,
    devices: int = 2,
    solo: bool = False,
    meet: bool = False,
) -> Any:
    """A fake ``cupy`` module; ``.world`` is its machine, ``.cuda.nccl`` its NCCL log;
    ``meet``: its NCCL's ranks are threads of this process whose collectives compute
    NCCL's results (``nccl._Group``)."""
    world = World()
    FakeNcclError.old_table = old_table
    return SimpleNamespace(
        __version__=cupy_version,
        world=world,
        counts=world.counts,
        **functions(world),
        cuda=SimpleNamespace(
            nccl=FakeNccl(world, version, solo=solo, meet=meet),
            Stream=lambda non_blocking=False: world.stream(non_blocking),
            Event=lambda disable_timing=False: FakeEvent(world, disable_timing),
            Device=device_class(world, devices),
            get_current_stream=lambda: current_stream(world),
            memory=SimpleNamespace(OutOfMemoryError=FakeOutOfMemoryError),
            runtime=SimpleNamespace(
                getDeviceCount=lambda: devices,
                CUDARuntimeError=FakeCudaError,
                eventQuery=world.event_query,
                getDeviceProperties=lambda device: {"computeMode": world.compute_mode},
                deviceSynchronize=lambda: world.contexts.add(world.device),
            ),
        ),
    )


def device_array(cupy: Any, values: Any, dtype: Any = np.float32) -> Any:
    """``values`` on ``cupy``'s current device, without counting it as a copy under test."""
    return ndarray(np.array(values, dtype=dtype), cupy.world.device, cupy.world)


def install(monkeypatch: Any, **options: Any) -> Any:
    """A fresh fake at the seam for one test; ``options`` as for ``make_cupy``."""
    from rendezvousd.trainer.comm import nccl

    fake = make_cupy(**options)
    monkeypatch.setattr(nccl, "_import_cupy", lambda: fake)
    # NcclCommunicator sets its default before init; put back what the test found.
    monkeypatch.delenv("NCCL_RUNTIME_CONNECT", raising=False)
    return fake


def install_globally() -> None:
    """For a worker process: every later CuPy import through the seam gets one fake,
    a machine with one GPU whose NCCL serves a world of one rank."""
    from rendezvousd.trainer.comm import nccl

    fake = make_cupy(devices=1, solo=True)
    nccl._import_cupy = lambda: fake
