"""Mutual authentication of two ranks over a fresh stream socket, for both cpu transports.

The TCP ring and the shared-memory group both open connections that anyone able to
reach the address could also open, so a connection carries data only after both ends
proved knowledge of the key derived from the job secret:

1. the acceptor sends a challenge: the transport's magic and a fresh 32-byte nonce;
2. the dialer answers HELLO: its own fresh nonce, its rank, the world size, the rank it
   meant to reach, and HMAC-SHA256 over all of it plus both nonces;
3. the acceptor checks that MAC (constant-time), that the claimed ranks are the ones it
   waits for, and answers WELCOME: its rank and a MAC binding both nonces, both ranks
   and the world size under another label; the dialer checks it the same way.

Fresh nonces both ways mean a recorded exchange replays to neither side. The magic is
inside every MAC, so a handshake meant for one transport is refused by the other. Its
trailing digits are the transport's wire version, raised whenever what the ranks send
each other, or how they read it, changes: a rank of another rendezvousd version is
refused as such (``other_version``), where it used to pass the handshake and then fail
on a frame it did not expect, or agree on a wrong result (mixed-version nodes of one job
averaged integers two ways).
A rejected dialer only sees the connection closed; neither side ever learns, logs or
shows the key, and error messages never include it.

The acceptor side is written without I/O (``Acceptance``) so the ring can drive many
pending handshakes from one selector; ``accept`` and ``dial`` are the blocking forms.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass

from rendezvousd.trainer.errors import (
    CommunicatorTimeout,
    ConfigError,
    PeerConnectionError,
    PeerVersionMismatch,
)

__all__ = ["Acceptance", "PeerAuth", "accept", "derive_key", "dial", "recv_fixed"]

_NONCE_BYTES = 32
_CHALLENGE = struct.Struct("<8s32s")  # magic, acceptor nonce
_HELLO = struct.Struct("<8s32sIII32s")  # magic, dialer nonce, rank, world, target, mac
_WELCOME = struct.Struct("<II32s")  # rank, world, mac
_KEY_LABEL = b"rendezvousd cpu-ring v1"

HELLO_SIZE = _HELLO.size


_VERSIONED = re.compile(rb"(\D*)(\d+)")


def other_version(theirs: bytes, ours: bytes) -> str | None:
    """Why a peer whose magic is ``theirs`` is of another version of this transport
    (the same name, other trailing digits), if it is; None for another transport."""
    t, o = _VERSIONED.fullmatch(theirs), _VERSIONED.fullmatch(ours)
    if t is None or o is None or t[1] != o[1] or t[2] == o[2]:
        return None
    return (
        f"runs another version of rendezvousd (wire version {int(t[2])} of "
        f"{o[1].decode()}, this rank's is {int(o[2])}): every node of a job must run the "
        "same rendezvousd version; upgrade them all"
    )


def derive_key(secret: bytes) -> bytes:
    # Domain separation: the same job id also serves as the NCCL unique id.
    return hmac.new(secret, _KEY_LABEL, hashlib.sha256).digest()


@dataclass(frozen=True)
class PeerAuth:
    """One rank's credentials: ``key`` from ``derive_key``, and the 8-byte ``magic``
    that names the transport (bound into every MAC)."""

    key: bytes
    magic: bytes
    rank: int
    world: int

    def __post_init__(self) -> None:
        if len(self.magic) != 8:
            raise ConfigError(f"a transport magic is 8 bytes, got {len(self.magic)}")

    def mac(
        self, label: bytes, acceptor_nonce: bytes, dialer_nonce: bytes, ids: tuple[int, ...]
    ) -> bytes:
        message = b"|".join([self.magic, label, acceptor_nonce, dialer_nonce])
        return hmac.new(self.key, message + struct.pack("<III", *ids), "sha256").digest()


class Acceptance:
    """The acceptor's side of one handshake, without I/O.

    Send ``challenge``, collect ``HELLO_SIZE`` bytes, then ``verify`` them: it returns
    the dialer's rank and the WELCOME to send, or raises ``PeerConnectionError`` saying
    why the connection must be dropped. ``admissible`` says which dialer ranks this
    acceptor is waiting for.
    """

    def __init__(
        self, auth: PeerAuth, admissible: Callable[[int], bool], door: str = "ring port"
    ) -> None:
        self._auth = auth
        self._admissible = admissible
        # What the dialer reached, as a failed authentication names it.
        self._door = door
        self._nonce = secrets.token_bytes(_NONCE_BYTES)
        self.challenge = _CHALLENGE.pack(auth.magic, self._nonce)

    def verify(self, hello: bytes) -> tuple[int, bytes]:
        auth = self._auth
        magic, nonce, rank, world, target, their_mac = _HELLO.unpack(hello)
        if magic != auth.magic:
            other = other_version(magic, auth.magic)
            raise PeerConnectionError(
                "not a handshake of this transport" if other is None else f"the dialer {other}"
            )
        expected = auth.mac(b"hello", self._nonce, nonce, (rank, world, target))
        if not hmac.compare_digest(their_mac, expected):
            raise PeerConnectionError(
                "failed authentication (a process of another job, or of an earlier "
                f"generation, dialled this rank's {self._door})"
            )
        if world != auth.world or target != auth.rank or not self._admissible(rank):
            raise PeerConnectionError(
                f"authenticated peer claimed rank {rank} of world {world} "
                f"connecting to rank {target}"
            )
        mac = auth.mac(b"welcome", self._nonce, nonce, (auth.rank, auth.world, rank))
        return rank, _WELCOME.pack(auth.rank, auth.world, mac)


def accept(
    sock: socket.socket, auth: PeerAuth, admissible: Callable[[int], bool], door: str
) -> int:
    """Blocking acceptor side on ``sock`` (its timeout applies); the dialer's rank.

    Raises ``PeerConnectionError`` (or ``OSError``) when the connection must be dropped.
    """
    acceptance = Acceptance(auth, admissible, door)
    sock.sendall(acceptance.challenge)
    hello = recv_fixed(sock, HELLO_SIZE)
    if hello is None:
        raise PeerConnectionError("closed before completing the handshake")
    rank, welcome = acceptance.verify(hello)
    sock.sendall(welcome)
    return rank


def dial(sock: socket.socket, auth: PeerAuth, peer: int, where: str) -> None:
    """Dialer side on a connected ``sock`` (its timeout applies), meant to reach ``peer``.

    ``where`` starts every error message (e.g. "rank 2: rank 3 at host:port").
    """
    rejected = PeerConnectionError(
        f"{where} rejected the handshake (different job secret, rank or world size?)"
    )
    try:
        challenge = recv_fixed(sock, _CHALLENGE.size)
        if challenge is None:
            raise rejected
        magic, acceptor_nonce = _CHALLENGE.unpack(challenge)
        if magic != auth.magic:
            other = other_version(magic, auth.magic)
            if other is not None:
                # Typed: the setup neither retries it nor waits to hear of another
                # failure before reporting it. (Only the dialer's: the acceptor reads an
                # unauthenticated magic, which a stranger could send to fail a setup.)
                raise PeerVersionMismatch(f"{where} {other}")
            raise PeerConnectionError(f"{where} is not an endpoint of this transport")
        nonce = secrets.token_bytes(_NONCE_BYTES)
        ids = (auth.rank, auth.world, peer)
        mac = auth.mac(b"hello", acceptor_nonce, nonce, ids)
        sock.sendall(_HELLO.pack(auth.magic, nonce, *ids, mac))
        welcome = recv_fixed(sock, _WELCOME.size)
    except TimeoutError as exc:
        raise CommunicatorTimeout(f"{where} did not complete the handshake in time") from exc
    except OSError as exc:
        raise rejected from exc
    if welcome is None:
        raise rejected
    their_rank, their_world, their_mac = _WELCOME.unpack(welcome)
    expected = auth.mac(b"welcome", acceptor_nonce, nonce, (peer, auth.world, auth.rank))
    if their_rank != peer or their_world != auth.world:
        raise PeerConnectionError(
            f"{where} answered as rank {their_rank} of world {their_world}, "
            f"not rank {peer} of world {auth.world}"
        )
    if not hmac.compare_digest(their_mac, expected):
        raise PeerConnectionError(f"{where} failed authentication (different job secret?)")


def recv_fixed(sock: socket.socket, size: int) -> bytes | None:
    """Exactly ``size`` bytes, or None if the peer closed first."""
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            return None
        got += n
    return bytes(buffer)
