"""The daemon from a stock tool's point of view: the real grpcurl binary.

Proves that reflection, the health service and JSON transcoding work for any
gRPC client, not only our SDK. The token goes in via -H and never reaches an
assertion message.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2

from rendezvousd.client import RendezvousClient
from tests.support import DaemonProcess

_NEXT_TO_PYTHON = Path(sys.executable).parent / "grpcurl"
GRPCURL = str(_NEXT_TO_PYTHON) if _NEXT_TO_PYTHON.exists() else shutil.which("grpcurl")

pytestmark = pytest.mark.skipif(GRPCURL is None, reason="grpcurl binary not installed")


def grpcurl(
    d: DaemonProcess, *target: str, options: tuple[str, ...] = (), token: bool = True
) -> subprocess.CompletedProcess[str]:
    """``grpcurl -plaintext [auth] OPTIONS ENDPOINT TARGET...``; the token is masked."""
    assert GRPCURL is not None
    auth = ["-H", f"authorization: Bearer {d.token}"] if token else []
    result = subprocess.run(
        [GRPCURL, "-plaintext", "-max-time", "20", *auth, *options, d.endpoint, *target],
        capture_output=True,
        text=True,
        timeout=60,
    )
    result.stdout = result.stdout.replace(d.token, "<token>")
    result.stderr = result.stderr.replace(d.token, "<token>")
    return result


def test_list_services(daemon: DaemonProcess) -> None:
    result = grpcurl(daemon, "list")
    assert result.returncode == 0, result.stderr
    services = set(result.stdout.split())
    assert services == {
        "rendezvous.v1.Rendezvous",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }, result.stdout


def test_list_without_token_is_unauthenticated(daemon: DaemonProcess) -> None:
    result = grpcurl(daemon, "list", token=False)
    assert result.returncode != 0
    assert "Unauthenticated" in result.stderr, result.stderr
    assert "rendezvous.v1.Rendezvous" not in result.stdout
    bad_header = "authorization: Bearer " + "w" * 43
    wrong = subprocess.run(
        [GRPCURL or "", "-plaintext", "-H", bad_header, daemon.endpoint, "list"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert wrong.returncode != 0 and "Unauthenticated" in wrong.stderr


def test_describe(daemon: DaemonProcess) -> None:
    result = grpcurl(daemon, "describe", "rendezvous.v1.Rendezvous")
    assert result.returncode == 0, result.stderr
    assert "rendezvous.v1.Rendezvous is a service" in result.stdout
    for rpc in ("Join", "PublishId", "Barrier", "KvSet", "GetJob", "ListJobs", "AbortJob"):
        assert f"rpc {rpc} (" in result.stdout, rpc
    assert "rpc Heartbeat ( stream .rendezvous.v1.HeartbeatRequest )" in result.stdout
    message = grpcurl(daemon, "describe", "rendezvous.v1.GetJobResponse")
    assert message.returncode == 0, message.stderr
    assert "id_published" in message.stdout
    assert "unique_id" not in message.stdout  # inspection never carries the id


@pytest.fixture(scope="module")
def health_protoset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """health.proto as a FileDescriptorSet, so grpcurl needs no (authenticated) reflection."""
    files = descriptor_pb2.FileDescriptorSet()
    health_pb2.DESCRIPTOR.CopyToProto(files.file.add())
    path = tmp_path_factory.mktemp("protoset") / "health.protoset"
    path.write_bytes(files.SerializeToString())
    return path


def test_health_check_without_token(daemon: DaemonProcess, health_protoset: Path) -> None:
    for service in ("", "rendezvous.v1.Rendezvous"):
        result = grpcurl(
            daemon,
            "grpc.health.v1.Health/Check",
            options=("-protoset", str(health_protoset), "-d", json.dumps({"service": service})),
            token=False,
        )
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout) == {"status": "SERVING"}
    # Through reflection, the descriptor lookup itself needs the token (by design).
    result = grpcurl(daemon, "grpc.health.v1.Health/Check", token=False)
    assert result.returncode != 0 and "Unauthenticated" in result.stderr
    result = grpcurl(daemon, "grpc.health.v1.Health/Check")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"status": "SERVING"}


def test_get_job_after_join_shows_no_unique_id(daemon: DaemonProcess, job_id: str) -> None:
    unique_id = bytes(range(1, 129))
    with RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as client:
        m = client.join(
            num_nodes=1,
            gpus_per_node=1,
            node_rank=0,
            local_rank=0,
            host="grpcurl-host",
            address="10.0.0.1:1234",
            unique_id=unique_id,
            timeout=10,
        )
        assert m.unique_id == unique_id
        result = grpcurl(
            daemon,
            "rendezvous.v1.Rendezvous/GetJob",
            options=("-d", json.dumps({"job_id": job_id})),
        )
        listed = grpcurl(daemon, "rendezvous.v1.Rendezvous/ListJobs", options=("-d", "{}"))
    assert result.returncode == 0, result.stderr
    job = json.loads(result.stdout)
    summary = job["summary"]
    assert summary.get("job_id", summary.get("jobId")) == job_id
    assert summary["state"] == "JOB_STATE_RUNNING"
    assert job.get("id_published", job.get("idPublished")) is True
    member = job["members"][0]["member"]
    assert member["host"] == "grpcurl-host"
    assert member["address"] == "10.0.0.1:1234"
    for text in (result.stdout, listed.stdout):
        assert not [k for k in _keys(json.loads(text)) if "unique" in k.lower()]
        for encoded in (
            base64.b64encode(unique_id).decode(),
            base64.urlsafe_b64encode(unique_id).decode(),
            unique_id.hex(),
            base64.b64encode(unique_id[:30]).decode(),
        ):
            assert encoded not in text, "the unique id leaked into inspection output"
    assert listed.returncode == 0, listed.stderr
    assert job_id in {j.get("job_id", j.get("jobId")) for j in json.loads(listed.stdout)["jobs"]}


def _keys(value: object) -> list[str]:
    """Every JSON object key, at any depth."""
    if isinstance(value, dict):
        return [*value, *(k for v in value.values() for k in _keys(v))]
    if isinstance(value, list):
        return [k for v in value for k in _keys(v)]
    return []


def test_error_details_reach_grpcurl(daemon: DaemonProcess) -> None:
    # grpcurl prints google.rpc.Status details: the ErrorInfo reason is visible to any client.
    result = grpcurl(
        daemon,
        "rendezvous.v1.Rendezvous/GetJob",
        options=("-d", json.dumps({"job_id": "no-such-job-xyz"}), "-format-error"),
    )
    assert result.returncode != 0
    text = result.stdout + result.stderr
    assert "NotFound" in text or "NOT_FOUND" in text or '"code": 5' in text, text
    assert "JOB_NOT_FOUND" in text, text
    assert "rendezvous.v1" in text, text
