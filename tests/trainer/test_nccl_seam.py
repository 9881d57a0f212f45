"""NcclCommunicator against a fake ``cupy`` installed at the one seam, ``_import_cupy``.

The fake records every NCCL call so the tests can pin the exact arguments
CuPy's bindings receive; fake device arrays refuse implicit host conversion like
CuPy's, so results are read through ``asnumpy``, and their ``data.ptr`` is the
address of their memory, so pointers in the log can be checked against them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rendezvousd.common.validation import UNIQUE_ID_BYTES
from rendezvousd.trainer import errors as errs
from rendezvousd.trainer.bucketing import BucketedAllReducer
from rendezvousd.trainer.comm import nccl
from rendezvousd.trainer.comm.communicator import Communicator, ReduceOp
from tests.support import parallel

from .fake_cupy import (
    FakeCudaError,
    FakeNccl,
    FakeNcclError,
    current_stream,
    device_array,
    install,
    make_cupy,
)

UID = bytes(range(1, 129))


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
    with pytest.raises(errs.CollectiveArgumentError):
        nccl.unique_id_to_bytes(bad)


def test_unique_id_of_wrong_type_is_rejected() -> None:
    with pytest.raises(errs.CollectiveArgumentError, match="not str"):
        nccl.unique_id_to_bytes("x" * 128)


def test_only_the_id_maker_calls_get_unique_id(cupy: Any) -> None:
    made = nccl.create_unique_id()
    assert len(made) == UNIQUE_ID_BYTES and log_of(cupy).names() == ["get_unique_id"]
    log_of(cupy).log.clear()
    nccl.NcclCommunicator(1, 2, UID, 0)
    assert "get_unique_id" not in log_of(cupy).names()


@pytest.mark.parametrize("cupy_version", ["13.6.0", "14.0.0"])
def test_create_unique_id_normalises_old_and_new_cupy(
    monkeypatch: pytest.MonkeyPatch, cupy_version: str
) -> None:
    raw: Any = nccl.unique_id_to_tuple(UID) if cupy_version < "14" else UID
    fake = make_cupy(cupy_version=cupy_version)
    monkeypatch.setattr(fake.cuda.nccl, "get_unique_id", lambda: raw)
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
    (entry,) = [e for e in log_of(fake).log if e[0] == "NcclCommunicator"]
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
    with pytest.raises(errs.CommunicatorError) as info:
        comm.all_reduce(device_array(cupy, [1.0]))
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
    with pytest.raises(errs.CollectiveArgumentError, match=r"2\.10\.3"):
        nccl.nccl_dtype("bfloat16", 21002)
    for bad in (np.int16, np.bool_, np.complex64):
        with pytest.raises(errs.CollectiveArgumentError, match="cannot reduce"):
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
    caller = current_stream(cupy.world)
    array = device_array(cupy, np.arange(8))
    cupy.world.trace.clear()
    comm.all_reduce(array, ReduceOp.AVG)
    stream = comm._stream
    assert stream.non_blocking and stream is not caller
    entry = [e for e in log_of(cupy).log if e[0] == "allReduce"][-1]
    assert entry == ("allReduce", array.data.ptr, array.data.ptr, 8, 7, 4, stream.ptr)
    ready, done = comm._ready.name, comm._done.name
    assert cupy.world.trace == [
        ("record", ready, "default"),
        ("wait_event", stream.name, ready),
        ("allReduce", stream.name),
        ("record", done, stream.name),
        ("wait_event", "default", done),
    ]
    comm.broadcast(array, root=1)
    assert [e for e in log_of(cupy).log if e[0] == "broadcast"] == [
        ("broadcast", *entry[1:3], 8, 7, 1, stream.ptr)
    ]
    before = len(log_of(cupy).log)
    comm.all_reduce(device_array(cupy, [], np.float32))  # empty: no NCCL call
    assert len(log_of(cupy).log) == before


def test_avg_falls_back_to_sum_and_divide_on_old_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = make_cupy(version=20804)
    monkeypatch.setattr(nccl, "_import_cupy", lambda: fake)
    comm = nccl.NcclCommunicator(0, 4, UID, 0)
    floats = device_array(fake, [4.0, 8.0, 2.0])
    comm.all_reduce(floats, ReduceOp.AVG)
    assert [e for e in log_of(fake).log if e[0] == "allReduce"][-1][
        5
    ] == 0  # SUM; the fake leaves the sum unchanged
    np.testing.assert_array_equal(fake.asnumpy(floats), [1.0, 2.0, 0.5])
    ints = device_array(fake, [9, 8], np.int64)
    comm.all_reduce(ints, ReduceOp.AVG)
    np.testing.assert_array_equal(fake.asnumpy(ints), [2, 2])


def test_bad_buffers_are_refused_before_nccl(cupy: Any) -> None:
    comm = nccl.NcclCommunicator(0, 1, UID, 0)
    # The same error the cpu backend raises for the same misuse.
    with pytest.raises(errs.CollectiveArgumentError, match="rank 0: NCCL all_reduce needs a CuPy"):
        comm.all_reduce(np.zeros(3, np.float32))
    with pytest.raises(errs.CollectiveArgumentError, match="contiguous"):
        comm.all_reduce(device_array(cupy, np.zeros((4, 4)))[:, ::2])
    with pytest.raises(errs.CollectiveArgumentError, match="root"):
        comm.broadcast(device_array(cupy, [1.0]), root=1)
    with pytest.raises(errs.CollectiveArgumentError, match="cannot reduce dtype int16"):
        comm.all_reduce(device_array(cupy, [1, 2], np.int16))
    assert "allReduce" not in log_of(cupy).names()


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (FakeNcclError(6), errs.PeerConnectionError),
        (FakeNcclError(3), errs.CommunicatorError),
        (FakeCudaError(700), errs.DeviceError),  # cudaErrorIllegalAddress
    ],
)
def test_errors_are_mapped_with_rank_and_operation(
    cupy: Any, error: BaseException, kind: type[BaseException]
) -> None:
    comm = nccl.NcclCommunicator(1, 2, UID, 0)
    log_of(cupy).fail = error
    with pytest.raises(kind, match=r"rank 1/2: NCCL all_reduce") as info:
        comm.all_reduce(device_array(cupy, [1.0]))
    assert info.value.__cause__ is error
    assert type(info.value) is kind
    assert not isinstance(info.value, errs.TransientInitError)  # only init is retried


@pytest.mark.parametrize("operation", ["init", "all_reduce"])
def test_a_system_error_is_this_ranks_own_not_a_peers(cupy: Any, operation: str) -> None:
    """ncclSystemError is a system call failing here (/dev/shm, a socket): blaming a
    peer and retrying on a fresh id sends the reader after the wrong host."""
    if operation == "init":
        log_of(cupy).fail = FakeNcclError(2)
        with pytest.raises(errs.CommunicatorError, match=r"rank 0/2: NCCL init") as info:
            nccl.NcclCommunicator(0, 2, UID, 0)
    else:
        comm = nccl.NcclCommunicator(0, 2, UID, 0)
        log_of(cupy).fail = FakeNcclError(2)
        with pytest.raises(errs.CommunicatorError, match=r"rank 0/2: NCCL all_reduce") as info:
            comm.all_reduce(device_array(cupy, [1.0]))
    assert not isinstance(info.value, errs.PeerConnectionError)
    assert "not at a peer" in str(info.value) and "/dev/shm" in str(info.value)
    assert "NCCL_DEBUG=WARN" in str(info.value)


@pytest.mark.parametrize("operation", ["init", "all_reduce"])
def test_a_cuda_errors_status_is_not_read_as_ncclS(cupy: Any, operation: str) -> None:
    """CUDARuntimeError(2) is cudaErrorMemoryAllocation; NCCL's 2 is ncclSystemError,
    which the seam took for an unreachable peer and retried on a fresh id."""
    error = FakeCudaError(2)
    if operation == "init":
        log_of(cupy).fail = error
        with pytest.raises(errs.DeviceError, match=r"rank 0/2: NCCL init") as info:
            nccl.NcclCommunicator(0, 2, UID, 0)
    else:
        comm = nccl.NcclCommunicator(0, 2, UID, 0)
        log_of(cupy).fail = error
        with pytest.raises(errs.DeviceError, match=r"rank 0/2: NCCL all_reduce") as info:
            comm.all_reduce(device_array(cupy, [1.0]))
        assert comm.aborted is not None
    assert not isinstance(info.value, errs.PeerConnectionError)
    assert "GPU 0 is out of memory" in str(info.value) and "not a peer" in str(info.value)


def test_cupys_out_of_memory_error_is_mapped_with_the_rank(cupy: Any) -> None:
    """CuPy's allocator raises OutOfMemoryError, a MemoryError and no CUDARuntimeError:
    it escaped the seam raw, naming no rank and leaving the communicator un-aborted."""
    cupy.world.out_of_memory = True
    with pytest.raises(errs.DeviceError, match=r"rank 1/2: NCCL init failed: GPU 0 is out of"):
        nccl.NcclCommunicator(1, 2, UID, 0)
    cupy.world.out_of_memory = False
    comm = nccl.NcclCommunicator(1, 2, UID, 0)
    cupy.world.out_of_memory = True  # broadcast's agreement allocates on the device
    with pytest.raises(errs.DeviceError, match=r"rank 1/2: NCCL broadcast failed: GPU 0") as info:
        comm.broadcast(device_array(cupy, [1.0]))
    assert isinstance(info.value.__cause__, MemoryError) and "restart" in str(info.value)
    assert comm.aborted is not None and log_of(cupy).names()[-1] == "abort"


def test_a_sticky_cuda_error_ends_the_wait_as_this_gpus_fault(cupy: Any) -> None:
    """After a kernel faults, cudaEventQuery returns the error for ever: Event.done
    stayed False, and the wait ran to the timeout blaming the peers (or for ever)."""
    comm = nccl.NcclCommunicator(0, 2, UID, 0, timeout=3)
    cupy.world.kernel_fault = 700  # cudaErrorIllegalAddress
    started = time.monotonic()
    with pytest.raises(errs.DeviceError, match=r"rank 0/2: NCCL all_reduce .*GPU 0") as info:
        comm.all_reduce(device_array(cupy, [1.0]))
    assert time.monotonic() - started < 2
    assert "cudaErrorIllegalAddress" in str(info.value) and "not a peer" in str(info.value)
    assert comm.aborted is not None


@pytest.mark.parametrize(
    ("error", "transient"),
    [(FakeNcclError(6), True), (FakeNcclError(2), False), (FakeNcclError(3), False)],
)
def test_only_an_init_failure_on_an_unreachable_peer_is_transient(
    cupy: Any, error: BaseException, transient: bool
) -> None:
    """The seam types it: init's caller retries on the class, never on the text."""
    log_of(cupy).fail = error
    with pytest.raises(errs.CommunicatorError, match="rank 0/2: NCCL init") as info:
        nccl.NcclCommunicator(0, 2, UID, 0)
    assert isinstance(info.value, errs.TransientInitError) is transient


