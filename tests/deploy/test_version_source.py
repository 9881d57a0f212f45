"""Which rendezvousd a process runs, from one source (``rendezvousd/common/version.py``):
the installed distribution's version, and a source checkout's never said as a release."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ASK = "from rendezvousd.common.version import installed_version; print(installed_version())"


def _said(tree: Path) -> str:
    # -S: no site-packages, so no installed distribution is found: a bare checkout.
    done = subprocess.run(
        [sys.executable, "-S", "-c", ASK],
        cwd=tree, capture_output=True, text=True, timeout=60, check=False,
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


def test_the_installed_version_is_the_distributions() -> None:
    import importlib.metadata

    from rendezvousd.common.version import installed_version

    assert installed_version() == importlib.metadata.version("rendezvousd")
