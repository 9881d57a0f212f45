"""Communicator setup in ``init_distributed`` and its one retry model (a transient
failure is retried on a fresh generation and id, then fails loudly), against a real
daemon: rendezvousd's process, or the one the file transport's rank 0 starts. CuPy
is faked at the seam.

Two ranks run as threads of this process (the fake CuPy is process-global).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rendezvousd.client import FileRendezvous, RendezvousClient
from rendezvousd.client._session import Session
from rendezvousd.trainer import distributed
from rendezvousd.trainer.comm import cpu_ring, devices
from rendezvousd.trainer.config import DistributedConfig
from rendezvousd.trainer.distributed import DistributedContext, init_distributed
from rendezvousd.trainer.errors import (
    ConfigError,
    DeviceCountError,
    PeerConnectionError,
    RetriesExhausted,
    TransientInitError,
)
from rendezvousd.trainer.topology import MultiNodeTopology
from tests.support import DaemonProcess, parallel, wait_for

from .fake_cupy import FakeCudaError, FakeNcclError, device_array, install


def _env(d: DaemonProcess, job: str, local: int) -> dict[str, str]:
    return {
        "RENDEZVOUSD_LOCAL_RANK": str(local),
        "RENDEZVOUSD_ENDPOINT": d.endpoint,
        "RENDEZVOUSD_JOB_ID": job,
        "RENDEZVOUSD_NUM_NODES": "1",
        "RENDEZVOUSD_GPUS_PER_NODE": "2",
        "RENDEZVOUSD_NODE_RANK": "0",
        "RENDEZVOUSD_BACKEND": "nccl",
        "RENDEZVOUSD_RETRIES": "1",
    }


def _config(tmp_path: Path, daemon: DaemonProcess) -> Path:
    config = tmp_path / "c.toml"
    config.write_text(
        "[distributed]\nsetup_timeout_s = 30\ncollective_timeout_s = 30\n"
        'heartbeat_interval_s = 0.5\n[distributed.rendezvous]\nkind = "daemon"\n'
        f'token_file = "{daemon.token_file}"\n'
    )
    return config


def _both_retry_on_one_fresh_generation(
    fake: Any, config: Path, daemon: DaemonProcess, job_id: str
) -> None:
    contexts: list[DistributedContext] = parallel(
        [
            functools.partial(init_distributed, str(config), env=_env(daemon, job_id, local))
            for local in range(2)
        ],
        limit=60,
    )
    assert all(isinstance(c, DistributedContext) for c in contexts), contexts
    inits: list[Any] = [e for e in fake.cuda.nccl.log if e[0] == "NcclCommunicator"]
    ids = {bytes(e[2]) for e in inits}
    assert len(inits) == 4 and len(ids) == 2  # two generations, each with its own id
    assert fake.cuda.nccl.names().count("get_unique_id") == 2
    generations = {c.rendezvous.membership.generation for c in contexts}  # type: ignore[attr-defined]
    assert len(generations) == 1 and generations.pop() > 1  # both on the retried generation
    for context in contexts:
        assert context.communicator.backend == "nccl"
        context.close()


def test_transient_init_failure_retries_on_a_fresh_generation_and_id(
    daemon: DaemonProcess, job_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = install(monkeypatch)
    fake.cuda.nccl.init_errors.append(FakeNcclError(6))  # one rank's first init fails
    _both_retry_on_one_fresh_generation(fake, _config(tmp_path, daemon), daemon, job_id)


def test_a_rank_that_finds_the_retry_generation_already_open_rejoins_it_too(
    daemon: DaemonProcess, job_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other rank's init succeeds only after the failed rank has aborted generation
    1 and opened generation 2 (a loaded machine): its confirmation barrier then hears
    STALE_GENERATION, not the abort, and it must rejoin all the same."""
    # The abort pushed on the heartbeat stream usually arrives first and the barrier is
    # never sent; on a loaded machine it may not have. Dropping it makes that the case.
    monkeypatch.setattr(Session, "fail", lambda self, error: None)
    fake = install(monkeypatch)
    fake.cuda.nccl.init_errors.append(FakeNcclError(6))  # the first init fails
    real = fake.cuda.nccl.NcclCommunicator
    calls: list[int] = []
    observer = RendezvousClient(daemon.endpoint, job_id, token_file=daemon.token_file)

    def second_init_late(*args: Any) -> Any:
        calls.append(len(calls))
        if len(calls) == 2:
            wait_for(
                "the failed rank to open generation 2",
                lambda: observer.get_job().summary.generation >= 2,
                20,
            )
        return real(*args)

    monkeypatch.setattr(fake.cuda.nccl, "NcclCommunicator", second_init_late)
    try:
        _both_retry_on_one_fresh_generation(fake, _config(tmp_path, daemon), daemon, job_id)
    finally:
        observer.close()


