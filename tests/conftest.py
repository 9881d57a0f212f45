"""Shared fixtures: a real rendezvousd process on 127.0.0.1:0 and its token."""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_SERVING = re.compile(r"rendezvousd: serving on (\S+)")


@dataclass
class DaemonProcess:
    endpoint: str
    token: str
    token_file: Path
    proc: subprocess.Popen[str]
    log_path: Path
    metrics_url: str = ""

    @property
    def port(self) -> int:
        return int(self.endpoint.rsplit(":", 1)[1])

    def log(self) -> str:
        return self.log_path.read_text()

    def terminate(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def write_token(path: Path, token: str | None = None) -> str:
    token = token or secrets.token_urlsafe(32)
    path.write_text(token + "\n")
    path.chmod(0o600)
    return token


def spawn_daemon(
    tmp: Path,
    *args: str,
    token: str | None = None,
    env: dict[str, str] | None = None,
    listen: str = "127.0.0.1:0",
    timeout: float = 20.0,
) -> DaemonProcess:
    tmp.mkdir(parents=True, exist_ok=True)
    token_file = tmp / f"token-{secrets.token_hex(4)}"
    token = write_token(token_file, token)
    log_path = tmp / f"daemon-{secrets.token_hex(4)}.log"
    cmd = [
        sys.executable,
        "-m",
        "rendezvousd.cli",
        "serve",
        "--listen",
        listen,
        "--token-file",
        str(token_file),
        *args,
    ]
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=log, text=True, env={**os.environ, **(env or {})}
        )
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    line = ""
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode}: {log_path.read_text()}")
        match = _SERVING.search(line)
        if match:
            daemon = DaemonProcess(match.group(1), token, token_file, proc, log_path)
            if "--metrics-listen" in args:
                daemon.metrics_url = proc.stdout.readline().split(" on ", 1)[1].strip()
            return daemon
    proc.kill()
    raise RuntimeError(f"daemon did not start: {line!r} {log_path.read_text()}")


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    started: list[DaemonProcess] = []

    def start(*args: str, **kw: object) -> DaemonProcess:
        daemon = spawn_daemon(tmp_path, *args, **kw)  # type: ignore[arg-type]
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.kill()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """One daemon shared by a module's tests; each test uses its own job id."""
    d = spawn_daemon(tmp_path_factory.mktemp("daemon"), "--heartbeat-timeout-s", "3")
    yield d
    d.kill()


def job_name(request: pytest.FixtureRequest) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "-", request.node.name)[:100] + "-" + secrets.token_hex(3)


@pytest.fixture
def job_id(request: pytest.FixtureRequest) -> str:
    return job_name(request)
