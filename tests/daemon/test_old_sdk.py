"""An SDK from before member instance ids (2026-12-01) sends its instance id in its Join
only: its later calls (a barrier, a key) name none and are refused DUPLICATE_RANK, and
its worker fails on that. The daemon said nothing, and its peers read "heartbeat stream
closed" (or a silence): the daemon now says it once per job, naming the host, and the
member's loss says why."""

from __future__ import annotations

import grpc
import pytest

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client import PeerFailed, RendezvousClient, RendezvousError
from rendezvousd.common.model import JobState, Warn
from rendezvousd.errors import RendezvousFault
from rendezvousd.state.machine import JoinArgs, RendezvousState
from tests.daemon.raw_calls import bearer, raw, reason_of
from tests.support import DaemonProcess, parallel, wait_for

ID = b"\x01" * 128


def formed(sm: RendezvousState) -> list[int]:
    """A running job of two workers on hosts h0 and h1, both beating; their tokens."""
    for rank in (0, 1):
        joined = JoinArgs.worker(
            "j", 2, 1, rank, 0, f"h{rank}", "", ID if rank == 0 else b"", f"w{rank}"
        )
        sm.join(joined, 0.0)
    assert sm.jobs["j"].state is JobState.RUNNING
    tokens = [sm.attach_stream("j", 1, rank, f"w{rank}", 0.0) for rank in (0, 1)]
    sm.take_effects()
    return tokens


def refused_without_id(sm: RendezvousState) -> RendezvousFault:
    with pytest.raises(RendezvousFault) as info:
        sm.barrier("j", 1, 1, "b", 1, 1.0, instance_id="")
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


def test_a_closed_stream_of_a_current_sdk_is_worded_as_before() -> None:
    sm = RendezvousState()
    tokens = formed(sm)
    sm.detach_stream("j", 1, 1, tokens[1], 1.5)
    assert sm.jobs["j"].gen.failed[0].cause == "heartbeat stream closed"


def test_the_daemon_logs_it_and_the_peers_hear_it(daemon: DaemonProcess, job_id: str) -> None:
    """End to end: the second worker's Join and heartbeat carry its instance id, its
    barrier none (what such an SDK sends, over the real wire)."""
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
        old = joined[1]
        with grpc.insecure_channel(daemon.endpoint) as channel:
            barrier = pb.BarrierRequest(
                job_id=job_id, generation=old.generation, rank=old.rank, name="b", sequence=1
            )
            refused = raw(channel, "Barrier", barrier.SerializeToString(), bearer(daemon))
        assert refused is not None and reason_of(refused)[0] == "DUPLICATE_RANK"
        clients[1].close()  # its worker failed on the refusal
        wait_for("rank 0 to hear of the loss", lambda: bool(heard))
    finally:
        for c in clients:
            c.close()
    assert isinstance(heard[0], PeerFailed), heard
    cause = heard[0].failed[0].cause
    assert cause.startswith("an SDK from before member instance ids (2026-12-01): upgrade it")
    log = daemon.log()
    said = f"WARNING rendezvousd: job {job_id} generation 1: rank 1 on host 'host-1' made a call"
    assert said in log, log
    assert log.count(f"job {job_id} generation 1: rank 1 on host 'host-1'") == 1
