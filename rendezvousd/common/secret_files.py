"""Secret files (a token file, a TLS private key) and where a token comes from, for the
daemon, the SDK and the launchers alike.

A secret file's mode is judged on the descriptor that is then read: a check by path
followed by a read by path lets a link swapped in between be read unchecked. Each
caller judges the file by its own policy (the daemon allows no group bits, the SDK
allows group read) and raises its own package's error, so this module raises nothing
of its own.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

__all__ = ["TOKEN_ENV", "TOKEN_FILE_ENV", "missing_token", "read_secret"]

TOKEN_ENV = "RENDEZVOUSD_TOKEN"
TOKEN_FILE_ENV = "RENDEZVOUSD_TOKEN_FILE"


def read_secret(path: Path, judge: Callable[[os.stat_result], None]) -> bytes:
    """The bytes of ``path`` once ``judge`` (which raises to refuse) has passed the
    file's ``fstat``. Opened without blocking, so a FIFO or a device reaches ``judge``
    instead of hanging the open; OSError for a file that cannot be opened or read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        # Judged before fdopen, which refuses a directory with an OSError of its own.
        judge(os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        return f.read()


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