def test_invalid_usage_at_init_names_a_gpu_shared_by_two_ranks(cupy: Any) -> None:
    """NCCL's 'invalid usage' at init is, in practice, two ranks on one GPU ('Duplicate
    GPU detected'): passed on as it was, it said nothing of the cause or the cure."""
    log_of(cupy).fail = FakeNcclError(5)
    with pytest.raises(errs.CommunicatorError, match=r"rank 1/2: NCCL init failed") as info:
        nccl.NcclCommunicator(1, 2, UID, 0)
    message = str(info.value)
    assert not isinstance(info.value, errs.TransientInitError)
    assert "two ranks of this communicator drive one GPU (device 0 here)" in message
    assert "RENDEZVOUSD_NCCL_SHARED_DEVICE=1" in message and "NCCL_HOSTID" in message


def test_init_failure_is_mapped(cupy: Any) -> None:
    log_of(cupy).fail = FakeNcclError(6)
    with pytest.raises(errs.PeerConnectionError, match="rank 0/2: NCCL init"):
        nccl.NcclCommunicator(0, 2, UID, 0)


def test_abort_then_collective_raises_aborted(cupy: Any) -> None:
    comm = nccl.NcclCommunicator(0, 2, UID, 0)
    comm.abort("peer 1 failed")
    comm.abort("again")
    assert log_of(cupy).names().count("abort") == 1
    for call in (lambda: comm.all_reduce(device_array(cupy, [1.0])), comm.barrier):
        with pytest.raises(errs.CommunicatorAborted, match="peer 1 failed"):
            call()
    comm.close()
    assert "destroy" not in log_of(cupy).names() and "aborted" in repr(comm)


