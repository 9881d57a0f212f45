"""Bucketed all-reduce: layout planning (pure), pack/unpack, overlap, and a 2-rank run.

The single-process tests drive the reducer with small in-test communicators
(world 1, or a world-2 stand-in whose other rank holds identical gradients);
the multi-rank equality test uses the real CPU ring communicator in real
processes and is skipped until ``trainer/comm/cpu_ring.py`` exists.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import socket
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rendezvousd.trainer import errors as errs
from rendezvousd.trainer.bucketing import (
    BucketedAllReducer,
    GradSpec,
    layout_fingerprint,
    layout_verdict,
    pack,
    plan_buckets,
    unpack,
)
from rendezvousd.trainer.comm.communicator import Communicator, RankedCommunicator, ReduceOp
from rendezvousd.trainer.config import DistributedConfig

F32 = 4


def f32(*numels: int) -> list[GradSpec]:
    return [GradSpec((n,), "float32", F32) for n in numels]


def members(buckets: Any) -> list[tuple[int, ...]]:
    return [b.grads for b in buckets]


class SoloCommunicator:
    """World size ``world_size`` seen from one rank whose peers hold identical data.

    SUM multiplies by the world size, which is exactly what a real group of
    identical ranks would produce, so averaging must give the input back.
    """

    def __init__(self, world_size: int = 1) -> None:
        self.world_size = world_size
        self.rank = 0
        self.backend = "test"
        self.calls: list[tuple[int, int]] = []  # (buffer address, element count)
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()
        self.fail_on_call: int | None = None

    def all_reduce(self, array: Any, op: ReduceOp = ReduceOp.SUM) -> None:
        assert op is ReduceOp.SUM and array.flags.c_contiguous
        self.calls.append((array.ctypes.data, array.size))
        self.entered.set()
        assert self.release.wait(10)
        if self.fail_on_call == len(self.calls):
            raise errs.CommunicatorError("rank 0: all_reduce failed: peer reset")
        array *= self.world_size

    def broadcast(self, array: Any, root: int = 0) -> None: ...
    def barrier(self) -> None: ...
    def abort(self, reason: str) -> None: ...
    def close(self) -> None: ...


def test_solo_communicator_satisfies_protocol() -> None:
    assert isinstance(SoloCommunicator(), Communicator)


# --- planning ------------------------------------------------------------


def test_reverse_order_and_overshoot_by_one_tensor() -> None:
    # 25-element grads, cap 60 elements: the third grad overshoots, never splits.
    buckets = plan_buckets(f32(25, 25, 25, 25, 25), cap_bytes=60 * F32, first_bucket_bytes=None)
    assert members(buckets) == [(4, 3, 2), (1, 0)]
    assert buckets[0].nbytes == 75 * F32 and buckets[0].offsets == (0, 25, 50)


def test_tensor_at_least_cap_gets_own_bucket() -> None:
    buckets = plan_buckets(f32(10, 500, 10, 10), cap_bytes=100 * F32, first_bucket_bytes=None)
    assert members(buckets) == [(3, 2), (1,), (0,)]


def test_sizes_straddling_the_cap() -> None:
    exact = plan_buckets(f32(4, 96, 4), cap_bytes=100 * F32, first_bucket_bytes=None)
    assert members(exact) == [(2, 1), (0,)]  # 100 == cap closes the bucket
    under = plan_buckets(f32(4, 95, 4), cap_bytes=100 * F32, first_bucket_bytes=None)
    assert members(under) == [(2, 1, 0)]  # 99 < cap stays open, last tensor overshoots


def test_first_bucket_cap_is_smaller_and_per_dtype() -> None:
    specs = f32(30, 30, 30, 30, 30, 30) + [GradSpec((30,), "float16", 2)] * 2
    buckets = plan_buckets(specs, cap_bytes=100 * F32, first_bucket_bytes=20 * F32)
    assert members(buckets) == [(7, 6), (5,), (4, 3, 2, 1), (0,)]
    assert [b.dtype for b in buckets] == ["float16"] + ["float32"] * 3


def test_mixed_dtypes_never_share_a_bucket() -> None:
    specs = [
        GradSpec((8,), "float32", 4),
        GradSpec((8,), "float16", 2),
        GradSpec((8,), "float32", 4),
        GradSpec((8,), "float64", 8),
    ]
    buckets = plan_buckets(specs, cap_bytes=1 << 20, first_bucket_bytes=None)
    assert {(b.dtype, b.grads) for b in buckets} == {
        ("float64", (3,)),
        ("float32", (2, 0)),
        ("float16", (1,)),
    }
    assert members(buckets) == [(3,), (2, 0), (1,)]  # by first appearance in backward


def test_zero_size_gradients_take_no_bucket() -> None:
    specs = [GradSpec((0, 3), "float32", 4), *f32(5), GradSpec((0,), "float32", 4)]
    assert members(plan_buckets(specs, cap_bytes=1024)) == [(1,)]


def test_bad_caps_are_rejected() -> None:
    with pytest.raises(errs.ConfigError, match="cap_bytes"):
        plan_buckets(f32(1), cap_bytes=0)
    with pytest.raises(errs.ConfigError, match="first_bucket_bytes"):
        plan_buckets(f32(1), cap_bytes=10, first_bucket_bytes=0)
    # A first-bucket cap above the cap is clamped to it.
    assert plan_buckets(f32(2, 2, 2), cap_bytes=8, first_bucket_bytes=1 << 20) == plan_buckets(
        f32(2, 2, 2), cap_bytes=8, first_bucket_bytes=None
    )


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(0, 300), st.sampled_from([2, 4, 8])), max_size=30),
    cap=st.integers(1, 2000),
    first=st.one_of(st.none(), st.integers(1, 2000)),
)
def test_plan_invariants(sizes: list[tuple[int, int]], cap: int, first: int | None) -> None:
    names = {2: "float16", 4: "float32", 8: "float64"}
    specs = [GradSpec((n,), names[size], size) for n, size in sizes]
    buckets = plan_buckets(specs, cap_bytes=cap, first_bucket_bytes=first)
    placed = [i for b in buckets for i in b.grads]
    assert sorted(placed) == [i for i, s in enumerate(specs) if s.nbytes > 0]
    for bucket in buckets:
        assert {specs[i].dtype for i in bucket.grads} == {bucket.dtype}
        assert list(bucket.grads) == sorted(bucket.grads, reverse=True)
        # Never closed early: everything but the last tensor stayed under the cap.
        assert sum(specs[i].nbytes for i in bucket.grads[:-1]) < cap
        if len(bucket.grads) > 1:
            assert all(specs[i].nbytes < cap for i in bucket.grads)
        assert (bucket.buffer_offset * specs[bucket.grads[0]].itemsize) % 256 == 0
    firsts = [b.grads[0] for b in buckets]
    assert firsts == sorted(firsts, reverse=True)
    for dtype in {b.dtype for b in buckets}:
        spans = sorted(
            (b.buffer_offset, b.buffer_offset + b.numel) for b in buckets if b.dtype == dtype
        )
        assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))


# --- fingerprint -----------------------------------------------------------


def fingerprint(
    specs: list[GradSpec], cap: int = 1024, first: int | None = 256, avg: bool = True
) -> str:
    buckets = plan_buckets(specs, cap_bytes=cap, first_bucket_bytes=first)
    return layout_fingerprint(specs, buckets, cap_bytes=cap, first_bucket_bytes=first, average=avg)


def test_fingerprint_is_stable_and_sensitive() -> None:
    base = f32(10, 300, 7)
    fp = fingerprint(base)
    assert fp == fingerprint(f32(10, 300, 7)) and len(fp) == 64 and int(fp, 16) >= 0
    variants = [
        fingerprint(base, cap=2048),
        fingerprint(base, first=None),
        fingerprint(base, avg=False),
        fingerprint(f32(10, 7, 300)),
        fingerprint(f32(10, 300, 8)),
        fingerprint([GradSpec((10,), "float16", 2), *f32(300, 7)]),
        fingerprint([GradSpec((2, 5), "float32", 4), *f32(300, 7)]),
    ]
    assert len({fp, *variants}) == len(variants) + 1


def test_reducer_fingerprint_matches_pure_function() -> None:
    grads = [np.zeros(10, np.float32), np.zeros(300, np.float32), np.zeros(7, np.float32)]
    with BucketedAllReducer(
        grads, SoloCommunicator(), cap_bytes=1024, first_bucket_bytes=256
    ) as reducer:
        assert reducer.layout_fingerprint() == fingerprint(f32(10, 300, 7))


def test_layout_verdict_names_the_odd_ranks() -> None:
    assert layout_verdict({0: "a", 1: "a", 2: "a"}) == ("a", [])
    assert layout_verdict({0: "a", 1: "b", 2: "a", 3: "b", 4: "b"}) == ("b", [0, 2])
    assert layout_verdict({0: "a", 1: "b"}) == ("a", [1])  # tie: rank 0 wins


# --- pack / unpack ------------------------------------------------------------


def test_pack_unpack_round_trip_with_strided_views() -> None:
    rng = np.random.default_rng(0)
    base = rng.standard_normal((6, 8)).astype(np.float32)
    grads = [base[:, ::2], base.T[1:4], rng.standard_normal(5).astype(np.float32), base[0, 0:1]]
    assert not grads[0].flags.c_contiguous and not grads[1].flags.c_contiguous
    offsets = [0, 24, 42, 47]
    flat = np.zeros(48, np.float32)
    pack(flat, grads, offsets, 1, np)
    expected = np.concatenate([g.reshape(-1) for g in grads])
    np.testing.assert_array_equal(flat, expected)
    flat *= 3
    before = base.copy()
    unpack(flat, grads, offsets)
    np.testing.assert_array_equal(grads[2], expected[42:47] * 3)
    touched = np.zeros_like(base, dtype=bool)
    touched[:, ::2] = True
    touched.T[1:4] = True
    touched[0, 0] = True
    np.testing.assert_array_equal(base[~touched], before[~touched])
    np.testing.assert_array_equal(base[:, ::2], before[:, ::2] * 3)


def test_pre_division_keeps_fp16_finite() -> None:
    grad = np.full(4, 60000, np.float16)
    flat = np.empty(4, np.float16)
    pack(flat, [grad], [0], 2, np)
    assert np.all(flat == 30000)
    assert np.all(np.isfinite(flat + flat))  # what a 2-rank SUM of pre-divided halves yields
    with np.errstate(over="ignore"):
        assert not np.all(np.isfinite(grad + grad))


# --- the reducer -------------------------------------------------------------


def make_grads(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = [(16,), (4, 4), (0,), (33,), (2, 3, 5), (64,)]
    grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads.append(rng.standard_normal(9).astype(np.float16))
    return grads


def test_average_round_trips_and_sum_scales() -> None:
    grads = make_grads()
    expected = [g.copy() for g in grads]
    comm = SoloCommunicator(world_size=4)
    with BucketedAllReducer(grads, comm, cap_bytes=128, first_bucket_bytes=64) as reducer:
        assert len(reducer.buckets) > 3
        reducer.all_reduce_all()
        for got, want in zip(grads, expected, strict=True):
            np.testing.assert_array_equal(got, want)  # /4 then *4 is exact
        reducer.all_reduce_all()  # a second step reuses the buffers
        assert len(comm.calls) == 2 * len(reducer.buckets)
    summed = make_grads()
    with BucketedAllReducer(summed, SoloCommunicator(2), average=False) as reducer:
        reducer.wait()
    for got, want in zip(summed, expected, strict=True):
        np.testing.assert_array_equal(got, want * 2)


def test_strided_gradients_are_written_back_through_the_view() -> None:
    base = np.arange(48, dtype=np.float64).reshape(6, 8)
    grads = [base[:, 1::2], base[::2, ::2]]
    with BucketedAllReducer(grads, SoloCommunicator(3), average=False, cap_bytes=64) as reducer:
        reducer.all_reduce_all()
    original = np.arange(48, dtype=np.float64).reshape(6, 8)
    np.testing.assert_array_equal(base[:, 1::2], original[:, 1::2] * 3)
    np.testing.assert_array_equal(base[::2, ::2], original[::2, ::2] * 3)
    np.testing.assert_array_equal(base[1::2, ::2], original[1::2, ::2])


def test_bucket_launches_before_later_gradients_are_ready() -> None:
    grads = [np.ones(64, np.float32) for _ in range(4)]
    comm = SoloCommunicator()
    comm.release.clear()
    with BucketedAllReducer(grads, comm, cap_bytes=256, first_bucket_bytes=None) as reducer:
        assert members(reducer.buckets) == [(3,), (2,), (1,), (0,)]
        reducer.mark_ready(3)
        # Bucket 0 is in flight on the worker while gradients 0..2 are "computing".
        assert comm.entered.wait(5)
        assert len(comm.calls) == 1
        comm.release.set()
        for index in (2, 1, 0):
            reducer.mark_ready(index)
        reducer.wait()
    assert len(comm.calls) == 4


def test_buckets_launch_in_index_order_whatever_the_readiness_order() -> None:
    grads = [np.ones(64, np.float32) for _ in range(5)]
    comm = SoloCommunicator()
    with BucketedAllReducer(grads, comm, cap_bytes=256, first_bucket_bytes=None) as reducer:
        expected = [(reducer._views[i].ctypes.data, 64) for i in range(5)]
        for index in (0, 2, 1, 4, 3):
            reducer.mark_ready(index)
        reducer.wait()
    assert comm.calls == expected


def test_unmarked_and_zero_size_gradients_do_not_hang() -> None:
    grads = make_grads()
    comm = SoloCommunicator()
    with BucketedAllReducer(grads, comm) as reducer:
        reducer.mark_ready(2)  # the zero-size one: no bucket, no launch
        assert comm.calls == []
        reducer.wait()  # the rest is marked by wait()
        assert len(comm.calls) == len(reducer.buckets)
        with pytest.raises(
            errs.CollectiveArgumentError, match=r"rank 0: gradient index 7 is out of range 0\.\.6"
        ):
            reducer.mark_ready(len(grads))
        reducer.mark_ready(0)
        with pytest.raises(errs.BucketingError, match="already marked"):
            reducer.mark_ready(0)


def test_communicator_error_is_reraised_and_sticky() -> None:
    grads = [np.ones(64, np.float32) for _ in range(3)]
    comm = SoloCommunicator()
    comm.fail_on_call = 2
    reducer = BucketedAllReducer(grads, comm, cap_bytes=256, first_bucket_bytes=None)
    with pytest.raises(errs.CommunicatorError, match="peer reset"):
        reducer.all_reduce_all()
    assert len(comm.calls) == 2  # the bucket after the failed one never ran
    with pytest.raises(errs.CommunicatorError):
        reducer.mark_ready(0)
    reducer.close()
    reducer.close()


def test_bad_gradients_are_rejected() -> None:
    with pytest.raises(errs.CollectiveArgumentError, match="floating"):
        BucketedAllReducer([np.zeros(3, np.int32)], SoloCommunicator())
    readonly = np.zeros(3, np.float32)
    readonly.flags.writeable = False
    with pytest.raises(errs.CollectiveArgumentError, match="gradient 0 is read-only"):
        BucketedAllReducer([readonly], SoloCommunicator())
    with pytest.raises(errs.CollectiveArgumentError, match="numpy or CuPy"):
        BucketedAllReducer([[1.0, 2.0]], SoloCommunicator())
    with BucketedAllReducer([np.zeros(3, np.int32)], SoloCommunicator(), average=False) as r:
        r.all_reduce_all()


def test_a_gradient_registered_twice_is_refused() -> None:
    # A tied weight listed twice lands in two buckets here; the second would reduce
    # the first's result again: a sum over 2 ranks of ones came out 4, not 2. Views
    # that overlap without starting at the same address (g[1:], g[::-1]) were accepted
    # and their shared elements summed twice.
    for alias in (
        lambda g: g,
        lambda g: g.reshape(50, 20).T,
        lambda g: g[1:],
        lambda g: g[::-1],
        lambda g: g[500:510],
        lambda g: g.reshape(50, 20)[:, 3],
    ):
        tied = np.ones(1000, np.float32)
        grads = [tied, np.ones(1000, np.float32), alias(tied)]
        with pytest.raises(errs.CollectiveArgumentError, match="gradients 0 and 2 share memory"):
            BucketedAllReducer(grads, SoloCommunicator(2), cap_bytes=4000, average=False)
    # Disjoint views of one flat buffer are separate gradients, interleaved ones too,
    # and empty ones share nothing.
    flat = np.ones(20, np.float32)
    grads = [flat[:10], flat[10:], np.ones(0, np.float32), np.ones(0, np.float32)]
    with BucketedAllReducer(grads, SoloCommunicator(2), cap_bytes=8, average=False) as r:
        r.all_reduce_all()
    assert (flat == 2).all()
    woven = np.ones(20, np.float32)
    with BucketedAllReducer(
        [woven[::2], woven[1::2]], SoloCommunicator(2), cap_bytes=8, average=False
    ) as r:
        r.all_reduce_all()
    assert (woven == 2).all()


def test_closed_reducer_refuses_work() -> None:
    reducer = BucketedAllReducer([np.zeros(3, np.float32)], SoloCommunicator())
    reducer.close()
    with pytest.raises(errs.ReducerClosed, match="closed") as info:
        reducer.mark_ready(0)
    assert isinstance(info.value, errs.TrainerError)


def test_from_config_takes_the_caps_from_the_config() -> None:
    grads = [np.zeros(1024, np.float32) for _ in range(6)]  # 4 KiB each
    config = DistributedConfig(bucket_cap_mib=8 / 1024, first_bucket_mib=4 / 1024)
    with BucketedAllReducer.from_config(grads, SoloCommunicator(), config) as reducer:
        explicit = BucketedAllReducer(
            grads, SoloCommunicator(), cap_bytes=8192, first_bucket_bytes=4096
        )
        assert reducer.layout_fingerprint() == explicit.layout_fingerprint()
        explicit.close()
        # The 4 KiB first bucket, then 8 KiB buckets, filled in reverse order.
        assert members(reducer.buckets) == [(5,), (4, 3), (2, 1), (0,)]


# --- layout verification through a real daemon ---------------------------------


class CountingStore:
    """A client as the reducer's ``JobStore``, counting the calls made through it."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.calls: Counter[str] = Counter()

    def __getattr__(self, method: str) -> Any:
        self.calls[method] += 1
        return getattr(self.client, method)


