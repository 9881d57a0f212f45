"""The node agents' links (``node_links``) over a real daemon's key-value store, on
loopback: who links to whom, what is not a cut, and that no one else can take a
node's link. The cut itself (a host that goes silent) needs real hosts:
tests/multihost/test_faults.py."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rendezvousd.client import Membership, NodeMembership, RendezvousClient
from rendezvousd.trainer.agent.node_links import (
    LINK_SETTLE_S,
    MAX_HANDSHAKES,
    LinkSilent,
    NodeLinks,
)
from tests.support import (
    FAKE_GPU_LAUNCHER,
    WORKERS,
    DaemonProcess,
    launcher_cmd,
    members,
    parallel,
    wait_for,
)


@pytest.fixture
def nodes(
    daemon: DaemonProcess, job_id: str
) -> Iterator[list[tuple[RendezvousClient, NodeMembership]]]:
    clients = [RendezvousClient(daemon.endpoint, job_id, token=daemon.token) for _ in range(3)]
    joined = parallel(
        [
            lambda c=c: c.join_node(min_nodes=3, max_nodes=3, gpus_per_node=2, timeout=20)  # type: ignore[misc]
            for c in clients
        ]
    )
    for j in joined:
        if isinstance(j, BaseException):
            raise j
    yield sorted(zip(clients, joined, strict=True), key=lambda cm: cm[1].node_rank)
    for c in clients:
        c.close()


def attached(client: RendezvousClient, m: NodeMembership) -> RendezvousClient:
    """A client acting as node ``m``'s first rank, as the links' own client does."""
    member = RendezvousClient(client.endpoint, m.job_id, token=client._s.token)
    member.attach(m.membership_for(0), m.member_instance_id(0))
    return member


def address_of(client: RendezvousClient, m: NodeMembership, node: int) -> tuple[str, int]:
    """Where ``node``'s links listen, as its neighbours read it."""
    reader = attached(client, m)
    try:
        entry = json.loads(reader.kv_get(f"node-link/{node}", timeout=10))
    finally:
        reader.close()  # not leave(): the member is that node's first rank
    return entry["host"], entry["port"]


def links_of(
    client: RendezvousClient, m: NodeMembership, heard: list[LinkSilent], notes: list[str]
) -> NodeLinks:
    """As the agents make them: on a client of their own."""
    return NodeLinks(
        RendezvousClient(client.endpoint, m.job_id, token=client._s.token),
        m,
        host="127.0.0.1",
        name=f"node{m.node_rank}",
        on_silent=heard.append,
        note=notes.append,
        setup_timeout=10.0,
    )


def test_each_node_links_to_both_neighbours_and_an_agent_that_ends_is_no_cut(
    nodes: list[tuple[RendezvousClient, NodeMembership]],
) -> None:
    heard: list[LinkSilent] = []
    notes: list[str] = []
    links = [links_of(c, m, heard, notes) for c, m in nodes]
    try:
        for each in links:
            each.start()
        wait_for(
            "every node linked to both neighbours",
            lambda: [each.linked for each in links] == [{2, 1}, {0, 2}, {1, 0}],
            10,
        )
        links[1].close()  # as when node 1's agent exits: its kernel closes its ends
        time.sleep(1.0)
        threads = [t.name for t in threading.enumerate() if t.name.startswith("node-link")]
    finally:
        for each in links:
            each.close()
    assert heard == [] and notes == [], (heard, notes)
    # Node 1's links ended with it; nodes 0 and 2 still watch the link between them.
    assert sorted(threads) == ["node-link-dial", "node-link-handshake"], threads


def test_links_closed_while_waiting_for_a_neighbour_end_at_once_and_quietly(
    nodes: list[tuple[RendezvousClient, NodeMembership]],
) -> None:
    """A generation that fails before the next node published its address: the agent
    closes the links on its main thread, which must not wait on the address's wait."""
    heard: list[LinkSilent] = []
    notes: list[str] = []
    links = links_of(*nodes[0], heard, notes)
    links.start()
    wait_for("node 0 published", lambda: address_of(*nodes[1], 0) is not None)
    started = time.monotonic()
    links.close()
    assert time.monotonic() - started < 0.5
    wait_for(
        "its threads gone",
        lambda: not [t for t in threading.enumerate() if t.name.startswith("node-link")],
        5,
    )
    assert heard == [] and notes == [], (heard, notes)


