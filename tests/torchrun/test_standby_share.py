"""A torchrun agent that would stand by beyond its job's share of parked joins (the
daemon's ``--max-waiters-per-job``, half of it for node joins parked for a later
generation): refused ``LimitExceeded`` with ``share=parked_joins``, which no restart
changes (``rendezvous-run --standby`` exits 2 for it, ``tests/daemon/test_parked_join_share.py``)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rendezvousd.client import RendezvousClient
from tests.daemon.test_limits import limited_daemon
from tests.support import ENV_WORKER, DaemonProcess, Torchrun, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def small(tmp_path: Path) -> Iterator[DaemonProcess]:
    yield from limited_daemon(tmp_path / "share", max_waiters_per_job=4, max_waiters=64)


def test_a_torchrun_agent_beyond_the_standby_share_ends_at_once(
    small: DaemonProcess,
    torchrun: Callable[..., Torchrun],
    tmp_path: Path,
    job_id: str,
) -> None:
    """A one-node job full, its share of parked joins held by two standbys: a third
    torchrun agent, told WORLD_FULL, would stand by and is refused for the share. Its
    first rendezvous raises torch's RendezvousError with the daemon's words, which
    torch's agent does not retry (its restarts are for failed workers, after a
    rendezvous): it ends at once, exit 1 as for every join refused for the setup
    (torch's, not rendezvous-run's 2), no worker started, no restart spent."""
    clients: list[RendezvousClient] = []

    def client() -> RendezvousClient:
        c = RendezvousClient(small.endpoint, job_id, token=small.token)
        clients.append(c)
        return c

    node = {"min_nodes": 1, "max_nodes": 1, "gpus_per_node": 1}

    def standby(i: int) -> None:
        with contextlib.suppress(Exception):  # closed at the test's end: its wait is cut
            client().join_node(**node, host=f"spare{i}", standby=True, timeout=60)

    steps = tmp_path / "steps"
    try:
        agent = client()
        agent.join_node(**node, host="n0", timeout=20)
        agent.start_heartbeat()
        for i in range(2):
            threading.Thread(target=standby, args=(i,), daemon=True).start()
        wait_for("two standbys parked", lambda: agent.get_job().standbys == 2, timeout=15)
        extra = torchrun(
            small, job_id, "1", "--step-log", str(steps), nproc=1, max_restarts=2, script=ENV_WORKER
        )
        code = extra.wait(120)
        standbys = agent.get_job().standbys
    finally:
        for c in clients:
            c.close()
    err = extra.stderr()
    assert code == 1, err[-3000:]
    said = "node joins parked for a later generation (2 of them parked standby joins)"
    assert "RendezvousError" in err and said in err, err[-3000:]
    assert "start fewer standby nodes" in err, err[-3000:]
    # torch's words for a restart ("attempts left"), and rendezvousd's: none said.
    assert "attempts left" not in err and "max_restarts" not in err, err[-3000:]
    assert not steps.exists() and standbys == 2