def test_abort_from_another_thread_ends_a_barrier(cupy: Any) -> None:
    comm = nccl.NcclCommunicator(0, 2, UID, 0)
    cupy.world.hang = True  # the barrier's all-reduce never completes
    threading.Timer(0.05, comm.abort, args=("peer 1 died",)).start()
    started = time.monotonic()
    with pytest.raises(errs.CommunicatorAborted, match="peer 1 died"):
        comm.barrier()
    assert time.monotonic() - started < 5
    assert "check_async_error" in log_of(cupy).names()


def test_barrier_timeout_aborts(cupy: Any) -> None:
    comm = nccl.NcclCommunicator(0, 2, UID, 0, timeout=0.05)
    cupy.world.hang = True
    with pytest.raises(
        errs.CommunicatorTimeout, match=r"barrier did not finish .* \(peers: ranks 1\)"
    ):
        comm.barrier()
    assert log_of(cupy).names()[-1] == "abort"
    with pytest.raises(errs.CommunicatorAborted):
        comm.barrier()


def test_barrier_and_close(cupy: Any) -> None:
    comm = nccl.NcclCommunicator(0, 1, UID, 0)
    comm.barrier()
    assert "allReduce" in log_of(cupy).names()
    comm.close()
    comm.close()
    assert log_of(cupy).names().count("destroy") == 1
    with pytest.raises(errs.CommunicatorError, match="closed"):
        comm.all_reduce(device_array(cupy, [1.0]))


