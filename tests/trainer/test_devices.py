"""devices.py: the array module per backend, device selection and explicit
host/device copies, against the fake CuPy at the package's one CuPy seam."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from rendezvousd.trainer.comm import devices, nccl
from rendezvousd.trainer.errors import ConfigError
from tests.trainer import fake_cupy


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Any:
    return fake_cupy.install(monkeypatch)


def test_the_fake_refuses_implicit_host_conversion_like_real_device_arrays(fake: Any) -> None:
    # The device-path tests prove no np.asarray on device arrays only if this holds.
    device = fake.asarray(np.arange(3.0))
    for implicit in (np.asarray, np.array, np.ascontiguousarray, np.max):
        with pytest.raises(TypeError, match="Implicit conversion"):
            implicit(device)
    with pytest.raises(TypeError):
        _ = np.arange(3.0) + device
    with pytest.raises(TypeError):
        _ = device + np.arange(3.0)


def test_cpu_backend_is_numpy_and_never_touches_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_cupy() -> Any:
        raise AssertionError("the cpu backend imported CuPy")

    monkeypatch.setattr(nccl, "_import_cupy", no_cupy)
    assert devices.array_module("cpu") is np
    host = np.arange(4, dtype=np.float32)
    devices.set_device(np, 3)
    assert devices.to_host(host) is host
    assert devices.to_device(host, np) is host
    assert not devices.is_device_array(host)


def test_importing_the_trainer_modules_does_not_import_cupy() -> None:
    code = (
        "import sys\n"
        "import rendezvousd.trainer.comm.devices, rendezvousd.trainer.example, "
        "rendezvousd.trainer.checkpoint, rendezvousd.trainer.demo\n"
        "print('cupy' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_nccl_backend_gets_cupy_through_the_seam(fake: Any) -> None:
    assert devices.array_module("nccl") is fake


def test_nccl_backend_without_cupy_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing() -> Any:
        raise ImportError("No module named 'cupy'")

    monkeypatch.setattr(nccl, "_import_cupy", missing)
    with pytest.raises(ConfigError, match=r"CuPy.*No module named 'cupy'.*gpu-cuda12"):
        devices.array_module("nccl")


def test_unknown_backend_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="'tpu'"):
        devices.array_module("tpu")


def test_host_device_round_trip_copies_both_ways(fake: Any) -> None:
    host = np.arange(6, dtype=np.float64).reshape(2, 3)
    before = fake.counts["asarray"], fake.counts["asnumpy"]
    device = devices.to_device(host, fake)
    assert devices.is_device_array(device)
    assert devices.to_device(device, fake) is device  # already there: no copy
    host[0, 0] = 99.0  # separate memory: the device copy keeps its value
    back = devices.to_host(device)
    assert isinstance(back, np.ndarray) and back.dtype == np.float64
    np.testing.assert_array_equal(back, np.arange(6.0).reshape(2, 3))
    assert devices.to_device(device, np).tolist() == back.tolist()
    assert (fake.counts["asarray"], fake.counts["asnumpy"]) == (
        before[0] + 1,
        before[1] + 2,
    )


def test_set_device_makes_the_local_rank_current_for_allocations(fake: Any) -> None:
    try:
        devices.set_device(fake, 1)
        assert fake.zeros(2).device.id == 1
        assert devices.to_device(np.ones(2), fake).device.id == 1
    finally:
        devices.set_device(fake, 0)


def test_shared_device_mode_puts_every_rank_on_gpu_0_as_its_own_nccl_host() -> None:
    from rendezvousd.trainer.comm import devices

    off: dict[str, str] = {}
    on = {devices.SHARED_DEVICE_ENV: "1"}
    assert [devices.device_for(r, off) for r in range(3)] == [0, 1, 2]
    assert [devices.device_for(r, on) for r in range(3)] == [0, 0, 0]
    envs = [dict(on), dict(on)]
    for rank, env in enumerate(envs):
        devices.prepare_nccl(rank, env)
    assert envs[0]["NCCL_HOSTID"] != envs[1]["NCCL_HOSTID"]
    assert all(e["NCCL_SOCKET_IFNAME"] == "lo" and e["NCCL_IB_DISABLE"] == "1" for e in envs)
    untouched: dict[str, str] = {}
    devices.prepare_nccl(0, untouched)
    assert untouched == {}
    # A user's own NCCL settings win.
    mine = {**on, "NCCL_SOCKET_IFNAME": "eth0"}
    devices.prepare_nccl(1, mine)
    assert mine["NCCL_SOCKET_IFNAME"] == "eth0"


def test_a_spare_makes_its_gpus_context_while_it_waits(
    fake: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(devices.SHARED_DEVICE_ENV, raising=False)
    assert devices.warm_spare(1) is None
    assert fake.world.contexts == {1} and fake.world.device == 1
    monkeypatch.setenv(devices.SHARED_DEVICE_ENV, "1")
    assert devices.warm_spare(1) is None
    assert fake.world.contexts == {0, 1}


@pytest.mark.parametrize("mode", [1, 2, 3])
def test_a_spare_leaves_a_gpu_alone_outside_the_shared_compute_mode(fake: Any, mode: int) -> None:
    # Exclusive (1, 3): its context would lock the running worker out; prohibited (2).
    fake.world.compute_mode = mode
    why = devices.warm_spare(0)
    assert why is not None and f"compute mode {mode}" in why
    assert fake.world.contexts == set()
