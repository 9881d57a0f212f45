"""A fake ``cupy`` for the one seam (``nccl._import_cupy``), modelling what broke on GPUs.

What it models, after CuPy's ``cupy_backends/cuda/libs/nccl.pyx`` and
``cupy/cuda/stream.pyx``:

* streams and events: ``record`` snapshots the work queued on a stream,
  ``wait_event`` and every op are appended to one ordered ``trace`` with the
  stream they ran on; an event is ``done`` once the NCCL ops it covers
  completed; ``synchronize`` on unfinished work fails the test (it would block).
  The current stream is thread-local, like CuPy's, and ``with stream:`` sets it.
* NCCL ops complete at once unless ``hang`` is set; ``async_error`` makes the
  next enqueued op never complete and ``check_async_error`` raise afterwards.
* ``abort()`` zeroes the handle (later calls raise status 4, as NCCL does on a
  null communicator) and completes pending ops; a call into NCCL running
  while another thread aborts is recorded in ``races`` (a use-after-free on a GPU).
* ``NcclError(status)`` with ``old_table`` raises ``KeyError(6)`` for status 6,
  like CuPy < 13.4.
* init can block on ``init_gate`` or fail with the errors queued in ``init_errors``;
  every ``get_unique_id`` returns a fresh id.
"""

from __future__ import annotations

import itertools
import threading
from types import SimpleNamespace
from typing import Any

import numpy as np

_tls = threading.local()


class FakeNcclError(RuntimeError):
    old_table = False

    def __init__(self, status: int) -> None:
        if status == 6 and FakeNcclError.old_table:
            raise KeyError(6)  # CuPy < 13.4: ERROR2 has no entry for ncclRemoteError
        self.status = status
        super().__init__(f"NCCL_ERROR_{status}: fake")


class FakeCudaError(RuntimeError):
    pass


class World:
    """Shared state of one fake CUDA machine: the ordered trace and NCCL's knobs."""

    def __init__(self) -> None:
        self.trace: list[tuple[Any, ...]] = []
        self.lock = threading.Lock()
        self.hang = False
        self.async_error: int | None = None
        self.pending: list[list[bool]] = []  # completion flags of unfinished NCCL ops
        self.names = itertools.count()

    def add(self, *entry: Any) -> None:
        with self.lock:
            self.trace.append(entry)

    def complete_all(self) -> None:
        for flag in self.pending:
            flag[0] = True
        self.pending.clear()


class FakeStream:
    def __init__(self, world: World, non_blocking: bool = False, name: str = "") -> None:
        self.world = world
        self.non_blocking = non_blocking
        self.name = name or f"stream{next(world.names)}"
        self.ptr = id(self)
        self.work: list[list[bool]] = []  # completion flags, in queue order

    def wait_event(self, event: FakeEvent) -> None:
        self.world.add("wait_event", self.name, event.name)
        self.queue(event.covers)

    def queue(self, flags: list[list[bool]]) -> None:
        # Finished work no longer matters; keeping it would grow without bound.
        self.work = [f for f in self.work if not f[0]] + [f for f in flags if not f[0]]

    def synchronize(self) -> None:
        assert all(f[0] for f in self.work), f"{self.name}.synchronize() would block forever"

    def __enter__(self) -> FakeStream:
        stack = getattr(_tls, "stack", None)
        if stack is None:
            stack = _tls.stack = []
        stack.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _tls.stack.pop()

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class FakeEvent:
    def __init__(self, world: World, disable_timing: bool = False) -> None:
        self.world = world
        self.name = f"event{next(world.names)}"
        self.covers: list[list[bool]] = []

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or current_stream(self.world)
        self.world.add("record", self.name, stream.name)
        self.covers = [f for f in stream.work if not f[0]]

    @property
    def done(self) -> bool:
        return all(f[0] for f in self.covers)

    def synchronize(self) -> None:
        assert self.done, f"{self.name}.synchronize() would block forever"


def current_stream(world: World) -> FakeStream:
    stack = getattr(_tls, "stack", None)
    if stack:
        return stack[-1]  # type: ignore[no-any-return]
    default: FakeStream = world.default_stream  # type: ignore[attr-defined]
    return default


