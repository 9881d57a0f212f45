"""A job token is bound to the job created after it was minted: once the daemon forgot
the last job of an id, a token minted before that opens no later job with the id (a
new token is needed), across a daemon restart too. Tokens of the earlier form, without
a minting time, are read for one release."""

from __future__ import annotations

import hashlib
import hmac
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from rendezvousd.client import AuthenticationError, RendezvousClient
from rendezvousd.server.scope import admin_key, derive_job_token, read_job_token
from rendezvousd.storage.job_ends import JobEnds
from tests.support import DaemonProcess, parallel, wait_for

CLI = (sys.executable, "-m", "rendezvousd.cli")


def _legacy_token(admin: str, job_id: str) -> str:
    """A job token as rendezvousd before this release minted it: no minting time."""
    mac = hmac.new(admin_key(admin), f"job:{job_id}".encode(), hashlib.sha256).hexdigest()
    return f"rdzv-job.{job_id}.{mac}"


# -- the token --------------------------------------------------------------------


def test_a_token_carries_its_minting_time_under_its_mac() -> None:
    keys = [admin_key("a" * 32)]
    token = derive_job_token("a" * 32, "j.issued-5", issued=1_700_000_000)
    assert token.endswith(".issued-1700000000")
    read = read_job_token(token, keys)
    assert read is not None and (read.job, read.issued, read.until) == (
        "j.issued-5",
        1_700_000_000,
        None,
    )
    assert read_job_token(token.replace("issued-1700000000", "issued-1700000001"), keys) is None
    assert read_job_token(token.replace("issued-", "issued-+"), keys) is None
    # Dropping the field does not make an old-form token of it: the MAC differs.
    assert read_job_token(token.rsplit(".", 1)[0], keys) is None
    both = derive_job_token("a" * 32, "j", until=1_800_000_000, issued=1_700_000_000)
    assert both.endswith(".issued-1700000000.until-1800000000")
    read = read_job_token(both, keys)
    assert read is not None and (read.issued, read.until) == (1_700_000_000, 1_800_000_000)
    legacy = read_job_token(_legacy_token("a" * 32, "j"), keys)
    assert legacy is not None and (legacy.job, legacy.issued) == ("j", None)


def test_a_token_predates_an_end_only_when_minted_before_it() -> None:
    keys = [admin_key("a" * 32)]
    token = read_job_token(derive_job_token("a" * 32, "j", issued=1000), keys)
    legacy = read_job_token(_legacy_token("a" * 32, "j"), keys)
    assert token is not None and legacy is not None
    assert not token.predates(None) and not legacy.predates(None)
    assert token.predates(1000.5) and not token.predates(1000.0)
    assert legacy.predates(1.0)  # no minting time: minted before any end
    assert "mint a new one: rendezvousd token --job j " in token.stale_text(1000.5, 2000.0)


# -- the history of ends ----------------------------------------------------------


def test_the_history_is_bounded_and_folds_what_it_drops_into_a_floor() -> None:
    ends = JobEnds(kept=2)
    ends.record("a", 10.0)
    ends.record("b", 20.0)
    ends.record("a", 30.0)  # a again: now the newest
    ends.record("c", 40.0)  # b, the oldest, is dropped
    assert list(ends.ends) == ["a", "c"] and ends.floor == 20.0
    assert ends.ended("a", held=False) == 30.0
    # An id no longer listed counts as ended at the floor, unless the daemon holds it.
    assert ends.ended("b", held=False) == 20.0 and ends.ended("never", held=False) == 20.0
    assert ends.ended("b", held=True) is None
    write = ends.take()
    assert write.put == {"a": 30.0, "c": 40.0} and write.drop == {"b"} and write.floor == 20.0
    assert not ends.take()
    ends.unsent(write)  # its commit failed: written with the next one
    assert ends.take().put == {"a": 30.0, "c": 40.0}


def test_a_restored_history_is_checked() -> None:
    with pytest.raises(ValueError, match="not a valid job id"):
        JobEnds().restore([("bad id!", 1.0)], 0.0)
    with pytest.raises(ValueError, match="Unix seconds"):
        JobEnds().restore([("j", float("nan"))], 0.0)
    with pytest.raises(ValueError, match="the floor"):
        JobEnds().restore([], "x")


# -- against a daemon -------------------------------------------------------------


