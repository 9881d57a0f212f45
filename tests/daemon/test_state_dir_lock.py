"""One daemon per ``--state-dir``: a second one is refused, naming the holder's pid;
a daemon killed with SIGKILL holds nothing, so its restart is not refused."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

from rendezvousd.cli.embedded import serve_command
from rendezvousd.client import RendezvousClient
from tests.support import DaemonProcess, serve_refused, with_own_mounts, write_token


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


def test_a_full_state_volume_at_first_start_is_a_clean_refusal(tmp_path: Path) -> None:
    # Writing the lock file's pid was unguarded: a full volume ended in ENOSPC's
    # traceback, where a full database is refused in words.
    volume = tmp_path / "volume"
    volume.mkdir()
    token = tmp_path / "token"
    write_token(token)
    fill = f"dd if=/dev/zero of={volume}/fill bs=4k >/dev/null 2>&1; true"
    setup = f"mount -t tmpfs -o size=64k tmpfs {volume} && {{ {fill}; }}"
    serve = serve_command("127.0.0.1:0", token, "--state-dir", str(volume / "state"))
    done = subprocess.run(
        with_own_mounts(setup, serve), capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 2, done.stderr
    assert "serving" not in done.stdout and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip() == (
        f"rendezvousd: error: cannot write the state dir lock file {volume}/state/"
        "rendezvousd.lock: No space left on device; the state dir's filesystem is full: "
        "free space there or give another --state-dir"
    )
