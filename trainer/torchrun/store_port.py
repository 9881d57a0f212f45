"""The port node 0's worker rank 0 listens on for the workers' TCPStore.

torch's ``RendezvousStoreInfo.build`` picks it with ``get_free_port()``: a port of the
kernel's ephemeral range that was free when asked and is listened on only once worker
rank 0 has started, seconds later. Meanwhile the kernel may give that port to any
outgoing connection on the host as its local port, among them the other workers'
connects to that very port, retried until the store listens, which Linux can complete
as a TCP self-connect (source and destination the same address and port). Worker rank
0 then fails "failed to listen on any local network address ... EADDRINUSE", and the
round is lost (seen on namespace hosts in CI). A port outside the ephemeral range is
never handed to an outgoing connection, so only another listener could take it.
Hand-written: neither torch nor the standard library chooses a port this way.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

#: Linux's ephemeral range (per network namespace); its default where it cannot be read.
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL = (32768, 60999)
#: Below this, ports are the well-known and commonly configured services' (and ours: 29420).
LOWEST = 30000
TRIES = 64


def ephemeral_range(path: Path = EPHEMERAL_RANGE) -> tuple[int, int]:
    """The kernel's ephemeral ports, inclusive (the default where unreadable)."""
    try:
        low, high = (int(field) for field in path.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL
    return low, high


def candidates(ephemeral: tuple[int, int]) -> list[int]:
    """Ports above ``LOWEST`` and outside ``ephemeral``; if the range leaves none there,
    any non-privileged port outside it."""
    low, high = ephemeral
    outside = [p for p in range(LOWEST, 65536) if not low <= p <= high]
    return outside or [p for p in range(1024, 65536) if not low <= p <= high]


def store_port(ephemeral: tuple[int, int] | None = None) -> int:
    """A port free on every address of this host now, outside the ephemeral range.

    Bound with ``SO_REUSEADDR``, as the TCPStore server binds it, so that a port whose
    earlier connections linger in TIME_WAIT counts as free, as it is to the store. If
    none of ``TRIES`` is free, an ephemeral one (torch's choice, and its race).
    """
    ports = candidates(ephemeral or ephemeral_range())
    for port in [*random.sample(ports, min(TRIES, len(ports))), 0]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("", port))
            except OSError:
                continue
            return int(probe.getsockname()[1])
    raise OSError("no port could be bound for the workers' TCPStore, not even an ephemeral one")
