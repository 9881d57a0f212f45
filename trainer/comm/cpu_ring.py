"""CPU ring all-reduce over authenticated TCP between worker processes (backend "cpu").

When every rank runs on one host and one node (``connect_cpu_ring`` decides through
the store), all_reduce goes through shared memory instead (``shm_group``); broadcast
and barrier always use the ring. ``transport`` says which all_reduce uses.

The array is cut into ``world_size`` segments. A reduce-scatter leaves every rank owning
one fully reduced segment; an all-gather then copies each owner's segment to everyone,
so all ranks end with the same bits. Segments travel in chunks (about a quarter of a
segment, between 256 KiB and ``chunk_bytes``): a sender thread streams chunks to the
right neighbour while the calling thread receives chunks from the left, reduces each
one and hands it straight back to the sender.

Semantics:

* float16 accumulates in float16 (every hop rounds, as NCCL does); pre-scale gradients
  if the sum could overflow. numpy's float16 arithmetic is slow on most CPUs (about
  0.25 GB/s of reduction on the development machine), so prefer float32 on this backend.
* AVG on integer dtypes is the sum (wrapping like numpy integer arithmetic) divided by
  ``world_size`` towards zero, as NCCL's is (-7 over 2 ranks: -3, where numpy's ``//``
  gives -4). AVG on floats scales each input by 1/``world_size`` first, as NCCL does.
* The order in which a float segment is summed depends on its place in the ring, so
  results can differ from ``numpy.sum`` in the last bits; they are identical on all ranks.
* Arrays must be writeable, native-endian numpy arrays that are C- or F-contiguous. They
  are reduced in place without copies; anything else raises ``CollectiveArgumentError``.
* Every collective returns only after the right neighbour has received all it was sent,
  so the caller may reuse the array at once (the sender thread reads it until then).
* A broadcast's ranks compare its root, size and type first, in one 48-byte all-reduce
  (``RankedCommunicator._agree``, as on NCCL): ranks that disagree each raise
  ``CommunicatorError`` naming what differs, nothing was sent, and the communicator
  stays usable. Other mismatched calls (an all-reduce of another size, a rank in a
  barrier) are caught at once by the frames' headers and break the ring.
"""

from __future__ import annotations

import contextlib
import math
import socket
import struct
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from rendezvousd.common.address import AddressError, parse_host_port
from rendezvousd.trainer.comm import peer_auth, peer_wait, shm_group
from rendezvousd.trainer.comm import ring_wire as wire
from rendezvousd.trainer.comm.communicator import RankedCommunicator, ReduceOp
from rendezvousd.trainer.comm.cpu_transport import local_claim, shared_memory_plan
from rendezvousd.trainer.comm.shm_group import SharedMemoryPeers
from rendezvousd.trainer.comm.store import JobStore
from rendezvousd.trainer.errors import (
    CollectiveArgumentError,
    CommunicatorAborted,
    CommunicatorError,
    CommunicatorTimeout,
    ConfigError,
    PeerConnectionError,
)

__all__ = ["DEFAULT_CHUNK_BYTES", "CpuRingCommunicator", "connect_cpu_ring"]

# Upper bound on the chunk size (see _chunk_size); 4 MiB measured best for 64 MiB arrays.
DEFAULT_CHUNK_BYTES = 4 << 20
_MIN_PIPELINE_CHUNK = 256 << 10
_PIPELINE_DEPTH = 4
_MIN_CHUNK_BYTES = 64
_MIN_SECRET_BYTES = 16
_CLOSE_GRACE_S = 1.0

_DTYPES: dict[np.dtype[Any], int] = {
    np.dtype(name): code for code, name in enumerate(wire.DTYPE_NAMES, start=1)
}
_OPS = {ReduceOp[name]: code for code, name in enumerate(wire.OP_NAMES, start=1)}
_UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.MAX: np.maximum,
    ReduceOp.MIN: np.minimum,
}

Array = npt.NDArray[Any]


