"""A daemon behind a loopback TCP proxy that stops forwarding: every call still
ends by its deadline with a clear error, never a hang."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from rendezvousd.client import (
    DaemonUnavailable,
    DaemonUnreachable,
    RendezvousClient,
    RendezvousTimeout,
)
from tests.support import DaemonProcess


class BlackHoleProxy:
    """Forwards 127.0.0.1:port <-> the daemon until ``cut()``; then swallows bytes."""

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.forwarding = True
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                return
            if not data:
                return
            if self.forwarding:  # after cut(): read and drop, like a dead route
                try:
                    dst.sendall(data)
                except OSError:
                    return

    def cut(self) -> None:
        self.forwarding = False

    def close(self) -> None:
        self.listener.close()
        for s in self.sockets:
            s.close()


@pytest.mark.parametrize("call", ["kv_set", "kv_get", "barrier"])
def test_calls_end_by_their_deadline_when_the_network_black_holes(
    daemon: DaemonProcess, job_id: str, call: str
) -> None:
    proxy = BlackHoleProxy(daemon.port)
    endpoint = f"127.0.0.1:{proxy.port}"
    client = RendezvousClient(
        endpoint, job_id, token=daemon.token, call_timeout=1.5, retry_attempts=1
    )
    try:
        client.join(num_nodes=1, gpus_per_node=1, node_rank=0, local_rank=0, timeout=10)
        proxy.cut()
        started = time.monotonic()
        # One deadline covers a call and its retries (as gRPC's own retries share one):
        # a read whose deadline passed is not sent again, and is reported as
        # DaemonUnavailable naming its one attempt.
        with pytest.raises((RendezvousTimeout, DaemonUnavailable)) as info:
            if call == "kv_set":
                client.kv_set("k", b"v")
            elif call == "kv_get":
                client.kv_get("k", wait=True, timeout=1.5)
            else:
                client.barrier("b", timeout=1.5)
        elapsed = time.monotonic() - started
        assert elapsed < 2 * (1.5 + 5.0) + 2
        # The job id is this test's name, which says "deadline" itself.
        message = str(info.value).replace(job_id, "JOB").lower()
        assert endpoint in message
        if isinstance(info.value, DaemonUnreachable):
            # A keepalive ping went unanswered meanwhile (5 s), which ends the connection,
            # and no daemon answered again within the reconnect window: said as such.
            assert "went away during" in message and "not back within" in message, message
        else:
            assert "deadline" in message, message
            if call == "kv_get":
                assert isinstance(info.value, DaemonUnavailable) and info.value.attempts == 1
    finally:
        client.close()
        proxy.close()
