"""Raw gRPC calls against a daemon process: bodies the SDK would never send."""

from __future__ import annotations

from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from rendezvousd.client import (
    Membership,
    RendezvousClient,
)
from rendezvousd.client.errors import error_info
from tests.support import DaemonProcess, members, wait_for

KIB = 1024
SERVICE = "rendezvous.v1.Rendezvous"
METHODS = list(pb.DESCRIPTOR.services_by_name["Rendezvous"].methods_by_name)
UNARY = [
    m.name for m in pb.DESCRIPTOR.services_by_name["Rendezvous"].methods if not m.client_streaming
]


def _identity(data: bytes) -> bytes:
    return data


def bearer(d: DaemonProcess) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {d.token}")]


def reason_of(exc: grpc.RpcError) -> tuple[str, dict[str, str]]:
    """(reason, metadata) of the status's ErrorInfo, as the SDK reads them."""
    return error_info(exc)


def raw(
    channel: grpc.Channel, method: str, body: bytes, metadata: Any, timeout: float = 5.0
) -> grpc.RpcError | None:
    """The error of one generic unary call, or None when it succeeded."""
    try:
        channel.unary_unary(
            f"/{SERVICE}/{method}", request_serializer=_identity, response_deserializer=_identity
        )(body, metadata=metadata, timeout=timeout)
    except grpc.RpcError as exc:
        return exc
    return None


def assert_healthy(d: DaemonProcess, job_id: str) -> None:
    """SERVING, and a fresh 1x1 join completes."""
    assert d.proc.poll() is None, "the daemon exited"
    with grpc.insecure_channel(d.endpoint) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert status.status == health_pb2.HealthCheckResponse.SERVING
    with RendezvousClient(d.endpoint, job_id, token=d.token) as client:
        m = client.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        assert m.world_size == 1


def join_one(client: RendezvousClient) -> Membership:
    return client.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)


def join_request(job_id: str, world: int, local_rank: int, **fields: Any) -> pb.JoinRequest:
    """``local_rank``'s Join of a 1 x ``world`` job, with the other ``fields`` given."""
    return pb.JoinRequest(
        job_id=job_id,
        topology=pb.Topology(num_nodes=1, gpus_per_node=world),
        node_rank=0,
        local_rank=local_rank,
        **fields,
    )


def park_joins(
    d: DaemonProcess,
    job_id: str,
    ranks: list[int],
    world: int,
    *,
    host: str = "parked",
    wait_s: int = 30,
) -> list[Any]:
    """Start raw Join calls of a 1 x ``world`` job that park (rank 0 never comes)."""
    stub = pb_grpc.RendezvousStub(grpc.insecure_channel(d.endpoint))
    return [
        stub.Join.future(
            join_request(
                job_id,
                world,
                rank,
                host=host,
                instance_id=f"{host}-{rank}",
                wait_timeout_ms=wait_s * 1000,
            ),
            metadata=bearer(d),
            timeout=wait_s + 5,
        )
        for rank in ranks
    ]


def wait_members(d: DaemonProcess, job_id: str, n: int) -> None:
    wait_for(f"{n} joins to register", lambda: len(members(d, job_id)) == n)
