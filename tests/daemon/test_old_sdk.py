"""An SDK from before member instance ids (2026-12-01) sends its instance id in its Join
only: its later calls (a barrier, a key) name none and are refused DUPLICATE_RANK, and
its worker fails on that. The daemon said nothing, and its peers read "heartbeat stream
closed" (or a silence): the daemon now says it once per job, naming the host, and the
member's loss says why."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client import Membership, PeerFailed, RendezvousClient, RendezvousError
from rendezvousd.common.model import JobState, Warn
from rendezvousd.errors import RendezvousFault
from rendezvousd.state.machine import JoinArgs, RendezvousState
from tests.daemon.raw_calls import bearer, raw, reason_of
from tests.support import DaemonProcess, members, parallel, wait_for

ID = b"\x01" * 128


def formed(sm: RendezvousState) -> list[int]:
    """A running job of two workers on hosts h0 and h1, both beating; their tokens."""
    for rank in (0, 1):
        joined = JoinArgs.worker(
            "j", 2, 1, rank, 0, f"h{rank}", "", ID if rank == 0 else b"", f"w{rank}"
        )
        sm.join(joined, 0.0)
    assert sm.jobs["j"].state is JobState.RUNNING
    tokens = [
        sm.attach_stream("j", 1, rank, f"w{rank}", 0.0, connection=CONNECTIONS[rank])
        for rank in (0, 1)
    ]
    sm.take_effects()
    return tokens


# The gRPC peers of the two workers' connections (their heartbeat streams').
CONNECTIONS = ("ipv4:10.0.0.1:40000", "ipv4:10.0.0.2:40001")


def refused_without_id(sm: RendezvousState, connection: str = CONNECTIONS[1]) -> RendezvousFault:
    """Rank 1's barrier without an instance id, over ``connection`` (its own by default:
    an old SDK's)."""
    with pytest.raises(RendezvousFault) as info:
        sm.barrier("j", 1, 1, "b", 1, 1.0, instance_id="", connection=connection)
    return info.value


def test_a_call_without_instance_id_is_said_once_per_job_naming_the_host() -> None:
    sm = RendezvousState()
    formed(sm)
    fault = refused_without_id(sm)
    assert fault.reason == "DUPLICATE_RANK" and "the call names no instance_id" in fault.message
    said = [e for e in sm.take_effects() if isinstance(e, Warn)]
    assert len(said) == 1, said
    assert (said[0].job_id, said[0].generation) == ("j", 1)
    assert "rank 1 on host 'h1' made a call without an instance_id" in said[0].message
    assert "an SDK from before member instance ids (2026-12-01)" in said[0].message
    assert "upgrade the rendezvousd SDK on 'h1'" in said[0].message
    refused_without_id(sm)  # its next refusal is not said again
    assert not [e for e in sm.take_effects() if isinstance(e, Warn)]


def test_its_loss_is_worded_as_an_old_sdk_not_a_closed_stream() -> None:
    sm = RendezvousState()
    tokens = formed(sm)
    refused_without_id(sm)
    sm.detach_stream("j", 1, 1, tokens[1], 1.5)  # its worker failed on the refusal
    job = sm.jobs["j"]
    assert job.state is JobState.FAILED
    cause = job.gen.failed[0].cause
    assert cause.startswith("an SDK from before member instance ids (2026-12-01): upgrade it")
    assert cause.endswith("upgrade it (heartbeat stream closed)"), cause


def test_a_silent_old_sdk_worker_is_worded_so_too() -> None:
    sm = RendezvousState()
    formed(sm)
    refused_without_id(sm)
    sm.heartbeat("j", 1, 0, 5.0)
    sm.tick(sm.timing.heartbeat_timeout_s + 1.0)
    cause = sm.jobs["j"].gen.failed[0].cause
    assert cause.startswith("an SDK from before member instance ids (2026-12-01): upgrade it")
    assert "no heartbeat for" in cause, cause


@pytest.mark.parametrize(
    "connection",
    [
        "ipv4:10.0.0.9:50000",  # another host
        "ipv4:10.0.0.2:50000",  # another process of rank 1's host
        CONNECTIONS[0],  # another member's
        "",  # not known
    ],
)
def test_a_call_over_another_connection_marks_nothing(connection: str) -> None:
    """Any holder of the job's token can name rank 1 without an instance id: refused as
    an old SDK's call is, but only a call over rank 1's own connection is its SDK's."""
    sm = RendezvousState()
    tokens = formed(sm)
    fault = refused_without_id(sm, connection)
    assert fault.reason == "DUPLICATE_RANK"
    assert not [e for e in sm.take_effects() if isinstance(e, Warn)]
    sm.detach_stream("j", 1, 1, tokens[1], 1.5)
    assert sm.jobs["j"].gen.failed[0].cause == "heartbeat stream closed"


