"""scripts/gpu_check.sh and benchmarks/gpu_check.py without a GPU: the script names
exactly what is missing in its JSON result instead of downloading anything, and the
benchmark's target verdicts follow the figures."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT, benchmark_module


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Any:
    return benchmark_module(monkeypatch, "gpu_check.py")


def _env(tmp_path: Path, **more: str) -> dict[str, str]:
    # No wheels folder: a checkout's artifacts/gpu-wheels would be installed into this
    # test's own Python.
    return {
        **os.environ,
        "OUT": str(tmp_path),
        "PYTHON": sys.executable,
        "GPU_WHEELS": str(tmp_path / "no-wheels"),
        **more,
    }


def _stub(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has a driver")
def test_gpu_check_names_what_is_missing_in_its_json_result(tmp_path: Path) -> None:
    run = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh")],
        env=_env(tmp_path),
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
    env = _env(tmp_path)
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


OLD_RUNTIMES = {
    "grpc/__init__.py": "__version__ = '1.80.0'\n",
    "google/protobuf/__init__.py": "__version__ = '6.33.5'\n",
}


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has a driver")
def test_gpu_check_names_a_grpcio_or_protobuf_the_generated_code_refuses(tmp_path: Path) -> None:
    """Only imports were probed: an image's older grpcio or protobuf passed the precheck
    and failed every step at import, in the generated code's words."""
    stub = _stub(tmp_path / "stub", OLD_RUNTIMES)
    run = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh")],
        env={**_env(tmp_path), "PYTHONPATH": str(stub)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode != 0
    missing = json.loads((tmp_path / "gpu_check.json").read_text())["missing"]
    gen = (ROOT / "rendezvousd/_gen/rendezvous/v1/rendezvous_pb2_grpc.py").read_text()
    assert "GRPC_GENERATED_VERSION = '1.85.1'" in gen  # the floor the message must name
    for words in ("grpcio >= 1.85.1, found 1.80.0", "protobuf >= 7.35.1, found 6.33.5"):
        assert any(m.startswith(words) and "scripts/gpu_wheels.sh" in m for m in missing), missing


# A CuPy with everything the precheck asks of it, and a driver that lists one GPU.
READY = {
    "cupy/__init__.py": "from . import cuda\n__version__ = '14.2.0'\n",
    "cupy/cuda/__init__.py": "from . import nccl, nvrtc, runtime\ncublas = object()\n",
    "cupy/cuda/runtime.py": (
        "def getDeviceCount(): return 1\ndef runtimeGetVersion(): return 13000\n"
    ),
    "cupy/cuda/nccl.py": "available = True\ndef get_version(): return 22809\n",
    "cupy/cuda/nvrtc.py": "def getVersion(): return (13, 0)\n",
}


def test_gpu_check_installs_the_wheels_brought_and_keeps_to_its_budget(tmp_path: Path) -> None:
    """Its steps' own limits add up to 590 s: one hanging step (here the GPU tests)
    ran past a 5-minute device session. And the wheels scripts/gpu_wheels.sh fetched
    are installed from their folder, never from an index."""
    stub = _stub(tmp_path / "stub", READY)
    bin_dir = _stub(tmp_path / "bin", {"nvidia-smi": "#!/bin/sh\necho 'GPU 0: Fake'\n"})
    (bin_dir / "nvidia-smi").chmod(0o755)
    wheels = _stub(tmp_path / "wheels", {"requirements.txt": "grpcio>=1.85.1\n"})
    pip_log = tmp_path / "pip.log"
    # Python itself, but pip only logs what it was asked and pytest hangs.
    python = _stub(
        tmp_path / "py",
        {
            "python": (
                "#!/bin/bash\n"
                f'if [ "$1 $2" = "-m pip" ]; then echo "$*" >> {pip_log}; exit 0; fi\n'
                'if [ "$1 $2" = "-m pytest" ]; then exec sleep 600; fi\n'
                f'exec {sys.executable} "$@"\n'
            )
        },
    )
    (python / "python").chmod(0o755)
    env = _env(
        tmp_path,
        PYTHON=str(python / "python"),
        GPU_WHEELS=str(wheels),
        GPU_CHECK_BUDGET_S="30",
        PYTHONPATH=str(stub),
        PATH=f"{bin_dir}:{os.environ['PATH']}",
    )
    started = time.monotonic()
    run = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - started
    assert run.returncode != 0 and took < 45, (took, run.stderr[-2000:])
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["status"] == "failed" and doc["missing"] == [], doc
    steps = {s["step"]: s for s in doc["steps"]}
    assert steps["wheels"]["status"] == "passed" and str(wheels) in steps["wheels"]["detail"]
    assert steps["gpu_tests"]["status"] == "failed" and "limit" in steps["gpu_tests"]["detail"]
    assert steps["benchmark"]["status"] == "skipped" and "budget" in steps["benchmark"]["detail"]
    first = pip_log.read_text().splitlines()[0]
    assert f"--no-index --find-links {wheels} -r {wheels}/requirements.txt" in first