def verify_in_threads(
    daemon: Any, job_id: str, caps: list[int], calls: list[Counter[str]] | None = None
) -> list[BaseException | None]:
    from rendezvousd.client import RendezvousClient

    outcomes: list[BaseException | None] = [None] * len(caps)

    def rank_main(local_rank: int) -> None:
        with RendezvousClient(
            daemon.endpoint, job_id, token_file=daemon.token_file, connect_timeout=10
        ) as client:
            try:
                m = client.join(
                    num_nodes=1,
                    gpus_per_node=len(caps),
                    node_rank=0,
                    local_rank=local_rank,
                    timeout=30,
                )
                grads = [np.zeros(100, np.float32) for _ in range(4)]
                comm = SoloCommunicator(m.world_size)
                cap = caps[m.rank]
                store = CountingStore(client)
                with BucketedAllReducer(grads, comm, cap_bytes=cap, first_bucket_bytes=None) as r:
                    r.verify_layout(store, m.rank, m.world_size, timeout=20)
                if calls is not None:
                    calls[m.rank] = store.calls
            except BaseException as exc:
                outcomes[local_rank] = exc
            finally:
                client.leave()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(len(caps))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return outcomes


@pytest.mark.slow
def test_verify_layout_passes_when_layouts_match(daemon: Any, job_id: str) -> None:
    assert verify_in_threads(daemon, job_id, [800, 800, 800]) == [None, None, None]


