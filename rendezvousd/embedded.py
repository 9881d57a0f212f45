"""A daemon process on loopback with a fresh token: for ``rendezvous-run
--standalone``, the demo and the benchmarks (tests have their own fixture)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from rendezvousd.errors import DaemonError

SERVING = "rendezvousd: serving on "
METRICS = "rendezvousd: metrics on "


def write_token_file(path: Path, *, replace: bool = False) -> str:
    """Create ``path`` with a random token, mode 0600 from the first byte."""
    token = secrets.token_urlsafe(32)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if replace else os.O_EXCL)
    fd = os.open(path, flags, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # O_CREAT's mode does not apply to an existing file
        f.write(token + "\n")
    return token


@dataclass
class EmbeddedDaemon:
    proc: subprocess.Popen[str]
    endpoint: str
    token_file: Path
    metrics_url: str = ""

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(timeout)


def spawn(
    workdir: Path, *flags: str, stderr: int | None = None, metrics: bool = False
) -> EmbeddedDaemon:
    """Start ``rendezvousd serve`` on 127.0.0.1:0 with a new token in ``workdir``."""
    token_file = workdir / "token"
    write_token_file(token_file)
    cmd = [
        sys.executable,
        "-m",
        "rendezvousd.cli",
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--token-file",
        str(token_file),
        *flags,
    ]
    if metrics:
        cmd += ["--metrics-listen", "127.0.0.1:0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith(SERVING):
        proc.kill()
        raise DaemonError(f"rendezvousd did not start (exit {proc.wait()}): {line.strip()!r}")
    daemon = EmbeddedDaemon(proc, line[len(SERVING) :].strip(), token_file)
    if metrics:
        daemon.metrics_url = proc.stdout.readline()[len(METRICS) :].strip()
    return daemon
