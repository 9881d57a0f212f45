"""Calls relayed through a node agent (``client.relay``), against a real daemon: a
node's workers make their calls on the agent's stream and get the answers, errors,
deadlines and cancellations they get on their own; the daemon sees their bursts
as messages of several calls; a worker gone, or a link gone, leaves nothing behind.

The link is the test's: in-process functions in place of rendezvous-run's agent
channel (whose "call"/"reply" frames tests/trainer/test_launcher.py covers)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from google.rpc import status_pb2

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client import (
    AsyncRendezvousClient,
    NodeMembership,
    RendezvousClient,
    RendezvousError,
    RendezvousTimeout,
)
from rendezvousd.client._calls import diagnosis_share
from rendezvousd.client._session import SLACK_S
from rendezvousd.client.relay import RelayedCalls, RelayEnd
from tests.support import DaemonProcess, scrape, wait_for

GPUS = 8


def _parked(d: DaemonProcess) -> float:
    return scrape(d.metrics_url)["rendezvousd_waiters"]


def _per_message(d: DaemonProcess) -> tuple[float, float]:
    """(calls, messages) the daemon read on CallBatches streams so far."""
    m = scrape(d.metrics_url)
    return m["rendezvousd_calls_per_message_sum"], m["rendezvousd_calls_per_message_count"]


class Node:
    """An agent client that joined a one-node job of GPUS ranks, and its workers,
    each attached to its rank and relayed through the agent."""

    def __init__(self, d: DaemonProcess, job_id: str) -> None:
        self.agent = RendezvousClient(d.endpoint, job_id, token=d.token)
        self.m = self.agent.join_node(
            min_nodes=1, max_nodes=1, gpus_per_node=GPUS, node_rank=0, host="h0", timeout=20
        )
        self.ends: list[RelayEnd] = []
        self.relayed: list[RelayedCalls] = []
        self.workers: list[RendezvousClient] = []
        self.links_up = [True] * GPUS
        for local in range(GPUS):
            w = RendezvousClient(d.endpoint, job_id, token=d.token)
            w.attach(self.m.membership_for(local), self.m.member_instance_id(local))
            self.workers.append(w)
            self._link(local, w)

    def _link(self, local: int, w: RendezvousClient) -> None:
        box: list[RelayedCalls] = []
        end = self.agent.relay_end(lambda reply: box[0].deliver(reply))
        assert end is not None

        def send(call: bytes) -> None:
            if not self.links_up[local]:
                raise ConnectionError("the agent went away")
            end.forward(call)

        box.append(w.relay_through(send))
        self.ends.append(end)
        self.relayed.append(box[0])

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.agent.close()


@pytest.fixture
def node(daemon: DaemonProcess, job_id: str) -> Iterator[Node]:
    n = Node(daemon, job_id)
    yield n
    n.close()


def each(node: Node, work: Callable[[int, RendezvousClient], Any]) -> list[Any]:
    with ThreadPoolExecutor(GPUS) as pool:
        return list(pool.map(work, range(GPUS), node.workers))


async def _async_node(
    d: DaemonProcess, job_id: str, gpus: int
) -> tuple[AsyncRendezvousClient, NodeMembership]:
    """An asyncio agent that joined a one-node job of ``gpus`` ranks."""
    agent = AsyncRendezvousClient(d.endpoint, job_id, token=d.token)
    m = await agent.join_node(
        min_nodes=1, max_nodes=1, gpus_per_node=gpus, node_rank=0, host="h0", timeout=20
    )
    return agent, m


def test_workers_exchange_keys_and_meet_in_barriers_through_their_agent(
    daemon: DaemonProcess, node: Node
) -> None:
    def work(i: int, w: RendezvousClient) -> bytes:
        w.kv_set(f"addr{i}", f"10.0.0.{i}".encode())
        w.barrier("up", timeout=20)
        return w.kv_get(f"addr{(i + 1) % GPUS}", timeout=20)

    assert each(node, work) == [f"10.0.0.{(i + 1) % GPUS}".encode() for i in range(GPUS)]
    # Every call went on the agent's one stream, none on a worker's own.
    agent_sent = node.agent._mux.sent  # type: ignore[union-attr]
    assert agent_sent["KvSet"] == agent_sent["Barrier"] == agent_sent["KvGet"] == GPUS
    assert all(r.sent["Barrier"] == 1 for r in node.relayed)
    assert [r.unary for r in node.relayed] == [False] * GPUS
    assert [w.call_route for w in node.workers] == ["relayed"] * GPUS
    assert node.agent.call_route == "stream"


def test_a_nodes_burst_reaches_the_daemon_as_messages_of_several_calls(
    daemon: DaemonProcess, node: Node
) -> None:
    """What the relay is for. Whether a burst shares a message depends on thread
    timing, so rounds repeat until one did; without batching none ever can."""
    node.workers[0].kv_set("k", b"v")
    calls0, messages0 = _per_message(daemon)
    for _ in range(50):
        each(node, lambda _i, w: w.kv_get("k", timeout=20))
        calls, messages = _per_message(daemon)
        if calls - calls0 > messages - messages0:
            return
    raise AssertionError(f"{calls - calls0:.0f} calls came in {messages - messages0:.0f} messages")


def test_a_relayed_calls_error_is_the_error_of_a_call_of_its_own(
    daemon: DaemonProcess, node: Node, job_id: str
) -> None:
    with RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as direct:
        direct.attach(node.m.membership_for(1), node.m.member_instance_id(1))
        with pytest.raises(RendezvousError) as own:
            direct.kv_get("missing", wait=False)
    with pytest.raises(RendezvousError) as relayed:
        node.workers[1].kv_get("missing", wait=False)
    assert type(relayed.value) is type(own.value)
    assert str(relayed.value) == str(own.value)
    assert relayed.value.code == own.value.code


def test_a_relayed_calls_deadline_cancels_its_wait_on_the_daemon(
    daemon: DaemonProcess, node: Node
) -> None:
    before = _parked(daemon)
    with pytest.raises(RendezvousTimeout):
        node.workers[2].kv_get("never", timeout=1.0)
    wait_for("the relayed wait released", lambda: _parked(daemon) == before)


def test_a_worker_gone_has_its_parked_calls_cancelled(daemon: DaemonProcess, node: Node) -> None:
    before = _parked(daemon)

    def wait() -> None:
        with pytest.raises(RendezvousError):
            node.workers[3].kv_get("never", timeout=30)

    waiting = threading.Thread(target=wait, daemon=True)
    waiting.start()
    wait_for("the relayed wait parked", lambda: _parked(daemon) == before + 1)
    node.ends[3].close()  # what the agent does when the worker's channel ends
    wait_for("the dead worker's wait released", lambda: _parked(daemon) == before)


def test_a_worker_whose_agent_is_gone_calls_the_daemon_itself(
    daemon: DaemonProcess, node: Node
) -> None:
    node.links_up[4] = False
    node.workers[4].kv_set("after", b"agent")
    assert node.workers[4].kv_get("after", wait=False) == b"agent"
    assert node.agent._mux.sent["KvSet"] == 0  # type: ignore[union-attr]
    assert node.workers[4].call_route == "unary"


def test_a_relay_link_that_ends_fails_its_calls_in_flight_over_to_the_worker(
    daemon: DaemonProcess, node: Node
) -> None:
    """The link ends (the agent died) under a parked call: the call fails over as a
    broken stream's does (UNAVAILABLE, retried) and is made on the worker's own
    channel, where the key then arrives."""
    result: list[bytes] = []
    waiting = threading.Thread(
        target=lambda: result.append(node.workers[5].kv_get("late", timeout=30)), daemon=True
    )
    before = _parked(daemon)
    waiting.start()
    wait_for("the relayed wait parked", lambda: _parked(daemon) == before + 1)
    node.links_up[5] = False
    node.relayed[5].end()
    node.ends[5].close()
    wait_for("the wait re-made by the worker", lambda: _parked(daemon) == before + 1)
    node.workers[6].kv_set("late", b"here")
    waiting.join(20)
    assert result == [b"here"]


def test_an_agent_without_a_call_stream_relays_nothing(daemon: DaemonProcess, job_id: str) -> None:
    with RendezvousClient(daemon.endpoint, job_id, token=daemon.token, call_stream=False) as c:
        assert c.relay_end(lambda _reply: None) is None
        assert c.call_route == "unary"


async def test_asyncio_workers_relay_through_an_asyncio_agent(
    daemon: DaemonProcess, job_id: str
) -> None:
    agent, m = await _async_node(daemon, job_id, 4)
    workers = []
    for local in range(4):
        w = AsyncRendezvousClient(daemon.endpoint, job_id, token=daemon.token)
        w.attach(m.membership_for(local), m.member_instance_id(local))
        box: list[Any] = []
        end = agent.relay_end(lambda reply, box=box: box[0].deliver(reply))
        assert end is not None
        box.append(w.relay_through(end.forward))
        workers.append(w)

    async def work(i: int, w: AsyncRendezvousClient) -> bytes:
        await w.kv_set(f"a{i}", bytes([i]))
        await w.barrier("up", timeout=20)
        return await w.kv_get(f"a{(i + 1) % 4}", timeout=20)

    try:
        got = await asyncio.gather(*[work(i, w) for i, w in enumerate(workers)])
        assert got == [bytes([(i + 1) % 4]) for i in range(4)]
        assert agent._mux.sent["Barrier"] == 4  # type: ignore[union-attr]
        with pytest.raises(RendezvousTimeout):
            await workers[0].kv_get("never", timeout=1.0)
    finally:
        for w in workers:
            await w.close()
        await agent.close()


def test_the_agents_end_refuses_what_its_worker_should_not_send(
    daemon: DaemonProcess, node: Node
) -> None:
    """A Call with no request, no deadline, or the id of one in flight is answered
    INVALID_ARGUMENT, naming why; after close() (the worker went) every Call is."""
    replies: list[pb.Reply] = []
    end = node.agent.relay_end(lambda data: replies.append(pb.Reply.FromString(data)))
    assert end is not None
    member = node.m.membership_for(0)
    wait = pb.KvGetRequest(
        job_id=member.job_id,
        generation=member.generation,
        rank=member.rank,
        instance_id=node.m.member_instance_id(0),
        key="never",
        wait=True,
    )
    end.forward(pb.Call(id=1, timeout_ms=1000).SerializeToString())
    end.forward(pb.Call(id=2, kv_get=wait).SerializeToString())
    before = _parked(daemon)
    end.forward(pb.Call(id=3, timeout_ms=30_000, kv_get=wait).SerializeToString())
    wait_for("the relayed wait parked", lambda: _parked(daemon) == before + 1)
    end.forward(pb.Call(id=3, timeout_ms=30_000, kv_get=wait).SerializeToString())
    end.close()
    wait_for("the closed end's wait released", lambda: _parked(daemon) == before)
    end.forward(pb.Call(id=4, timeout_ms=1000, kv_get=wait).SerializeToString())
    said = {r.id: status_pb2.Status.FromString(r.error) for r in replies}
    assert sorted(said) == [1, 2, 3, 4]
    assert {s.code for s in said.values()} == {grpc.StatusCode.INVALID_ARGUMENT.value[0]}
    assert "sets no request field" in said[1].message
    assert "has no deadline" in said[2].message
    assert "already in flight" in said[3].message
    assert "relay is closed" in said[4].message


async def test_a_cancelled_asyncio_workers_relayed_wait_is_cancelled_on_the_daemon(
    daemon: DaemonProcess, job_id: str
) -> None:
    """A worker's task cancelled under a parked relayed call (a training loop torn
    down, a wait_for around it) tells its agent, which cancels the call on its stream:
    the daemon's parked wait goes at once, not at its 60 s wait."""
    agent, m = await _async_node(daemon, job_id, 1)
    worker = AsyncRendezvousClient(daemon.endpoint, job_id, token=daemon.token)
    worker.attach(m.membership_for(0), m.member_instance_id(0))
    box: list[Any] = []
    end = agent.relay_end(lambda reply: box[0].deliver(reply))
    assert end is not None
    box.append(worker.relay_through(end.forward))
    try:
        before = _parked(daemon)
        waiting = asyncio.create_task(worker.kv_get("never", timeout=60))
        while _parked(daemon) != before + 1:
            await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        loop = asyncio.get_running_loop()
        released_by = loop.time() + 10
        while _parked(daemon) != before and loop.time() < released_by:
            await asyncio.sleep(0.05)
        assert _parked(daemon) == before, "the cancelled worker's wait is still parked"
        # The relay goes on serving the worker.
        await worker.kv_set("after", b"cancel")
        assert await worker.kv_get("after", wait=False) == b"cancel"
        assert worker.call_route == "relayed"
    finally:
        await worker.close()
        await agent.close()


