"""What the sync and asyncio clients share: settings, channel options, retries,
request building and the membership they hold after a join. No I/O here."""

from __future__ import annotations

import functools
import json
import os
import random
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client.errors import (
    DaemonUnavailable,
    InvalidRequest,
    JobAborted,
    PeerFailed,
    RendezvousError,
    RendezvousTimeout,
    from_rpc_error,
)

SERVICE = "rendezvous.v1.Rendezvous"
HEALTH_SERVICE = "grpc.health.v1.Health"
TOKEN_ENV = "RENDEZVOUSD_TOKEN"
TOKEN_FILE_ENV = "RENDEZVOUSD_TOKEN_FILE"
UNIQUE_ID_BYTES = 128
# Extra deadline beyond a waiting call's own timeout, so the daemon's answer
# (which names the missing ranks) arrives before the transport gives up.
SLACK_S = 5.0

# Safe to repeat: Join/PublishId by instance id, Barrier by sequence, sets overwrite.
IDEMPOTENT = frozenset(
    {
        "Join",
        "PublishId",
        "Barrier",
        "KvSet",
        "KvGet",
        "KvDelete",
        "Heartbeat",
        "Leave",
        "AbortJob",
        "ListJobs",
        "GetJob",
        "Check",
    }
)
# Reads may also be retried after DEADLINE_EXCEEDED (gRFC A6 leaves this to the caller).
READS = frozenset({"KvGet", "ListJobs", "GetJob", "Check"})


@dataclass(frozen=True)
class RetryPolicy:
    """The seed's policy: ``attempts`` retries on a transient error, then a loud error.

    Transient = UNAVAILABLE for idempotent methods, plus DEADLINE_EXCEEDED for
    reads. Permanent errors (bad input, auth, peer failure...) get one attempt.
    Under each attempt gRPC's own service-config retry re-sends on UNAVAILABLE.
    """

    attempts: int = 1
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 2.0

    def __post_init__(self) -> None:
        if self.attempts < 0:
            raise ValueError(f"retry attempts={self.attempts} must be >= 0")

    def retryable(self, method: str, code: grpc.StatusCode) -> bool:
        if code is grpc.StatusCode.UNAVAILABLE:
            return method in IDEMPOTENT
        return code is grpc.StatusCode.DEADLINE_EXCEEDED and method in READS

    def backoff(self, attempt: int) -> float:
        """Full-jitter exponential backoff before retry number ``attempt`` (1-based)."""
        cap = min(self.max_backoff_s, self.initial_backoff_s * 2 ** (attempt - 1))
        return random.uniform(cap / 2, cap)


