"""One fake CUDA machine: its ordered trace, streams, events and current device.

After CuPy's ``cupy/cuda/stream.pyx``: ``record`` snapshots the work queued
on a stream, ``wait_event`` and every op are appended to one ordered ``trace``
with the stream they ran on; an event is ``done`` once the NCCL ops it covers
completed (``runtime.eventQuery`` on its ``ptr``: 0, 600 while pending, or the
context's sticky error, after which ``done`` stays False and records and waits
raise, as in CUDA); ``synchronize`` on unfinished work fails the test (it would block).
The current stream and the current device are thread-local, like CuPy's.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any


class World:
    """Shared state of one fake CUDA machine: the ordered trace, NCCL's knobs, copy counts."""

    def __init__(self) -> None:
        self.trace: list[tuple[Any, ...]] = []
        self.lock = threading.Lock()
        self.hang = False
        self.async_error: int | None = None
        # A CUDA status the next NCCL op's kernel faults with, and the context's sticky
        # error once one did: event queries return it, records and waits raise it.
        self.kernel_fault: int | None = None
        self.faulting: int | None = None  # a faulting kernel queued, not yet seen
        self.sticky_error: int | None = None
        self.out_of_memory = False  # every device allocation fails, as CuPy's pool does
        self.events: dict[int, FakeEvent] = {}  # by ptr, for runtime.eventQuery
        self.pending: list[list[bool]] = []  # completion flags of unfinished NCCL ops
        self.names = itertools.count()
        self.local = threading.local()  # .stack (current streams), .device
        self.streams: list[FakeStream] = []
        self.counts = {"asnumpy": 0, "asarray": 0}  # explicit host<->device copies
        self.compute_mode = 0  # cudaComputeModeDefault; 1 and 3 are the exclusive modes
        self.contexts: set[int] = set()  # devices whose context a call has made
        self.default_stream = self.stream(name="default")

    def stream(self, non_blocking: bool = False, name: str = "") -> FakeStream:
        made = FakeStream(self, non_blocking, name)
        self.streams.append(made)  # NCCL finds the stream an op names by its ptr
        return made

    def add(self, *entry: Any) -> None:
        with self.lock:
            self.trace.append(entry)

    def complete_all(self) -> None:
        for flag in self.pending:
            flag[0] = True
        self.pending.clear()

    def check_sticky(self) -> None:
        """What a CUDA call that returns the context's sticky error does in CuPy."""
        if self.sticky_error is not None:
            from .nccl import FakeCudaError

            raise FakeCudaError(self.sticky_error)

    def event_query(self, ptr: int) -> int:
        """``cudaEventQuery``: 0 done, 600 (cudaErrorNotReady) pending, or the sticky error."""
        if self.faulting is not None:  # the kernel has run by now, and faulted
            self.sticky_error, self.faulting = self.faulting, None
        if self.sticky_error is not None:
            return self.sticky_error
        return 0 if all(f[0] for f in self.events[ptr].covers) else 600

    def allocate(self, nbytes: int) -> None:
        if self.out_of_memory:
            from .nccl import FakeOutOfMemoryError

            raise FakeOutOfMemoryError(nbytes, 1 << 30)

    @property
    def device(self) -> int:
        return int(getattr(self.local, "device", 0))

    @device.setter
    def device(self, device: int) -> None:
        self.local.device = device


class FakeStream:
    def __init__(self, world: World, non_blocking: bool = False, name: str = "") -> None:
        self.world = world
        self.non_blocking = non_blocking
        self.name = name or f"stream{next(world.names)}"
        self.ptr = id(self)
        self.work: list[list[bool]] = []  # completion flags, in queue order

    def wait_event(self, event: FakeEvent) -> None:
        self.world.check_sticky()
        self.world.add("wait_event", self.name, event.name)
        self.queue(event.covers)

    def queue(self, flags: list[list[bool]]) -> None:
        # Finished work no longer matters; keeping it would grow without bound.
        self.work = [f for f in self.work if not f[0]] + [f for f in flags if not f[0]]

    def synchronize(self) -> None:
        self.world.check_sticky()
        assert all(f[0] for f in self.work), f"{self.name}.synchronize() would block forever"

    def __enter__(self) -> FakeStream:
        stack = getattr(self.world.local, "stack", None)
        if stack is None:
            stack = self.world.local.stack = []
        stack.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.world.local.stack.pop()

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class FakeEvent:
    def __init__(self, world: World, disable_timing: bool = False) -> None:
        self.world = world
        self.name = f"event{next(world.names)}"
        self.covers: list[list[bool]] = []
        self.ptr = id(self)
        world.events[self.ptr] = self

    def record(self, stream: FakeStream | None = None) -> None:
        self.world.check_sticky()
        stream = stream or current_stream(self.world)
        self.world.add("record", self.name, stream.name)
        self.covers = [f for f in stream.work if not f[0]]

    @property
    def done(self) -> bool:
        # CuPy's: cudaEventQuery == cudaSuccess, so False for ever after a sticky error.
        return self.world.event_query(self.ptr) == 0

    def synchronize(self) -> None:
        self.world.check_sticky()
        assert self.done, f"{self.name}.synchronize() would block forever"


def current_stream(world: World) -> FakeStream:
    stack = getattr(world.local, "stack", None)
    return stack[-1] if stack else world.default_stream  # type: ignore[no-any-return]


def device_class(world: World, devices: int) -> type:
    """``cupy.cuda.Device`` for ``world``: ``use()`` or ``with`` sets the current device;
    one beyond the ``devices`` the machine has raises cudaErrorInvalidDevice there, as
    cudaSetDevice does (CuPy's constructor checks nothing)."""

    def check(device: int) -> None:
        if not 0 <= device < devices:
            from .nccl import FakeCudaError

            raise FakeCudaError(101)

    class Device:
        def __init__(self, device: int = 0) -> None:
            self.id = device
            self._saved: list[int] = []

        def use(self) -> None:
            check(self.id)
            world.device = self.id

        def __enter__(self) -> Device:
            check(self.id)
            self._saved.append(world.device)
            world.device = self.id
            return self

        def __exit__(self, *exc: object) -> None:
            world.device = self._saved.pop()

    return Device
