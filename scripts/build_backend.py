"""The build backend: setuptools' own, minus one notice on editable installs, plus the
build id a wheel or sdist carries.

A wheel (and an sdist, so that a wheel built from it later keeps it) is stamped with
the commit the tree's git says (``rendezvousd/common/BUILD``: ``g873aec9``, with
``.dirty`` where tracked files differed), which ``rendezvousd/common/version.py`` reads
and every program says after the release (``0.1.0+g873aec9``): two builds of one
release are told apart. The stamp is written for the build only and removed after. No
git, or a tree that is not a repository (a container build's context), builds all the
same: ``$RENDEZVOUSD_BUILD`` is the stamp where given (the Dockerfile's build argument),
else an sdist's stamp is kept, else there is none. An editable install is not stamped:
its files are the checkout's, whose commit version.py asks git for as it runs.

setuptools prints "Editable installation ... Please be careful with folders in your
working directory with the same name as your package" for every editable install
whose layout is not a plain ``src/`` or flat one. Ours maps ``rendezvousd.client``
to ``client/`` and ``rendezvousd.trainer`` to ``trainer/`` (fixed by the design
card), so ``pip install -e .`` would print it every time, although the editable
finder resolves those mapped packages from the checkout's ``rendezvousd/`` folder
as well. Everything else — wheels, sdists, metadata, every other warning — is
setuptools unchanged.
"""

from __future__ import annotations

import contextlib
import importlib.util
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from setuptools import build_meta
from setuptools.build_meta import (  # noqa: F401  (the PEP 517/660 hooks, re-exported)
    get_requires_for_build_editable,
    get_requires_for_build_sdist,
    get_requires_for_build_wheel,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)


def build_editable(
    wheel_directory: str,
    config_settings: dict[str, Any] | None = None,
    metadata_directory: str | None = None,
) -> str:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"\s*Editable installation\.")
        name: str = build_meta.build_editable(wheel_directory, config_settings, metadata_directory)
        return name


def build_wheel(
    wheel_directory: str,
    config_settings: dict[str, Any] | None = None,
    metadata_directory: str | None = None,
) -> str:
    with _stamped():
        name: str = build_meta.build_wheel(wheel_directory, config_settings, metadata_directory)
        return name


def build_sdist(sdist_directory: str, config_settings: dict[str, Any] | None = None) -> str:
    with _stamped():
        name: str = build_meta.build_sdist(sdist_directory, config_settings)
        return name


@contextlib.contextmanager
def _stamped() -> Iterator[None]:
    """The tree (the working directory, as PEP 517 runs a backend) stamped with its
    build id while the build runs; untouched where git cannot say."""
    root = Path.cwd()
    version = _version_module(root)
    stamp = root / "rendezvousd" / "common" / version.STAMP
    # Asked before the stamp exists: the stamp (git-ignored anyway) is no change.
    build: str = version.git_build_id(root) if (root / ".git").exists() else ""
    if not build:
        build = _given_build(version)
    if not build:
        yield  # an sdist's own stamp, if any, goes into the wheel as it is
        return
    had = stamp.read_bytes() if stamp.exists() else None
    stamp.write_text(build + "\n", encoding="ascii")
    try:
        yield
    finally:
        if had is None:
            stamp.unlink(missing_ok=True)
        else:
            stamp.write_bytes(had)


def _given_build(version: Any) -> str:
    """``$RENDEZVOUSD_BUILD`` as a build id (``g873aec9``; a bare short commit, as
    ``git rev-parse --short HEAD`` prints it, gets its ``g``), "" where unset. A value
    that is no commit fails the build: an image said as another commit than it is would
    mislead the operator comparing hosts, where "no build id" only says less."""
    import os

    given = os.environ.get(version.BUILD_ENV, "").strip()
    if not given:
        return ""
    build = given if given.startswith("g") else f"g{given}"
    if not version._BUILD_ID.fullmatch(build):
        raise ValueError(
            f"{version.BUILD_ENV}={given!r} is not a commit: give the short commit the tree "
            f"was built from (`--build-arg {version.BUILD_ENV}=$(git rev-parse --short HEAD)`, "
            "4 to 40 lower-case hex digits, optionally with .dirty), or leave it unset"
        )
    return str(build)


def _version_module(root: Path) -> Any:
    """The tree's ``rendezvousd/common/version.py``, loaded by path: it needs only the
    standard library, where the package it lies in needs grpc, which a build lacks."""
    path = root / "rendezvousd" / "common" / "version.py"
    spec = importlib.util.spec_from_file_location("_rendezvousd_build_version", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
