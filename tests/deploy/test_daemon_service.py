"""The daemon behaves as the systemd unit, the container HEALTHCHECK and the
Kubernetes probes expect: sd_notify over a real datagram socket, ``rendezvousd
health`` exit codes, token file modes."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import secrets
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rendezvousd.cli.sdnotify import Notifier
from rendezvousd.cli.serve import main as cli_main
from rendezvousd.server import auth

# ---------------------------------------------------------------------------
# 4. The running daemon: sd_notify, health, token files.
# ---------------------------------------------------------------------------

WATCHDOG_USEC = 200_000
START_TIMEOUT = 20.0


def cli() -> list[str]:
    script = Path(sys.executable).with_name("rendezvousd")
    return [str(script)] if script.exists() else [sys.executable, "-m", "rendezvousd.cli"]


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RENDEZVOUSD_", "NOTIFY_SOCKET", "WATCHDOG_", "LISTEN_"))
    }
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run_cli(*args: str, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*cli(), *args], capture_output=True, text=True, timeout=timeout, env=clean_env()
    )


def new_token(path: Path) -> str:
    result = run_cli("token", str(path))
    assert result.returncode == 0, result.stderr
    return path.read_text().strip()


@contextlib.contextmanager
def daemon(tmp_path: Path, token_file: Path, **env: str) -> Iterator[subprocess.Popen[str]]:
    log = tmp_path / "daemon.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [
                *cli(), "serve", "--listen", "127.0.0.1:0", "--token-file", str(token_file),
                "--drain-grace-s", "1", "--no-reflection",
            ],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=clean_env(**env),
        )  # fmt: skip
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


def daemon_log(tmp_path: Path) -> str:
    path = tmp_path / "daemon.log"
    return path.read_text()[-3000:] if path.exists() else ""


def stdout_port(proc: subprocess.Popen[str], timeout: float = START_TIMEOUT) -> int:
    """The port from the one stable stdout line, ``rendezvousd: serving on HOST:PORT``."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.1)
        if ready:
            line = proc.stdout.readline()
            match = re.search(r"serving on 127\.0\.0\.1:(\d+)", line)
            if match:
                return int(match.group(1))
            if not line:
                break
    raise AssertionError(f"no 'serving on' line (exit code {proc.poll()})")


def health_status(port: int, service: str = "") -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return int(response.status)


@dataclass(frozen=True)
class Notification:
    fields: dict[str, str]
    sender_pid: int | None
    at: float


def receive(sock: socket.socket, deadline: float, what: str, tmp_path: Path) -> Notification:
    sock.settimeout(max(0.001, deadline - time.monotonic()))
    try:
        data, ancdata, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(struct.calcsize("3i")))
    except TimeoutError:
        raise AssertionError(
            f"no {what} datagram in time; daemon log:\n{daemon_log(tmp_path)}"
        ) from None
    lines = data.decode().splitlines()
    assert lines and all("=" in line for line in lines), f"not KEY=VALUE lines: {data!r}"
    pid = None
    for level, kind, cdata in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            pid = struct.unpack("3i", cdata[: struct.calcsize("3i")])[0]
    return Notification(dict(line.split("=", 1) for line in lines), pid, time.monotonic())


@contextlib.contextmanager
def notify_socket() -> Iterator[tuple[socket.socket, str]]:
    # A short directory: AF_UNIX paths are limited to 107 bytes.
    with tempfile.TemporaryDirectory(prefix="rdzv-", dir="/tmp") as directory:
        path = os.path.join(directory, "notify")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.bind(path)
            # As systemd does: the kernel then tells us which pid sent each datagram.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            yield sock, path


