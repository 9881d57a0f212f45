"""SIGTERM with calls in flight: NOT_SERVING at once, waiters released with
DRAINING, exit 0 within the drain grace, and a log line that says so."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from rendezvousd.client import (
    DaemonUnreachable,
    RendezvousClient,
    RendezvousError,
)
from tests.daemon.raw_calls import bearer, join_request, park_joins, reason_of, wait_members
from tests.support import DaemonProcess, members, wait_for, worker_cmd

# Long, so that "exited well before the grace" proves the drain finished by itself.
GRACE_S = 10.0


class HealthWatch:
    """A Health.Watch stream; records when each status arrived."""

    def __init__(self, d: DaemonProcess) -> None:
        self.channel = grpc.insecure_channel(d.endpoint)
        self.call = health_pb2_grpc.HealthStub(self.channel).Watch(
            health_pb2.HealthCheckRequest(service="rendezvous.v1.Rendezvous"), timeout=30
        )
        self.events: list[tuple[int, float]] = []
        self.not_serving = threading.Event()
        assert next(self.call).status == health_pb2.HealthCheckResponse.SERVING
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for response in self.call:
                self.events.append((response.status, time.monotonic()))
                if response.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    self.not_serving.set()
                    self.call.cancel()  # hang up, so the drain need not wait for us
        except grpc.RpcError:
            pass

    def close(self) -> None:
        self.call.cancel()
        self.channel.close()


class HeartbeatStream:
    """A running 1x1 member's raw heartbeat stream; records the events it gets.

    With ``hang_up`` it closes its side on DAEMON_DRAINING, as the SDK does; without,
    it keeps the stream open until told to stop."""

    def __init__(self, d: DaemonProcess, job_id: str, *, hang_up: bool) -> None:
        self.channel = grpc.insecure_channel(d.endpoint)
        stub = pb_grpc.RendezvousStub(self.channel)
        metadata = bearer(d)
        joined = stub.Join(
            join_request(
                job_id, 1, 0, host="drain", instance_id="running-0", unique_id=bytes(range(1, 129))
            ),
            metadata=metadata,
            timeout=10,
        )
        assert joined.world_size == 1 and not joined.id_required
        self.stop = threading.Event()
        first = pb.HeartbeatRequest(
            job_id=job_id, generation=joined.generation, rank=0, instance_id="running-0"
        )

        def requests() -> Iterator[pb.HeartbeatRequest]:
            yield first
            self.stop.wait(30)

        self.call = stub.Heartbeat(requests(), metadata=metadata, timeout=30)
        self.events: list[int] = []
        self.hang_up = hang_up
        self.draining = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for event in self.call:
                self.events.append(event.kind)
                if event.kind == pb.JobEvent.DAEMON_DRAINING:
                    self.draining.set()
                    if self.hang_up:
                        self.stop.set()
                        self.call.cancel()
        except grpc.RpcError:
            pass

    def close(self) -> None:
        self.stop.set()
        self.call.cancel()
        self.thread.join(5)
        self.channel.close()


def wait_stream_open(d: DaemonProcess, job_id: str) -> None:
    wait_for("the heartbeat stream", lambda: members(d, job_id)[0].heartbeat_stream_open)


def test_sigterm_releases_parked_waiters_and_exits_zero(
    start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    d = start_daemon("--drain-grace-s", str(GRACE_S))
    joins = park_joins(d, job_id, [1, 2], 3, host="drain", wait_s=60)
    wait_members(d, job_id, 2)
    member = HeartbeatStream(d, job_id + "-running", hang_up=True)
    wait_stream_open(d, job_id + "-running")
    watch = HealthWatch(d)
    assert all(not f.done() for f in joins), "the joins did not park"

    sent = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)

    assert watch.not_serving.wait(5), "health never turned NOT_SERVING"
    assert watch.events[-1][1] - sent < 2.0, "NOT_SERVING was not prompt"
    for future in joins:
        with pytest.raises(grpc.RpcError) as info:
            future.result(timeout=5)
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE
        assert reason_of(info.value)[0] == "DRAINING"
    released = time.monotonic() - sent
    assert released < 3.0, f"parked joins were released only after {released:.2f} s"
    assert member.draining.wait(5), f"the member got no DAEMON_DRAINING event: {member.events}"
    watch.close()

    code = d.proc.wait(GRACE_S + 5)
    elapsed = time.monotonic() - sent
    member.close()
    assert code == 0
    assert elapsed < GRACE_S / 2, f"with every call answered the drain took {elapsed:.1f} s"
    log = d.log()
    assert "signal received: draining" in log
    assert "rendezvousd stopped" in log
    assert "Traceback" not in log


def test_a_stuck_heartbeat_stream_holds_no_drain_and_leaves_no_traceback(
    start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    """A member that does not close its stream on DAEMON_DRAINING (stopped, cut off,
    stuck) held the drain for its whole grace, and grpc then cancelled the handler with
    "Exception not handled ... CancelledError" and a traceback after "rendezvousd
    stopped" (a chaos review). The daemon now ends its heartbeat streams itself once
    they have sent DAEMON_DRAINING: no member's loss while it drains."""
    grace = 5.0
    d = start_daemon("--drain-grace-s", str(grace))
    member = HeartbeatStream(d, job_id, hang_up=False)
    wait_stream_open(d, job_id)
    sent = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    code = d.proc.wait(grace + 5)
    elapsed = time.monotonic() - sent
    member.close()
    assert code == 0
    assert elapsed < grace / 2, f"exit took {elapsed:.1f} s: the stream held the drain"
    assert pb.JobEvent.DAEMON_DRAINING in member.events, member.events
    log = d.log()
    assert "rendezvousd stopped" in log
    assert "Traceback" not in log and "CancelledError" not in log, log


