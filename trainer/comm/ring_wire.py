"""Wire layer of the CPU ring: authenticated connection setup, frames, the sender thread.

Sockets are written by hand on purpose: gloo and torch are not dependencies, and a
ring needs only two TCP streams per rank.

Every rank connects to its right neighbour and accepts from its left. Both ends
authenticate with the handshake of ``peer_auth`` (HMAC over fresh nonces from both
sides, binding rank, world size and the rank they meant to reach); handshakes advance
under one selector, so a stray or foreign connection never blocks the accept loop.

After setup, data flows left to right as frames (a fixed header, then the payload).
The otherwise idle right-to-left direction carries acknowledgements and failure
notices, so a failing rank can tell its upstream neighbour why.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import queue
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rendezvousd.common.address import host_port
from rendezvousd.trainer.comm import peer_auth
from rendezvousd.trainer.errors import CommunicatorTimeout, PeerConnectionError

# Frame kinds.
DATA = 1
ACK = 2
FAIL = 3

# Collectives, carried in every data frame so mismatched calls are caught, not summed.
ALL_REDUCE = 1
BROADCAST = 2
BARRIER = 3
COLLECTIVE_NAMES = {ALL_REDUCE: "all_reduce", BROADCAST: "broadcast", BARRIER: "barrier"}
#: The wire's op and dtype codes (1-based; 0 is none), by name: the ranks compare
#: codes, and a mismatch is told in these names, not as "op 3, dtype 2".
OP_NAMES = ("SUM", "AVG", "MAX", "MIN")
DTYPE_NAMES = (
    "float16",
    "float32",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
)


def describe_collective(coll: int, op: int, dtype: int, seq: int, nbytes: int) -> str:
    """One collective as a mismatch names it: ``all_reduce #3 (SUM of float32, 16 bytes)``."""
    name = COLLECTIVE_NAMES.get(coll, f"collective {coll}")
    if coll == BARRIER:
        return f"{name} #{seq}"
    if coll == BROADCAST and op:
        # The agreement that opens every broadcast (an all-reduce MAX over int64s,
        # ``RankedCommunicator._agree``): its own 48 bytes are not the caller's.
        return f"{name} #{seq} (agreeing on its root, size and type first)"
    what = _named(DTYPE_NAMES, dtype, "dtype")
    if coll == ALL_REDUCE:
        what = f"{_named(OP_NAMES, op, 'op')} of {what}"
    return f"{name} #{seq} ({what}, {nbytes} bytes)"


def _named(names: tuple[str, ...], code: int, what: str) -> str:
    return names[code - 1] if 0 < code <= len(names) else f"{what} code {code}"


# Failure codes, carried in FAIL frames so every survivor names the rank that failed.
LOST = 1
TIMEOUT = 2
ABORTED = 3
MISMATCH = 4
INTERRUPTED = 5
#: The detail of the ABORTED notice ``close()`` sends: a rank that closed its
#: communicator with no failure first (it finished, or left its ``with`` block early).
#: Its peers word it as a rank that left, not one that aborted. The same bytes every
#: ``RDVRING3`` rank sends on close, only read apart: no wire change.
CLOSED = "communicator closed"

# kind, collective, op (or failure code), dtype, sequence, total bytes, aux (root or
# origin rank), frame index, payload length.
FRAME = struct.Struct("<BBBBIQIII")
MAX_DETAIL_BYTES = 512

# Its last digit is the wire version: raise it with any change to what ranks send each
# other or how they read it, so that ranks of two versions are refused as such
# (``peer_auth.other_version``). 3: the broadcast's agreement frame, integer AVG
# rounded towards zero.
_MAGIC = b"RDVRING3"
#: What a node agent tells the daemon its nodes speak to each other
#: (``JoinNodeRequest.wire_version``): the ring's magic, whose digit is raised with any
#: change to what ranks send each other, so that the daemon refuses a node of another
#: version at its join. (The package version cannot tell two checkouts apart, nor says
#: whether they can train together; the wire version does.)
WIRE_VERSION = _MAGIC.decode()
# A real peer answers in milliseconds; a silent stray is dropped after this.
_HANDSHAKE_S = 5.0
_MAX_PENDING = 32


