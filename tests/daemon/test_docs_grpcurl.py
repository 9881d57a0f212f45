"""Every grpcurl command in docs/operations.md ("Inspecting") works as written."""

from __future__ import annotations

import re
import shlex
import subprocess

import pytest

from rendezvousd.client import RendezvousClient
from tests.daemon.test_grpcurl import GRPCURL
from tests.support import ROOT, DaemonProcess

pytestmark = pytest.mark.skipif(GRPCURL is None, reason="grpcurl binary not installed")


def doc_commands() -> list[str]:
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text.split("## Inspecting", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.startswith("grpcurl ")]


def test_the_docs_show_a_health_command() -> None:
    assert any("Health/Check" in c for c in doc_commands())


@pytest.mark.parametrize("command", doc_commands())
def test_doc_grpcurl_command_works(daemon: DaemonProcess, job_id: str, command: str) -> None:
    assert GRPCURL is not None
    with RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as client:
        client.join(num_nodes=1, gpus_per_node=1, local_rank=0)
    line = command.replace("HOST:29420", daemon.endpoint).replace("my-job", job_id)
    argv = [
        f"authorization: Bearer {daemon.token}" if a == "$T" else a
        for a in shlex.split(line.replace('"$T"', "'$T'"))
    ]
    argv[0] = GRPCURL
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    shown = re.sub(re.escape(daemon.token), "<token>", result.stderr)
    assert result.returncode == 0, shown
