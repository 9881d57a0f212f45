"""Clocks that disagree: a daemon whose wall clock is stepped while it runs, a restart
whose clock differs from the old process's, and tokens minted on hosts whose clocks
differ from the daemon's. Each refusal names the daemon's clock, so that its reader
sees the two disagree; what the daemon keeps goes by its monotonic clock."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from rendezvousd.client import AsyncRendezvousClient, AuthenticationError
from rendezvousd.common.model import JobState
from rendezvousd.config import DaemonConfig
from rendezvousd.daemon import Daemon
from rendezvousd.server.scope import MINTED_AHEAD_S, derive_job_token
from rendezvousd.state.machine import JoinArgs, RendezvousState
from rendezvousd.storage import snapshot
from rendezvousd.storage.persistence import Persister
from tests.support import InProcessDaemon

HOURS_3 = 3 * 3600.0


@pytest_asyncio.fixture
async def ttl_daemon(tmp_path: Path) -> AsyncIterator[InProcessDaemon]:
    """An in-process daemon that forgets an ended job at once, with a state dir."""
    token = secrets.token_urlsafe(32)
    config = DaemonConfig(listen="127.0.0.1:0", job_ttl_s=0.2, state_dir=tmp_path / "state")
    server = Daemon(config, [token])
    port = await server.start()
    try:
        yield InProcessDaemon(server, f"127.0.0.1:{port}", token)
    finally:
        await server.stop(grace=0)


async def _until(what: str, check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def _run_and_forget(d: InProcessDaemon, job_id: str) -> None:
    async with d.client(job_id) as c:
        await c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=20)
        await c.leave()
    await _until("the job forgotten", lambda: job_id not in d.server.state.jobs)


async def _get_job(d: InProcessDaemon, job_id: str, token: str) -> None:
    """A call with ``token`` (refused with AuthenticationError, or NotFound past it)."""
    async with AsyncRendezvousClient(d.endpoint, job_id, token=token, retry_attempts=0) as c:
        await c.get_job()


async def _opens(d: InProcessDaemon, job_id: str, token: str) -> None:
    """``token`` opens a run of ``job_id``."""
    async with AsyncRendezvousClient(d.endpoint, job_id, token=token, retry_attempts=0) as c:
        await c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=20)
        await c.leave()


async def test_an_end_stamped_while_the_daemons_clock_was_ahead_blocks_no_new_token(
    ttl_daemon: InProcessDaemon, job_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The end was stamped with the live wall clock: stepped 3 h ahead while the job was
    forgotten, it refused every token of the job id minted in the next 3 h, restarts
    included (the end is kept), however often a new one was minted."""
    d = ttl_daemon
    real = time.time
    async with d.client(job_id) as c:
        await c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=20)
        await c.leave()
    monkeypatch.setattr(time, "time", lambda: real() + HOURS_3)  # NTP steps it ahead
    await _until("the job forgotten", lambda: job_id not in d.server.state.jobs)
    monkeypatch.setattr(time, "time", real)  # and back
    ended = d.server.persister.ended(job_id)
    assert ended is not None and ended <= real() + 1.0, (ended, real())
    # Minted after the end, on a right clock: it opens the job's next run.
    await asyncio.sleep(max(0.0, int(ended) + 1 - real()))
    await _opens(d, job_id, derive_job_token(d.token, job_id))


async def test_an_end_in_the_daemons_future_is_said_to_be_so(
    ttl_daemon: InProcessDaemon, job_id: str
) -> None:
    """An end kept from before this release's stamping (or by a daemon whose clock was
    ahead at start-up) lies in the daemon's future: the refusal said only "mint a new
    one", which fails again until the daemon's clock passes it."""
    d = ttl_daemon
    d.server.persister.job_ended(job_id, time.time() + HOURS_3)
    with pytest.raises(AuthenticationError) as refused:
        await _get_job(d, job_id, derive_job_token(d.token, job_id))
    said = str(refused.value)
    assert ", which is later than this daemon's clock reads 20" in said, said
    assert "that end was recorded while this daemon's clock was ahead" in said, said
    assert "check this daemon's clock, and use another job id, or mint a new token" in said


async def test_token_refusals_name_the_daemons_clock(
    ttl_daemon: InProcessDaemon, job_id: str
) -> None:
    """An expired token, or one minted before its job's end, named only the token's
    dates: a reader whose own clock differs from the daemon's could not tell why a token
    minted a minute ago had "expired" an hour ago."""
    d = ttl_daemon
    now = int(time.time())
    with pytest.raises(AuthenticationError) as expired:
        await _get_job(d, job_id, derive_job_token(d.token, job_id, until=now - 3600))
    said = str(expired.value)
    assert f"the job token for job {job_id!r} expired at " in said, said
    assert "(this daemon's clock reads 20" in said, said
    assert "if that date is still to come, this daemon's host's clock is ahead" in said, said
    await _run_and_forget(d, job_id)
    with pytest.raises(AuthenticationError) as stale:
        await _get_job(d, job_id, derive_job_token(d.token, job_id, issued=now - 60))
    said = str(stale.value)
    assert "(this daemon's clock reads 20" in said, said
    assert "on a host whose clock is behind looks older; check that host's clock" in said, said


async def test_a_token_minted_ahead_of_the_daemons_clock_is_refused(
    ttl_daemon: InProcessDaemon, job_id: str
) -> None:
    """Minted on a host a day ahead, a token opened the job of its id and, once that job
    was forgotten, the next job of the id too: "a job token opens only the job created
    after it was minted" did not hold for a day. A host a few seconds ahead still mints
    tokens that work."""
    d = ttl_daemon
    now = int(time.time())
    ahead = derive_job_token(d.token, job_id, issued=now + 86400)
    with pytest.raises(AuthenticationError) as refused:
        await _get_job(d, job_id, ahead)
    said = str(refused.value)
    assert f"the job token for job {job_id!r} was minted at " in said, said
    assert f"more than {MINTED_AHEAD_S} s after this daemon's clock reads 20" in said, said
    assert "it was minted on a host whose clock is ahead" in said, said
    assert "mint a new one: rendezvousd token --job" in said, said
    await _opens(d, job_id, derive_job_token(d.token, job_id, issued=now + 60))


def _ended_job(sm: RendezvousState, job_id: str, at: float) -> None:
    sm.join(JoinArgs.worker(job_id, 1, 1, 0, 0, "h", "", b"\x07" * 128, "i0"), at - 1.0)
    sm.leave(job_id, 1, 0, "i0", at)
    assert sm.jobs[job_id].state is JobState.ENDED


def test_a_restart_whose_clock_is_ahead_keeps_a_drained_jobs_age(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The age was kept as Unix time: restarted on a clock an hour ahead of the old
    process's, a job ended 6 s before the drain was an hour old, and was forgotten at
    once (its TTL long past); `status` showed a running job's AGE jump alike."""
    sm = RendezvousState()
    drained = time.monotonic()
    _ended_job(sm, "j", drained - 6.0)
    sm.drain(drained)
    saver = Persister(tmp_path, sm)
    saver.restore()
    saver.close()
    # The new process reads its wall clock an hour ahead of the old one's.
    monkeypatch.setattr(snapshot, "_WALL_OFFSET", snapshot._WALL_OFFSET + 3600.0)
    fresh = RendezvousState()
    Persister(tmp_path, fresh).restore()
    age = time.monotonic() - fresh.jobs["j"].state_since
    assert 6.0 <= age < 60.0, age
