"""The key-value store's rules: sizes, budgets and counters (pure, no I/O).

``RendezvousState`` decides who may call (membership, generation, instance)
and wakes waiters; this module decides what one job's store accepts. Bytes
are counted as UTF-8 key bytes plus value bytes, per job and daemon-wide.
"""

from __future__ import annotations

import re

from rendezvousd.common import validation
from rendezvousd.common.escape import quoted
from rendezvousd.common.limits import Limits
from rendezvousd.errors import Code, Reason, RendezvousFault
from rendezvousd.state import fences
from rendezvousd.state.job import Job

# Plain decimal only: int() would also take " 7 ", "+5" and "1_000", which no
# other client of the same counter would read back the same way.
_COUNTER = re.compile(rb"-?[0-9]{1,19}")


def entry_bytes(key: str, value: bytes) -> int:
    return len(key.encode()) + len(value)


def put(job: Job, key: str, value: bytes, limits: Limits, held: int) -> set[int]:
    """Store ``value`` under ``key`` within the limits; returns the waiters to wake.

    ``held`` is the daemon-wide total before this change.
    """
    old = job.gen.kv.get(key)
    if old is None and len(job.gen.kv) >= limits.max_keys_per_job:
        raise validation.limit_exceeded(
            "max_keys_per_job",
            f"job {job.job_id!r} already has max_keys_per_job={limits.max_keys_per_job} keys; "
            "delete keys it no longer needs",
            job_id=job.job_id,
        )
    grown = (
        job.gen.kv_bytes
        + entry_bytes(key, value)
        - (entry_bytes(key, old) if old is not None else 0)
    )
    # Only a write that grows the job: one restored over a limit lowered since (a
    # release that added it, a restart with smaller --max-kv-bytes) could otherwise
    # not even overwrite a key with a value as long, nor shrink.
    if grown > limits.kv_bytes_per_job and grown > job.gen.kv_bytes:
        raise validation.limit_exceeded(
            "max_kv_bytes_per_job",
            f"job {job.job_id!r} would hold {grown} key-value bytes, over the "
            f"{limits.kv_bytes_per_job} one job may (max_kv_bytes_per_job, at most half "
            "of max_kv_bytes); delete keys it no longer needs",
            job_id=job.job_id,
        )
    after = held - job.gen.kv_bytes + grown
    if grown > job.gen.kv_bytes:
        # Other jobs' totals are theirs: the message names only this job's share.
        room = limits.max_kv_bytes
        if job.gen.kv_bytes >= limits.kv_reserve:
            # Fair share: a job already holding the reserve's size leaves the last
            # bytes to jobs holding less.
            room -= limits.kv_reserve
        if after > room:
            raise validation.limit_exceeded(
                "max_kv_bytes",
                f"the daemon's key-value store is full for job {job.job_id!r}, which holds "
                f"{job.gen.kv_bytes} bytes (max_kv_bytes={limits.max_kv_bytes} across all "
                f"jobs, the last {limits.kv_reserve} kept for jobs holding less): it cannot "
                f"store {len(value)} more bytes until keys are deleted or jobs end (or "
                "raise --max-kv-bytes)",
                job_id=job.job_id,
            )
    job.gen.kv[key] = value
    job.gen.kv_bytes = grown
    return job.gen.kv_waiters.pop(key, set())


def left(job: Job, rank: int, key: str) -> RendezvousFault:
    """The fault of rank ``rank``'s wait for ``key`` once it left the job."""
    return fences.left(job, rank, f"its wait for key {quoted(key)} ends")


def delete(job: Job, key: str) -> bool:
    value = job.gen.kv.pop(key, None)
    if value is None:
        return False
    job.gen.kv_bytes -= entry_bytes(key, value)
    return True


def counter(job: Job, key: str, delta: int) -> bytes:
    """The counter under ``key`` (absent = 0) plus ``delta``, encoded for storing."""
    raw = job.gen.kv.get(key, b"0")
    if not _COUNTER.fullmatch(raw):
        raise RendezvousFault(
            Code.FAILED_PRECONDITION,
            Reason.NOT_A_COUNTER,
            f"key {quoted(key)} of job {job.job_id!r} holds a value that is not a plain decimal "
            "integer (digits with an optional leading '-'); KvAdd needs a counter",
            {"job_id": job.job_id},
        )
    total = int(raw) + delta
    if not -(2**63) <= total < 2**63:
        raise validation.invalid(
            Reason.INVALID_ARGUMENT,
            f"KvAdd on {quoted(key)} of job {job.job_id!r} would overflow int64",
        )
    return str(total).encode("ascii")
