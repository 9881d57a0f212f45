"""The one host:port parser (rendezvousd.common.address) and how both config loaders report it."""

from __future__ import annotations

import errno
import socket
import time
import urllib.request
from collections.abc import Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rendezvousd import config as daemon_config
from rendezvousd.common import address
from rendezvousd.common.address import (
    Address,
    AddressError,
    UnresolvedHost,
    parse_address,
    parse_host_port,
)
from rendezvousd.errors import ConfigError as DaemonConfigError
from rendezvousd.trainer.config import load_config
from rendezvousd.trainer.errors import ConfigError as TrainerConfigError
from tests.support import DaemonProcess


def test_host_port_and_bracketed_ipv6() -> None:
    assert parse_host_port("head:29420") == ("head", 29420)
    assert parse_host_port("[::1]:5") == ("::1", 5)
    assert parse_address("unix:/run/r.sock", allow_unix=True) == Address(None, 0, "/run/r.sock")


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "malformed"),
        ("localhost", "malformed"),
        (":29400", "malformed"),
        ("::1:5", r"wrap IPv6"),
        ("127.0.0.1:29420,127.0.0.1:29421", "names several addresses"),  # was: wrap IPv6
        ("[head]:5", "not an IPv6 address"),
        ("http://h:1", "no scheme"),
        ("h :1", "no scheme or spaces"),
        ("h:0", r"port '0': expected 1\.\.65535"),
        ("h:65536", r"port '65536'"),
        ("h:x", r"port 'x'"),
        ("unix:/x", "port '/x'"),  # unix: only where the caller allows it
    ],
)
def test_malformed_addresses_are_quoted(text: str, reason: str) -> None:
    with pytest.raises(AddressError, match=reason) as info:
        parse_host_port(text, what="endpoint")
    assert f"endpoint={text!r}" in str(info.value)


@pytest.mark.parametrize("host", ["127.1", "0x7f000001", "2130706433", "0177.0.0.1"])
def test_a_shorthand_ipv4_host_is_refused_with_its_dotted_form(host: str) -> None:
    # The C library reads these as 127.0.0.1; gRPC's resolver does not: the SDK's
    # plain-socket probe then reached a daemon gRPC never did and blamed it as stuck.
    with pytest.raises(AddressError) as info:
        parse_host_port(f"{host}:29420", what="endpoint")
    said = str(info.value)
    assert said.startswith(f"endpoint='{host}:29420' has host '{host}', a shorthand IPv4")
    assert said.endswith("write it as 127.0.0.1"), said


@pytest.mark.parametrize("host", ["127.0.0.1", "10.1.2.3", "1e100.net", "123abc", "head-0"])
def test_dotted_quads_and_names_that_start_with_digits_are_taken(host: str) -> None:
    assert parse_host_port(f"{host}:1") == (host, 1)


def test_port_zero_and_empty_unix_path_only_where_allowed() -> None:
    assert parse_host_port("h:0", allow_port_zero=True) == ("h", 0)
    with pytest.raises(AddressError, match="no socket path"):
        parse_address("unix:", allow_unix=True)


def test_each_config_loader_raises_its_own_error_with_the_origin() -> None:
    with pytest.raises(
        DaemonConfigError, match=r"\$RENDEZVOUSD_LISTEN='::1:5' is malformed: wrap IPv6"
    ):
        daemon_config.load(None, env={"RENDEZVOUSD_LISTEN": "::1:5"})
    with pytest.raises(DaemonConfigError, match=r"--metrics-listen='h:70000' has port '70000'"):
        daemon_config.load(None, env={}, overrides={"metrics_listen": "h:70000"})
    with pytest.raises(TrainerConfigError, match=r"\$RENDEZVOUSD_ENDPOINT='h:0' has port '0'"):
        load_config(None, env={"RENDEZVOUSD_ENDPOINT": "h:0"})
    assert daemon_config.split_listen("unix:/tmp/s") == (None, 0)
    assert daemon_config.split_listen("[::1]:0") == ("::1", 0)


