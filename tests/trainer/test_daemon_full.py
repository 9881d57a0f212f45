"""A join refused for a daemon-wide limit (a daemon holding --max-jobs jobs) is waited
out within the join's timeout, with a backoff and no restart used: rendezvous-run spent
every --max-restarts on the same refusal within milliseconds (an SRE review: 1000
restarts in 2.4 s, then the job failed)."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

from rendezvousd.client import LimitExceeded, RendezvousClient
from rendezvousd.trainer.agent.recovery import (
    ROOM_RETRY_MAX_S,
    ROOM_RETRY_S,
    daemon_full,
    room_wait,
)
from tests.support import DaemonProcess, launcher_cmd, wait_for

_SCRIPT = (
    "from rendezvousd.trainer.distributed import init_distributed\n"
    "with init_distributed():\n"
    "    pass\n"
)


def test_only_daemon_wide_limits_are_waited_for() -> None:
    def refused(limit: str, reason: str = "LIMIT_EXCEEDED") -> LimitExceeded:
        return LimitExceeded("refused", reason=reason, metadata={"limit": limit})

    assert daemon_full(refused("max_jobs")) == "max_jobs"
    assert daemon_full(refused("max_waiters")) == "max_waiters"
    assert daemon_full(refused("max_concurrent_rpcs")) == "max_concurrent_rpcs"
    # The request's own size, and a job's own world, are no wait: they never pass.
    assert daemon_full(refused("max_members_per_job")) is None
    assert daemon_full(refused("", reason="WORLD_FULL")) is None
    assert daemon_full(RuntimeError("max_jobs")) is None


def test_a_full_daemon_is_asked_again_backing_off_within_the_join_timeout() -> None:
    wait = room_wait(20.0, since=100.0)
    asks = []
    now = 100.0
    while (at := wait.retry_at(now)) is not None:
        asks.append(at - now)
        now = at
    assert asks[0] == ROOM_RETRY_S
    assert asks[:4] == [ROOM_RETRY_S * 2**i for i in range(4)]
    assert max(asks) == ROOM_RETRY_MAX_S
    assert now == 120.0  # never past the join's timeout
    wait.reset()
    assert wait.retry_at(200.0) == 200.0 + ROOM_RETRY_S


def test_rendezvous_run_waits_for_room_at_max_jobs_using_no_restart(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path, job_id: str
) -> None:
    d = start_daemon("--max-jobs", "1", "--job-ttl-s", "1")
    script = tmp_path / "w.py"
    script.write_text(_SCRIPT)
    err_path = tmp_path / "node.err"
    holder = RendezvousClient(d.endpoint, f"{job_id}-holder", token=d.token)
    node: subprocess.Popen[str] | None = None
    try:
        holder.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=30)
        holder.start_heartbeat()
        cmd = [*launcher_cmd(1, 0, 1, endpoint=d.endpoint, token_file=d.token_file, job=job_id),
               "--max-restarts", "3", "--join-timeout-s", "90", str(script)]  # fmt: skip
        with err_path.open("w") as err:
            node = subprocess.Popen(cmd, stderr=err, text=True)

        def said() -> str:
            return err_path.read_text()

        # Before the fix: its 3 restarts went within milliseconds and it exited 1.
        wait_for(
            "the node to say the daemon is full",
            lambda: "daemon is full" in said() or node.poll() is not None,
            60,
        )
        assert node.poll() is None, said()
        holder.leave()
        holder.close()
        assert node.wait(timeout=90) == 0, said()
    finally:
        holder.close()
        if node is not None and node.poll() is None:
            node.kill()
            node.wait(timeout=10)
    text = said()
    assert text.count("daemon is full") == 1, text  # said once, not per ask
    assert "its max_jobs limit, held by other jobs" in text, text
    assert "no restart used" in text and "a larger --max-jobs" in text, text
    assert f"job {job_id!r} cannot start" in text, text  # the daemon's own words, its job
    assert "restart 1 of" not in text and "gave up" not in text, text


def test_a_daemon_still_full_at_the_join_timeout_ends_the_node_without_restarts(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path, job_id: str
) -> None:
    d = start_daemon("--max-jobs", "1")
    script = tmp_path / "w.py"
    script.write_text(_SCRIPT)
    with RendezvousClient(d.endpoint, f"{job_id}-holder", token=d.token) as holder:
        holder.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=30)
        holder.start_heartbeat()
        cmd = [*launcher_cmd(1, 0, 1, endpoint=d.endpoint, token_file=d.token_file, job=job_id),
               "--max-restarts", "3", "--join-timeout-s", "3", str(script)]  # fmt: skip
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=90, check=False)
    assert run.returncode == 1, run.stderr
    assert "still full after 3 s of trying" in run.stderr, run.stderr
    assert "gave up after 0 restarts (max_restarts=3); 1 failure" in run.stderr, run.stderr
    assert "max_jobs" in run.stderr