def test_a_rank_outside_the_world_is_refused_and_with_closes(cupy: Any) -> None:
    with pytest.raises(errs.ConfigError, match=r"rank=1 is out of range for world_size=1"):
        nccl.NcclCommunicator(1, 1, UID, 0)
    assert "NcclCommunicator" not in log_of(cupy).names()
    with nccl.NcclCommunicator(0, 1, UID, 0) as comm:
        comm.barrier()
    assert log_of(cupy).names().count("destroy") == 1


# --- bucketing on (fake) CuPy arrays ---------------------------------------------


def test_close_drains_abortably(cupy: Any) -> None:
    comm = nccl.NcclCommunicator(0, 2, UID, 0)
    cupy.world.hang = True  # work in flight that never finishes (a dead peer)
    comm._stream.queue([[False]])
    threading.Timer(0.05, comm.abort, args=("peer 1 died",)).start()
    comm.close()  # returns once abort() lands, without destroying
    assert "destroy" not in log_of(cupy).names() and log_of(cupy).names()[-1] == "abort"
    timed = nccl.NcclCommunicator(0, 2, UID, 0, timeout=0.05)
    timed._stream.queue([[False]])
    with pytest.raises(errs.CommunicatorTimeout, match="close"):
        timed.close()
    timed.close()


# --- fault paths: asynchronous errors, timeouts, abort races, old CuPy ------------


def join_alive(thread: threading.Thread, timeout: float = 10) -> None:
    thread.join(timeout)
    assert not thread.is_alive(), f"{thread.name} is still running: something hangs"


def test_async_error_after_enqueue_aborts_never_destroys(cupy: Any) -> None:
    comm = nccl.NcclCommunicator(0, 3, UID, 0, timeout=30)
    cupy.world.async_error = 6  # a peer died after the all-reduce was enqueued
    with pytest.raises(errs.PeerConnectionError, match=r"rank 0/3: NCCL all_reduce .*ranks 1, 2"):
        comm.all_reduce(device_array(cupy, [1.0, 2.0]))
    names = log_of(cupy).names()
    assert names.index("allReduce") < names.index("check_async_error") < names.index("abort")
    assert comm.aborted is not None and cupy.cuda.nccl.comms[0].handle == 0
    with pytest.raises(errs.CommunicatorAborted, match="after abort"):
        comm.broadcast(device_array(cupy, [1.0]))
    comm.close()
    assert "destroy" not in log_of(cupy).names()


def test_collective_timeout_aborts_and_names_op_and_peers(cupy: Any) -> None:
    comm = nccl.NcclCommunicator(2, 4, UID, 0, timeout=0.05)
    cupy.world.hang = True
    with pytest.raises(
        errs.CommunicatorTimeout,
        match=r"rank 2/4: NCCL all_reduce .*0\.05 s \(peers: ranks 0, 1, 3\)",
    ):
        comm.all_reduce(device_array(cupy, [1.0]))
    assert log_of(cupy).names()[-1] == "abort" and "destroy" not in log_of(cupy).names()


def test_old_cupy_keyerror_for_remote_error_is_a_peer_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = make_cupy(old_table=True)
    monkeypatch.setattr(nccl, "_import_cupy", lambda: fake)
    with pytest.raises(KeyError):
        FakeNcclError(6)  # what CuPy < 13.4 does for ncclRemoteError
    comm = nccl.NcclCommunicator(1, 2, UID, 0)
    fake.world.async_error = 6
    with pytest.raises(errs.PeerConnectionError, match="status 6") as info:
        comm.all_reduce(device_array(fake, [1.0]))
    assert isinstance(info.value.__cause__, KeyError) and comm.aborted is not None


def test_cupy_older_than_13_4_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = make_cupy(cupy_version="13.3.1")
    monkeypatch.setattr(nccl, "_import_cupy", lambda: fake)
    with pytest.raises(errs.ConfigError, match=r"CuPy >= 13\.4 .* CuPy 13\.3\.1 is installed"):
        nccl.NcclCommunicator(0, 1, UID, 0)


def test_abort_waits_for_a_call_inside_nccl(cupy: Any) -> None:
    comm = nccl.NcclCommunicator(0, 2, UID, 0, timeout=30)
    fake: FakeNccl = cupy.cuda.nccl
    caller, errors = _stuck_in_enqueue(cupy, comm)
    aborter = threading.Thread(target=comm.abort, args=("heartbeat: peer 1 died",), name="abort")
    aborter.start()
    deadline = time.monotonic() + 10
    while comm.aborted is None:  # abort() has begun, and must now wait for the enqueue
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert "abort" not in fake.names()
    fake.enqueue_gate.set()
    join_alive(aborter)
    join_alive(caller)
    assert fake.races == [] and fake.names().index("allReduce") < fake.names().index("abort")
    assert len(errors) == 1 and isinstance(errors[0], errs.CommunicatorAborted)


