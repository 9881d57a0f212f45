"""Shared-memory all-reduce between ranks on one host: the cpu backend's fast path.

Why hand-written: gloo has no shared-memory transport and torch is not a dependency.
``multiprocessing.shared_memory`` (Python 3.11) registers every attached segment with a
resource tracker that unlinks it when any one process exits, so segments here are
anonymous memfds handed over UNIX sockets (SCM_RIGHTS): nothing is named on disk, and
nothing is left behind when a process is killed.

Each rank owns a memfd segment: a header page of progress words, then three slots of
``slot_bytes``. An all-reduce walks the array in chunks of at most one slot; every
chunk is cut into one segment per rank, and for chunk c:

1. each rank copies the chunk (all but its own segment) into slot c % 3 and publishes
   READY c in its progress word;
2. once every peer is READY c, each rank reduces *its* segment (its own input plus
   every peer's slot) into its own slot and publishes DONE c;
3. once every peer is DONE c, each rank copies every segment out of its owner's slot.

Chunk c + 1 is staged between steps 2 and 3, so a rank rarely sleeps with work left.
Every segment is reduced by exactly one rank, so all ranks end with the same bits.
The chunk counter runs across collectives; a rank refills slot c % 3 (at chunk c + 3)
only after every peer was READY c + 2, which a peer publishes only after it copied
chunk c out. Copies in and out make the caller's array free to reuse at once.

Waiting is a futex on the peer's progress word (trainer/comm/futex.py), in slices of
50 ms that also poll the peer's socket: a killed peer is noticed within a slice.
The header also carries each rank's collective descriptor, so mismatched calls are
caught, not summed.

Peers are connected by a full mesh of UNIX stream sockets in the abstract namespace,
used to hand over the memfds and, afterwards, only for FAIL notices that name the
rank that failed. A connection is kept only if the peer runs as the same user
(SO_PEERCRED) and passes the mutual handshake of ``peer_auth`` (the same one as the
TCP ring), so the socket name alone grants nothing.

Memory ordering: a rank publishes "data written" with a plain store of its progress
word after the data copy, and a peer reads the word before the data, with no fence in
between (numpy and ctypes cannot issue one, and the futex syscalls run only when a
waiter sleeps, so they do not order the fast path). That is correct only where stores
become visible in program order and loads are not reordered with older loads: x86-64's
total store order. On weakly ordered CPUs (ARM, e.g. Grace-Hopper, POWER, RISC-V) a
peer could see the new progress word before the data and sum stale bytes without any
error, so ``unsupported_reason`` gates the whole transport to x86-64 Linux.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from rendezvousd.trainer.comm import futex, peer_auth, peer_wait
from rendezvousd.trainer.comm import ring_wire as wire
from rendezvousd.trainer.errors import CommunicatorTimeout, ConfigError, PeerConnectionError

__all__ = [
    "DEFAULT_SLOT_BYTES",
    "SharedMemoryPeers",
    "ShmGroup",
    "create_listener",
    "host_identity",
    "unsupported_reason",
]

# 2-4 MiB measured best for 64 MiB float32 arrays at world 4 on the development
# machine (1 MiB: 0.78 GB/s bus bandwidth, 2-4 MiB: 1.2-1.3, 16 MiB: 0.88): small
# enough that a chunk is still in the shared L3 cache when its owner reduces it.
DEFAULT_SLOT_BYTES = 4 << 20
_SLOTS = 3
# Each segment starts with a header page of 32-bit words, written only by its owner.
_HEADER_BYTES = 4096
_PROGRESS = 0  # 2c + 1 once chunk c is staged (READY), 2c + 2 once reduced (DONE)
_FAILED = 1  # nonzero once the owner stopped; its FAIL notice is on the socket
_DESCRIPTOR = slice(2, 8)  # collective, op, dtype, sequence, bytes (low, high)
_SEQUENCE = 5
_MASK = 0xFFFFFFFF
# How often a waiter looks for a dead peer (a killed process never wakes anyone).
_LIVENESS_POLL_S = 0.05
# Its last digits are the wire version, as the ring's (``ring_wire._MAGIC``).
_MAGIC = b"RDVSHM03"
_HANDSHAKE_S = 5.0
_UCRED = struct.Struct("iII")  # pid, uid, gid

Array = npt.NDArray[Any]
Ufunc = Callable[..., Any]

# Machines whose memory model makes the unfenced progress-word hand-off correct (see
# the module docstring); platform.machine() spells x86-64 either way.
_TOTAL_STORE_ORDER = frozenset({"x86_64", "amd64"})


def unsupported_reason() -> str | None:
    """Why this machine must not run a shared-memory group, or None where it may."""
    machine = platform.machine()
    if machine.lower() not in _TOTAL_STORE_ORDER:
        return (
            f"the shared-memory all-reduce relies on x86-64 store ordering and this "
            f"machine is {machine or 'of unknown architecture'}"
        )
    if not futex.available():
        return "the shared-memory all-reduce needs Linux futexes"
    return None


def host_identity() -> str:
    """Ranks with equal identities can share memory and reach each other's sockets.

    The boot id tells hosts (and reboots) apart; the network namespace decides which
    abstract UNIX sockets a process can reach, so containers without a shared network
    namespace never try.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return ""  # not Linux: never share memory
    return f"{boot}/{netns}"


