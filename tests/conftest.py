"""Fixtures: a real rendezvousd process on 127.0.0.1:0 and its token."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from rendezvousd.config import DaemonConfig
from rendezvousd.server import Daemon
from tests.support import (
    DaemonProcess,
    InProcessDaemon,
    Pki,
    job_name,
    make_pki,
    spawn_daemon,
)


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
