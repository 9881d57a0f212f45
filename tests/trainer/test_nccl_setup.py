"""NCCL setup in ``init_distributed`` against a real daemon, CuPy faked at the seam.

Two ranks run as threads of this process (the fake CuPy is process-global);
the daemon is a real process.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from rendezvousd.client import RendezvousClient
from rendezvousd.client._session import Session
from rendezvousd.trainer.distributed import DistributedContext, init_distributed
from tests.support import DaemonProcess, parallel, wait_for

from .fake_cupy import FakeNcclError, install


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
