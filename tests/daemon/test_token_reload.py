"""SIGHUP reloads the daemon's token file: a rotation without a restart. A real
daemon process; its token file is rewritten and the signal sent, as
`systemctl reload` (the unit's ExecReload) does."""

from __future__ import annotations

import dataclasses
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client import RendezvousClient
from tests.daemon.raw_calls import raw
from tests.support import DaemonProcess, members, spawn_daemon


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    d = spawn_daemon(tmp_path, "--heartbeat-timeout-s", "2")
    yield d
    d.kill()


def _refused(d: DaemonProcess, token: str) -> bool:
    """Whether a ListJobs with ``token`` is refused for its token."""
    with grpc.insecure_channel(d.endpoint) as ch:
        exc = raw(
            ch,
            "ListJobs",
            pb.ListJobsRequest().SerializeToString(),
            [("authorization", f"Bearer {token}")],
        )
    if exc is None:
        return False
    assert exc.code() is grpc.StatusCode.UNAUTHENTICATED, exc
    return True


def _rewrite(path: Path, *tokens: str, mode: int = 0o600) -> None:
    """Replaced atomically, as the runbook says (a temporary file moved over it)."""
    tmp = path.with_suffix(".new")
    tmp.write_text("".join(t + "\n" for t in tokens))
    tmp.chmod(mode)
    os.replace(tmp, path)


def test_sighup_adds_then_removes_a_token_without_a_restart(daemon: DaemonProcess) -> None:
    old, new = daemon.token, secrets.token_urlsafe(32)
    assert _refused(daemon, new)

    _rewrite(daemon.token_file, new, old)
    line = daemon.reload("reloaded")
    assert "2 token(s) accepted, 0 removed" in line
    assert "first line changed" in line  # job tokens minted from now on derive from `new`
    assert not _refused(daemon, new)
    assert not _refused(daemon, old)

    _rewrite(daemon.token_file, new)
    line = daemon.reload("reloaded")
    assert "1 token(s) accepted, 1 removed" in line
    assert "job tokens derived from a removed token are refused" in line
    assert _refused(daemon, old)
    assert not _refused(daemon, new)
    assert old not in daemon.log() and new not in daemon.log()


def test_a_heartbeat_stream_opened_with_a_removed_token_stays_open(
    daemon: DaemonProcess,
) -> None:
    """Decided: a call or stream is checked when it opens, as before. A member's
    heartbeat stream opened with the old token keeps beating after the old token is
    removed, so the reload fails no running job; its next stream or call is refused
    (a client given a token file then reads it again)."""
    old, new = daemon.token, secrets.token_urlsafe(32)
    job = f"reload-{secrets.token_hex(4)}"
    with RendezvousClient(daemon.endpoint, job, token=old) as client:
        client.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        client.start_heartbeat(0.2)
        _rewrite(daemon.token_file, new)
        daemon.reload("reloaded")
        assert _refused(daemon, old)
        admin = dataclasses.replace(daemon, token=new)
        # Past the heartbeat timeout (2 s): a stream cut by the reload would have lost it.
        time.sleep(3.0)
        states = [m.state for m in members(admin, job)]
        assert states == [pb.MEMBER_STATE_ACTIVE], states


@pytest.mark.parametrize(
    ("content", "mode", "problem"),
    [
        ((), 0o600, "holds no token"),
        (("short",), 0o600, "shorter than 16 characters"),
        (("x" * 32,), 0o644, "accessible by group/others"),
    ],
)
def test_an_invalid_file_keeps_the_old_tokens_and_says_why(
    daemon: DaemonProcess, content: tuple[str, ...], mode: int, problem: str
) -> None:
    _rewrite(daemon.token_file, *content, mode=mode)
    line = daemon.reload("not reloaded")
    assert " ERROR " in line
    assert problem in line
    assert "still accepting the 1 token(s) loaded before" in line
    assert not _refused(daemon, daemon.token)


def test_a_status_page_session_of_a_removed_token_ends(tmp_path: Path) -> None:
    """The admin token's session kept no token to check again (it "changes only with a
    restart"): after a reload removed it, the session must end, as a Bearer call with it."""
    from tests.daemon.test_status_page import login, request

    d = spawn_daemon(tmp_path, "--metrics-listen", "127.0.0.1:0")
    try:
        old, new = d.token, secrets.token_urlsafe(32)
        sessions = {}
        status, headers = login(d, old)
        assert status == 303
        sessions[old] = headers["set-cookie"].split(";", 1)[0]
        _rewrite(d.token_file, new, old)
        d.reload("reloaded")
        assert request(d, "GET", "/api/jobs", cookie=sessions[old])[0] == 200
        status, headers = login(d, new)
        sessions[new] = headers["set-cookie"].split(";", 1)[0]
        _rewrite(d.token_file, new)
        d.reload("reloaded")
        assert request(d, "GET", "/api/jobs", cookie=sessions[old])[0] == 401
        assert request(d, "GET", "/api/jobs", cookie=sessions[new])[0] == 200
    finally:
        d.kill()
