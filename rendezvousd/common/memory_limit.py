"""The daemon's memory limit (its cgroup's, as a container, a systemd unit's
``MemoryMax=`` or Kubernetes' ``resources.limits.memory`` set it), checked at start
against what its call limits let clients make it hold.

Open calls are the daemon's largest cost that no byte limit bounds: ~32 KiB each from
their headers on (operations.md, "Memory limits": 20,000 idle call streams of one job
token took it from 52 to 672 MiB). The default ``--max-concurrent-rpcs`` (100,000) is
~3 GiB of them, three times the shipped container's 1 GiB: clients together could have
the daemon, and so every job it serves, killed for memory rather than refused. Nothing
the operator reads said so; this says it once at start, with the value that fits.

Read by hand: the standard library has no cgroup reader, and psutil (not a dependency)
has none either.
"""

from __future__ import annotations

import logging
from pathlib import Path

from rendezvousd.common.limits import MIB, Limits

log = logging.getLogger("rendezvousd")

#: What one open call holds in the daemon (measured; operations.md "Memory limits").
CALL_BYTES = 32 * 1024
#: What the daemon holds besides its calls and key-value bytes (an idle daemon's RSS
#: with its imports, ~50 MiB, and its state machine's records).
BASE_BYTES = 96 * MIB
#: A limit at or above this is no limit (cgroup v1 writes "unlimited" as a page-rounded
#: 2**63 - 1).
_UNLIMITED = 2**60


def cgroup_memory_limit(root: Path = Path("/")) -> tuple[int, str] | None:
    """This process's memory limit in bytes and the file that sets it (the lowest of
    its cgroup and the cgroups above it, v2 ``memory.max`` or v1
    ``memory.limit_in_bytes``), or None where none is set or none can be read.
    ``root``: the file system the paths are read under."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    found: list[tuple[int, str]] = []
    for line in lines:
        hierarchy, controllers, path = [*line.split(":", 2), "", ""][:3]
        if hierarchy == "0" and controllers == "":
            base, name = root / "sys/fs/cgroup", "memory.max"
        elif "memory" in controllers.split(","):
            base, name = root / "sys/fs/cgroup/memory", "memory.limit_in_bytes"
        else:
            continue
        folder = base / path.strip("/")
        while True:
            limit = _read_limit(folder / name)
            if limit is not None:
                found.append((limit, str((folder / name).relative_to(root))))
            if folder == base or base not in folder.parents:
                break
            folder = folder.parent
    return min(found) if found else None


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text.isdigit():  # "max": none
        return None
    value = int(text)
    return value if value < _UNLIMITED else None


def calls_that_fit(limit_bytes: int, limits: Limits) -> int:
    """How many open calls a daemon of ``limit_bytes`` holds beside its base and a full
    key-value store."""
    return max(0, (limit_bytes - BASE_BYTES - limits.max_kv_bytes) // CALL_BYTES)


def warn_at_start(limits: Limits, root: Path = Path("/")) -> None:
    """Warn once when ``max_concurrent_rpcs`` open calls would take more memory than the
    daemon's limit leaves, naming the value that fits."""
    found = cgroup_memory_limit(root)
    if found is None:
        return
    limit, source = found
    fits = calls_that_fit(limit, limits)
    if limits.max_concurrent_rpcs <= fits:
        return
    need = limits.max_concurrent_rpcs * CALL_BYTES
    log.warning(
        "max_concurrent_rpcs=%d open calls could take ~%.1f GiB (~%d KiB each), more than "
        "this daemon's memory limit of %.1f GiB (%s) leaves: clients together could get it "
        "killed for memory, every job it serves with it, where they would be refused; set "
        "--max-concurrent-rpcs (RENDEZVOUSD_MAX_CONCURRENT_RPCS) to %d or less, or give it "
        'more memory (operations.md, "Memory limits")',
        limits.max_concurrent_rpcs,
        need / 2**30,
        CALL_BYTES // 1024,
        limit / 2**30,
        source,
        fits,
    )
