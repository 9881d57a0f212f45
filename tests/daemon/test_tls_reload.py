"""SIGHUP reads the daemon's TLS files again: a certificate renewed before it expires
(cert-manager, an ACME client) is served without a restart. A real daemon process;
its files are replaced atomically and the signal sent, as `systemctl reload` does."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client import RendezvousClient, TlsConfig
from tests.support import DaemonProcess, Pki, make_pki, spawn_daemon


def _pki(root: Path) -> Pki:
    root.mkdir()
    return make_pki(root)


def _answers(d: DaemonProcess, ca: Path, client: tuple[Path, Path] | None = None) -> bool:
    """Whether a new connection that trusts ``ca`` (and shows ``client``'s certificate
    and key) gets a health answer: its handshake took."""
    key, cert = (None, None) if client is None else (client[1].read_bytes(), client[0].read_bytes())
    trust = grpc.ssl_channel_credentials(ca.read_bytes(), key, cert)
    with grpc.secure_channel(d.endpoint, trust) as ch:
        try:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as exc:
            assert exc.code() is grpc.StatusCode.UNAVAILABLE, exc
            return False
    return True


def _https_trusted_by(url: str, ca: Path) -> bool:
    """Whether the metrics port's certificate verifies against ``ca``."""
    host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    context = ssl.create_default_context(cafile=str(ca))
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        try:
            with context.wrap_socket(raw, server_hostname=host):
                return True
        except ssl.SSLCertVerificationError:
            return False


def _install(new: Pki, served: Pki) -> None:
    """``new``'s server certificate and key (and client CA) over the served files,
    each moved into place whole, the key kept 0600."""
    for source, target in (
        (new.server, served.server),
        (new.server_key, served.server_key),
        (new.ca, served.ca),
    ):
        tmp = target.with_suffix(".new")
        shutil.copy2(source, tmp)
        os.replace(tmp, target)


def test_sighup_serves_a_renewed_certificate_to_new_connections(tmp_path: Path) -> None:
    served, renewed = _pki(tmp_path / "served"), _pki(tmp_path / "renewed")
    old_ca = tmp_path / "old-ca.pem"
    shutil.copy2(served.ca, old_ca)
    d = spawn_daemon(tmp_path, *served.serve_args(), "--metrics-listen", "127.0.0.1:0")
    try:
        assert d.metrics_url is not None
        # A member joined over the old certificate: its connection outlives the reload.
        with RendezvousClient(
            d.endpoint, "tls-job", token=d.token, tls=TlsConfig(ca=old_ca), connect_timeout=10
        ) as member:
            member.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
            member.start_heartbeat(0.2)
            assert _answers(d, old_ca) and not _answers(d, renewed.ca)

            _install(renewed, served)
            line = d.reload("TLS files reloaded")
            assert "(was " in line

            assert _answers(d, renewed.ca), "new connections still get the old certificate"
            assert not _answers(d, old_ca)
            assert _https_trusted_by(d.metrics_url, renewed.ca)
            assert not _https_trusted_by(d.metrics_url, old_ca)
            # The member's open connection kept its session: its calls go on.
            member.kv_set("after", b"reload")
            assert member.kv_get("after", wait=False) == b"reload"
            assert member.get_job().summary.state == pb.JOB_STATE_RUNNING

            # The same files again: said, nothing changes.
            assert "unchanged" in d.reload("read again, unchanged")
            assert _answers(d, renewed.ca)
    finally:
        d.kill()


def test_a_bad_reload_keeps_serving_the_certificate_it_had(tmp_path: Path) -> None:
    served, other = _pki(tmp_path / "served"), _pki(tmp_path / "other")
    d = spawn_daemon(tmp_path, *served.serve_args())
    try:
        # A key that does not belong to the certificate (a renewal half copied).
        shutil.copy2(other.server_key, served.server_key)
        line = d.reload("TLS files not reloaded")
        assert "does not belong to certificate" in line and "still serving" in line
        assert _answers(d, served.ca)
        # A key others can read is refused as at start-up.
        shutil.copy2(other.server, served.server)
        served.server_key.chmod(0o644)
        line = d.reload("TLS files not reloaded")
        assert "more than 0600" in line
        assert _answers(d, served.ca) and not _answers(d, other.ca)
    finally:
        d.kill()


def test_sighup_reads_a_rotated_client_ca(tmp_path: Path) -> None:
    served, renewed = _pki(tmp_path / "served"), _pki(tmp_path / "renewed")
    # The daemon's own certificate stays, trusted by the CA that issued it.
    daemon_ca = tmp_path / "daemon-ca.pem"
    shutil.copy2(served.ca, daemon_ca)
    d = spawn_daemon(tmp_path, *served.serve_args(mtls=True))
    try:
        new_client = (renewed.client, renewed.client_key)
        old_client = (served.client, served.client_key)
        assert _answers(d, daemon_ca, old_client) and not _answers(d, daemon_ca, new_client)
        # The clients' CA rotated (--tls-client-ca's file replaced).
        tmp = served.ca.with_suffix(".new")
        shutil.copy2(renewed.ca, tmp)
        os.replace(tmp, served.ca)
        assert "client CA" in d.reload("TLS files reloaded")
        assert _answers(d, daemon_ca, new_client)
        assert not _answers(d, daemon_ca, old_client)
    finally:
        d.kill()