def test_a_worker_whose_agent_never_answers_fails_over_to_its_own_channel(
    daemon: DaemonProcess, node: Node, job_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An agent that takes the worker's calls and answers none (stalled, or its stream
    stuck): at the call's own deadline (the daemon's wait plus the SDK's slack) the
    agent is told to cancel it, the call is re-made on the worker's own channel (the
    retry policy's one retry), and so are later calls. Before, the retry went through
    the stuck agent too, and the worker heard "is the daemon running and reachable?"
    after twice the deadline while the daemon was fine."""
    node.agent.start_heartbeat()  # the job must outlive the deadline (seconds)
    sent: list[pb.Call] = []
    w = node.workers[7]
    relayed = w.relay_through(lambda data: sent.append(pb.Call.FromString(data)))
    node.workers[6].kv_set("ready", b"yes")
    started = time.monotonic()
    assert w.kv_get("ready", timeout=0.5) == b"yes"
    took = time.monotonic() - started
    # The stall is told at the wire's deadline: the call's, less the share kept for
    # the look at why no answer came (half of which the re-make then gets).
    limit = 0.5 + SLACK_S
    assert limit - diagnosis_share(limit) <= took <= limit + 5, took
    asked, told = sent
    assert asked.WhichOneof("request") == "kv_get"
    assert told.WhichOneof("request") == "cancel" and told.id == asked.id
    assert w.call_route == "unary"
    w.kv_set("later", b"own")  # made on its own channel, not through the stuck agent
    assert len(sent) == 2
    said = [r.getMessage() for r in caplog.records if "through the node agent" in r.getMessage()]
    assert len(said) == 1, said  # an operator hears of the stuck agent, once
    # Of which worker and call: it said "relayed daemon call 1: ...", no job or rank.
    assert said[0].startswith(
        f"job {job_id!r} rank 7: relayed KvGet (call {asked.id}): no answer "
        "through the node agent within the call's deadline"
    ), said
    assert said[0].endswith("this worker makes its calls on its own channel from now on")
    assert not relayed.pending.drop(asked.id)  # nothing of it is left in flight


async def test_an_asyncio_worker_whose_agent_never_answers_fails_over_too(
    daemon: DaemonProcess, job_id: str
) -> None:
    """The same for an asyncio worker; and a call the retry policy does not re-make
    (a KvAdd may have run) says that the agent did not answer, not the daemon."""
    agent, m = await _async_node(daemon, job_id, 1)
    agent.start_heartbeat()
    worker = AsyncRendezvousClient(daemon.endpoint, job_id, token=daemon.token, call_timeout=1.0)
    worker.attach(m.membership_for(0), m.member_instance_id(0))
    sent: list[pb.Call] = []
    worker.relay_through(lambda data: sent.append(pb.Call.FromString(data)))
    try:
        with pytest.raises(RendezvousTimeout) as stalled:
            await worker.kv_add("n", 1)
        assert "no answer through the node agent" in str(stalled.value)
        assert stalled.value.reason == "RELAY_STALLED"
        assert [c.WhichOneof("request") for c in sent] == ["kv_add", "cancel"]
        assert worker.call_route == "unary"
        await worker.kv_set("k", b"v")  # on its own channel
        assert await worker.kv_get("k", wait=False) == b"v"
        assert len(sent) == 2
    finally:
        await worker.close()
        await agent.close()