def test_nccl_connects_inside_init_where_the_watchdog_bounds_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NCCL >= 2.22 connects on first use by default, inside the first collective's
    enqueue: a peer that never answers blocked it there, with no timeout."""
    fake = install(monkeypatch, version=22809)
    comm = nccl.NcclCommunicator(0, 2, UID, 0)
    assert ("connect", "init") in fake.cuda.nccl.log
    comm.all_reduce(device_array(fake, [1.0]))
    assert [e for e in fake.cuda.nccl.log if e[0] == "connect"] == [("connect", "init")]
    # A value the user chose stays.
    monkeypatch.setenv("NCCL_RUNTIME_CONNECT", "1")
    lazy = nccl.NcclCommunicator(0, 2, UID, 0)
    lazy.all_reduce(device_array(fake, [1.0]))
    assert [e for e in fake.cuda.nccl.log if e[0] == "connect"][-1] == ("connect", "allReduce")


def _stuck_in_enqueue(
    cupy: Any, comm: nccl.NcclCommunicator
) -> tuple[threading.Thread, list[BaseException]]:
    """A collective whose enqueue blocks inside NCCL until ``enqueue_gate`` opens."""
    fake: FakeNccl = cupy.cuda.nccl
    fake.enqueue_gate = threading.Event()
    errors: list[BaseException] = []

    def collective() -> None:
        try:
            comm.all_reduce(device_array(cupy, [1.0]))
        except BaseException as exc:
            errors.append(exc)

    caller = threading.Thread(target=collective, name="collective")
    caller.start()
    assert fake.entered.wait(10)
    return caller, errors


def test_abort_never_frees_the_communicator_under_a_stuck_call(
    cupy: Any, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """ncclCommAbort frees the communicator: a thread still inside an NCCL call on it
    (a blocking one) would then use freed memory. The process ends instead."""
    from rendezvousd.trainer.comm.nccl_watchdog import CALL_HANG_EXIT_CODE

    monkeypatch.setattr(nccl, "_ABORT_GRACE_S", 0.1)
    comm = nccl.NcclCommunicator(1, 2, UID, 0)
    exits: list[int] = []
    comm._exit = exits.append
    caller, errors = _stuck_in_enqueue(cupy, comm)
    comm.abort("heartbeat: peer 0 died")
    assert exits == [CALL_HANG_EXIT_CODE]
    fake: FakeNccl = cupy.cuda.nccl
    assert "abort" not in fake.names() and fake.races == []
    err = capfd.readouterr().err
    assert "rank 1/2: abort (heartbeat: peer 0 died) waited 0.1 s" in err
    assert f"exits with code {CALL_HANG_EXIT_CODE}" in err
    fake.enqueue_gate.set()  # type: ignore[union-attr]
    join_alive(caller)
    assert len(errors) == 1 and isinstance(errors[0], errs.CommunicatorAborted)


def test_an_enqueue_stuck_past_the_collective_timeout_ends_the_process(
    cupy: Any, capfd: pytest.CaptureFixture[str]
) -> None:
    """The wait's deadline starts after the enqueue: a blocked enqueue had none."""
    from rendezvousd.trainer.comm.nccl_watchdog import CALL_HANG_EXIT_CODE

    comm = nccl.NcclCommunicator(0, 2, UID, 0, timeout=0.2)
    exits: list[int] = []
    comm._exit = exits.append
    caller, _ = _stuck_in_enqueue(cupy, comm)
    deadline = time.monotonic() + 5
    while not exits and time.monotonic() < deadline:
        time.sleep(0.01)
    cupy.cuda.nccl.enqueue_gate.set()
    join_alive(caller)
    assert exits == [CALL_HANG_EXIT_CODE] and cupy.cuda.nccl.races == []
    assert "did not return within collective_timeout_s=0.2 s" in capfd.readouterr().err


def _in_a_process(script: str) -> subprocess.CompletedProcess[str]:
    """``script`` run by a fresh interpreter from the repository root (the fake CuPy
    is imported from tests/): what ends the process is what is tested."""
    root = Path(__file__).resolve().parents[2]
    return subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=60
    )


STUCK_SCRIPT = """
import threading
from rendezvousd.trainer.comm import nccl
from tests.trainer.fake_cupy import make_cupy, device_array
fake = make_cupy()
fake.cuda.nccl.enqueue_gate = threading.Event()  # never opens: a peer never answers
nccl._import_cupy = lambda: fake
comm = nccl.NcclCommunicator(1, 2, bytes(range(1, 129)), 0, timeout=0.2)
comm.all_reduce(device_array(fake, [1.0]))
print("all_reduce returned", flush=True)
"""


def test_a_stuck_enqueue_ends_the_process_with_its_own_code() -> None:
    from rendezvousd.trainer.comm.nccl_watchdog import CALL_HANG_EXIT_CODE

    done = _in_a_process(STUCK_SCRIPT)
    assert done.returncode == CALL_HANG_EXIT_CODE, done.stderr
    assert "rank 1/2: an NCCL call" in done.stderr and "returned" not in done.stdout


