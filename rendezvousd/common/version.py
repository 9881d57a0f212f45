"""Which rendezvousd this process runs: the one source of the version every program
says (``--version``, the daemon's ``serving on`` line, ``rendezvousd_build_info``,
``GetJob``/``ListJobs``' ``daemon_version``, the status page, rendezvous-run's start
line), and the build's other parts an operator compares across hosts.

Read lazily, once: ``importlib.metadata`` (and the ``tempfile`` it imports) cost a
launcher's start a few milliseconds before its spares start, on every node.
"""

from __future__ import annotations

import functools
from pathlib import Path

#: What a version that cannot be told is said as (a vendored copy, a zipapp), and what
#: a daemon from before it said its version is shown as.
UNKNOWN = "unknown"

#: The local-version suffix of a source checkout run without installing it: its
#: pyproject.toml's version, which says nothing of the commit, so marked apart from a
#: release of that version.
SOURCE_SUFFIX = "+source"


@functools.cache
def installed_version() -> str:
    """The installed distribution's version (``importlib.metadata``); in a source
    checkout that was never installed, its ``pyproject.toml``'s with ``+source``;
    else ``unknown``: a log line or ``--version`` must not fail on it."""
    import importlib.metadata

    try:
        return importlib.metadata.version("rendezvousd")
    except importlib.metadata.PackageNotFoundError:
        return _checkout_version() or UNKNOWN


def _checkout_version() -> str | None:
    """``pyproject.toml``'s version, with ``SOURCE_SUFFIX``, where this package lies in
    rendezvousd's own source tree (``ROOT/rendezvousd/common/version.py``)."""
    import tomllib

    try:
        with (Path(__file__).resolve().parents[2] / "pyproject.toml").open("rb") as f:
            project = tomllib.load(f).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return None
    version = project.get("version")
    if project.get("name") != "rendezvousd" or not isinstance(version, str):
        return None
    return version + SOURCE_SUFFIX


def shown(version: str) -> str:
    """A peer's version as said: ``unknown`` where it said none (one from before)."""
    return version or UNKNOWN
