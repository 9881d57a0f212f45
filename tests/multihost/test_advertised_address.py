"""Which address a node advertises, on hosts with two networks (a review on namespace
hosts): the address of the connection that reaches the daemon, whatever order the
daemon's name resolves in; and a ``--ring-host`` name resolved once, as this host
resolves it."""

from __future__ import annotations

import ipaddress
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rendezvousd.trainer.demo import netns
from rendezvousd.trainer.demo.netns import Hosts
from tests.multihost.cluster import Cluster, start_cluster
from tests.support import spawn_daemon, wait_for

#: The management network: every node reaches the daemon on it, but not each other.
NET_M = ipaddress.ip_network(f"198.19.{netns.OCTET}.0/24")


def _m_address(index: int) -> str:
    return str(NET_M.network_address + (1 if index == 0 else 10 + index))


#: An address of the management network no host has: a dead address of the daemon's.
DEAD = str(NET_M.network_address + 10)


def _add_net_m(hosts: Hosts) -> None:
    """Each host gets ``eth1`` on a second bridge, whose node ports are isolated from
    each other (they reach h0 only), and its default route through it: what a naive
    pick of "the route towards the daemon" finds first."""
    sw = hosts.switch
    netns._ip("-n", sw, "link", "add", "br1", "type", "bridge")
    netns._ip("-n", sw, "link", "set", "br1", "up")
    for i, host in enumerate(hosts.hosts):
        netns._ip("-n", sw, "link", "add", f"m{i}", "type", "veth", "peer", "eth1")
        netns._ip("-n", sw, "link", "set", "eth1", "netns", host.netns)
        netns._ip("-n", sw, "link", "set", f"m{i}", "master", "br1", "up")
        if i > 0:
            netns._ip("-n", sw, "link", "set", "dev", f"m{i}", "type", "bridge_slave",
                      "isolated", "on")  # fmt: skip
        netns._ip("-n", host.netns, "addr", "add", f"{_m_address(i)}/{NET_M.prefixlen}",
                  "dev", "eth1")  # fmt: skip
        netns._ip("-n", host.netns, "link", "set", "eth1", "up")
        netns._ip("-n", host.netns, "route", "add", "default", "via", _m_address(0))


@pytest.fixture
def hosts_files() -> Iterator[Callable[[Hosts, int, str], None]]:
    """``write(hosts, i, text)``: host i's /etc/hosts (``ip netns exec`` mounts
    /etc/netns/NAME/hosts over it); removed after the test."""
    made: list[Path] = []

    def write(hosts: Hosts, index: int, text: str) -> None:
        folder = Path("/etc/netns") / hosts[index].netns
        folder.mkdir(parents=True, exist_ok=True)
        made.append(folder)
        (folder / "hosts").write_text("127.0.0.1 localhost\n" + text)

    yield write
    for folder in made:
        (folder / "hosts").unlink(missing_ok=True)
        folder.rmdir()


