"""Worlds for the contract suite: one parametrised fixture per contract.

``world`` is N ranks that joined one job through one rendezvous transport (the daemon
through ``RendezvousClient`` or ``AsyncRendezvousClient``, a node agent's ``join_node``
with its workers ``attach``ed, ``FileRendezvous``); ``comms`` is N communicators of one
backend (the CPU ring over TCP, the ring with its shared-memory group, NCCL through the
fake CuPy). The tests in this directory assert one contract over every parameter.

The communicator classes are not public (``rendezvousd.trainer`` exports only the
``Communicator`` protocol), so their internal modules are imported here and nowhere
else in this directory: the one place to fix when modules move.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import secrets
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rendezvousd.client import (
    AsyncRendezvousClient,
    FileRendezvous,
    Membership,
    RendezvousClient,
)
from rendezvousd.trainer.comm.communicator import Communicator
from rendezvousd.trainer.comm.cpu_ring import CpuRingCommunicator
from rendezvousd.trainer.comm.nccl import NcclCommunicator
from rendezvousd.trainer.comm.shm_group import (
    SharedMemoryPeers,
    create_listener,
    unsupported_reason,
)
from tests.support import DaemonProcess, parallel, wait_for
from tests.trainer import test_cpu_ring
from tests.trainer.fake_cupy import device_array, install

# The ring's process helper (its fork server imports that module once, then forks each
# rank): a peer that is SIGKILLed needs a process of its own.
process_ring = test_cpu_ring.process_ring
recv_report = test_cpu_ring._recv

WORLD = 3
JOIN_TIMEOUT_S = 20.0
SECRET = bytes(range(128))

TRANSPORTS = ["daemon-sync", "daemon-async", "node-agent", "file"]


# -- rendezvous transports ------------------------------------------------------------


class EventLoopThread:
    """One event loop on a thread of its own, for every asyncio client of a world:
    grpc.aio serves one loop per process, so each rank gets no loop of its own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Any) -> Any:
        if self.loop.is_closed():
            coro.close()
            raise RuntimeError("the world's event loop is closed")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def close(self) -> None:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()


class AsyncAsSync:
    """An ``AsyncRendezvousClient`` driven from plain threads (one per rank): each call
    runs on the world's event loop, where the client and its heartbeat task live."""

    def __init__(self, loop: EventLoopThread, endpoint: str, job_id: str, token: str) -> None:
        self._loop = loop
        self._closed = False

        async def make() -> AsyncRendezvousClient:
            return AsyncRendezvousClient(endpoint, job_id, token=token)

        self._client = loop.run(make())

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._client, name)

        @functools.wraps(method)
        def call(*args: Any, **kw: Any) -> Any:
            if self._closed:
                raise RuntimeError(f"{name}() on a closed client (its rank was lost)")

            async def run() -> Any:
                out = method(*args, **kw)
                return await out if inspect.isawaitable(out) else out

            return self._loop.run(run())

        return call

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._loop.run(self._client.close())


@dataclass
class World:
    """N joined ranks of one transport: ``api[r]`` answers barrier/kv_* for rank r."""

    transport: str
    job_id: str
    api: list[Any]
    memberships: list[Membership]
    # Makes rank r lost as that transport loses it (its process gone, or its agent
    # reporting it); the others must then hear PeerFailed naming r.
    lose: Callable[[int], None]
    # A join this transport refuses for its topology (what each accepts differs, the
    # exception class may not).
    refuse_bad_topology: Callable[[], Any]
    # A newcomer to this job asking for another topology (gpus_per_node + 1).
    join_conflicting: Callable[[], Any]
    closers: list[Callable[[], None]] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.api)


def together(fns: Sequence[Callable[[], Any]], limit: float = 30.0) -> list[Any]:
    """Each callable on its own thread (a rank each); their results, or the first
    exception any of them raised."""
    results = parallel(fns, limit)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def streams_open(client: Any, world: int) -> bool:
    """Whether the daemon has every rank's heartbeat stream attached.

    Every world starts from open streams, so that a lost rank is the end of its
    stream on both clients (not a heartbeat timeout). A leave() right after
    start_heartbeat() once hung the asyncio client (Python 3.11's wait_for swallowed
    the cancellation); tests/client/test_aio_stop.py covers that shape now."""
    members = client.get_job().members
    return len(members) == world and all(m.heartbeat_stream_open for m in members)