class LinkError(Exception):
    """Internal: a ring link failed; the communicator turns it into a public error."""

    def __init__(self, origin: int, code: int, detail: str, via: int | None = None) -> None:
        super().__init__(detail)
        self.origin = origin
        self.code = code
        self.detail = detail
        self.via = via


def _tcp_socket(host: str, port: int) -> tuple[socket.socket, Any]:
    """A TCP socket of the family ``host`` resolves to, and the address to use it on.

    No Nagle delay: acks and the last chunk of a collective are small and latency-bound.
    Socket buffers are left to Linux autotuning, which measured as fast as fixed
    1-4 MiB buffers on loopback.
    """
    family, stype, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, stype, proto)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock, addr


def create_listener(host: str, port: int = 0) -> socket.socket:
    """Bind a listening TCP socket on ``host`` (an ephemeral port by default)."""
    return listening(*_tcp_socket(host, port))


def ring_listener(host: str, *, origin: str = "", port: int = 0) -> socket.socket:
    """``create_listener`` for a rank's own ring address, whose EADDRNOTAVAIL says what
    it means here: the address was this host's when it was chosen (a ``ring_host``
    that never was is refused before any worker starts), so the host's address changed
    since (a DHCP renewal, a migrated VM, a re-addressed host). Said as the bare errno,
    "Cannot assign requested address" named neither the address nor why. An OSError
    still, with its errno: a worker's own failure, reported as such."""
    try:
        return create_listener(host, port)
    except OSError as exc:
        if exc.errno != errno.EADDRNOTAVAIL:
            raise
        where = f" ({host} was {origin})" if origin else ""
        raise OSError(
            exc.errno,
            f"cannot listen for the ring on {host}: {host} is no longer an address of "
            f"this host ({socket.gethostname()}; {exc.strerror}, EADDRNOTAVAIL), which "
            f"held it when it was chosen{where}: the host's address changed (a DHCP "
            "renewal, a migrated VM, a re-addressed host). rendezvous-run chooses an "
            "address it was not given again at its next restart; one given by "
            "--ring-host ($RENDEZVOUSD_RING_HOST, ring_host) must be changed to an "
            "address this host has",
        ) from None


def listening(sock: socket.socket, addr: Any) -> socket.socket:
    """``sock`` bound to ``addr`` and listening (TCP here, UNIX for ``shm_group``);
    closed if either fails, so a refused address leaks no descriptor."""
    try:
        sock.bind(addr)
        sock.listen(64)
    except BaseException:
        sock.close()
        raise
    return sock


#: A link whose peer's host answers nothing at all (no TCP acknowledgement, no
#: keepalive reply) for this long is dead. Without it a cut between two nodes that both
#: still reach the daemon held every rank until collective_timeout_s (300 s): their
#: heartbeats go on, so only the link can tell. A live host's kernel answers at once
#: even while its process is stopped or slow, so only a cut network or a host that is
#: gone goes this silent.
LINK_SILENCE_S = 10.0
#: One connect's wait while the ring forms. A peer host that answers nothing (the
#: network between the hosts cut, a firewall dropping it) is said after it, once, and
#: asked again until the setup's deadline: a connect waited the whole setup timeout
#: (300 s) without a word (a chaos review, nodes cut apart at launch).
CONNECT_ATTEMPT_S = LINK_SILENCE_S

log = logging.getLogger("rendezvousd.trainer")


def watch_link(sock: socket.socket) -> None:
    """End ``sock`` with ETIMEDOUT once its peer's host has been silent
    ``LINK_SILENCE_S``: TCP's user timeout for unacknowledged data, and keepalive probes
    every second so that a link that is only waiting to receive is covered too."""
    if not hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux only; elsewhere the io timeout
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, round(LINK_SILENCE_S))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, round(LINK_SILENCE_S * 1000))


def link_error(exc: OSError, peer: int | None = None) -> str:
    """What a link's OSError says, in words that name a silent peer host as such, and
    a reset as possibly a firewall's: "reset by peer" blamed the healthy peer when a
    firewall on this host sent the reset (h160, on namespace hosts)."""
    if exc.errno == errno.ETIMEDOUT:
        return (
            f"its host answered nothing for {LINK_SILENCE_S:g} s (the network between "
            "the two hosts is cut, or that host is down)"
        )
    if exc.errno == errno.ECONNRESET:
        whose = f"rank {peer}'s host" if peer is not None else "the peer's host"
        return f"connection reset (by {whose}, or a firewall between)"
    return f"connection error: {exc.strerror}"


