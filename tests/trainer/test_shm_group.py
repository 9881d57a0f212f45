"""The cpu backend's shared-memory path: futex hand-off, group authentication, the
architecture gate, and the transport decision taken through a real daemon's KV store.

The collective semantics themselves (result matrix, abort, timeout, mismatch, SIGKILL)
run over both transports in test_cpu_ring.py.
"""

from __future__ import annotations

import logging
import mmap
import os
import platform
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rendezvousd.client import RendezvousClient
from rendezvousd.trainer.comm import futex
from rendezvousd.trainer.comm.cpu_ring import CpuRingCommunicator, connect_cpu_ring
from rendezvousd.trainer.comm.shm_group import (
    ShmGroup,
    create_listener,
    host_identity,
    unsupported_reason,
)
from rendezvousd.trainer.errors import (
    CommunicatorError,
    CommunicatorTimeout,
    ConfigError,
    PeerConnectionError,
)
from tests.support import parallel, wait_for

# Tests without this mark check the gate itself and run on every machine.
needs_shm = pytest.mark.skipif(unsupported_reason() is not None, reason=f"{unsupported_reason()}")


def _blocked_in_futex_wait(thread_id: int, address: int) -> bool:
    # /proc names the syscall a thread is blocked in and its first argument, so this
    # tells a sleep on ``address`` apart from, e.g., a wait for the GIL.
    fields = Path(f"/proc/self/task/{thread_id}/syscall").read_text().split()
    return len(fields) > 1 and fields[0] == "202" and int(fields[1], 16) == address


@needs_shm
def test_futex_wait_times_out_and_wakes() -> None:
    region = mmap.mmap(-1, 4096)
    raw = np.frombuffer(region, np.uint32)
    address = int(raw.ctypes.data)
    raw[0] = 7
    started = time.monotonic()
    assert futex.wait(address, 7, 0.2) is False
    assert 0.15 <= time.monotonic() - started < 2.0
    assert futex.wait(address, 6, 5.0) is True  # value already moved on: no sleep

    waiter = threading.get_native_id()

    def bump() -> None:
        # Wake only once the main thread sleeps on the word, so the wake is what ends it.
        wait_for("the waiter to sleep", lambda: _blocked_in_futex_wait(waiter, address))
        raw[0] = 8
        futex.wake(address)

    thread = threading.Thread(target=bump)
    thread.start()
    started = time.monotonic()
    while raw[0] == 7:
        futex.wait(address, 7, 5.0)
    assert time.monotonic() - started < 2.0
    thread.join()


@needs_shm
def test_host_identity_names_boot_and_network_namespace() -> None:
    identity = host_identity()
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert identity.startswith(boot + "/") and identity.split("/")[1].isdigit()


@needs_shm
def test_wrong_key_is_refused_without_showing_it() -> None:
    made = [create_listener() for _ in range(2)]
    names = [name for _, name in made]
    keys = [b"k" * 32, b"q" * 32]
    started = time.monotonic()
    outcome = parallel(
        [lambda r=r: ShmGroup(r, range(2), made[r][0], names, keys[r], 2.0) for r in range(2)]
    )
    assert time.monotonic() - started < 10.0
    # Rank 1 dials rank 0, which drops the bad MAC; rank 0 then waits out its timeout.
    assert isinstance(outcome[1], PeerConnectionError), outcome
    assert "rejected" in str(outcome[1])
    assert isinstance(outcome[0], CommunicatorTimeout), outcome
    assert "rank(s) 1" in str(outcome[0]) and "failed authentication" in str(outcome[0])
    for result in outcome:
        text = str(result)
        assert "kkkk" not in text and "qqqq" not in text


@needs_shm
def test_slot_size_disagreement_is_a_clear_error() -> None:
    made = [create_listener() for _ in range(2)]
    names = [name for _, name in made]
    outcome = parallel(
        [
            lambda r=r: ShmGroup(r, range(2), made[r][0], names, b"k" * 32, 5.0, 4096 * (r + 1))
            for r in range(2)
        ]
    )
    assert all(isinstance(o, CommunicatorError) for o in outcome), outcome
    assert any("slot size" in str(o) for o in outcome), outcome


def _connect_ranks(daemon: Any, job: str, node_of: list[int], shared: list[bool]) -> list[Any]:
    """Join ``len(node_of)`` ranks through the daemon and build their communicators."""
    world = len(node_of)

    def rank_main(local: int) -> Any:
        with RendezvousClient(
            daemon.endpoint, job, token_file=daemon.token_file, connect_timeout=10
        ) as client:
            membership = client.join(
                num_nodes=1, gpus_per_node=world, node_rank=0, local_rank=local, timeout=30
            )
            rank = membership.rank
            with connect_cpu_ring(
                client,
                rank=rank,
                world_size=world,
                secret=membership.unique_id,
                timeout=20.0,
                node_rank=node_of[rank],
                shared_memory=shared[rank],
            ) as comm:
                array = np.full(1000, rank + 1, np.float32)
                comm.all_reduce(array)
                transport = comm.transport
            client.leave()
            return transport, float(array[0])

    return parallel([lambda r=r: rank_main(r) for r in range(world)], 60.0)


@needs_shm
def test_ranks_on_one_host_and_node_use_shared_memory(daemon: Any, job_id: str) -> None:
    results = _connect_ranks(daemon, job_id, [0, 0, 0], [True, True, True])
    assert results == [("shared-memory", 6.0)] * 3, results


