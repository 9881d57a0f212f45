"""``ring_host = "@IFACE"``: the interface's IPv4 address on each host, so one shared
config names the nodes' data network (as GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME do);
refused naming the interfaces the host has. And NCCL pointed at the interface holding
the advertised address, as the torchrun handler points gloo, never over the user's."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest

from rendezvousd.trainer.agent import launcher
from rendezvousd.trainer.config import RingAddress, load_config
from rendezvousd.trainer.errors import ConfigError
from rendezvousd.trainer.interfaces import interface_holding, ipv4_of


def test_an_interface_named_in_ring_host_is_advertised_as_its_ipv4_address() -> None:
    said: list[str] = []
    ring = load_config(None, env={"RENDEZVOUSD_RING_HOST": "@lo"}).ring_choice(said.append)
    assert ring.address == "127.0.0.1"
    assert ring.origin == (
        "given by --ring-host ($RENDEZVOUSD_RING_HOST, ring_host) as interface lo's address"
    )
    assert said == [
        "ring_host '@lo' is interface lo's address 127.0.0.1 on this host: the ring listens "
        "on and advertises 127.0.0.1"
    ]
    assert ipv4_of("lo") == "127.0.0.1" and interface_holding("127.0.0.1") == "lo"


def test_an_interface_this_host_lacks_is_refused_naming_those_it_has() -> None:
    config = load_config(None, env={"RENDEZVOUSD_RING_HOST": "@nosuch9"})
    with pytest.raises(ConfigError) as caught:
        config.ring_choice()
    text = str(caught.value)
    assert text.startswith(
        f"ring_host='@nosuch9' on host {socket.gethostname()}: this host has no interface "
        "'nosuch9' (its interfaces: lo 127.0.0.1"
    ), text
    assert "name an interface this host has after '@'" in text, text


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs a network namespace"
)
def test_an_interface_without_an_ipv4_address_is_refused() -> None:
    """A fresh network namespace's loopback is down and holds no address."""
    code = textwrap.dedent(
        """
        from rendezvousd.trainer.config import load_config
        from rendezvousd.trainer.errors import ConfigError
        try:
            load_config(None, env={"RENDEZVOUSD_RING_HOST": "@lo"}).ring_choice()
        except ConfigError as exc:
            print(exc)
        """
    )
    done = subprocess.run(
        ["unshare", "--net", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "interface 'lo' has no IPv4 address on this host (its interfaces: lo (no IPv4 " \
        "address))" in done.stdout, done.stdout  # fmt: skip


def _nccl_env(
    monkeypatch: pytest.MonkeyPatch, base: dict[str, str], address: str = "127.0.0.1"
) -> tuple[dict[str, str], str | None]:
    """The env rendezvous-run's workers get (``spare_env`` then ``point_nccl_at``), and
    the launcher's own NCCL_SOCKET_IFNAME (node 0's bootstrap root for the id)."""
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    for name, value in base.items():
        monkeypatch.setenv(name, value)
    config = load_config(None, env={"RENDEZVOUSD_BACKEND": "nccl", **base})
    env = launcher.spare_env(config, None, base)
    launcher.point_nccl_at(config, RingAddress(address, "given by a test"), env)
    return env, os.environ.get("NCCL_SOCKET_IFNAME")


def test_nccl_workers_are_pointed_at_the_interface_of_the_advertised_address(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    env, own = _nccl_env(monkeypatch, {})
    assert (env.get("NCCL_SOCKET_IFNAME"), own) == ("lo", "lo")
    assert "NCCL_SOCKET_IFNAME=lo (holds 127.0.0.1, this node's address, given by a test)" in (
        capsys.readouterr().err
    )


def test_nccl_keeps_the_users_interface_and_the_shared_device_modes_loopback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env, own = _nccl_env(monkeypatch, {"NCCL_SOCKET_IFNAME": "ib0"})
    assert (env["NCCL_SOCKET_IFNAME"], own) == ("ib0", "ib0")
    monkeypatch.delenv("NCCL_SOCKET_IFNAME")
    # devices.prepare_nccl sets loopback in each worker of that mode: not fought here.
    env, own = _nccl_env(monkeypatch, {"RENDEZVOUSD_NCCL_SHARED_DEVICE": "1"})
    assert ("NCCL_SOCKET_IFNAME" in env, own) == (False, None)
    # An address no interface holds (a NAT's): NCCL left to its own pick.
    monkeypatch.delenv("RENDEZVOUSD_NCCL_SHARED_DEVICE")
    env, own = _nccl_env(monkeypatch, {}, "192.0.2.77")
    assert ("NCCL_SOCKET_IFNAME" in env, own) == (False, None)


def test_a_readdressed_nodes_warm_spares_get_the_interface_of_its_new_address(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The NCCL_SOCKET_IFNAME the launcher chose went into the warm spares' env once,
    at launch: a node re-addressed onto another interface since had its spares
    point NCCL at the old one. The agent chooses it again with the address before
    each re-join, sets its own (node 0's bootstrap root), and hands it to each worker
    in its assignment, which sets it over the env it was started with."""
    from rendezvousd.client import RendezvousClient
    from rendezvousd.trainer.agent.agent_worker import UNIQUE_ID_BYTES, Assignment
    from rendezvousd.trainer.agent.node_agent import NodeAgent
    from rendezvousd.trainer.distributed import point_nccl_from

    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth9")  # set by the launcher, for the old
    config = load_config(None, env={"RENDEZVOUSD_BACKEND": "nccl"})
    said: list[str] = []
    with RendezvousClient("127.0.0.1:1", "job", token="t") as client:
        agent = NodeAgent(
            config,
            ["true"],
            {"NCCL_SOCKET_IFNAME": "eth9"},
            client,
            link_host="198.18.179.99",
            ring_origin="chosen as its host's route to the daemon",
            ring_again=lambda: RingAddress("127.0.0.1", "chosen as its host's route"),
            socket_ifname="eth9",
            note=said.append,
        )
        try:
            assert agent._choose_ring() is None
        finally:
            agent.pool.stop()
    assert (agent.socket_ifname, os.environ["NCCL_SOCKET_IFNAME"]) == ("lo", "lo")
    assert any("NCCL_SOCKET_IFNAME=lo for this node's workers from now on" in s for s in said)
    handed = Assignment(
        "job", 2, 1, 0, 0, 0, 1, 1, 1, b"\0" * UNIQUE_ID_BYTES, "i", config,
        socket_ifname=agent.socket_ifname,
    )  # fmt: skip
    got = Assignment.decode(handed.header(), handed.secrets_payload())
    spare_env = {"NCCL_SOCKET_IFNAME": "eth9"}  # what the spare was started with
    point_nccl_from(got, spare_env)
    assert spare_env["NCCL_SOCKET_IFNAME"] == "lo"
