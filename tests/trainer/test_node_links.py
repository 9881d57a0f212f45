"""The node agents' links (``node_links``) over a real daemon's key-value store, on
loopback: who links to whom, what is not a cut, and that no one else can take a
node's link. The cut itself (a host that goes silent) needs real hosts:
tests/multihost/test_faults.py."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from rendezvousd.client import NodeMembership, RendezvousClient
from rendezvousd.trainer.agent.node_links import MAX_HANDSHAKES, LinkSilent, NodeLinks
from tests.support import DaemonProcess, parallel, wait_for


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
    member = RendezvousClient(client.endpoint, m.job_id, token=client._s.token)
    member.attach(m.membership_for(0), m.member_instance_id(0))
    return member


def links_of(
    client: RendezvousClient, m: NodeMembership, heard: list[LinkSilent], notes: list[str]
) -> NodeLinks:
    """As the node agent makes them: the store a client of their own, attached as the
    node's first rank."""
    return NodeLinks(
        attached(client, m),
        generation=m.generation,
        node_rank=m.node_rank,
        num_nodes=m.num_nodes,
        gpus_per_node=m.gpus_per_node,
        secret=m.unique_id,
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


def test_a_stranger_on_a_nodes_port_neither_holds_nor_takes_its_link(
    nodes: list[tuple[RendezvousClient, NodeMembership]],
) -> None:
    heard: list[LinkSilent] = []
    notes: list[str] = []
    (c0, m0), (c1, m1), (c2, m2) = nodes
    node1 = links_of(c1, m1, heard, notes)
    others: list[NodeLinks] = []
    strangers: list[socket.socket] = []
    try:
        node1.start()
        reader = attached(c0, m0)
        try:
            entry = json.loads(reader.kv_get("node-link/1", timeout=10))
        finally:
            reader.close()  # not leave(): the member is node 0's first rank
        address = (entry["host"], entry["port"])
        # One says nothing (it would hold a one-at-a-time acceptor), one speaks garbage.
        strangers = [socket.create_connection(address, timeout=5) for _ in range(2)]
        strangers[1].sendall(b"\x00" * 200)
        others = [links_of(c, m, heard, notes) for c, m in [(c0, m0), (c2, m2)]]
        for each in others:
            each.start()
        wait_for("node 1 linked to both neighbours", lambda: node1.linked == {0, 2}, 10)
        # The garbage speaker was dropped without a word of its own from node 1.
        strangers[1].settimeout(5)
        assert len(strangers[1].recv(100)) == 40  # the challenge
        try:
            rest = strangers[1].recv(100)
        except ConnectionResetError:  # closed with its unread garbage
            rest = b""
        assert rest == b""
    finally:
        for s in strangers:
            s.close()
        node1.close()
        for each in others:
            each.close()
    assert heard == [] and notes == [], (heard, notes)


def test_strangers_beyond_the_handshake_cap_are_closed_unread(
    nodes: list[tuple[RendezvousClient, NodeMembership]],
) -> None:
    """Each pending handshake holds a thread: past MAX_HANDSHAKES at once a connection
    is closed unread, so a flood cannot pile up threads; once the strangers go, the
    neighbours link as ever."""
    heard: list[LinkSilent] = []
    notes: list[str] = []
    (c0, m0), (c1, m1), (c2, m2) = nodes
    node1 = links_of(c1, m1, heard, notes)
    others: list[NodeLinks] = []
    strangers: list[socket.socket] = []
    try:
        node1.start()
        reader = attached(c0, m0)
        try:
            entry = json.loads(reader.kv_get("node-link/1", timeout=10))
        finally:
            reader.close()
        before = _handshake_threads()
        for _ in range(MAX_HANDSHAKES + 8):
            strangers.append(socket.create_connection((entry["host"], entry["port"]), timeout=5))
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
        others = [links_of(c, m, heard, notes) for c, m in [(c0, m0), (c2, m2)]]
        for each in others:
            each.start()
        wait_for("node 1 linked to both neighbours", lambda: node1.linked == {0, 2}, 10)
    finally:
        for s in strangers:
            s.close()
        node1.close()
        for each in others:
            each.close()
    assert heard == [] and notes == [], (heard, notes)


def _handshake_threads() -> int:
    return sum(t.name == "node-link-handshake" for t in threading.enumerate())


def test_a_one_node_job_links_to_no_one() -> None:
    heard: list[LinkSilent] = []
    links = NodeLinks(
        _NoStore(),
        generation=1,
        node_rank=0,
        num_nodes=1,
        gpus_per_node=8,
        secret=b"\x01" * 128,
        host="127.0.0.1",
        name="solo",
        on_silent=heard.append,
        note=print,
        setup_timeout=1.0,
    )
    before = threading.active_count()
    links.start()
    assert threading.active_count() == before
    links.close()


class _NoStore:
    def kv_set(self, key: str, value: bytes) -> None:
        raise AssertionError("a job of one node publishes no link")

    def kv_get(self, key: str, *, wait: bool = True, timeout: float | None = None) -> bytes:
        raise AssertionError("a job of one node reads no link")

    def close(self) -> None:
        pass
