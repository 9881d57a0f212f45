"""Resources running out under a serving daemon (an operator review, helper 146): a
closed stdout, a low open-file limit, a full filesystem; each named with what to do."""

from __future__ import annotations

import http.client
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from rendezvousd.cli.embedded import serve_command
from rendezvousd.client import RendezvousClient, RendezvousError
from tests.support import DaemonProcess, make_pki, wait_for, with_own_mounts, write_token


def _serve(
    tmp: Path, *flags: str, prefix: tuple[str, ...] = ()
) -> tuple[subprocess.Popen[str], Path]:
    """A daemon whose stdout is a pipe nobody reads (closed here at once), and its log."""
    token = tmp / f"token-{secrets.token_hex(4)}"
    write_token(token)
    log = tmp / f"daemon-{secrets.token_hex(4)}.log"
    r, w = os.pipe()
    with log.open("w") as err:
        proc = subprocess.Popen(
            [*prefix, *serve_command("127.0.0.1:0", token, *flags)], stdout=w, stderr=err, text=True
        )
    os.close(w)
    os.close(r)
    return proc, log


def test_a_serving_daemon_whose_stdout_reader_left_keeps_serving(tmp_path: Path) -> None:
    """`rendezvousd serve | head -1`: the reader has the port and exits; the daemon's
    next ready line met the closed pipe and the daemon exited 141."""
    proc, log = _serve(tmp_path, "--metrics-listen", "127.0.0.1:0")
    try:
        wait_for("the closed stdout said", lambda: "stdout is closed" in log.read_text()
                 or proc.poll() is not None, timeout=20)  # fmt: skip
        text = log.read_text()
        assert proc.poll() is None, f"the daemon exited {proc.returncode}: {text}"
        assert "still serving, stdout now goes to /dev/null" in text, text
        found = re.search(r"rendezvousd: serving on ([^\s;]+)", text)
        assert found is not None, text
        token = next(tmp_path.glob("token-*")).read_text().strip()
        with RendezvousClient(found.group(1), "after-head", token=token) as c:
            c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
            c.kv_set("k", b"v")
        time.sleep(0.2)
        assert proc.poll() is None, log.read_text()
    finally:
        proc.kill()
        proc.wait(10)


_LIMIT = 128


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _fill_descriptors(d: DaemonProcess, held: list[socket.socket]) -> None:
    """Plain connections to the daemon until it holds every descriptor its limit
    allows: gRPC accepts each (its handshake waits for bytes that never come)."""
    deadline = time.monotonic() + 20
    while _open_fds(d.proc.pid) < _LIMIT:
        assert time.monotonic() < deadline, f"{_open_fds(d.proc.pid)} fds open: {d.log()}"
        if len(held) < 2 * _LIMIT:
            held.append(socket.create_connection(("127.0.0.1", d.port), timeout=5))
        else:
            time.sleep(0.05)


def test_a_low_open_file_limit_is_named_at_start_and_when_reached(
    tmp_path: Path, start_daemon: Callable[..., DaemonProcess]
) -> None:
    """Under `prlimit --nofile=128:128` nothing said the limit was far below what
    --max-connections needs, and when it was reached the only lines were gRPC core's
    "File descriptor limit reached. Retrying."; a cold daemon's first commit, which
    opened the -wal file then, failed with EMFILE, and every joiner was told that the
    daemon "cannot write its state storage"."""
    d = start_daemon(
        "--state-dir", str(tmp_path / "state"), prefix=["prlimit", f"--nofile={_LIMIT}:{_LIMIT}"]
    )
    assert (
        f"the open-file limit is {_LIMIT}, below the 16484 this daemon may need "
        "(--max-connections 16384 + 100)" in d.log()
    ), d.log()
    assert "LimitNOFILE=" in d.log()
    held: list[socket.socket] = []
    try:
        with RendezvousClient(d.endpoint, "cold", token=d.token) as c:
            c.check_health()  # its connection before the descriptors run out
            _fill_descriptors(d, held)
            wait_for(
                "the limit named in the log",
                lambda: "files open of this daemon's open-file limit 128" in d.log(),
                timeout=10,
            )
            c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
            c.kv_set("k", b"v")
            assert c.kv_get("k") == b"v"
    finally:
        for s in held:
            s.close()
    assert "raise it (LimitNOFILE= in its systemd unit, or ulimit -n" in d.log()


