"""Fixtures of the trainer tests."""

from __future__ import annotations

from typing import Any

import pytest

from rendezvousd.trainer import nccl

from .fake_cupy import make_cupy


@pytest.fixture
def cupy(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The fake CuPy at the one seam (``nccl._import_cupy``)."""
    fake = make_cupy()
    monkeypatch.setattr(nccl, "_import_cupy", lambda: fake)
    return fake
