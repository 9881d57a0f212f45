"""A daemon process with a fresh token: on loopback for
the demo and the benchmarks; on a private UNIX socket for the
file transport and ``rendezvous-run --standalone`` (tests have their own fixture)."""

from __future__ import annotations

import errno
import os
import secrets
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rendezvousd.config import ENV_PREFIX, FIELDS
from rendezvousd.errors import DaemonError

SERVING = "rendezvousd: serving on "
METRICS = "rendezvousd: metrics on "
EXIT_WITH_PARENT = "--exit-with-parent"


def write_token_file(path: Path, *, replace: bool = False, token: str | None = None) -> str:
    """Create ``path`` with ``token`` (default: a random one), mode 0600 from the first
    byte."""
    token = token or secrets.token_urlsafe(32)
    # Not through a link: --force at a link planted in a shared directory overwrote,
    # and made 0600, a file of the planter's choosing.
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_TRUNC if replace else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise OSError(
            errno.ELOOP,
            "it is a symbolic link; a token is written only to a plain file (name the "
            "link's target, or remove the link)",
        ) from None
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
            if self.proc.stdin is not None:
                # A daemon started with EXIT_WITH_PARENT reads this as its parent
                # leaving: members still joined from here are lost, then it drains.
                self.proc.stdin.close()
            else:
                self.proc.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def serve_command(listen: str, token_file: Path, *flags: str) -> list[str]:
    """The command line of ``rendezvousd serve`` in this interpreter."""
    return [
        sys.executable,
        "-m",
        "rendezvousd.cli",
        "serve",
        "--listen",
        listen,
        "--token-file",
        str(token_file),
        *flags,
    ]


def spawn(
    workdir: Path,
    *flags: str,
    stderr: int | None = None,
    metrics: bool = False,
    listen: str = "127.0.0.1:0",
    token_file: Path | None = None,
    exit_with_parent: bool = False,
    prefix: Sequence[str] = (),
    pass_fds: Sequence[int] = (),
) -> EmbeddedDaemon:
    """Start ``rendezvousd serve`` on ``listen`` with a new token in ``workdir``.

    ``exit_with_parent``: the daemon's stdin is a pipe from this process, and it
    exits when that pipe closes, which the kernel does even on SIGKILL. ``prefix``
    wraps the command (e.g. to run it on a namespace host); ``pass_fds`` stay open
    in the daemon under the same numbers (``/proc/self/fd/N`` paths work there too). Its
    settings then come from the flags alone: inherited ``RENDEZVOUSD_*`` variables
    (a state directory, say) could otherwise put a job's id on disk.
    """
    token_file = token_file or workdir / "token"
    write_token_file(token_file, replace=exit_with_parent)
    cmd = [*prefix, *serve_command(listen, token_file, *flags)]
    if metrics:
        cmd += ["--metrics-listen", "127.0.0.1:0"]
    env = None
    if exit_with_parent:
        cmd.append(EXIT_WITH_PARENT)
        settings = {ENV_PREFIX + name.upper() for name in FIELDS}
        env = {k: v for k, v in os.environ.items() if k not in settings}
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE if exit_with_parent else None,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=env,
        pass_fds=tuple(pass_fds),
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith(SERVING):
        proc.kill()
        raise DaemonError(f"rendezvousd did not start (exit {proc.wait()}): {line.strip()!r}")
    daemon = EmbeddedDaemon(proc, line[len(SERVING) :].strip(), token_file)
    if metrics:
        daemon.metrics_url = proc.stdout.readline()[len(METRICS) :].strip()
    return daemon
