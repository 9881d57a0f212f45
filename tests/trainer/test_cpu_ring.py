"""CpuRingCommunicator over real loopback sockets: threads for most checks, spawned
processes for the multi-rank result matrix and for a peer killed mid-all-reduce.

Checks marked with TRANSPORTS run twice: over the TCP ring, and with all_reduce going
through the one-host shared-memory group (trainer/comm/shm_group.py)."""

from __future__ import annotations

import contextlib
import errno
import json
import multiprocessing as mp
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from rendezvousd.client import RendezvousClient
from rendezvousd.trainer import errors as errs
from rendezvousd.trainer.comm import peer_auth, ring_wire
from rendezvousd.trainer.comm.communicator import Communicator, ReduceOp
from rendezvousd.trainer.comm.cpu_ring import CpuRingCommunicator, connect_cpu_ring
from rendezvousd.trainer.comm.shm_group import (
    SharedMemoryPeers,
    create_listener,
    unsupported_reason,
)
from tests.support import WORKERS, parallel, wait_for

SECRET = bytes(range(128))
DTYPES = [f"float{b}" for b in (16, 32, 64)] + [
    f"{u}int{b}" for u in ("", "u") for b in (8, 16, 32, 64)
]
OPS = list(ReduceOp)
# 70_001 elements span several 80 KiB chunks for 4- and 8-byte dtypes; 131 is odd and
# indivisible by 2, 3 and 4.
SIZES = [0, 1, 5, 131, 70_001]
MATRIX_CHUNK_BYTES = 80 * 1024
# Shared memory runs only on x86-64 Linux (shm_group.unsupported_reason); elsewhere the
# ring is used and only the ring is tested.
TRANSPORTS = [
    "tcp-ring",
    pytest.param(
        "shared-memory",
        marks=pytest.mark.skipif(
            unsupported_reason() is not None, reason=f"{unsupported_reason()}"
        ),
    ),
]


def shm_peers(n: int, slot_bytes: int = MATRIX_CHUNK_BYTES) -> list[SharedMemoryPeers]:
    made = [create_listener() for _ in range(n)]
    names = [name for _, name in made]
    return [SharedMemoryPeers(sock, names, slot_bytes) for sock, _ in made]


# -- helpers --------------------------------------------------------------------------


def _listeners(n: int) -> tuple[list[socket.socket], list[tuple[str, int]]]:
    socks = [socket.create_server(("127.0.0.1", 0)) for _ in range(n)]
    return socks, [("127.0.0.1", s.getsockname()[1]) for s in socks]


@contextmanager
def thread_ring(
    n: int,
    *,
    timeout: float = 10.0,
    secrets: Sequence[bytes] | None = None,
    transport: str = "tcp-ring",
    **kw: Any,
) -> Iterator[list[CpuRingCommunicator]]:
    socks, addrs = _listeners(n)
    keys = secrets or [SECRET] * n
    shm: list[SharedMemoryPeers | None] = [None] * n
    if transport == "shared-memory":
        shm = list(shm_peers(n))
    built = parallel(
        [
            (
                lambda r=r: CpuRingCommunicator(
                    r, n, socks[r], addrs, keys[r], timeout, shared_memory=shm[r], **kw
                )
            )
            for r in range(n)
        ]
    )
    errors = [b for b in built if isinstance(b, BaseException)]
    comms = [b for b in built if isinstance(b, CpuRingCommunicator)]
    try:
        if errors:
            raise errors[0]
        assert all(c.transport == (transport if n > 1 else "tcp-ring") for c in comms)
        yield comms
    finally:
        for c in comms:
            c.close()


def case_input(case: int, rank: int, dtype: str, size: int) -> np.ndarray:
    rng = np.random.default_rng([case, rank])
    dt = np.dtype(dtype)
    if dt.kind == "f":
        return (rng.standard_normal(size) * 4).astype(dt)
    info = np.iinfo(dt)
    return rng.integers(info.min, info.max, size=size, dtype=dt, endpoint=True)


def matrix_cases() -> list[tuple[int, ReduceOp, str, int]]:
    cases = []
    for op in OPS:
        for dtype in DTYPES:
            for size in SIZES:
                cases.append((len(cases), op, dtype, size))
    return cases


