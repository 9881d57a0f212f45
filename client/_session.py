"""What the sync and asyncio clients share: per-client session state, request
building and the heartbeat-stream decisions. No I/O here."""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client.connection import RetryPolicy
from rendezvousd.client.errors import (
    DaemonUnavailable,
    InvalidRequest,
    JobAborted,
    PeerFailed,
    RendezvousError,
    RendezvousTimeout,
    from_rpc_error,
)
from rendezvousd.client.membership import Membership, from_join_response

UNIQUE_ID_BYTES = 128
# Extra deadline beyond a waiting call's own timeout, so the daemon's answer
# (which names the missing ranks) arrives before the transport gives up.
SLACK_S = 5.0


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
        self.session.joined = from_join_response(response)
        return self.session.joined