def _per_rank_world(
    transport: str, job_id: str, make: Callable[[], Any], refuse: Callable[[], Any]
) -> World:
    def conflicting() -> Any:
        newcomer = make()
        try:
            return newcomer.join(num_nodes=1, gpus_per_node=WORLD + 1, local_rank=1, timeout=5)
        finally:
            newcomer.close()

    clients = [make() for _ in range(WORLD)]
    ms = together(
        [
            functools.partial(
                c.join, num_nodes=1, gpus_per_node=WORLD, local_rank=i, timeout=JOIN_TIMEOUT_S
            )
            for i, c in enumerate(clients)
        ],
        limit=JOIN_TIMEOUT_S + 10,
    )
    for c in clients:
        c.start_heartbeat(0.2)
    if transport != "file":  # FileRendezvous has no get_job
        # Every rank's stream open before a test begins: a loss is then the stream's end,
        # and no leave() or close() races the stream's start (see streams_open).
        wait_for("every rank's heartbeat stream", lambda: streams_open(clients[0], WORLD))
    return World(
        transport,
        job_id,
        clients,
        ms,
        lose=lambda r: clients[r].close(),  # gone without leaving, as a dead process
        refuse_bad_topology=refuse,
        join_conflicting=conflicting,
        closers=[c.close for c in clients],
    )


def _node_world(d: DaemonProcess, job_id: str) -> World:
    agent = RendezvousClient(d.endpoint, job_id, token=d.token)
    node = agent.join_node(
        min_nodes=1, max_nodes=1, gpus_per_node=WORLD, host="contract", timeout=JOIN_TIMEOUT_S
    )
    agent.start_heartbeat(0.2)
    workers = [RendezvousClient(d.endpoint, job_id, token=d.token) for _ in range(WORLD)]
    for local, w in enumerate(workers):
        w.attach(node.membership_for(local), node.member_instance_id(local))

    def refuse() -> Any:
        with RendezvousClient(d.endpoint, job_id + "-bad", token=d.token) as c:
            return c.join_node(min_nodes=2, max_nodes=1, gpus_per_node=WORLD, timeout=5)

    def conflicting() -> Any:
        with RendezvousClient(d.endpoint, job_id, token=d.token) as c:
            return c.join_node(min_nodes=1, max_nodes=1, gpus_per_node=WORLD + 1, timeout=5)

    return World(
        "node-agent",
        job_id,
        workers,
        [node.membership_for(i) for i in range(WORLD)],
        lose=lambda r: agent.report_failure(r, "lost by the contract test"),
        refuse_bad_topology=refuse,
        join_conflicting=conflicting,
        closers=[w.close for w in workers] + [agent.close],
    )


@pytest.fixture(params=TRANSPORTS)
def world(request: pytest.FixtureRequest, daemon: DaemonProcess, job_id: str) -> Iterator[World]:
    kind: str = request.param
    made: World
    if kind == "daemon-sync":

        def refuse_sync() -> Any:
            with RendezvousClient(daemon.endpoint, job_id + "-bad", token=daemon.token) as c:
                return c.join(num_nodes=1, gpus_per_node=WORLD, local_rank=WORLD, timeout=5)

        made = _per_rank_world(
            kind,
            job_id,
            lambda: RendezvousClient(daemon.endpoint, job_id, token=daemon.token),
            refuse_sync,
        )
    elif kind == "daemon-async":
        loop = EventLoopThread()

        def refuse_async() -> Any:
            c = AsyncAsSync(loop, daemon.endpoint, job_id + "-bad", daemon.token)
            try:
                return c.join(num_nodes=1, gpus_per_node=WORLD, local_rank=WORLD, timeout=5)
            finally:
                c.close()

        made = _per_rank_world(
            kind,
            job_id,
            lambda: AsyncAsSync(loop, daemon.endpoint, job_id, daemon.token),
            refuse_async,
        )
        made.closers.append(loop.close)
    elif kind == "node-agent":
        made = _node_world(daemon, job_id)
    else:
        # A UNIX socket's path is at most 107 bytes: a short directory and job id.
        directory = Path(tempfile.mkdtemp(prefix="contract-"))
        short = "job-" + secrets.token_hex(4)

        def refuse_file() -> Any:
            with FileRendezvous(directory / "bad", short) as rv:
                return rv.join(num_nodes=2, gpus_per_node=WORLD, local_rank=0, timeout=5)

        made = _per_rank_world(
            kind, short, lambda: FileRendezvous(directory / "rdzv", short), refuse_file
        )
        # Rank 0 hosts the daemon: closing it last lets the others go first.
        made.closers.reverse()
        made.closers.append(lambda: shutil.rmtree(directory, ignore_errors=True))
    try:
        yield made
    finally:
        # Every rank says goodbye first: a job whose ranks all left ends, and then the
        # file transport's rank 0 stops its daemon without waiting out a drain.
        parallel([a.leave for a in made.api])
        for close in made.closers:
            close()