class FakeArray(np.ndarray):
    __module__ = "cupy._fake"
    world: World | None = None

    @property
    def data(self) -> Any:  # type: ignore[override]
        return SimpleNamespace(ptr=self.ctypes.data)

    @property
    def device(self) -> Any:  # type: ignore[override]
        return SimpleNamespace(id=0)

    def __setitem__(self, key: Any, value: Any) -> None:
        if FakeArray.world is not None:
            FakeArray.world.add("copy", current_stream(FakeArray.world).name)
        super().__setitem__(key, value)


class FakeNccl:
    NcclError = FakeNcclError

    def __init__(self, world: World, version: int) -> None:
        self.world = world
        self.log: list[tuple[Any, ...]] = []
        self.version = version
        self.fail: BaseException | None = None
        self.reject_bytes_id = False
        self.init_gate: threading.Event | None = None
        self.init_errors: list[BaseException] = []
        self.enqueue_gate: threading.Event | None = None
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
                if fake.init_gate is not None:
                    fake.init_gate.wait()
                if fake.init_errors:
                    raise fake.init_errors.pop(0)
                if fake.fail is not None:
                    raise fake.fail
                self.handle = 1
                self.async_status: int | None = None
                fake.comms.append(self)

            def _enter(self, name: str, *args: Any) -> None:
                fake.log.append((name, *args))
                fake.inside += 1

            def _leave(self) -> None:
                fake.inside -= 1

            def _enqueue(self, name: str, *args: Any) -> None:
                self._enter(name, *args)
                try:
                    if fake.enqueue_gate is not None:
                        fake.entered.set()
                        fake.enqueue_gate.wait(10)
                    if not self.handle:
                        raise FakeNcclError(4)  # ncclInvalidArgument: null communicator
                    if fake.fail is not None:
                        raise fake.fail
                    stream = next(s for s in fake.streams if s.ptr == args[-1])
                    fake.world.add(name, stream.name)
                    flag = [not fake.world.hang and fake.world.async_error is None]
                    if fake.world.async_error is not None:
                        self.async_status = fake.world.async_error
                    if not flag[0]:
                        fake.world.pending.append(flag)
                    stream.queue([flag])
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

    streams: list[FakeStream]

    def get_unique_id(self) -> bytes:
        self.log.append(("get_unique_id",))
        n = next(self.ids)
        return bytes((n + i) % 255 + 1 for i in range(128))

    def get_version(self) -> int:
        return self.version

    def names(self) -> list[str]:
        return [entry[0] for entry in self.log]


def make_cupy(version: int = 21805, cupy_version: str = "14.0.0", old_table: bool = False) -> Any:
    """A fake ``cupy`` module; ``.world`` is its trace, ``.cuda.nccl`` its NCCL log."""
    world = World()
    FakeNcclError.old_table = old_table
    fake_nccl = FakeNccl(world, version)
    fake_nccl.streams = []
    FakeArray.world = world

    def stream(non_blocking: bool = False) -> FakeStream:
        made = FakeStream(world, non_blocking)
        fake_nccl.streams.append(made)
        return made

    world.default_stream = stream()  # type: ignore[attr-defined]
    world.default_stream.name = "default"  # type: ignore[attr-defined]

    def wrap(array: Any) -> Any:
        return np.asarray(array).view(FakeArray)

    def divide(a: Any, b: Any, out: Any) -> Any:
        world.add("divide", current_stream(world).name)
        return np.divide(np.asarray(a), b, out=np.asarray(out))

    class Device:
        def __init__(self, device: int = 0) -> None:
            self.id = device

        def __enter__(self) -> Device:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    return SimpleNamespace(
        __version__=cupy_version,
        world=world,
        ndarray=FakeArray,
        zeros=lambda n, dtype: wrap(np.zeros(n, dtype)),
        empty=lambda n, dtype: wrap(np.empty(n, dtype)),
        divide=divide,
        cuda=SimpleNamespace(
            nccl=fake_nccl,
            Stream=stream,
            Event=lambda disable_timing=False: FakeEvent(world, disable_timing),
            Device=Device,
            get_current_stream=lambda: current_stream(world),
            runtime=SimpleNamespace(getDeviceCount=lambda: 2, CUDARuntimeError=FakeCudaError),
        ),
    )


def device_array(values: Any, dtype: Any = np.float32) -> Any:
    return np.array(values, dtype=dtype).view(FakeArray)
