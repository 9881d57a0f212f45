"""``ring_wire.listening``, the one bind-and-listen of the ring's TCP listener and the
shared-memory group's UNIX one: a refused address leaks no descriptor."""

from __future__ import annotations

import socket

import pytest

from rendezvousd.trainer.comm import ring_wire, shm_group


def test_a_listener_takes_connections_and_a_taken_address_closes_the_socket() -> None:
    first = ring_wire.create_listener("127.0.0.1")
    try:
        with socket.create_connection(first.getsockname(), timeout=5):
            pass
        second = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        with pytest.raises(OSError):
            ring_wire.listening(second, first.getsockname())
        assert second.fileno() == -1
    finally:
        first.close()


def test_the_shared_memory_groups_listener_is_a_listening_unix_socket() -> None:
    sock, name = shm_group.create_listener()
    try:
        assert sock.family == socket.AF_UNIX and len(name) == 32
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
    finally:
        sock.close()
