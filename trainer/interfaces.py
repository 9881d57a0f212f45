"""This host's network interfaces and their addresses: ``ring_host = "@eth1"`` read as
that interface's IPv4 address, and the interface that holds an advertised address,
which gloo and NCCL are pointed at (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``).

Hand-written on the standard library (``socket.if_nameindex``, the ``SIOCGIFADDR`` and
``SIOCGIFCONF`` ioctls, ``/proc/net/if_inet6``): the node agent and a bare worker must
not need psutil, a compiled package the base install does not carry, nor run
``ip -j addr``, which a minimal container image lacks. Linux only, as the rest of the
node side is (futexes, ``/proc``)."""

from __future__ import annotations

import array
import errno
import fcntl
import ipaddress
import socket
import struct
from collections.abc import MutableMapping

#: What starts a ``ring_host`` that names an interface: no host name (RFC 1123) or
#: address starts with it, so ``@eth1`` is never a name the resolver was meant to read.
INTERFACE_MARK = "@"

_SIOCGIFCONF = 0x8912
_SIOCGIFADDR = 0x8915
_IFNAMSIZ = 16
#: ``struct ifreq``: the name, then a union of which a ``sockaddr`` is the largest part
#: used here; 40 bytes where pointers take 8, 32 where they take 4.
_IFREQ = 40 if struct.calcsize("P") == 8 else 32


class InterfaceError(Exception):
    """An interface named that this host does not have, or that has no IPv4 address."""


def interface_names() -> list[str]:
    """This host's interfaces, in the kernel's index order."""
    return [name for _index, name in socket.if_nameindex()]


def ipv4_of(name: str) -> str:
    """The IPv4 address of interface ``name`` (its primary one, which the kernel picks as
    the source of what leaves through it); ``InterfaceError`` naming the interfaces this
    host has when it has no such interface or that one has no IPv4 address."""
    if not name or len(name.encode()) >= _IFNAMSIZ or "/" in name or name.strip() != name:
        raise InterfaceError(f"{name!r} is not an interface name{_present()}")
    request = struct.pack(f"{_IFNAMSIZ}s{_IFREQ - _IFNAMSIZ}x", name.encode())
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
        except OSError as exc:
            if exc.errno == errno.ENODEV:
                raise InterfaceError(f"this host has no interface {name!r}{_present()}") from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise InterfaceError(
                    f"interface {name!r} has no IPv4 address on this host{_present()}"
                ) from None
            raise InterfaceError(f"cannot read interface {name!r}'s address: {exc}") from None
    # sockaddr_in after the name: family (2 bytes), port (2), then the address.
    return socket.inet_ntoa(answer[_IFNAMSIZ + 4 : _IFNAMSIZ + 8])


def _ipv4_addresses() -> list[tuple[str, str]]:
    """Every IPv4 address of this host with its interface, secondary ones too (which
    ``SIOCGIFADDR`` does not say); an alias's label (``eth0:1``) read as its device."""
    size = 64 * _IFREQ
    while True:
        buffer = array.array("B", bytes(size))
        pointer, _ = buffer.buffer_info()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            packed = fcntl.ioctl(probe.fileno(), _SIOCGIFCONF, struct.pack("iP", size, pointer))
        used = int(struct.unpack("iP", packed)[0])
        if used < size:  # a full buffer may have cut the list: ask with a larger one
            break
        size *= 2
    raw = buffer.tobytes()
    found = []
    for at in range(0, used, _IFREQ):
        label = raw[at : at + _IFNAMSIZ].split(b"\0", 1)[0].decode(errors="replace")
        address = socket.inet_ntoa(raw[at + _IFNAMSIZ + 4 : at + _IFNAMSIZ + 8])
        found.append((label.split(":", 1)[0], address))
    return found


def _ipv6_addresses() -> list[tuple[str, str]]:
    try:
        with open("/proc/net/if_inet6", encoding="ascii") as table:
            rows = [line.split() for line in table]
    except OSError:  # IPv6 off in this kernel or namespace
        return []
    return [(row[5], str(ipaddress.IPv6Address(int(row[0], 16)))) for row in rows if len(row) >= 6]


def interface_holding(address: str) -> str | None:
    """The interface that holds ``address`` on this host (IPv4 or IPv6), or None."""
    try:
        wanted = ipaddress.ip_address(address.strip("[]").split("%", 1)[0])
    except ValueError:
        return None
    held = _ipv4_addresses() if wanted.version == 4 else _ipv6_addresses()
    for name, have in held:
        if ipaddress.ip_address(have) == wanted:
            return name
    return None


def point_socket_ifname(variable: str, address: str, env: MutableMapping[str, str]) -> str | None:
    """Set ``variable`` (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``) in ``env`` to
    the interface holding ``address``, the one this node advertises, unless the user set
    it (their choice stands, even where it differs); returns what was set. Left alone,
    gloo resolves the host name (127.0.1.1 on many hosts) and NCCL takes the first
    interface it likes, which on a multi-homed host need not be the one peers reach."""
    if env.get(variable):
        return None
    name = interface_holding(address)
    if name is not None:
        env[variable] = name
    return name


def _present() -> str:
    """The interfaces this host has, with their IPv4 addresses, for a refusal."""
    held: dict[str, list[str]] = {}
    try:
        for name, address in _ipv4_addresses():
            held.setdefault(name, []).append(address)
        names = interface_names()
    except OSError:
        return ""
    listed = [f"{n} {', '.join(held[n])}" if n in held else f"{n} (no IPv4 address)" for n in names]
    return f" (its interfaces: {'; '.join(listed)})"