def _timed_out(peer: int, exc: OSError, stalled: str) -> LinkError:
    """A link call that timed out: the kernel's ETIMEDOUT is the peer's host gone silent
    (``watch_link``), anything else this side's own io timeout (``stalled``)."""
    if exc.errno == errno.ETIMEDOUT:
        return LinkError(peer, LOST, link_error(exc))
    return LinkError(peer, TIMEOUT, stalled)


def set_io_timeout(sock: socket.socket, seconds: float) -> None:
    """Blocking socket with kernel-side timeouts, so MSG_WAITALL reads stay one syscall."""
    sock.settimeout(None)
    whole = int(seconds)
    micros = min(999_999, round((seconds - whole) * 1e6))
    tv = struct.pack("ll", whole, micros if whole or micros else 1)  # 0 would mean "never"
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


@dataclass
class _Pending:
    sock: socket.socket
    #: The dialer's address (HOST:PORT), as a rejection names it.
    peer: str
    acceptance: peer_auth.Acceptance
    deadline: float
    buffer: bytearray


def establish_ring(
    listener: socket.socket,
    addresses: Mapping[int, tuple[str, int]],
    secret: bytes,
    rank: int,
    world: int,
    timeout: float,
    *,
    origin: str = "",
    first_setup: bool = False,
    own_origin: str = "",
) -> tuple[socket.socket, socket.socket]:
    """Return authenticated (left, right) sockets; accept and connect run concurrently.

    ``origin``: whose the right neighbour's address is and where it came from
    (``node 1's (host n2), chosen as its host's route to the daemon at ...``), said with
    the setting to change when it cannot be reached. ``first_setup``: no ring of this
    run formed before; a right neighbour with no route to it for ``FIRST_NO_ROUTE_S``
    then ends the setup (its address is wrong more likely than the network cut).
    ``own_origin``: the same of this rank's own address, said when the left neighbour
    never connected (it may be the one that cannot reach it).
    """
    auth = peer_auth.PeerAuth(peer_auth.derive_key(secret), _MAGIC, rank, world)
    deadline = time.monotonic() + timeout
    right = (rank + 1) % world
    outcome: list[socket.socket | BaseException] = []

    def connect() -> None:
        try:
            outcome.append(
                _connect(auth, right, addresses[right], deadline, timeout, origin, first_setup)
            )
        except BaseException as exc:
            outcome.append(exc)

    def connect_failed() -> bool:
        return bool(outcome) and isinstance(outcome[0], BaseException)

    thread = threading.Thread(target=connect, name=f"cpu-ring-connect-r{rank}", daemon=True)
    thread.start()
    acceptor = _Acceptor(auth, listener, timeout, own_origin)
    try:
        # Stops early once the connect side failed: setup is lost either way.
        left = acceptor.run(deadline, connect_failed)
    except BaseException:
        thread.join()
        if outcome and isinstance(outcome[0], socket.socket):
            outcome[0].close()
        raise
    thread.join()
    result = outcome[0]
    if isinstance(result, BaseException):
        if left is not None:
            left.close()
        if isinstance(result, CommunicatorTimeout) and acceptor.last_rejection:
            # A peer this rank rejected fails and closes its listener; our dial then
            # reads "not listening yet" to the end. The rejection is the cause.
            raise CommunicatorTimeout(
                f"{result} (this rank rejected a connection meanwhile: {acceptor.last_rejection})"
            ) from result
        raise result
    assert left is not None
    for sock in (left, result):
        set_io_timeout(sock, timeout)
        watch_link(sock)
    return left, result