@dataclass(frozen=True)
class SharedMemoryPeers:
    """What a rank needs to join its host's group: its own listener (the group takes
    ownership), every member's listener name indexed by rank, and the slot size (every
    member must use the same)."""

    listener: socket.socket
    names: Sequence[str]
    slot_bytes: int = DEFAULT_SLOT_BYTES


def create_listener() -> tuple[socket.socket, str]:
    """A listening UNIX socket under a random abstract name, and that name (hex)."""
    name = secrets.token_hex(16)
    return wire.listening(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), _address(name)), name


def _address(name: str) -> bytes:
    return b"\0rendezvousd-shm-" + name.encode("ascii")


class ShmGroup:
    """One rank's end of a shared-memory group; see the module docstring.

    ``members`` are the global ranks in the group (ascending) and ``names`` their
    listener names in the same order; ``rank`` is this process's global rank, used
    in every message and error. The collective's caller serializes calls;
    ``signal_failure`` may come from any thread.
    """

    def __init__(
        self,
        rank: int,
        members: Sequence[int],
        listener: socket.socket,
        names: Sequence[str],
        key: bytes,
        timeout: float,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        setup_timeout: float | None = None,
        waits: peer_wait.PeerWaits | None = None,
    ) -> None:
        """``timeout``: each collective's wait for a peer; ``setup_timeout``: the group's
        forming (default ``timeout``), which may wait for peers still starting;
        ``waits``: the communicator's watcher, told of a wait that goes to sleep."""
        reason = unsupported_reason()
        if reason is not None:
            listener.close()
            raise ConfigError(f"rank {rank}: {reason}; use the TCP ring (shared_memory=None)")
        self._rank = rank
        self._members = list(members)
        self._index = self._members.index(rank)
        self._auth = peer_auth.PeerAuth(key, _MAGIC, rank, len(self._members))
        self._timeout = timeout
        self._setup_timeout = timeout if setup_timeout is None else setup_timeout
        self._slot_bytes = slot_bytes
        self._chunk_counter = 0
        self._segment_bytes = _HEADER_BYTES + _SLOTS * slot_bytes
        self._send_lock = threading.Lock()
        self._stopped = False
        self._announced = [0] * 6  # this rank's collective descriptor (``announce``)
        self._expect: tuple[int, ...] = (0, 0, 0, 0, 0)  # the same, as ``announce`` got it
        self._waits = waits
        self._raw: list[Array] = []
        self._words: list[Array] = []
        self._addresses: list[int] = []
        fd = os.memfd_create("rendezvousd-shm", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, self._segment_bytes)
            own = mmap.mmap(fd, self._segment_bytes)
            self._maps: list[mmap.mmap | None] = [None] * len(self._members)
            self._maps[self._index] = own
            self._peers: dict[int, socket.socket] = {}
            try:
                self._connect_mesh(listener, names, fd)
            except BaseException:
                self.close()
                raise
        finally:
            os.close(fd)
        self._raw = [np.frombuffer(m, np.uint8) for m in self._maps if m is not None]
        self._words = [raw[:_HEADER_BYTES].view(np.uint32) for raw in self._raw]
        self._addresses = [int(raw.ctypes.data) for raw in self._raw]
        # After setup the sockets carry nothing but FAIL notices, so any readable or
        # hung-up socket means that peer stopped.
        self._poller = select.poll()
        for index, sock in self._peers.items():
            wire.set_io_timeout(sock, timeout)
            self._poller.register(sock, select.POLLIN | select.POLLHUP)
            if waits is not None:
                with contextlib.suppress(OSError):
                    pid = _UCRED.unpack(
                        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
                    )[0]
                    waits.hosts[self._members[index]] = f"pid {pid} on this host"

    # -- setup --------------------------------------------------------------------------

    def _connect_mesh(self, listener: socket.socket, names: Sequence[str], fd: int) -> None:
        # Connect down, accept up: every rank waits only on lower ranks, so no cycle.
        deadline = time.monotonic() + self._setup_timeout
        for index in range(self._index):
            sock = self._dial(names[index], self._members[index], deadline)
            self._exchange_fds(sock, index, fd)
        listener.settimeout(max(0.001, deadline - time.monotonic()))
        last_rejection = ""
        while len(self._peers) < len(self._members) - 1:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                missing = [
                    str(m)
                    for i, m in enumerate(self._members)
                    if i > self._index and i not in self._peers
                ]
                note = f" (last rejected connection: {last_rejection})" if last_rejection else ""
                raise CommunicatorTimeout(
                    f"rank {self._rank}: rank(s) {', '.join(missing)} on this host did not "
                    f"join the shared-memory group within {self._setup_timeout:g} s{note}"
                ) from None
            admitted = self._admit(conn, deadline)
            if isinstance(admitted, str):
                last_rejection = admitted
            else:
                self._exchange_fds(conn, admitted, fd)
            listener.settimeout(max(0.001, deadline - time.monotonic()))

    def _dial(self, name: str, peer: int, deadline: float) -> socket.socket:
        where = f"rank {self._rank}: shared-memory peer rank {peer}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(0.001, min(_HANDSHAKE_S, deadline - time.monotonic())))
            try:
                sock.connect(_address(name))
            except OSError as exc:
                raise PeerConnectionError(f"{where} is not reachable: {exc.strerror}") from exc
            _check_same_user(sock, where)
            peer_auth.dial(sock, self._auth, peer, where)
        except BaseException:
            sock.close()
            raise
        return sock

    def _admit(self, conn: socket.socket, deadline: float) -> int | str:
        """The peer's group index if ``conn`` is an authenticated higher member, else why not."""

        def admissible(rank: int) -> bool:
            index = self._members.index(rank) if rank in self._members else -1
            return index > self._index and index not in self._peers

        try:
            conn.settimeout(max(0.001, min(_HANDSHAKE_S, deadline - time.monotonic())))
            _check_same_user(conn, "connection")
            rank = peer_auth.accept(conn, self._auth, admissible, "shared-memory socket")
        except (OSError, PeerConnectionError) as exc:
            # A stray or foreign connection: drop it and keep waiting for real members.
            conn.close()
            return str(exc) if isinstance(exc, PeerConnectionError) else "connection error"
        return self._members.index(rank)

    def _exchange_fds(self, sock: socket.socket, index: int, fd: int) -> None:
        peer = self._members[index]
        self._peers[index] = sock
        try:
            socket.send_fds(sock, [b"m"], [fd])
            _, fds, _, _ = socket.recv_fds(sock, 1, 1)
        except OSError as exc:
            raise PeerConnectionError(
                f"rank {self._rank}: shared-memory peer rank {peer} broke off setup: {exc}"
            ) from exc
        if len(fds) != 1:
            for extra in fds:
                os.close(extra)
            raise PeerConnectionError(
                f"rank {self._rank}: shared-memory peer rank {peer} sent no memory segment"
            )
        try:
            if os.fstat(fds[0]).st_size != self._segment_bytes:
                raise PeerConnectionError(
                    f"rank {self._rank}: shared-memory peer rank {peer} uses another slot size"
                )
            self._maps[index] = mmap.mmap(fds[0], self._segment_bytes)
        finally:
            os.close(fds[0])

    # -- data path ----------------------------------------------------------------------

    def all_reduce(
        self,
        flat: Array,
        ufunc: Ufunc,
        finish: Callable[[Array], None] | None,
        expect: tuple[int, int, int, int, int],
    ) -> None:
        """Reduce ``flat`` in place across the group with ``ufunc``.

        The owner of each reduced segment applies ``finish`` (e.g. AVG's division)
        before anyone copies it out.
        ``expect`` is (collective, op, dtype code, sequence, bytes), checked against
        every peer's notifications.
        """
        size = flat.itemsize
        step = max(1, self._slot_bytes // size)
        chunks = [(a, min(flat.size, a + step)) for a in range(0, flat.size, step)] or [(0, 0)]
        base = self._chunk_counter
        self.announce(expect)
        # Software-pipelined: chunk i + 1 is staged between announcing DONE i and
        # waiting for everyone else's DONE i, so a rank rarely blocks with work left.
        self._stage(flat, chunks[0], base)
        for i, (start, stop) in enumerate(chunks):
            views, bounds = self._views(flat.dtype, base + i, stop - start)
            self._await_all(2 * (base + i) + 1)
            if i == 0:
                self._check_descriptors(expect)
            self._reduce_own(flat[start:stop], views, bounds, ufunc, finish)
            self._post(2 * (base + i) + 2)
            if i + 1 < len(chunks):
                self._stage(flat, chunks[i + 1], base + i + 1)
            self._await_all(2 * (base + i) + 2)
            for j in range(len(views)):
                flat[start + bounds[j] : start + bounds[j + 1]] = views[j][
                    bounds[j] : bounds[j + 1]
                ]
        self._chunk_counter = base + len(chunks)

    def announce(self, expect: tuple[int, int, int, int, int]) -> None:
        """Publish this rank's collective (``all_reduce``'s ``expect``), also one that
        runs on the TCP ring (broadcast, barrier): a peer waiting here for this rank
        then reports the mismatch at once instead of timing out."""
        words, want = self._words[self._index], _descriptor(expect)
        # The sequence last: a peer that reads it first (``_ahead``) sees the rest.
        words[_DESCRIPTOR] = [*want[:3], words[_SEQUENCE], *want[4:]]
        words[_SEQUENCE] = want[3]
        self._announced = want
        self._expect = expect
        futex.wake(self._addresses[self._index])

    def _views(
        self, dtype: np.dtype[Any], chunk: int, length: int
    ) -> tuple[list[Array], list[int]]:
        """Every member's slot for ``chunk``, as ``length`` items, and the segment bounds."""
        offset = _HEADER_BYTES + (chunk % _SLOTS) * self._slot_bytes
        end = offset + length * dtype.itemsize
        views = [raw[offset:end].view(dtype) for raw in self._raw]
        n = len(views)
        return views, [i * (length // n) + min(i, length % n) for i in range(n + 1)]

    def _stage(self, flat: Array, span: tuple[int, int], chunk: int) -> None:
        # The own segment stays put: _reduce_own reads it straight from ``flat``.
        start, stop = span
        views, bounds = self._views(flat.dtype, chunk, stop - start)
        mine, a, b = views[self._index], bounds[self._index], bounds[self._index + 1]
        mine[:a] = flat[start : start + a]
        mine[b:] = flat[start + b : stop]
        self._post(2 * chunk + 1)

    def _reduce_own(
        self,
        chunk: Array,
        views: list[Array],
        bounds: list[int],
        ufunc: Ufunc,
        finish: Callable[[Array], None] | None,
    ) -> None:
        me = self._index
        a, b = bounds[me], bounds[me + 1]
        if b == a:
            return
        mine = views[me][a:b]
        source = chunk[a:b]  # this rank's own input, never staged
        for j, view in enumerate(views):
            if j != me:
                ufunc(source, view[a:b], out=mine)
                source = mine
        if finish is not None:
            finish(mine)

    def _post(self, progress: int) -> None:
        # Correct only under total store order (see unsupported_reason): the data
        # written before this store becomes visible to peers first.
        self._words[self._index][_PROGRESS] = progress & _MASK
        futex.wake(self._addresses[self._index])

    def _await_all(self, progress: int) -> None:
        target = progress & _MASK
        for index in self._peers:
            self._await(index, target)

    def _await(self, index: int, target: int) -> None:
        words = self._words[index]
        deadline = 0.0
        waits = None
        while True:
            current = int(words[_PROGRESS])
            if (current - target) & _MASK < 1 << 31:  # current >= target, modulo 2**32
                if waits is not None:
                    # Not on a failure: the communicator clears it once the failure is
                    # recorded, so that the watcher does not say the peer was heard again.
                    waits.current = None
                return
            if self._stopped:
                # This rank's own abort; the communicator reports the failure it recorded.
                raise wire.LinkError(self._rank, wire.ABORTED, "stopped")
            if words[_FAILED]:
                raise self._notice_from(index)
            if (mismatch := self._ahead(index, target)) is not None:
                raise mismatch
            now = time.monotonic()
            if not deadline:
                deadline = now + self._timeout
                # A wait that sleeps, told to the watcher (``peer_wait``) with the clock
                # read it takes anyway; one that finds the peer ready pays nothing.
                if (waits := self._waits) is not None:
                    waits.current = (now, self._members[index], self._expect, peer_wait.SHARED)
            elif now >= deadline:
                peer = self._members[index]
                raise wire.LinkError(peer, wire.TIMEOUT, "no progress within the timeout")
            slice_s = min(_LIVENESS_POLL_S, deadline - now)
            if not futex.wait(self._addresses[index], current, slice_s):
                self._check_links()

    def _ahead(self, index: int, target: int) -> wire.LinkError | None:
        """The mismatch, if the peer this rank waits for announced a collective of the
        same sequence or later and not this one: it will never post ``target``."""
        words = self._words[index]
        seq = int(words[_SEQUENCE])
        if (seq - self._announced[3]) & _MASK >= 1 << 31:
            return None  # still in an earlier collective
        got = [int(v) for v in words[_DESCRIPTOR]]
        got[3] = seq
        # Posted meanwhile, then moved on: its next collective is no mismatch.
        if got == self._announced or (int(words[_PROGRESS]) - target) & _MASK < 1 << 31:
            return None
        return self._mismatch(self._members[index], got, self._announced)

    def _check_descriptors(self, expect: tuple[int, ...]) -> None:
        want = _descriptor(expect)
        for index in self._peers:
            got = [int(v) for v in self._words[index][_DESCRIPTOR]]
            if got != want:
                raise self._mismatch(self._members[index], got, want)

    def _mismatch(self, peer: int, theirs: list[int], ours: list[int]) -> wire.LinkError:
        """``peer`` is in another collective than this rank: both named, in words."""
        detail = f"rank {peer} is in {_describe(theirs)}; rank {self._rank} is in {_describe(ours)}"
        return wire.LinkError(peer, wire.MISMATCH, detail)

    def _check_links(self) -> None:
        """Raise for the first peer whose socket says it stopped (notice or exit)."""
        for fd, _ in self._poller.poll(0):
            index = next(i for i, s in self._peers.items() if s.fileno() == fd)
            raise self._notice_from(index)

    def _notice_from(self, index: int) -> wire.LinkError:
        peer = self._members[index]
        sock = self._peers[index]
        header = bytearray(wire.FRAME.size)
        try:
            wire.recv_exact(sock, memoryview(header), peer)
        except wire.LinkError as exc:
            return exc
        got = wire.FRAME.unpack(header)
        if got[0] != wire.FAIL:
            return wire.LinkError(peer, wire.LOST, f"unexpected frame kind {got[0]}")
        return wire.read_failure(sock, got, peer)

    # -- failure and teardown -------------------------------------------------------------

    def signal_failure(self, notice: bytes) -> None:
        """Tell every peer why this rank stops, then cut the links so no one waits on it."""
        # Never block here: this runs from abort(), possibly while a send is in flight.
        acquired = self._send_lock.acquire(timeout=0.1)
        try:
            for sock in self._peers.values():
                with contextlib.suppress(OSError):
                    sock.send(notice, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
        finally:
            if acquired:
                self._send_lock.release()
        self._stopped = True
        if self._words:
            self._words[self._index][_FAILED] = 1
            for address in self._addresses:
                # Wakes peers waiting on this rank and this rank's own waiter.
                futex.wake(address)
        for sock in self._peers.values():
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        for sock in self._peers.values():
            sock.close()
        self._peers = {}
        self._raw, self._words, self._addresses = [], [], []
        for index, mapped in enumerate(self._maps):
            if mapped is not None:
                # A view the caller still holds keeps the mapping alive; the kernel
                # frees it with the last reference.
                with contextlib.suppress(BufferError):
                    mapped.close()
                self._maps[index] = None


def _check_same_user(sock: socket.socket, where: str) -> None:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    _, uid, _ = _UCRED.unpack(creds)
    if uid != os.getuid():
        raise PeerConnectionError(f"{where} runs as uid {uid}, not {os.getuid()}")


def _descriptor(expect: tuple[int, ...]) -> list[int]:
    coll, op, dtype, seq, nbytes = expect
    return [coll, op, dtype, seq & _MASK, nbytes & _MASK, nbytes >> 32]


def _describe(words: list[int]) -> str:
    coll, op, dtype, seq, low, high = words
    return wire.describe_collective(coll, op, dtype, seq, low | high << 32)