def _failing_inits(fake: Any, monkeypatch: pytest.MonkeyPatch, failing: set[int]) -> list[int]:
    """Makes NCCL init call number n (from 1, over all ranks) fail transiently for n
    in ``failing``; the others are the fake's own."""
    real = fake.cuda.nccl.NcclCommunicator
    calls: list[int] = []

    def init(*args: Any) -> Any:
        calls.append(len(calls) + 1)
        if calls[-1] in failing:
            raise FakeNcclError(6)
        return real(*args)

    monkeypatch.setattr(fake.cuda.nccl, "NcclCommunicator", init)
    return calls


def test_a_second_transient_failure_fails_every_rank_loudly(
    daemon: DaemonProcess, job_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One rank's init fails in each generation: generation 1's (calls 1-2) is retried,
    # generation 2's (calls 3-4, after every rank rejoined) uses up retry_attempts=1.
    fake = install(monkeypatch)
    calls = _failing_inits(fake, monkeypatch, {1, 3})
    config = _config(tmp_path, daemon)
    outcomes = parallel(
        [
            functools.partial(
                _outcome,
                functools.partial(init_distributed, str(config), env=_env(daemon, job_id, local)),
            )
            for local in range(2)
        ],
        limit=60,
    )
    assert len(calls) == 4, calls
    for outcome in outcomes:
        assert isinstance(outcome, RetriesExhausted), outcomes
        assert "nccl communicator setup for rank" in str(outcome)
        assert "failed 2 times (retry_attempts=1)" in str(outcome)
    # The rank whose own init failed names that failure; the other, the generation's end.
    causes = sorted(type(o.__cause__).__name__ for o in outcomes)
    assert causes == ["JobAborted", "TransientInitError"], outcomes


def _outcome(call: Any) -> Any:
    try:
        return call()
    except RetriesExhausted as exc:
        return exc


def _file_env(job_id: str, backend: str) -> dict[str, str]:
    # No endpoint and no path: the file transport's private world of one, whose
    # rank 0 starts the daemon on a UNIX socket; nothing listens on TCP.
    return {
        "RENDEZVOUSD_JOB_ID": job_id,
        "RENDEZVOUSD_BACKEND": backend,
        "RENDEZVOUSD_RETRIES": "1",
    }


def _ring_fails(monkeypatch: pytest.MonkeyPatch, times: int) -> None:
    """The CPU ring's setup fails transiently ``times`` times, then is the real one."""
    real = cpu_ring.connect_cpu_ring
    left = [times]

    def connect(*args: Any, **kwargs: Any) -> Any:
        if left[0]:
            left[0] -= 1
            raise PeerConnectionError("rank 0: peer could not be reached: Connection refused")
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_ring, "connect_cpu_ring", connect)


