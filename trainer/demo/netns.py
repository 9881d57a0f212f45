"""Real network hosts on one machine: Linux network namespaces on a bridge (a demo and
test helper shipped in the library, not used by training).

For seeing (``scripts/demo.sh --hosts N``) and testing (``tests/multihost``) the
multi-node path for real without a cluster: addresses, TLS and partitions behave
as between machines, which loopback hides.

Each host is a namespace with its own loopback and one veth interface ``eth0``
holding an address from the benchmarking range 198.18.0.0/15 (RFC 2544), the
only range these tests may use. The bridge lives in a namespace of its own, so
nothing is added to the machine's own network: deleting the namespaces removes
every interface. A host's link can be cut with ``link(host, up=False)``.

A run killed before its teardown (a crashed test worker, a SIGKILLed demo) leaves its
namespaces behind, so each set's name carries its builder's pid: the next ``build``
deletes the sets whose builder is gone and that hold no process.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

#: Runs sharing one machine keep apart by these: the third octet of the hosts'
#: addresses (198.18.N.0/24 and, where a test adds a second network, 198.19.N.0/24) and
#: the root of their namespaces' names (only ``rdzv`` sets are swept).
OCTET = int(os.environ.get("RDZV_NETNS_OCTET", "0"))
ROOT = os.environ.get("RDZV_NETNS_ROOT", "rdzv")
SUBNET = ipaddress.ip_network(f"198.18.{OCTET}.0/24")
_IP_TIMEOUT_S = 10.0
# rdzv-PID-HEX-sw / rdzv-PID-HEX-hN: the builder's pid tells a live set from a dead one.
_NAME = re.compile(r"rdzv-(\d+)-[0-9a-f]+-(?:sw|h\d+)")


def unavailable_reason() -> str | None:
    """Why namespace hosts cannot be built here, or None when they can."""
    if os.geteuid() != 0:
        return "building network namespaces needs root"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    return None


def _ip(*args: str) -> str:
    result = subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


def sweep() -> list[str]:
    """Deletes the namespaces of host sets whose builder process has died, unless a
    process still runs inside one; the names deleted. A recycled pid keeps a dead
    set until that process ends too, which errs towards keeping."""
    gone = []
    for line in _ip("netns", "list").splitlines():
        name = line.split(" ", 1)[0]
        match = _NAME.fullmatch(name)
        if match is None or _alive(int(match.group(1))):
            continue
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            if not _ip("netns", "pids", name).split():
                _ip("netns", "delete", name)
                gone.append(name)
    return gone


@dataclass
class Host:
    name: str
    netns: str
    address: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host's namespace, under its own hostname (a UTS
        namespace), as a process on a separate machine would see itself."""
        enter = ["ip", "netns", "exec", self.netns]
        if not argv:
            return enter
        setname = 'hostname "$0" && exec "$@"'
        return [*enter, "unshare", "--uts", "sh", "-c", setname, self.name, *argv]

    def prefix(self) -> list[str]:
        """What runs the command that follows it inside this host, under its own
        hostname (``command`` without the command: a launcher's ``prefix=``).
        ``command([])`` enters the namespace only: a program started so saw this
        machine's hostname."""
        return self.command(["true"])[:-1]

    def popen(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, **kw: object
    ) -> subprocess.Popen[str]:
        return subprocess.Popen(  # type: ignore[call-overload, no-any-return]
            self.command(argv), env={**os.environ, **(env or {})}, text=True, **kw
        )


#: A locally administered unicast address no host here has (``partition``).
_NOBODY = "02:00:5e:ff:ff:01"


@dataclass
class Hosts:
    """``count`` hosts named h0..h{count-1} at 198.18.0.1, .2, ..."""

    count: int
    prefix: str = field(default_factory=lambda: f"{ROOT}-{os.getpid()}-{secrets.token_hex(3)}")
    hosts: list[Host] = field(default_factory=list)

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def build(self) -> None:
        if self.prefix.startswith("rdzv-"):
            sweep()  # only the sets it names: another root's are its runner's own
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i in range(self.count):
            netns = f"{self.prefix}-h{i}"
            address = str(SUBNET.network_address + i + 1)
            _ip("netns", "add", netns)
            self.hosts.append(Host(f"h{i}", netns, address))
            # Created inside the switch namespace, then one end moved to the host:
            # no interface ever exists in the machine's own namespace.
            _ip("-n", self.switch, "link", "add", f"p{i}", "type", "veth", "peer", "eth0")
            _ip("-n", self.switch, "link", "set", "eth0", "netns", netns)
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", netns, "addr", "add", f"{address}/{SUBNET.prefixlen}", "dev", "eth0")
            _ip("-n", netns, "link", "set", "eth0", "up")
            _ip("-n", netns, "link", "set", "lo", "up")

    def link(self, host: Host, *, up: bool) -> None:
        """Plug or unplug ``host``'s cable (its interface, as seen from the host)."""
        _ip("-n", host.netns, "link", "set", "eth0", "up" if up else "down")

    def partition(self, a: Host, b: Host) -> None:
        """Cut ``a`` and ``b`` off from each other while both still reach every other
        host: each sends the other's packets to a hardware address nobody has, so they
        are lost on the wire, silently, as past a cut cable (a blackhole route would
        fail the sender's own writes instead, which no cut does)."""
        for here, there in ((a, b), (b, a)):
            _ip("-n", here.netns, "neigh", "replace", there.address, "lladdr", _NOBODY,
                "dev", "eth0", "nud", "permanent")  # fmt: skip

    def heal(self, a: Host, b: Host) -> None:
        """Undo ``partition``: each host finds the other's hardware address again."""
        for here, there in ((a, b), (b, a)):
            _ip("-n", here.netns, "neigh", "del", there.address, "dev", "eth0")

    def teardown(self) -> None:
        for netns in [h.netns for h in self.hosts] + [self.switch]:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                _ip("netns", "delete", netns)
        self.hosts.clear()
