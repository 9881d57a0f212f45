"""systemd's notify protocol (READY=1, STOPPING=1, WATCHDOG=1) over $NOTIFY_SOCKET.

The protocol is one datagram per message; a dependency (python-systemd, which
needs libsystemd headers to build) would be heavier than these few lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass
class Notifier:
    socket_path: str | None
    watchdog_interval: float | None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Notifier:
        environ = os.environ if env is None else env
        path = environ.get("NOTIFY_SOCKET") or None
        interval = None
        usec = environ.get("WATCHDOG_USEC", "")
        pid = environ.get("WATCHDOG_PID", "")
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            # Ping at half the period, as sd_watchdog_enabled(3) advises.
            interval = int(usec) / 1_000_000 / 2
        return cls(path, interval)

    def send(self, message: str) -> None:
        if not self.socket_path:
            return
        address = self.socket_path
        if address.startswith("@"):
            address = "\0" + address[1:]  # abstract namespace
        kind = socket.SOCK_DGRAM | socket.SOCK_CLOEXEC
        with socket.socket(socket.AF_UNIX, kind) as sock, contextlib.suppress(OSError):
            sock.sendto(message.encode(), address)

    def ready(self, status: str) -> None:
        self.send(f"READY=1\nSTATUS={status}\nMAINPID={os.getpid()}")

    def stopping(self) -> None:
        self.send("STOPPING=1\nSTATUS=draining")

    async def watchdog_loop(self) -> None:
        # Pinged from the event loop itself: a wedged loop stops the pings and
        # systemd restarts us, which is the point of the watchdog.
        assert self.watchdog_interval is not None
        while True:
            self.send("WATCHDOG=1")
            await asyncio.sleep(self.watchdog_interval)
