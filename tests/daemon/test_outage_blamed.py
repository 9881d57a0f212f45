"""A daemon SIGKILLed and restarted with its --state-dir after more than the heartbeat
timeout: every node agent gave up on it meanwhile (DaemonUnreachable), stopped its
workers and joins again. The restored generation fails for the daemon's own outage,
said so in its log line and ``status``'s last failure; before, the
first node back was named its cause ("rank 1 on host-b (its node agent left this
generation and joined again ...)"), a healthy node blamed for the daemon's outage."""

from __future__ import annotations

import time
from pathlib import Path

import grpc

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from rendezvousd.common.model import JobState, Transition
from rendezvousd.state.machine import RendezvousState
from rendezvousd.storage import snapshot
from tests.daemon.test_node_state import node
from tests.daemon.test_standby import running_pair
from tests.support import free_port, spawn_daemon, wait_for, write_token

TIMEOUT_S = 2.0


def _request(inst: str, host: str, previous: str, uid: bytes = b"") -> pb.JoinNodeRequest:
    return pb.JoinNodeRequest(
        job_id="j1", min_nodes=2, max_nodes=2, gpus_per_node=1, host=host,
        instance_id=inst, wait_timeout_ms=20_000, unique_id=uid,
        previous_instance_id=previous,
    )  # fmt: skip


def test_a_generation_ended_by_the_daemons_own_outage_blames_no_node(tmp_path: Path) -> None:
    port = free_port()
    token = write_token(tmp_path / "tok")
    flags = ("--state-dir", str(tmp_path / "state"), "--heartbeat-timeout-s", f"{TIMEOUT_S:g}")
    d = spawn_daemon(tmp_path, *flags, token=token, listen=f"127.0.0.1:{port}")
    md = [("authorization", f"Bearer {token}")]
    with grpc.insecure_channel(d.endpoint) as channel:
        stub = pb_grpc.RendezvousStub(channel)
        assert stub.JoinNode(_request("a", "host-a", ""), metadata=md, timeout=30).id_required
        a = stub.JoinNode.future(_request("a", "host-a", "", b"\x01" * 128), metadata=md)
        b = stub.JoinNode(_request("b", "host-b", ""), metadata=md, timeout=30)
        assert a.result(30).generation == b.generation == 1
    d.kill()  # SIGKILL: no drain
    down_from = time.monotonic()
    # Down longer than the nodes' reconnect window (the heartbeat timeout): a measured
    # outage, the case itself, not a synchronisation.
    time.sleep(TIMEOUT_S + 1.0)
    d2 = spawn_daemon(tmp_path, *flags, token=token, listen=f"127.0.0.1:{port}")
    try:
        down = time.monotonic() - down_from
        restore = next(line for line in d2.log().splitlines() if "restored 1 job(s)" in line)
        said = float(restore.split("the daemon was down ")[1].split(" s")[0])
        # The file's mtime is marked once a tick (at most a second apart here).
        assert TIMEOUT_S < said <= down + 1.0, restore
        assert "restored after the daemon was down" in d2.log()
        with grpc.insecure_channel(d2.endpoint) as channel:
            stub = pb_grpc.RendezvousStub(channel)
            # Node b's agent, back first, joins again naming the seat it gave up.
            b2 = stub.JoinNode.future(_request("b2", "host-b", "b"), metadata=md)
            wait_for(
                "generation 1 to fail",
                lambda: "RUNNING -> FAILED" in d2.log(),
            )
            job = stub.GetJob(pb.GetJobRequest(job_id="j1"), metadata=md, timeout=10)
            b2.cancel()
        failed = next(line for line in d2.log().splitlines() if "RUNNING -> FAILED" in line)
        assert "the daemon was down" in failed and "host-b" not in failed, failed
        cause = job.last_failure.cause
        assert job.last_failure.generation == 1
        assert cause.startswith("the daemon was down"), cause
        assert f"longer than the nodes' {TIMEOUT_S:g} s reconnect window" in cause, cause
        assert "host-" not in cause and "rank" not in cause, cause
    finally:
        d2.kill()


def test_the_restored_generation_fails_for_the_outage_and_keeps_the_other_nodes_seats() -> None:
    """The state machine: a running two-node job restored after the daemon was down
    longer than the heartbeat timeout; node b's agent joins again naming its old seat.
    The job's last failure and the FAILED line are the outage, naming no node; node b's
    ranks are listed failed with the outage as their cause; a restore within the window
    changes nothing (a re-join then is the node's own doing)."""
    sm = RendezvousState()
    running_pair(sm)
    record = snapshot.job_record(sm.jobs["j"])
    timeout = sm.timing.heartbeat_timeout_s
    back = RendezvousState()
    snapshot.restore_job(back, record, {}, 100.0, alive_unix=time.time() - timeout - 5)
    said = [e for e in back.take_effects() if isinstance(e, Transition)]
    assert "restored after the daemon was down" in said[0].detail, said
    restored = back.jobs["j"].gen  # a new generation gets a new one: this one is kept
    back.join(node("b2", previous="b"), 101.0)
    job = back.jobs["j"]
    # Node b's ranks, each for the outage; node a is still owed its seat, which a
    # standby could have taken had it been marked lost with b.
    assert sorted(f.rank for f in restored.failed) == [2, 3], restored.failed
    assert all(f.cause.startswith("the daemon was down") for f in restored.failed)
    assert "a" in back.jobs["j"].gen.owed, back.jobs["j"].gen.owed
    assert job.last_failure is not None and job.last_failure.generation == 1
    assert job.last_failure.cause.startswith("the daemon was down"), job.last_failure
    gen1 = [e for e in back.take_effects() if isinstance(e, Transition) and e.generation == 1]
    assert gen1[-1].new is JobState.FAILED and "rank" not in gen1[-1].detail, gen1
    # Within the window: its nodes reattach, and a re-join is a node's own (as before).
    quick = RendezvousState()
    snapshot.restore_job(quick, record, {}, 100.0, alive_unix=time.time() - 1)
    quick.join(node("b2", previous="b"), 101.0)
    assert quick.jobs["j"].last_failure is not None
    assert "rank 2 on" in quick.jobs["j"].last_failure.cause, quick.jobs["j"].last_failure