@pytest.mark.slow
def test_matching_layouts_cost_every_rank_the_same_three_calls(daemon: Any, job_id: str) -> None:
    """Not world_size - 1 reads on rank 0: a count, a barrier and one read on each."""
    calls: list[Counter[str]] = [Counter() for _ in range(5)]
    assert verify_in_threads(daemon, job_id, [800] * 5, calls) == [None] * 5
    for made in calls:
        assert made == Counter({"kv_add": 1, "barrier": 1, "kv_get": 1}), calls


@pytest.mark.slow
def test_verify_layout_fails_on_every_rank_naming_the_odd_one(daemon: Any, job_id: str) -> None:
    outcomes = verify_in_threads(daemon, job_id, [800, 800, 1600])
    for outcome in outcomes:
        assert isinstance(outcome, errs.BucketLayoutMismatch), outcome
        assert "rank(s) [2]" in str(outcome)


# --- two real ranks over the CPU ring ------------------------------------------

HAVE_RING = importlib.util.find_spec("rendezvousd.trainer.comm.cpu_ring") is not None

RANK_SCRIPT = """
import json, socket, sys
import numpy as np
from rendezvousd.trainer.bucketing import BucketedAllReducer
from rendezvousd.trainer.comm.cpu_ring import CpuRingCommunicator

rank, fd, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
peers = [tuple(p) for p in json.loads(sys.argv[4])]
listener = socket.socket(fileno=fd)
comm = CpuRingCommunicator(rank, 2, listener, peers, b"s" * 32, 20.0)
rng = np.random.default_rng(rank)
grads = [rng.standard_normal(n).astype(np.float32) for n in (1000, 7, 70000, 3)]
grads.append(rng.standard_normal((40, 30)).astype(np.float32).T)
with BucketedAllReducer(grads, comm, cap_bytes=64 * 1024, first_bucket_bytes=4096) as r:
    for i in reversed(range(len(grads))):
        r.mark_ready(i)
    r.wait()
comm.close()
np.savez(out, *[np.ascontiguousarray(g) for g in grads])
"""


