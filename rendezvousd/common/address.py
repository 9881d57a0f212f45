"""The one ``host:port`` parser: daemon listen addresses, trainer endpoints, ring peers.

Accepted: ``host:port``, ``[v6addr]:port`` and, where the caller allows it,
``unix:PATH``. An unbracketed IPv6 address (``::1:5``) is refused because the
port cannot be told apart from the last group. Errors are ``AddressError``, a
``ValueError``: each caller maps it to its own package's error.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

UNIX_PREFIX = "unix:"


class AddressError(ValueError):
    """A malformed address; the message quotes it and shows the expected form."""


class UnresolvedHost(AddressError):
    """A well-formed address whose host name did not resolve, or to which this host had
    no route (``route_source``): a daemon that cannot be reached, not a mistake in the
    address."""


@dataclass(frozen=True, slots=True)
class Address:
    """``host``/``port`` for TCP (``host`` without IPv6 brackets); ``unix_path`` otherwise."""

    host: str | None
    port: int
    unix_path: str | None = None


def parse_address(
    text: str,
    *,
    what: str = "address",
    allow_port_zero: bool = False,
    allow_unix: bool = False,
) -> Address:
    """Parse ``text``; ``what`` names it in errors (e.g. ``"endpoint"``)."""
    if not isinstance(text, str):
        raise AddressError(f"{what}={text!r} must be a string 'host:port'")
    forms = "'host:port' or '[v6addr]:port'" + (" or 'unix:PATH'" if allow_unix else "")
    if allow_unix and text.startswith(UNIX_PREFIX):
        path = text[len(UNIX_PREFIX) :]
        if not path:
            raise AddressError(f"{what}={text!r} names no socket path: expected 'unix:PATH'")
        return Address(None, 0, path)
    if "://" in text or any(c.isspace() for c in text):
        raise AddressError(
            f"{what}={text!r} is malformed: expected {forms} with no scheme or spaces"
        )
    if "," in text:
        # Read as an IPv6 host ("wrap IPv6 hosts as '[addr]:port'"): a list, as
        # c10d's or etcd's endpoints take, is what was meant (an SDK misuse review).
        raise AddressError(
            f"{what}={text!r} names several addresses: give the one daemon's {forms}"
        )
    host, sep, port_text = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise AddressError(
                f"{what}={text!r} has {host!r} in brackets: not an IPv6 address"
            ) from None
    elif ":" in host:
        raise AddressError(f"{what}={text!r} is malformed: wrap IPv6 hosts as '[addr]:port'")
    if not sep or not host:
        raise AddressError(
            f"{what}={text!r} is malformed: expected {forms}, e.g. '127.0.0.1:29420'"
        )
    if (dotted := _ipv4_shorthand(host)) is not None:
        raise AddressError(
            f"{what}={text!r} has host {host!r}, a shorthand IPv4 form that gRPC's resolver "
            f"does not read (only the C library does): write it as {dotted}"
        )
    low = 0 if allow_port_zero else 1
    # isascii: str.isdigit and int() take other scripts' digits ("٣٤٢٦٩"), which the
    # client then dialled as another port.
    if not (port_text.isascii() and port_text.isdigit()) or not low <= int(port_text) <= 65535:
        raise AddressError(f"{what}={text!r} has port {port_text!r}: expected {low}..65535")
    return Address(host, int(port_text))


def _ipv4_shorthand(host: str) -> str | None:
    """The dotted quad of a host the C library reads as IPv4 but gRPC's resolver does not
    (``127.1``, ``0x7f000001``, ``2130706433``, ``0177.0.0.1``), else None. The SDK's own
    plain-socket probe reached the daemon at such a name where gRPC could not, and then
    blamed a stuck daemon (an operator review)."""
    if not host or host.strip("0123456789.xXabcdefABCDEF") or not host[0].isdigit():
        return None
    try:
        ipaddress.IPv4Address(host)
        return None  # already the dotted quad
    except ValueError:
        pass
    try:
        return socket.inet_ntoa(socket.inet_aton(host))
    except OSError:
        return None


def host_port(host: str, port: int) -> str:
    """``host:port`` as ``parse_address`` reads it back (an IPv6 host in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_host_port(
    text: str, *, what: str = "address", allow_port_zero: bool = False
) -> tuple[str, int]:
    """``(host, port)`` of a TCP address; the form trainer endpoints and ring peers use."""
    address = parse_address(text, what=what, allow_port_zero=allow_port_zero)
    assert address.host is not None  # unix: is not allowed here
    return address.host, address.port


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


#: How often a name that does not resolve yet is asked again (``route_source``).
RESOLVE_RETRY_S = 1.0
#: The routing errors of a network still coming up, waited for (``route_source``).
_NO_ROUTE_YET = frozenset({errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL})


def route_source(
    endpoint: str, wait_s: float = 0.0, on_wait: Callable[[str], None] | None = None
) -> str:
    """The local address this machine reaches ``endpoint`` from (``daemon_route``'s)."""
    return daemon_route(endpoint, wait_s, on_wait).local


@dataclass(frozen=True, slots=True)
class Route:
    """How this host reaches a daemon: ``local``, its own address on the way (what a
    worker advertises), ``remote``, the daemon's address it reached (one of those its
    name resolves to), and ``connected``, whether a connection to it was accepted
    (else ``local`` is only the routing table's answer: nothing listened yet)."""

    host: str
    local: str
    remote: str
    connected: bool

    def resolved(self) -> str:
        """``'head' resolves to 127.0.1.1 on this host (/etc/hosts)``, for a name; "" for an
        address literal, whose resolution says nothing."""
        if self.host == self.remote or is_address_literal(self.host):
            return ""
        where = " (/etc/hosts)" if is_loopback(self.remote) else ""
        return f"{self.host!r} resolves to {self.remote} on this host{where}"


def is_address_literal(host: str) -> bool:
    """Whether ``host`` is an IP address written out (no brackets), not a name."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


#: How long one of the daemon's addresses is given to accept a plain connection
#: (``daemon_route``): a LAN connects in milliseconds, a dead address costs this much.
CONNECT_EACH_S = 2.0
#: What all of them together are given, however many the name has.
CONNECT_ALL_S = 6.0


def daemon_route(
    endpoint: str, wait_s: float = 0.0, on_wait: Callable[[str], None] | None = None
) -> Route:
    """The way this machine reaches ``endpoint``: the local address of a TCP connection
    the daemon accepted, made to each address its name resolves to, in the C library's
    order, until one is accepted; the first that is answers.

    That is the connection gRPC itself makes: our programs run gRPC's native resolver
    (``GRPC_DNS_RESOLVER=native``, set in ``rendezvousd/__init__.py``), the same
    ``getaddrinfo`` answer, and its ``pick_first`` policy dials the addresses in that
    order. The routing table's answer for the first address alone (a UDP ``connect``)
    named a network the daemon was not reached by when the name had addresses on two
    networks (RFC 6724 sorts a dead management address first): the node advertised an
    address its peers could not reach. Hand-written because gRPC tells a Python caller
    nothing of the connection it made. Bounded: ``CONNECT_EACH_S`` per address,
    ``CONNECT_ALL_S`` in all. When none accepts (the daemon not started yet), the routing
    table's answer for the first address with a route stands, as before.

    A host name that does not resolve, or a host without a route to it yet, is asked
    again every ``RESOLVE_RETRY_S`` for ``wait_s`` (a launcher's connect timeout), as a
    daemon not up yet is waited for: a Kubernetes Service's name may resolve only once
    its pod is ready, a pod's network may come up after it starts, and a node started
    before either failed at once. ``on_wait`` hears once that it waits. A ``unix:``
    endpoint means one machine: loopback.
    """
    address = parse_address(endpoint, what="endpoint", allow_unix=True)
    if address.host is None:  # unix:PATH
        return Route("localhost", "127.0.0.1", "127.0.0.1", False)
    began, told = time.monotonic(), False
    cause: OSError
    while True:
        try:
            infos = socket.getaddrinfo(address.host, address.port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            refusal, asked, cause = f"cannot resolve {address.host!r}", "asked", exc
            yet = f"{address.host!r} does not resolve yet ({exc}); asking again"
        else:
            routed = _routed(infos)
            if isinstance(routed, tuple):
                local, remote, connected = routed
                return Route(address.host, local, remote, connected)
            if routed.errno not in _NO_ROUTE_YET:
                # A lasting refusal (IPv6 off, a broadcast address): no wait helps.
                raise UnresolvedHost(f"endpoint={endpoint!r}: no route from this host ({routed})")
            # No route yet: a pod's network set up after its containers start (a CNI
            # or sidecar not ready), a link still coming up. Waited for as a name that
            # does not resolve yet is: a node started a moment early exited 2.
            refusal, asked, cause = "no route from this host", "tried", routed
            yet = f"no route from this host yet ({routed}); trying again"
        waited = time.monotonic() - began
        if waited >= wait_s:
            tried = f" ({asked} for {waited:.0f} s)" if wait_s > 0 else ""
            raise UnresolvedHost(f"endpoint={endpoint!r}: {refusal}{tried}: {cause}") from None
        if on_wait is not None and not told:
            told = True
            on_wait(
                f"endpoint={endpoint!r}: {yet} every {RESOLVE_RETRY_S:g} s for up to {wait_s:g} s"
            )
        time.sleep(min(RESOLVE_RETRY_S, wait_s - waited))


def _routed(infos: list[tuple[Any, ...]]) -> tuple[str, str, bool] | OSError:
    """(local address, remote address, connected) of the first of ``infos`` that accepts
    a TCP connection; else of the first this host has a route to; else why the last had
    none."""
    deadline = time.monotonic() + CONNECT_ALL_S
    for family, kind, proto, _, target in infos:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.settimeout(min(CONNECT_EACH_S, left))
                probe.connect(target)
                return str(probe.getsockname()[0]), str(target[0]), True
        except OSError:
            continue
    last: OSError = OSError("no address")
    for family, _, _, _, target in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect(target)
                return str(probe.getsockname()[0]), str(target[0]), False
        except OSError as exc:
            last = exc
    return last
