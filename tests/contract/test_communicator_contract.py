"""One communicator contract, asserted for every backend (``conftest.comms``): the CPU
ring over TCP, the ring with its shared-memory all-reduce group, and NCCL through the
fake CuPy at its one seam. Ranks run as threads of this process, as the ring's and
NCCL's own thread tests do.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from typing import Any

import numpy as np
import pytest

from rendezvousd.trainer import (
    CollectiveArgumentError,
    CommunicatorAborted,
    CommunicatorError,
    CommunicatorTimeout,
    PeerConnectionError,
    ReduceOp,
)
from tests.support import parallel

from .conftest import BACKENDS, Comms, process_ring, recv_report, together

DTYPES = ["float16", "float32", "float64", "int32", "int64", "uint8"]
# 0 and 1 are the edges; 7 and 1001 are not multiples of the ring's world of 3.
SIZES = [0, 1, 7, 1001]
OPS = [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX, ReduceOp.MIN]


def inputs(world: int, dtype: str, size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng([seed, size])
    dt = np.dtype(dtype)
    if dt.kind == "f":
        return [(rng.standard_normal(size) * 4).astype(dt) for _ in range(world)]
    info = np.iinfo(dt)
    # Values far from the type's ends, so that a sum cannot wrap.
    bound = min(int(info.max) // (4 * world), 1 << 20)
    low = 0 if dt.kind == "u" else -bound
    return [rng.integers(low, bound, size=size, dtype=dt) for _ in range(world)]


def expected(values: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    stack = np.stack(values)
    n, dt = len(values), stack.dtype
    if op is ReduceOp.MAX:
        return np.asarray(stack.max(axis=0))
    if op is ReduceOp.MIN:
        return np.asarray(stack.min(axis=0))
    if dt.kind == "f":
        total = stack.astype(np.float64).sum(axis=0)
        return np.asarray(total / n if op is ReduceOp.AVG else total).astype(dt)
    total = stack.sum(axis=0, dtype=dt)
    if op is not ReduceOp.AVG:
        return np.asarray(total)
    # Towards zero, as NCCL's integer AVG divides (-7 / 2 is -3, not -4).
    below = (total < 0) & (total % n != 0) if dt.kind == "i" else False
    return np.asarray(total // n + below).astype(dt)


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce_gives_every_rank_the_same_reduction(
    comms: Comms, op: ReduceOp, dtype: str
) -> None:
    world = len(comms.ranks)
    for seed, size in enumerate(SIZES):
        values = inputs(world, dtype, size, seed)
        arrays = [comms.to_device(v.copy()) for v in values]
        together(
            [
                functools.partial(c.all_reduce, a, op)
                for c, a in zip(comms.ranks, arrays, strict=True)
            ]
        )
        got = [comms.to_host(a) for a in arrays]
        label = f"{comms.backend} {op.name} {dtype} size {size}"
        assert all(g.dtype == np.dtype(dtype) and g.shape == (size,) for g in got), label
        assert all(g.tobytes() == got[0].tobytes() for g in got), f"{label}: ranks differ"
        want = expected(values, op)
        if np.dtype(dtype).kind == "f" and op not in (ReduceOp.MAX, ReduceOp.MIN):
            tolerance = 2 * world * float(np.finfo(dtype).eps)
            scale = np.abs(np.stack(values).astype(np.float64)).sum(axis=0)
            error = np.abs(got[0].astype(np.float64) - want.astype(np.float64))
            assert np.all(error <= tolerance * scale + 1e-30), label
        else:
            assert got[0].tobytes() == want.tobytes(), label


def test_all_reduce_over_several_ranks(comms: Comms) -> None:
    world = len(comms.ranks)
    arrays = [comms.to_device(np.full(5, r + 1, np.int64)) for r in range(world)]
    together([functools.partial(c.all_reduce, a) for c, a in zip(comms.ranks, arrays, strict=True)])
    total = world * (world + 1) // 2
    assert all((comms.to_host(a) == total).all() for a in arrays)


def test_broadcast_from_a_non_zero_root(comms: Comms) -> None:
    world = len(comms.ranks)
    root = world - 1
    for size in SIZES:
        arrays = [comms.to_device(np.full(size, r, np.float32)) for r in range(world)]
        together(
            [
                functools.partial(c.broadcast, a, root)
                for c, a in zip(comms.ranks, arrays, strict=True)
            ]
        )
        assert all((comms.to_host(a) == root).all() for a in arrays), size


@pytest.mark.parametrize("layout", ["fortran-order", "zero-dimensional"])
def test_any_contiguous_layout_is_reduced_and_broadcast_in_place(comms: Comms, layout: str) -> None:
    """A Fortran-ordered matrix (its memory is contiguous, in column order) and a 0-d
    array: the CPU ring took both, NCCL refused the first as "not C-contiguous"."""
    world = len(comms.ranks)

    def host(r: int) -> np.ndarray:
        if layout == "fortran-order":
            return np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3) + r)
        return np.array(r + 1.0, dtype=np.float32)

    arrays = [comms.to_device(host(r)) for r in range(world)]
    together([functools.partial(c.all_reduce, a) for c, a in zip(comms.ranks, arrays, strict=True)])
    want = sum(host(r) for r in range(world))
    assert all(np.array_equal(comms.to_host(a), want) for a in arrays), layout
    arrays = [comms.to_device(host(r)) for r in range(world)]
    together(
        [functools.partial(c.broadcast, a, 1) for c, a in zip(comms.ranks, arrays, strict=True)]
    )
    assert all(np.array_equal(comms.to_host(a), host(1)) for a in arrays), layout


def test_broadcast_from_root_zero_keeps_its_data(comms: Comms) -> None:
    world = len(comms.ranks)
    arrays = [comms.to_device(np.arange(7, dtype=np.int32) + 10 * r) for r in range(world)]
    together(
        [functools.partial(c.broadcast, a, 0) for c, a in zip(comms.ranks, arrays, strict=True)]
    )
    assert all((comms.to_host(a) == np.arange(7)).all() for a in arrays)


def test_a_root_outside_the_world_is_refused(comms: Comms) -> None:
    array = comms.to_device(np.zeros(3, np.float32))
    with pytest.raises(CollectiveArgumentError):
        comms.ranks[0].broadcast(array, len(comms.ranks))


@pytest.mark.parametrize("roots", [(0, 0, 1), (2, 2, 1), (1, 0, 2)])
def test_ranks_that_disagree_on_a_broadcasts_root_are_all_told_at_once(
    comms: Comms, roots: tuple[int, ...]
) -> None:
    """Each rank taking another for the root waited for data no one sent, until the
    collective timeout (10 s here, 300 s by default): every rank is told at once, and
    as nothing was sent, the communicator goes on (the CPU ring's used to break)."""
    started = time.monotonic()
    arrays = [comms.to_device(np.ones(4, np.float32)) for _ in comms.ranks]
    errors = parallel(
        [
            functools.partial(c.broadcast, a, roots[c.rank])
            for c, a in zip(comms.ranks, arrays, strict=True)
        ],
        limit=30,
    )
    assert time.monotonic() - started < 5, errors
    low, high = min(roots), max(roots)
    for e in errors:
        assert isinstance(e, CommunicatorError), errors
        assert not isinstance(e, CommunicatorTimeout), errors
        assert f"broadcast: the ranks disagree on its root {low} to {high}" in str(e), errors
    arrays = [comms.to_device(np.full(5, 10 * c.rank, np.int32)) for c in comms.ranks]
    together(
        [functools.partial(c.broadcast, a, 2) for c, a in zip(comms.ranks, arrays, strict=True)]
    )
    assert all(comms.to_host(a).tolist() == [20] * 5 for a in arrays)


def test_ranks_that_disagree_on_an_all_reduces_size_are_told(comms: Comms) -> None:
    """The ring compares every frame's header, so it tells at once. NCCL cannot tell (a
    collective of another size is just a collective that never ends): its ranks wait
    for collective_timeout_s (10 s here), and the timeout says this may be why."""
    arrays = [comms.to_device(np.ones(n, np.float32)) for n in (4, 4, 5)]
    errors = parallel(
        [functools.partial(c.all_reduce, a) for c, a in zip(comms.ranks, arrays, strict=True)],
        limit=30,
    )
    assert all(isinstance(e, CommunicatorError) for e in errors), errors
    if comms.backend.startswith("fake-nccl"):
        assert all(isinstance(e, CommunicatorTimeout) for e in errors), errors
        assert all("the ranks disagree on this collective" in str(e) for e in errors), errors
    else:
        assert not any(isinstance(e, CommunicatorTimeout) for e in errors), errors


def test_an_abort_ends_a_waiting_collective_and_every_later_one(comms: Comms) -> None:
    """What init_distributed's peer-failure callback does: abort() from another thread
    while ranks wait in a collective for a peer that will not come; each raises
    CommunicatorAborted naming the reason, at once, and so does every later call."""
    waiting = comms.ranks[:-1]  # the last rank never calls
    arrays = [comms.to_device(np.ones(1001, np.float32)) for _ in waiting]
    results: list[Any] = []
    runner = threading.Thread(
        target=lambda: results.extend(
            parallel(
                [functools.partial(c.all_reduce, a) for c, a in zip(waiting, arrays, strict=True)]
            )
        ),
        daemon=True,
    )
    runner.start()
    time.sleep(0.5)  # inside the collective by now
    started = time.monotonic()
    for c in waiting:
        c.abort("rank 2 was lost (the daemon said so)")
    runner.join(10)
    assert not runner.is_alive() and time.monotonic() - started < 5, results
    for e in results:
        assert isinstance(e, CommunicatorAborted), results
        assert "rank 2 was lost" in str(e), results
    for c, a in zip(waiting, arrays, strict=True):
        with pytest.raises(CommunicatorAborted, match="rank 2 was lost"):
            c.all_reduce(a)
        with pytest.raises(CommunicatorAborted, match="rank 2 was lost"):
            c.barrier()


def test_barrier_returns_after_the_last_rank_arrived(comms: Comms) -> None:
    world = len(comms.ranks)
    last = world - 1
    arrived: list[int] = []

    def enter(r: int) -> list[int]:
        if r == last:
            arrived.append(r)
        comms.ranks[r].barrier()
        return list(arrived)

    seen = together([functools.partial(enter, r) for r in range(world)])
    assert seen == [[last]] * world, seen


def test_a_closed_communicator_refuses_every_collective(comms: Comms) -> None:
    comm = comms.ranks[0]
    comm.close()
    comm.close()  # idempotent
    array = comms.to_device(np.ones(4, np.float32))
    for call in (
        lambda: comm.all_reduce(array),
        lambda: comm.broadcast(array, 0),
        comm.barrier,
    ):
        with pytest.raises(CommunicatorError, match="closed"):
            call()


def test_a_failed_peer_is_a_peer_connection_error(comms: Comms) -> None:
    failed = len(comms.ranks) - 1
    survivors = comms.fail_peer(failed)
    arrays = {r: comms.to_device(np.ones(1001, np.float32)) for r in survivors}
    errors = parallel([functools.partial(comms.ranks[r].all_reduce, arrays[r]) for r in survivors])
    assert all(isinstance(e, PeerConnectionError) for e in errors), errors


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sigkilled_peer_process_is_a_peer_connection_error(backend: str) -> None:
    if backend.startswith("fake-nccl"):
        pytest.skip("the fake NCCL has no peer processes: its lost peer is ncclRemoteError above")
    # Ranks in processes (mid all-reduce when one dies); each survivor reports the
    # class of what its all_reduce raised.
    with process_ring(3, "kill", backend) as (procs, conns):
        for c in conns:
            assert json.loads(recv_report(c)) == {"started": True}
        procs[1].kill()
        reports = [json.loads(recv_report(conns[r])) for r in (0, 2)]
    assert [r["error"] for r in reports] == ["PeerConnectionError"] * 2, reports
    assert all("rank 1" in r["message"] for r in reports), reports