@pytest.mark.slow
@pytest.mark.skipif(
    not HAVE_RING, reason="trainer/comm/cpu_ring.py (CpuRingCommunicator) not written yet"
)
def run_two_ranks(script: str, outputs: list[Path]) -> None:
    """``script`` as ranks 0 and 1 of a CPU ring, each in its own process, given its
    rank, its listening socket's descriptor, ``outputs[rank]`` and the peers."""
    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    peers = json.dumps([["127.0.0.1", s.getsockname()[1]] for s in listeners])
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(r), str(s.fileno()), str(outputs[r]), peers],
            pass_fds=(s.fileno(),),
        )
        for r, s in enumerate(listeners)
    ]
    for s in listeners:
        s.close()
    assert [p.wait(timeout=60) for p in procs] == [0, 0]


def test_two_rank_bucketed_all_reduce_equals_the_mean(tmp_path: Path) -> None:
    run_two_ranks(RANK_SCRIPT, [tmp_path / f"{r}.npz" for r in range(2)])
    results = [np.load(tmp_path / f"{r}.npz") for r in range(2)]
    inputs = []
    for rank in range(2):
        rng = np.random.default_rng(rank)
        grads = [rng.standard_normal(n).astype(np.float32) for n in (1000, 7, 70000, 3)]
        grads.append(rng.standard_normal((40, 30)).astype(np.float32).T)
        inputs.append(grads)
    for i, (a, b) in enumerate(zip(*inputs, strict=True)):
        mean = a / np.float32(2) + b / np.float32(2)
        np.testing.assert_array_equal(results[0][f"arr_{i}"], mean)
        np.testing.assert_array_equal(results[1][f"arr_{i}"], mean)


