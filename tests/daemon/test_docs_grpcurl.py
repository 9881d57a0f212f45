"""Every grpcurl command in docs/operations.md ("Inspecting") works as written: the
plaintext ones against a plaintext daemon, the ``-cacert`` ones against a daemon
serving TLS (and requiring client certificates where the line gives ``-cert``)."""

from __future__ import annotations

import re
import shlex
import subprocess
from collections.abc import Iterator

import pytest

from rendezvousd.client import RendezvousClient, TlsConfig
from tests.daemon.test_grpcurl import GRPCURL
from tests.support import ROOT, DaemonProcess, Pki, spawn_daemon

pytestmark = pytest.mark.skipif(GRPCURL is None, reason="grpcurl binary not installed")


def doc_commands() -> list[str]:
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text.split("## Inspecting", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.startswith("grpcurl ")]


def test_the_docs_show_a_health_command() -> None:
    assert any("Health/Check" in c for c in doc_commands())


def test_the_docs_show_each_command_kind_over_tls() -> None:
    """The operator review's gap: every example was -plaintext, none for the TLS the
    docs recommend (a -plaintext call to it prints only "use of closed network
    connection")."""
    tls = [c for c in doc_commands() if "-cacert ca.crt" in c]
    assert any(c.endswith(" list") for c in tls), tls
    assert any("GetJob" in c for c in tls) and any("Health/Check" in c for c in tls), tls
    assert any("-authority NAME" in c for c in tls), tls
    assert any("-cert client.crt -key client.key" in c for c in tls), tls


@pytest.fixture(scope="module")
def tls_daemon(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[DaemonProcess]:
    d = spawn_daemon(tmp_path_factory.mktemp("tls"), *pki.serve_args())
    yield d
    d.kill()


@pytest.fixture(scope="module")
def mtls_daemon(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[DaemonProcess]:
    d = spawn_daemon(tmp_path_factory.mktemp("mtls"), *pki.serve_args(mtls=True))
    yield d
    d.kill()


@pytest.mark.parametrize("command", doc_commands())
def test_doc_grpcurl_command_works(
    request: pytest.FixtureRequest, pki: Pki, job_id: str, command: str
) -> None:
    assert GRPCURL is not None
    tls: TlsConfig | None = None
    if "-cert " in command:
        daemon: DaemonProcess = request.getfixturevalue("mtls_daemon")
        tls = TlsConfig(ca=pki.ca, cert=pki.client, key=pki.client_key)
    elif "-cacert " in command:
        daemon = request.getfixturevalue("tls_daemon")
        tls = TlsConfig(ca=pki.ca)
    else:
        daemon = request.getfixturevalue("daemon")
    with RendezvousClient(daemon.endpoint, job_id, token=daemon.token, tls=tls) as client:
        client.join(num_nodes=1, gpus_per_node=1, local_rank=0)
    line = command.replace("HOST:29420", daemon.endpoint).replace("my-job", job_id)
    files = {
        "ca.crt": str(pki.ca),
        "client.crt": str(pki.client),
        "client.key": str(pki.client_key),
        "NAME": "localhost",  # a name in the test certificate, not the address dialled
    }
    argv = [
        f"authorization: Bearer {daemon.token}" if a == "$T" else files.get(a, a)
        for a in shlex.split(line.replace('"$T"', "'$T'"))
    ]
    argv[0] = GRPCURL
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    shown = re.sub(re.escape(daemon.token), "<token>", result.stderr)
    assert result.returncode == 0, shown
