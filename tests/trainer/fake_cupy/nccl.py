"""Fake ``cupy.cuda.nccl``: what broke on GPUs, after CuPy's ``cupy_backends/cuda/libs/nccl.pyx``.

* NCCL ops complete at once unless ``world.hang`` is set; ``world.async_error``
  makes the next enqueued op never complete and ``check_async_error`` raise afterwards.
  Collectives leave the data as it is (a sum over one rank, or a test that checks
  calls rather than results).
* ``abort()`` zeroes the handle (later calls raise status 4, as NCCL does on a
  null communicator) and completes pending ops; a call into NCCL running
  while another thread aborts is recorded in ``races`` (a use-after-free on a GPU).
* ``NcclError(status)`` is worded with CuPy's name for the status (``STATUS_NAMES``)
  and raises ``KeyError(status)`` for a status CuPy cannot name, as CuPy does (7,
  ncclInProgress, in 14.2); with ``old_table`` that includes 6, like CuPy < 13.4.
* init can block on ``init_gate`` or fail with the errors queued in ``init_errors``;
  ``solo`` refuses any world but one rank (where leaving data as it is is right);
  every ``get_unique_id`` returns a fresh id.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

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


class FakeCudaError(RuntimeError):
    pass


class FakeNccl:
    NcclError = FakeNcclError
    available = True

    def __init__(self, world: World, version: int, solo: bool = False) -> None:
        self.world = world
        self.solo = solo
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
                    stream = next(s for s in fake.world.streams if s.ptr == args[-1])
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

    def get_unique_id(self) -> bytes:
        self.log.append(("get_unique_id",))
        n = next(self.ids)
        return bytes((n + i) % 255 + 1 for i in range(128))

    def get_version(self) -> int:
        return self.version

    def names(self) -> list[str]:
        return [entry[0] for entry in self.log]
