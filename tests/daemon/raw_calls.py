"""Raw gRPC calls against a daemon process: bodies the SDK would never send."""

from __future__ import annotations

from typing import Any

import grpc
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client import (
    Membership,
    RendezvousClient,
)
from tests.support import DaemonProcess

KIB = 1024
SERVICE = "rendezvous.v1.Rendezvous"
METHODS = list(pb.DESCRIPTOR.services_by_name["Rendezvous"].methods_by_name)
UNARY = [m for m in METHODS if m != "Heartbeat"]


def _identity(data: bytes) -> bytes:
    return data


def bearer(d: DaemonProcess) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {d.token}")]


def reason_of(exc: grpc.RpcError) -> tuple[str, dict[str, str]]:
    status = rpc_status.from_call(exc)
    for detail in status.details if status is not None else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info.reason, dict(info.metadata)
    return "", {}


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
