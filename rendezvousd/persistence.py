"""Durable job state in ``--state-dir``: atomic, fsync'd, checksummed, group-committed.

Every RPC that changed state waits for a snapshot containing its change to be on
disk before it answers (so an acknowledged KvSet or Join survives SIGKILL), but
concurrent changes share one write: the writer snapshots whatever is pending.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import secrets
import stat
import time
from pathlib import Path
from typing import Any

from rendezvousd import snapshot
from rendezvousd.errors import DaemonError
from rendezvousd.state import RendezvousState

log = logging.getLogger("rendezvousd")
STATE_FILE = "state.json"


class StateStore:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / STATE_FILE

    def prepare(self) -> None:
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            mode = self.directory.stat().st_mode
        except OSError as exc:
            raise DaemonError(f"cannot create state dir {self.directory}: {exc.strerror}") from exc
        if mode & (stat.S_IWGRP | stat.S_IWOTH):
            # Another user could plant a symlink or file the daemon (often root)
            # then writes through; the job state is nobody else's to touch either.
            raise DaemonError(
                f"state dir {self.directory} is writable by group/others (mode "
                f"{stat.filemode(mode)}); run: chmod 700 {self.directory}"
            )
        if not os.access(self.directory, os.W_OK):
            raise DaemonError(f"state dir {self.directory} is not writable by this user")
        for stale in self.directory.glob(f".{STATE_FILE}.*.tmp"):
            # Left by a crash mid-write; unlink removes a link itself, never its target.
            stale.unlink(missing_ok=True)

    def read(self) -> dict[str, Any] | None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise DaemonError(
                f"cannot read state file {self.path}: {exc.strerror} (a symlink is refused); "
                "move it aside to start with no jobs"
            ) from exc
        with os.fdopen(fd, "rb") as f:
            raw = f.read()
        try:
            envelope = json.loads(raw)
            payload = envelope["payload"]
            digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
            if digest != envelope["sha256"]:
                raise ValueError("checksum mismatch")
        except (ValueError, KeyError, TypeError) as exc:
            raise DaemonError(
                f"state file {self.path} is torn or corrupt ({exc}); refusing to start rather than "
                "lose jobs silently. Move it aside to start with no jobs."
            ) from exc
        if not isinstance(payload, dict):
            raise DaemonError(f"state file {self.path} does not hold a state document")
        return payload

    def write(self, payload: dict[str, Any]) -> None:
        body = json.dumps(payload, sort_keys=True)
        envelope = {"sha256": hashlib.sha256(body.encode()).hexdigest(), "payload": payload}
        tmp = self.path.with_name(f".{STATE_FILE}.{secrets.token_hex(8)}.tmp")
        # A fresh name that must not exist: never write through a planted file or link.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(envelope, f, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        dir_fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


class Persister:
    def __init__(self, store: StateStore | None, state: RendezvousState) -> None:
        self.store = store
        self.state = state
        self._version = 0
        self._saved = 0
        self._lock = asyncio.Lock()

    def restore(self) -> int:
        """Load the last snapshot into the state machine; returns the number of jobs."""
        if self.store is None:
            return 0
        self.store.prepare()
        doc = self.store.read()
        if doc is None:
            return 0
        try:
            snapshot.load(self.state, doc, time.monotonic())
        except (KeyError, ValueError, TypeError) as exc:
            raise DaemonError(
                f"state file {self.store.path} is not a valid snapshot: {exc}"
            ) from exc
        self.mark()
        return len(self.state.jobs)

    def mark(self) -> None:
        self._version += 1

    async def durable(self) -> None:
        """Return once every change made so far is on disk."""
        if self.store is None or self._saved >= self._version:
            return
        target = self._version
        async with self._lock:
            if self._saved >= target:
                return  # a concurrent writer already covered our change
            version = self._version
            doc = snapshot.dump(self.state)  # taken on the loop: a consistent cut
            await asyncio.to_thread(self.store.write, doc)
            self._saved = version
