"""This host's address on a client's way to its daemon, and whether the host still has
it: a host re-addressed under a running client (a DHCP renewal, a migrated VM) keeps
the channel's connection bound to the address removed. Nothing ends that connection
at once (the kernel keeps the socket; gRPC's keepalive notices within 15 s), its
channel still reads READY, and each call on it waited its deadline: a job that ended
normally failed its final Leave, said as "it accepts connections, but no gRPC server
answered ... a daemon that is stuck", since a plain connect from the new address
worked (h179)."""

from __future__ import annotations

import errno
import socket
import time

from rendezvousd.common.address import AddressError, parse_address


def route_from(endpoint: str) -> str | None:
    """The local address this host's routing table sends to ``endpoint`` from (a UDP
    ``connect``: no packet leaves); None for a Unix socket, a name that does not
    resolve, or no route. The first of the name's addresses, as gRPC dials it first:
    a connection made to another of them is from an address this host has, too, which
    ``gone`` then never reports."""
    try:
        address = parse_address(endpoint, what="endpoint", allow_unix=True)
    except AddressError:
        return None
    if address.unix_path is not None or address.host is None:
        return None
    try:
        infos = socket.getaddrinfo(address.host, address.port, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, kind, proto, _, target in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.connect(target)
                return str(probe.getsockname()[0])
        except OSError:
            continue
    return None


def held(address: str) -> bool:
    """Whether this host still has ``address`` (a bind to it works): one socket, no
    packet. A host that binds any address (``ip_nonlocal_bind``) always has it."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((address, 0))
    except OSError as exc:
        return exc.errno != errno.EADDRNOTAVAIL
    return True


#: How often a client's calls look (``LocalAddress.gone``): a bind costs 10-40 us, a
#: share of a fast call's own; a host re-addressed is rare and stays so.
LOOK_EVERY_S = 1.0


class LocalAddress:
    """The address a client's channel reached its daemon from, noted as it joined."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.address: str | None = None
        #: The address this host lost, once a call found it gone (for the words of a
        #: Leave that still failed on the channel made anew).
        self.lost: str | None = None
        self._looked = 0.0

    def note(self) -> None:
        """Blocking (a name resolved): run off an event loop."""
        self.address = route_from(self.endpoint)
        self._looked = time.monotonic()

    def gone(self, *, now: bool = False) -> str | None:
        """The noted address, where this host no longer has it; else None. Looked at
        once per ``LOOK_EVERY_S`` at most, unless ``now`` (a Leave: said once)."""
        if self.address is None:
            return None
        if not now and time.monotonic() - self._looked < LOOK_EVERY_S:
            return None
        self._looked = time.monotonic()
        if held(self.address):
            return None
        self.lost = self.address
        return self.address
