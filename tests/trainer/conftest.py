"""Fixtures of the trainer tests."""

from __future__ import annotations

from typing import Any

import pytest

from .fake_cupy import install


@pytest.fixture
def cupy(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The fake CuPy at the one seam (``nccl._import_cupy``)."""
    return install(monkeypatch)