def test_concurrent_collectives_from_two_threads_are_refused_without_a_race(cupy: Any) -> None:
    """Two threads' collectives at once are refused (ranks would pair them in either
    order): the late one's abort waits for the thread inside NCCL to leave it, so the
    NCCL handle is never freed under it."""
    comm = nccl.NcclCommunicator(0, 2, UID, 0, timeout=30)
    errors: list[BaseException] = []
    start = threading.Barrier(2, timeout=10)

    def loop() -> None:
        try:
            start.wait()
            for _ in range(50):
                comm.all_reduce(device_array(cupy, [1.0, 2.0]))
                comm.barrier()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=loop, name=f"t{i}") for i in range(2)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as can be: they overlap
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            join_alive(thread, 30)
    finally:
        sys.setswitchinterval(interval)
    assert cupy.cuda.nccl.races == []
    if not errors:  # the fake's calls are quick: the threads' may never overlap
        assert cupy.cuda.nccl.names().count("allReduce") == 200
        return
    assert len(errors) == 2, errors  # both threads stop: the communicator is aborted
    assert any(isinstance(e, errs.CollectiveArgumentError) for e in errors), errors
    assert all("is in flight on this communicator" in str(e) for e in errors), errors
    assert cupy.cuda.nccl.names().count("abort") == 1


def test_init_watchdog_reports_then_exits(cupy: Any) -> None:
    from rendezvousd.trainer.comm.nccl_watchdog import INIT_TIMEOUT_EXIT_CODE, InitWatchdog

    reports: list[str] = []
    exits: list[int] = []
    gate = threading.Event()
    with InitWatchdog(0.05, "rank 3/4: NCCL init", on_timeout=reports.append, exit=exits.append):
        assert not gate.wait(0.01)
        deadline = time.monotonic() + 10
        while not exits:
            assert time.monotonic() < deadline
            time.sleep(0.005)
    assert exits == [INIT_TIMEOUT_EXIT_CODE] and "rank 3/4: NCCL init" in reports[0]
    with InitWatchdog(5, "fast", exit=exits.append) as quick:
        pass
    assert not quick.fired and len(exits) == 1


WATCHDOG_SCRIPT = """
import sys, threading
from rendezvousd.trainer.comm import nccl
from rendezvousd.common.validation import UNIQUE_ID_BYTES
from tests.trainer.fake_cupy import make_cupy
fake = make_cupy()
fake.cuda.nccl.init_gate = threading.Event()  # a peer that never arrives
nccl._import_cupy = lambda: fake
def told(message):
    print("daemon told:", message.split(";")[0], flush=True)
nccl.NcclCommunicator(1, 2, bytes(range(1, 129)), 0, setup_timeout=0.2, on_setup_timeout=told)
print("init returned", flush=True)
"""


def test_init_hang_ends_the_process_with_its_own_code() -> None:
    from rendezvousd.trainer.comm.nccl_watchdog import INIT_TIMEOUT_EXIT_CODE

    done = _in_a_process(WATCHDOG_SCRIPT)
    assert done.returncode == INIT_TIMEOUT_EXIT_CODE, done.stderr
    assert "daemon told: rank 1/2: NCCL init on device 0 did not finish" in done.stdout
    assert "init returned" not in done.stdout and "setup_timeout_s=0.2" in done.stderr


# --- the reducer's streams (DDP's scheme) -------------------------------------------


def test_reducer_never_makes_the_callers_stream_wait_before_wait(cupy: Any) -> None:
    comm = nccl.NcclCommunicator(0, 1, UID, 0, timeout=30)
    base = device_array(cupy, np.arange(24).reshape(4, 6))
    grads = [device_array(cupy, np.arange(5)), base[:, ::2], device_array(cupy, np.ones(300))]
    expected = [cupy.asnumpy(g) for g in grads]
    user = cupy.cuda.Stream(non_blocking=True)  # e.g. a per-thread default stream
    trace = cupy.world.trace
    with user, BucketedAllReducer(grads, comm, cap_bytes=1024, first_bucket_bytes=None) as r:
        assert len(r.buckets) == 2
        comm_stream = r._ops.stream.name
        trace.clear()
        r.mark_ready(2)  # bucket 0 launches: its all-reduce completes on the worker
        deadline = time.monotonic() + 10
        while ("allReduce", comm._stream.name) not in trace:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        r.mark_ready(1)
        r.mark_ready(0)
        before_wait = len(trace)
        r.wait()
    waits_on_user = [i for i, e in enumerate(trace) if e[:2] == ("wait_event", user.name)]
    assert waits_on_user and min(waits_on_user) >= before_wait  # only wait() orders the caller
    assert len(waits_on_user) == 1 and trace[-2] == ("record", r._ops._final.name, comm_stream)
    # Every copy (pack/unpack) and division ran on the communication stream.
    assert {e[1] for e in trace if e[0] in ("copy", "divide")} == {comm_stream}
    # Each bucket: mark on the caller's stream, then the communication stream waits on it.
    ready = {e[1]: i for i, e in enumerate(trace) if e[0] == "record" and e[2] == user.name}
    for event in r._ops._ready.values():
        assert trace.index(("wait_event", comm_stream, event.name)) > ready[event.name]
    for got, want in zip(grads, expected, strict=True):
        np.testing.assert_array_equal(cupy.asnumpy(got), want)