#: A connect's errors that a network cut or a peer not up yet gives, which pass: asked
#: again until the setup's deadline. A route lost for a moment (an ARP failure on the
#: same L2, an ICMP host-unreachable, a link flapping) read as fatal at once, and a 25 s
#: cut between two nodes used a job's every restart in 7 s (an operator review).
_PASSING_CONNECT_ERRNOS = frozenset(
    {
        errno.ECONNREFUSED,  # the peer still binding its listener
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.ETIMEDOUT,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.EHOSTDOWN,
        errno.ENETDOWN,
    }
)
#: Of those, the ones that mean the network is down between the hosts: said once,
#: as a silent host is, since they are rarely a peer merely starting late.
_ROUTE_ERRNOS = frozenset({errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN})
#: ...and those a listener not up yet gives as well as a firewall rejecting (REJECT,
#: tcp-reset): said once they lasted REFUSED_SAID_S. A firewall's reject was asked
#: again in silence up to the setup's deadline (300 s), the job seemingly hung (h160).
_REFUSED_ERRNOS = frozenset({errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED})
#: How long a connect is refused or reset before it is said: longer than a peer's
#: start takes to bind its listener.
REFUSED_SAID_S = 10.0


#: How long a first setup asks again a right neighbour that this host has no route
#: to, before it ends: the neighbour's advertised address is on a network this host
#: does not reach (the nodes reach the daemon on a management network but not each
#: other there) far more often than a cut comes at launch, and the setup's 300 s, then
#: the same again per restart, was all the user waited before "did not connect and
#: authenticate", which blamed the rank that could not be reached. Longer than an ARP
#: failure (3 s) and a link coming up at a pod's start; a cut of a running job's
#: network (not a first setup) is still asked again until the setup's deadline.
FIRST_NO_ROUTE_S = 15.0


def _unreachable_advice(origin: str) -> str:
    """What a rank that cannot reach its right neighbour's address says of where that
    address came from and what to set: at the end, which a shortened cause (a root
    cause's 120 characters) keeps."""
    if not origin:
        return ""
    return f"; that address is {origin} (the one to fix, not this rank's): {_fix(origin)}"


def _fix(origin: str) -> str:
    """The setting that changes an address of ``origin`` (``node 1's (host n2), ...``)."""
    owner = origin.partition(",")[0].split(" (")[0].removesuffix("'s")  # "node 1"
    return (
        "if the hosts reach each other on another network, set --ring-host "
        f"($RENDEZVOUSD_RING_HOST, ring_host) on {owner} to its address there"
    )


def _errno_words(exc: OSError) -> str:
    """``No route to host (EHOSTUNREACH)``: the kernel's words and the errno's name."""
    name = errno.errorcode.get(exc.errno, "") if exc.errno is not None else ""
    if not name:  # a socket timeout of our own: no errno
        return f"no answer within {CONNECT_ATTEMPT_S:g} s"
    return f"{exc.strerror or name} ({name})"


