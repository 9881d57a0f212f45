"""Whether the NCCL backend can run here, and CuPy's import boundary, against a fake
``cupy`` at the one seam (``_import_cupy``): what is said when CuPy, its NCCL library
or a device is missing, and that nothing but nccl.py ever imports CuPy."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rendezvousd.trainer import errors as errs
from rendezvousd.trainer.comm import nccl

from .fake_cupy import FakeCudaError, make_cupy

UID = bytes(range(1, 129))


def test_without_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing() -> Any:
        raise ImportError("No module named 'cupy'")

    monkeypatch.setattr(nccl, "_import_cupy", missing)
    assert nccl.device_count() == 0
    with pytest.raises(errs.ConfigError, match="CuPy"):
        nccl.NcclCommunicator(0, 1, UID, 0)


def test_device_count(cupy: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert nccl.device_count() == 2

    def no_driver() -> int:
        raise FakeCudaError(100)  # cudaErrorNoDevice

    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", no_driver)
    assert nccl.device_count() == 0


@pytest.mark.parametrize(
    ("missing", "expected"),
    [
        ("nothing", None),
        ("cupy", r"^CuPy does not import \(ImportError: libcudart.so.12: cannot open"),
        ("nccl", r"^CuPy cannot load the NCCL library .* install nvidia-nccl-cu12"),
        ("driver", r"^no CUDA device \(FakeCudaError: cudaErrorInsufficientDriver: "),
        ("device", r"^no CUDA device \(CuPy sees none\)$"),
    ],
)
def test_unavailable_reason_names_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, missing: str, expected: str | None
) -> None:
    fake = make_cupy(devices=0 if missing == "device" else 1)

    def seam() -> Any:
        if missing == "cupy":
            raise ImportError("libcudart.so.12: cannot open shared object file")
        return fake

    def no_driver() -> int:
        raise FakeCudaError(35)  # cudaErrorInsufficientDriver

    monkeypatch.setattr(nccl, "_import_cupy", seam)
    if missing == "nccl":  # what real CuPy says when libnccl does not load
        monkeypatch.setattr(fake.cuda.nccl, "available", False)
    if missing == "driver":
        monkeypatch.setattr(fake.cuda.runtime, "getDeviceCount", no_driver)
    reason = nccl.unavailable_reason()
    assert reason is None if expected is None else re.search(expected, str(reason)), reason
    if missing == "nccl":
        with pytest.raises(errs.ConfigError, match="cannot load the NCCL library"):
            nccl.create_unique_id()


def test_a_cupy_that_cannot_load_the_nccl_wheel_is_told_to_upgrade(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CuPy finds NCCL's pip wheel from 13.5.0 on: telling 13.4 to install the wheel
    it cannot load sent its user round in a circle."""
    fake = make_cupy(cupy_version="13.4.1")
    monkeypatch.setattr(nccl, "_import_cupy", lambda: fake)
    monkeypatch.setattr(fake.cuda.nccl, "available", False)
    reason = str(nccl.unavailable_reason())
    assert "CuPy 13.4.1 cannot load the NCCL library" in reason and "upgrade CuPy" in reason
    with pytest.raises(errs.ConfigError, match=r"CuPy 13\.4\.1 .* from 13\.5\.0 on"):
        nccl.create_unique_id()


def test_cupy_is_imported_only_in_nccl_py() -> None:
    trainer = Path(nccl.__file__).parent
    pattern = re.compile(r"^\s*(import cupy|from cupy)", re.MULTILINE)
    importers = sorted(p.name for p in trainer.glob("*.py") if pattern.search(p.read_text()))
    assert importers == ["nccl.py"]
    code = (
        "import sys, rendezvousd.trainer.bucketing, rendezvousd.trainer.comm.nccl; "
        "assert not any(m == 'cupy' or m.startswith('cupy.') for m in sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