def test_reducer_after_abort_raises_and_leaves_no_garbage(cupy: Any) -> None:
    comm = nccl.NcclCommunicator(0, 2, UID, 0, timeout=30)
    grads = [device_array(cupy, np.full(10, 4.0)), device_array(cupy, np.full(300, 8.0))]
    cupy.world.hang = True
    reducer = BucketedAllReducer(grads, comm, cap_bytes=1024, first_bucket_bytes=None)
    threading.Timer(0.05, comm.abort, args=("peer 1 died",)).start()
    with pytest.raises(
        errs.CommunicatorAborted, match=r"peer 1 died.*\[bucket 0 of 2: gradients \[1\]"
    ):
        reducer.wait()
    # The aborted bucket was never unpacked: the gradients hold what they held.
    np.testing.assert_array_equal(cupy.asnumpy(grads[1]), np.full(300, 8.0))
    with pytest.raises(errs.CommunicatorAborted):
        reducer.wait()
    reducer.close()


def test_bfloat16_gradients_are_averaged_on_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    """ml_dtypes' bfloat16 (numpy kind 'V') was refused as 'not floating', though
    CuPy holds it and NCCL reduces it (ncclBfloat16)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    cp = install(monkeypatch, devices=1, meet=True)
    ranks = [nccl.NcclCommunicator(r, 2, UID, 0, timeout=10.0) for r in range(2)]
    grads = [[device_array(cp, np.full(5, 2.0 * (r + 1)), ml_dtypes.bfloat16)] for r in range(2)]
    reducers = [BucketedAllReducer(g, c, average=True) for g, c in zip(grads, ranks, strict=True)]
    errors = parallel([r.all_reduce_all for r in reducers])
    assert errors == [None, None]
    for g in grads:
        np.testing.assert_array_equal(cp.asnumpy(g[0]).astype(np.float32), np.full(5, 3.0))
    assert {e[4] for e in log_of(cp).log if e[0] == "allReduce"} == {9}  # ncclBfloat16
    for r in reducers:
        r.close()


def test_reducer_timeout_names_bucket_op_and_peers(cupy: Any) -> None:
    comm = nccl.NcclCommunicator(1, 2, UID, 0, timeout=0.05)
    cupy.world.hang = True
    with (
        BucketedAllReducer([device_array(cupy, np.ones(8))], comm) as reducer,
        pytest.raises(
            errs.CommunicatorTimeout, match=r"all_reduce .*peers: ranks 0\).*\[bucket 0 of 1"
        ),
    ):
        reducer.wait()


def _many_small_grads(cupy: Any) -> list[Any]:
    """40 gradients of odd sizes and shapes, an empty one among them, each a distinct ramp."""
    rng = np.random.default_rng(7)
    sizes = [int(n) for n in rng.integers(1, 200, size=40)]
    sizes[5] = 0
    grads = []
    for i, n in enumerate(sizes):
        ramp = np.arange(n, dtype=np.float32) + 1000 * i
        grads.append(device_array(cupy, ramp.reshape(-1, 1) if i % 3 == 0 else ramp))
    return grads


def test_a_bucket_of_many_small_gradients_moves_in_one_launch_each_way(cupy: Any) -> None:
    comm = nccl.NcclCommunicator(0, 1, UID, 0, timeout=30)
    grads = _many_small_grads(cupy)
    expected = [cupy.asnumpy(g).copy() for g in grads]
    trace = cupy.world.trace
    with BucketedAllReducer(grads, comm, first_bucket_bytes=None) as reducer:
        assert len(reducer.buckets) == 1
        tables = cupy.counts["asarray"]
        for _ in range(2):
            trace.clear()
            reducer.all_reduce_all()
            assert [e[0] for e in trace if e[0] in ("copy", "allReduce")] == [
                "copy",
                "allReduce",
                "copy",
            ]
        # Where each gradient goes is uploaded once per bucket, not per step.
        assert cupy.counts["asarray"] == tables + 2
    for got, want in zip(grads, expected, strict=True):
        np.testing.assert_array_equal(cupy.asnumpy(got), want)


def test_a_bucket_with_a_strided_gradient_is_copied_one_gradient_at_a_time(cupy: Any) -> None:
    comm = nccl.NcclCommunicator(0, 1, UID, 0, timeout=30)
    grads = _many_small_grads(cupy)
    grads[7] = device_array(cupy, np.arange(60, dtype=np.float32).reshape(6, 10))[:, ::2]
    expected = [cupy.asnumpy(g).copy() for g in grads]
    trace = cupy.world.trace
    with BucketedAllReducer(grads, comm, first_bucket_bytes=None) as reducer:
        trace.clear()
        reducer.all_reduce_all()
    # One copy each way per gradient that has elements (an empty one is not bucketed).
    assert sum(e[0] == "copy" for e in trace) == 2 * sum(g.size > 0 for g in grads)
    for got, want in zip(grads, expected, strict=True):
        np.testing.assert_array_equal(cupy.asnumpy(got), want)


# --- check_collectives: every all-reduce compared across ranks first ---------------


def test_check_collectives_tells_ranks_disagreeing_on_an_all_reduce_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without it NCCL waits for collective_timeout_s (tests/contract asserts that);
    with it every rank hears what differs at once, and agreeing calls reduce as ever."""
    cp = install(monkeypatch, devices=1, meet=True)
    ranks = [
        nccl.NcclCommunicator(r, 3, UID, 0, timeout=10.0, check_collectives=True) for r in range(3)
    ]
    try:
        arrays = [device_array(cp, np.ones(n), np.float32) for n in (4, 4, 5)]
        started = time.monotonic()
        errors = parallel(
            [lambda c=c, a=a: c.all_reduce(a) for c, a in zip(ranks, arrays, strict=True)]
        )
        assert time.monotonic() - started < 5, errors
        for e in errors:
            assert type(e) is errs.CommunicatorError, errors
            assert "all_reduce: the ranks disagree on its element count 4 to 5" in str(e)
        arrays = [device_array(cp, np.full(3, r + 1), np.int64) for r in range(3)]
        errors = parallel(
            [
                lambda c=c, a=a: c.all_reduce(a, ReduceOp.MAX)
                for c, a in zip(ranks, arrays, strict=True)
            ]
        )
        assert errors == [None] * 3, errors
        assert all((cp.asnumpy(a) == 3).all() for a in arrays)
    finally:
        for c in ranks:
            c.close()