@needs_shm
def test_ranks_declared_on_different_nodes_use_the_tcp_ring(daemon: Any, job_id: str) -> None:
    # Simulated nodes on one machine keep their inter-node traffic on TCP.
    results = _connect_ranks(daemon, job_id, [0, 0, 1], [True, True, True])
    assert results == [("tcp-ring", 6.0)] * 3, results


@needs_shm
def test_one_rank_opting_out_keeps_everyone_on_the_ring(daemon: Any, job_id: str) -> None:
    results = _connect_ranks(daemon, job_id, [0, 0, 0], [True, False, True])
    assert results == [("tcp-ring", 6.0)] * 3, results


@needs_shm
def test_shared_memory_segments_are_not_named_on_disk() -> None:
    # memfd segments live only as file descriptors: nothing under /dev/shm to leak.
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    made = [create_listener() for _ in range(2)]
    names = [name for _, name in made]
    groups = parallel(
        [lambda r=r: ShmGroup(r, range(2), made[r][0], names, b"k" * 32, 5.0) for r in range(2)]
    )
    try:
        assert all(isinstance(g, ShmGroup) for g in groups), groups
        after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
        assert after == before
    finally:
        for g in groups:
            if isinstance(g, ShmGroup):
                g.close()


def test_world_one_never_builds_a_group() -> None:
    with CpuRingCommunicator(0, 1, "127.0.0.1", [("127.0.0.1", 0)], b"s" * 32, 5.0) as comm:
        assert comm.transport == "tcp-ring"


# -- architecture gate --------------------------------------------------------------------


@pytest.mark.parametrize("machine", ["aarch64", "arm64", "ppc64le", "riscv64", "s390x", ""])
def test_weakly_ordered_machines_never_share_memory(
    machine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(platform, "machine", lambda: machine)
    reason = unsupported_reason()
    assert reason is not None and "x86-64 store ordering" in reason
    assert (machine or "unknown architecture") in reason


@pytest.mark.parametrize("machine", ["x86_64", "AMD64"])
def test_x86_64_linux_may_share_memory(machine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "machine", lambda: machine)
    expected = None if futex.available() else "the shared-memory all-reduce needs Linux futexes"
    assert unsupported_reason() == expected


def test_an_arm_node_uses_the_tcp_ring_and_logs_why(
    daemon: Any, job_id: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Same host, same node, shared memory wanted: only the architecture says no.
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    with caplog.at_level(logging.INFO, logger="rendezvousd.trainer"):
        results = _connect_ranks(daemon, job_id, [0, 0, 0], [True, True, True])
    assert results == [("tcp-ring", 6.0)] * 3, results
    why = [r.getMessage() for r in caplog.records if "not shared memory" in r.getMessage()]
    assert len(why) == 3, why
    assert all("x86-64 store ordering" in m and "aarch64" in m for m in why), why


def test_a_group_refuses_to_start_on_a_weakly_ordered_machine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Direct construction bypasses the transport decision; the group checks again.
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    listener, name = create_listener()
    with pytest.raises(ConfigError, match=r"rank 0: .*x86-64 store ordering.*TCP ring"):
        ShmGroup(0, range(2), listener, [name, name], b"k" * 32, 1.0)
    assert listener.fileno() == -1


class _CountingStore:
    """The rank's real client, counting the KV round trips the ring's setup makes."""

    def __init__(self, client: RendezvousClient) -> None:
        self.client, self.sets, self.gets = client, 0, 0

    def kv_set(self, key: str, value: bytes) -> None:
        self.sets += 1
        self.client.kv_set(key, value)

    def kv_get(self, key: str, *, wait: bool = True, timeout: float | None = None) -> bytes:
        self.gets += 1
        return self.client.kv_get(key, wait=wait, timeout=timeout)


@pytest.mark.parametrize(
    ("node_of", "reads"),
    [([0, 0, 0], 2), ([0, 1, 2], 1), ([0, 0, 1, 1, 2, 2], 1)],
    ids=["one-node", "three-nodes", "three-nodes-of-two"],
)
def test_setup_is_one_exchange_through_the_daemon(
    daemon: Any, job_id: str, node_of: list[int], reads: int
) -> None:
    """Each rank publishes one value (its ring address and shared-memory claim) and
    reads each peer's once on one node, where shared memory needs every claim, and
    only its right neighbour's across nodes: every read is a round trip to the
    daemon, the cost of a recovery's ring set-up on a loaded machine, and reading
    every peer made the job's set-up quadratic in its size."""
    world = len(node_of)

    def rank_main(local: int) -> tuple[int, int, str, float]:
        with RendezvousClient(
            daemon.endpoint, job_id, token_file=daemon.token_file, connect_timeout=10
        ) as client:
            m = client.join(num_nodes=1, gpus_per_node=world, node_rank=0, local_rank=local)
            store = _CountingStore(client)
            with connect_cpu_ring(
                store,
                rank=m.rank,
                world_size=world,
                secret=m.unique_id,
                timeout=20.0,
                node_rank=node_of[m.rank],
                nodes=len(set(node_of)),
            ) as comm:
                array = np.full(100, m.rank + 1, np.float32)
                comm.all_reduce(array)
                transport = comm.transport
            client.leave()
            return store.sets, store.gets, transport, float(array[0])

    results = parallel([lambda r=r: rank_main(r) for r in range(world)], 60.0)
    shm = node_of == [0, 0, 0] and unsupported_reason() is None
    expected = "shared-memory" if shm else "tcp-ring"
    assert results == [(1, reads, expected, world * (world + 1) / 2)] * world, results
