"""Helpers shared by the test packages: daemon processes, worker commands, ports, threads."""

from __future__ import annotations

import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def job_name(request: pytest.FixtureRequest) -> str:
    """A job id unique to this test (ids are per daemon, daemons are per module)."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", request.node.name)[:100] + "-" + secrets.token_hex(3)


WORKERS = Path(__file__).resolve().parent / "workers"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_cmd(
    d: DaemonProcess, job: str, nodes: int, gpus: int, node: int | None, local: int, *extra: str
) -> list[str]:
    """The command line of one SDK worker process (``workers/join_worker.py``)."""
    cmd = [
        sys.executable,
        str(WORKERS / "join_worker.py"),
        "--endpoint",
        d.endpoint,
        "--token-file",
        str(d.token_file),
        "--job",
        job,
        "--nodes",
        str(nodes),
        "--gpus",
        str(gpus),
        "--local-rank",
        str(local),
        *extra,
    ]
    return cmd + (["--node-rank", str(node)] if node is not None else [])


def parallel(fns: Sequence[Callable[[], Any]], limit: float = 20.0) -> list[Any]:
    """Run each callable in its own thread; return results or the exceptions raised."""
    out: list[Any] = [None] * len(fns)

    def run(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as exc:
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(limit)
        assert not t.is_alive(), "a rank hung"
    return out
