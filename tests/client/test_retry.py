"""The retry policy: waitForReady while the daemon starts, exactly one retry on a
transient failure, exactly one attempt on a permanent one."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client import (
    AsyncRendezvousClient,
    DaemonUnavailable,
    KeyNotFound,
    Membership,
    NotFound,
    RendezvousClient,
    RendezvousError,
    TopologyMismatch,
)
from rendezvousd.client import _calls as steps
from tests.support import (
    DaemonProcess,
    GatedProxy,
    free_port,
    members,
    scrape,
    spawn_daemon,
    wait_for,
    write_token,
)


def test_daemon_started_late_still_lets_join_succeed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """And says once, while it waits, that it has not reached the daemon yet: a client
    started before its daemon (a node agent) was silent for its whole connect_timeout."""
    monkeypatch.setattr(steps, "UNREACHED_NOTE_S", 0.3)
    port = free_port()
    token = write_token(tmp_path / "t")
    result: dict[str, object] = {}

    def join() -> None:
        with RendezvousClient(f"127.0.0.1:{port}", "late", token=token, connect_timeout=20) as c:
            result["m"] = c.join(
                num_nodes=1, gpus_per_node=1, node_rank=0, local_rank=0, timeout=20
            )
            c.leave()

    # Hold the port with a listener that never answers, so the worker's first
    # connection attempt is visible: then it is certainly waiting for the daemon.
    with socket.create_server(("127.0.0.1", port)) as blocker:
        t = threading.Thread(target=join)
        t.start()
        blocker.settimeout(20)
        attempt, _ = blocker.accept()
        attempt.close()
        wait_for("the client to say it waits", lambda: bool(_unreached(caplog)), timeout=10)
    daemon = spawn_daemon(tmp_path, token=token, listen=f"127.0.0.1:{port}")
    try:
        t.join(30)
        assert not t.is_alive()
        assert result["m"].rank == 0  # type: ignore[attr-defined]
    finally:
        daemon.kill()
    [said] = _unreached(caplog)
    assert said.startswith(f"job 'late': rendezvousd at 127.0.0.1:{port} not reached after "), said
    assert said.endswith(
        "still trying, for up to 20 s (connect_timeout): a daemon that comes up meanwhile is found"
    ), said


def _unreached(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "rendezvousd.client" and "not reached after" in r.getMessage()
    ]


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_a_client_waiting_for_a_daemon_says_so_once_per_outage(
    flavour: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    daemon: DaemonProcess,
    job_id: str,
) -> None:
    """Both clients (the decision is the shared steps'): two joins against nothing say
    it once, with what a plain connect there finds; a client that connects says nothing."""
    monkeypatch.setattr(steps, "UNREACHED_NOTE_S", 0.3)
    endpoint = f"127.0.0.1:{free_port()}"
    join = {"num_nodes": 1, "gpus_per_node": 1, "local_rank": 0, "timeout": 5}

    async def twice(target: str, token: str) -> list[str]:
        errors = []
        async with AsyncRendezvousClient(target, job_id, token=token, connect_timeout=1.2) as c:
            for _ in range(2):
                try:
                    await c.join(**join)  # type: ignore[arg-type]
                except DaemonUnavailable as exc:
                    errors.append(str(exc))
                else:
                    await c.leave()
        return errors

    if flavour == "sync":
        errors = []
        with RendezvousClient(endpoint, job_id, token="x" * 32, connect_timeout=1.2) as c:
            for _ in range(2):
                with pytest.raises(DaemonUnavailable) as info:
                    c.join(**join)  # type: ignore[arg-type]
                errors.append(str(info.value))
    else:
        errors = asyncio.run(twice(endpoint, "x" * 32))
    assert len(errors) == 2 and all("within 1.2 s (connect_timeout)" in e for e in errors)
    [said] = _unreached(caplog)
    assert f"rendezvousd at {endpoint} not reached after 0 s: nothing listens there " in said
    caplog.clear()
    d = daemon
    if flavour == "sync":
        with RendezvousClient(d.endpoint, job_id, token=d.token) as c:
            c.join(**join)  # type: ignore[arg-type]
            c.leave()
    else:
        assert asyncio.run(twice(d.endpoint, d.token)) == []
    assert _unreached(caplog) == []


def _against_nothing(call: Callable[[RendezvousClient], object], **options: Any) -> Any:
    """``call``'s DaemonUnavailable at an endpoint where no daemon listens, and how long
    it took to come."""
    endpoint = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with (
        RendezvousClient(endpoint, "gone", token="x" * 32, **options) as c,
        pytest.raises(DaemonUnavailable) as info,
    ):
        call(c)
    assert endpoint in str(info.value)
    return info.value, time.monotonic() - started


@pytest.mark.parametrize("attempts", [0, 1, 2])
def test_daemon_gone_fails_loudly_within_call_timeout_whatever_the_retries(
    attempts: int,
) -> None:
    """An attached client's call (no join to connect first) waits for the daemon up to
    call_timeout in all: each retry waited it again (docs/sdk.md, "Timeouts and
    deadlines"), and after a wait for the daemon that spent the deadline none is made."""

    def get(c: RendezvousClient) -> object:
        c.attach(Membership("gone", 0, 0, 1, 1, 0, bytes(128)), "instance")
        return c.kv_get("k", wait=False)

    # leave_timeout=0: the timed block's exit says no goodbye (2 s more here).
    err, elapsed = _against_nothing(get, call_timeout=0.6, retry_attempts=attempts, leave_timeout=0)
    assert err.attempts == 1
    assert "KvGet" in str(err) and "after 1 attempt" in str(err)
    assert "nothing listens there" in str(err)
    assert elapsed < 0.6 + 1.0


@pytest.mark.parametrize("attempts", [0, 2])
def test_a_join_waits_for_a_daemon_that_is_not_there_connect_timeout_in_all(
    attempts: int,
) -> None:
    """The documented bound (docs/protocol.md). A Check that waited for the daemon
    and was then retried as a transient failure took connect_timeout once per
    attempt: 61 s at the default, 2.4 s here with 2 retries."""
    err, elapsed = _against_nothing(
        lambda c: c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=5),
        connect_timeout=0.8,
        retry_attempts=attempts,
    )
    assert "could not be connected to within 0.8 s (connect_timeout)" in str(err)
    # The TLS probe's first look (up to 2 s) comes before the wait; not a second wait.
    assert 0.8 - 0.05 <= elapsed < 0.8 + 2.0 + 0.7, elapsed


def _count(metrics_url: str, method: str, code: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    needle = f'rendezvousd_rpc_duration_seconds_count{{code="{code}",method="{method}"}}'
    for line in text.splitlines():
        if line.startswith(needle):
            return float(line.split()[-1])
    return 0.0


def test_permanent_error_is_tried_exactly_once(
    start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    d = start_daemon("--metrics-listen", "127.0.0.1:0")
    holder = RendezvousClient(d.endpoint, job_id, token=d.token, retry_attempts=3)

    def hold_rank_zero() -> None:
        with pytest.raises(TopologyMismatch):
            holder.join(num_nodes=1, gpus_per_node=2, node_rank=0, local_rank=0, timeout=3)

    t = threading.Thread(target=hold_rank_zero)
    t.start()
    wait_for("rank 0 to park in Join", lambda: len(members(d, job_id)) == 1)
    with (
        RendezvousClient(d.endpoint, job_id, token=d.token, retry_attempts=3) as c,
        pytest.raises(TopologyMismatch),
    ):
        c.join(num_nodes=1, gpus_per_node=4, node_rank=0, local_rank=1, timeout=3)
    # The daemon records a call just after sending its status: allow it a moment,
    # then check that no second attempt follows.
    wait_for(
        "the refused Join in the metrics",
        lambda: _count(d.metrics_url, "Join", "FAILED_PRECONDITION") >= 2,
    )
    # A retry would follow within the first backoff (0.2 s): give it twice that to show up.
    time.sleep(0.5)
    # Two: the refused Join, and the parked rank 0 the conflict failed with it.
    assert _count(d.metrics_url, "Join", "FAILED_PRECONDITION") == 2
    t.join(15)
    holder.close()


class _CuttingProxy:
    """TCP to a daemon, forwarded; after ``hold()`` the daemon's bytes are dropped, and
    ``cut()`` closes every connection so far: a call that reached the daemon loses
    its answer (as when the daemon or the network goes right after it applied)."""

    def __init__(self, target: str) -> None:
        self._target = target
        self._server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self._server.getsockname()[1]}"
        self._held = False
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        host, port = self._target.rsplit(":", 1)
        with contextlib.suppress(OSError):
            while True:
                client, _ = self._server.accept()
                daemon = socket.create_connection((host, int(port)))
                with self._lock:
                    self._sockets += [client, daemon]
                for src, dst, answers in ((client, daemon, False), (daemon, client, True)):
                    pump = threading.Thread(target=self._pump, args=(src, dst, answers))
                    pump.daemon = True
                    pump.start()

    def _pump(self, src: socket.socket, dst: socket.socket, answers: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if not (answers and self._held):
                    dst.sendall(data)

    def hold(self) -> None:
        self._held = True

    def cut(self) -> None:
        with self._lock:
            sockets, self._sockets, self._held = self._sockets, [], False
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self._server.close()
        self.cut()


@pytest.mark.parametrize("call_stream", [True, False])
def test_a_delete_whose_answer_was_lost_is_not_repeated_into_another_answer(
    daemon: DaemonProcess, job_id: str, call_stream: bool
) -> None:
    """Repeated, it answered deleted=False for the key it had deleted itself."""
    proxy = _CuttingProxy(daemon.endpoint)
    c = RendezvousClient(proxy.endpoint, job_id, token=daemon.token, call_stream=call_stream)
    watcher = RendezvousClient(daemon.endpoint, job_id, token=daemon.token)
    try:
        c.connect()
        m = c.join(num_nodes=1, gpus_per_node=1, local_rank=0, node_rank=0, timeout=10)
        watcher.attach(m, c._s.instance_id)
        c.kv_set("k", b"v")
        proxy.hold()
        outcome: list[object] = []

        def delete() -> None:
            try:
                outcome.append(c.kv_delete("k"))
            except DaemonUnavailable as exc:
                outcome.append(exc)

        t = threading.Thread(target=delete)
        t.start()

        def deleted() -> bool:
            try:
                watcher.kv_get("k", wait=False)
            except KeyNotFound:
                return True
            return False

        wait_for("the daemon to delete the key", deleted)
        proxy.cut()
        t.join(30)
        (got,) = outcome
        assert isinstance(got, DaemonUnavailable), got
        # Loud about what is unknown: whether the daemon applied it.
        assert "KvDelete" in str(got) and "may have applied it" in str(got), got
        assert got.attempts == 1
    finally:
        c.close()
        watcher.close()
        proxy.close()


def test_a_reasoned_unavailable_after_a_retry_counts_its_attempts() -> None:
    """The daemon's own reason (its storage failing) after the retry: the error kept
    its words but said .attempts == 0, where protocol.md promises the attempts."""
    from rendezvousd.client import DaemonUnavailable

    with RendezvousClient("127.0.0.1:9", "j", token="t" * 32) as c:
        last = DaemonUnavailable(
            "the daemon's storage is failing", code="UNAVAILABLE", reason="STORAGE_UNAVAILABLE"
        )
        error = c._s.exhausted("KvSet", 2, last)
    assert error is last and error.attempts == 2
    assert str(error) == "the daemon's storage is failing (after 2 attempts)"


@pytest.mark.parametrize("call_stream", [True, False])
def test_a_join_cut_while_its_generation_forms_joins_the_next_generation(
    daemon: DaemonProcess, job_id: str, call_stream: bool
) -> None:
    """A worker's Join cut by a connection blip while its generation forms: the daemon
    reads the cut as the worker's death and fails the generation, and the SDK's retry
    of the same Join (gRPC's own, unary) was answered PeerFailed naming the worker's own
    rank as the failed peer. The retry now joins the next generation, as a node
    agent's JoinNode does."""
    proxy = GatedProxy(daemon.port)
    cut = RendezvousClient(proxy.endpoint, job_id, token=daemon.token, call_stream=call_stream)
    other = RendezvousClient(daemon.endpoint, job_id, token=daemon.token)
    join = {"num_nodes": 2, "gpus_per_node": 1, "local_rank": 0, "timeout": 30}
    outcome: list[object] = []

    def join_cut() -> None:
        try:
            outcome.append(cut.join(node_rank=1, host="cut-host", **join))
        except RendezvousError as exc:
            outcome.append(exc)

    def generation() -> tuple[int, int] | None:
        try:
            summary = other.get_job().summary
        except NotFound:
            return None
        return summary.generation, summary.state

    try:
        t = threading.Thread(target=join_cut, daemon=True)
        t.start()
        wait_for("the cut rank parked", lambda: generation() == (1, pb.JOB_STATE_FORMING))
        wait_for("its Join parked", lambda: scrape(daemon.metrics_url)["rendezvousd_waiters"] >= 1)
        proxy.gate.clear()
        proxy.cut()
        wait_for("the daemon to read the cut", lambda: generation() == (1, pb.JOB_STATE_FAILED))
        proxy.gate.set()
        # The retry first, while the generation it was cut from is the job's latest.
        wait_for(
            "the cut rank's retry answered",
            lambda: bool(outcome) or generation() == (2, pb.JOB_STATE_FORMING),
            20,
        )
        assert not outcome, outcome  # before: PeerFailed naming rank 1, itself
        m = other.join(node_rank=0, host="other-host", **join)
        t.join(30)
        (got,) = outcome
        assert isinstance(got, Membership), got
        assert (got.generation, got.rank) == (m.generation, 1) and m.generation == 2
    finally:
        cut.close()
        other.close()
        proxy.close()