class CpuRingCommunicator(RankedCommunicator):
    """One rank of a CPU ring; see the module docstring for semantics.

    ``listener`` is a bound, listening socket (the communicator takes ownership and
    closes it after setup) or a host to bind at this rank's port in ``addresses``.
    ``addresses`` is every rank's (host, port), or a mapping by rank of those this rank
    uses: its right neighbour's, which it connects to, and its own if it binds.
    ``secret`` is the job's per-generation id; it authenticates every connection and
    never appears in messages. ``timeout`` bounds setup and any wait without progress.

    ``chunk_bytes`` caps the pipelining chunk. A receive that has waited
    ``slow_peer_warn_s`` on one peer is logged, naming the peer (``peer_wait``), in
    words that name ``context`` (``generation 3``) where given.
    """

    backend: Final = "cpu"
    _label = "CPU"

    def __init__(
        self,
        rank: int,
        world_size: int,
        listener: socket.socket | str,
        addresses: Sequence[tuple[str, int]] | Mapping[int, tuple[str, int]],
        secret: bytes,
        timeout: float,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        shared_memory: SharedMemoryPeers | None = None,
        setup_timeout: float | None = None,
        origins: Mapping[int, str] | None = None,
        first_setup: bool = False,
        slow_peer_warn_s: float = peer_wait.DEFAULT_WARN_S,
        context: str = "",
    ) -> None:
        """``origins``: where each peer's address came from, in words (``RingAddress``),
        said when it cannot be reached; ``first_setup``: no ring of this run formed
        before, so a missing route to a peer is its wrong address more likely than a
        cut (``ring_wire.establish_ring``)."""
        super().__init__(rank, world_size)
        if not isinstance(addresses, Mapping):
            if len(addresses) != world_size:
                raise ConfigError(f"need {world_size} ring addresses, got {len(addresses)}")
            addresses = dict(enumerate(addresses))
        needed = {(rank + 1) % world_size} | ({rank} if isinstance(listener, str) else set())
        _validate(needed, addresses, secret, timeout, chunk_bytes)
        if not isinstance(slow_peer_warn_s, int | float) or not slow_peer_warn_s > 0:
            raise ConfigError(
                f"slow_peer_warn_s must be a positive number of seconds, got {slow_peer_warn_s!r}"
            )
        # Connecting may wait for peers still starting; a collective may not wait that long.
        setup = timeout if setup_timeout is None else setup_timeout
        self._left_rank = (rank - 1) % world_size
        self._right_rank = (rank + 1) % world_size
        self._timeout = timeout
        self._chunk_bytes = chunk_bytes
        self._state_lock = threading.RLock()  # re-entrant: abort() may run in a signal handler
        self._io_lock = threading.Lock()  # held by the thread running a collective
        self._failure: CommunicatorError | None = None
        self._abort_reason: str | None = None
        self._closed = False
        self._seq = 0
        self._left: socket.socket | None = None
        self._right: socket.socket | None = None
        self._sender: wire.SenderThread | None = None
        self._header = bytearray(wire.FRAME.size)
        self._scratch = np.empty(chunk_bytes, np.uint8)
        self._shm: shm_group.ShmGroup | None = None
        self._waits = peer_wait.PeerWaits(rank, slow_peer_warn_s, timeout, context)
        if isinstance(listener, str):
            listener = wire.ring_listener(
                listener, origin=(origins or {}).get(rank, ""), port=addresses[rank][1]
            )
        try:
            if world_size > 1:
                self._left, self._right = wire.establish_ring(
                    listener,
                    addresses,
                    secret,
                    rank,
                    world_size,
                    setup,
                    origin=(origins or {}).get(self._right_rank, ""),
                    own_origin=(origins or {}).get(rank, ""),
                    first_setup=first_setup,
                )
                # Each collective's own wait from here on, not what was left of the
                # setup's: a ring formed late into its setup timed collectives out
                # after that rest, and one formed early waited out the whole setup
                # timeout for a peer (a differential review).
                for sock in (self._left, self._right):
                    wire.set_io_timeout(sock, timeout)
                for peer, sock in ((self._left_rank, self._left), (self._right_rank, self._right)):
                    with contextlib.suppress(OSError):
                        self._waits.hosts[peer] = f"host {sock.getpeername()[0]}"
        finally:
            listener.close()
        if self._right is not None:
            self._sender = wire.SenderThread(
                self._right, self._right_rank, rank, failed=self._has_failed, on_error=self._record
            )
        if shared_memory is not None:
            try:
                self._shm = shm_group.ShmGroup(
                    rank,
                    range(world_size),
                    shared_memory.listener,
                    shared_memory.names,
                    peer_auth.derive_key(secret),
                    timeout,
                    shared_memory.slot_bytes,
                    setup_timeout=setup,
                    waits=self._waits,
                )
            except BaseException:
                self.close()
                raise
            finally:
                shared_memory.listener.close()  # the group's own: done with once it formed
        if world_size > 1:
            self._waits.start()

    @property
    def transport(self) -> str:
        """How all_reduce moves data: "shared-memory" (one host) or "tcp-ring"."""
        return "shared-memory" if self._shm is not None else "tcp-ring"

    def all_reduce(self, array: Any, op: ReduceOp = ReduceOp.SUM) -> None:
        flat, dtype_code = _flatten(array, self.rank)
        if not isinstance(op, ReduceOp):
            raise CollectiveArgumentError(f"rank {self.rank}: op must be a ReduceOp, got {op!r}")
        with self._collective() as seq:
            if op is ReduceOp.AVG and not _divides_after(flat):
                np.multiply(flat, _reciprocal(flat, self.world_size), out=flat)
            if self._shm is not None:
                expect = (wire.ALL_REDUCE, _OPS[op], dtype_code, seq, flat.nbytes)
                finish = self._average if op is ReduceOp.AVG and _divides_after(flat) else None
                self._shm.all_reduce(flat, _UFUNCS[op], finish, expect)
            elif self.world_size > 1:
                self._ring_all_reduce(flat, op, dtype_code, wire.ALL_REDUCE, seq)

    def _max_across_ranks(
        self, values: npt.NDArray[np.int64], operation: str
    ) -> npt.NDArray[np.int64]:
        # Marked as the broadcast's, so a rank already in another collective is a
        # mismatch, not a partner in this one.
        code = _DTYPES[values.dtype]
        with self._collective() as seq:
            if self._shm is not None:
                # Through the group, where the others would find a rank in another
                # collective (it announces there, as every collective does).
                announced = (wire.BROADCAST, _OPS[ReduceOp.MAX], code, seq, values.nbytes)
                self._shm.all_reduce(values, _UFUNCS[ReduceOp.MAX], None, announced)
                return values
            # An all-gather around the ring, every rank's values passed on n - 1 hops,
            # then the maximum here: half the hops of a ring all-reduce (a 1 KiB
            # broadcast at world 2 took 0.46 ms with one, 0.34 ms with this; 0.17 ms
            # without either).
            n = self.world_size
            rows = np.empty((n, len(values)), np.int64)
            rows[0] = values
            expect = (wire.BROADCAST, _OPS[ReduceOp.MAX], code, seq, values.nbytes, 0)
            for hop in range(n - 1):
                self._post(expect, hop, rows[hop].view(np.uint8).data)
                self._recv_data(expect, hop, rows[hop + 1].view(np.uint8).data)
            # No acks (``_finish``): ``rows`` is this call's own, so nothing waits to
            # be reused, and the broadcast's own acks follow on the same links.
        return np.asarray(rows.max(axis=0), dtype=np.int64)

    def broadcast(self, array: Any, root: int = 0) -> None:
        flat, dtype_code = _flatten(array, self.rank)
        self._check_root(root)
        fields = {"root": root, "element count": flat.size, "dtype code": dtype_code}
        self._agree("broadcast", fields)
        with self._collective() as seq:
            if self._shm is not None:
                self._shm.announce((wire.BROADCAST, 0, dtype_code, seq, flat.nbytes))
            if self.world_size > 1:
                self._ring_broadcast(flat.view(np.uint8), dtype_code, root, seq)

    def barrier(self) -> None:
        # An empty all-reduce still passes one frame per step around the ring, so no rank
        # can leave before every rank has entered.
        with self._collective() as seq:
            if self._shm is not None:
                self._shm.announce((wire.BARRIER, _OPS[ReduceOp.SUM], 0, seq, 0))
            if self.world_size > 1:
                self._ring_all_reduce(np.empty(0, np.uint8), ReduceOp.SUM, 0, wire.BARRIER, seq)

    def abort(self, reason: str) -> None:
        with self._state_lock:
            if self._abort_reason is None:
                self._abort_reason = reason
        self._record(wire.LinkError(self.rank, wire.ABORTED, reason))

    def close(self) -> None:
        if self._forked():
            self._drop()
            return
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
        closed = CommunicatorError(f"rank {self.rank}: communicator is closed")
        self._record(wire.LinkError(self.rank, wire.ABORTED, wire.CLOSED), closed)
        self._waits.stop()
        if self._sender is not None:
            # The sender forwards the failure notice downstream first, so survivors past
            # the neighbour still learn which rank failed; a stuck peer costs one grace.
            grace = min(self._timeout, _CLOSE_GRACE_S)
            if not self._sender.stop(grace):
                with self._state_lock, contextlib.suppress(OSError):
                    if self._right is not None:
                        self._right.shutdown(socket.SHUT_RDWR)
                self._sender.stop(grace)
        with self._io_lock, self._state_lock:
            for sock in (self._left, self._right):
                if sock is not None:
                    sock.close()
            if self._shm is not None:
                self._shm.close()

    def _drop(self) -> None:
        """A forked child's close (a DataLoader worker, or a child leaving the parent's
        ``with init_distributed()`` block): its copies of the descriptors go, and
        nothing else. A FAIL frame or a shutdown() on the sockets it shares with the
        parent broke the parent's ring, and the peers blamed the healthy parent. No
        lock: one held by another of the parent's threads at the fork stays held."""
        if self._closed:
            return
        self._closed = True
        for sock in (self._left, self._right):
            if sock is not None:
                sock.close()  # this process's descriptor only
        if self._shm is not None:
            self._shm.close()  # unmaps and closes; signals nothing

    # -- failure handling -------------------------------------------------------------

    @contextlib.contextmanager
    def _collective(self) -> Iterator[int]:
        with self._io_lock:
            self._raise_if_unusable()
            self._seq = (self._seq + 1) & 0xFFFFFFFF
            try:
                yield self._seq
            except wire.LinkError as exc:
                self._record(exc)
                self._reset_left()
                raise self._current_error() from exc
            except BaseException as exc:
                detail = f"interrupted by {type(exc).__name__}"
                self._record(wire.LinkError(self.rank, wire.INTERRUPTED, detail))
                self._reset_left()
                raise
            finally:
                # After the failure is recorded: the watcher then says no "heard again".
                self._waits.current = None

    def _raise_if_unusable(self) -> None:
        with self._state_lock:
            if self._abort_reason is not None or self._failure is not None:
                raise self._current_error()

    def _current_error(self) -> CommunicatorError:
        """A fresh exception each time, so tracebacks do not pile up on one object."""
        with self._state_lock:
            if self._abort_reason is not None:
                return CommunicatorAborted(
                    f"rank {self.rank}: communicator aborted: {self._abort_reason}"
                )
            assert self._failure is not None
            return type(self._failure)(str(self._failure))

    def _record(self, link: wire.LinkError, error: CommunicatorError | None = None) -> None:
        """Keep the first failure, then break both links so no thread or peer waits."""
        with self._state_lock:
            if self._failure is not None:
                return
            self._failure = error or self._public_error(link)
            self._waits.broken = True
            reporter = self.rank if link.via is None else link.via
            notice = wire.fail_frame(link.origin, link.code, link.detail, reporter)
            with contextlib.suppress(OSError):
                if self._left is not None:
                    # Upstream finds this in its queue when its next send is reset.
                    self._left.send(notice, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
            with contextlib.suppress(OSError):
                if self._left is not None:
                    self._left.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                if self._right is not None:
                    # Read side only: the sender still forwards the failure downstream.
                    self._right.shutdown(socket.SHUT_RD)
        if self._sender is not None:
            self._sender.signal_failure(notice)
        if self._shm is not None:
            self._shm.signal_failure(notice)
        if self._io_lock.acquire(blocking=False):
            try:
                self._reset_left()
            finally:
                self._io_lock.release()

    def _reset_left(self) -> None:
        # A reset, unlike a FIN, fails an upstream sender that is blocked on a full window.
        with self._state_lock:
            sock = self._left
            if sock is None or sock.fileno() < 0:
                return
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()

    def _public_error(self, link: wire.LinkError) -> CommunicatorError:
        code, origin = link.code, link.origin
        kind = {wire.TIMEOUT: CommunicatorTimeout, wire.MISMATCH: CommunicatorError}.get(
            code, PeerConnectionError
        )
        if origin == self.rank and link.via is not None:
            # A neighbour blamed this rank (e.g. timed out on it) before disconnecting.
            return kind(f"rank {self.rank}: rank {link.via} gave up on this rank: {link.detail}")
        if code == wire.ABORTED and origin == self.rank:
            return CommunicatorAborted(f"rank {self.rank}: communicator aborted: {link.detail}")
        what = {
            wire.TIMEOUT: f"rank {origin} made no progress within {self._timeout:g} s",
            wire.ABORTED: f"rank {origin} aborted",
            wire.MISMATCH: f"collective mismatch between rank {origin} and rank {link.via}"
            if link.via not in (None, origin)
            else f"collective mismatch with rank {origin}",
            wire.INTERRUPTED: f"rank {origin} was interrupted mid-collective",
        }.get(code, f"lost rank {origin}")
        hearsay = link.via not in (None, origin)
        via = f" (reported by rank {link.via})" if hearsay else ""
        if code == wire.INTERRUPTED:
            kind = CommunicatorError
        if code == wire.ABORTED and link.detail == wire.CLOSED:
            # A peer that closed with no failure of its own finished, or left its
            # ``with`` block early: "aborted" sent its user looking for a crash there.
            error = kind(
                f"rank {self.rank}: rank {origin} left the job (finished or exited early) "
                f"while this rank still ran collectives{via}: give every rank the same "
                "number of steps (uneven data?)"
            )
            error.reported_by = link.via if hearsay else None
            return error
        error = kind(f"rank {self.rank}: {what}{via}: {link.detail}")
        error.reported_by = link.via if hearsay else None
        return error

    # -- data path ----------------------------------------------------------------------

    def _ring_all_reduce(
        self, flat: Array, op: ReduceOp, dtype_code: int, coll: int, seq: int
    ) -> None:
        n, r = self.world_size, self.rank
        count, size = flat.size, flat.itemsize
        raw = flat.view(np.uint8).data
        step = _chunk_size(count // n * size + size, self._chunk_bytes) // size
        bounds = [i * (count // n) + min(i, count % n) for i in range(n + 1)]
        expect = (coll, _OPS[op], dtype_code, seq, flat.nbytes, 0)
        ufunc = _UFUNCS[op]
        divide = op is ReduceOp.AVG and _divides_after(flat)  # integers: the sum, at its last add
        scratch = self._scratch[: step * size].view(flat.dtype)
        scratch_raw = self._scratch.data
        sent = received = 0

        def send(a: int, b: int) -> None:
            nonlocal sent
            self._post(expect, sent, raw[a * size : b * size])
            sent += 1

        for a, b in _chunks(bounds[r], bounds[r + 1], step):
            send(a, b)
        for s in range(n - 1):  # reduce-scatter
            seg = (r - s - 1) % n
            for a, b in _chunks(bounds[seg], bounds[seg + 1], step):
                self._recv_data(expect, received, scratch_raw[: (b - a) * size])
                received += 1
                if b > a:
                    ufunc(flat[a:b], scratch[: b - a], out=flat[a:b])
                    if s == n - 2 and divide:
                        _divide(flat[a:b], n)
                send(a, b)
        for s in range(n - 1):  # all-gather
            seg = (r - s) % n
            for a, b in _chunks(bounds[seg], bounds[seg + 1], step):
                self._recv_data(expect, received, raw[a * size : b * size])
                received += 1
                if s < n - 2:
                    send(a, b)
        self._finish(expect, received=True, sent=True)

    def _average(self, segment: Array) -> None:
        _divide(segment, self.world_size)

    def _ring_broadcast(self, raw_array: Array, dtype_code: int, root: int, seq: int) -> None:
        raw = raw_array.data
        # The ranks agreed on the root, size and type first (``_agree``).
        expect = (wire.BROADCAST, 0, dtype_code, seq, raw_array.nbytes, root)
        receives = self.rank != root
        sends = self._right_rank != root
        step = _chunk_size(raw_array.nbytes, self._chunk_bytes)
        for index, (a, b) in enumerate(_chunks(0, raw_array.nbytes, step)):
            if receives:
                self._recv_data(expect, index, raw[a:b])
            if sends:
                self._post(expect, index, raw[a:b])
        self._finish(expect, received=receives, sent=sends)

    def _post(self, expect: tuple[int, ...], index: int, view: memoryview) -> None:
        assert self._sender is not None
        header = wire.FRAME.pack(wire.DATA, *expect, index, len(view))
        self._sender.post(header, view)

    def _recv_data(self, expect: tuple[int, ...], index: int, dest: memoryview) -> None:
        assert self._left is not None
        # What this receive waits for, for the watcher (``peer_wait``): a stamp, not a
        # shorter kernel timeout or a poll, so a healthy receive pays ~0.1 us for it.
        waits = self._waits
        waits.current = (time.monotonic(), self._left_rank, expect, peer_wait.DATA)
        wire.recv_exact(self._left, memoryview(self._header), self._left_rank)
        got = wire.FRAME.unpack(self._header)
        if got[0] == wire.FAIL:
            raise wire.read_failure(self._left, got, self._left_rank)
        want = (wire.DATA, *expect, index, len(dest))
        if got != want:
            detail = wire.describe_mismatch(got, want, self._left_rank, self.rank)
            raise wire.LinkError(self._left_rank, wire.MISMATCH, detail)
        if len(dest):
            wire.recv_exact(self._left, dest, self._left_rank)
        waits.current = None

    def _finish(self, expect: tuple[int, ...], *, received: bool, sent: bool) -> None:
        """Acknowledge upstream, then wait until downstream has everything we sent."""
        seq = expect[3]
        if received:
            assert self._left is not None
            ack = wire.FRAME.pack(wire.ACK, 0, 0, 0, seq, 0, self.rank, 0, 0)
            try:
                self._left.sendall(ack, socket.MSG_NOSIGNAL)
            except OSError as exc:
                detail = f"ack failed: {wire.link_error(exc)}"
                raise wire.LinkError(self._left_rank, wire.LOST, detail) from exc
        if sent:
            assert self._right is not None
            self._waits.current = (time.monotonic(), self._right_rank, expect, peer_wait.ACK)
            wire.recv_exact(self._right, memoryview(self._header), self._right_rank)
            self._waits.current = None
            got = wire.FRAME.unpack(self._header)
            if got[0] == wire.FAIL:
                raise wire.read_failure(self._right, got, self._right_rank)
            if got[0] != wire.ACK or got[4] != seq:
                detail = f"expected the ack of collective #{seq}, got frame kind {got[0]}"
                raise wire.LinkError(self._right_rank, wire.MISMATCH, detail)

    def _has_failed(self) -> bool:
        with self._state_lock:
            return self._failure is not None


def connect_cpu_ring(
    store: JobStore,
    *,
    rank: int,
    world_size: int,
    secret: bytes,
    host: str = "127.0.0.1",
    timeout: float,
    node_rank: int | None = None,
    shared_memory: bool = True,
    setup_timeout: float | None = None,
    nodes: int | None = None,
    origin: str = "",
    first_setup: bool = False,
    slow_peer_warn_s: float = peer_wait.DEFAULT_WARN_S,
    context: str = "",
) -> CpuRingCommunicator:
    """Bind on ``host``, exchange addresses through ``store``, and build the ring.

    ``host`` must be an address the other ranks can reach. When every rank runs on
    this host (and, if given, on the same ``node_rank``), all_reduce goes through
    shared memory instead (``shared_memory=False`` on any rank keeps the TCP ring).
    ``nodes``, when given, is how many nodes the world spans, the same on every rank:
    above 1, shared memory is out for every rank alike, so each reads only its right
    neighbour's address instead of every rank's claim.
    ``setup_timeout`` (default ``timeout``) bounds the whole setup; ``timeout`` then
    bounds each collective. The store's own errors pass through unchanged, but a
    setup that runs out of time names the peer it was waiting for.
    ``slow_peer_warn_s`` and ``context``: as ``CpuRingCommunicator``'s.
    """
    setup = timeout if setup_timeout is None else setup_timeout
    deadline = time.monotonic() + setup
    # A world over several nodes never shares memory, and every rank knows it: each
    # then reads one peer's value, not world_size - 1. Reading them all made the job's
    # set-up world_size**2 round trips through the daemon: 2.5 s at 64 ranks on 2
    # cores and 11.3 s at 128 (0.31 and 0.85 s reading one).
    many_nodes = nodes is not None and nodes > 1
    shm_listener, claim = local_claim(rank, world_size, node_rank, shared_memory and not many_nodes)
    with contextlib.ExitStack() as undo:  # the listeners are closed if setup fails here
        if shm_listener is not None:
            undo.callback(shm_listener.close)
        listener = wire.ring_listener(host, origin=origin)
        undo.callback(listener.close)
        port = listener.getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        # One value per rank carries its ring address and its shared-memory claim:
        # setup is one exchange through the daemon, not two. Each read is a round
        # trip, and 2 x world_size of them took ~0.45 s of a node's recovery beside
        # 36 busy loops on 2 cores.
        # Where the address came from goes after a newline (a claim has "|" in it): a
        # peer that cannot reach it names the setting to change, and on which node.
        told = (
            f"node {node_rank}'s (host {socket.gethostname()})"
            if node_rank is not None
            else (f"rank {rank}'s (host {socket.gethostname()})")
        )
        mine = f"{shown}:{port}|{claim}" + (f"\n{told}, {origin}" if origin else "")
        store.kv_set(f"cpu-ring/peer/{rank}", mine.encode())
        right = (rank + 1) % world_size
        values: dict[int, str] = {}
        origins: dict[int, str] = {}
        for peer in [right] if many_nodes else range(world_size):
            if peer == rank:
                values[peer], _, origins[peer] = mine.partition("\n")
                continue
            remaining = max(0.001, deadline - time.monotonic())
            try:
                value = store.kv_get(f"cpu-ring/peer/{peer}", wait=True, timeout=remaining)
            except TimeoutError as exc:
                raise CommunicatorTimeout(
                    f"rank {rank}: cpu ring setup waited {setup:g} s for rank {peer}'s ring "
                    f"address; rank {peer} has not reached its communicator setup (still "
                    "starting, or stuck before it). Raise setup_timeout_s if it is just slow"
                ) from exc
            values[peer], _, origins[peer] = value.decode("ascii", "replace").partition("\n")
        addresses = {peer: _parse_address(v.partition("|")[0], peer) for peer, v in values.items()}
        undo.pop_all()
    shm = None
    if not many_nodes:
        claims = [values[peer].partition("|")[2] for peer in range(world_size)]
        shm = shared_memory_plan(shm_listener, claims, rank)
    return CpuRingCommunicator(
        rank,
        world_size,
        listener,
        addresses,
        secret,
        timeout,
        shared_memory=shm,
        setup_timeout=max(0.001, deadline - time.monotonic()),
        origins=origins,
        first_setup=first_setup,
        slow_peer_warn_s=slow_peer_warn_s,
        context=context,
    )


def _parse_address(text: str, rank: int) -> tuple[str, int]:
    try:
        return parse_host_port(text, what=f"rank {rank}'s ring address")
    except AddressError as exc:
        raise PeerConnectionError(
            f"rank {rank} published a malformed ring address: {exc}"
        ) from None


def _validate(
    needed: set[int],
    addresses: Mapping[int, tuple[str, int]],
    secret: bytes,
    timeout: float,
    chunk_bytes: int,
) -> None:
    if missing := sorted(needed - addresses.keys()):
        raise ConfigError(f"need the ring addresses of ranks {missing}")
    for host, port in addresses.values():
        if not isinstance(host, str) or not isinstance(port, int) or not 0 <= port < 65536:
            raise ConfigError(f"ring address must be (host, port), got {(host, port)!r}")
    if not isinstance(secret, bytes) or len(secret) < _MIN_SECRET_BYTES:
        raise ConfigError(f"secret must be at least {_MIN_SECRET_BYTES} bytes")
    if not isinstance(timeout, int | float) or not math.isfinite(timeout) or timeout <= 0:
        raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if not isinstance(chunk_bytes, int) or chunk_bytes < _MIN_CHUNK_BYTES:
        raise ConfigError(f"chunk_bytes must be an int >= {_MIN_CHUNK_BYTES}, got {chunk_bytes!r}")


def _flatten(array: Any, rank: int) -> tuple[Array, int]:
    if not isinstance(array, np.ndarray):
        raise CollectiveArgumentError(
            f"rank {rank}: the cpu backend works on numpy arrays, got {type(array).__name__}"
        )
    code = _DTYPES.get(array.dtype)
    if code is None:
        names = ", ".join(str(d) for d in _DTYPES)
        raise CollectiveArgumentError(
            f"rank {rank}: unsupported dtype {array.dtype}; supported: {names}"
        )
    if not array.flags.writeable:
        raise CollectiveArgumentError(f"rank {rank}: array is read-only; collectives work in place")
    if array.flags.c_contiguous:
        return array.reshape(-1), code
    if array.flags.f_contiguous:
        return array.reshape(-1, order="F"), code
    raise CollectiveArgumentError(
        f"rank {rank}: array is not contiguous (shape {array.shape}, strides "
        f"{array.strides}); pass numpy.ascontiguousarray(array) and copy the result back"
    )


def _chunk_size(segment_bytes: int, max_bytes: int) -> int:
    """Bytes per chunk: about four per segment so the pipeline fills, within bounds.

    Measured on loopback: big chunks cut per-syscall overhead on large arrays, small
    ones keep sender and receiver overlapped on small arrays. Every rank derives the
    same value from the array size, so frames line up.
    """
    target = -(-segment_bytes // _PIPELINE_DEPTH)
    return max(min(max_bytes, _MIN_PIPELINE_CHUNK), min(max_bytes, target))


def _chunks(start: int, stop: int, step: int) -> list[tuple[int, int]]:
    # An empty range still yields one (empty) frame, which keeps the ring in lockstep.
    if start >= stop:
        return [(start, start)]
    return [(a, min(a + step, stop)) for a in range(start, stop, step)]


def _divides_after(flat: Array) -> bool:
    """Whether AVG divides the sum (integers: towards zero) rather than each input.
    Floats are scaled first, as NCCL's AVG does (a premultiplied sum): a float16 sum
    of in-range values would otherwise overflow to inf before the division."""
    return flat.dtype.kind != "f"


def _reciprocal(flat: Array, n: int) -> Any:
    """NCCL's premultiplier for AVG over ``n`` ranks in ``flat``'s dtype: 1/n rounded
    to float32 first for float16 and float32 (``float(1.0/nRanks)``), so that each
    input is scaled by the same constant and the same product as on a GPU. Dividing
    instead rounds differently (x/3 and x*float32(1/3) differ in the last bit for a
    third of float32 values)."""
    if flat.dtype.itemsize <= 4:
        return flat.dtype.type(np.float32(1.0 / n))
    return flat.dtype.type(1.0 / n)


def _divide(segment: Array, n: int) -> None:
    """An integer sum divided by ``n`` towards zero, in place: NCCL's AVG
    (``FuncSumPostDiv`` divides the magnitude and negates it back), so that the CPU
    and NCCL backends agree on negative sums where numpy's floor division would not."""
    if segment.dtype.kind != "i":
        np.floor_divide(segment, n, out=segment)
        return
    # floor(x / n) is one below the truncated quotient where x < 0 and n does not divide it.
    below = (segment < 0) & (np.remainder(segment, n) != 0)
    np.floor_divide(segment, n, out=segment)
    np.add(segment, below, out=segment, casting="unsafe")
