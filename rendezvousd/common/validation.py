"""Checks on request fields that need no job state."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from rendezvousd.common.escape import SHOWN_NAME_CHARS, quoted
from rendezvousd.errors import Code, Reason, RendezvousFault

if TYPE_CHECKING:
    # The daemon's bounds (two frozen dataclasses, ~4 ms to build) are its callers'
    # to pass; the SDK and the trainer import this module for UNIQUE_ID_BYTES and
    # LONGEST_WAIT_S only.
    from rendezvousd.common.limits import Limits

UNIQUE_ID_BYTES = 128
# The longest wait a client sends (30 days): its milliseconds, and those of its call's
# deadline, fit the protocol's 32-bit fields. The SDK refuses longer ones, the CLI's
# probes too, and the torchrun store sends torch's longer timeouts as this. Here, not
# in limits: a worker loads this module, never the daemon's bounds.
LONGEST_WAIT_S = 30 * 24 * 3600.0
# The shortest heartbeat interval a client beats at (20 beats a second): a beat only
# proves liveness, and an interval of 0 or 1e-9 s made one client's heartbeat busy-loop,
# costing it and the daemon most of a core each.
SHORTEST_HEARTBEAT_S = 0.05


def is_wait(value: object, least: float) -> bool:
    """Whether ``value`` is seconds a call can wait: an int or float (never a bool) from
    ``least`` to ``LONGEST_WAIT_S`` (NaN is not). The SDK's keywords and the trainer's
    settings ask it alike."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return number and least <= value <= LONGEST_WAIT_S  # type: ignore[operator]


_JOB_ID_CHAR = re.compile(r"[A-Za-z0-9._-]")
_JOB_ID = re.compile(_JOB_ID_CHAR.pattern + "{1,128}")
# C0 and C1 controls, and the bidi marks and overrides that make a log line or
# `rendezvousd status` show text other than what it holds (Trojan Source).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def invalid(reason: Reason, message: str, **metadata: str) -> RendezvousFault:
    return RendezvousFault(Code.INVALID_ARGUMENT, reason, message, metadata)


def limit_exceeded(limit: str, message: str, **metadata: str) -> RendezvousFault:
    """RESOURCE_EXHAUSTED naming the limit (``limit`` in the ErrorInfo metadata)."""
    return RendezvousFault(
        Code.RESOURCE_EXHAUSTED, Reason.LIMIT_EXCEEDED, message, {"limit": limit, **metadata}
    )


def rank_in_range(name: str, value: int, bound_name: str, bound: int, *, job_id: str) -> None:
    """Refuses a rank ``value`` outside 0..``bound`` - 1 (``bound_name`` counts them)."""
    if value >= bound:
        raise invalid(
            Reason.RANK_OUT_OF_RANGE,
            f"{name}={value} is out of range for {bound_name}={bound} (expected 0..{bound - 1})",
            job_id=job_id,
        )


def job_id(value: str) -> str:
    if value in (".", ".."):
        raise invalid(
            Reason.INVALID_JOB_ID,
            f"job id {value!r} is invalid: a job id is a URL path segment (the status "
            "page's /api/jobs/<job id>), where browsers and curl take '.' and '..' for the "
            "path itself and its parent; use 1-128 characters from [A-Za-z0-9._-] other "
            "than these two",
        )
    if not _JOB_ID.fullmatch(value):
        # ascii_only: each character outside printable ASCII escaped once, so the one
        # that broke the rule shows (a Cyrillic a, U+0430, looks like 'a'), and so
        # does every control, bidi and invisible one. (The repr of an escaped copy
        # doubled each backslash: 'h\\xe9llo'.)
        bad = next((i for i, c in enumerate(value) if not _JOB_ID_CHAR.fullmatch(c)), None)
        # Named, where the shown head may end before it.
        why = (
            f"its character {bad + 1} is {quoted(value[bad], ascii_only=True)}"
            if bad is not None
            else "it is empty"
            if not value
            else f"it is {len(value)} characters long"
        )
        raise invalid(
            Reason.INVALID_JOB_ID,
            f"job id {quoted(value, SHOWN_NAME_CHARS, ascii_only=True)} is invalid: {why}; a job id "
            "is 1-128 characters from [A-Za-z0-9._-]",
        )
    return value


def topology(num_nodes: int, gpus_per_node: int, limits: Limits) -> None:
    if num_nodes < 1 or gpus_per_node < 1:
        raise invalid(
            Reason.INVALID_TOPOLOGY,
            f"topology num_nodes={num_nodes} gpus_per_node={gpus_per_node} is invalid: "
            "both must be at least 1",
        )
    world = num_nodes * gpus_per_node
    if world > limits.max_members_per_job:
        raise limit_exceeded(
            "max_members_per_job",
            f"world size {world} ({num_nodes} nodes x {gpus_per_node} per node) "
            f"exceeds the daemon's max_members_per_job={limits.max_members_per_job}: "
            "run fewer nodes or workers per node, or start the daemon with a larger "
            "--max-members-per-job",
        )


def text_field(name: str, value: str, max_bytes: int, *, required: bool) -> str:
    if required and not value:
        raise invalid(Reason.INVALID_ARGUMENT, f"{name} must not be empty")
    if len(value.encode()) > max_bytes:
        raise invalid(Reason.INVALID_ARGUMENT, f"{name} is longer than {max_bytes} bytes")
    if _CONTROL.search(value):
        raise invalid(Reason.INVALID_ARGUMENT, f"{name} contains control characters")
    return value


def unique_id(value: bytes) -> bytes:
    # Never echo the bytes: the id is a bearer credential for the NCCL world.
    if len(value) != UNIQUE_ID_BYTES:
        raise invalid(
            Reason.INVALID_ID,
            f"unique id must be exactly {UNIQUE_ID_BYTES} bytes, got {len(value)}",
        )
    if not any(value):
        raise invalid(Reason.INVALID_ID, "unique id is all zero bytes; generate a fresh one")
    return value


def kv_key(key: str, limits: Limits) -> str:
    if not key:
        raise invalid(Reason.INVALID_ARGUMENT, "key must not be empty")
    size = len(key.encode())
    if size > limits.max_key_bytes:
        raise limit_exceeded(
            "max_key_bytes",
            f"key {quoted(key, SHOWN_NAME_CHARS)} is {size} bytes, longer than max_key_bytes="
            f"{limits.max_key_bytes}; use a shorter key (a hash of a long name)",
        )
    if _CONTROL.search(key):
        raise invalid(
            Reason.INVALID_ARGUMENT,
            f"key {quoted(key, SHOWN_NAME_CHARS)} contains control characters; keys are printable text: "
            "encode such bytes (hex, base64) into the key",
        )
    return key


def kv_value(value: bytes, limits: Limits) -> bytes:
    if len(value) > limits.max_value_bytes:
        raise limit_exceeded(
            "max_value_bytes",
            f"value of {len(value)} bytes exceeds max_value_bytes={limits.max_value_bytes}",
        )
    return value


def longest_beat_s(heartbeat_timeout_s: float) -> float:
    """The longest gap between an attendee's beats: a third of the daemon's heartbeat
    timeout, so that two beats may go missing (a loaded host, a redial) before it is
    lost. The SDK and the node agent beat at least this often; a restored daemon takes
    it as the cadence of an attendee it heard only once."""
    return heartbeat_timeout_s / 3
