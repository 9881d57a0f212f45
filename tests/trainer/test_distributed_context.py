"""``init_distributed`` misuse in real workers under a real ``rendezvous-run``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def test_a_second_init_distributed_under_the_launcher_fails_instead_of_hanging(
    tmp_path: Path,
) -> None:
    script = tmp_path / "twice.py"
    script.write_text(
        "from rendezvousd.trainer.distributed import init_distributed\n"
        "with init_distributed() as ctx:\n"
        "    init_distributed()\n"
    )
    launcher = [sys.executable, "-m", "rendezvousd.trainer.agent.launcher", "--standalone"]
    proc = subprocess.Popen(
        [*launcher, "--nproc-per-node", "2", str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the launcher stops its workers on SIGTERM
        proc.communicate(timeout=60)
        pytest.fail("the second init_distributed() waited for a second assignment forever")
    assert proc.returncode != 0
    assert "init_distributed() was already called in this worker" in err, err[-3000:]
    assert "rendezvous-run assigns each worker once" in err