def service_config(channel_retries: int) -> str:
    retry = {
        "maxAttempts": max(2, min(5, channel_retries + 1)),
        "initialBackoff": "0.1s",
        "maxBackoff": "1s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    safe = sorted(IDEMPOTENT - {"Check", "Heartbeat"})
    return json.dumps(
        {
            "methodConfig": [
                {
                    "name": [{"service": SERVICE, "method": m} for m in safe]
                    + [{"service": HEALTH_SERVICE}],
                    "waitForReady": True,
                    "retryPolicy": retry,
                },
                {
                    # Not idempotent: wait for the daemon, but never re-send.
                    "name": [
                        {"service": SERVICE, "method": m} for m in ("KvAdd", "KvCompareAndSet")
                    ]
                    + [{"service": SERVICE, "method": "Heartbeat"}],
                    "waitForReady": True,
                },
            ]
        }
    )


@dataclass(frozen=True)
class TlsConfig:
    """PEM paths: ``ca`` verifies the daemon; ``cert``/``key`` for mTLS."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        def read(p: Path | None) -> bytes | None:
            return p.read_bytes() if p is not None else None

        return grpc.ssl_channel_credentials(read(self.ca), read(self.key), read(self.cert))


def resolve_token(token: str | None, token_file: Path | str | None) -> str:
    if token:
        return token.strip()
    path = token_file or os.environ.get(TOKEN_FILE_ENV)
    if path:
        try:
            lines = [ln.strip() for ln in Path(path).read_text().splitlines() if ln.strip()]
        except OSError as exc:
            raise InvalidRequest(f"cannot read token file {path}: {exc.strerror}") from exc
        if lines:
            return lines[0]
        raise InvalidRequest(f"token file {path} is empty")
    env = os.environ.get(TOKEN_ENV, "").strip()
    if env:
        return env
    raise InvalidRequest(
        f"no rendezvous token: pass token= or token_file=, or set ${TOKEN_ENV} / ${TOKEN_FILE_ENV}"
    )


def channel_options(retry: RetryPolicy, server_name: str | None) -> list[tuple[str, object]]:
    options: list[tuple[str, object]] = [
        ("grpc.enable_retries", 1),
        ("grpc.service_config", service_config(retry.attempts)),
        ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        # Redial quickly once the daemon is back (default backoff grows to 120 s).
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    return options


@dataclass(frozen=True)
class Member:
    rank: int
    node_rank: int
    local_rank: int
    host: str
    address: str


@dataclass(frozen=True)
class Membership:
    """What a join gives a worker. ``unique_id`` is kept out of repr and logs."""

    job_id: str
    generation: int
    rank: int
    world_size: int
    node_rank: int
    local_rank: int
    unique_id: bytes = field(repr=False)
    # Decoded on first use: at thousands of ranks, building every rank's copy
    # of the table eagerly costs more than the whole rendezvous.
    _table: Any = field(repr=False, compare=False, default=())

    @functools.cached_property
    def members(self) -> tuple[Member, ...]:
        return tuple(
            Member(m.rank, m.node_rank, m.local_rank, m.host, m.address) for m in self._table
        )

    @property
    def num_nodes(self) -> int:
        return len({m.node_rank for m in self.members}) or 1


def membership(response: pb.JoinResponse) -> Membership:
    return Membership(
        job_id=response.job_id,
        generation=response.generation,
        rank=response.rank,
        world_size=response.world_size,
        node_rank=response.node_rank,
        local_rank=response.local_rank,
        unique_id=response.unique_id,
        _table=response.members,
    )


@dataclass
class Session:
    """Per-client state: the membership, barrier counts and any failure seen."""

    endpoint: str
    job_id: str
    token: str
    retry: RetryPolicy
    call_timeout: float
    connect_timeout: float
    instance_id: str = ""
    joined: Membership | None = None
    barrier_counts: dict[str, int] = field(default_factory=dict)
    failure: RendezvousError | None = None
    on_failure: Callable[[RendezvousError], None] | None = None

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),)

    def new_instance(self) -> str:
        # A fresh identity per join() call; retries inside that call reuse it.
        self.instance_id = secrets.token_hex(16)
        return self.instance_id

    def member(self) -> Membership:
        if self.failure is not None:
            raise self.failure
        if self.joined is None:
            raise InvalidRequest(
                f"not joined to job {self.job_id!r}: call join() first", job_id=self.job_id
            )
        return self.joined

    def plan_join(
        self,
        *,
        num_nodes: int,
        gpus_per_node: int,
        local_rank: int,
        node_rank: int | None,
        host: str | None,
        address: str,
        unique_id: bytes | None,
        id_factory: Callable[[], bytes] | None,
        timeout: float,
    ) -> JoinPlan:
        """Start a join: a fresh instance id, cleared state, and the first request."""
        self.new_instance()
        self.joined, self.failure, self.barrier_counts = None, None, {}
        plan = JoinPlan(self, unique_id, id_factory, timeout, time.monotonic())
        known_rank_zero = node_rank == 0 and local_rank == 0
        plan.request = pb.JoinRequest(
            job_id=self.job_id,
            topology=pb.Topology(num_nodes=num_nodes, gpus_per_node=gpus_per_node),
            local_rank=local_rank,
            host=host or socket.gethostname(),
            address=address,
            unique_id=plan.make_id() if known_rank_zero else b"",
            instance_id=self.instance_id,
            wait_timeout_ms=int(timeout * 1000),
        )
        if node_rank is not None:
            plan.request.node_rank = node_rank
        return plan

    def next_barrier(self, name: str) -> int:
        self.barrier_counts[name] = self.barrier_counts.get(name, 0) + 1
        return self.barrier_counts[name]

    def event_error(self, event: pb.JobEvent) -> RendezvousError | None:
        """The error a heartbeat event means for this member, if any."""
        me = self.joined.rank if self.joined else None
        if event.kind == pb.JobEvent.PEER_FAILED:
            lost = ", ".join(f"rank {f.rank} on {f.host} ({f.cause})" for f in event.failed[:8])
            return PeerFailed(
                f"job {event.job_id!r} generation {event.generation} failed: lost {lost}",
                code="ABORTED",
                reason="PEER_FAILED",
                endpoint=self.endpoint,
                method="Heartbeat",
                job_id=event.job_id,
                rank=me,
                metadata={
                    "ranks": ",".join(str(f.rank) for f in event.failed),
                    "hosts": ",".join(sorted({f.host for f in event.failed})),
                    "generation": str(event.generation),
                },
            )
        if event.kind == pb.JobEvent.JOB_ABORTED:
            return JobAborted(
                f"job {event.job_id!r} generation {event.generation} was aborted: {event.reason}",
                code="ABORTED",
                reason="JOB_ABORTED",
                endpoint=self.endpoint,
                method="Heartbeat",
                job_id=event.job_id,
                rank=me,
                metadata={"reason": event.reason},
            )
        return None

    def fail(self, error: RendezvousError) -> None:
        if self.failure is None:
            self.failure = error
            if self.on_failure is not None:
                self.on_failure(error)

    def exhausted(self, method: str, attempts: int, last: RendezvousError) -> RendezvousError:
        if isinstance(last, (DaemonUnavailable, RendezvousTimeout)) and last.reason == "":
            return DaemonUnavailable(
                f"{method} to rendezvousd at {self.endpoint} (job {self.job_id!r}) failed after "
                f"{attempts} attempt{'s' if attempts > 1 else ''}: {last.code or 'no answer'}; "
                "is the daemon running and reachable?",
                attempts=attempts,
                code=last.code,
                endpoint=self.endpoint,
                method=method,
                job_id=self.job_id,
                rank=last.rank,
            )
        return last


_TRANSIENT_STREAM_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)


@dataclass
class StreamWatch:
    """What the heartbeat loops (thread and task) decide; they only do the I/O."""

    session: Session
    member: Membership
    reconnect_window: float
    outage_since: float | None = None
    attempt: int = 0

    def on_event(self, event: pb.JobEvent) -> str:
        """ "stop" (the member failed), "reconnect" (daemon draining) or "continue"."""
        self.outage_since, self.attempt = None, 0
        error = self.session.event_error(event)
        if error is not None:
            self.session.fail(error)
            return "stop"
        return "reconnect" if event.kind == pb.JobEvent.DAEMON_DRAINING else "continue"

    def on_error(self, exc: grpc.RpcError) -> bool:
        """True to reconnect; False when the error ends this member."""
        if exc.code() in _TRANSIENT_STREAM_CODES:
            return True
        self.session.fail(
            from_rpc_error(
                exc,
                endpoint=self.session.endpoint,
                method="Heartbeat",
                job_id=self.member.job_id,
                rank=self.member.rank,
            )
        )
        return False

    def next_backoff(self) -> float | None:
        """Seconds to wait before reconnecting, or None once the outage is too long."""
        now = time.monotonic()
        self.outage_since = self.outage_since or now
        if now - self.outage_since > self.reconnect_window:
            self.session.fail(
                DaemonUnavailable(
                    f"lost the heartbeat stream to rendezvousd at {self.session.endpoint} for more than "
                    f"{self.reconnect_window:g} s (job {self.member.job_id!r}, rank {self.member.rank})",
                    code="UNAVAILABLE",
                    endpoint=self.session.endpoint,
                    method="Heartbeat",
                    job_id=self.member.job_id,
                    rank=self.member.rank,
                )
            )
            return None
        self.attempt += 1
        return self.session.retry.backoff(self.attempt)


def rank_zero_id(unique_id: bytes | None, id_factory: Callable[[], bytes] | None) -> bytes:
    """Rank 0's id: the caller's bytes, else ``id_factory()`` (e.g. NCCL's), else 128
    random bytes (all the CPU backend needs: it keys the ring's HMAC)."""
    return unique_id or (id_factory() if id_factory else os.urandom(UNIQUE_ID_BYTES))


@dataclass
class JoinPlan:
    """The decisions of one ``join()`` call, shared by the sync and asyncio clients."""

    session: Session
    unique_id: bytes | None
    id_factory: Callable[[], bytes] | None
    timeout: float
    started: float
    request: pb.JoinRequest = field(default_factory=pb.JoinRequest)

    def make_id(self) -> bytes:
        """Rank 0's id: the caller's bytes, else ``id_factory()``, else 128 random bytes."""
        return self.unique_id or (
            self.id_factory() if self.id_factory else os.urandom(UNIQUE_ID_BYTES)
        )

    def left(self) -> float:
        return max(0.001, self.timeout - (time.monotonic() - self.started))

    def fresh_id_after(self, error: RendezvousError) -> bool:
        """True when the Join should be sent again with a new id.

        A restarted daemon fenced the generation our id belonged to: a fresh id is
        all rank 0 needs, unless the caller pinned the bytes.
        """
        if error.reason != "ID_REUSED" or self.unique_id is not None:
            return False
        self.request.unique_id = self.make_id()
        return True

    def publish_request(self, response: pb.JoinResponse) -> pb.PublishIdRequest:
        return pb.PublishIdRequest(
            job_id=self.session.job_id,
            generation=response.generation,
            rank=response.rank,
            instance_id=self.session.instance_id,
            unique_id=self.make_id(),
            wait_timeout_ms=int(self.left() * 1000),
        )

    def finish(self, response: pb.JoinResponse) -> Membership:
        self.session.joined = membership(response)
        return self.session.joined
