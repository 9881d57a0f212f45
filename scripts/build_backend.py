"""The build backend: setuptools' own, minus one notice on editable installs.

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

import warnings
from typing import Any

from setuptools import build_meta
from setuptools.build_meta import (  # noqa: F401  (the PEP 517/660 hooks, re-exported)
    build_sdist,
    build_wheel,
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
