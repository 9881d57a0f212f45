"""Rank-0-only, atomic, pickle-free checkpoints, and rank-0-only logging.

A checkpoint is one ``.npz`` file: the arrays plus a JSON metadata document
stored as a uint8 array. One file means one ``os.replace`` makes it visible, so
a reader sees either the previous checkpoint or the complete new one.

Each array's dtype name is recorded in the metadata: the ``.npy`` format stores
an extension dtype (ml_dtypes' bfloat16, which CuPy >= 14 and the nccl backend
use) as raw bytes (``|V2``), and the name is what lets a load give it back typed.

Arrays may be numpy or CuPy. Device arrays are copied to the host explicitly
when saving (``devices.to_host``) and, when the caller passes its array module,
back to the device when loading: CuPy refuses ``np.asarray`` on device memory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from rendezvousd.trainer import raw_dtypes
from rendezvousd.trainer.comm.devices import to_device, to_host
from rendezvousd.trainer.errors import CheckpointError
from rendezvousd.trainer.topology import MultiNodeTopology

FORMAT = "rendezvousd-checkpoint/1"
_META_KEY = "__rendezvousd_meta__"
_NAME_RE = re.compile(r"^ckpt-(\d+)\.npz$")

HostArrays = dict[str, npt.NDArray[Any]]
# numpy arrays, or CuPy arrays when loaded with ``xp=cupy``.
Arrays = dict[str, Any]


def _is_global_rank_zero(rank: int | MultiNodeTopology) -> bool:
    if isinstance(rank, MultiNodeTopology):
        return rank.is_global_rank_zero
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise CheckpointError(f"rank={rank!r} must be a global rank (int >= 0) or a topology")
    return rank == 0


def checkpoint_path(directory: str | os.PathLike[str], step: int) -> Path:
    """The canonical file name for ``step``; ``latest_checkpoint`` finds these."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step={step!r} must be an integer >= 0")
    return Path(directory) / f"ckpt-{step:010d}.npz"


def checkpoint_step(path: str | os.PathLike[str]) -> int:
    """The step in a canonical checkpoint file name; -1 for any other name."""
    match = _NAME_RE.match(Path(path).name)
    return int(match.group(1)) if match else -1


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The highest-step ``ckpt-<step>.npz`` in ``directory``, or None if there is none."""
    folder = Path(directory)
    if not folder.is_dir():
        return None
    found = [e for e in folder.iterdir() if checkpoint_step(e) >= 0 and e.is_file()]
    # Compare steps numerically: names are zero-padded but steps may outgrow the padding.
    return max(found, key=checkpoint_step, default=None)


def _encode(arrays: Mapping[str, Any], meta: Mapping[str, Any]) -> HostArrays:
    payload: HostArrays = {}
    dtypes: dict[str, str] = {}
    for name, value in arrays.items():
        if not isinstance(name, str) or not name or name == _META_KEY:
            raise CheckpointError(f"array name {name!r} is empty, not a string, or reserved")
        array = to_host(value)
        if array.dtype.hasobject:
            raise CheckpointError(
                f"array {name!r} has dtype {array.dtype}, which cannot be saved without "
                "pickle; convert it to a numeric or fixed-width string dtype"
            )
        if not raw_dtypes.known(array.dtype):
            raise CheckpointError(
                f"array {name!r} has dtype {array.dtype.name}, which a checkpoint stores as "
                "raw bytes and could not load as that type (not an ml_dtypes type); convert "
                "it to a numpy dtype (e.g. float32) before saving"
            )
        payload[name] = array
        dtypes[name] = array.dtype.name
    try:
        doc = {"format": FORMAT, "arrays": sorted(payload), "dtypes": dtypes, "meta": dict(meta)}
        text = json.dumps(doc)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint metadata is not JSON-serialisable: {exc}") from exc
    payload[_META_KEY] = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    return payload


def _fsync_directory(folder: Path) -> None:
    # Makes the rename itself durable; not every platform can open a directory.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_abandoned_writes(target: Path, started: float) -> None:
    """Delete what a killed save left (its temporary file, as large as a checkpoint)
    beside ``target``: temporary files of this name or of any ``ckpt-<step>.npz``,
    untouched since before this save began and locked by no writer.

    The time alone deleted a live save's file: another process's (a second rank 0, as
    a SIGKILLed torchrun agent's workers train on beside their replacement's) stalled
    on a slow disk, or written on a host whose clock is ahead of this one's. Each save
    holds a lock on its file while it writes (``flock``: the kernel drops it when the
    writer dies, however), so only a file nobody holds is abandoned. The time still
    guards the moment between another save's ``mkstemp`` and its lock."""
    import fcntl

    for entry in target.parent.iterdir():
        name = entry.name
        if not (name.startswith(".") and name.endswith(".tmp")):
            continue
        written = name[1:].rsplit(".", 2)[0]
        if written != target.name and not _NAME_RE.match(written):
            continue
        with contextlib.suppress(OSError):
            if not entry.is_file() or entry.stat().st_mtime >= started:
                continue
            fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: in use
                entry.unlink()
            finally:
                os.close(fd)


