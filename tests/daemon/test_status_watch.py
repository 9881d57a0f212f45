"""``rendezvousd status --watch``: on a terminal it redraws as the job changes; piped,
it prints one snapshot and exits (a script can read it)."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time

from rendezvousd.client import RendezvousClient
from tests.support import DaemonProcess


def _status(d: DaemonProcess, job: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rendezvousd.cli",
        "status",
        "--endpoint",
        d.endpoint,
        "--token-file",
        str(d.token_file),
        "--watch",
        "0.2",
        job,
    ]


def test_watch_piped_prints_one_snapshot(daemon: DaemonProcess, job_id: str) -> None:
    with RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as c:
        c.join(num_nodes=1, gpus_per_node=1, node_rank=0, local_rank=0, host="piped-host")
        out = subprocess.run(_status(daemon, job_id), capture_output=True, text=True, timeout=30)
        c.leave()
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("JOB ") == 1 and "piped-host" in out.stdout
    assert "\x1b[" not in out.stdout


def test_watch_on_a_terminal_redraws_as_the_job_changes(daemon: DaemonProcess, job_id: str) -> None:
    primary, secondary = pty.openpty()
    proc = subprocess.Popen(_status(daemon, job_id), stdout=secondary, stderr=secondary)
    os.close(secondary)
    seen = ""

    def read_until(needle: str, timeout: float = 20) -> None:
        nonlocal seen
        deadline = time.monotonic() + timeout
        while needle not in seen:
            assert time.monotonic() < deadline, f"never drew {needle!r}: {seen[-500:]!r}"
            if select.select([primary], [], [], 0.2)[0]:
                seen += os.read(primary, 65536).decode(errors="replace")

    try:
        read_until("does not exist")  # no such job yet: the watcher keeps going
        with RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as c:
            c.join(num_nodes=1, gpus_per_node=1, node_rank=0, local_rank=0, host="tty-host")
            read_until("RUNNING")
            c.leave()
        read_until("ENDED")
        assert "tty-host" in seen and seen.count("\x1b[H\x1b[2J") >= 3
        assert proc.poll() is None  # still watching
    finally:
        proc.terminate()
        proc.wait(10)
        os.close(primary)