def test_notify_ready_after_serving_then_watchdog_then_stopping_on_sigterm(tmp_path: Path) -> None:
    token = tmp_path / "token"
    new_token(token)  # written by `rendezvousd token`, so this also proves serve accepts it
    with (
        notify_socket() as (sock, path),
        daemon(tmp_path, token, NOTIFY_SOCKET=path, WATCHDOG_USEC=str(WATCHDOG_USEC)) as proc,
    ):
        # READY=1 comes first, from the main pid, naming it, once serving.
        ready = receive(sock, time.monotonic() + START_TIMEOUT, "READY=1", tmp_path)
        assert ready.fields.get("READY") == "1", ready.fields
        match = re.search(r"127\.0\.0\.1:(\d+)", ready.fields.get("STATUS", ""))
        assert match, ready.fields
        port = int(match.group(1))
        # Right away: READY=1 must mean health already answers SERVING.
        assert health_status(port) == health_pb2.HealthCheckResponse.SERVING
        assert (
            health_status(port, "rendezvous.v1.Rendezvous")
            == health_pb2.HealthCheckResponse.SERVING
        )
        assert ready.fields.get("MAINPID") == str(proc.pid)
        assert ready.sender_pid == proc.pid, "NotifyAccess=main drops datagrams from other pids"
        assert stdout_port(proc) == port

        # WATCHDOG=1 keeps coming, from the main pid, faster than WATCHDOG_USEC.
        # Drop the pings queued meanwhile so the gaps below are real ones.
        sock.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                assert sock.recv(4096) == b"WATCHDOG=1"
        pings: list[Notification] = []
        deadline = time.monotonic() + 5
        while len(pings) < 5:
            note = receive(sock, deadline, "WATCHDOG=1", tmp_path)
            assert note.fields == {"WATCHDOG": "1"}, note.fields
            assert note.sender_pid == proc.pid
            pings.append(note)
        gaps = [b.at - a.at for a, b in itertools.pairwise(pings)]
        assert sum(gaps) / len(gaps) < WATCHDOG_USEC / 1e6, gaps

        # SIGTERM: STOPPING=1 (only watchdog pings before it), health no longer
        # SERVING, exit 0 within the drain grace plus a margin.
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        while True:
            note = receive(sock, sent + 10, "STOPPING=1", tmp_path)
            if note.fields.get("STOPPING") == "1":
                break
            assert note.fields == {"WATCHDOG": "1"}, note.fields
        assert note.sender_pid == proc.pid
        with contextlib.suppress(grpc.RpcError):
            assert health_status(port) != health_pb2.HealthCheckResponse.SERVING
        assert proc.wait(timeout=10) == 0, daemon_log(tmp_path)
        assert time.monotonic() - sent < 1 + 5
        # Nothing after the exit claims readiness again.
        sock.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                assert b"READY=1" not in sock.recv(4096)


def test_no_watchdog_pings_when_they_are_meant_for_another_process() -> None:
    other = Notifier.from_env({"WATCHDOG_USEC": "200000", "WATCHDOG_PID": str(os.getppid())})
    assert other.watchdog_interval is None
    own = Notifier.from_env({"WATCHDOG_USEC": "200000", "WATCHDOG_PID": str(os.getpid())})
    assert own.watchdog_interval == pytest.approx(0.1)
    assert Notifier.from_env({}).watchdog_interval is None


def write_token(path: Path) -> str:
    token = secrets.token_urlsafe(32)
    path.touch(mode=0o600)
    path.write_text(token + "\n")
    return token


def test_health_exits_0_when_serving_and_2_when_nothing_listens(tmp_path: Path) -> None:
    token = tmp_path / "token"
    write_token(token)
    with daemon(tmp_path, token) as proc:
        port = stdout_port(proc)
        result = run_cli("health", "--endpoint", f"127.0.0.1:{port}", "--timeout", "5")
        assert result.returncode == 0, result.stderr
        assert "SERVING" in result.stdout
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0, daemon_log(tmp_path)

    with socket.socket() as s:  # a port that was free a moment ago and now nothing holds
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    result = run_cli("health", "--endpoint", f"127.0.0.1:{closed}", "--timeout", "2")
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "cannot reach" in result.stderr
    assert "nothing listens there (connection refused)" in result.stderr, result.stderr


def test_health_at_a_silent_port_keeps_to_its_timeout_and_says_what_is_there() -> None:
    """A port that accepts and never speaks: the look after the failed check took a
    fixed 2 s more (--timeout 2 took 4.3 s), and said only DEADLINE_EXCEEDED."""
    with socket.socket() as s:  # a port nothing holds: refused at once
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    started = time.monotonic()
    run_cli("health", "--endpoint", f"127.0.0.1:{closed}", "--timeout", "2")
    start_up = time.monotonic() - started  # the interpreter's, the imports', a refusal's
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        started = time.monotonic()
        result = run_cli(
            "health", "--endpoint", f"127.0.0.1:{silent.getsockname()[1]}", "--timeout", "2"
        )
        took = time.monotonic() - started
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "accepts connections, but no gRPC server answered" in result.stderr, result.stderr
    # --timeout, its looks' 0.1 s floors and slack; the fixed sniff added 2 s.
    assert took < start_up + 2 + 1.0, (took, start_up)


def test_token_command_writes_a_0600_file_and_never_overwrites_silently(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "token"
    first = new_token(path)  # the installed console script
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert auth.read_token_file(path) == [first]  # what serve's loader accepts
    # The rest in-process (same code, no interpreter start-up).
    assert cli_main(["token", str(path)]) == 1
    assert "--force" in capsys.readouterr().err
    assert path.read_text().strip() == first
    path.chmod(0o644)  # --force must not keep a loose mode on the file it replaces
    assert cli_main(["token", "--force", str(path)]) == 0
    output = capsys.readouterr()
    token = path.read_text().strip()
    assert token not in ("", first)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert token not in output.out + output.err  # never echoed


@pytest.mark.parametrize("mode", [0o644, 0o640])
def test_serve_refuses_a_token_file_others_can_read(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "token"
    token = write_token(path)
    path.chmod(mode)
    result = run_cli("serve", "--listen", "127.0.0.1:0", "--token-file", str(path))
    assert result.returncode == 2
    assert "chmod 600" in result.stderr, result.stderr
    assert "serving on" not in result.stdout
    assert token not in result.stdout + result.stderr
