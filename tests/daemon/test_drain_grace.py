"""operations.md, "Shutdown": "calls drain within `--drain-grace-s` ...; exit 0": the
grace is an upper bound. A call still running when it passes (here a health Watch
whose client never hangs up, which the drain does not end) is cut, and the daemon
exits 0 at about the grace, not when the call would have ended."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support import DaemonProcess

GRACE_S = 2.0
SLACK_S = 3.0  # generous: start-up of the exit, a busy machine


def test_a_call_still_running_at_the_drain_grace_is_cut_and_the_daemon_exits_0(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon("--drain-grace-s", str(GRACE_S))
    ended = threading.Event()
    heard: list[int] = []
    with grpc.insecure_channel(d.endpoint) as channel:
        # The watch's own deadline far past the grace: only the drain can end it.
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(), timeout=120
        )
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING

        def read() -> None:
            with contextlib.suppress(grpc.RpcError):  # cut: how it ends
                for response in watch:
                    heard.append(response.status)
            ended.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        started = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        # Half the grace on, the watch still holds the drain (NOT_SERVING told, the
        # stream open): what follows is the grace cutting it, not the call ending.
        time.sleep(GRACE_S / 2)
        assert d.proc.poll() is None, d.log()
        assert not ended.is_set()
        code = d.proc.wait(GRACE_S + SLACK_S)
        elapsed = time.monotonic() - started
        assert code == 0, d.log()
        assert elapsed < GRACE_S + SLACK_S
        assert ended.wait(10), "the watch was not cut"
        assert health_pb2.HealthCheckResponse.NOT_SERVING in heard, heard
        watch.cancel()
