"""The workers' TCPStore port (``store_port``): outside the kernel's ephemeral range,
where torch's ``get_free_port()`` choice could be given to an outgoing connection (or a
peer's self-connect) before worker rank 0 listens on it. No torch needed."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from rendezvousd.trainer.torchrun import store_port as sp


def test_the_port_is_outside_the_kernels_ephemeral_range_and_free() -> None:
    low, high = sp.ephemeral_range()
    for _ in range(20):
        port = sp.store_port()
        assert not low <= port <= high, (port, low, high)
        assert port >= sp.LOWEST
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("", port))


def test_a_range_reaching_the_top_leaves_the_ports_below_it() -> None:
    port = sp.store_port((40000, 65535))
    assert sp.LOWEST <= port < 40000


def test_the_range_is_read_from_the_kernel_and_defaults_where_unreadable(
    tmp_path: Path,
) -> None:
    f = tmp_path / "range"
    f.write_text("20000\t50000\n")
    assert sp.ephemeral_range(f) == (20000, 50000)
    assert sp.ephemeral_range(tmp_path / "absent") == sp.DEFAULT_EPHEMERAL
    f.write_text("garbage\n")
    assert sp.ephemeral_range(f) == sp.DEFAULT_EPHEMERAL


def test_a_port_held_by_a_listener_is_not_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        busy = held.getsockname()[1]
        with socket.socket() as free:
            free.bind(("", 0))
            other = free.getsockname()[1]
        # The busy port is tried first, then one that is free.
        monkeypatch.setattr(sp, "candidates", lambda _range: [busy, other])
        monkeypatch.setattr(sp.random, "sample", lambda ports, k: list(ports)[:k])
        assert sp.store_port((1, 2)) == other


def test_no_port_outside_the_range_falls_back_to_an_ephemeral_one() -> None:
    port = sp.store_port((1024, 65535))
    assert 1024 <= port <= 65535
