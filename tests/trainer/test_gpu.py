"""Real CuPy + NCCL on real devices; skipped cleanly where either is missing.

World-1 tests need one GPU; the two-rank tests (two threads, one GPU each)
need two. Set ``RENDEZVOUSD_REQUIRE_GPU=1`` (scripts/gpu_check.sh does) to turn
the skips into failures on a machine that is supposed to have a GPU.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from rendezvousd.trainer.bucketing import BucketedAllReducer
from rendezvousd.trainer.comm import nccl
from rendezvousd.trainer.comm.communicator import ReduceOp
from rendezvousd.trainer.errors import CommunicatorAborted, CommunicatorError, CommunicatorTimeout
from tests.support import parallel
from tests.trainer.gpu_gate import DEVICES, GPU_MARKS, REASON

pytestmark = GPU_MARKS
two_gpus = pytest.mark.skipif(DEVICES < 2, reason=REASON if DEVICES == 0 else "needs 2 devices")


@pytest.fixture
def cp() -> Any:
    # Through the seam, so nccl.py stays the package's only CuPy importer.
    return nccl._import_cupy()


@pytest.fixture
def comm() -> Iterator[nccl.NcclCommunicator]:
    communicator = nccl.NcclCommunicator(0, 1, nccl.create_unique_id(), 0, timeout=60)
    yield communicator
    communicator.close()


def host(array: Any) -> np.ndarray:
    return np.asarray(array.get())


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", "int32", "int64"])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX, ReduceOp.MIN])
def test_world_one_all_reduce_is_identity(
    cp: Any, comm: nccl.NcclCommunicator, dtype: str, op: ReduceOp
) -> None:
    data = np.arange(-50, 1000).astype(dtype)
    array = cp.asarray(data)
    comm.all_reduce(array, op)
    np.testing.assert_array_equal(host(array), data)


def test_world_one_broadcast_and_barrier(cp: Any, comm: nccl.NcclCommunicator) -> None:
    array = cp.arange(4096, dtype=cp.float32)
    comm.broadcast(array, root=0)
    comm.barrier()
    np.testing.assert_array_equal(host(array), np.arange(4096, dtype=np.float32))


def test_abort_makes_later_collectives_fail(cp: Any) -> None:
    communicator = nccl.NcclCommunicator(0, 1, nccl.create_unique_id(), 0)
    communicator.abort("test abort")
    with pytest.raises(CommunicatorAborted, match="test abort"):
        communicator.all_reduce(cp.zeros(4, dtype=cp.float32))
    communicator.close()


def test_bucketed_all_reduce_on_cupy(cp: Any, comm: nccl.NcclCommunicator) -> None:
    rng = np.random.default_rng(0)
    base = cp.asarray(rng.standard_normal((64, 48)).astype(np.float32))
    grads = [
        cp.asarray(rng.standard_normal(100_000).astype(np.float32)),
        base[:, ::3],  # strided: written back through the view
        cp.zeros(0, dtype=cp.float32),
        cp.asarray(rng.standard_normal(3000).astype(np.float16)),
        cp.asarray(rng.standard_normal((300, 300)).astype(np.float32)),
    ]
    expected = [host(g).copy() for g in grads]
    with BucketedAllReducer(grads, comm, cap_bytes=256 * 1024, first_bucket_bytes=16 * 1024) as r:
        assert len(r.buckets) >= 4
        for step in range(2):
            for index in reversed(range(len(grads))):
                r.mark_ready(index)
            r.wait()
            cp.cuda.get_current_stream().synchronize()
            for got, want in zip(grads, expected, strict=True):
                np.testing.assert_array_equal(host(got), want, err_msg=f"step {step}")


def on_two_devices(rank_main: Callable[[int], Any]) -> list[Any]:
    """``rank_main(rank)`` for ranks 0 and 1, each in a thread on its own device; what
    each returned, or the exception it raised."""

    def on_device(rank: int) -> Any:
        with nccl._import_cupy().cuda.Device(rank):
            return rank_main(rank)

    return parallel([functools.partial(on_device, rank) for rank in range(2)], limit=120)


def run_ranks(fn: Callable[[int, nccl.NcclCommunicator], Any]) -> list[Any]:
    uid = nccl.create_unique_id()

    def rank_main(rank: int) -> Any:
        communicator = nccl.NcclCommunicator(rank, 2, uid, rank, timeout=60)
        try:
            return fn(rank, communicator)
        finally:
            communicator.close()

    results = on_two_devices(rank_main)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    return results


@two_gpus
def test_two_ranks_all_reduce_and_broadcast(cp: Any) -> None:
    def body(rank: int, communicator: nccl.NcclCommunicator) -> Any:
        summed = cp.full(1000, rank + 1, dtype=cp.float32)
        communicator.all_reduce(summed, ReduceOp.SUM)
        averaged = cp.full(1000, 2 * rank, dtype=cp.float32)
        communicator.all_reduce(averaged, ReduceOp.AVG)
        sent = cp.full(10, 7 if rank == 1 else 0, dtype=cp.int64)
        communicator.broadcast(sent, root=1)
        communicator.barrier()
        return host(summed), host(averaged), host(sent)

    for summed, averaged, sent in run_ranks(body):
        assert np.all(summed == 3) and np.all(averaged == 1) and np.all(sent == 7)


@two_gpus
def test_two_ranks_disagreeing_on_a_root_are_told_and_integer_avg_is_towards_zero(
    cp: Any,
) -> None:
    """What the contract suite asserts through the fake NCCL, on the real one."""

    def body(rank: int, communicator: nccl.NcclCommunicator) -> Any:
        try:
            communicator.broadcast(cp.ones(4, dtype=cp.float32), root=rank)
        except CommunicatorError as exc:
            told = str(exc)
        else:
            told = ""
        averaged = cp.full(3, -3 if rank == 0 else -4, dtype=cp.int32)  # sum -7
        communicator.all_reduce(averaged, ReduceOp.AVG)
        return told, host(averaged)

    for told, averaged in run_ranks(body):
        assert "disagree on its root 0 to 1" in told, told
        assert np.all(averaged == -3), averaged


SIZES = (5000, 7, 90_000)


def rank_grads(rank: int) -> list[np.ndarray]:
    rng = np.random.default_rng(rank)
    return [rng.standard_normal(n).astype(np.float32) for n in SIZES]


@two_gpus
def test_two_ranks_bucketed_mean(cp: Any) -> None:
    def body(rank: int, communicator: nccl.NcclCommunicator) -> Any:
        grads = [cp.asarray(g) for g in rank_grads(rank)]
        with BucketedAllReducer(grads, communicator, cap_bytes=64 * 1024) as reducer:
            reducer.all_reduce_all()
        cp.cuda.get_current_stream().synchronize()
        return [host(g) for g in grads]

    results = run_ranks(body)
    # Halving is exact and a two-term sum is order-free, so the mean is bitwise.
    means = [
        a / np.float32(2) + b / np.float32(2)
        for a, b in zip(rank_grads(0), rank_grads(1), strict=True)
    ]
    for result in results:
        for got, want in zip(result, means, strict=True):
            np.testing.assert_array_equal(got, want)


def test_reducer_on_a_user_stream_matches_and_orders_only_at_wait(
    cp: Any, comm: nccl.NcclCommunicator
) -> None:
    grads = [cp.arange(n, dtype=cp.float32) for n in (70_000, 13, 5000)]
    expected = [host(g).copy() for g in grads]
    user = cp.cuda.Stream(non_blocking=True)
    with user, BucketedAllReducer(grads, comm, cap_bytes=64 * 1024) as reducer:
        for index in reversed(range(len(grads))):
            reducer.mark_ready(index)
        reducer.wait()
        user.synchronize()
    for got, want in zip(grads, expected, strict=True):
        np.testing.assert_array_equal(host(got), want)


def rank_zero_alone(
    timeout: float, collective: Callable[[nccl.NcclCommunicator], None]
) -> list[BaseException]:
    """Rank 0 runs ``collective`` while rank 1 never joins it; the errors raised.
    Both communicators are aborted afterwards (never destroyed: the group failed)."""
    uid = nccl.create_unique_id()
    comms: list[nccl.NcclCommunicator] = []
    ready = threading.Barrier(2, timeout=120)

    def rank_main(rank: int) -> None:
        communicator = nccl.NcclCommunicator(rank, 2, uid, rank, timeout=timeout)
        comms.append(communicator)
        ready.wait()
        if rank == 0:
            collective(communicator)

    try:
        return [r for r in on_two_devices(rank_main) if isinstance(r, BaseException)]
    finally:
        for communicator in comms:
            communicator.abort("test over")
            communicator.close()


@two_gpus
def test_absent_peer_times_out_and_aborts(cp: Any) -> None:
    errors = rank_zero_alone(2, lambda c: c.all_reduce(cp.ones(16, dtype=cp.float32)))
    assert len(errors) == 1 and isinstance(errors[0], CommunicatorTimeout), errors
    assert "peers: ranks 1" in str(errors[0])


@two_gpus
def test_abort_from_another_thread_ends_a_waiting_collective(cp: Any) -> None:
    def aborted_soon(communicator: nccl.NcclCommunicator) -> None:
        threading.Timer(0.5, communicator.abort, args=("peer 1 died",)).start()
        communicator.all_reduce(cp.ones(16, dtype=cp.float32))

    errors = rank_zero_alone(60, aborted_soon)
    assert len(errors) == 1 and isinstance(errors[0], CommunicatorAborted), errors


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_many_small_gradients_go_through_one_launch_each_way_intact(
    cp: Any, comm: nccl.NcclCommunicator, dtype: str
) -> None:
    # More than 8 contiguous gradients averaging under 2 MiB: CuPy's one-kernel
    # concatenate packs them and our scatter kernel unpacks them (nccl.CupyBufferOps).
    rng = np.random.default_rng(3)
    sizes = [int(n) for n in rng.integers(1, 5000, size=60)]
    sizes[9] = 0
    host_grads = [(np.arange(n) % 1000 + i).astype(dtype) for i, n in enumerate(sizes)]
    grads = [cp.asarray(g.reshape(-1, 1) if i % 4 == 0 else g) for i, g in enumerate(host_grads)]
    with BucketedAllReducer(grads, comm, first_bucket_bytes=None) as reducer:
        assert len(reducer.buckets) == 1
        for _ in range(2):  # the second step reuses the bucket's table
            reducer.all_reduce_all()
    cp.cuda.get_current_stream().synchronize()
    for got, want in zip(grads, host_grads, strict=True):
        np.testing.assert_array_equal(host(got).reshape(-1), want)
