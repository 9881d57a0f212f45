"""NcclCommunicator against a fake ``cupy`` installed at the one seam, ``_import_cupy``.

The fake records every NCCL call so the tests can pin the exact arguments
CuPy's bindings receive; fake arrays are numpy arrays whose ``data.ptr`` is
their host address, so pointers in the log can be checked against them.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from rendezvousd.trainer import nccl
from rendezvousd.trainer.bucketing import BucketedAllReducer
from rendezvousd.trainer.communicator import Communicator, ReduceOp
from rendezvousd.trainer.errors import (
    CollectiveArgumentError,
    CommunicatorAborted,
    CommunicatorError,
    CommunicatorTimeout,
    ConfigError,
    PeerConnectionError,
)

UID = bytes(range(1, 129))


class FakeArray(np.ndarray):
    __module__ = "cupy._fake"

    @property
    def data(self) -> Any:  # type: ignore[override]
        return SimpleNamespace(ptr=self.ctypes.data)

    @property
    def device(self) -> Any:  # type: ignore[override]
        return SimpleNamespace(id=0)


def device_array(values: Any, dtype: Any = np.float32) -> Any:
    return np.array(values, dtype=dtype).view(FakeArray)


class FakeNcclError(RuntimeError):
    def __init__(self, status: int) -> None:
        self.status = status
        super().__init__(f"NCCL_ERROR_{status}: fake")


class FakeCudaError(RuntimeError):
    pass


class FakeStream:
    current: dict[int, FakeStream] = {}

    def __init__(self, non_blocking: bool = False, ptr: int = 0) -> None:
        self.ptr = ptr or id(self)
        self.non_blocking = non_blocking
        self.waited: list[Any] = []
        self._saved: list[FakeStream] = []

    def wait_event(self, event: Any) -> None:
        self.waited.append(event)

    def synchronize(self) -> None:
        pass

    def __enter__(self) -> FakeStream:
        self._saved.append(current_stream())
        FakeStream.current[threading.get_ident()] = self
        return self

    def __exit__(self, *exc: object) -> None:
        FakeStream.current[threading.get_ident()] = self._saved.pop()


NULL_STREAM = FakeStream(ptr=1)


def current_stream() -> FakeStream:
    return FakeStream.current.get(threading.get_ident(), NULL_STREAM)


class FakeEvent:
    def __init__(self, disable_timing: bool = False) -> None:
        self.done = True
        self.recorded_on: list[Any] = []

    def record(self, stream: Any = None) -> None:
        self.recorded_on.append(stream)


class FakeDevice:
    def __init__(self, device: int) -> None:
        self.id = device

    def __enter__(self) -> FakeDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class FakeNccl:
    NcclError = FakeNcclError

    def __init__(self, version: int, unique_id: Any) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.version = version
        self.unique_id = unique_id
        self.fail: BaseException | None = None
        self.reject_bytes_id = False
        fake = self

        class Comm:
            def __init__(self, ndev: int, comm_id: Any, rank: int) -> None:
                if fake.reject_bytes_id and isinstance(comm_id, bytes):
                    raise TypeError("Argument 'commId' has incorrect type")
                fake.log.append(("NcclCommunicator", ndev, comm_id, rank))
                if fake.fail is not None:
                    raise fake.fail

            def allReduce(self, *args: Any) -> None:
                fake.call("allReduce", *args)

            def broadcast(self, *args: Any) -> None:
                fake.call("broadcast", *args)

            def check_async_error(self) -> None:
                fake.call("check_async_error")

            def abort(self) -> None:
                fake.log.append(("abort",))

            def destroy(self) -> None:
                fake.log.append(("destroy",))

        self.NcclCommunicator = Comm

    def call(self, name: str, *args: Any) -> None:
        self.log.append((name, *args))
        if self.fail is not None:
            raise self.fail

    def get_unique_id(self) -> Any:
        self.log.append(("get_unique_id",))
        return self.unique_id

    def get_version(self) -> int:
        return self.version

    def names(self) -> list[str]:
        return [entry[0] for entry in self.log]


def make_cupy(version: int = 21805, cupy_version: str = "14.0.0", unique_id: Any = UID) -> Any:
    fake_nccl = FakeNccl(version, unique_id)

    def wrap(array: Any) -> Any:
        return np.asarray(array).view(FakeArray)

    return SimpleNamespace(
        __version__=cupy_version,
        ndarray=FakeArray,
        zeros=lambda n, dtype: wrap(np.zeros(n, dtype)),
        empty=lambda n, dtype: wrap(np.empty(n, dtype)),
        divide=lambda a, b, out: np.divide(a, b, out=out),
        cuda=SimpleNamespace(
            nccl=fake_nccl,
            Stream=FakeStream,
            Event=FakeEvent,
            Device=FakeDevice,
            get_current_stream=current_stream,
            runtime=SimpleNamespace(getDeviceCount=lambda: 2, CUDARuntimeError=FakeCudaError),
        ),
    )


@pytest.fixture
def cupy(monkeypatch: pytest.MonkeyPatch) -> Any:
    fake = make_cupy()
    monkeypatch.setattr(nccl, "_import_cupy", lambda: fake)
    return fake


def log_of(cp: Any) -> FakeNccl:
    fake: FakeNccl = cp.cuda.nccl
    return fake


# --- ids ---------------------------------------------------------------------


def test_unique_id_normalisation_both_directions() -> None:
    assert nccl.unique_id_to_bytes(UID) == UID
    high = bytes(range(128, 256))
    as_tuple = nccl.unique_id_to_tuple(high)
    assert as_tuple == tuple(range(-128, 0))  # C chars are signed
    assert nccl.unique_id_to_bytes(as_tuple) == high
    assert nccl.unique_id_to_bytes(list(as_tuple)) == high
    assert nccl.unique_id_to_bytes(tuple(high)) == high  # unsigned values too
    assert nccl.unique_id_to_tuple(UID) == (*range(1, 128), -128)


@pytest.mark.parametrize(
    "bad",
    [bytes(128), b"\x01" * 127, b"\x01" * 129, (0,) * 128, (1,) * 127, (300,) + (1,) * 127],
)
def test_bad_unique_ids_are_rejected(bad: Any) -> None:
    with pytest.raises(CollectiveArgumentError):
        nccl.unique_id_to_bytes(bad)


def test_unique_id_of_wrong_type_is_rejected() -> None:
    with pytest.raises(CollectiveArgumentError, match="not str"):
        nccl.unique_id_to_bytes("x" * 128)


def test_only_rank_zero_creates_the_id(cupy: Any) -> None:
    published: list[bytes] = []
    assert nccl.exchange_unique_id(0, published.append, lambda: b"") == UID
    assert published == [UID] and log_of(cupy).names() == ["get_unique_id"]
    log_of(cupy).log.clear()
    assert nccl.exchange_unique_id(1, published.append, lambda: UID) == UID
    nccl.NcclCommunicator(1, 2, UID, 0)
    assert "get_unique_id" not in log_of(cupy).names()


@pytest.mark.parametrize("cupy_version", ["13.6.0", "14.0.0"])
def test_create_unique_id_normalises_old_and_new_cupy(
    monkeypatch: pytest.MonkeyPatch, cupy_version: str
) -> None:
    raw: Any = nccl.unique_id_to_tuple(UID) if cupy_version < "14" else UID
    fake = make_cupy(cupy_version=cupy_version, unique_id=raw)
    monkeypatch.setattr(nccl, "_import_cupy", lambda: fake)
    assert nccl.create_unique_id() == UID


@pytest.mark.parametrize(
    ("cupy_version", "expected"), [("13.6.0", tuple), ("14.0.0", bytes), ("15.1.0", bytes)]
)
def test_constructor_passes_the_id_in_cupys_form(
    monkeypatch: pytest.MonkeyPatch, cupy_version: str, expected: type
) -> None:
    fake = make_cupy(cupy_version=cupy_version)
    monkeypatch.setattr(nccl, "_import_cupy", lambda: fake)
    nccl.NcclCommunicator(3, 4, UID, 0)
    (entry,) = log_of(fake).log
    assert entry[0] == "NcclCommunicator" and entry[1] == 4 and entry[3] == 3
    assert type(entry[2]) is expected and nccl.unique_id_to_bytes(entry[2]) == UID


def test_constructor_falls_back_to_tuple_when_bytes_are_refused(cupy: Any) -> None:
    log_of(cupy).reject_bytes_id = True
    nccl.NcclCommunicator(0, 1, UID, 0)
    assert isinstance(log_of(cupy).log[0][2], tuple)


def test_id_never_in_repr_errors_or_state(cupy: Any) -> None:
    comm = nccl.NcclCommunicator(1, 2, UID, 0)
    assert isinstance(comm, Communicator) and comm.backend == "nccl"
    text = repr(comm)
    assert "rank=1" in text and UID.hex()[:8] not in text and "\\x01\\x02" not in text
    for value in vars(comm).values():
        assert not (isinstance(value, bytes | bytearray) and value == UID)
        assert not (isinstance(value, tuple) and len(value) == 128)
    log_of(cupy).fail = FakeNcclError(3)
    with pytest.raises(CommunicatorError) as info:
        comm.all_reduce(device_array([1.0]))
    assert UID.hex()[:8] not in str(info.value) and "\\x01\\x02" not in str(info.value)


# --- mapping tables ----------------------------------------------------------


def test_dtype_table() -> None:
    table = {
        np.int8: 0,
        np.uint8: 1,
        np.int32: 2,
        np.uint32: 3,
        np.int64: 4,
        np.uint64: 5,
        np.float16: 6,
        np.float32: 7,
        np.float64: 8,
    }
    for dtype, code in table.items():
        assert nccl.nccl_dtype(np.dtype(dtype), 21805) == code
    assert nccl.nccl_dtype("bfloat16", 21003) == 9
    with pytest.raises(CollectiveArgumentError, match=r"2\.10\.3"):
        nccl.nccl_dtype("bfloat16", 21002)
    for bad in (np.int16, np.bool_, np.complex64):
        with pytest.raises(CollectiveArgumentError, match="cannot reduce"):
            nccl.nccl_dtype(np.dtype(bad), 21805)


def test_op_table_and_avg_version_gate() -> None:
    assert nccl.nccl_op(ReduceOp.SUM, 21805) == (0, False)
    assert nccl.nccl_op(ReduceOp.MAX, 21805) == (2, False)
    assert nccl.nccl_op(ReduceOp.MIN, 21805) == (3, False)
    assert nccl.nccl_op(ReduceOp.AVG, 21003) == (4, False)
    assert nccl.nccl_op(ReduceOp.AVG, 21002) == (0, True)


# --- collectives ---------------------------------------------------------------


def test_all_reduce_call_sequence(cupy: Any) -> None:
    comm = nccl.NcclCommunicator(0, 2, UID, 0)
    caller = current_stream()
    array = device_array(np.arange(8))
    comm.all_reduce(array, ReduceOp.AVG)
    stream = comm._stream
    assert stream.non_blocking and stream is not caller
    entry = log_of(cupy).log[-1]
    assert entry == ("allReduce", array.ctypes.data, array.ctypes.data, 8, 7, 4, stream.ptr)
    assert stream.waited == [comm._ready] and caller.waited[-1] is comm._done
    assert comm._ready.recorded_on[-1] is caller and comm._done.recorded_on[-1] is stream
    comm.broadcast(array, root=1)
    assert log_of(cupy).log[-1] == ("broadcast", *entry[1:3], 8, 7, 1, stream.ptr)
    comm.all_reduce(device_array([], np.float32))  # empty: no NCCL call
    assert log_of(cupy).log[-1][0] == "broadcast"


def test_avg_falls_back_to_sum_and_divide_on_old_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = make_cupy(version=20804)
    monkeypatch.setattr(nccl, "_import_cupy", lambda: fake)
    comm = nccl.NcclCommunicator(0, 4, UID, 0)
    floats = device_array([4.0, 8.0, 2.0])
    comm.all_reduce(floats, ReduceOp.AVG)
    assert log_of(fake).log[-1][5] == 0  # SUM; the fake leaves the sum unchanged
    np.testing.assert_array_equal(floats, [1.0, 2.0, 0.5])
    ints = device_array([9, 8], np.int64)
    comm.all_reduce(ints, ReduceOp.AVG)
    np.testing.assert_array_equal(ints, [2, 2])


def test_bad_buffers_are_refused_before_nccl(cupy: Any) -> None:
    comm = nccl.NcclCommunicator(0, 1, UID, 0)
    # The same error the cpu backend raises for the same misuse.
    with pytest.raises(CollectiveArgumentError, match="rank 0: NCCL all_reduce needs a CuPy"):
        comm.all_reduce(np.zeros(3, np.float32))
    with pytest.raises(CollectiveArgumentError, match="contiguous"):
        comm.all_reduce(device_array(np.zeros((4, 4)))[:, ::2])
    with pytest.raises(CollectiveArgumentError, match="root"):
        comm.broadcast(device_array([1.0]), root=1)
    with pytest.raises(CollectiveArgumentError, match="cannot reduce dtype int16"):
        comm.all_reduce(device_array([1, 2], np.int16))
    assert "allReduce" not in log_of(cupy).names()


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (FakeNcclError(6), PeerConnectionError),
        (FakeNcclError(2), PeerConnectionError),
        (FakeNcclError(3), CommunicatorError),
        (FakeCudaError("cudaErrorIllegalAddress"), CommunicatorError),
    ],
)
def test_errors_are_mapped_with_rank_and_operation(
    cupy: Any, error: BaseException, kind: type[BaseException]
) -> None:
    comm = nccl.NcclCommunicator(1, 2, UID, 0)
    log_of(cupy).fail = error
    with pytest.raises(kind, match=r"rank 1/2: NCCL all_reduce") as info:
        comm.all_reduce(device_array([1.0]))
    assert info.value.__cause__ is error


def test_init_failure_is_mapped(cupy: Any) -> None:
    log_of(cupy).fail = FakeNcclError(6)
    with pytest.raises(PeerConnectionError, match="rank 0/2: NCCL init"):
        nccl.NcclCommunicator(0, 2, UID, 0)


def test_abort_then_collective_raises_aborted(cupy: Any) -> None:
    comm = nccl.NcclCommunicator(0, 2, UID, 0)
    comm.abort("peer 1 failed")
    comm.abort("again")
    assert log_of(cupy).names().count("abort") == 1
    for call in (lambda: comm.all_reduce(device_array([1.0])), comm.barrier):
        with pytest.raises(CommunicatorAborted, match="peer 1 failed"):
            call()
    comm.close()
    assert "destroy" not in log_of(cupy).names() and "aborted" in repr(comm)


def test_abort_from_another_thread_ends_a_barrier(cupy: Any) -> None:
    comm = nccl.NcclCommunicator(0, 2, UID, 0)
    comm._done.done = False  # the barrier's all-reduce never completes
    threading.Timer(0.05, comm.abort, args=("peer 1 died",)).start()
    started = time.monotonic()
    with pytest.raises(CommunicatorAborted, match="peer 1 died"):
        comm.barrier()
    assert time.monotonic() - started < 5
    assert "check_async_error" in log_of(cupy).names()


def test_barrier_timeout_aborts(cupy: Any) -> None:
    comm = nccl.NcclCommunicator(0, 2, UID, 0, timeout=0.05)
    comm._done.done = False
    with pytest.raises(CommunicatorTimeout, match="barrier"):
        comm.barrier()
    assert log_of(cupy).names()[-1] == "abort"
    with pytest.raises(CommunicatorAborted):
        comm.barrier()


def test_barrier_and_close(cupy: Any) -> None:
    comm = nccl.NcclCommunicator(0, 1, UID, 0)
    comm.barrier()
    assert log_of(cupy).names()[-1] == "allReduce"
    comm.close()
    comm.close()
    assert log_of(cupy).names().count("destroy") == 1
    with pytest.raises(CommunicatorError, match="closed"):
        comm.all_reduce(device_array([1.0]))


# --- availability and the import boundary -------------------------------------------


def test_without_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing() -> Any:
        raise ImportError("No module named 'cupy'")

    monkeypatch.setattr(nccl, "_import_cupy", missing)
    assert not nccl.cupy_available() and nccl.device_count() == 0
    with pytest.raises(ConfigError, match="CuPy"):
        nccl.NcclCommunicator(0, 1, UID, 0)


def test_device_count(cupy: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert nccl.cupy_available() and nccl.device_count() == 2

    def no_driver() -> int:
        raise FakeCudaError("cudaErrorNoDevice")

    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", no_driver)
    assert nccl.device_count() == 0


def test_cupy_is_imported_only_in_nccl_py() -> None:
    trainer = Path(nccl.__file__).parent
    pattern = re.compile(r"^\s*(import cupy|from cupy)", re.MULTILINE)
    importers = sorted(p.name for p in trainer.glob("*.py") if pattern.search(p.read_text()))
    assert importers == ["nccl.py"]
    code = (
        "import sys, rendezvousd.trainer.bucketing, rendezvousd.trainer.nccl; "
        "assert not any(m == 'cupy' or m.startswith('cupy.') for m in sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --- bucketing on (fake) CuPy arrays ---------------------------------------------


def test_bucketed_reducer_on_cupy_arrays_uses_the_callers_stream(cupy: Any) -> None:
    comm = nccl.NcclCommunicator(0, 1, UID, 0)
    base = device_array(np.arange(24).reshape(4, 6))
    grads = [device_array(np.arange(5)), base[:, ::2], device_array(np.ones(300))]
    expected = [np.asarray(g).copy() for g in grads]
    user_stream = FakeStream(non_blocking=True)
    seen: list[FakeStream] = []
    real_all_reduce = comm.all_reduce

    def spy(array: Any, op: ReduceOp = ReduceOp.SUM) -> None:
        assert isinstance(array, FakeArray)
        seen.append(current_stream())
        real_all_reduce(array, op)

    comm.all_reduce = spy  # type: ignore[method-assign]
    with (
        user_stream,
        BucketedAllReducer(grads, comm, cap_bytes=1024, first_bucket_bytes=None) as reducer,
    ):
        assert len(reducer.buckets) == 2
        reducer.all_reduce_all()
    assert seen == [user_stream, user_stream]  # the worker thread re-entered it
    counts = [e[3] for e in log_of(cupy).log if e[0] == "allReduce"]
    assert counts == [300, 5 + 12]
    for got, want in zip(grads, expected, strict=True):
        np.testing.assert_array_equal(got, want)


def test_close_drains_abortably(cupy: Any) -> None:
    comm = nccl.NcclCommunicator(0, 2, UID, 0)
    comm._done.done = False  # work in flight that never finishes (a dead peer)
    threading.Timer(0.05, comm.abort, args=("peer 1 died",)).start()
    comm.close()  # returns once abort() lands, without destroying
    assert "destroy" not in log_of(cupy).names() and log_of(cupy).names()[-1] == "abort"
    timed = nccl.NcclCommunicator(0, 2, UID, 0, timeout=0.05)
    timed._done.done = False
    with pytest.raises(CommunicatorTimeout, match="close"):
        timed.close()
    timed.close()
