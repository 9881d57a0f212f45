"""Fixtures for the daemon tests."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from tests.support import DaemonProcess


@pytest.fixture(scope="module")
def channel(daemon: DaemonProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(daemon.endpoint) as ch:
        yield ch
