"""Limits and timings the state machine enforces (plain values, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass

KIB = 1024
MIB = 1024 * KIB


@dataclass(frozen=True)
class Limits:
    """Every bound a client can hit; exceeding one is RESOURCE_EXHAUSTED naming it."""

    max_message_bytes: int = 64 * KIB
    max_jobs: int = 1024
    max_members_per_job: int = 8192
    max_key_bytes: int = 512
    max_value_bytes: int = 32 * KIB
    max_keys_per_job: int = 32768
    max_kv_bytes_per_job: int = 64 * MIB
    # Daemon-wide: all jobs' keys and values together. Sized for the shipped 1 GiB
    # container limit: held once in memory; SQLite commits (incremental, or the whole
    # state after a storage failure) hand it the same bytes objects, not copies.
    max_kv_bytes: int = 128 * MIB
    # Parked calls cost ~26 KiB each (measured: gRPC call state, future, member
    # record): 16384 is ~420 MiB, inside the shipped 1 GiB container limit next to
    # max_kv_bytes. A job may hold half, so one job can never
    # block every other job's joins, and a world of max_members_per_job fits.
    max_waiters: int = 16384
    max_waiters_per_job: int = 8192
    # Barrier names per job generation (each is a sequence of rounds, so a
    # training loop needs a handful): bounds what one member can make us hold.
    max_barriers_per_job: int = 1024
    max_concurrent_rpcs: int = 100_000
    # Health calls carry no token: small budgets of their own, so that they never
    # take authenticated calls' slots, and watch streams never those of checks.
    max_health_checks: int = 64
    max_health_watches: int = 16
    max_host_bytes: int = 255
    max_reason_bytes: int = 1024

    @property
    def request_bytes(self) -> int:
        """The largest request message taken (gRPC's receive limit): ``max_message_bytes``,
        or room for a KvCompareAndSet of two values at ``max_value_bytes`` when that is
        more (framing included). A CAS of two 32 KiB values, the documented limit, was
        refused at 64 KiB, and a larger --max-value-bytes was taken but never reachable."""
        return max(self.max_message_bytes, 2 * self.max_value_bytes + self.max_key_bytes + 4 * KIB)

    @property
    def waiters_reserve(self) -> int:
        """The last parked-call slots, an eighth of ``max_waiters`` (2048 by default),
        kept for jobs holding fewer than that many: two jobs at max_waiters_per_job
        would otherwise fill the daemon, and a third could not even form."""
        return self.max_waiters // 8

    @property
    def parked_joins_per_job(self) -> int:
        """The node joins one job may hold parked for a later generation (standbys,
        scale-ups, its id's next run), half of ``max_waiters_per_job`` (4096 by
        default), counted apart from its members' parked calls: anyone holding the job's
        token may start standbys, and they must never take the room the members' own
        barriers and joins need. (A job may so hold 1.5 x max_waiters_per_job parked
        calls; ``max_waiters`` still bounds all jobs together.)"""
        return max(1, self.max_waiters_per_job // 2)

    @property
    def calls_per_job(self) -> int:
        """The most calls (streams included) one job's token may hold open at once: what a
        world of ``max_members_per_job`` needs, a call stream and a heartbeat stream per
        member (a node agent's serve its node's ranks), and ``max_waiters_per_job``
        parked unary calls (an SDK without the call stream). A call costs the daemon
        ~31 KiB from its headers on (measured: 20,000 idle call streams of one job
        token, 52 -> 672 MiB RSS): bounded only by --max-concurrent-rpcs (100,000: ~3 GiB),
        one job's token holder could have the daemon of every job killed for memory."""
        return 2 * self.max_members_per_job + self.max_waiters_per_job

    @property
    def kv_bytes_per_job(self) -> int:
        """What one job may hold: ``max_kv_bytes_per_job``, at most half of
        ``max_kv_bytes`` (a daemon given a small total would let one job take it all)."""
        return min(self.max_kv_bytes_per_job, self.max_kv_bytes // 2)

    @property
    def kv_reserve(self) -> int:
        """The last key-value bytes, an eighth of ``max_kv_bytes`` (16 MiB by default),
        kept for jobs holding fewer than that, as ``waiters_reserve`` keeps parked-call
        slots: two jobs at their share would otherwise fill the daemon."""
        return self.max_kv_bytes // 8


@dataclass(frozen=True)
class Timing:
    """Durations in seconds, measured on the monotonic clock."""

    # Silence after which a member is considered lost (a closed stream is immediate).
    heartbeat_timeout_s: float = 10.0
    # Used when a waiting call asks for 0 (the daemon's default).
    default_wait_s: float = 600.0
    # Ended, failed and empty jobs are forgotten this long after their last change.
    job_ttl_s: float = 600.0
    # Node joins (JoinNode) that ask for 0: once min_nodes joined, how long after the
    # last arrival more nodes may still join before the generation forms.
    default_last_call_s: float = 30.0
    # The longest any call waits, whatever it asks (wait_timeout_ms is a uint32: up to
    # ~49.7 days): a parked call, or rank 0's id owed, holds a slot meanwhile.
    max_wait_s: float = 600.0
    # After a node generation failed: how long the next one keeps a seat for each node
    # expected back (0: the heartbeat timeout, the silence after which the daemon
    # itself would give up on a node).
    seat_hold_s: float = 0.0

    @property
    def hold_s(self) -> float:
        """How long a seat is kept for a node expected back (``seat_hold_s``)."""
        return self.seat_hold_s or self.heartbeat_timeout_s