# -- communicator backends ------------------------------------------------------------

BACKENDS = [
    "tcp-ring",
    pytest.param(
        "shared-memory",
        marks=pytest.mark.skipif(
            unsupported_reason() is not None, reason=f"shared memory: {unsupported_reason()}"
        ),
    ),
    "fake-nccl",
    # NCCL before 2.10.3 has no AVG: the communicator sums, then divides on the GPU.
    "fake-nccl-2.8",
]


@dataclass
class Comms:
    """Communicators of one backend, one per rank, and how to move arrays to them."""

    backend: str
    ranks: list[Communicator]
    to_device: Callable[[np.ndarray], Any]
    to_host: Callable[[Any], np.ndarray]
    # Makes rank r's peers fail as this backend fails them: returns the ranks that
    # must now see an error on their next collective.
    fail_peer: Callable[[int], list[int]] = lambda r: []


def _ring(n: int, backend: str) -> list[CpuRingCommunicator]:
    socks = [socket.create_server(("127.0.0.1", 0)) for _ in range(n)]
    addrs = [("127.0.0.1", s.getsockname()[1]) for s in socks]
    shm: list[SharedMemoryPeers | None] = [None] * n
    if backend == "shared-memory":
        made = [create_listener() for _ in range(n)]
        names = [name for _, name in made]
        shm = [SharedMemoryPeers(sock, names, 80 * 1024) for sock, _ in made]
    return together(
        [
            functools.partial(
                CpuRingCommunicator, r, n, socks[r], addrs, SECRET, 10.0, shared_memory=shm[r]
            )
            for r in range(n)
        ]
    )


@pytest.fixture(params=BACKENDS)
def comms(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Comms]:
    backend: str = request.param
    made: Comms
    if backend.startswith("fake-nccl"):
        # Ranks as threads of this process, whose fake NCCL computes NCCL's results.
        version = 20804 if backend == "fake-nccl-2.8" else 21805
        cp = install(monkeypatch, devices=1, meet=True, version=version)
        ranks: list[Communicator] = [
            NcclCommunicator(r, WORLD, SECRET, 0, timeout=10.0) for r in range(WORLD)
        ]

        def fail_nccl(r: int) -> list[int]:
            cp.world.async_error = 6  # ncclRemoteError: a peer went away
            return [x for x in range(WORLD) if x != r]

        made = Comms(
            backend,
            ranks,
            to_device=lambda a: device_array(cp, a, a.dtype),
            to_host=lambda a: np.asarray(cp.asnumpy(a)),
            fail_peer=fail_nccl,
        )
    else:
        rings: list[Communicator] = list(_ring(WORLD, backend))

        def fail_ring(r: int) -> list[int]:
            rings[r].close()
            return [x for x in range(len(rings)) if x != r]

        made = Comms(
            backend, rings, to_device=lambda a: a, to_host=lambda a: a, fail_peer=fail_ring
        )
    try:
        yield made
    finally:
        for c in made.ranks:
            c.close()