@pytest.mark.parametrize("average", [True, False])
def test_complex_gradients_are_refused_when_the_reducer_is_made(average: bool) -> None:
    grads = [np.ones(4, np.float32), np.ones(3, np.complex64)]
    with pytest.raises(errs.CollectiveArgumentError, match=r"complex gradients.*g\.view"):
        BucketedAllReducer(grads, SoloCommunicator(2), average=average)
    # Their real view is reduced as floats are.
    grads[1] = grads[1].view(np.float32)
    with BucketedAllReducer(grads, SoloCommunicator(2), average=average) as reducer:
        reducer.all_reduce_all()


@pytest.mark.parametrize("dtype", [np.bool_, np.longdouble])
def test_gradients_no_backend_reduces_are_refused_when_the_reducer_is_made(dtype: Any) -> None:
    """bool (average=False) and float128 were taken, then refused by the first bucket's
    all-reduce on the worker thread, a step later (a differential review)."""
    if dtype is np.longdouble and np.dtype(dtype).itemsize <= 8:
        pytest.skip("this platform's long double is a float64")
    grads = [np.ones(4, np.float32), np.ones(3, dtype)]
    with pytest.raises(errs.CollectiveArgumentError, match=r"no communicator reduces gradients of"):
        BucketedAllReducer(grads, SoloCommunicator(2), average=False)


