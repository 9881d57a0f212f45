"""Which rendezvousd a process runs, from one source (``rendezvousd/common/version.py``):
the installed distribution's version, and a source checkout's never said as a release."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ASK = "from rendezvousd.common.version import installed_version; print(installed_version())"


def _said(tree: Path, env: dict[str, str] | None = None) -> str:
    # -S: no site-packages, so no installed distribution is found: a bare checkout.
    done = subprocess.run(
        [sys.executable, "-S", "-c", ASK],
        cwd=tree, capture_output=True, text=True, timeout=60, check=False, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize("with_pyproject", [True, False])
def test_a_source_checkout_says_its_pyproject_version_marked_as_source(
    tmp_path: Path, with_pyproject: bool
) -> None:
    """It said "unknown" however the tree was run: an operator could not tell a checkout
    of 0.1.0 from a vendored copy; and a checkout must not pass for the release."""
    shutil.copytree(
        ROOT / "rendezvousd", tmp_path / "rendezvousd",
        ignore=shutil.ignore_patterns("__pycache__", "_gen"),
    )  # fmt: skip
    if with_pyproject:
        shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    import tomllib

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert _said(tmp_path) == (f"{version}+source" if with_pyproject else "unknown")


def test_the_installed_version_is_the_distributions_with_its_build() -> None:
    import importlib.metadata

    from rendezvousd.common.version import build_id, installed_version

    # This editable install is the checkout: its build is what its git says now.
    assert build_id()
    assert installed_version() == f"{importlib.metadata.version('rendezvousd')}+{build_id()}"


def _git(tree: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args],
        cwd=tree, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return done.stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_git_checkout_says_its_commit_and_without_git_says_source(tmp_path: Path) -> None:
    """Every checkout of a release said 0.1.0+source (h139 F3). A git checkout says its
    commit, and .dirty while a tracked file differs from it (an editable install runs
    these files, so it says the same). Without git on the PATH it says +source, and
    a stamp left in the tree does not pass for the checkout's commit."""
    import tomllib

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    shutil.copytree(
        ROOT / "rendezvousd", tmp_path / "rendezvousd",
        ignore=shutil.ignore_patterns("__pycache__", "_gen", "BUILD"),
    )  # fmt: skip
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-q", "-m", "one")
    commit = _git(tmp_path, "rev-parse", "--short=7", "HEAD")
    (tmp_path / "rendezvousd/common/BUILD").write_text("gdeadbee\n")  # a stale stamp
    assert _said(tmp_path) == f"{version}+g{commit}"
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text() + "\n")
    assert _said(tmp_path) == f"{version}+g{commit}.dirty"
    no_git = {**os.environ, "PATH": str(tmp_path / "no-such-bin")}
    assert _said(tmp_path, no_git) == f"{version}+source"
