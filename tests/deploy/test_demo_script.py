"""The README's demo commands, run as documented: ``scripts/demo.sh`` with its flags.

demo.sh sources ``_venv.sh``; sourced without arguments that got demo.sh's own "$1",
and pip then ran ``pip install -e ".[--hosts]"``: every documented flag failed.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from rendezvousd.trainer.demo.netns import unavailable_reason
from tests.support import ROOT

DEMO = ROOT / "scripts" / "demo.sh"


def _set_up_by_venv_sh() -> bool:
    """Whether ``.venv`` was installed by _venv.sh for this pyproject.toml, so that
    demo.sh runs without installing anything (no network, no pip in a test)."""
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()[:16]
    return any((ROOT / ".venv").glob(f".installed-{digest}-*"))


pytestmark = pytest.mark.skipif(
    not _set_up_by_venv_sh(), reason="the .venv was not set up by scripts/_venv.sh"
)


def _demo(*flags: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RENDEZVOUSD_")}
    return subprocess.run(
        ["bash", str(DEMO), *flags], capture_output=True, text=True, timeout=timeout,
        check=False, env=env,
    )  # fmt: skip


def _assert_scorecard(done: subprocess.CompletedProcess[str], out: Path, steps: int) -> None:
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "pip" not in done.stderr and "InvalidRequirement" not in done.stderr
    card = json.loads(out.read_text())
    assert card["steps"] == steps, card
    assert f"scorecard written to {out}" in done.stdout + done.stderr


@pytest.mark.slow
def test_demo_with_steps_and_out_runs_and_writes_the_scorecard(tmp_path: Path) -> None:
    out = tmp_path / "card.json"
    _assert_scorecard(_demo("--steps", "2", "--out", str(out)), out, 2)


def test_demo_hands_hosts_to_the_demo_not_to_pip(tmp_path: Path) -> None:
    # A value the demo itself refuses: cheap, and only the demo can say this.
    done = _demo("--hosts", "-1", "--steps", "2", "--out", str(tmp_path / "c.json"))
    assert done.returncode == 2, done.stderr
    assert "--hosts=-1 must be >= 0" in done.stderr, done.stderr


@pytest.mark.slow
@pytest.mark.skipif(unavailable_reason() is not None, reason=f"--hosts: {unavailable_reason()}")
def test_demo_on_three_network_hosts_as_the_readme_says(tmp_path: Path) -> None:
    out = tmp_path / "card.json"
    _assert_scorecard(_demo("--hosts", "3", "--steps", "2", "--out", str(out)), out, 2)


@pytest.mark.parametrize("bad", [(), ("--hosts",), ("a", "b")])
def test_venv_sh_refuses_anything_but_one_extra_name(bad: tuple[str, ...]) -> None:
    script = f'source {ROOT / "scripts" / "_venv.sh"} "$@"; echo sourced'
    done = subprocess.run(
        ["bash", "-c", script, "venv-test", *bad], capture_output=True, text=True,
        timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "sourced" not in done.stdout, done
    assert "_venv.sh:" in done.stderr and '"" for none' in done.stderr, done.stderr
