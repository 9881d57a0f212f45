"""How the CPU ring's wire layer words what went wrong on a link: a rejected dialer by
its address, a sender thread's own bug with its message and a log line."""

from __future__ import annotations

import logging
import re
import socket
import threading
import time

import pytest

from rendezvousd.trainer.comm import peer_auth, ring_wire
from rendezvousd.trainer.errors import CommunicatorTimeout, PeerConnectionError

SECRET = bytes(range(128))


def test_a_rejected_dialer_is_named_by_its_address_in_the_acceptors_timeout() -> None:
    """A process of another job dialling this rank's ring port: its rejection was
    "failed authentication (different job secret?)", naming no host."""
    listener = ring_wire.create_listener("127.0.0.1")
    acceptor = ring_wire._Acceptor(
        peer_auth.PeerAuth(peer_auth.derive_key(SECRET), ring_wire._MAGIC, 0, 2),
        listener,
        1.0,
    )
    stranger = peer_auth.PeerAuth(
        peer_auth.derive_key(bytes(reversed(SECRET))), ring_wire._MAGIC, 1, 2
    )
    dialled: list[int] = []

    def dial() -> None:
        with socket.create_connection(listener.getsockname()[:2], timeout=5) as sock:
            dialled.append(sock.getsockname()[1])
            with pytest.raises(PeerConnectionError):
                peer_auth.dial(sock, stranger, 0, "rank 1: rank 0")

    thread = threading.Thread(target=dial, daemon=True)
    thread.start()
    try:
        with pytest.raises(CommunicatorTimeout) as caught:
            acceptor.run(time.monotonic() + 1.0, lambda: False)
    finally:
        thread.join(5)
        listener.close()
    text = str(caught.value)
    assert text.startswith("rank 0: rank 1 did not connect and authenticate within 1 s"), text
    assert (
        f"(last rejected connection: from 127.0.0.1:{dialled[0]}: failed authentication (a "
        "process of another job, or of an earlier generation, dialled this rank's ring port))"
    ) in text
    assert SECRET.hex() not in text


def test_a_sender_threads_own_bug_is_logged_and_told_with_its_message(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """It said only "sender crashed: TypeError", and logged nothing."""
    ours, theirs = socket.socketpair()
    errors: list[ring_wire.LinkError] = []
    heard = threading.Event()

    def on_error(exc: ring_wire.LinkError) -> None:
        errors.append(exc)
        heard.set()

    caplog.set_level(logging.ERROR, logger="rendezvousd.trainer")
    sender = ring_wire.SenderThread(ours, 4, 3, failed=lambda: False, on_error=on_error)
    try:
        sender.post("not bytes", memoryview(b"x"))  # type: ignore[arg-type]
        assert heard.wait(5)
    finally:
        assert sender.stop(5)
        ours.close()
        theirs.close()
    (error,) = errors
    assert error.origin == 3 and error.code == ring_wire.INTERRUPTED
    assert re.fullmatch(
        r"sender to rank 4 crashed: TypeError: .+ \(a bug: report it\)", error.detail
    ), error.detail
    logged = [r for r in caplog.records if r.exc_info]
    assert logged and logged[0].getMessage() == "rank 3: the CPU ring's sender to rank 4 failed"