def save_checkpoint(
    path: str | os.PathLike[str],
    arrays: Mapping[str, Any],
    meta: Mapping[str, Any],
    *,
    rank: int | MultiNodeTopology,
) -> bool:
    """Write ``path`` atomically if ``rank`` is global rank 0; return whether it wrote.

    ``arrays`` may be numpy or CuPy (copied to the host first). ``rank`` is the
    global rank or the caller's topology. Other ranks return False without
    touching the file system.
    """
    if not _is_global_rank_zero(rank):
        return False
    # Here, not at the top: the training example imports this module, and a worker
    # that never writes or reads a checkpoint should not pay for them at start-up.
    import fcntl
    import tempfile
    import zipfile

    target = Path(path)
    payload = _encode(arrays, meta)
    tmp_name: str | None = None
    started = time.time()
    try:
        fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        # Held while this save writes: another save's sweep leaves the file alone.
        fcntl.flock(fd, fcntl.LOCK_EX)
        with os.fdopen(fd, "wb") as fh:
            # Written member by member rather than via np.savez, whose own keyword
            # parameters ("file", "allow_pickle") would collide with array names.
            with zipfile.ZipFile(fh, mode="w", compression=zipfile.ZIP_STORED) as archive:
                for name, array in payload.items():
                    with archive.open(f"{name}.npy", mode="w", force_zip64=True) as member:
                        np.lib.format.write_array(member, array, allow_pickle=False)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp_name, target)
        tmp_name = None
        _fsync_directory(target.parent)
        _remove_abandoned_writes(target, started)
    except OSError as exc:
        raise CheckpointError(
            f"could not write checkpoint {target}: {exc}; the previous file, if any, "
            "is unchanged. Check free space and permissions of the directory"
        ) from exc
    finally:
        if tmp_name is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp_name)
    return True


def load_checkpoint(path: str | os.PathLike[str], *, xp: Any = np) -> tuple[Arrays, dict[str, Any]]:
    """Read a checkpoint written by ``save_checkpoint``; CheckpointError if unusable.

    The arrays come back in ``xp``'s memory: numpy by default, on the current
    GPU with ``xp=cupy`` (only after the file has been fully validated).
    """
    import zipfile  # see save_checkpoint

    source = Path(path)
    if not source.is_file():
        raise CheckpointError(f"checkpoint {source} does not exist or is not a file")
    try:
        if not zipfile.is_zipfile(source):  # else np.load reads a bare .npy as an array
            raise zipfile.BadZipFile("not a zip archive")
        with np.load(source, allow_pickle=False) as archive:
            # Reading every member verifies each one's zip CRC.
            contents = {name: archive[name] for name in archive.files}
    # MemoryError: a member whose header claims more than memory (a tampered file).
    except (OSError, ValueError, EOFError, KeyError, MemoryError, zipfile.BadZipFile) as exc:
        raise CheckpointError(
            f"checkpoint {source} is corrupt or truncated ({type(exc).__name__}: {exc}); "
            "resume from an earlier checkpoint"
        ) from exc
    raw_meta = contents.pop(_META_KEY, None)
    try:
        if raw_meta is None or raw_meta.dtype != np.uint8:
            raise ValueError("metadata record is missing")
        doc = json.loads(raw_meta.tobytes().decode("utf-8"))
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"format is {doc.get('format') if isinstance(doc, dict) else doc!r}")
        if doc.get("arrays") != sorted(contents) or not isinstance(doc.get("meta"), dict):
            raise ValueError("array list does not match the metadata")
        # Absent in checkpoints written before dtypes were recorded.
        dtypes = doc.get("dtypes", {})
        if not isinstance(dtypes, dict) or not all(isinstance(v, str) for v in dtypes.values()):
            raise ValueError("dtype list is not an object of names")
    except (ValueError, RecursionError) as exc:  # (RecursionError: nested too deep)
        raise CheckpointError(f"checkpoint {source} is not a valid {FORMAT} file: {exc}") from exc
    for name, array in contents.items():
        contents[name] = _typed(source, name, array, dtypes.get(name))
    return {name: to_device(array, xp) for name, array in contents.items()}, doc["meta"]


def _typed(source: Path, name: str, array: npt.NDArray[Any], saved: str | None) -> npt.NDArray[Any]:
    """``array`` as the dtype it was saved with (an extension type came back as raw
    bytes of its width)."""
    found = array if saved is None else raw_dtypes.typed(array, saved)
    if found is None:
        raise CheckpointError(
            f"checkpoint {source}: array {name!r} was saved as {saved!s:.40}, which this "
            "process cannot load as that type; install ml_dtypes (pip install ml_dtypes) "
            "in the environment that resumes"
        )
    return found


class _RankZeroAdapter(logging.LoggerAdapter[logging.Logger]):
    """Drops records below ``min_level`` so only global rank 0 reports progress."""

    def __init__(self, logger: logging.Logger, min_level: int) -> None:
        super().__init__(logger, {})
        self.min_level = min_level

    def isEnabledFor(self, level: int) -> bool:
        return level >= self.min_level and self.logger.isEnabledFor(level)


def rank_zero_logger(
    logger: logging.Logger | str, rank: int | MultiNodeTopology
) -> logging.LoggerAdapter[logging.Logger]:
    """A logger that logs everything on global rank 0; elsewhere only WARNING and up.

    Warnings and errors still surface on every rank because a failure on rank 5
    is exactly what rank 0 cannot report. The shared logger's level is untouched.
    """
    base = logging.getLogger(logger) if isinstance(logger, str) else logger
    min_level = logging.NOTSET if _is_global_rank_zero(rank) else logging.WARNING
    return _RankZeroAdapter(base, min_level)
