"""One daemon per ``--state-dir``: a second one is refused, naming the holder's pid;
a daemon killed with SIGKILL holds nothing, so its restart is not refused."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from rendezvousd.cli.embedded import serve_command
from rendezvousd.client import RendezvousClient
from rendezvousd.storage.store_sqlite import SqliteStore
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


@pytest.mark.parametrize("where", ["the mount itself", "a dir to create on it"])
def test_a_state_dir_on_a_read_only_filesystem_says_so_not_chown(
    tmp_path: Path, where: str
) -> None:
    """It said "state dir ... is not writable by this daemon's user (uid 0); chown it to
    that user", to root too (an operator review): os.access answers only "no" for a
    read-only mount, and no chown helps there."""
    volume = tmp_path / "volume"
    volume.mkdir()
    token = tmp_path / "token"
    write_token(token)
    state = volume if where == "the mount itself" else volume / "state"
    setup = f"mount -t tmpfs -o ro,mode=0700 tmpfs {volume}"
    serve = serve_command("127.0.0.1:0", token, "--state-dir", str(state))
    done = subprocess.run(
        with_own_mounts(setup, serve), capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 2, done.stderr
    assert "serving" not in done.stdout and "Traceback" not in done.stderr, done.stderr
    if where == "the mount itself":
        said = (
            f"state dir {state} is on a read-only filesystem (mounted read-only); remount it "
            "read-write, or give a --state-dir on a writable one"
        )
    else:
        said = (
            f"cannot create state dir {state}: Read-only file system (its parent is on a "
            "read-only filesystem); remount it read-write, or give a --state-dir on a "
            "writable one"
        )
    assert done.stderr.strip() == f"rendezvousd: error: {said}", done.stderr
    assert "chown" not in done.stderr


def test_a_state_database_on_a_read_only_remount_says_so_not_chown(tmp_path: Path) -> None:
    """The storage retry reopens a database whose directory was put back without the
    start's dir check: one put back read-only must read as that too, not as an owner
    to chown (os.access says "no" even to root there)."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    store = SqliteStore(state)
    store.open()
    store.close()
    setup = f"mount --bind {state} {state} && mount -o remount,bind,ro {state}"
    opening = (
        "import sys; from pathlib import Path; from rendezvousd.storage.store_sqlite import "
        "SqliteStore; SqliteStore(Path(sys.argv[1])).open()"
    )
    done = subprocess.run(
        with_own_mounts(setup, [sys.executable, "-c", opening, str(state)]),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"rendezvousd.errors.DaemonError: state database {state}/state.db is on a read-only "
        f"filesystem: remount {state} read-write, then start again (it holds the jobs to "
        "restore)"
    ), done.stderr
