"""Fixtures: a real rendezvousd process on 127.0.0.1:0 and its token."""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest
import pytest_asyncio

from rendezvousd.config import DaemonConfig
from rendezvousd.daemon import Daemon
from tests import GRPC_VERBOSITY_AT_START
from tests.support import (
    TORCH_PYTHON_ENV,
    TORCH_WORKER,
    DaemonProcess,
    InProcessDaemon,
    Pki,
    Torchrun,
    job_name,
    make_pki,
    spawn_daemon,
)


def _restore_grpc_verbosity() -> None:
    if GRPC_VERBOSITY_AT_START is None:
        os.environ.pop("GRPC_VERBOSITY", None)
    else:
        os.environ["GRPC_VERBOSITY"] = GRPC_VERBOSITY_AT_START


# At once, not only per test: importing ``rendezvousd.trainer`` (above, through the
# tests' support) set it in this process, and pytest-xdist's workers, started from
# this one after its conftest loaded, would inherit it as the run's own.
_restore_grpc_verbosity()


@pytest.fixture(autouse=True)
def _grpc_verbosity_kept() -> Iterator[None]:
    """The launcher's and CLI's ``main``, run in this process by some tests, quiet gRPC
    by setting GRPC_VERBOSITY in os.environ: daemons started by later tests would
    inherit it and drop the "Handshake failed" lines other tests count. Importing
    ``rendezvousd.trainer`` sets it too: each test starts with the run's own."""
    _restore_grpc_verbosity()
    yield
    _restore_grpc_verbosity()


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    started: list[DaemonProcess] = []

    def start(*args: str, **kw: object) -> DaemonProcess:
        daemon = spawn_daemon(tmp_path, *args, **kw)  # type: ignore[arg-type]
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.kill()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """One daemon shared by a module's tests; each test uses its own job id.
    Its metrics (``metrics_url``) let tests wait for parked calls."""
    d = spawn_daemon(
        tmp_path_factory.mktemp("daemon"),
        "--heartbeat-timeout-s",
        "3",
        "--metrics-listen",
        "127.0.0.1:0",
    )
    yield d
    d.kill()


@pytest.fixture
def job_id(request: pytest.FixtureRequest) -> str:
    return job_name(request)


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest_asyncio.fixture
async def inproc_daemon() -> AsyncIterator[InProcessDaemon]:
    token = secrets.token_urlsafe(32)
    server = Daemon(DaemonConfig(listen="127.0.0.1:0", heartbeat_timeout_s=3.0), [token])
    port = await server.start()
    try:
        yield InProcessDaemon(server, f"127.0.0.1:{port}", token)
    finally:
        await server.stop(grace=0)


@pytest.fixture(scope="session")
def torch_python() -> str:
    path = os.environ.get(TORCH_PYTHON_ENV)
    if not path:
        pytest.skip(f"no torch venv: run scripts/test.sh, or set ${TORCH_PYTHON_ENV}")
    if not Path(path).exists():
        pytest.fail(f"${TORCH_PYTHON_ENV}={path} does not exist: run scripts/torch_venv.sh")
    return path


@pytest.fixture
def torchrun(torch_python: str, tmp_path: Path) -> Iterator[Callable[..., Torchrun]]:
    """``torchrun(d, job, nnodes, *worker_args, conf=..., prefix=...)`` starts one agent;
    its workers run ``script``: torch_worker.py, or ENV_WORKER where the test asserts the
    rendezvous and not what torch trains (support.ENV_WORKER says when)."""
    started: list[Torchrun] = []

    def start(
        d: DaemonProcess | None,
        job: str,
        nnodes: str,
        *worker_args: str,
        nproc: int = 2,
        max_restarts: int = 0,
        conf: str | None = None,
        endpoint: str | None = None,
        prefix: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        script: Path = TORCH_WORKER,
    ) -> Torchrun:
        n = len(started)
        log, out = tmp_path / f"torchrun-{n}.err", tmp_path / f"torchrun-{n}.out"
        cmd = [
            *prefix,
            torch_python,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            nnodes,
            "--nproc-per-node",
            str(nproc),
            "--rdzv-backend",
            "rendezvousd",
            "--rdzv-endpoint",
            endpoint or (d.endpoint if d else ""),
            "--rdzv-id",
            job,
            "--rdzv-conf",
            conf or f"token_file={d.token_file if d else ''}",
            "--max-restarts",
            str(max_restarts),
            "--monitor-interval",
            "0.1",
            # torch's per-agent log directory (one a launch, under the base given) made
            # in /tmp without it: thousands of torchelastic_* left behind by the suite.
            "--log-dir",
            str(tmp_path / "torchelastic"),
            str(script),
            *worker_args,
        ]
        with log.open("w") as err, out.open("w") as stdout:
            proc = subprocess.Popen(
                cmd,
                stdout=stdout,
                stderr=err,
                text=True,
                start_new_session=True,
                env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
            )
        agent = Torchrun(proc, log, out)
        started.append(agent)
        return agent

    yield start
    for agent in started:
        agent.kill()