def _run_once(d: DaemonProcess, job_id: str, token: str) -> None:
    with RendezvousClient(d.endpoint, job_id, token=token) as c:
        c.join(num_nodes=1, gpus_per_node=1, node_rank=0, local_rank=0, timeout=20)
        c.leave()


def _forgotten(d: DaemonProcess, job_id: str) -> Callable[[], bool]:
    def check() -> bool:
        with RendezvousClient(d.endpoint, "any", token=d.token) as admin:
            return all(j.job_id != job_id for j in admin.list_jobs())

    return check


def test_a_token_minted_before_the_last_job_ended_opens_no_new_job(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path, job_id: str
) -> None:
    state = tmp_path / "state"
    args = ("--job-ttl-s", "0.2", "--state-dir", str(state))
    d = start_daemon(*args)
    before = derive_job_token(d.token, job_id, issued=int(time.time()) - 60)
    legacy = _legacy_token(d.token, job_id)
    # No job of this id ended yet: both work, the earlier form with a warning.
    clients = [RendezvousClient(d.endpoint, job_id, token=t) for t in (legacy, before)]
    try:
        parallel(
            [
                lambda c=c, i=i: c.join(  # type: ignore[misc]
                    num_nodes=2, gpus_per_node=1, node_rank=i, local_rank=0, timeout=20
                )
                for i, c in enumerate(clients)
            ]
        )
        for c in clients:
            c.leave()
    finally:
        for c in clients:
            c.close()
    assert f"job {job_id}: a job token without a minting time" in d.log()
    wait_for("the job forgotten", _forgotten(d, job_id), timeout=20)
    for stale in (before, legacy):
        with pytest.raises(AuthenticationError) as refused:
            _run_once(d, job_id, stale)
        message = str(refused.value)
        assert f"the job token for job {job_id!r}" in message, message
        assert f"mint a new one: rendezvousd token --job {job_id} " in message, message
    # Another job's token is untouched by this job's end.
    _run_once(d, job_id + "-other", derive_job_token(d.token, job_id + "-other", issued=1))
    # Minted after the end (the daemon's clock, which the test shares), it works; the
    # CLI mints with the time it is run at, in whole seconds: the next one is after it.
    gone = time.time()
    wait_for("the next second", lambda: int(time.time()) > gone)
    token_file = tmp_path / "fresh"
    subprocess.run(
        [*CLI, "token", "--job", job_id, "--admin-token-file", str(d.token_file), str(token_file)],
        check=True,
        capture_output=True,
        timeout=30,
    )
    fresh = token_file.read_text().strip()
    running = RendezvousClient(d.endpoint, job_id, token=fresh)
    try:
        running.join(num_nodes=1, gpus_per_node=1, node_rank=0, local_rank=0, timeout=20)
        # The end is durable: a restarted daemon refuses the old tokens, and the job
        # the fresh token opened (running, restored) keeps taking it.
        d.kill()
        d2 = start_daemon(*args, token=d.token)
        for stale in (before, legacy):
            with (
                RendezvousClient(d2.endpoint, job_id, token=stale) as c,
                pytest.raises(AuthenticationError, match="mint a new one"),
            ):
                c.get_job()
        with RendezvousClient(d2.endpoint, job_id, token=fresh) as c:
            assert c.get_job().summary.job_id == job_id
    finally:
        running.close()


def test_a_client_kept_open_across_its_jobs_end_opens_no_new_job(
    start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    """The client's calls go on one stream, opened (and its token checked) on the first:
    each later call is checked again, as a unary call would be."""
    d = start_daemon("--job-ttl-s", "0.2")
    token = derive_job_token(d.token, job_id, issued=int(time.time()) - 60)
    with RendezvousClient(d.endpoint, job_id, token=token) as client:
        client.join(num_nodes=1, gpus_per_node=1, node_rank=0, local_rank=0, timeout=20)
        client.leave()
        wait_for("the job forgotten", _forgotten(d, job_id), timeout=20)
        with pytest.raises(AuthenticationError) as refused:
            client.join(num_nodes=1, gpus_per_node=1, node_rank=0, local_rank=0, timeout=20)
    assert f"the job token for job {job_id!r} was minted at" in str(refused.value)
    with RendezvousClient(d.endpoint, "any", token=d.token) as admin:
        assert all(j.job_id != job_id for j in admin.list_jobs())
