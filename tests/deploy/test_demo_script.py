"""The README's demo commands, run as documented: ``scripts/demo.sh`` with its flags.

demo.sh sources ``_venv.sh``; sourced without arguments that got demo.sh's own "$1",
and pip then ran ``pip install -e ".[--hosts]"``: every documented flag failed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT, need_hosts

DEMO = ROOT / "scripts" / "demo.sh"


def _set_up_by_venv_sh() -> bool:
    """Whether ``.venv`` was installed by _venv.sh for this pyproject.toml, so that
    demo.sh runs without installing anything (no network, no pip in a test)."""
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()[:16]
    return any((ROOT / ".venv").glob(f".installed-{digest}-*"))


#: The tests that run demo.sh or _venv.sh itself (the --help smoke test needs neither).
needs_venv_sh = pytest.mark.skipif(
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


@needs_venv_sh
@pytest.mark.slow
def test_demo_with_steps_and_out_runs_and_writes_the_scorecard(tmp_path: Path) -> None:
    out = tmp_path / "card.json"
    _assert_scorecard(_demo("--steps", "2", "--out", str(out)), out, 2)


@needs_venv_sh
def test_demo_hands_hosts_to_the_demo_not_to_pip(tmp_path: Path) -> None:
    # A value the demo itself refuses: cheap, and only the demo can say this.
    done = _demo("--hosts", "-1", "--steps", "2", "--out", str(tmp_path / "c.json"))
    assert done.returncode == 2, done.stderr
    assert "--hosts=-1 must be >= 0" in done.stderr, done.stderr


@needs_venv_sh
@pytest.mark.slow
def test_demo_on_three_network_hosts_as_the_readme_says(tmp_path: Path) -> None:
    need_hosts("the demo's --hosts")
    out = tmp_path / "card.json"
    _assert_scorecard(_demo("--hosts", "3", "--steps", "2", "--out", str(out)), out, 2)


@needs_venv_sh
@pytest.mark.parametrize("bad", [(), ("--hosts",), ("a", "b")])
def test_venv_sh_refuses_anything_but_one_extra_name(bad: tuple[str, ...]) -> None:
    script = f'source {ROOT / "scripts" / "_venv.sh"} "$@"; echo sourced'
    done = subprocess.run(
        ["bash", "-c", script, "venv-test", *bad], capture_output=True, text=True,
        timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "sourced" not in done.stdout, done
    assert "_venv.sh:" in done.stderr and '"" for none' in done.stderr, done.stderr


def test_the_demo_module_is_an_entry_point_taking_every_flag_its_users_are_shown() -> None:
    """demo.sh is ``exec .venv/bin/python -m rendezvousd.trainer.demo "$@"``: the module
    runs (its __main__.py), and each flag that demo.sh's usage line and the README
    give it is one the demo takes (read off the usage, not the description)."""
    assert 'python -m rendezvousd.trainer.demo "$@"' in DEMO.read_text()
    done = subprocess.run(
        [sys.executable, "-m", "rendezvousd.trainer.demo", "--help"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0 and done.stderr == "", done.stderr
    usage = done.stdout.split("\n\n", 1)[0]
    assert usage.startswith("usage: python -m rendezvousd.trainer.demo "), done.stdout
    taken = set(re.findall(r"\[(--[a-z][a-z-]*)", usage))
    usage_line = next(line for line in DEMO.read_text().splitlines() if "Usage:" in line)
    shown = set(re.findall(r"--[a-z][a-z-]*", usage_line))
    shown |= set(re.findall(r"demo\.sh (--[a-z][a-z-]*)", (ROOT / "README.md").read_text()))
    assert shown >= {"--steps", "--out", "--hosts"}, shown
    assert shown - taken == set(), usage


def test_the_demos_daemon_ends_with_the_demo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo starts its daemon as the benchmarks do (``exit_with_parent``: it exits
    when the demo's pipe to it closes, which the kernel does however the demo ends).
    Killed alone, or by its terminal's SIGHUP, the demo left its daemon serving: a
    SIGHUP now reloads the daemon's tokens instead of ending it, and a daemon with
    nothing to log never met its closed log pipe."""
    from rendezvousd.trainer.demo import run as demo

    asked: dict[str, object] = {}

    def spawn(*args: object, **kw: object) -> object:
        asked.update(kw)
        raise demo.DaemonError("stopped here by the test")

    monkeypatch.setattr(demo, "spawn", spawn)
    with pytest.raises(SystemExit, match="stopped here by the test"):
        demo._start_daemon(tmp_path, None)
    assert asked.get("exit_with_parent") is True, asked