def _connect(
    auth: peer_auth.PeerAuth,
    peer: int,
    address: tuple[str, int],
    deadline: float,
    timeout: float,
    origin: str = "",
    first_setup: bool = False,
) -> socket.socket:
    where = f"rank {auth.rank}: rank {peer} at {host_port(address[0], address[1])}"
    advice = _unreachable_advice(origin)
    delay = 0.02
    told = False
    last: OSError | None = None
    no_route_since: float | None = None
    refused_since: float | None = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            why = f" (last attempt: {_errno_words(last)})" if last is not None else ""
            raise CommunicatorTimeout(
                f"{where} was not reachable within {timeout:g} s{why}{advice}"
            )
        sock, addr = _tcp_socket(*address)
        try:
            sock.settimeout(min(remaining, CONNECT_ATTEMPT_S))
            sock.connect(addr)
        except OSError as exc:
            sock.close()
            # A socket timeout of our own (TimeoutError, no errno) passes too.
            if not isinstance(exc, TimeoutError) and exc.errno not in _PASSING_CONNECT_ERRNOS:
                raise PeerConnectionError(
                    f"{where} could not be reached: {_errno_words(exc)}; not asked again (only "
                    "a refused, reset or timed-out connect and a missing route are)"
                ) from exc
            last = exc
            now = time.monotonic()
            if exc.errno in _ROUTE_ERRNOS:
                no_route_since = now if no_route_since is None else no_route_since
                if first_setup and now - no_route_since >= FIRST_NO_ROUTE_S:
                    raise PeerConnectionError(
                        f"{where} cannot be reached: {_errno_words(exc)} for "
                        f"{now - no_route_since:.0f} s at this run's first ring setup"
                        f"{advice or ' (the network between the two hosts is down or its route is missing)'}"
                    ) from exc
            else:
                no_route_since = None
            if exc.errno in _REFUSED_ERRNOS:
                refused_since = now if refused_since is None else refused_since
            else:
                refused_since = None
            if not told and time.monotonic() < deadline:
                if isinstance(exc, TimeoutError):
                    told = True
                    log.warning(
                        "%s answers no TCP connect within %g s (the network between the two "
                        "hosts cut, a firewall dropping it, or that host down); asking again "
                        "until the setup's deadline, %.0f s from now",
                        where,
                        CONNECT_ATTEMPT_S,
                        max(0.0, deadline - time.monotonic()),
                    )
                elif exc.errno in _ROUTE_ERRNOS:
                    told = True
                    log.warning(
                        "%s cannot be reached: %s (the network between the two hosts is "
                        "down or its route is missing)%s; asking again %s",
                        where,
                        _errno_words(exc),
                        advice,
                        f"for up to {FIRST_NO_ROUTE_S:g} s (a first setup)"
                        if first_setup
                        else "until the setup's deadline, "
                        f"{max(0.0, deadline - time.monotonic()):.0f} s from now",
                    )
                elif refused_since is not None and now - refused_since >= REFUSED_SAID_S:
                    told = True
                    log.warning(
                        "%s refuses or resets every TCP connect for %.0f s: %s (no process "
                        "listens there, or a firewall rejects it)%s; asking again until the "
                        "setup's deadline, %.0f s from now",
                        where,
                        now - refused_since,
                        _errno_words(exc),
                        advice,
                        max(0.0, deadline - time.monotonic()),
                    )
            # The peer may still be binding (direct construction) or the cut may heal.
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.5)
            continue
        try:
            peer_auth.dial(sock, auth, peer, where)
        except CommunicatorTimeout as exc:
            sock.close()
            # A port that takes the connection and never answers (a process there that
            # never accepts): said "in time", not which timeout.
            raise CommunicatorTimeout(
                f"{where} did not complete the handshake within {timeout:g} s"
            ) from exc
        except BaseException:
            sock.close()
            raise
        return sock


class _Acceptor:
    """Accepts on the listener until the left neighbour authenticates.

    Handshakes advance concurrently under one selector, so a silent or hostile
    connection costs nothing but a slot until its own short deadline.
    """

    def __init__(
        self, auth: peer_auth.PeerAuth, listener: socket.socket, timeout: float, origin: str = ""
    ) -> None:
        self._origin = origin
        self._auth = auth
        self._listener = listener
        self._timeout_s = timeout
        self._peer = (auth.rank - 1) % auth.world
        self._pending: dict[int, _Pending] = {}
        self._selector = selectors.DefaultSelector()
        self.last_rejection = ""

    def run(self, deadline: float, give_up: Callable[[], bool]) -> socket.socket | None:
        self._listener.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ)
        try:
            while True:
                now = time.monotonic()
                for entry in [e for e in self._pending.values() if e.deadline <= now]:
                    self._drop(entry)
                if give_up():
                    return None
                if now >= deadline:
                    raise self._timeout()
                wake = min([deadline, now + 0.1, *(e.deadline for e in self._pending.values())])
                for key, _ in self._selector.select(max(0.0, wake - now)):
                    if key.fileobj is self._listener:
                        self._accept_new(now)
                        continue
                    entry = self._pending[key.fd]
                    verdict = _serve_hello(entry)
                    if verdict == "":
                        self._selector.unregister(entry.sock)
                        del self._pending[key.fd]
                        entry.sock.setblocking(True)
                        return entry.sock
                    if verdict is not None:
                        self.last_rejection = f"from {entry.peer}: {verdict}"
                        self._drop(entry)
        finally:
            for entry in list(self._pending.values()):
                self._drop(entry)
            self._selector.close()

    def _timeout(self) -> CommunicatorTimeout:
        note = f" (last rejected connection: {self.last_rejection})" if self.last_rejection else ""
        mine = ""
        if self._origin:
            # The left neighbour may be alive and unable to reach this rank's address:
            # then it is this address that is wrong, which the neighbour says too.
            address = self._listener.getsockname()
            mine = (
                f"; if rank {self._peer} cannot reach this rank's address "
                f"{host_port(str(address[0]), int(address[1]))}, that address is "
                f"{self._origin}: {_fix(self._origin)}"
            )
        return CommunicatorTimeout(
            f"rank {self._auth.rank}: rank {self._peer} did not connect and authenticate "
            f"within {self._timeout_s:g} s{note}{mine}"
        )

    def _drop(self, entry: _Pending) -> None:
        self._selector.unregister(entry.sock)
        self._pending.pop(entry.sock.fileno(), None)
        entry.sock.close()

    def _accept_new(self, now: float) -> None:
        while True:
            try:
                conn, address = self._listener.accept()
            except OSError:
                return
            conn.setblocking(False)
            acceptance = peer_auth.Acceptance(self._auth, lambda r: r == self._peer)
            try:
                # A fresh socket's buffer takes the whole challenge at once.
                conn.send(acceptance.challenge)
            except OSError:
                conn.close()
                continue
            if len(self._pending) >= _MAX_PENDING:
                self._drop(min(self._pending.values(), key=lambda e: e.deadline))
            self._pending[conn.fileno()] = _Pending(
                conn, host_port(address[0], address[1]), acceptance, now + _HANDSHAKE_S, bytearray()
            )
            self._selector.register(conn, selectors.EVENT_READ)