def test_a_start_on_a_full_filesystem_says_it_is_full_not_a_disk_io_error(
    tmp_path: Path,
) -> None:
    """With a few KiB free SQLite cannot grow its -shm file and reports "disk I/O error"
    (SQLITE_IOERR_SHMSIZE), not SQLITE_FULL; the daemon said "check the disk it is on
    (dmesg)", which a service manager's restarts repeated."""
    volume = tmp_path / "volume"
    volume.mkdir()
    token = tmp_path / "token"
    write_token(token)
    fill = (
        f"dd if=/dev/zero of={volume}/pad bs=4k count=4 2>/dev/null && "
        f"{{ dd if=/dev/zero of={volume}/fill bs=4k >/dev/null 2>&1; true; }} && rm {volume}/pad"
    )
    setup = f"mount -t tmpfs -o size=1m tmpfs {volume} && {fill}"
    serve = serve_command("127.0.0.1:0", token, "--state-dir", str(volume / "state"))
    done = subprocess.run(
        with_own_mounts(setup, serve), capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 2, done.stderr
    assert "serving" not in done.stdout and "Traceback" not in done.stderr, done.stderr
    assert "dmesg" not in done.stderr, done.stderr
    assert re.search(
        r"its filesystem is full \(\d+ KiB free\): free space there, then start again",
        done.stderr,
    ), done.stderr


def _status(d: DaemonProcess) -> str:
    base = {k: v for k, v in os.environ.items() if not k.startswith("RENDEZVOUSD_")}
    done = subprocess.run(
        [sys.executable, "-m", "rendezvousd.cli", "status", "--endpoint", d.endpoint],
        capture_output=True,
        text=True,
        timeout=60,
        env={**base, "RENDEZVOUSD_TOKEN": d.token},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _overview(d: DaemonProcess) -> dict[str, object]:
    url = urlsplit(d.metrics_url)
    assert url.hostname is not None and url.port is not None
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    try:
        conn.request("GET", "/api/jobs", headers={"Authorization": f"Bearer {d.token}"})
        r = conn.getresponse()
        body = r.read()
        assert r.status == 200, (r.status, body)
        said: dict[str, object] = json.loads(body)
        return said
    finally:
        conn.close()


def test_a_storage_outage_shows_in_status_and_on_the_page_and_says_what_to_do(
    tmp_path: Path, start_daemon: Callable[..., DaemonProcess]
) -> None:
    """`rendezvousd status` showed `RUNNING`, every rank `ACTIVE` and no daemon line while
    every change was refused; the log said the state dir "was removed or replaced" and
    not what to do about it."""
    state = tmp_path / "state"
    d = start_daemon("--state-dir", str(state), "--metrics-listen", "127.0.0.1:0")
    with RendezvousClient(d.endpoint, "outage", token=d.token) as c:
        c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        assert "state storage failing" not in _status(d)
        assert _overview(d)["storage_failing_since"] is None
        before = time.time()
        shutil.rmtree(state)
        with pytest.raises(RendezvousError) as info:
            c.kv_set("k", b"v")
        assert info.value.reason == "STORAGE_UNAVAILABLE"
        shown = _status(d)
        found = re.search(
            r"^NOT_SERVING: state storage failing since (\S+): changes are refused until it "
            r"takes writes again; see the daemon's log$",
            shown,
            flags=re.M,
        )
        assert found is not None, shown
        assert shown.splitlines()[0].startswith("daemon ")  # the line under the daemon's
        since = _overview(d)["storage_failing_since"]
        assert isinstance(since, float) and before - 1 <= since <= time.time(), since
        assert f"the state dir {state} is gone: put it back (or create it, mode 0700)" in d.log()
        assert "or restart the daemon" in d.log()
        state.mkdir(mode=0o700)
        wait_for("storage back", lambda: "takes writes again; serving" in d.log())
        c.kv_set("k", b"v")
        assert "state storage failing" not in _status(d)
        assert _overview(d)["storage_failing_since"] is None


def test_a_sighup_with_the_token_file_gone_says_what_to_do(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon()
    d.token_file.unlink()
    d.proc.send_signal(signal.SIGHUP)
    wait_for("the refused reload", lambda: "SIGHUP: token file not reloaded" in d.log())
    assert "put the file back (or fix it) and send SIGHUP again" in d.log()
    assert d.token not in d.log()


def test_an_unreadable_tls_key_names_its_flag(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    token = tmp_path / "token"
    write_token(token)
    gone = tmp_path / "gone.key"
    done = subprocess.run(
        serve_command("127.0.0.1:0", token, "--tls-cert", str(pki.server), "--tls-key", str(gone)),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert f"cannot read TLS file {gone} (--tls-key): No such file or directory" in done.stderr
    assert "check the path given to --tls-key" in done.stderr
