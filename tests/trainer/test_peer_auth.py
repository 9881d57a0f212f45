"""The one peer handshake both cpu transports use (trainer/comm/peer_auth.py), over real
socket pairs: mutual proof of the key, ranks bound, fresh nonces, key never shown.

Each transport's own wrong-key test lives beside it (test_cpu_ring, test_shm_group)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import pytest

from rendezvousd.trainer.comm import peer_auth
from rendezvousd.trainer.comm.peer_auth import Acceptance, PeerAuth
from rendezvousd.trainer.errors import PeerConnectionError
from tests.support import parallel

KEY = peer_auth.derive_key(b"s" * 32)
OTHER_KEY = peer_auth.derive_key(b"t" * 32)
MAGIC = b"TESTAUTH"


def handshake(
    dialer: PeerAuth, acceptor: PeerAuth, target: int, admissible: Callable[[int], bool]
) -> list[Any]:
    a, b = socket.socketpair()
    for s in (a, b):
        s.settimeout(5.0)

    # Each side closes when done, as the transports do, so a refusal is seen at once.
    def accept() -> int:
        with b:
            return peer_auth.accept(b, acceptor, admissible, "ring port")

    def dial() -> None:
        with a:
            peer_auth.dial(a, dialer, target, "rank 1: peer rank 0")

    return parallel([dial, accept])


def test_matching_keys_authenticate_both_ways() -> None:
    result = handshake(PeerAuth(KEY, MAGIC, 1, 2), PeerAuth(KEY, MAGIC, 0, 2), 0, {1}.__contains__)
    assert result == [None, 1]


@pytest.mark.parametrize(
    ("dialer", "target", "why"),
    [
        (PeerAuth(OTHER_KEY, MAGIC, 1, 2), 0, "failed authentication"),
        (PeerAuth(KEY, MAGIC, 1, 3), 0, "claimed rank 1 of world 3"),
        (PeerAuth(KEY, MAGIC, 1, 2), 5, "connecting to rank 5"),
        (PeerAuth(KEY, MAGIC, 3, 2), 0, "claimed rank 3"),
    ],
)
def test_acceptor_refuses_and_the_dialer_learns_it(dialer: PeerAuth, target: int, why: str) -> None:
    dial, accept = handshake(dialer, PeerAuth(KEY, MAGIC, 0, 2), target, {1}.__contains__)
    assert isinstance(accept, PeerConnectionError) and why in str(accept), accept
    assert isinstance(dial, PeerConnectionError), dial
    for error in (dial, accept):
        text = str(error)
        assert KEY.hex() not in text and OTHER_KEY.hex() not in text and "\\x" not in text


def test_the_other_transports_endpoint_is_refused() -> None:
    dial, accept = handshake(
        PeerAuth(KEY, b"OTHERTRN", 1, 2), PeerAuth(KEY, MAGIC, 0, 2), 0, {1}.__contains__
    )
    assert isinstance(dial, PeerConnectionError), dial
    assert "not an endpoint of this transport" in str(dial)
    assert isinstance(accept, PeerConnectionError), accept


def test_a_peer_of_another_version_of_the_transport_is_told_so_both_ways() -> None:
    dial, _ = handshake(
        PeerAuth(KEY, b"TESTAUT2", 1, 2), PeerAuth(KEY, b"TESTAUT3", 0, 2), 0, {1}.__contains__
    )
    assert isinstance(dial, PeerConnectionError), dial
    assert str(dial).startswith(
        "rank 1: peer rank 0 runs another version of rendezvousd (wire version 3 of TESTAUT, "
        "this rank's is 2): every node of a job must run the same rendezvousd version"
    ), dial
    # The acceptor reads the dialer's magic only in its HELLO, which a dialer that
    # refused the challenge never sends; one that sends it is told the same way.
    acceptance = Acceptance(PeerAuth(KEY, b"TESTAUT3", 0, 2), {1}.__contains__)
    hello = peer_auth._HELLO.pack(b"TESTAUT2", bytes(32), 1, 2, 0, bytes(32))
    with pytest.raises(PeerConnectionError, match=r"^the dialer runs another version"):
        acceptance.verify(hello)


def test_dialer_refuses_an_acceptor_without_the_key() -> None:
    # The acceptor cannot verify the dialer's MAC without the key, so it is tricked here
    # into answering with its own: the dialer must still refuse the WELCOME.
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(5.0)
        b.settimeout(5.0)
        impostor = Acceptance(PeerAuth(OTHER_KEY, MAGIC, 0, 2), lambda _: True)
        b.sendall(impostor.challenge)

        def answer() -> None:
            hello = peer_auth.recv_fixed(b, peer_auth.HELLO_SIZE)
            assert hello is not None
            with pytest.raises(PeerConnectionError):
                impostor.verify(hello)
            forged = bytes(4) + (2).to_bytes(4, "little") + bytes(32)
            b.sendall(forged)

        dial, _ = parallel([lambda: peer_auth.dial(a, PeerAuth(KEY, MAGIC, 1, 2), 0, "x"), answer])
    assert isinstance(dial, PeerConnectionError) and "failed authentication" in str(dial), dial


def test_a_recorded_hello_does_not_replay() -> None:
    # Fresh acceptor nonces: a HELLO that passed once is refused by the next acceptance.
    auth = PeerAuth(KEY, MAGIC, 0, 2)
    dialer = PeerAuth(KEY, MAGIC, 1, 2)
    first = Acceptance(auth, {1}.__contains__)
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(5.0)
        b.settimeout(5.0)
        b.sendall(first.challenge)

        def relay() -> bytes:
            hello = peer_auth.recv_fixed(b, peer_auth.HELLO_SIZE)
            assert hello is not None
            _, welcome = first.verify(hello)
            b.sendall(welcome)
            return hello

        dial, recorded = parallel([lambda: peer_auth.dial(a, dialer, 0, "x"), relay])
    assert dial is None
    with pytest.raises(PeerConnectionError, match="failed authentication"):
        Acceptance(auth, {1}.__contains__).verify(recorded)