def _serve_hello(entry: _Pending) -> str | None:
    """Advance one pending handshake: None = need more bytes, "" = accepted, else why not."""
    try:
        data = entry.sock.recv(peer_auth.HELLO_SIZE - len(entry.buffer))
    except (BlockingIOError, InterruptedError):
        return None
    except OSError as exc:
        return f"connection error {exc.strerror}"
    if not data:
        return "closed before completing the handshake"
    entry.buffer += data
    if len(entry.buffer) < peer_auth.HELLO_SIZE:
        return None
    try:
        _, welcome = entry.acceptance.verify(bytes(entry.buffer))
        entry.sock.send(welcome)
    except PeerConnectionError as exc:
        return str(exc)
    except OSError as exc:
        return f"connection error {exc.strerror}"
    return ""


def recv_exact(sock: socket.socket, view: memoryview, peer: int) -> None:
    """Fill ``view`` from ``sock``; EOF, reset or no progress within the timeout raise."""
    got = 0
    size = len(view)
    while got < size:
        try:
            n = sock.recv_into(view[got:], 0, socket.MSG_WAITALL)
        except (BlockingIOError, TimeoutError) as exc:
            raise _timed_out(peer, exc, "no data arrived within the timeout") from exc
        except OSError as exc:
            raise LinkError(peer, LOST, link_error(exc, peer)) from exc
        if n == 0:
            raise LinkError(peer, LOST, "connection closed (process exited?)")
        got += n


def peek_failure(sock: socket.socket) -> tuple[int, int, str, int] | None:
    """A FAIL frame the peer left in our receive queue before it reset the connection."""
    try:
        data = sock.recv(2 * FRAME.size + MAX_DETAIL_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except OSError:
        return None
    offset = 0
    while offset + FRAME.size <= len(data):
        kind, _, code, _, _, _, origin, reporter, length = FRAME.unpack_from(data, offset)
        offset += FRAME.size
        if kind == FAIL:
            detail = data[offset : offset + min(length, MAX_DETAIL_BYTES)]
            return origin, code, detail.decode("utf-8", "replace"), reporter
        if kind != ACK:
            return None
    return None


def read_failure(sock: socket.socket, header: tuple[int, ...], peer: int) -> LinkError:
    """The LinkError a FAIL frame (``header``, already read from ``peer``) describes;
    reads its detail."""
    detail = bytearray(min(header[8], MAX_DETAIL_BYTES))
    with contextlib.suppress(LinkError):
        recv_exact(sock, memoryview(detail), peer)
    return LinkError(header[6], header[2], detail.decode("utf-8", "replace"), via=header[7])


def fail_frame(origin: int, code: int, detail: str, reporter: int) -> bytes:
    """A FAIL notice: ``origin`` failed (``code``), as ``reporter`` found, carried in the
    frame index field so that ranks past the reporter's neighbours name it too, not
    the neighbour that passed the notice on."""
    payload = detail.encode("utf-8", "replace")[:MAX_DETAIL_BYTES]
    return FRAME.pack(FAIL, 0, code, 0, 0, 0, origin, reporter, len(payload)) + payload


def _send_all(sock: socket.socket, buffers: list[bytes | memoryview]) -> None:
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    while views:
        sent = sock.sendmsg(views, [], socket.MSG_NOSIGNAL)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]


