"""Where a client's token comes from, in order: ``token=``, ``token_file=``,
$RENDEZVOUSD_TOKEN_FILE, $RENDEZVOUSD_TOKEN; and the clear error when there is none,
or the file holds none, before anything is sent."""

from __future__ import annotations

import os
import secrets
import socket
import stat
import subprocess
import time
import traceback
from pathlib import Path
from typing import Any

import pytest

from rendezvousd.client import InvalidRequest, RendezvousClient, RendezvousError, TlsConfig
from tests.support import DaemonProcess, launcher_cmd


@pytest.fixture(autouse=True)
def _no_token_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RENDEZVOUSD_TOKEN", raising=False)
    monkeypatch.delenv("RENDEZVOUSD_TOKEN_FILE", raising=False)


def test_the_token_from_the_environment_is_used(
    daemon: DaemonProcess, job_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RENDEZVOUSD_TOKEN", f"  {daemon.token}\n")
    with RendezvousClient(daemon.endpoint, job_id) as c:
        assert c.list_jobs() is not None  # authorized: a wrong token is refused


def test_the_token_file_from_the_environment_comes_before_the_token(
    daemon: DaemonProcess, job_id: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    good = tmp_path / "token"
    good.write_text(f"\n{daemon.token}\n")  # the first non-blank line
    good.chmod(0o600)
    monkeypatch.setenv("RENDEZVOUSD_TOKEN_FILE", str(good))
    monkeypatch.setenv("RENDEZVOUSD_TOKEN", "not-the-token")
    with RendezvousClient(daemon.endpoint, job_id) as c:
        assert c.list_jobs() is not None


def test_an_unreadable_token_file_from_the_environment_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    missing = tmp_path / "nope"
    monkeypatch.setenv("RENDEZVOUSD_TOKEN_FILE", str(missing))
    with pytest.raises(InvalidRequest) as refused:
        RendezvousClient("127.0.0.1:1", "j")
    said = str(refused.value)
    assert said == (
        f"cannot read token file {missing} (from $RENDEZVOUSD_TOKEN_FILE): "
        "No such file or directory"
    ), said


def test_no_token_anywhere_is_an_error_naming_every_source(daemon: DaemonProcess) -> None:
    with pytest.raises(InvalidRequest) as no_token:
        RendezvousClient(daemon.endpoint, "j")
    said = str(no_token.value)
    for source in ("token=", "token_file=", "$RENDEZVOUSD_TOKEN", "$RENDEZVOUSD_TOKEN_FILE"):
        assert source in said, said


def test_an_empty_token_file_is_an_error_naming_it(daemon: DaemonProcess, tmp_path: Path) -> None:
    empty = tmp_path / "token"
    empty.write_text("\n  \n")
    empty.chmod(0o600)
    with pytest.raises(InvalidRequest, match=f"token file {empty} is empty"):
        RendezvousClient(daemon.endpoint, "j", token_file=empty)


@pytest.mark.parametrize(
    ("source", "text"),
    [
        ("token=", "s3cret-é-token"),
        ("token file", "\ufeffs3cret-token"),  # saved with a byte-order mark
        ("$RENDEZVOUSD_TOKEN", "s3cret\ttoken"),
    ],
)
def test_a_token_no_daemon_can_accept_is_refused_naming_its_source_not_it(
    source: str, text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gRPC cannot send it: every call failed INTERNAL "Invalid metadata", naming no token."""
    options: dict[str, Any] = {}
    if source == "token=":
        options["token"] = text
    elif source == "token file":
        path = tmp_path / "token"
        path.write_text(text + "\n", encoding="utf-8")
        path.chmod(0o600)
        options["token_file"] = path
    else:
        monkeypatch.setenv("RENDEZVOUSD_TOKEN", text)
    with pytest.raises(InvalidRequest) as refused:
        RendezvousClient("127.0.0.1:1", "j", **options)
    said = f"{refused.value} {refused.value!r}"
    assert source in said and "rendezvousd token FILE" in said, said
    assert "s3cret" not in said, said


def test_a_failed_call_s_traceback_with_its_locals_does_not_show_the_token() -> None:
    """What error reporters (Sentry, by default) capture: every frame's locals, as repr;
    the call core's frames hold the client's session."""
    token = secrets.token_urlsafe(32)
    with socket.create_server(("127.0.0.1", 0)) as silent:
        endpoint = f"127.0.0.1:{silent.getsockname()[1]}"
        c = RendezvousClient(endpoint, "j", token=token, call_timeout=0.5, retry_attempts=0)
        with c, pytest.raises(RendezvousError) as failed:
            c.list_jobs()
    shown = traceback.TracebackException.from_exception(failed.value, capture_locals=True)
    frames = [f for f in shown.stack if f.filename != __file__]
    assert frames, shown.stack
    for frame in frames:
        for name, value in (frame.locals or {}).items():
            assert token not in value, f"{frame.name}: {name}"


@pytest.mark.parametrize("mode", [0o644, 0o604, 0o660, 0o620, 0o602], ids=oct)
def test_a_token_file_others_can_read_or_change_is_refused_before_anything_is_sent(
    mode: int, tmp_path: Path
) -> None:
    """A token others can read is theirs as well: refused as the daemon refuses its own
    (ssh does the same for a private key), with the fix, and without the token."""
    token = secrets.token_urlsafe(32)
    path = tmp_path / "token"
    path.write_text(token + "\n")
    path.chmod(mode)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(0.5)
        endpoint = f"127.0.0.1:{listener.getsockname()[1]}"
        with pytest.raises(InvalidRequest) as refused:
            RendezvousClient(endpoint, "j", token_file=path)
        with pytest.raises(TimeoutError):
            listener.accept()  # nothing dialled the daemon
    said = f"{refused.value} {refused.value!r}"
    assert str(path) in said and stat.filemode(0o100000 | mode) in said, said
    assert f"chmod 600 {path}" in said, said
    assert token not in said, said


@pytest.mark.parametrize("mode", [0o600, 0o400, 0o640, 0o440], ids=oct)
def test_a_token_file_only_its_owner_and_group_can_read_is_used(
    mode: int, daemon: DaemonProcess, job_id: str, tmp_path: Path
) -> None:
    """Group read stays allowed: a Kubernetes pod with fsGroup gets its Secret 0440
    whatever defaultMode says, and that group is the pod's own."""
    path = tmp_path / "token"
    path.write_text(daemon.token + "\n")
    path.chmod(mode)
    with RendezvousClient(daemon.endpoint, job_id, token_file=path) as c:
        assert c.list_jobs() is not None  # authorized: a wrong token is refused


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_token_path_that_is_not_a_file_is_refused_at_once_not_read_forever(
    tmp_path: Path, kind: str
) -> None:
    """Reading a FIFO nobody writes would block the client with no deadline; a
    directory was "cannot read ...: Is a directory", which says nothing to do."""
    path = tmp_path / "token"
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    else:
        path.mkdir(mode=0o700)
    started = time.monotonic()
    with pytest.raises(InvalidRequest, match="is not a regular file") as refused:
        RendezvousClient("127.0.0.1:1", "j", token_file=path)
    assert time.monotonic() - started < 5
    assert str(path) in str(refused.value)


def test_a_token_file_that_is_not_text_is_an_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "token.bin"
    path.write_bytes(b"\xff\xfe" + secrets.token_bytes(30))
    path.chmod(0o600)
    with pytest.raises(InvalidRequest, match="is not text") as info:
        RendezvousClient("127.0.0.1:1", "j", token_file=path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("given", ["cert", "key"])
def test_half_a_client_key_pair_is_refused_before_grpc_aborts_on_it(
    tmp_path: Path, given: str
) -> None:
    # gRPC's core SIGABRTs the process at the first connect with only one of the two.
    pem = tmp_path / "x.pem"
    pem.write_text("not used\n")
    with pytest.raises(InvalidRequest, match="mutual TLS needs both"):
        TlsConfig(ca=pem, **{given: pem})
    with pytest.raises(InvalidRequest, match="without ca=: a client certificate or key needs ca="):
        TlsConfig.from_paths(None, **{given: str(pem)})


@pytest.mark.parametrize("call_stream", [True, False])
def test_a_refused_token_is_read_again_from_its_file_and_the_call_sent_once_more(
    daemon: DaemonProcess,
    job_id: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    call_stream: bool,
) -> None:
    """A rotation (h115 D1): the client's file held a token the daemon no longer
    accepts when the client was made, and the daemon's token when it called. Before,
    the call was refused (the file was read once); now it is refused once, the file read
    again, and the call made with its token, said in the log without either token."""
    token_file = tmp_path / "token"
    stale = secrets.token_urlsafe(32)
    token_file.write_text(stale + "\n")
    token_file.chmod(0o600)
    with RendezvousClient(
        daemon.endpoint, job_id, token_file=token_file, call_stream=call_stream
    ) as c:
        token_file.write_text(daemon.token + "\n")  # the rotation reached this client
        assert c.list_jobs() is not None
        assert c.list_jobs() is not None  # and stays with it
    said = caplog.text
    assert f"token file {token_file} holds another token now (rotated)" in said, said
    assert stale not in said and daemon.token not in said


def test_a_token_refused_and_unchanged_in_its_file_is_refused_naming_a_rotation(
    daemon: DaemonProcess, job_id: str, tmp_path: Path
) -> None:
    """No new token in the file: refused once, not sent again, and the error asks
    whether the token was rotated instead of reading like any other failure."""
    token_file = tmp_path / "token"
    token_file.write_text(secrets.token_urlsafe(32) + "\n")
    token_file.chmod(0o600)
    with (
        RendezvousClient(daemon.endpoint, job_id, token_file=token_file) as c,
        pytest.raises(RendezvousError) as caught,
    ):
        c.list_jobs()
    assert caught.value.code == "UNAUTHENTICATED"
    assert "was it rotated?" in str(caught.value), caught.value


# A worker of rendezvous-run that makes a client of its own, with no token given.
_OWN_CLIENT_WORKER = r"""
import os, sys
from rendezvousd.client import InvalidRequest, RendezvousClient
from rendezvousd.trainer.distributed import init_distributed

with init_distributed() as ctx:
    try:
        RendezvousClient(ctx.rendezvous.endpoint, "own")
        said = "made"
    except InvalidRequest as exc:
        said = str(exc)
    with open(f"{sys.argv[1]}.{ctx.rank}", "w") as fh:
        fh.write(said)
"""


def test_a_worker_of_rendezvous_run_is_told_the_launcher_s_way_to_a_token(
    daemon: DaemonProcess, job_id: str, tmp_path: Path
) -> None:
    """Given $RENDEZVOUSD_TOKEN, which the launcher leaves out of its workers'
    environment, a worker's own client was told to set $RENDEZVOUSD_TOKEN."""
    script = tmp_path / "w.py"
    script.write_text(_OWN_CLIENT_WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RENDEZVOUSD_TOKEN")}
    env["RENDEZVOUSD_TOKEN"] = daemon.token
    cmd = launcher_cmd(1, 0, 1, endpoint=daemon.endpoint, job=job_id)
    run = subprocess.run(
        [*cmd, str(script), str(tmp_path / "said")],
        env=env, capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    said = (tmp_path / "said.0").read_text()
    assert said == (
        "no rendezvous token: this process is a worker of rendezvous-run, which puts no "
        "token in its workers' environment: use the worker's own client, ctx.rendezvous "
        "(from init_distributed()), or give the launcher --token-file, whose path reaches "
        "its workers as $RENDEZVOUSD_TOKEN_FILE; or pass token= or token_file="
    ), said
    assert daemon.token not in said + run.stderr + run.stdout


def test_the_sdk_names_the_agent_s_variable_as_the_trainer_does() -> None:
    from rendezvousd.client.connection import AGENT_FD_ENV
    from rendezvousd.trainer.agent._agent_boot import ENV_AGENT_FD

    assert AGENT_FD_ENV == ENV_AGENT_FD
