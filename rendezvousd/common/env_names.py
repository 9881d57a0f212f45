"""Every ``RENDEZVOUSD_*`` variable a rendezvousd program reads, so that one it does not
(a misspelt ``RENDEZVOUSD_HEARTBEAT_TIMEOUTS``) is said, not ignored without a word.

The daemon, the SDK, the trainer, the launcher and the torchrun backend share the
prefix, and one environment (a shell, a unit's ``EnvironmentFile``, a pod) often holds
several programs' names, so a name is unknown only when no program reads it. The names
are written out here, not gathered from each program's settings, because the daemon
would then import the trainer to warn; ``tests/deploy/test_env_names.py`` fails when
this list and what the programs read drift apart.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping

PREFIX = "RENDEZVOUSD_"

#: The daemon's settings (``rendezvousd serve``; the SDK reads the token's two).
_DAEMON = (
    "CONNECTION_IDLE_S", "DEFAULT_WAIT_S", "DRAIN_GRACE_S", "EVENT_LOOP",
    "HEARTBEAT_TIMEOUT_S", "INSECURE_METRICS", "INSECURE_PLAINTEXT", "JOB_TTL_S",
    "LAST_CALL_S", "LISTEN", "LOG_LEVEL", "MAX_BARRIERS_PER_JOB", "MAX_CONCURRENT_RPCS",
    "MAX_CONCURRENT_STREAMS", "MAX_CONNECTIONS", "MAX_JOBS", "MAX_KEYS_PER_JOB",
    "MAX_KV_BYTES", "MAX_KV_BYTES_PER_JOB", "MAX_MEMBERS_PER_JOB", "MAX_VALUE_BYTES",
    "MAX_WAITERS", "MAX_WAITERS_PER_JOB", "MAX_WAIT_S", "METRICS_LISTEN", "REFLECTION",
    "REQUEST_BODY_TIMEOUT_S", "SEAT_HOLD_S", "STATE_DIR", "TLS_CERT", "TLS_CLIENT_CA",
    "TLS_KEY", "TOKEN", "TOKEN_FILE",
)  # fmt: skip
#: The trainer's and the launcher's (``rendezvous-run``, ``init_distributed``).
_TRAINER = (
    "BACKEND", "BUCKET_CAP_MIB", "CHECK_COLLECTIVES", "COLLECTIVE_TIMEOUT_S", "CONFIG",
    "CONNECT_TIMEOUT_S", "CPU_SHARED_MEMORY", "ENDPOINT", "FIRST_BUCKET_MIB",
    "GPUS_PER_NODE", "HANG_TIMEOUT_S", "HEARTBEAT_INTERVAL_S", "JOB_ID", "JOIN_TIMEOUT_S",
    "LOCAL_RANK", "MAX_RESTARTS", "MIN_NODES", "NODE_LINK_WATCH", "NODE_RANK", "NUM_NODES",
    "RANK", "REJOIN_TIMEOUT_S", "RENDEZVOUS_PATH", "RETRIES", "RING_HOST",
    "SETUP_TIMEOUT_S", "SLOW_PEER_WARN_S", "SPARE_GPU_CONTEXT", "STANDBY", "STANDBY_IF_FULL", "STOP_GRACE_S",
    "TLS_CA", "TLS_SERVER_NAME", "WORLD_SIZE", "FORK_SERVER", "TRACE_FILE",
    "NCCL_SHARED_DEVICE",
)  # fmt: skip
#: The torchrun backend's (torch's own names for its rendezvous settings).
_TORCHRUN = ("CONNECT_TIMEOUT", "JOIN_TIMEOUT", "LAST_CALL_TIMEOUT", "PRELOAD")
#: Set by our launchers for the processes they start, never by a user.
_HANDED_ON = (
    "AGENT_FD", "AGENT_PID", "FORK_SERVER_FD", "FORK_SERVER_PRELOAD", "SPARE_GPU",
    "WARM_SOCKET",
)  # fmt: skip
#: Read by the build backend (version.BUILD_ENV: the commit of a build without git).
_BUILD = ("BUILD",)
#: Read by scripts/ and the test suite, which set them beside the programs'.
_TOOLS = (
    "MODEL_EXAMPLES", "REQUIRE_GPU", "TEST_REQUIRE_HOSTS", "TEST_TORCH_PYTHON", "TORCH_VERSION",
)  # fmt: skip

EVERY_NAME = frozenset(
    PREFIX + n for n in (*_DAEMON, *_TRAINER, *_TORCHRUN, *_HANDED_ON, *_BUILD, *_TOOLS)
)
# Compared without the prefix, which every name shares and would make any name look
# close to some other.
_SUFFIXES = sorted(n.removeprefix(PREFIX) for n in EVERY_NAME)


#: How alike a misspelt name and a real one must be to be suggested (difflib's ratio).
CLOSE_ENOUGH = 0.75


def closest(name: str, names: Iterable[str]) -> str | None:
    """The one of ``names`` that ``name`` most likely misspells, or None: the rule for a
    misspelt variable here and a misspelt ``--rdzv-conf`` key of the torchrun backend."""
    close = difflib.get_close_matches(name, list(names), n=1, cutoff=CLOSE_ENOUGH)
    return close[0] if close else None


def unknown_names(environ: Mapping[str, str]) -> list[str]:
    """A sentence for each ``RENDEZVOUSD_*`` name in ``environ`` that no program reads,
    with the closest name one does. Only names: a value may be a secret."""
    said = []
    for name in sorted(environ):
        if not name.startswith(PREFIX) or name in EVERY_NAME:
            continue
        close = closest(name.removeprefix(PREFIX), _SUFFIXES)
        hint = f": did you mean {PREFIX}{close}?" if close else ""
        said.append(f"${name} is set, but no rendezvousd program reads it{hint} (ignored)")
    return said