class SenderThread:
    """Streams posted frames to the right neighbour ``peer`` over ``sock``, in posting
    order, on its own thread.

    After a failure it skips queued data and, if the stream is still frame-aligned,
    forwards one FAIL frame so ranks further down the ring learn who failed.
    """

    def __init__(
        self,
        sock: socket.socket,
        peer: int,
        rank: int,
        *,
        failed: Callable[[], bool],
        on_error: Callable[[LinkError], None],
    ) -> None:
        self._sock = sock
        self._peer = peer
        self._rank = rank
        self._failed = failed
        self._on_error = on_error
        self._queue: queue.SimpleQueue[tuple[bytes, memoryview] | str] = queue.SimpleQueue()
        self._fail_frame = b""
        self._thread = threading.Thread(
            target=self._run, name=f"cpu-ring-sender-r{rank}", daemon=True
        )
        self._thread.start()

    def post(self, header: bytes, view: memoryview) -> None:
        self._queue.put((header, view))

    def signal_failure(self, frame: bytes) -> None:
        self._fail_frame = frame
        self._queue.put("fail")

    def stop(self, timeout: float) -> bool:
        """Ask the thread to exit after the queued items; True once it has."""
        self._queue.put("stop")
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        aligned = True  # False once a frame was cut short: a FAIL frame would be misread
        while True:
            item = self._queue.get()
            if item == "stop":
                return
            if item == "fail":
                with contextlib.suppress(OSError):
                    if aligned:
                        _send_all(self._sock, [self._fail_frame])
                    self._sock.shutdown(socket.SHUT_WR)
                continue
            if self._failed() or isinstance(item, str):
                continue
            try:
                self._send(*item)
            except LinkError as exc:
                aligned = False
                self._on_error(exc)
            except Exception as exc:  # a bug here must not leave the ring waiting
                aligned = False
                log.exception(
                    "rank %d: the CPU ring's sender to rank %d failed", self._rank, self._peer
                )
                said = f"{type(exc).__name__}: {exc}"[:200]
                detail = f"sender to rank {self._peer} crashed: {said} (a bug: report it)"
                self._on_error(LinkError(self._rank, INTERRUPTED, detail))

    def _send(self, header: bytes, payload: memoryview) -> None:
        """Send one frame; raises LinkError naming the peer on failure."""
        try:
            _send_all(self._sock, [header, payload])
        except (BlockingIOError, TimeoutError) as exc:
            raise _timed_out(self._peer, exc, "send stalled past the timeout") from exc
        except OSError as exc:
            found = peek_failure(self._sock)
            if found is not None:
                origin, code, detail, reporter = found
                raise LinkError(origin, code, detail, via=reporter) from exc
            raise LinkError(self._peer, LOST, link_error(exc, self._peer)) from exc


def describe_mismatch(
    got: tuple[int, ...], want: tuple[int, ...], sender: int, receiver: int
) -> str:
    """Both sides, named: the text travels around the ring to every rank, where a bare
    "received X, expected Y" read as the reader's own (a review)."""

    def show(f: tuple[int, ...]) -> str:
        said = describe_collective(f[1], f[2], f[3], f[4], f[5])
        if f[1] == BROADCAST and f[2]:
            return said  # its agreement: no root yet, and its frames are not the caller's
        if f[1] == BROADCAST:
            said += f" from root {f[6]}"
        return f"{said}, frame {f[7]} of {f[8]} bytes"

    return f"rank {sender} sent {show(got)}; rank {receiver} is in {show(want)}"
