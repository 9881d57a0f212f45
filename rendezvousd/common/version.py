"""Which rendezvousd this process runs: the one source of the version every program
says (``--version``, the daemon's ``serving on`` line, ``rendezvousd_build_info``,
``GetJob``/``ListJobs``' ``daemon_version``, the status page, rendezvous-run's start
line), and the build's other parts an operator compares across hosts.

Read lazily, once: ``importlib.metadata`` (and the ``tempfile`` it imports) cost a
launcher's start a few milliseconds before its spares start, on every node.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

#: What a version that cannot be told is said as (a vendored copy, a zipapp), and what
#: a daemon from before it said its version is shown as.
UNKNOWN = "unknown"

#: The local-version suffix of a source tree whose commit cannot be told (no git): its
#: pyproject.toml's version, which says nothing of the commit, so marked apart from a
#: release of that version.
SOURCE_SUFFIX = "+source"


#: The file a wheel carries its build in (``scripts/build_backend.py`` writes it into
#: the tree it builds, for that build only): what the checkout's git said then.
STAMP = "BUILD"

#: The variable a build without git takes its commit from (the container build's
#: argument of that name; ``scripts/build_backend.py`` stamps the wheel with it).
BUILD_ENV = "RENDEZVOUSD_BUILD"

#: A build id as git says it: ``g`` and the short commit, ``.dirty`` where tracked
#: files differed from it (a PEP 440 local-version label, as ``source`` is).
_BUILD_ID = re.compile(r"g[0-9a-f]{4,40}(\.dirty)?")


@functools.cache
def installed_version() -> str:
    """The release (the installed distribution's version, ``importlib.metadata``; in a
    source checkout that was never installed, its ``pyproject.toml``'s) with this
    build's id as its local label (``build_id``): ``0.1.0+g873aec9``,
    ``0.1.0+g873aec9.dirty``, ``0.1.0+source``; the release alone from a wheel built
    where git could not say; ``unknown`` where no release can be told: a log line or
    ``--version`` must not fail on it."""
    import importlib.metadata

    try:
        release: str | None = importlib.metadata.version("rendezvousd")
    except importlib.metadata.PackageNotFoundError:
        release = _checkout_release()
    if release is None:
        return UNKNOWN
    build = build_id()
    if not build:
        return release
    return f"{release}{'.' if '+' in release else '+'}{build}"


@functools.cache
def build_id() -> str:
    """Which build of the release runs, "" where none can be told.

    A git checkout (run from source, or an editable install, whose files are the
    checkout's as they are now) says its commit when asked, each process once: a
    stamp made at install time would name a commit the checkout has moved on from.
    A wheel says what git said when it was built (``STAMP``). A source tree without
    git (an unpacked sdist keeps its stamp) says ``source``, as before. Git missing,
    failing or slow is no error: the checkout says ``source``."""
    root = _checkout_root()
    if root is not None and (root / ".git").exists():
        return git_build_id(root) or SOURCE_SUFFIX[1:]
    stamped = read_stamp(Path(__file__).with_name(STAMP))
    if stamped:
        return stamped
    return SOURCE_SUFFIX[1:] if root is not None else ""


def git_build_id(root: Path) -> str:
    """``g`` and ``root``'s short commit, ``.dirty`` when a tracked file differs from
    it; "" where git cannot say (not installed, not a repository, an owner git does not
    trust, 5 s passed). Shared with the build backend, which stamps a wheel with it."""
    import os
    import subprocess

    # Not one of the caller's GIT_DIR/GIT_WORK_TREE: the commit of this tree, no other.
    # No optional lock: asking must not make a git command run meanwhile in the checkout
    # fail on index.lock (``--dirty`` refreshes the index).
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env["GIT_OPTIONAL_LOCKS"] = "0"
    try:
        done = subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty=.dirty",
             "--abbrev=7", "--exclude=*"],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=5,
            env=env, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return ""
    said = done.stdout.strip()
    if done.returncode != 0 or not re.fullmatch(r"[0-9a-f]{4,40}(\.dirty)?", said):
        return ""
    return "g" + said


def read_stamp(path: Path) -> str:
    """A wheel's stamped build id; "" when absent or not one (a hand-edited file)."""
    try:
        said = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return ""
    return said if _BUILD_ID.fullmatch(said) else ""


def _checkout_root() -> Path | None:
    """rendezvousd's own source tree this package lies in (``ROOT/rendezvousd/common/
    version.py``, its ``pyproject.toml`` naming rendezvousd), or None: installed."""
    root = Path(__file__).resolve().parents[2]
    return root if _pyproject_version(root) is not None else None


def _checkout_release() -> str | None:
    """``pyproject.toml``'s version, where this package lies in rendezvousd's own source
    tree, which was never installed."""
    return _pyproject_version(Path(__file__).resolve().parents[2])


def _pyproject_version(root: Path) -> str | None:
    import tomllib

    try:
        with (root / "pyproject.toml").open("rb") as f:
            project = tomllib.load(f).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return None
    version = project.get("version")
    if project.get("name") != "rendezvousd" or not isinstance(version, str):
        return None
    return version


def shown(version: str) -> str:
    """A peer's version as said: ``unknown`` where it said none (one from before)."""
    return version or UNKNOWN
