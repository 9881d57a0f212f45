"""The example trainer written once for host and device arrays.

In process: the model math, digest and baseline against the fake CuPy of
``fake_cupy`` (arrays that refuse implicit host conversion, as CuPy's do). As
real processes with a real daemon: the example on the nccl backend with that
fake at the CuPy seam trains, checkpoints and resumes from device arrays, and
ends bit-identical to the cpu backend on the same data.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rendezvousd.trainer import example
from rendezvousd.trainer.comm import devices, nccl
from rendezvousd.trainer.demo import run as demo
from tests.support import FAKE_GPU_LAUNCHER, ROOT, WORKERS, DaemonProcess
from tests.trainer import fake_cupy

SMOKE = ROOT / "trainer" / "configs" / "multinode_smoke.toml"
# Small enough to be quick, big enough for several buckets and two epochs.
TRAIN = ["--samples", "256", "--features", "8", "--hidden", "16", "--batch", "64"]


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Any:
    return fake_cupy.install(monkeypatch)


def test_model_math_on_device_equals_host_bit_for_bit(fake: Any) -> None:
    x, y = example.make_data(64, 4, seed=0)
    host = example.init_params(4, 8, seed=0)
    on_device = {k: devices.to_device(v, fake) for k, v in host.items()}
    loss, grads = example.loss_and_grads(host, x, y)
    dloss, dgrads = example.loss_and_grads(
        on_device, devices.to_device(x, fake), devices.to_device(y, fake), fake
    )
    assert dloss == loss
    for name, grad in grads.items():
        assert isinstance(dgrads[name], fake.ndarray)
        assert devices.to_host(dgrads[name]).tobytes() == grad.tobytes()
    # The digest hashes host bytes, so it names the model, not where it lives.
    assert example.params_digest(on_device) == example.params_digest(host)


def test_model_math_refuses_host_data_with_device_parameters(fake: Any) -> None:
    x, y = example.make_data(8, 4, seed=0)
    on_device = {k: fake.asarray(v) for k, v in example.init_params(4, 8, seed=0).items()}
    with pytest.raises(TypeError):
        example.loss_and_grads(on_device, x, y, fake)


EXAMPLE = ["-m", "rendezvousd.trainer.example"]
FAKE_GPU_EXAMPLE = [str(WORKERS / "fake_gpu_example.py")]


def run_example(
    d: DaemonProcess,
    job: str,
    backend: str,
    out: Path,
    *args: str,
    script: list[str] | None = None,
) -> dict[str, Any]:
    """One rank (world 1) of the example; its result JSON. ``script`` defaults to the
    example itself on cpu and to the example on the fake GPU on nccl."""
    env = {
        **os.environ,
        "RENDEZVOUSD_LOCAL_RANK": "0",
        "RENDEZVOUSD_ENDPOINT": d.endpoint,
        "RENDEZVOUSD_TOKEN_FILE": str(d.token_file),
        "RENDEZVOUSD_JOB_ID": job,
        "RENDEZVOUSD_NUM_NODES": "1",
        "RENDEZVOUSD_GPUS_PER_NODE": "1",
        "RENDEZVOUSD_NODE_RANK": "0",
        "RENDEZVOUSD_CONFIG": str(SMOKE),
        "RENDEZVOUSD_BACKEND": backend,
    }
    if script is None:
        script = FAKE_GPU_EXAMPLE if backend == "nccl" else EXAMPLE
    run = subprocess.run(
        [sys.executable, *script, *TRAIN, "--result-dir", str(out), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    result: dict[str, Any] = json.loads((out / "rank-0.json").read_text())
    return result


def test_nccl_backend_on_fake_device_trains_checkpoints_and_resumes_like_cpu(
    daemon: DaemonProcess, job_id: str, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    first = run_example(
        daemon, f"{job_id}-a", "nccl", tmp_path / "a", "--steps", "6",
        "--checkpoint-dir", str(ckpt), "--checkpoint-every", "4",
    )  # fmt: skip
    assert first["backend"] == "nccl" and first["checkpoint_written"]
    assert first["max_abs_grad_diff_vs_single_process"] == 0.0
    assert sorted(p.name for p in ckpt.iterdir()) == ["ckpt-0000000004.npz", "ckpt-0000000006.npz"]
    shutil.copytree(ckpt, tmp_path / "ckpt-for-cpu")
    resumed = run_example(
        daemon, f"{job_id}-b", "nccl", tmp_path / "b", "--steps", "10",
        "--checkpoint-dir", str(ckpt), "--resume",
    )  # fmt: skip
    assert (resumed["start_step"], resumed["steps"]) == (6, 4)
    straight = run_example(daemon, f"{job_id}-c", "cpu", tmp_path / "c", "--steps", "10")
    assert straight["backend"] == "cpu"
    # Device arrays through a checkpoint and back lose nothing: same bytes as never stopping.
    assert resumed["params_sha256"] == straight["params_sha256"]
    assert resumed["final_loss"] == straight["final_loss"]
    # Checkpoints do not record a device: the GPU run's resumes on the cpu backend.
    on_cpu = run_example(
        daemon, f"{job_id}-d", "cpu", tmp_path / "d", "--steps", "10",
        "--checkpoint-dir", str(tmp_path / "ckpt-for-cpu"), "--resume",
    )  # fmt: skip
    assert on_cpu["start_step"] == 6 and on_cpu["params_sha256"] == straight["params_sha256"]


def test_a_diverged_run_fails_the_gradient_check_instead_of_reporting_it_exact(
    daemon: DaemonProcess, job_id: str, tmp_path: Path
) -> None:
    # lr 1e30 overflows the parameters, so the gradients turn NaN: no agreement can be
    # vouched for, and the demo's `max_diff <= GRAD_TOLERANCE` must not pass.
    result = run_example(daemon, job_id, "cpu", tmp_path, "--steps", "6", "--lr", "1e30")
    assert np.isnan(result["final_loss"])
    diff = result["max_abs_grad_diff_vs_single_process"]
    assert not diff <= demo.GRAD_TOLERANCE, diff


def test_resuming_a_finished_run_keeps_its_final_checkpoint_as_it_was(
    daemon: DaemonProcess, job_id: str, tmp_path: Path
) -> None:
    from rendezvousd.trainer.checkpoint import checkpoint_path, load_checkpoint

    ckpt = tmp_path / "ckpt"
    flags = ("--steps", "4", "--checkpoint-dir", str(ckpt))
    first = run_example(daemon, f"{job_id}-a", "cpu", tmp_path / "a", *flags)
    final = checkpoint_path(ckpt, 4)
    before = load_checkpoint(final)[1]
    # 4 steps of 64 are the 256 samples' first epoch: the data resumes at epoch 1.
    cursor = {"epoch": 1, "consumed": 0}
    assert before == {"step": 4, "loss": first["final_loss"], "data_cursor": cursor}
    # A rerun of the same command with --resume (a scheduler that always resumes).
    again = run_example(daemon, f"{job_id}-b", "cpu", tmp_path / "b", *flags, "--resume")
    assert (again["start_step"], again["steps"]) == (4, 0)
    assert again["params_sha256"] == first["params_sha256"]
    assert load_checkpoint(final)[1] == before  # its loss was overwritten with NaN
    assert not again["checkpoint_written"]


def test_resume_without_a_checkpoint_dir_is_refused_not_a_fresh_start(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RENDEZVOUSD_")}
    run = subprocess.run(
        [sys.executable, *EXAMPLE, *TRAIN, "--steps", "1", "--resume"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr[-3000:]
    assert "--resume needs --checkpoint-dir" in run.stderr


def test_gpu_layout_never_puts_two_ranks_on_one_gpu() -> None:
    assert demo.gpu_layout(["0"]) == [["0"]]
    assert demo.gpu_layout(["0", "1"]) == [["0"], ["1"]]
    assert demo.gpu_layout(["0", "1", "2"]) == [["0"], ["1"]]
    assert demo.gpu_layout([str(i) for i in range(8)]) == [["0", "1"], ["2", "3"]]


def test_demo_nccl_without_a_gpu_says_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def missing() -> Any:
        raise ImportError("No module named 'cupy'")

    monkeypatch.setattr(nccl, "_import_cupy", missing)
    with pytest.raises(SystemExit, match=r"--backend nccl needs CuPy.*does not import"):
        demo.run(1, tmp_path / "card.json", tmp_path, backend="nccl")
    assert not (tmp_path / "card.json").exists()


def test_demo_nccl_without_a_device_asks_for_none_of_the_installs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake_cupy.install(monkeypatch, devices=0)
    with pytest.raises(SystemExit, match=r"no CUDA device \(CuPy sees none\); use --backend cpu$"):
        demo.run(1, tmp_path / "card.json", tmp_path, backend="nccl")


def test_host_baseline_data_is_the_data_the_device_trains_on(fake: Any) -> None:
    x_host, _ = example.make_data(16, 4, seed=3)
    x = devices.to_device(x_host, fake)
    idx = np.array([3, 1, 7], dtype=np.int64)
    np.testing.assert_array_equal(devices.to_host(x[devices.to_device(idx, fake)]), x_host[idx])


def _spare_gpu_trace(tmp_path: Path, *flags: str) -> list[str]:
    """One standalone node of one nccl rank on the fake GPU; its workers' trace events."""
    tmp_path.mkdir()
    trace = tmp_path / "trace.jsonl"
    run = subprocess.run(
        [
            *(sys.executable, *FAKE_GPU_LAUNCHER, "--standalone", "--nproc-per-node", "1"),
            *("--backend", "nccl", *flags, *FAKE_GPU_EXAMPLE, *TRAIN, "--steps", "2"),
            *("--result-dir", str(tmp_path / "out")),
        ],
        env={**os.environ, "RENDEZVOUSD_TRACE_FILE": str(trace)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    trained = {e["pid"] for e in events if e["event"] == "ring-up"}
    return [e["event"] for e in events if e["pid"] in trained]


def test_a_spare_makes_its_gpu_context_before_it_is_assigned(tmp_path: Path) -> None:
    events = _spare_gpu_trace(tmp_path / "on")
    assert events.index("spare-gpu-ready") < events.index("assignment-heard"), events
    off = _spare_gpu_trace(tmp_path / "off", "--no-spare-gpu-context")
    assert "spare-gpu-ready" not in off and "ring-up" in off, off