def test_a_daemon_on_ipv6_prints_an_endpoint_and_a_url_clients_can_use(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    """The 'serving on' line is what scripts read the bound port from: '::1:PORT' was no
    endpoint (gRPC could not reach it), and 'http://::1:PORT/metrics' no URL."""
    d = start_daemon("--metrics-listen", "[::1]:0", listen="[::1]:0")
    assert d.endpoint.startswith("[::1]:"), d.endpoint
    with grpc.insecure_channel(d.endpoint) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
    assert check.status == health_pb2.HealthCheckResponse.SERVING
    assert d.metrics_url.startswith("http://[::1]:"), d.metrics_url
    with urllib.request.urlopen(d.metrics_url, timeout=10) as page:
        assert b"rendezvousd_" in page.read()


def test_a_daemon_name_that_resolves_late_is_waited_for_and_one_that_never_does_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Kubernetes Service's name may resolve only once its pod is ready: a node
    started before it failed at once with "cannot resolve" (torchrun's agent with our
    AddressError's traceback, found by review), where a port not listening yet is
    waited for within the connect timeout."""
    monkeypatch.setattr(address, "RESOLVE_RETRY_S", 0.01)
    real = socket.getaddrinfo
    asked: list[str] = []

    def late(host: str, *rest: object, **kw: object) -> object:
        asked.append(host)
        if (host == "daemon.example" and len(asked) < 3) or host == "nowhere.invalid":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real("127.0.0.1" if host == "daemon.example" else host, *rest, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", late)
    said: list[str] = []
    assert address.route_source("daemon.example:29400", 5.0, said.append) == "127.0.0.1"
    assert len(asked) == 3 and len(said) == 1, (asked, said)
    assert "'daemon.example' does not resolve yet" in said[0]
    assert "asking again every 0.01 s for up to 5 s" in said[0]
    asked.clear()
    with pytest.raises(
        UnresolvedHost, match=r"cannot resolve 'nowhere\.invalid' \(asked for 0 s\)"
    ):
        address.route_source("nowhere.invalid:1", 0.05)
    assert len(asked) >= 5, asked  # asked again, within the whole wait, not refused at once
    # Without a wait (the old call), the first answer stands.
    asked.clear()
    with pytest.raises(UnresolvedHost, match=r"cannot resolve 'nowhere\.invalid': "):
        address.route_source("nowhere.invalid:1")
    assert asked == ["nowhere.invalid"]
    # A malformed address is no unresolved host: a mistake, told at once.
    with pytest.raises(AddressError) as malformed:
        address.route_source("daemon.example:http", 5.0)
    assert not isinstance(malformed.value, UnresolvedHost)


def test_a_host_without_a_route_to_the_daemon_yet_is_waited_for_and_then_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pod whose network comes up after it starts (a CNI or sidecar not ready, a link
    still down): a node started a moment early exited 2 with "no route from this host"
    (found by a chaos review on namespace hosts), where a name not resolving yet is
    waited for."""
    monkeypatch.setattr(address, "RESOLVE_RETRY_S", 0.01)
    unreachable = OSError(errno.ENETUNREACH, "Network is unreachable")
    tries: list[int] = []

    def routed(infos: object) -> tuple[str, str, bool] | OSError:
        tries.append(1)
        return unreachable if len(tries) < 3 else ("198.18.7.11", "198.18.7.10", False)

    monkeypatch.setattr(address, "_routed", routed)
    said: list[str] = []
    assert address.route_source("198.18.7.10:29400", 5.0, said.append) == "198.18.7.11"
    assert len(tries) == 3 and len(said) == 1, (tries, said)
    assert "no route from this host yet ([Errno 101] Network is unreachable)" in said[0]
    assert "trying again every 0.01 s for up to 5 s" in said[0]
    tries.clear()
    monkeypatch.setattr(address, "_routed", lambda infos: unreachable)
    with pytest.raises(UnresolvedHost, match=r"no route from this host \(tried for 0 s\): "):
        address.route_source("198.18.7.10:29400", 0.05)
    # A lasting refusal (IPv6 off, a broadcast address) is no network coming up: at once.
    lasting = OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
    monkeypatch.setattr(address, "_routed", lambda infos: lasting)
    started = time.monotonic()
    with pytest.raises(UnresolvedHost, match=r"no route from this host \(\[Errno 97\]"):
        address.route_source("198.18.7.10:29400", 5.0)
    assert time.monotonic() - started < 1.0


def test_the_route_is_the_connection_the_daemon_accepted_in_resolution_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A name whose first address has nothing listening (a dead management address)
    and whose second is the daemon's: the route is the one that accepted, as gRPC's
    pick_first connects, not the routing table's answer for the first address. With
    nothing listening anywhere (a daemon not started yet), the first routed one."""
    real = socket.getaddrinfo
    with socket.create_server(("127.0.0.1", 0)) as daemon:
        port = daemon.getsockname()[1]

        def two(host: str, *rest: object, **kw: object) -> object:
            if host != "daemon.example":
                return real(host, *rest, **kw)  # type: ignore[arg-type]
            first = real("127.0.0.2", port, type=socket.SOCK_STREAM)
            return first + real("127.0.0.1", port, type=socket.SOCK_STREAM)

        monkeypatch.setattr(socket, "getaddrinfo", two)
        route = address.daemon_route(f"daemon.example:{port}")
        assert (route.local, route.remote, route.connected) == ("127.0.0.1", "127.0.0.1", True)
        assert (
            route.resolved() == "'daemon.example' resolves to 127.0.0.1 on this host (/etc/hosts)"
        )
    route = address.daemon_route(f"daemon.example:{port}")  # nothing listens now
    assert (route.remote, route.connected) == ("127.0.0.2", False)
    assert address.daemon_route(f"127.0.0.1:{port}").resolved() == ""
