"""The device-generic example and checkpoints on real CuPy and a real GPU;
skipped cleanly where CuPy or a device is missing (``RENDEZVOUSD_REQUIRE_GPU=1``
turns the skips into failures, as in test_gpu.py).

Self-contained (its own daemon, no conftest fixtures) so it also runs under
``pytest --noconftest`` the way scripts/gpu_check.sh runs the GPU tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rendezvousd.trainer import example
from rendezvousd.trainer.checkpoint import load_checkpoint, save_checkpoint
from rendezvousd.trainer.comm import devices
from rendezvousd.trainer.demo import run as demo
from tests.support import DaemonProcess, spawn_daemon
from tests.trainer.gpu_gate import DEVICES, GPU_MARKS
from tests.trainer.test_example_devices import EXAMPLE, run_example

pytestmark = GPU_MARKS


@pytest.fixture
def cp() -> Any:
    # Through the seam, so nccl.py stays the package's only CuPy importer.
    cupy = devices.array_module("nccl")
    devices.set_device(cupy, 0)
    return cupy


@pytest.fixture(scope="module")
def gpu_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = spawn_daemon(tmp_path_factory.mktemp("daemon"), "--heartbeat-timeout-s", "5")
    yield d
    d.kill()


def test_real_device_arrays_refuse_np_asarray(cp: Any) -> None:
    # What the fake CuPy in test_example_devices stands in for.
    with pytest.raises(TypeError):
        np.asarray(cp.zeros(2))


def test_checkpoint_round_trip_of_cupy_arrays(cp: Any, tmp_path: Path) -> None:
    host = {
        "w": np.arange(12, dtype=np.float32).reshape(3, 4),
        "b": np.array([1.5, -2.0], dtype=np.float64),
        "n": np.array([7], dtype=np.int64),
    }
    path = tmp_path / "c.npz"
    assert save_checkpoint(path, {k: cp.asarray(v) for k, v in host.items()}, {"s": 1}, rank=0)
    back, meta = load_checkpoint(path, xp=cp)
    assert meta == {"s": 1}
    for name, value in host.items():
        assert isinstance(back[name], cp.ndarray) and back[name].device.id == 0
        assert back[name].dtype == value.dtype
        np.testing.assert_array_equal(cp.asnumpy(back[name]), value)


def test_params_digest_hashes_host_bytes(cp: Any) -> None:
    host = example.init_params(8, 16, seed=0)
    on_device = {k: devices.to_device(v, cp) for k, v in host.items()}
    assert example.params_digest(on_device) == example.params_digest(host)


def test_example_trains_checkpoints_and_resumes_on_the_gpu(
    gpu_daemon: DaemonProcess, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    first = run_example(
        gpu_daemon, "gpu-a", "nccl", tmp_path / "a", "--steps", "6",
        "--checkpoint-dir", str(ckpt), script=EXAMPLE,
    )  # fmt: skip
    assert first["backend"] == "nccl" and first["checkpoint_written"]
    # cuBLAS vs the host baseline: float32 rounding, not a wrong gradient.
    assert first["max_abs_grad_diff_vs_single_process"] <= demo.GRAD_TOLERANCE
    resumed = run_example(
        gpu_daemon, "gpu-b", "nccl", tmp_path / "b", "--steps", "10",
        "--checkpoint-dir", str(ckpt), "--resume", script=EXAMPLE,
    )  # fmt: skip
    assert (resumed["start_step"], resumed["steps"]) == (6, 4)
    on_cpu = run_example(gpu_daemon, "gpu-c", "cpu", tmp_path / "c", "--steps", "10")
    assert resumed["final_loss"] == pytest.approx(on_cpu["final_loss"], rel=1e-4)


def test_demo_scorecard_on_gpus(tmp_path: Path) -> None:
    card = demo.run(steps=8, out=tmp_path / "card.json", workdir=tmp_path, backend="nccl")
    assert card["success"], card
    assert card["topology"]["backend"] == "nccl"
    assert card["topology"]["world_size"] == sum(map(len, demo.gpu_layout(["x"] * DEVICES)))
