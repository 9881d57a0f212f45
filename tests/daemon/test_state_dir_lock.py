"""One daemon per ``--state-dir``: a second one is refused, naming the holder's pid;
a daemon killed with SIGKILL holds nothing, so its restart is not refused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from rendezvousd.client import RendezvousClient
from tests.support import DaemonProcess, serve_refused


def _one_job(d: DaemonProcess, job_id: str) -> None:
    with RendezvousClient(d.endpoint, job_id, token=d.token) as c:
        c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        c.kv_set("k", b"v")


def test_a_second_daemon_on_the_same_state_dir_is_refused_naming_the_holder(
    tmp_path: Path, start_daemon: Callable[..., DaemonProcess]
) -> None:
    state = tmp_path / "state"
    first = start_daemon("--state-dir", str(state))
    _one_job(first, "held")
    second = serve_refused(tmp_path, state)
    assert second.returncode == 2, second.stderr
    assert "serving" not in second.stdout
    err = second.stderr
    assert f"state dir {state} is in use by another rendezvousd (pid {first.proc.pid}" in err
    assert "stop that daemon first, or give this one another --state-dir" in err
    assert "Traceback" not in err
    # The first daemon is untouched: it still serves its job from its own state.
    assert first.proc.poll() is None
    with RendezvousClient(first.endpoint, "held", token=first.token) as c:
        assert c.get_job().summary.generation == 1


def test_a_daemon_killed_with_sigkill_does_not_block_its_restart(
    tmp_path: Path, start_daemon: Callable[..., DaemonProcess]
) -> None:
    state = tmp_path / "state"
    first = start_daemon("--state-dir", str(state))
    _one_job(first, "kept")
    first.kill()  # SIGKILL: no shutdown code runs, the lock file stays behind
    assert (state / "rendezvousd.lock").read_text().strip() == str(first.proc.pid)
    again = start_daemon("--state-dir", str(state))
    assert "restored 1 job" in again.log()
    assert (state / "rendezvousd.lock").read_text().strip() == str(again.proc.pid)
    with RendezvousClient(again.endpoint, "kept", token=again.token) as c:
        assert c.get_job().summary.job_id == "kept"