def test_a_neighbour_closing_mid_handshake_is_no_warning_when_this_node_closes_too(
    nodes: list[tuple[RendezvousClient, NodeMembership]],
) -> None:
    """A neighbour whose generation ends while this node dials it closes the
    connection, as a stranger refusing the handshake would. This node hears of that end
    from the daemon at the same moment and closes its links: no warning then (once one
    in a full run, CI of 6ef4a94). Links still open LINK_SETTLE_S later do warn."""
    refusing = socket.create_server(("127.0.0.1", 0))
    accepted = threading.Event()

    def refuse() -> None:  # node 1, its generation ended: every handshake cut short
        while True:
            try:
                conn, _ = refusing.accept()
            except OSError:
                return
            conn.close()
            accepted.set()

    threading.Thread(target=refuse, daemon=True).start()
    node1 = attached(*nodes[1])
    entry = {"host": "127.0.0.1", "port": refusing.getsockname()[1], "name": "node1"}
    node1.kv_set("node-link/1", json.dumps(entry).encode())
    try:
        heard: list[LinkSilent] = []
        notes: list[str] = []
        ending = links_of(*nodes[0], heard, notes)
        ending.start()
        assert accepted.wait(10)
        time.sleep(0.5)  # the dial has failed by now
        ending.close()  # the daemon's word of the generation's end
        wait_for(
            "node 0's threads gone",
            lambda: not [t for t in threading.enumerate() if t.name == "node-link-dial"],
            5,
        )
        assert heard == [] and notes == [], (heard, notes)

        accepted.clear()
        staying = links_of(*nodes[0], heard, notes)
        staying.start()
        assert accepted.wait(10)
        refused = time.monotonic()
        wait_for("the warning", lambda: notes, LINK_SETTLE_S + 5)
        assert time.monotonic() - refused >= LINK_SETTLE_S - 0.1
        staying.close()
        assert heard == [] and len(notes) == 1, notes
        assert "link to node 1's agent is not watched" in notes[0], notes
    finally:
        refusing.close()
        node1.close()


class MiddleNode:
    """Node 1's links, started first, with strangers on its port (``connect``); then
    ``link_neighbours()`` starts nodes 0's and 2's. Used as a ``with`` block: everything
    is closed after it, and nothing may have been reported or noted meanwhile."""

    def __init__(self, nodes: list[tuple[RendezvousClient, NodeMembership]]) -> None:
        self.nodes = nodes
        self.heard: list[LinkSilent] = []
        self.notes: list[str] = []
        self.links = [links_of(*nodes[1], self.heard, self.notes)]
        self.strangers: list[socket.socket] = []

    def __enter__(self) -> MiddleNode:
        self.links[0].start()
        self.address = address_of(*self.nodes[0], 1)
        return self

    def connect(self) -> socket.socket:
        self.strangers.append(socket.create_connection(self.address, timeout=5))
        return self.strangers[-1]

    def link_neighbours(self) -> None:
        for n in (0, 2):
            self.links.append(links_of(*self.nodes[n], self.heard, self.notes))
            self.links[-1].start()
        # Every link up, not only node 1's: the strangers took none of them.
        wait_for(
            "every node linked to both neighbours",
            lambda: [each.linked for each in self.links] == [{0, 2}, {2, 1}, {1, 0}],
            10,
        )

    def __exit__(self, *exc: object) -> None:
        for s in self.strangers:
            s.close()
        for each in self.links:
            each.close()
        if exc[0] is None:
            assert self.heard == [] and self.notes == [], (self.heard, self.notes)


def test_a_stranger_on_a_nodes_port_neither_holds_nor_takes_its_link(
    nodes: list[tuple[RendezvousClient, NodeMembership]],
) -> None:
    with MiddleNode(nodes) as middle:
        # One says nothing (it would hold a one-at-a-time acceptor), one speaks garbage.
        middle.connect()
        garbage = middle.connect()
        garbage.sendall(b"\x00" * 200)
        middle.link_neighbours()
        # The garbage speaker was dropped without a word of its own from node 1.
        assert len(garbage.recv(100)) == 40  # the challenge
        try:
            rest = garbage.recv(100)
        except ConnectionResetError:  # closed with its unread garbage
            rest = b""
        assert rest == b""


def test_strangers_beyond_the_handshake_cap_are_closed_unread(
    nodes: list[tuple[RendezvousClient, NodeMembership]],
) -> None:
    """Each pending handshake holds a thread: past MAX_HANDSHAKES at once a connection
    is closed unread, so a flood cannot pile up threads; once the strangers go, the
    neighbours link as ever."""
    with MiddleNode(nodes) as middle:
        before = _handshake_threads()
        strangers = [middle.connect() for _ in range(MAX_HANDSHAKES + 8)]
        firsts = []
        for s in strangers:
            try:
                firsts.append(len(s.recv(100)))
            except ConnectionResetError:
                firsts.append(0)
        assert sorted(set(firsts)) == [0, 40] and firsts.count(40) == MAX_HANDSHAKES, firsts
        assert _handshake_threads() - before <= MAX_HANDSHAKES
        for s in strangers:
            s.close()
        middle.link_neighbours()


def _handshake_threads() -> int:
    return sum(t.name == "node-link-handshake" for t in threading.enumerate())


