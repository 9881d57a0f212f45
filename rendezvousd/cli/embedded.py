"""A daemon process with a fresh token: on loopback for
the demo and the benchmarks; on a private UNIX socket for the
file transport and ``rendezvous-run --standalone`` (tests have their own fixture)."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
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
    byte. With ``replace`` the new file is written and synced under a temporary name
    in the same directory, then renamed over ``path``: a write that fails (a full
    disk, ``ulimit -f``) leaves the old token in place, where truncating it in place
    left an empty file and no token at all."""
    token = token or secrets.token_urlsafe(32)
    body = (token + "\n").encode()
    # Every name is looked up in the directory opened once: the rename and the
    # check for a link before it are about the same directory.
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if replace:
            _replace_token(path.name, body, dir_fd)
        else:
            _create_token(path.name, body, dir_fd)
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return token


_LINK_REFUSED = (
    "it is a symbolic link; a token is written only to a plain file (name the "
    "link's target, or remove the link)"
)


def _create_token(name: str, body: bytes, dir_fd: int) -> None:
    # O_EXCL claims the name at once, and never through a link; a failed write
    # removes the file it made, so no empty token file stays behind.
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
    try:
        _write_synced(fd, body)
    except BaseException:
        os.unlink(name, dir_fd=dir_fd)
        raise


def _replace_token(name: str, body: bytes, dir_fd: int) -> None:
    try:
        old: os.stat_result | None = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        old = None
    if old is not None and stat.S_ISLNK(old.st_mode):
        # A rename would replace the link, not write through it; still refused, as
        # --force at a link planted in a shared directory was meant for its target.
        raise OSError(errno.ELOOP, _LINK_REFUSED)
    tmp = f".{name}.{secrets.token_hex(8)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
    try:
        if old is not None and (old.st_uid, old.st_gid) != (os.getuid(), os.getgid()):
            # Root replacing the token of a daemon run as its own user: the file
            # truncated in place kept its owner, and the daemon must still read it.
            # Another user may not give it away: replaced by a file of theirs (mode
            # 0600), the daemon's user could no longer read its token (a review;
            # truncating in place was refused EACCES).
            try:
                os.fchown(fd, old.st_uid, old.st_gid)
            except PermissionError:
                if old.st_uid != os.geteuid():
                    os.close(fd)
                    raise PermissionError(
                        errno.EACCES,
                        f"{name} belongs to another user (uid {old.st_uid}); replace it as "
                        "that user or as root",
                    ) from None
        _write_synced(fd, body)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def _write_synced(fd: int, body: bytes) -> None:
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)  # the umask may have taken bits off O_CREAT's mode
        f.write(body)
        f.flush()
        os.fsync(f.fileno())


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
    exits when that pipe closes, which the kernel does even on SIGKILL; in a session
    of its own, no signal to this process's group reaches it. ``prefix``
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
        # A session of its own: a Ctrl-C (SIGINT to the terminal's process group) or
        # a group's SIGTERM ended it first, and the launcher's abort and goodbye
        # then waited out the SDK's outage window (10 s) while its workers, not yet
        # signalled, trained on. Its parent's death still ends it (stdin's EOF).
        start_new_session=exit_with_parent,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith(SERVING):
        proc.kill()
        raise DaemonError(_did_not_start(proc, line, stderr))
    daemon = EmbeddedDaemon(proc, line[len(SERVING) :].strip(), token_file)
    if metrics:
        daemon.metrics_url = proc.stdout.readline()[len(METRICS) :].strip()
    return daemon


def _did_not_start(proc: subprocess.Popen[str], line: str, stderr: int | None) -> str:
    """Why ``spawn``'s daemon did not start: its error is on its stderr (its stdout,
    ``line``, is empty then), here where this process reads it, else where it went."""
    said = f"rendezvousd did not start (exit {proc.wait()})"
    if line.strip():
        said += f": its first line was {line.strip()!r}"
    if stderr == subprocess.PIPE and proc.stderr is not None:
        try:
            _, err = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:  # a child of a wrapper still holds the pipe
            err = ""
        last = [text for text in err.splitlines() if text.strip()][-1:]
        if last:
            return f"{said}: {last[0].strip()}"
    if stderr is None:
        return f"{said}; its error is on stderr above"
    return f"{said}; its error went to the stderr it was given"