@pytest.mark.parametrize("backend", ["nccl", "cpu"])
def test_the_file_transport_retries_on_a_fresh_generation_too(
    backend: str, job_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, a FileRendezvous could not join twice: an NCCL retry there failed, and the
    CPU ring retried in place, on the same generation, by a second model."""
    fake = install(monkeypatch, devices=1)
    if backend == "nccl":
        fake.cuda.nccl.init_errors.append(FakeNcclError(6))
    else:
        _ring_fails(monkeypatch, 1)
    with init_distributed(env=_file_env(job_id, backend)) as ctx:
        assert isinstance(ctx.rendezvous, FileRendezvous)
        assert ctx.communicator.backend == backend
        membership = ctx.rendezvous.membership
        assert membership is not None and membership.generation == 2


@pytest.mark.parametrize("backend", ["nccl", "cpu"])
def test_the_file_transport_fails_loudly_after_the_retry(
    backend: str, job_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = install(monkeypatch, devices=1)
    if backend == "nccl":
        fake.cuda.nccl.init_errors.extend([FakeNcclError(6), FakeNcclError(6)])
    else:
        _ring_fails(monkeypatch, 2)
    with pytest.raises(RetriesExhausted) as info:
        init_distributed(env=_file_env(job_id, backend))
    message = str(info.value)
    assert f"{backend} communicator setup for rank 0 failed 2 times (retry_attempts=1)" in message
    expected = TransientInitError if backend == "nccl" else PeerConnectionError
    assert isinstance(info.value.__cause__, expected)


def test_a_worker_without_the_agent_is_its_own_nccl_host_on_a_shared_gpu(
    job_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the agent, NCCL_HOSTID was named after the local rank: every simulated
    node's local rank 0 on one machine was one NCCL host with one GPU, which NCCL
    refuses as a duplicate GPU. The process's own id differs between them."""
    install(monkeypatch, devices=1)
    monkeypatch.setenv(devices.SHARED_DEVICE_ENV, "1")
    for name in ("NCCL_HOSTID", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE"):
        monkeypatch.delenv(name, raising=False)
    with init_distributed(env=_file_env(job_id, "nccl")) as ctx:
        assert ctx.communicator.backend == "nccl"
    assert os.environ["NCCL_HOSTID"].endswith(f"-rendezvousd-pid{os.getpid()}")


def test_a_driver_problem_is_said_as_itself_not_as_zero_devices(
    job_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """device_count() is 0 on any CUDA error, which read 'found 0 devices; lower the
    per-node worker count' for a driver too old for CuPy."""
    fake = install(monkeypatch, devices=1)
    monkeypatch.delenv(devices.SHARED_DEVICE_ENV, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")

    def too_old() -> int:
        raise FakeCudaError(35)  # cudaErrorInsufficientDriver

    monkeypatch.setattr(fake.cuda.runtime, "getDeviceCount", too_old)
    with pytest.raises(ConfigError) as info:
        init_distributed(env=_file_env(job_id, "nccl"))
    message = str(info.value)
    assert "cudaErrorInsufficientDriver" in message and "found 0" not in message
    assert "LOCAL_RANK=0, CUDA_VISIBLE_DEVICES='0'" in message


def test_more_workers_per_node_than_visible_gpus_is_said_before_nccl_init(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under rendezvous-run nothing compared --nproc-per-node with the visible GPUs:
    local rank 1 of 2 on a one-GPU node failed inside NCCL init's Device(1), on every
    restart, as an NCCL init failure."""
    fake = install(monkeypatch, devices=1)
    monkeypatch.delenv(devices.SHARED_DEVICE_ENV, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    config = DistributedConfig(backend="nccl")
    topology = MultiNodeTopology(num_nodes=1, gpus_per_node=2, node_rank=0, local_rank=1)
    with pytest.raises(DeviceCountError) as info:
        distributed._communicator(config, None, topology, bytes(range(1, 129)), "", None)  # type: ignore[arg-type]
    message = str(info.value)
    assert "this node runs 2 workers" in message and "CUDA sees 1" in message
    assert "LOCAL_RANK=1, CUDA_VISIBLE_DEVICES='0'" in message and "--nproc-per-node" in message
    assert "NcclCommunicator" not in fake.cuda.nccl.names()


def test_without_the_launcher_too_few_gpus_are_said_as_under_it(
    job_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent-less path said "need 2 local devices ... found 1" without naming
    LOCAL_RANK, CUDA_VISIBLE_DEVICES or the shared-device mode."""
    fake = install(monkeypatch, devices=1)
    monkeypatch.delenv(devices.SHARED_DEVICE_ENV, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("RENDEZVOUSD_TOKEN", "t" * 32)  # the client reads it from os.environ
    env = {
        "RENDEZVOUSD_LOCAL_RANK": "1",
        "RENDEZVOUSD_ENDPOINT": "127.0.0.1:9",  # never reached: refused before the join
        "RENDEZVOUSD_JOB_ID": job_id,
        "RENDEZVOUSD_NUM_NODES": "1",
        "RENDEZVOUSD_GPUS_PER_NODE": "2",
        "RENDEZVOUSD_NODE_RANK": "0",
        "RENDEZVOUSD_BACKEND": "nccl",
        "RENDEZVOUSD_RETRIES": "1",
    }
    with pytest.raises(DeviceCountError) as info:
        init_distributed(env=env)
    message = str(info.value)
    assert "this node runs 2 workers" in message and "CUDA sees 1" in message, message
    assert "LOCAL_RANK=1, CUDA_VISIBLE_DEVICES='0'" in message
    assert f"{devices.SHARED_DEVICE_ENV}=1" in message
    assert "NcclCommunicator" not in fake.cuda.nccl.names()


def test_check_collectives_in_the_config_reaches_the_nccl_communicator(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, daemon: DaemonProcess, job_id: str
) -> None:
    """``check_collectives`` (RENDEZVOUSD_CHECK_COLLECTIVES) from the worker's config:
    two ranks' all-reduces of different sizes are told at once, not at the timeout."""
    fake = install(monkeypatch, meet=True)
    config = _config(tmp_path, daemon)
    envs = [
        {**_env(daemon, job_id, local), "RENDEZVOUSD_CHECK_COLLECTIVES": "true"}
        for local in range(2)
    ]
    contexts: list[DistributedContext] = parallel(
        [functools.partial(init_distributed, str(config), env=e) for e in envs], limit=60
    )
    assert all(isinstance(c, DistributedContext) for c in contexts), contexts

    def reduce(context: DistributedContext, size: int) -> None:
        with fake.cuda.Device(context.communicator.device):  # type: ignore[attr-defined]
            array = device_array(fake, np.ones(size), np.float32)
        context.communicator.all_reduce(array)

    try:
        errors = parallel(
            [functools.partial(reduce, c, 4 + c.topology.rank) for c in contexts], limit=20
        )
        assert all("disagree on its element count 4 to 5" in str(e) for e in errors), errors
    finally:
        for context in contexts:
            context.close()
