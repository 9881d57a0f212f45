"""Fixtures: a real rendezvousd process on 127.0.0.1:0 and its token."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support import DaemonProcess, Pki, job_name, make_pki, spawn_daemon


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
    """One daemon shared by a module's tests; each test uses its own job id."""
    d = spawn_daemon(tmp_path_factory.mktemp("daemon"), "--heartbeat-timeout-s", "3")
    yield d
    d.kill()


@pytest.fixture
def job_id(request: pytest.FixtureRequest) -> str:
    return job_name(request)


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))