def test_sdk_waiters_of_a_daemon_not_started_again_hear_so_after_the_reconnect_window(
    start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    """Joins waiting when the daemon is stopped wait for it to serve again (a restart),
    as they do when it is killed, for the reconnect window (2 s here), not its drain
    grace (10 s, which a stream may hold), then say it shut down and was not back."""
    d = start_daemon("--drain-grace-s", str(GRACE_S))
    results: dict[int, BaseException | None] = {}
    clients = {
        r: RendezvousClient(
            d.endpoint, job_id, token=d.token, connect_timeout=5, reconnect_window=2
        )
        for r in (1, 2)
    }

    def worker(local_rank: int) -> None:
        try:
            clients[local_rank].join(num_nodes=1, gpus_per_node=3, local_rank=local_rank, timeout=4)
            results[local_rank] = None
        except RendezvousError as exc:
            results[local_rank] = exc

    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in clients]
    for t in threads:
        t.start()
    try:
        wait_members(d, job_id, 2)
        d.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 6
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        answered = dict(results)
    finally:
        for client in clients.values():
            client.close()  # cancels a hanging call
        for t in threads:
            t.join(5)
    assert sorted(answered) == [1, 2], "SDK joins did not return within 6 s of SIGTERM"
    for error in answered.values():
        assert isinstance(error, DaemonUnreachable), error
        assert "shut down (draining) during Join" in str(error), error
        assert "was not back within 2 s (the reconnect window)" in str(error), error


def test_a_stream_opened_ahead_of_its_join_does_not_hold_up_the_drain(
    start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    """The SDK opens its heartbeat stream before the join (``connect()``, and a join
    answered DRAINING leaves it open): a stream that never sent its first beat held
    the drain for the whole grace period (10 s here)."""
    d = start_daemon("--drain-grace-s", str(GRACE_S))
    client = RendezvousClient(d.endpoint, job_id, token=d.token)
    try:
        client.connect()
        time.sleep(0.5)  # the stream's call is at the daemon
        sent = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        code = d.proc.wait(GRACE_S + 5)
        elapsed = time.monotonic() - sent
    finally:
        client.close()
    assert code == 0
    assert elapsed < GRACE_S / 2, f"the drain took {elapsed:.1f} s"
    assert "Traceback" not in d.log()


@pytest.mark.parametrize("grace", [0.6, 10.0])
def test_a_frozen_member_holds_no_drain_and_leaves_no_traceback(
    start_daemon: Callable[..., DaemonProcess], job_id: str, grace: float
) -> None:
    """A member process that is frozen (SIGSTOP, a VM paused, a host cut off) cannot
    take its streams' end: gRPC's stop waited out the whole grace for it, so one such
    member made every SIGTERM restart last ``--drain-grace-s`` (10 s by default, as
    long as the SDK's reconnect window), and every healthy job on the daemon gave up
    on it (DaemonUnreachable, recorded as unreachable). With a grace under a second,
    gRPC cancelled the handler with "Exception not handled ... CancelledError" and a
    traceback. Once every call was answered, the drain no longer waits for them."""
    d = start_daemon("--drain-grace-s", str(grace))
    worker = subprocess.Popen(
        worker_cmd(d, job_id, 1, 1, 0, 0, "--action", "hold", "--hold-s", "60"),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stdout is not None
        assert json.loads(worker.stdout.readline())["event"] == "joined"
        wait_stream_open(d, job_id)
        worker.send_signal(signal.SIGSTOP)
        sent = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        code = d.proc.wait(grace + 10)
        elapsed = time.monotonic() - sent
    finally:
        worker.kill()
        worker.wait(10)
    assert code == 0
    if grace > 1.0:
        # Its streams stop being read 1 s into the drain (call_stream.DRAIN_ANSWER_S),
        # then at most 2 s for the answers to leave (daemon.STOP_SETTLE_S).
        assert elapsed < grace / 2, f"exit took {elapsed:.1f} s: a frozen member held it"
    log = d.log()
    assert "rendezvousd stopped" in log
    assert "Traceback" not in log and "CancelledError" not in log, log