def _in(hosts: Hosts, index: int, code: str) -> str:
    done = subprocess.run(
        hosts[index].command([sys.executable, "-c", code]),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_node_advertises_the_address_it_reaches_the_daemon_by_not_the_first_answers_route(
    make_hosts: Callable[[int], Hosts],
    hosts_files: Callable[[Hosts, int, str], None],
    tmp_path: Path,
) -> None:
    """The daemon's name has its live address on net A and a dead one on the nodes'
    management net M, which the C library sorts first (or a hosts file lists first).
    The node advertised its M address (the routing table's answer for the first
    address), which the other nodes cannot reach: every ring setup failed after its
    timeout while `status` said RUNNING. Now: the address of the connection the
    daemon accepted, which is gRPC's own (the native resolver dials in that order).
    And gRPC resolves the name as the C library does, from /etc/hosts, without asking
    a nameserver these hosts cannot reach."""
    hosts = make_hosts(3)
    _add_net_m(hosts)
    d = spawn_daemon(
        tmp_path, "--insecure-plaintext", listen="0.0.0.0:0", prefix=hosts[0].command([])
    )
    try:
        port = d.endpoint.rsplit(":", 1)[1]
        hosts_files(hosts, 1, f"{hosts[0].address} hlive\n{DEAD} hlive\n{DEAD} hdead\n"
                              f"{hosts[0].address} hdead\n")  # fmt: skip
        order = _in(
            hosts, 1,
            "import socket\n"
            f"print([a[4][0] for a in socket.getaddrinfo('hlive', {port}, type=socket.SOCK_STREAM)])",
        )  # fmt: skip
        for name in ("hlive", "hdead"):
            picked = _in(
                hosts, 1,
                "from rendezvousd.common.address import route_source\n"
                f"print(route_source('{name}:{port}'))",
            )  # fmt: skip
            assert picked == hosts[1].address, (name, picked, order)
            # gRPC dials the same way, and names from /etc/hosts do not wait on the
            # nameserver these hosts cannot reach (gRPC's c-ares resolver asked it and
            # missed health's own 5 s, blamed on "no gRPC server answered").
            health = subprocess.run(
                hosts[1].command([sys.executable, "-m", "rendezvousd", "health", "--endpoint",
                                  f"{name}:{port}"]),
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert health.returncode == 0, (name, health.stdout, health.stderr)
            assert "is SERVING" in health.stdout
    finally:
        d.kill()


def test_a_two_node_ring_forms_when_the_daemons_name_also_names_a_dead_address(
    make_hosts: Callable[[int], Hosts],
    hosts_files: Callable[[Hosts, int, str], None],
    tmp_path: Path,
    job_id: str,
) -> None:
    """The same two-network hosts, end to end: two nodes, a CPU ring across them."""
    hosts = make_hosts(3)
    _add_net_m(hosts)
    cluster = start_cluster(hosts, tmp_path)
    try:
        port = cluster.daemon.endpoint.rsplit(":", 1)[1]
        for i in (1, 2):
            hosts_files(hosts, i, f"{DEAD} head\n{hosts[0].address} head\n")
        cluster.daemon.endpoint = f"head:{port}"
        nodes = cluster.launch(2, 1, job=job_id, launcher_args=["--setup-timeout-s", "20"])
        codes = cluster.wait(nodes, timeout=90)
        assert codes == [0, 0], [n.summary() for n in nodes]
        assert len(cluster.results(job_id)) == 2
    finally:
        cluster.stop()


def _cluster_on_every_address(hosts: Hosts, tmp_path: Path) -> Cluster:
    """rendezvousd on h0, listening on all of its addresses (both networks, loopback)."""
    daemon = spawn_daemon(
        tmp_path, "--insecure-plaintext", listen="0.0.0.0:0", prefix=hosts[0].command([])
    )
    return Cluster(hosts, daemon, tmp_path)


def test_a_ring_host_name_is_resolved_once_and_its_loopback_answer_refused(
    make_hosts: Callable[[int], Hosts],
    hosts_files: Callable[[Hosts, int, str], None],
    tmp_path: Path,
    job_id: str,
) -> None:
    """``--ring-host x1`` where this host's /etc/hosts says ``127.0.1.1 x1`` (Debian's
    form) and the other host's says x1's LAN address: the ring listened on 127.0.1.1
    and advertised the name, which the other node resolved to another address;
    refused connections for the whole setup, then the other node blamed. Now the name
    is resolved here, the address advertised, and loopback refused at once, saying
    which name resolved to what."""
    hosts = make_hosts(3)
    cluster = _cluster_on_every_address(hosts, tmp_path)
    try:
        port = cluster.daemon.endpoint.rsplit(":", 1)[1]
        cluster.daemon.endpoint = f"{hosts[0].address}:{port}"
        hosts_files(hosts, 1, "127.0.1.1 x1\n")
        hosts_files(hosts, 2, f"{hosts[1].address} x1\n")
        first = cluster.launch(
            2,
            1,
            job=job_id,
            nodes=[0],
            launcher_args=["--ring-host", "x1", "--setup-timeout-s", "20"],
        )
        second = cluster.launch(
            2, 1, job=job_id, nodes=[1], launcher_args=["--setup-timeout-s", "20"]
        )
        codes = cluster.wait([*first, *second], timeout=60)
        said = first[0].text()
        assert codes[0] == 2, first[0].summary()
        assert "ring_host 'x1' resolves to 127.0.1.1 on this host" in said, said
        assert "advertises the loopback address '127.0.1.1" in said, said
        assert "given by --ring-host" in said and "as 'x1', which resolves to 127.0.1.1" in said
    finally:
        cluster.stop()


def test_a_daemon_name_that_resolves_to_loopback_is_named_in_the_refusal(
    make_hosts: Callable[[int], Hosts],
    hosts_files: Callable[[Hosts, int, str], None],
    tmp_path: Path,
    job_id: str,
) -> None:
    """A node on the daemon's own host, whose /etc/hosts says ``127.0.1.1 head``, and
    ``--rdzv-endpoint head:PORT`` on every node: refused, as before, but the refusal said
    "which is loopback when --rdzv-endpoint is" of an endpoint written as a name."""
    hosts = make_hosts(2)
    cluster = _cluster_on_every_address(hosts, tmp_path)
    try:
        port = cluster.daemon.endpoint.rsplit(":", 1)[1]
        cluster.daemon.endpoint = f"head:{port}"
        hosts_files(hosts, 0, "127.0.1.1 head\n")
        hosts_files(hosts, 1, f"{hosts[0].address} head\n")
        on_head = cluster.launch(2, 1, job=job_id, nodes=[0], on_host=0)
        other = cluster.launch(2, 1, job=job_id, nodes=[1], on_host=1)
        codes = cluster.wait([*on_head, *other], timeout=60)
        said = on_head[0].text()
        assert codes[0] == 2, on_head[0].summary()
        assert "'head' resolves to 127.0.1.1 on this host (/etc/hosts)" in said, said
    finally:
        cluster.stop()


def test_a_peer_address_on_a_network_the_nodes_do_not_share_is_named_with_its_setting(
    make_hosts: Callable[[int], Hosts], tmp_path: Path, job_id: str
) -> None:
    """Nodes that reach the daemon on its management address (net M, where they cannot
    reach each other) advertise their M addresses. Each rank's connect meets "No route
    to host"; the setup waited its whole timeout (300 s, again per restart), and the
    root cause blamed the rank that was not reached ("did not connect and
    authenticate"), naming no setting. Now a first setup gives up after
    FIRST_NO_ROUTE_S, naming where the address came from and what to set."""
    hosts = make_hosts(3)
    _add_net_m(hosts)
    cluster = _cluster_on_every_address(hosts, tmp_path)
    try:
        port = cluster.daemon.endpoint.rsplit(":", 1)[1]
        endpoint = f"{_m_address(0)}:{port}"
        cluster.daemon.endpoint = endpoint
        nodes = cluster.launch(2, 1, job=job_id)
        codes = cluster.wait(nodes, timeout=90)
        assert codes != [0, 0]
        said = "\n".join(n.text() for n in nodes)
        assert f"chosen as its host's route to the daemon at {endpoint}" in said, said
        assert "cannot be reached: No route to host (EHOSTUNREACH) for" in said, said
        assert "set --ring-host ($RENDEZVOUSD_RING_HOST, ring_host) on node" in said, said
        root = [line for line in said.splitlines() if "root cause" in line]
        assert root and "did not connect and authenticate" not in root[0], root
        # Its end, which a shortened root cause keeps, names the node to fix.
        assert "ring_host) on node" in root[0], root
    finally:
        cluster.stop()


def test_a_shared_config_naming_the_data_interface_forms_the_ring_on_it(
    make_hosts: Callable[[int], Hosts], tmp_path: Path, job_id: str
) -> None:
    """The same hosts, the nodes reaching the daemon on net M, where the default pick
    (the route towards the daemon) advertises addresses the nodes cannot reach each
    other at. One TOML for every node, `ring_host = "@eth0"` (net A's interface): each
    node advertises its own net A address, said as that interface's, and the ring forms.
    Before, the name had to be each node's own address: `@eth0` did not resolve."""
    hosts = make_hosts(3)
    _add_net_m(hosts)
    cluster = _cluster_on_every_address(hosts, tmp_path)
    shared = tmp_path / "shared.toml"
    shared.write_text('[distributed]\nring_host = "@eth0"\nsetup_timeout_s = 30.0\n')
    try:
        port = cluster.daemon.endpoint.rsplit(":", 1)[1]
        cluster.daemon.endpoint = f"{_m_address(0)}:{port}"
        nodes = cluster.launch(2, 1, job=job_id, launcher_args=["--config", str(shared)])
        codes = cluster.wait(nodes, timeout=90)
        assert codes == [0, 0], [n.summary() for n in nodes]
        assert len(cluster.results(job_id)) == 2
        for node in nodes:
            address = node.host.address
            assert (
                f"ring_host '@eth0' is interface eth0's address {address} on this host"
                in node.text()
            ), node.text()
    finally:
        cluster.stop()


def test_a_node_readdressed_under_its_agent_rejoins_with_its_new_address(
    make_cluster: Callable[..., Cluster],
) -> None:
    """h2's address changes in place under its running agents (a DHCP renewal, a
    migrated VM): the address chosen at launch was advertised to every generation
    after, whose workers failed to bind it ("OSError: [Errno 99]") within 0.4 s each,
    every restart spent (h170). Now a node whose address was not given chooses it
    again before each re-join: one restart, for the generation the change broke, and
    the job finishes. A ``--ring-host`` given that the host no longer has is refused
    before the join, as a setting is (exit 2, no restart burned), naming it. Both jobs
    share the two hosts, so one change of address serves both."""
    cluster = make_cluster(2, "--heartbeat-timeout-s", "3")
    h2 = cluster.hosts[2]
    old, new = h2.address, str(netns.SUBNET.network_address + 20)
    launcher = ("--heartbeat-interval-s", "0.5", "--max-restarts", "2")
    # Long enough to be mid-run when the address changes; resumed from the agents'
    # copy of the last step, so the restart repeats little of it.
    work = ("--steps", "150", "--step-sleep", "0.04", "--log-every", "10")
    work += ("--samples", "256", "--hidden", "16")
    follows = cluster.launch(2, 1, job="follows", launcher_args=launcher, example_args=work)
    pinned = cluster.launch(2, 1, job="pinned", nodes=[0], launcher_args=launcher,
                            example_args=work)  # fmt: skip
    pinned += cluster.launch(2, 1, job="pinned", nodes=[1],
                             launcher_args=(*launcher, "--ring-host", old),
                             example_args=work)  # fmt: skip
    for node in (follows[0], pinned[0]):
        wait_for("both jobs' first steps", lambda n=node: n.first("step 11/") is not None, 60)
    netns._ip("-n", h2.netns, "addr", "del", f"{old}/{netns.SUBNET.prefixlen}", "dev", "eth0")
    netns._ip("-n", h2.netns, "addr", "add", f"{new}/{netns.SUBNET.prefixlen}", "dev", "eth0")
    h2.address = new

    assert cluster.wait(follows, 60) == [0, 0], [n.summary() for n in follows]
    assert len(cluster.results("follows")) == 2
    said = follows[1].text()
    assert (
        f"this node's address changed: its ring now listens on and advertises {new}, "
        f"chosen as its host's route to the daemon at {cluster.daemon.endpoint}"
    ) in said, follows[1].summary()
    assert f"(it was {old})" in said
    # What `rendezvousd status` shows: the generation that finished, at the new address.
    assert {m["address"] for m in cluster.job_members("follows") if m["host"] == "h2"} == {new}
    for node in follows:
        assert "restart 1 of 2" in node.text() and "restart 2 of 2" not in node.text(), (
            node.summary()
        )

    assert cluster.wait(pinned[1:], 30) == [2], pinned[1].summary()
    refused = pinned[1].text()
    assert (
        f"no generation: node on host h2: this node's ring address {old} (given by --ring-host "
        "($RENDEZVOUSD_RING_HOST, ring_host)) cannot be used on host h2 any more"
    ) in refused, pinned[1].summary()
    assert "give an address of this host that the other nodes reach" in refused
    assert "restart 2 of 2" not in refused


def test_the_other_nodes_hear_at_once_that_a_readdressed_node_refused_its_ring_host(
    make_cluster: Callable[..., Cluster],
) -> None:
    """h2's pinned ``--ring-host`` is gone from it (re-addressed in place): its agent
    refuses it before the re-join (exit 2). The other node waited its whole re-join
    timeout (60 s) for it, then said only that the job did not form. It hears now,
    within seconds, which node left, from which host, and why."""
    cluster = make_cluster(2, "--heartbeat-timeout-s", "3")
    h2 = cluster.hosts[2]
    old, new = h2.address, str(netns.SUBNET.network_address + 21)
    launcher = ("--heartbeat-interval-s", "0.5", "--max-restarts", "2")
    work = ("--steps", "150", "--step-sleep", "0.04", "--log-every", "10")
    work += ("--samples", "256", "--hidden", "16")
    nodes = cluster.launch(2, 1, job="pinned", nodes=[0], launcher_args=launcher,
                           example_args=work)  # fmt: skip
    nodes += cluster.launch(2, 1, job="pinned", nodes=[1],
                            launcher_args=(*launcher, "--ring-host", old),
                            example_args=work)  # fmt: skip
    wait_for("the first steps", lambda: nodes[0].first("step 11/") is not None, 60)
    netns._ip("-n", h2.netns, "addr", "del", f"{old}/{netns.SUBNET.prefixlen}", "dev", "eth0")
    netns._ip("-n", h2.netns, "addr", "add", f"{new}/{netns.SUBNET.prefixlen}", "dev", "eth0")
    h2.address = new

    assert cluster.wait(nodes[1:], 30) == [2], nodes[1].summary()
    refused_at = nodes[1].first("cannot be used on host h2 any more")
    assert refused_at is not None, nodes[1].summary()
    # Well inside the re-join timeout (60 s) it waited before, once per restart left;
    # as a setup error (exit 2): no restart changes the other node's setting.
    assert cluster.wait(nodes[:1], 30) == [2], nodes[0].summary()
    said = nodes[0].text()
    assert (
        f"node 1 (host h2) left job 'pinned': its ring address {old} (given by --ring-host"
    ) in said, nodes[0].summary()
    assert "is no longer an address of that host" in said, nodes[0].summary()
    assert "restart 2 of 2" not in said, nodes[0].summary()
    ended_at = nodes[0].first("gave up")
    assert ended_at is not None and ended_at - refused_at < 15, nodes[0].summary()


#: A member on h1 that joins, waits for a line on stdin (its host re-addressed
#: meanwhile), leaves and says what the SDK logged.
_LEAVER = """
import logging, sys
from rendezvousd.client import RendezvousClient
logging.basicConfig(level=logging.WARNING, format="%(message)s")
endpoint, job, token_file = sys.argv[1:4]
c = RendezvousClient(endpoint, job, token_file=token_file, leave_timeout=5)
c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=20)
c.barrier("warm", timeout=10)  # the channel connected, from the address h1 has now
print("joined", flush=True)
sys.stdin.readline()
c.leave()
print("left", flush=True)
c.close()
"""


def test_a_member_whose_host_was_readdressed_still_says_its_leave(
    make_cluster: Callable[..., Cluster],
) -> None:
    """h1's address changes in place between a member's join and its leave: the
    channel's connection stays bound to the address removed, still READY, and the
    Leave on it waited its whole timeout, then said "it accepts connections, but no
    gRPC server answered ... a daemon that is stuck" (a plain connect from the new
    address works) and the daemon was never told. The channel is made anew where the
    address the client joined from is gone: the Leave gets through, and the job ends
    as every member left."""
    cluster = make_cluster(1, "--heartbeat-timeout-s", "60")
    h1 = cluster.hosts[1]
    old, new = h1.address, str(netns.SUBNET.network_address + 22)
    argv = [sys.executable, "-c", _LEAVER, cluster.daemon.endpoint, "left",
            str(cluster.daemon.token_file)]  # fmt: skip
    proc = subprocess.Popen(
        h1.command(argv),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "joined"
        netns._ip("-n", h1.netns, "addr", "del", f"{old}/{netns.SUBNET.prefixlen}", "dev", "eth0")
        netns._ip("-n", h1.netns, "addr", "add", f"{new}/{netns.SUBNET.prefixlen}", "dev", "eth0")
        h1.address = new
        out, err = proc.communicate("go\n", timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0 and "left" in out, err
    assert "could not tell the daemon" not in err, err
    # JOB_STATE_ENDED: the daemon heard the leave (not left RUNNING, to lose it later).
    assert cluster.job_facts("left")["state"] == 5, (cluster.job_facts("left"), err)
