"""Files the daemon and the SDK must not be fooled by (a token file, TLS keys and
certificates), and where a token comes from, for the daemon, the SDK and the
launchers alike.

A file is judged on the descriptor that is then read: a check by path followed by a
read by path lets a link swapped in between be read unchecked, and a FIFO given for
any of them would block the read with no deadline. Each caller judges a file by its
own policy (the daemon allows a secret no group bits, the SDK group read) and raises
its own package's error, so this module raises nothing of its own.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Callable, Mapping
from pathlib import Path

__all__ = [
    "TOKEN_ENV",
    "TOKEN_FILE_ENV",
    "looks_like_token",
    "missing_token",
    "read_judged",
    "unreadable_token_file",
]

TOKEN_ENV = "RENDEZVOUSD_TOKEN"
TOKEN_FILE_ENV = "RENDEZVOUSD_TOKEN_FILE"
# The shortest token a daemon takes (rendezvousd.server.auth.MIN_TOKEN_CHARS), and the
# prefix of the job-scoped tokens it derives (rendezvousd.server.scope): here, not
# imported, as the SDK and the launchers read token files without the daemon's modules.
_MIN_TOKEN_CHARS = 16
_JOB_TOKEN_PREFIX = "rdzv-job."
# What a path names when it is not found: none of these leaves the path a file to read.
_NOT_THERE = (errno.ENOENT, errno.ENAMETOOLONG, errno.ENOTDIR)


def read_judged(
    path: Path,
    not_regular: Callable[[str], Exception],
    judge: Callable[[os.stat_result], None] | None = None,
    limit: int = -1,
) -> bytes:
    """The bytes of ``path`` (up to ``limit``), a regular file that ``judge`` (which
    raises to refuse) has passed. Anything else raises ``not_regular(its filemode)``,
    the caller's own error: by path first, so a socket or a device is never opened (the
    open itself can act, or fail with a word that names no kind), then on the
    descriptor that is read, which ``judge`` sees. Opened without blocking, so a FIFO
    swapped in between is refused instead of hanging the open. OSError for a file that
    cannot be looked at, opened or read."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise not_regular(stat.filemode(mode))
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise not_regular(stat.filemode(info.st_mode))
        if judge is not None:
            judge(info)
        os.set_blocking(fd, True)  # O_NONBLOCK was for the open: a FUSE file may honour it
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        return f.read(limit)


def missing_token(token_file: str | Path | None, env: Mapping[str, str]) -> str | None:
    """Why a command-line client has no token, naming the flag and the variables, or
    None when one of the SDK's sources (in its order) gives one. For the commands that
    take ``--token-file``: the SDK's own error names its keyword arguments, token= and
    token_file=, which no command-line user can pass."""
    if token_file or env.get(TOKEN_FILE_ENV) or env.get(TOKEN_ENV, "").strip():
        return None
    return (
        f"no token: pass --token-file FILE (the daemon's token file), or set "
        f"${TOKEN_FILE_ENV} to that file or ${TOKEN_ENV} to the token"
    )


_EXTENSION = re.compile(r"\.[A-Za-z0-9]{1,5}$")


def looks_like_token(text: str) -> bool:
    """Whether ``text``, a token file's path that names no file, may be a token instead.

    A token is what the daemon takes: 16 or more printable ASCII characters, no space.
    ``rendezvousd token`` writes 43 URL-safe base64 characters (letters of both cases,
    digits, ``-``, ``_``); a job token starts ``rdzv-job.``. A name ending in a short
    extension (``token.txt``) or starting ``.`` or ``~``, or of one letter case and no
    digit (``rendezvous_token``), reads as a path; dots elsewhere do not (a JWT, a
    Vault ``hvs.`` token were shown whole: a review); with a slash,
    only a mix of capitals, small letters and digits (base64's ``/``) does. Leaning to
    "token" only costs a mistyped path its echo, where the other way a secret lands in
    logs."""
    text = text.strip()
    if (
        len(text) < _MIN_TOKEN_CHARS
        or not text.isascii()
        or not text.isprintable()
        or any(c.isspace() for c in text)
    ):
        return False
    if text.startswith(_JOB_TOKEN_PREFIX):
        return True
    if text.startswith((".", "~")) or _EXTENSION.search(text):
        return False  # ./token, ~/tok, rendezvous.tok: a path
    kinds = sum(any(test(c) for c in text) for test in (str.islower, str.isupper, str.isdigit))
    return kinds == 3 if "/" in text else kinds >= 2


def unreadable_token_file(path: str | Path, exc: OSError, origin: str = "") -> str:
    """What to say of a token file that cannot be read (``exc``), ``origin`` saying
    where its path came from (" (from $VAR)"). A path that names nothing and looks
    like a token is not shown: a token pasted where its file belongs
    (``RENDEZVOUSD_TOKEN_FILE="$(cat tok)"``) would otherwise be echoed to stderr
    and into the logs that collect it."""
    text = str(path)
    if exc.errno in _NOT_THERE and looks_like_token(text):
        return (
            f"the token file given{origin} does not exist, and its name looks like a token "
            f"rather than a path ({len(text.strip())} characters, not shown): give the "
            f"file that holds the token (`rendezvousd token FILE` writes one), or set "
            f"${TOKEN_ENV} to the token itself"
        )
    return f"cannot read token file {text}{origin}: {exc.strerror}"