# --- a training script's threads and forks (the h157 review) ----------------------


def test_a_collective_from_a_second_thread_while_one_is_in_flight_is_refused(cupy: Any) -> None:
    """Ranks pair collectives by the order they start: two threads' collectives, run in
    either order on each rank, were summed with each other's data. As on the CPU ring,
    the second thread's is refused and the communicator aborted (the first's fails)."""
    comm = nccl.NcclCommunicator(0, 2, UID, 0, timeout=5)
    cupy.world.hang = True  # the first thread's barrier stays in flight
    first: list[BaseException] = []

    def in_flight() -> None:
        try:
            comm.barrier()
        except BaseException as exc:
            first.append(exc)

    t = threading.Thread(target=in_flight, name="metrics")
    t.start()
    deadline = time.monotonic() + 5
    while "allReduce" not in log_of(cupy).names() and time.monotonic() < deadline:
        time.sleep(0.005)
    with pytest.raises(
        errs.CollectiveArgumentError,
        match=r"rank 0/2: all_reduce\(\) was called on thread 'MainThread' while barrier\(\) "
        r"of thread 'metrics' is in flight on this communicator: .* from one thread",
    ):
        comm.all_reduce(device_array(cupy, [1.0]))
    join_alive(t)
    assert len(first) == 1 and isinstance(first[0], errs.CommunicatorAborted), first
    assert "is in flight on this communicator" in str(first[0])
    assert log_of(cupy).names()[-1] == "abort"


def test_in_a_forked_child_collectives_are_refused_and_close_ends_nothing(cupy: Any) -> None:
    """A forked child (a DataLoader worker) holds a copy of the parent's communicator:
    its collective is refused in the SDK's words, and its close neither drains,
    destroys nor aborts the NCCL communicator, which is the parent's."""
    comm = nccl.NcclCommunicator(0, 1, UID, 0)
    before = len(log_of(cupy).names())
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child reports through the pipe)
        try:
            try:
                comm.all_reduce(device_array(cupy, [1.0]))
                said = "no error"
            except Exception as exc:
                said = f"{type(exc).__name__}: {exc}"
            comm.close()
            report = {"said": said, "calls": log_of(cupy).names()[before:]}
            os.write(write, json.dumps(report).encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        with os.fdopen(read, "rb") as pipe:
            got = json.loads(pipe.read() or b"{}")
    finally:
        os.waitpid(pid, 0)
    assert got["said"].startswith("CommunicatorError: rank 0: all_reduce() refused: "), got
    assert "is a fork of it" in got["said"] and "do not survive a fork" in got["said"], got
    assert got["calls"] == [], got  # no destroy, abort, or wait on the parent's stream
    comm.barrier()  # the parent's is untouched
    comm.close()
    assert log_of(cupy).names().count("destroy") == 1