def test_a_call_after_its_stream_closed_marks_nothing() -> None:
    """Its connection is known only while its heartbeat stream is open: once the stream
    ended, a call from that address says nothing of the member."""
    sm = RendezvousState()
    tokens = formed(sm)
    sm.leave("j", 1, 1, "w1", 1.0)  # ends the generation: its members' calls go on
    sm.detach_stream("j", 1, 1, tokens[1], 1.2)
    with pytest.raises(RendezvousFault):
        sm.member_table("j", 1, 1, "", connection=CONNECTIONS[1])
    assert not sm.jobs["j"].gen.members[1].without_instance_id
    assert not [e for e in sm.take_effects() if isinstance(e, Warn)]


def test_a_closed_stream_of_a_current_sdk_is_worded_as_before() -> None:
    sm = RendezvousState()
    tokens = formed(sm)
    sm.detach_stream("j", 1, 1, tokens[1], 1.5)
    assert sm.jobs["j"].gen.failed[0].cause == "heartbeat stream closed"


def barrier_without_id(channel: grpc.Channel, daemon: DaemonProcess, seat: Membership) -> None:
    """What an old SDK's barrier sends for ``seat``: its rank, no instance id."""
    barrier = pb.BarrierRequest(
        job_id=seat.job_id, generation=seat.generation, rank=seat.rank, name="b", sequence=1
    )
    refused = raw(channel, "Barrier", barrier.SerializeToString(), bearer(daemon))
    assert refused is not None and reason_of(refused)[0] == "DUPLICATE_RANK"


def lost_after(
    daemon: DaemonProcess, job_id: str, forged: Callable[[RendezvousClient, Membership], None]
) -> str:
    """Two workers join and beat, ``forged`` makes its call about rank 1 (its client and
    seat), then rank 1's worker fails: the loss rank 0 hears."""
    clients = [RendezvousClient(daemon.endpoint, job_id, token=daemon.token) for _ in range(2)]
    try:
        joined = parallel(
            [
                lambda i=i: clients[i].join(  # type: ignore[misc]
                    num_nodes=2, gpus_per_node=1, node_rank=i, local_rank=0, host=f"host-{i}"
                )
                for i in range(2)
            ]
        )
        heard: list[RendezvousError] = []
        clients[0].start_heartbeat(0.2, on_failure=heard.append)
        clients[1].start_heartbeat(0.2)
        # The daemon tells a member's own connection by its heartbeat stream's peer: a
        # call before the stream is attached is no call of its connection.
        wait_for(
            "both heartbeat streams",
            lambda: sum(m.heartbeat_stream_open for m in members(daemon, job_id)) == 2,
        )
        forged(clients[1], joined[1])
        clients[1].close()  # its worker failed (on the refusal, for an old SDK)
        wait_for("rank 0 to hear of the loss", lambda: bool(heard))
    finally:
        for c in clients:
            c.close()
    assert isinstance(heard[0], PeerFailed), heard
    return heard[0].failed[0].cause


def test_the_daemon_logs_it_and_the_peers_hear_it(daemon: DaemonProcess, job_id: str) -> None:
    """End to end: the second worker's Join and heartbeat carry its instance id, its
    barrier none, on the one connection its heartbeat stream rides (what such an SDK
    sends, over the real wire: its one channel)."""

    def old_sdk(client: RendezvousClient, seat: Membership) -> None:
        barrier_without_id(client._channel, daemon, seat)

    cause = lost_after(daemon, job_id, old_sdk)
    assert cause.startswith("an SDK from before member instance ids (2026-12-01): upgrade it")
    log = daemon.log()
    said = f"WARNING rendezvousd: job {job_id} generation 1: rank 1 on host 'host-1' made a call"
    assert said in log, log
    assert log.count(f"job {job_id} generation 1: rank 1 on host 'host-1'") == 1


def test_a_token_holder_cannot_mark_a_member_as_an_old_sdk(
    daemon: DaemonProcess, job_id: str
) -> None:
    """A holder of the job's token that is no member names rank 1 with no instance id,
    from a connection of its own: refused as before, but rank 1 is not marked, so its
    later loss reads as what it was and no upgrade warning names its host."""

    def forger(client: RendezvousClient, seat: Membership) -> None:
        with grpc.insecure_channel(daemon.endpoint) as channel:
            barrier_without_id(channel, daemon, seat)

    cause = lost_after(daemon, job_id, forger)
    assert cause == "heartbeat stream closed", cause
    assert f"job {job_id} generation 1: rank 1 on host 'host-1'" not in daemon.log()