@pytest.mark.parametrize("average", [True, False])
def test_bfloat16_gradients_are_refused_on_the_cpu_backend_when_the_reducer_is_made(
    average: bool,
) -> None:
    """The CPU ring has no bfloat16 type: the first bucket's all-reduce refused it on the
    worker thread, a step later (or the average check called it an integer)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    grads = [np.ones(4, np.float32), np.ones(3, ml_dtypes.bfloat16)]
    cpu = SoloCommunicator(2)
    cpu.backend = "cpu"
    with pytest.raises(
        errs.CollectiveArgumentError,
        match=r"rank 0: the cpu backend cannot reduce bfloat16 gradients.*astype",
    ):
        BucketedAllReducer(grads, cpu, average=average)
    # A backend that reduces it (NCCL's; this one multiplies) averages it as a float.
    with BucketedAllReducer(grads, SoloCommunicator(2), average=average) as reducer:
        reducer.all_reduce_all()
    np.testing.assert_array_equal(grads[1].astype(np.float32), np.full(3, 1.0 if average else 2.0))


class SoloRanked(RankedCommunicator):
    """A real RankedCommunicator of one rank (its collectives do nothing): what the
    reducer's hold on a communicator applies to."""

    _label = "solo"

    def __init__(self) -> None:
        super().__init__(0, 1)
        self.calls: list[tuple[str, int]] = []

    def all_reduce(self, array: Any, op: ReduceOp = ReduceOp.SUM) -> None:
        self.calls.append(("all_reduce", array.size))

    def broadcast(self, array: Any, root: int = 0) -> None:
        self.calls.append(("broadcast", array.size))

    def barrier(self) -> None:
        self.calls.append(("barrier", 0))

    def _max_across_ranks(self, values: Any, operation: str) -> Any:
        return values

    def abort(self, reason: str) -> None:
        pass

    def close(self) -> None:
        pass