def test_a_one_node_job_links_to_no_one() -> None:
    node = NodeMembership("solo", 1, 0, 1, 8, None, b"\x01" * 128, 0, ("instance",))
    links = NodeLinks(
        _NoStore(),
        node,
        host="127.0.0.1",
        name="solo",
        on_silent=print,
        note=print,
        setup_timeout=1.0,
    )
    before = threading.active_count()
    links.start()
    assert threading.active_count() == before
    links.close()


def test_a_silent_link_is_reported_once_naming_the_node_its_ranks_and_an_escaped_name() -> None:
    """The report's words (the silence itself needs real hosts: tests/multihost). The
    neighbour's name comes from its entry, which a member wrote: shown escaped."""
    heard: list[LinkSilent] = []
    node = NodeMembership("j", 3, 0, 2, 4, None, b"\x01" * 128, 0, ("a", "b", "c", "d"))
    links = NodeLinks(
        _NoStore(), node, host="127.0.0.1", name="me", on_silent=heard.append, note=print,
        setup_timeout=1.0,
    )  # fmt: skip
    links._names[1] = "h2\x1b[31m\nforged line"
    links._silent(1, OSError(errno.ETIMEDOUT, "Connection timed out"))
    links._silent(1, OSError(errno.ETIMEDOUT, "Connection timed out"))  # the other link
    links._silent(1, TimeoutError("timed out"), connected=False)
    links.close()
    assert len(heard) == 1 and heard[0].generation == 3 and heard[0].connected
    cause = heard[0].cause
    assert cause.startswith(
        "lost the link to node 1 on h2\\x1b[31m\\x0aforged line (ranks 4-7): "
    ), cause
    assert "its host answered nothing for 10 s" in cause and "\n" not in cause


def test_a_link_that_never_connected_names_the_address_it_dialed() -> None:
    """An address the others cannot reach (a node's route to the daemon on a network
    the nodes do not share) reads like a cut unless the report says where it dialed."""
    heard: list[LinkSilent] = []
    node = NodeMembership("j", 1, 0, 2, 4, None, b"\x01" * 128, 0, ("a", "b", "c", "d"))
    links = NodeLinks(
        _NoStore(), node, host="127.0.0.1", name="me", on_silent=heard.append, note=print,
        setup_timeout=1.0,
    )  # fmt: skip
    links._names[1] = "n2"
    unreachable = OSError(errno.EHOSTUNREACH, os.strerror(errno.EHOSTUNREACH))
    links._silent(1, unreachable, connected=False, at="198.19.145.12:38153")
    links.close()
    assert [h.connected for h in heard] == [False]
    assert heard[0].cause == (
        "could not link to node 1 on n2 (ranks 4-7) at 198.19.145.12:38153: its host is "
        "unreachable (No route to host)"
    ), heard[0].cause


class _NoStore:
    def attach(self, membership: Membership, instance_id: str) -> None:
        pass

    def kv_set(self, key: str, value: bytes) -> None:
        raise AssertionError("a job of one node publishes no link")

    def kv_get(self, key: str, *, wait: bool = True, timeout: float | None = None) -> bytes:
        raise AssertionError("a job of one node reads no link")

    def close(self) -> None:
        pass


def test_no_node_link_watch_keeps_an_agent_from_opening_its_links(
    daemon: DaemonProcess, job_id: str, tmp_path: Path
) -> None:
    """``--no-node-link-watch`` (docs/trainer.md): two nodes of the nccl backend (a fake
    GPU, tests/trainer/fake_cupy), node 0 started with it, node 1 without. Node 1's
    agent publishes where its links listen (``node-link/1``, the one key either writes);
    node 0's never does, though its workers train as long (without the flag it wrote
    its own within milliseconds of node 1's: two keys)."""
    errs = [tmp_path / f"node{n}.err" for n in (0, 1)]
    nodes = []
    for n, flags in enumerate([["--no-node-link-watch"], []]):
        cmd = launcher_cmd(2, n, 1, endpoint=daemon.endpoint, token_file=daemon.token_file)
        # The fake GPU's launcher in place of ``-m rendezvousd.trainer.agent.launcher``.
        cmd = [cmd[0], *FAKE_GPU_LAUNCHER, *cmd[3:], "--job-id", job_id, "--backend", "nccl"]
        cmd += [*flags, str(WORKERS / "fake_nccl_worker.py")]
        with errs[n].open("w") as err:
            nodes.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err))
    try:
        steps = lambda: [m.step for m in members(daemon, job_id)]  # noqa: E731
        wait_for("both nodes to train", lambda: len(steps()) == 2 and min(steps()) >= 20, 60)
        with RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as probe:
            keys = lambda: probe.get_job().kv_keys  # noqa: E731
            wait_for("node 1 to publish its link", lambda: keys() >= 1, 30)
            published = keys()
    finally:
        for node in nodes:
            node.kill()
            node.wait(10)
    assert published == 1, [e.read_text()[-2000:] for e in errs]