def expected(inputs: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    stack = np.stack(inputs)
    n, dt = len(inputs), stack.dtype
    if op is ReduceOp.MAX:
        return stack.max(axis=0)
    if op is ReduceOp.MIN:
        return stack.min(axis=0)
    if dt.kind == "f":
        total = stack.astype(np.float64).sum(axis=0)
        return total / n if op is ReduceOp.AVG else total
    total = stack.sum(axis=0, dtype=dt)  # wraps like the ring does
    if op is not ReduceOp.AVG:
        return total
    # Towards zero, as NCCL's integer AVG divides (-7 / 2 is -3, not -4).
    below = (total < 0) & (total % n != 0) if dt.kind == "i" else False
    return np.asarray(total // n + below).astype(dt)


def check_results(world: int, results: list[list[bytes]]) -> None:
    for case, op, dtype, size in matrix_cases():
        inputs = [case_input(case, r, dtype, size) for r in range(world)]
        got = [np.frombuffer(results[r][case], dtype=dtype) for r in range(world)]
        label = f"world {world} {op.name} {dtype} size {size}"
        for r in range(1, world):
            assert got[r].tobytes() == got[0].tobytes(), f"{label}: rank {r} differs from rank 0"
        want = expected(inputs, op)
        if np.dtype(dtype).kind == "f" and op in (ReduceOp.SUM, ReduceOp.AVG):
            scale = np.abs(np.stack(inputs).astype(np.float64)).sum(axis=0)
            eps = float(np.finfo(dtype).eps)
            assert np.all(np.abs(got[0] - want) <= 2 * world * eps * scale + 1e-30), label
        else:
            assert got[0].tobytes() == want.astype(dtype).tobytes(), label


# -- spawned-process workers (module level so spawn can import them) --------------------


def _send(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(struct.pack("<I", len(payload)) + payload)


def _recv(sock: socket.socket) -> bytes:
    def exact(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            part = sock.recv(n - len(buf))
            if not part:
                raise ConnectionError("control connection closed")
            buf += part
        return buf

    (length,) = struct.unpack("<I", exact(4))
    return exact(length)


def _proc_worker(rank: int, world: int, control_port: int, mode: str, transport: str) -> None:
    control = socket.create_connection(("127.0.0.1", control_port))
    listener = socket.create_server(("127.0.0.1", 0))
    shm_listener, shm_name = create_listener() if transport == "shared-memory" else (None, "")
    hello = {"rank": rank, "port": listener.getsockname()[1], "shm": shm_name}
    _send(control, json.dumps(hello).encode())
    plan = json.loads(_recv(control))
    addrs = [(h, int(p)) for h, p in plan["addresses"]]
    shm = None
    if shm_listener is not None:
        shm = SharedMemoryPeers(shm_listener, plan["shm"], MATRIX_CHUNK_BYTES)
    timeout = 10.0
    comm = CpuRingCommunicator(
        rank,
        world,
        listener,
        addrs,
        SECRET,
        timeout,
        chunk_bytes=MATRIX_CHUNK_BYTES,
        shared_memory=shm,
    )
    assert comm.transport == transport
    try:
        if mode == "matrix":
            for case, op, dtype, size in matrix_cases():
                array = case_input(case, rank, dtype, size)
                comm.all_reduce(array, op)
                _send(control, array.tobytes())
        elif mode == "kill":
            array = np.ones(2 << 20, np.float32)
            try:
                for i in range(1000):
                    comm.all_reduce(array, ReduceOp.AVG)
                    if i == 0:
                        _send(control, b'{"started": true}')
            except errs.CommunicatorError as exc:
                report = {"error": type(exc).__name__, "message": str(exc)}
                _send(control, json.dumps(report).encode())
    finally:
        comm.close()


@contextmanager
def process_ring(
    world: int, mode: str, transport: str = "tcp-ring"
) -> Iterator[tuple[list[Any], list[socket.socket]]]:
    # Not spawn: every rank would import this module again (pytest, numpy, grpc:
    # 0.7 s of CPU each). The fork server imports it once and forks the ranks; it
    # has no threads, unlike this process, so forking it is safe.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(30)
    port = server.getsockname()[1]
    procs = [
        ctx.Process(target=_proc_worker, args=(r, world, port, mode, transport))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        conns = [server.accept()[0] for _ in range(world)]
        for c in conns:
            c.settimeout(30)
        hellos = [json.loads(_recv(c)) for c in conns]
        by_rank = {h["rank"]: (conns[i], h["port"], h["shm"]) for i, h in enumerate(hellos)}
        plan = {
            "addresses": [["127.0.0.1", by_rank[r][1]] for r in range(world)],
            "shm": [by_rank[r][2] for r in range(world)],
        }
        for c in conns:
            _send(c, json.dumps(plan).encode())
        yield procs, [by_rank[r][0] for r in range(world)]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        server.close()


# -- result matrix ------------------------------------------------------------------------


def test_world_one_leaves_data_as_is_except_defined_ops() -> None:
    # A host instead of a socket: the communicator binds it at its own address's port.
    with CpuRingCommunicator(0, 1, "127.0.0.1", [("127.0.0.1", 0)], SECRET, 5.0) as comm:
        assert isinstance(comm, Communicator) and comm.backend == "cpu"
        for case, op, dtype, size in matrix_cases():
            array = case_input(case, 0, dtype, size)
            comm.all_reduce(array, op)
            want = expected([case_input(case, 0, dtype, size)], op).astype(dtype)
            assert array.tobytes() == want.tobytes()
        comm.broadcast(np.zeros(3), root=0)
        comm.barrier()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_all_reduce_matrix_in_processes(world: int, transport: str) -> None:
    cases = matrix_cases()
    with process_ring(world, "matrix", transport) as (_, conns):
        # Drain every rank at once: a rank blocked on a full control socket stalls the ring.
        results = parallel([lambda c=c: [_recv(c) for _ in cases] for c in conns], 60.0)
    check_results(world, results)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_default_chunking_large_array_threads(transport: str) -> None:
    # Several 1 MiB chunks per segment, plus an odd tail;
    # in shared memory, three 4 MiB slots in rotation.
    with thread_ring(3, transport=transport) as comms:
        inputs = [np.random.default_rng(r).standard_normal(1_000_003) for r in range(3)]
        arrays = [a.copy() for a in inputs]
        parallel([lambda c=c: c.all_reduce(arrays[c.rank], ReduceOp.AVG) for c in comms])
        assert arrays[0].tobytes() == arrays[1].tobytes() == arrays[2].tobytes()
        np.testing.assert_allclose(arrays[0], np.mean(inputs, axis=0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_array_is_reusable_as_soon_as_all_reduce_returns(transport: str) -> None:
    # The sender thread reads the array after all_reduce posted it; a collective must not
    # return before the neighbour has it all, or this overwrite would corrupt its result.
    with thread_ring(2, transport=transport) as comms:

        def rank(c: CpuRingCommunicator) -> bool:
            ok = True
            array = np.empty(1 << 19, np.float64)
            for step in range(16):
                array.fill(step + c.rank)
                c.all_reduce(array)
                ok = ok and bool((array == 2 * step + 1).all())
                array.fill(np.nan)
            return ok

        assert parallel([lambda c=c: rank(c) for c in comms]) == [True, True]


def test_fortran_order() -> None:
    with thread_ring(2) as comms:
        arrays = [np.asfortranarray(np.full((300, 500), r + 1, np.float32)) for r in range(2)]
        parallel([lambda c=c: c.all_reduce(arrays[c.rank]) for c in comms])
        assert (arrays[0] == 3).all() and (arrays[1] == 3).all()


# -- broadcast and barrier ---------------------------------------------------------------


@pytest.mark.parametrize("root", [0, 1, 2])
def test_broadcast_from_each_root(root: int) -> None:
    with thread_ring(3, chunk_bytes=256) as comms:
        for dtype, size in [("float32", 0), ("int64", 1), ("float16", 1001), ("uint8", 7)]:
            arrays = [case_input(100 + root, r, dtype, size) for r in range(3)]
            source = arrays[root].copy()
            parallel([lambda c=c, a=arrays[c.rank]: c.broadcast(a, root=root) for c in comms])
            for a in arrays:
                assert a.tobytes() == source.tobytes()


def test_barrier_waits_for_the_last_rank() -> None:
    with thread_ring(3) as comms:
        entered: list[float] = []

        def late(c: CpuRingCommunicator) -> float:
            # Not a synchronisation: this delay is the lateness the test measures.
            time.sleep(0.4)
            entered.append(time.monotonic())
            c.barrier()
            return time.monotonic()

        def prompt(c: CpuRingCommunicator) -> float:
            c.barrier()
            return time.monotonic()

        left = parallel(
            [lambda: prompt(comms[0]), lambda: prompt(comms[1]), lambda: late(comms[2])]
        )
        assert all(t >= entered[0] for t in left)


# -- failures -----------------------------------------------------------------------------


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_abort_unblocks_a_pending_all_reduce(transport: str) -> None:
    with thread_ring(2, timeout=30.0, transport=transport) as comms:
        outcome: list[BaseException] = []

        def blocked() -> None:
            try:
                comms[0].all_reduce(np.ones(1 << 20, np.float32))
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=blocked, daemon=True)
        thread.start()
        # Rank 1 never joins; once rank 0 holds its collective lock it is inside the call.
        wait_for("rank 0 to be inside all_reduce", comms[0]._io_lock.locked)
        started = time.monotonic()
        comms[0].abort("peer 7 failed (unit test)")
        thread.join(5)
        assert not thread.is_alive()
        assert time.monotonic() - started < 2.0
        assert isinstance(outcome[0], errs.CommunicatorAborted)
        assert "peer 7 failed (unit test)" in str(outcome[0])
        with pytest.raises(errs.CommunicatorAborted, match="unit test"):
            comms[0].barrier()
        # The aborted rank's neighbour learns who left instead of waiting 30 s.
        started = time.monotonic()
        with pytest.raises(errs.PeerConnectionError, match="rank 0"):
            comms[1].all_reduce(np.ones(1 << 20, np.float32))
        assert time.monotonic() - started < 5.0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_timeout_names_the_rank_waited_on(transport: str) -> None:
    with thread_ring(2, timeout=0.5, transport=transport) as comms:
        started = time.monotonic()
        with pytest.raises(errs.CommunicatorTimeout, match="rank 1"):
            comms[0].all_reduce(np.ones(10, np.float64))
        assert time.monotonic() - started < 3.0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_collective_waits_its_own_timeout_not_what_the_setup_had_left(transport: str) -> None:
    """Both ways the setup's rest stood for the collective timeout (a differential
    review): a ring formed at once waited a peer for the whole setup timeout (300 s by
    default, here 8 s) instead of the collective's, and one formed late into its setup
    timed collectives out after that rest (here 0.5 s) for the rest of its life."""
    with thread_ring(2, timeout=0.5, setup_timeout=8.0, transport=transport) as comms:
        started = time.monotonic()
        with pytest.raises(errs.CommunicatorTimeout, match="rank 1"):
            comms[0].all_reduce(np.ones(10, np.float64))
        assert time.monotonic() - started < 3.0
    socks, addrs = _listeners(2)
    shm: list[SharedMemoryPeers | None] = [None, None]
    if transport == "shared-memory":
        shm = list(shm_peers(2))

    def build(rank: int) -> CpuRingCommunicator:
        if rank == 1:
            time.sleep(2.5)  # a peer still starting: the setup has 0.5 s left when it forms
        return CpuRingCommunicator(
            rank, 2, socks[rank], addrs, SECRET, 10.0, shared_memory=shm[rank], setup_timeout=3.0
        )

    built = parallel([lambda r=r: build(r) for r in range(2)])
    comms = [b for b in built if isinstance(b, CpuRingCommunicator)]
    try:
        assert len(comms) == 2, built
        assert comms[0].transport == transport

        def late(comm: CpuRingCommunicator, delay: float) -> np.ndarray:
            time.sleep(delay)
            data = np.full(4, comm.rank + 1.0)
            comm.all_reduce(data)
            return data

        done = parallel([lambda: late(comms[0], 0.0), lambda: late(comms[1], 1.5)])
        for result in done:
            assert not isinstance(result, BaseException), result
            assert list(result) == [3.0] * 4
    finally:
        for c in comms:
            c.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_mismatched_collectives_fail_instead_of_corrupting(transport: str) -> None:
    with thread_ring(2, timeout=5.0, transport=transport) as comms:
        calls = [
            lambda: comms[0].all_reduce(np.ones(10, np.float32)),
            lambda: comms[1].all_reduce(np.ones(12, np.float32)),
        ]
        errors = parallel(calls)
        assert all(isinstance(e, errs.CommunicatorError) for e in errors), errors
        assert any("mismatch" in str(e) for e in errors)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("odd", ["barrier", "broadcast", "all_reduce"])
def test_a_rank_in_another_collective_is_named_not_waited_for(transport: str, odd: str) -> None:
    # Shared memory runs all_reduce only; broadcast and barrier stay on the ring. A
    # rank that skipped a step's all_reduce (or ran an extra barrier) must be a mismatch
    # at once, as on the ring, not a wait for the collective timeout.
    def call(c: CpuRingCommunicator, name: str) -> None:
        if name == "all_reduce":
            c.all_reduce(np.ones(10, np.float32))
        elif name == "barrier":
            c.barrier()
        else:
            c.broadcast(np.ones(10, np.float32))

    with thread_ring(3, timeout=20.0, transport=transport) as comms:
        usual = "barrier" if odd == "all_reduce" else "all_reduce"
        errors = parallel([lambda c=c: call(c, odd if c.rank == 2 else usual) for c in comms])
    for e in errors:
        assert isinstance(e, errs.CommunicatorError), errors
        assert not isinstance(e, errs.CommunicatorTimeout), errors
    assert all(odd in str(e) and usual in str(e) for e in errors), errors


def test_every_rank_names_the_rank_that_found_a_mismatch_not_the_one_passing_it_on() -> None:
    # World 6, rank 3 the odd one: only ranks 3 and 4 receive its mismatched data, and
    # their notice reaches rank 0 (two hops from either) through a neighbour, which
    # must not be named as the rank that found it.
    with thread_ring(6, timeout=20.0) as comms:
        dtypes = [np.int32 if c.rank == 3 else np.float32 for c in comms]
        errors = parallel([lambda c=c: c.all_reduce(np.ones(10, dtypes[c.rank])) for c in comms])
    found = re.compile(r"rank (\d+) gave up on this rank|\(reported by rank (\d+)\)")
    for rank, e in enumerate(errors):
        assert isinstance(e, errs.CommunicatorError), errors
        named = {int(a or b) for a, b in found.findall(str(e))}
        assert named <= {3, 4}, (rank, errors)
        assert named or rank in (3, 4), (rank, errors)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_rank_is_told_which_rank_is_in_which_collective_in_words(transport: str) -> None:
    """The odd rank's collective is named with its rank, in words, on every rank: the
    ring's notice said "received X, expected Y" from its finder's side, read on the
    other ranks as their own, so rank 0 of 16 bytes read "expected ... 20 bytes" and
    took its finder's neighbour for the odd one; codes read "op 2, dtype 2" (review)."""
    with thread_ring(4, timeout=20.0, transport=transport) as comms:
        ops = [ReduceOp.AVG if c.rank == 3 else ReduceOp.SUM for c in comms]
        errors = parallel(
            [lambda c=c: c.all_reduce(np.ones(4, np.float32), ops[c.rank]) for c in comms]
        )
    odd = re.compile(r"rank 3 (sent|is in) all_reduce #\d+ \(AVG of float32, 16 bytes")
    for e in errors:
        assert isinstance(e, errs.CommunicatorError), errors
        assert odd.search(str(e)), errors
        assert "SUM of float32" in str(e) and "op 2" not in str(e), errors


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_rank_in_a_broadcast_is_named_as_such_not_by_its_agreement_frame(
    transport: str,
) -> None:
    """A broadcast opens with a 48-byte MAX over int64s (its agreement); a rank in one
    while the others all-reduce was described by that frame, "broadcast #1 (int64,
    48 bytes)", which is neither the caller's array nor its dtype (helper-70)."""
    with thread_ring(3, timeout=20.0, transport=transport) as comms:
        calls = [
            (lambda c=c: c.broadcast(np.ones(4, np.float32), 0))
            if c.rank == 2
            else (lambda c=c: c.all_reduce(np.ones(4, np.float32)))
            for c in comms
        ]
        errors = parallel(calls)
    for e in errors:
        assert isinstance(e, errs.CommunicatorError), errors
        assert "broadcast #1 (agreeing on its root, size and type first)" in str(e), errors
        assert "48 bytes" not in str(e) and "int64" not in str(e), errors


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_mismatched_op_is_shown_in_the_error(transport: str) -> None:
    # Same bytes, dtype and sequence: the op is all that differs, and the error must
    # say so rather than show two identical descriptions.
    with thread_ring(2, timeout=20.0, transport=transport) as comms:
        ops = [ReduceOp.SUM, ReduceOp.MAX]
        errors = parallel([lambda c=c: c.all_reduce(np.ones(4), ops[c.rank]) for c in comms])
    for e in errors:
        assert isinstance(e, errs.CommunicatorError), errors
        assert re.search(
            r"SUM of float64.*MAX of float64|MAX of float64.*SUM of float64", str(e)
        ), errors


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_float16_average_of_in_range_values_stays_in_range(transport: str) -> None:
    # 3 x 40000 overflows float16 (max 65504); their average does not, and NCCL's AVG
    # (a premultiplied sum) returns it.
    with thread_ring(3, transport=transport) as comms:
        arrays = [np.full(1001, 40000, np.float16) for _ in comms]
        parallel([lambda c=c: c.all_reduce(arrays[c.rank], ReduceOp.AVG) for c in comms])
    for a in arrays:
        np.testing.assert_allclose(a.astype(np.float64), 40000, rtol=2e-3)
        assert a.tobytes() == arrays[0].tobytes()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_average_scales_each_input_by_nccls_premultiplier(transport: str, dtype: Any) -> None:
    # NCCL's AVG on floats is a sum of x * T(float(1.0/nRanks)): for a world of 3 that
    # product differs from x / 3 in the last bit for about a third of the values.
    values = (np.arange(1, 2001) * 1.37).astype(dtype)
    scale = dtype(np.float32(1.0 / 3)) if np.dtype(dtype).itemsize <= 4 else dtype(1.0 / 3)
    scaled = values * scale
    expected = scaled + scaled + scaled  # identical inputs: every summing order agrees
    divided = values / dtype(3)
    assert (divided + divided + divided).tobytes() != expected.tobytes()  # tells them apart
    with thread_ring(3, transport=transport) as comms:
        arrays = [values.copy() for _ in comms]
        parallel([lambda c=c: c.all_reduce(arrays[c.rank], ReduceOp.AVG) for c in comms])
    for a in arrays:
        assert a.tobytes() == expected.tobytes()


def test_wrong_secret_is_rejected_and_never_shown() -> None:
    """Each side's MAC is refused by the other, so neither waits for its timeout, but
    for one race: a rank whose own dial was refused fails and closes its listener, and
    its peer's dial, when it comes only after that (a thread started late on a loaded
    machine, once in a CI run), is refused as a listener not up yet is. That peer waits
    out its timeout, and its error names the handshake it rejected."""
    other = bytes(reversed(SECRET))
    socks, addrs = _listeners(2)
    started = time.monotonic()
    outcome = parallel(
        [
            lambda: CpuRingCommunicator(0, 2, socks[0], addrs, SECRET, 8.0),
            lambda: CpuRingCommunicator(1, 2, socks[1], addrs, other, 8.0),
        ]
    )
    took = time.monotonic() - started
    for result in outcome:
        assert isinstance(result, errs.PeerConnectionError | errs.CommunicatorTimeout), result
        assert "rejected" in str(result), result
        text = str(result)
        assert SECRET.hex() not in text and other.hex() not in text and "\\x" not in text
    raced = any(isinstance(r, errs.CommunicatorTimeout) for r in outcome)
    assert raced or took < 5.0, (took, outcome)


def test_a_rank_of_another_rendezvousd_version_is_refused_as_such() -> None:
    """Nodes of one job running two rendezvousd versions (a rolling upgrade, one node's
    venv behind): the ring's handshake passed, its wire version having never been
    raised, then a broadcast met a frame it did not expect, or integer averages came
    out two ways, with exit 0 (found by review). A rank of another wire version is
    refused, and told so."""
    socks, addrs = _listeners(2)
    old = peer_auth.PeerAuth(peer_auth.derive_key(SECRET), b"RDVRING2", 1, 2)

    def old_rank() -> None:
        conn, _ = socks[1].accept()
        with conn:
            conn.settimeout(10.0)
            conn.sendall(peer_auth.Acceptance(old, lambda _: True).challenge)
            with contextlib.suppress(OSError):
                conn.recv(1)  # until rank 0 hangs up

    new, _ = parallel([lambda: CpuRingCommunicator(0, 2, socks[0], addrs, SECRET, 5.0), old_rank])
    assert isinstance(new, errs.PeerConnectionError), new
    assert (
        "rank 0: rank 1 at 127.0.0.1:" in str(new)
        and "runs another version of rendezvousd (wire version 2 of RDVRING, this rank's is 3): "
        "every node of a job must run the same rendezvousd version"
        in str(new)
    ), new


def test_a_peer_that_failed_on_our_rejection_is_named_when_its_listener_is_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The race above, made certain: rank 1 dials only after rank 0 failed on rank
    1's rejection and closed its listener. Rank 1's timeout said only "rank 0 was not
    reachable within T s", hiding the rejected handshake that was the cause."""
    connect = ring_wire._connect

    def late(auth: Any, peer: int, *rest: Any) -> Any:
        if auth.rank == 1:
            time.sleep(1.0)
        return connect(auth, peer, *rest)

    monkeypatch.setattr(ring_wire, "_connect", late)
    socks, addrs = _listeners(2)
    other = bytes(reversed(SECRET))
    first, second = parallel(
        [
            lambda: CpuRingCommunicator(0, 2, socks[0], addrs, SECRET, 3.0),
            lambda: CpuRingCommunicator(1, 2, socks[1], addrs, other, 3.0),
        ]
    )
    assert isinstance(first, errs.PeerConnectionError) and "rejected" in str(first), first
    assert isinstance(second, errs.CommunicatorTimeout), second
    # Its dial's timeout ("this rank rejected a connection meanwhile: ..."), or its
    # acceptor's ("last rejected connection: ..."), whichever ends first: both name it.
    assert re.search(r"rejected a connection|last rejected connection", str(second)), second
    assert re.search(
        r"from 127\.0\.0\.1:\d+: failed authentication \(a process of another job, or of an "
        r"earlier generation, dialled this rank's ring port\)",
        str(second),
    ), second


@pytest.mark.parametrize("absent", ["nothing listens", "never accepts"])
def test_a_rank_that_never_shows_up_is_named_with_the_timeout(absent: str) -> None:
    """World 3, rank 2 never starts: rank 0 (whose left neighbour it is) waits out the
    timeout for its connection, rank 1 (whose right neighbour it is) for its answer at
    its address, a port nothing listens on, or one whose process never accepts. Each
    names the rank it waited for, and the timeout, once the timeout is out."""
    socks, addrs = _listeners(3)
    socks[2].close()
    with contextlib.ExitStack() as stack:
        if absent == "never accepts":
            silent = stack.enter_context(socket.create_server(("127.0.0.1", 0)))
            addrs[2] = ("127.0.0.1", silent.getsockname()[1])
        started = time.monotonic()
        outcome = parallel(
            [lambda r=r: CpuRingCommunicator(r, 3, socks[r], addrs, SECRET, 3.0) for r in (0, 1)]
        )
        took = time.monotonic() - started
    for c in outcome:
        if isinstance(c, CpuRingCommunicator):
            c.close()
    left_of_absent, right_of_absent = outcome
    assert isinstance(left_of_absent, errs.CommunicatorTimeout), left_of_absent
    assert str(left_of_absent) == "rank 0: rank 2 did not connect and authenticate within 3 s"
    assert isinstance(right_of_absent, errs.CommunicatorTimeout), right_of_absent
    where = f"rank 1: rank 2 at 127.0.0.1:{addrs[2][1]}"
    if absent == "nothing listens":
        said = f"{where} was not reachable within 3 s (last attempt: Connection refused (ECONNREFUSED))"
    else:
        said = f"{where} did not complete the handshake within 3 s"
    assert str(right_of_absent) == said, right_of_absent
    assert 2.9 < took < 12.0, took


def test_stray_connections_do_not_block_the_ring() -> None:
    socks, addrs = _listeners(2)
    strays = []
    for payload in (b"", b"GET / HTTP/1.1\r\n\r\n", bytes(84)):
        s = socket.create_connection(addrs[0])
        if payload:
            s.sendall(payload)
        strays.append(s)
    started = time.monotonic()
    comms = parallel(
        [lambda r=r: CpuRingCommunicator(r, 2, socks[r], addrs, SECRET, 10.0) for r in range(2)]
    )
    try:
        assert all(isinstance(c, CpuRingCommunicator) for c in comms), comms
        assert time.monotonic() - started < 3.0
        arrays = [np.full(5, r, np.int32) for r in range(2)]
        parallel([lambda c=c: c.all_reduce(arrays[c.rank]) for c in comms])
        assert (arrays[0] == 1).all()
    finally:
        for s in strays:
            s.close()
        for c in comms:
            if isinstance(c, CpuRingCommunicator):
                c.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sigkilled_peer_is_named_by_the_survivors(transport: str) -> None:
    # World 4: rank 3 is not adjacent to rank 1 and learns of it from a forwarded notice.
    with process_ring(4, "kill", transport) as (procs, conns):
        for c in conns:
            assert json.loads(_recv(c)) == {"started": True}
        started = time.monotonic()
        procs[1].kill()
        reports = [json.loads(_recv(conns[r])) for r in (0, 2, 3)]
        elapsed = time.monotonic() - started
    assert elapsed < 20.0
    for report in reports:
        assert report["error"] in ("PeerConnectionError", "CommunicatorTimeout"), report
        assert "rank 1" in report["message"], report


# -- arguments and lifecycle --------------------------------------------------------------


def test_bad_arguments_raise_and_leave_the_ring_usable() -> None:
    with thread_ring(2) as comms:
        bad: list[tuple[Any, Any]] = [
            (np.ones((4, 4), np.float32)[:, 1], ReduceOp.SUM),  # non-contiguous
            (np.frombuffer(bytes(16), np.float32), ReduceOp.SUM),  # read-only
            (np.ones(4, np.complex64), ReduceOp.SUM),
            (np.ones(4, bool), ReduceOp.SUM),
            (np.ones(4, ">f4"), ReduceOp.SUM),
            ([1.0, 2.0], ReduceOp.SUM),
            (np.ones(4, np.float32), "sum"),
        ]
        for array, op in bad:
            for comm in comms:  # each names its rank, as every other error does
                with pytest.raises(
                    errs.CollectiveArgumentError, match=f"^rank {comm.rank}: "
                ) as info:
                    comm.all_reduce(array, op)
                assert isinstance(info.value, (errs.TrainerError, ValueError))
        with pytest.raises(errs.CollectiveArgumentError, match="root"):
            comms[0].broadcast(np.ones(3), root=2)
        arrays = [np.ones(3, np.float32) for _ in range(2)]
        parallel([lambda c=c: c.all_reduce(arrays[c.rank]) for c in comms])
        assert (arrays[0] == 2).all()


def test_constructor_validates_configuration() -> None:
    socks, addrs = _listeners(1)
    try:
        with pytest.raises(errs.ConfigError, match="rank"):
            CpuRingCommunicator(1, 1, socks[0], addrs, SECRET, 1.0)
        with pytest.raises(errs.ConfigError, match="secret"):
            CpuRingCommunicator(0, 1, socks[0], addrs, b"short", 1.0)
        with pytest.raises(errs.ConfigError, match="timeout"):
            CpuRingCommunicator(0, 1, socks[0], addrs, SECRET, 0.0)
        with pytest.raises(errs.ConfigError, match="slow_peer_warn_s must be a positive"):
            CpuRingCommunicator(0, 1, socks[0], addrs, SECRET, 1.0, slow_peer_warn_s=0.0)
        with pytest.raises(errs.ConfigError, match="addresses"):
            CpuRingCommunicator(0, 2, socks[0], addrs, SECRET, 1.0)
        # By rank, the right neighbour's address is the one a listening rank needs.
        with pytest.raises(errs.ConfigError, match=r"addresses of ranks \[1\]"):
            CpuRingCommunicator(0, 3, socks[0], {2: addrs[0]}, SECRET, 1.0)
        with pytest.raises(errs.ConfigError, match=r"addresses of ranks \[0\]"):
            CpuRingCommunicator(0, 3, "127.0.0.1", {1: addrs[0]}, SECRET, 1.0)
    finally:
        socks[0].close()


def test_a_ring_needs_only_each_ranks_right_neighbour() -> None:
    socks, addrs = _listeners(3)
    comms = parallel(
        [
            lambda r=r: CpuRingCommunicator(
                r, 3, socks[r], {(r + 1) % 3: addrs[(r + 1) % 3]}, SECRET, 10.0
            )
            for r in range(3)
        ]
    )
    try:
        assert all(isinstance(c, CpuRingCommunicator) for c in comms), comms
        arrays = [np.full(7, r + 1, np.int64) for r in range(3)]
        parallel([lambda c=c: c.all_reduce(arrays[c.rank]) for c in comms])
        assert all((a == 6).all() for a in arrays), arrays
    finally:
        for c in comms:
            if isinstance(c, CpuRingCommunicator):
                c.close()


def test_close_is_idempotent_and_final() -> None:
    with thread_ring(2) as comms:
        comms[0].close()
        comms[0].close()
        with pytest.raises(errs.CommunicatorError, match="closed"):
            comms[0].all_reduce(np.ones(2))


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("roots", [(1, 0), (0, 0, 1), (2, 2, 1)])
def test_ranks_that_disagree_on_a_broadcasts_root_are_told_at_once(
    transport: str, roots: tuple[int, ...]
) -> None:
    # (1, 0): each rank took the other for the root, so both waited for data no one
    # sent, until the collective timeout (20 s here, 300 s by default).
    started = time.monotonic()
    with thread_ring(len(roots), timeout=20.0, transport=transport) as comms:
        errors = parallel(
            [lambda c=c: c.broadcast(np.ones(4, np.float32), root=roots[c.rank]) for c in comms],
            limit=30,
        )
        assert time.monotonic() - started < 10, errors
        for e in errors:
            assert isinstance(e, errs.CommunicatorError), errors
            assert not isinstance(e, errs.CommunicatorTimeout), errors
            low, high = min(roots), max(roots)
            assert f"CPU broadcast: the ranks disagree on its root {low} to {high}" in str(e)
        # Nothing was sent, so the ring goes on (it used to break here, as NCCL did not).
        arrays = [np.full(3, c.rank + 1, np.int64) for c in comms]
        done = parallel(
            [lambda c=c, a=a: c.broadcast(a, root=1) for c, a in zip(comms, arrays, strict=True)]
        )
        assert done == [None] * len(comms), done
        assert all(a.tolist() == [2, 2, 2] for a in arrays), arrays


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ranks_that_disagree_on_a_broadcasts_size_or_type_are_told_and_go_on(
    transport: str,
) -> None:
    shapes = [(np.float32, 4), (np.float32, 5), (np.float64, 4)]
    with thread_ring(3, timeout=20.0, transport=transport) as comms:
        errors = parallel(
            [lambda c=c: c.broadcast(np.ones(shapes[c.rank][1], shapes[c.rank][0])) for c in comms],
            limit=30,
        )
        for e in errors:
            assert isinstance(e, errs.CommunicatorError), errors
            assert re.search(r"disagree on its element count 4 to 5, dtype code \d+ to \d+", str(e))
        arrays = [np.full(2, c.rank + 1.0) for c in comms]
        done = parallel(
            [lambda c=c, a=a: c.all_reduce(a) for c, a in zip(comms, arrays, strict=True)]
        )
        assert done == [None] * 3, done
        assert all(a.tolist() == [6.0, 6.0] for a in arrays), arrays


def test_a_peer_host_that_answers_no_connect_is_said_once_while_the_ring_forms(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Nodes cut apart at launch (a chaos review on namespace hosts): one connect waited
    the whole setup timeout (300 s) without a word. A full accept queue drops SYNs as a
    cut does: each connect is capped, the silence said once, and asked again."""
    monkeypatch.setattr(ring_wire, "CONNECT_ATTEMPT_S", 0.3)
    with socket.create_server(("127.0.0.1", 0), backlog=0) as silent:
        address = silent.getsockname()[:2]
        filler = socket.create_connection(address)  # the queue's one place taken
        try:
            auth = peer_auth.PeerAuth(peer_auth.derive_key(SECRET), b"RDVRING3", 0, 2)
            started = time.monotonic()
            with (
                caplog.at_level("WARNING", "rendezvousd.trainer"),
                pytest.raises(errs.CommunicatorTimeout, match=r"not reachable within 2 s"),
            ):
                ring_wire._connect(auth, 1, address, started + 2.0, 2.0)
        finally:
            filler.close()
    said = [r.getMessage() for r in caplog.records if "answers no TCP connect" in r.getMessage()]
    assert said == [
        f"rank 0: rank 1 at {address[0]}:{address[1]} answers no TCP connect within 0.3 s (the "
        "network between the two hosts cut, a firewall dropping it, or that host down); "
        "asking again until the setup's deadline, 2 s from now"
    ], said
    assert time.monotonic() - started < 4.0


def test_a_peer_that_refuses_every_connect_is_said_once_while_the_ring_forms(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A firewall rejecting the ring's connects (REJECT, tcp-reset) was asked again in
    silence up to the setup's deadline (300 s): the job looked hung (h160's
    ring_oneway_reject). A port nobody listens on refuses alike."""
    monkeypatch.setattr(ring_wire, "REFUSED_SAID_S", 0.3)
    with socket.create_server(("127.0.0.1", 0)) as gone:
        address = gone.getsockname()[:2]  # closed below: connects to it are refused
    auth = peer_auth.PeerAuth(peer_auth.derive_key(SECRET), b"RDVRING3", 0, 2)
    origin = "node 1's (host n2), chosen as its host's route to the daemon"
    started = time.monotonic()
    with (
        caplog.at_level("WARNING", "rendezvousd.trainer"),
        pytest.raises(errs.CommunicatorTimeout, match=r"not reachable within 1\.5 s"),
    ):
        ring_wire._connect(auth, 1, address, started + 1.5, 1.5, origin)
    said = [r.getMessage() for r in caplog.records if "refuses or resets" in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].startswith(
        f"rank 0: rank 1 at {address[0]}:{address[1]} refuses or resets every TCP connect "
        "for 0 s: Connection refused (ECONNREFUSED) (no process listens there, or a "
        f"firewall rejects it); that address is {origin} (the one to fix"
    ), said
    assert said[0].endswith("; asking again until the setup's deadline, 1 s from now"), said
    assert time.monotonic() - started < 4.0


def test_a_reset_link_names_the_peer_or_a_firewall_between_not_the_peer_alone() -> None:
    """ "connection error: Connection reset by peer" blamed the healthy peer when a
    firewall on this host sent the reset (h160)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        ours = socket.create_connection(server.getsockname()[:2], timeout=5)
        theirs, _ = server.accept()
    with ours, theirs:
        # Closed with unread data and no linger: the kernel resets the connection.
        theirs.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        theirs.close()
        ring_wire.set_io_timeout(ours, 5.0)
        with pytest.raises(ring_wire.LinkError) as info:
            ring_wire.recv_exact(ours, memoryview(bytearray(8)), 1)
    assert info.value.detail == "connection reset (by rank 1's host, or a firewall between)"


def _ring_behind_a_route(route: str, ending: str) -> dict[str, Any]:
    """tests/workers/ring_route_worker.py in a network namespace of its own: its
    routes vanish with it, and the host's network is untouched."""
    probe = ["unshare", "--net", "--map-root-user", "ip", "link", "set", "lo", "up"]
    try:
        allowed = subprocess.run(probe, capture_output=True, check=False).returncode == 0
    except FileNotFoundError:
        allowed = False
    if not allowed:
        pytest.skip("no network namespace here (unshare --net --map-root-user, ip)")
    worker = WORKERS / "ring_route_worker.py"
    done = subprocess.run(
        ["unshare", "--net", "--map-root-user", sys.executable, str(worker), route, ending],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


ROUTE_ERRORS = [("unreachable", "No route to host (EHOSTUNREACH)"),
                ("none", "Network is unreachable (ENETUNREACH)")]  # fmt: skip


@pytest.mark.parametrize(("route", "words"), ROUTE_ERRORS)
def test_a_ring_whose_peer_has_no_route_yet_forms_once_the_route_is_back(
    route: str, words: str
) -> None:
    """A short cut between two nodes (an operator review: ``ip route add unreachable``
    for 25 s) failed each generation's ring at its first connect, "No route to host",
    and used the job's 3 restarts in 7 s, though the docs say a cut at setup is asked
    again until the setup's deadline: now it is, and the ring forms once the route is
    back, having said the cut once, naming the errno and the peer."""
    result = _ring_behind_a_route(route, "heals")
    assert "formed_after_s" in result, result
    assert result["formed_after_s"] >= 1.0, result
    assert result["warnings"] == [
        f"rank 0: rank 1 at 198.18.118.2:{result['port']} cannot be reached: {words} (the "
        "network between the two hosts is down or its route is missing); asking again "
        "until the setup's deadline, 20 s from now"
    ], result


@pytest.mark.parametrize(("route", "words"), ROUTE_ERRORS)
def test_a_ring_whose_peer_never_gets_a_route_ends_at_the_setup_deadline_naming_why(
    route: str, words: str
) -> None:
    result = _ring_behind_a_route(route, "never")
    assert result.get("error") == (
        f"CommunicatorTimeout: rank 0: rank 1 at 198.18.118.2:{result['port']} was not "
        f"reachable within 2 s (last attempt: {words})"
    ), result


def test_a_left_neighbour_that_never_connects_is_told_where_this_ranks_address_came_from() -> None:
    """A rank whose own advertised address its left neighbour cannot reach said only
    "rank 1 did not connect and authenticate": the root cause blamed it, naming neither
    its address nor the setting that chose it (a review on namespace hosts). Now it says
    both, and what to set on which node."""
    auth = peer_auth.PeerAuth(peer_auth.derive_key(bytes(128)), b"RDVRTEST", 0, 2)
    origin = "node 0's (host n1), chosen as its host's route to the daemon at 198.19.0.1:29420"
    with ring_wire.create_listener("127.0.0.1") as listener:
        port = listener.getsockname()[1]
        acceptor = ring_wire._Acceptor(auth, listener, 0.05, origin)
        with pytest.raises(errs.CommunicatorTimeout) as caught:
            acceptor.run(time.monotonic() + 0.05, lambda: False)
    said = str(caught.value)
    assert said.startswith("rank 0: rank 1 did not connect and authenticate within 0.05 s"), said
    assert f"if rank 1 cannot reach this rank's address 127.0.0.1:{port}, that address is " in said
    assert said.endswith(
        f"{origin}: if the hosts reach each other on another network, set --ring-host "
        "($RENDEZVOUSD_RING_HOST, ring_host) on node 0 to its address there"
    ), said


#: TEST-NET-1 (RFC 5737): an address no host here has, which a bind refuses with
#: EADDRNOTAVAIL, as it does an address its host held until it was re-addressed.
GONE = "192.0.2.1"


def _says_the_address_is_gone(error: OSError, origin: str) -> None:
    said = str(error)
    assert error.errno == errno.EADDRNOTAVAIL, said
    assert (
        f"cannot listen for the ring on {GONE}: {GONE} is no longer an address of this host ("
        in said
    )
    assert f"({GONE} was {origin})" in said, said
    assert "the host's address changed" in said, said
    assert "--ring-host ($RENDEZVOUSD_RING_HOST, ring_host) must be changed" in said, said


def test_a_ring_address_no_longer_on_this_host_is_named_with_why(daemon: Any, job_id: str) -> None:
    """A node re-addressed under a running agent (h170): its workers failed to bind the
    old address with a bare "OSError: [Errno 99] Cannot assign requested address", the
    cause of record of every restart, naming neither the address nor why. Both places a
    rank binds its ring listener say it: the connect's, and a listener given by host."""
    origin = "chosen as its host's route to the daemon at 198.18.0.1:29420"
    with (
        RendezvousClient(daemon.endpoint, job_id, token_file=daemon.token_file) as store,
        pytest.raises(OSError) as caught,
    ):
        connect_cpu_ring(
            store,
            rank=1,
            world_size=2,
            secret=SECRET,
            host=GONE,
            timeout=1.0,
            nodes=2,
            origin=origin,
        )
    _says_the_address_is_gone(caught.value, origin)
    told = "node 1's (host n2), " + origin
    with pytest.raises(OSError) as caught:
        CpuRingCommunicator(
            1, 2, GONE, [("127.0.0.1", 1), (GONE, 0)], SECRET, 1.0, origins={1: told}
        )
    _says_the_address_is_gone(caught.value, told)
