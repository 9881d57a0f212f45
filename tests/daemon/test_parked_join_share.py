"""Node joins parked for a later generation (standbys, scale-ups) have a share of
their own, half of ``max_waiters_per_job``: any number of them, from anyone holding
the job's token, cannot take the room the job's members need for their own barriers
(helper-173's finding 3, on a real daemon)."""

from __future__ import annotations

import contextlib
import subprocess
import threading
from collections.abc import Callable, Iterator

import pytest

from rendezvousd.client import LimitExceeded, RendezvousClient
from rendezvousd.trainer.comm.ring_wire import WIRE_VERSION as WIRE
from tests.daemon.test_limits import limited_daemon
from tests.support import ROOT, DaemonProcess, launcher_cmd, scrape, wait_for


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    yield from limited_daemon(
        tmp_path_factory.mktemp("share"), max_waiters_per_job=4, max_waiters=64
    )


def test_parked_standbys_cannot_take_the_members_barrier_room(
    small: DaemonProcess, job_id: str
) -> None:
    clients: list[RendezvousClient] = []

    def client() -> RendezvousClient:
        c = RendezvousClient(small.endpoint, job_id, token=small.token)
        clients.append(c)
        return c

    refused: list[str] = []
    ended: list[str] = []

    def standby(i: int) -> None:
        try:
            client().join_node(
                min_nodes=1,
                max_nodes=1,
                gpus_per_node=2,
                host=f"spare{i}",
                standby=True,
                timeout=20,
            )
        except LimitExceeded as exc:
            refused.append(str(exc))
        except Exception as exc:  # closed at the test's end: its wait is cut
            ended.append(repr(exc))

    try:
        agent = client()
        node = agent.join_node(min_nodes=1, max_nodes=1, gpus_per_node=2, host="n0", timeout=20)
        agent.start_heartbeat()
        workers = [client() for _ in range(2)]
        for i, w in enumerate(workers):
            w.attach(node.membership_for(i), node.member_instance_id(i))
        spares = [threading.Thread(target=standby, args=(i,), daemon=True) for i in range(4)]
        for t in spares:
            t.start()
        wait_for(
            "every standby parked or refused",
            lambda: agent.get_job().standbys + len(refused) >= 4,
            timeout=15,
        )
        # Both members' barrier completes: the standbys hold no room of theirs.
        outcomes: list[str] = []

        def barrier(w: RendezvousClient) -> None:
            try:
                w.barrier("step-1", timeout=10)
                outcomes.append("ok")
            except Exception as exc:
                outcomes.append(f"{type(exc).__name__}: {exc}")

        first = threading.Thread(target=barrier, args=(workers[0],))
        first.start()
        barrier(workers[1])
        first.join(timeout=15)
        assert outcomes == ["ok", "ok"], outcomes
        # Two standbys park (half of max_waiters_per_job=4); the others are refused,
        # told what holds the slots.
        assert agent.get_job().standbys == 2
        assert len(refused) == 2, (refused, ended)
        for text in refused:
            assert "already holds 2 node joins parked for a later generation" in text, text
            assert "(2 of them parked standby joins)" in text, text
            assert "half of max_waiters_per_job=4" in text, text
            assert "a larger --max-waiters-per-job" in text, text
    finally:
        for c in clients:
            c.close()


def test_a_standby_agent_beyond_the_share_ends_at_once_spending_no_restart(
    small: DaemonProcess, job_id: str
) -> None:
    """rendezvous-run --standby refused for the share spent each restart on the same
    refusal (3 tries in 62 ms, helper-175), then advised to raise --max-restarts: no
    restart changes it. Now a setup error: exit 2 at once, the daemon's words kept."""
    clients: list[RendezvousClient] = []

    def client() -> RendezvousClient:
        c = RendezvousClient(small.endpoint, job_id, token=small.token)
        clients.append(c)
        return c

    def standby(i: int) -> None:
        c = client()
        with contextlib.suppress(Exception):  # closed at the test's end: its wait is cut
            c.join_node(
                min_nodes=1,
                max_nodes=1,
                gpus_per_node=1,
                host=f"spare{i}",
                standby=True,
                timeout=30,
                wire_version=WIRE,
            )

    try:
        agent = client()
        # The wire version rendezvous-run sends: one node of another was refused first.
        agent.join_node(
            min_nodes=1, max_nodes=1, gpus_per_node=1, host="n0", timeout=20, wire_version=WIRE
        )
        agent.start_heartbeat()
        for i in range(2):
            threading.Thread(target=standby, args=(i,), daemon=True).start()
        wait_for("two standbys parked", lambda: agent.get_job().standbys == 2, timeout=15)
        cmd = launcher_cmd(1, "auto", 1, endpoint=small.endpoint, token_file=small.token_file)
        cmd += [
            "--job-id",
            job_id,
            "--standby",
            "--max-restarts",
            "2",
            "-m",
            "rendezvousd.trainer.example",
        ]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
    finally:
        for c in clients:
            c.close()
    assert run.returncode == 2, run.stderr
    assert "node joins parked for a later generation" in run.stderr, run.stderr
    assert "restart 1 of 2" not in run.stderr and "raise --max-restarts" not in run.stderr, (
        run.stderr
    )


def test_the_parked_join_share_is_watched_before_it_runs_out(
    start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    """The share refused the third standby under max_waiters_per_job's name while
    ``limit_used{limit="max_waiters_per_job"}`` read 0 of 4: RendezvousdNearLimit could
    not fire first. It has a gauge and a refusal count of its own."""
    d = start_daemon("--metrics-listen", "127.0.0.1:0", "--max-waiters-per-job", "4")
    s = scrape(d.metrics_url)
    assert s['rendezvousd_limit{limit="parked_joins_per_job"}'] == 2
    assert s['rendezvousd_limit_refused_total{limit="parked_joins_per_job"}'] == 0
    clients: list[RendezvousClient] = []

    def client() -> RendezvousClient:
        c = RendezvousClient(d.endpoint, job_id, token=d.token)
        clients.append(c)
        return c

    def standby(i: int) -> None:
        with contextlib.suppress(Exception):  # closed at the test's end: its wait is cut
            client().join_node(
                min_nodes=1, max_nodes=1, gpus_per_node=1, host=f"spare{i}", standby=True
            )

    try:
        agent = client()
        agent.join_node(min_nodes=1, max_nodes=1, gpus_per_node=1, host="n0", timeout=20)
        agent.start_heartbeat()
        for i in range(2):
            threading.Thread(target=standby, args=(i,), daemon=True).start()
        wait_for(
            "both standbys' share on the gauge",
            lambda: (
                scrape(d.metrics_url)['rendezvousd_limit_used{limit="parked_joins_per_job"}'] == 2
            ),
        )
        with pytest.raises(LimitExceeded):
            client().join_node(
                min_nodes=1, max_nodes=1, gpus_per_node=1, host="spare2", standby=True
            )
        s = scrape(d.metrics_url)
        assert s['rendezvousd_limit_refused_total{limit="parked_joins_per_job"}'] == 1
        # The members' own share is untouched, and refused nothing.
        assert s['rendezvousd_limit_refused_total{limit="max_waiters_per_job"}'] == 0
        assert s['rendezvousd_limit_used{limit="max_waiters_per_job"}'] == 0
    finally:
        for c in clients:
            c.close()
