"""scripts/gpu_check.sh and benchmarks/gpu_check.py without a GPU: the script names
exactly what is missing in its JSON result instead of downloading anything, and the
benchmark's target verdicts follow the figures."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT, benchmark_module


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Any:
    return benchmark_module(monkeypatch, "gpu_check.py")


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has a driver")
def test_gpu_check_names_what_is_missing_in_its_json_result(tmp_path: Path) -> None:
    run = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh")],
        env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["status"] == "missing" and doc["steps"] == []
    assert any("NVIDIA driver" in m for m in doc["missing"]), doc
    # Nothing was installed from the network on the way.
    assert "pip install" not in run.stderr


# A CuPy that imports on a machine without a device, with NCCL's library but neither
# NVRTC nor cuBLAS: the probes must name each in CUDA's words, and never claim that
# CuPy itself is missing.
NO_DEVICE = {
    "__init__.py": "from . import cuda\n__version__ = '14.2.0'\n",
    "cuda/__init__.py": (
        "from . import nccl, nvrtc, runtime\n"
        "def __getattr__(name):\n"
        "    raise ImportError(f'Failure finding \"lib{name}.so.12\"')\n"
    ),
    "cuda/runtime.py": (
        "class CUDARuntimeError(RuntimeError): pass\n"
        "def getDeviceCount():\n"
        "    raise CUDARuntimeError('cudaErrorInsufficientDriver: CUDA driver version is "
        "insufficient for CUDA runtime version')\n"
        "def runtimeGetVersion(): return 12090\n"
    ),
    "cuda/nccl.py": "available = True\ndef get_version(): return 23203\n",
    "cuda/nvrtc.py": (
        "def getVersion():\n    raise RuntimeError('Failure finding \"libnvrtc.so.12\"')\n"
    ),
}
BROKEN = {"__init__.py": "raise ImportError('libcuda.so.1: cannot open shared object file')\n"}


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has a driver")
@pytest.mark.parametrize(
    ("stub", "expected"),
    [
        (
            NO_DEVICE,
            [
                "a CUDA device that CuPy can use (getDeviceCount: CUDARuntimeError: "
                "cudaErrorInsufficientDriver: CUDA driver version is insufficient",
                "NVRTC, which CuPy compiles its kernels with (nvidia-cuda-nvrtc-cu12, or a "
                "CUDA toolkit, or pip install 'cupy-cuda12x[ctk]'; RuntimeError: Failure "
                'finding "libnvrtc.so.12"',
                "cuBLAS, which the example's matrix products need (nvidia-cublas-cu12",
            ],
        ),
        (BROKEN, ["a CuPy that imports in ", "(import cupy: ImportError: libcuda.so.1"]),
    ],
    ids=["imports-without-device", "fails-to-import"],
)
def test_gpu_check_says_what_an_installed_cupy_lacks(
    tmp_path: Path, stub: dict[str, str], expected: list[str]
) -> None:
    for name, text in stub.items():
        (tmp_path / "stub" / "cupy" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "stub" / "cupy" / name).write_text(text)
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    run = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh")],
        env={**env, "PYTHONPATH": str(tmp_path / "stub")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0
    missing = json.loads((tmp_path / "gpu_check.json").read_text())["missing"]
    for words in expected:
        assert any(words in m for m in missing), (words, missing)
    assert not any(m.startswith("CuPy in ") or "NCCL" in m for m in missing), missing


def _row(
    size: int, bucketed_over_raw: float, pack: float, unpack: float, copy: float
) -> dict[str, Any]:
    return {
        "bytes": size,
        "bucketed_over_raw": bucketed_over_raw,
        "pack_gbps": pack,
        "unpack_gbps": unpack,
        "copy_gbps": copy,
    }


def test_benchmark_targets_judge_the_largest_size(bench: Any) -> None:
    rows = [_row(1 << 20, 2.0, 1.0, 1.0, 100.0), _row(64 << 20, 1.03, 600.0, 700.0, 1000.0)]
    verdict = bench.targets(rows, world=2)
    assert verdict["bucketed_over_raw"]["met"] and verdict["bucketed_over_raw"]["measured"] == 1.03
    assert verdict["pack_unpack_over_copy"]["met"]
    assert verdict["pack_unpack_over_copy"]["measured"] == 0.6
    slow = bench.targets([_row(64 << 20, 1.2, 400.0, 900.0, 1000.0)], world=2)
    assert not slow["bucketed_over_raw"]["met"] and not slow["pack_unpack_over_copy"]["met"]
    # World 1 measures no communication: the bucketed target cannot be met there.
    assert not bench.targets(rows, world=1)["bucketed_over_raw"]["met"]


def test_ranks_on_one_gpu_are_told_they_are_separate_hosts(bench: Any) -> None:
    env = [bench.shared_device_env(r) for r in range(2)]
    assert env[0]["NCCL_HOSTID"] != env[1]["NCCL_HOSTID"]
    assert all(e["NCCL_SOCKET_IFNAME"] == "lo" and e["NCCL_IB_DISABLE"] == "1" for e in env)
