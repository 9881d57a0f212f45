"""A damaged or hand-edited ``state.db`` cannot break a running daemon: every restored
field is checked at start-up, a commit that fails for any reason is undone, and a
timer task that dies turns health NOT_SERVING instead of going unnoticed."""

from __future__ import annotations

import asyncio
import logging
import secrets
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rendezvousd.client import RendezvousError
from rendezvousd.config import DaemonConfig
from rendezvousd.daemon import Daemon
from rendezvousd.state.machine import JoinArgs, RendezvousState
from rendezvousd.storage.persistence import Persister
from rendezvousd.storage.store_sqlite import SqliteStore
from tests.support import InProcessDaemon, serve_refused

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
ID = b"\x07" * 128


def _state_dir_with_a_running_job(state: Path) -> None:
    sm = RendezvousState()
    for local in (0, 1):
        sm.join(
            JoinArgs.worker("j", 1, 2, 0, local, "h", "", ID if local == 0 else b"", f"i{local}"),
            0.0,
        )
    saver = Persister(state, sm)
    saver.restore()
    saver.close()


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        # Forming: the restart opens the next generation, 2**63, which SQLite cannot store.
        ("UPDATE jobs SET generation = 9223372036854775807, state = 'FORMING', "
         "detail = json_set(detail, '$.members', json('[]'))",
         "generation must be an integer in 1..4611686018427387904"),
        # Failed: restored, then the next Join's new generation killed the timer.
        ("UPDATE jobs SET generation = 9223372036854775807, state = 'FAILED'",
         "generation must be an integer in 1..4611686018427387904"),
        ("UPDATE jobs SET num_nodes = 1048576, gpus_per_node = 1048576, "
         "detail = json_set(detail, '$.members', json('[]')), state = 'ENDED'",
         "num_nodes x gpus_per_node = 1048576 x 1048576 exceeds 1048576 ranks"),
        ("UPDATE jobs SET job_id = 'no/such id'; UPDATE kv SET job_id = 'no/such id'",
         "job id 'no/such id' is invalid"),
        ("UPDATE jobs SET detail = json_set(detail, '$.members[1].instance_id', '')",
         "members[].instance_id must not be empty"),
        ("UPDATE jobs SET detail = json_set(detail, '$.barriers', json('{\"b\": 9223372036854775807}'))",
         "completed must be an integer in 0..4611686018427387904"),
        ("UPDATE jobs SET detail = json_set(detail, '$.state_since_unix', 'yesterday')",
         "state_since_unix must be a number of Unix seconds"),
        ("UPDATE jobs SET detail = json_set(detail, '$.last_call_s', 'soon')",
         "last_call_s must be a number of seconds"),
        ("UPDATE jobs SET detail = json_set(detail, '$.last_call_s', -1)",
         "last_call_s must not be negative"),
        # A close of a generation the job never reached, or one no AbortJob would take.
        ("UPDATE jobs SET detail = json_set(detail, '$.closed', "
         "json('{\"at_unix\": 1, \"reason\": \"stopped\", \"generation\": 2}'))",
         "generation must be an integer in 1..1"),
        ("UPDATE jobs SET detail = json_set(detail, '$.closed', "
         "json('{\"at_unix\": 1, \"reason\": \"a\\u0007b\", \"generation\": 1}'))",
         "closed.reason contains control characters"),
    ],
)  # fmt: skip
def test_a_bad_restored_field_refuses_start_up_naming_the_row(
    tmp_path: Path, edit: str, problem: str
) -> None:
    state = tmp_path / "state"
    _state_dir_with_a_running_job(state)
    db = sqlite3.connect(state / "state.db")
    db.executescript(edit)
    db.commit()
    db.close()
    done = serve_refused(tmp_path, state, timeout=20)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "serving" not in done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    assert f"state database {state / 'state.db'}, table jobs, row job_id=" in done.stderr
    assert problem in done.stderr, done.stderr
    assert "fix or delete that row" in done.stderr


async def _health(endpoint: str) -> int:
    async with grpc.aio.insecure_channel(endpoint) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        status: int = reply.status
        return status


@pytest_asyncio.fixture
async def stored_daemon(tmp_path: Path) -> AsyncIterator[InProcessDaemon]:
    """An in-process daemon with a state dir (its state machine and store at hand)."""
    token = secrets.token_urlsafe(32)
    config = DaemonConfig(
        listen="127.0.0.1:0", heartbeat_timeout_s=2.0, state_dir=tmp_path / "state"
    )
    server = Daemon(config, [token])
    port = await server.start()
    try:
        yield InProcessDaemon(server, f"127.0.0.1:{port}", token)
    finally:
        await server.stop(grace=0)


async def test_a_commit_failing_with_any_exception_is_undone_and_the_timer_lives_on(
    stored_daemon: InProcessDaemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = stored_daemon
    async with d.client("j") as c:
        await c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        await c.kv_set("kept", b"1")
        store = d.server.persister.store
        assert store is not None
        broken = True
        real_write = SqliteStore.write

        def write(self: SqliteStore, *args: Any, **kw: Any) -> bool:
            if broken:
                # What a value SQLite cannot bind raises: not a sqlite3.Error.
                raise OverflowError("Python int too large to convert to SQLite INTEGER")
            return real_write(self, *args, **kw)

        monkeypatch.setattr(SqliteStore, "write", write)
        with pytest.raises(RendezvousError) as info:
            await c.kv_set("lost", b"2")
        assert (info.value.code, info.value.reason) == ("UNAVAILABLE", "STORAGE_UNAVAILABLE")
        assert "lost" not in d.server.state.jobs["j"].gen.kv  # undone, not left applied
        assert await _health(d.endpoint) == NOT_SERVING
        broken = False
        await d.until("health SERVING once commits work", lambda: d.server.persister.healthy)
        assert d.server._ticker is not None and not d.server._ticker.done()
        assert await _health(d.endpoint) == SERVING
        with pytest.raises(RendezvousError) as missing:
            await c.kv_get("lost", wait=False)
        assert missing.value.reason == "KEY_NOT_FOUND"
        assert await c.kv_get("kept", wait=False) == b"1"
        await c.kv_set("lost", b"2")  # the retry, once storage takes writes
        assert await c.kv_get("lost", wait=False) == b"2"


async def test_a_timer_task_that_dies_is_logged_and_turns_health_not_serving(
    stored_daemon: InProcessDaemon,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    d = stored_daemon
    assert await _health(d.endpoint) == SERVING

    def tick(now: float) -> None:
        raise RuntimeError("a bug in the state machine")

    monkeypatch.setattr(d.server.state, "tick", tick)
    with caplog.at_level(logging.ERROR, logger="rendezvousd"):
        await d.until("the timer task to end", lambda: d.server._ticker is not None
                      and d.server._ticker.done())  # fmt: skip
        deadline = asyncio.get_running_loop().time() + 5
        while await _health(d.endpoint) != NOT_SERVING:
            assert asyncio.get_running_loop().time() < deadline, "health stayed SERVING"
            await asyncio.sleep(0.01)
    assert "timer task died (RuntimeError: a bug in the state machine)" in caplog.text
    assert "health is NOT_SERVING until the daemon is restarted" in caplog.text