def test_no_other_collective_runs_while_a_reducer_step_is_in_flight() -> None:
    """Ranks pair collectives by the order they start; a bucket starts on the reducer's
    thread whenever its gradients are ready, so a loss all-reduced between mark_ready()
    and wait() was paired with another rank's bucket of the same size and summed with
    it, silently (2 ranks: gradients 3.0 came out 2001.0 and 1002.0)."""
    comm = SoloRanked()
    grads = [np.ones(10, np.float32), np.ones(10, np.float32)]
    other = BucketedAllReducer([np.ones(5, np.float32)], comm, cap_bytes=40)
    with BucketedAllReducer(grads, comm, cap_bytes=40) as r:
        comm.all_reduce(np.ones(3, np.float32))  # before the step: fine
        r.mark_ready(0)
        for collective in (
            lambda: comm.all_reduce(np.ones(10, np.float32)),
            lambda: comm.broadcast(np.ones(10, np.float32)),
            comm.barrier,
        ):
            with pytest.raises(errs.CollectiveArgumentError, match=r"reducer's step .* in flight"):
                collective()
        with pytest.raises(errs.CollectiveArgumentError, match="one reducer's step at a time"):
            other.mark_ready(0)
        r.wait()
        comm.all_reduce(np.ones(4, np.float32))  # after wait(): fine
        other.all_reduce_all()  # the other reducer's step, now its turn
    other.close()
    assert comm.calls == [
        ("all_reduce", 3),
        ("all_reduce", 10),
        ("all_reduce", 10),
        ("all_reduce", 4),
        ("all_reduce", 5),
    ]


MIXED_SCRIPT = """
import json, socket, sys
import numpy as np
from rendezvousd.trainer.bucketing import BucketedAllReducer
from rendezvousd.trainer.comm.communicator import ReduceOp
from rendezvousd.trainer.comm.cpu_ring import CpuRingCommunicator
from rendezvousd.trainer.errors import CollectiveArgumentError

rank, fd, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
peers = [tuple(p) for p in json.loads(sys.argv[4])]
comm = CpuRingCommunicator(rank, 2, socket.socket(fileno=fd), peers, b"s" * 32, 20.0)
grads = [np.full(100_000, rank + 1, np.float32) for _ in range(4)]
user = np.full(100_000, 1000.0 * (rank + 1), np.float32)
refused = ""
with BucketedAllReducer(grads, comm, cap_bytes=400_000, average=False) as r:
    r.mark_ready(0)
    r.mark_ready(1)
    try:
        comm.all_reduce(user, ReduceOp.SUM)  # a loss, say, between the marks and wait()
    except CollectiveArgumentError as exc:
        refused = str(exc)
    r.mark_ready(2)
    r.mark_ready(3)
    r.wait()
comm.close()
json.dump({"grads": sorted({float(g[0]) for g in grads}), "refused": refused}, open(out, "w"))
"""


@pytest.mark.slow
def test_a_collective_between_mark_ready_and_wait_is_refused_on_every_rank(
    tmp_path: Path,
) -> None:
    run_two_ranks(MIXED_SCRIPT, [tmp_path / f"{r}" for r in range(2)])
    for r in range(2):
        got = json.loads((tmp_path / f"{r}").read_text())
        assert got["grads"] == [3.0], got  # every bucket summed with its own kind only
        assert f"rank {r}: all_reduce() was called while" in got["refused"], got
