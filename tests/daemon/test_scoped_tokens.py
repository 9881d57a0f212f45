"""Job-scoped tokens against a real daemon: a job token touches its own job only."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client import AuthenticationError, RendezvousClient
from rendezvousd.server.methods import POLICY
from rendezvousd.server.scope import (
    ADMIN,
    Scope,
    admin_key,
    allowed,
    denied,
    derive_job_token,
    read_job_token,
)
from tests.daemon.raw_calls import SERVICE, UNARY, raw, reason_of
from tests.support import DaemonProcess

CLI = (sys.executable, "-m", "rendezvousd.cli")
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
JOB_METHODS = frozenset(name for name, p in POLICY.items() if p.job_scoped)


# -- the decision itself ------------------------------------------------------


@pytest.mark.parametrize("method", sorted(JOB_METHODS | {"ListJobs", "Nope"}))
def test_admin_may_call_everything_for_any_job(method: str) -> None:
    assert allowed(ADMIN, method, "any-job")
    assert allowed(ADMIN, method, None)


@pytest.mark.parametrize("method", sorted(JOB_METHODS))
def test_job_scope_may_call_job_methods_for_its_job_only(method: str) -> None:
    scope = Scope("a")
    assert allowed(scope, method, "a")
    assert not allowed(scope, method, "b")
    assert not allowed(scope, method, "a-longer")
    assert not allowed(scope, method, None)


def test_job_scope_lists_jobs_but_nothing_else() -> None:
    scope = Scope("a")
    assert allowed(scope, "ListJobs", None)  # filtered to job a by the servicer
    assert not allowed(scope, "ServerReflectionInfo", None)
    assert not allowed(scope, "Unknown", "a")


def test_a_refusal_names_the_job_sent_escaped_and_cut_with_the_one_marker() -> None:
    """The job id as sent (unchecked, it may be any length) was cut at 128 characters
    without a word, a convention of its own (escape.quoted is every message's)."""
    sent = "\u202e" + "j" * 300
    message = denied(Scope("a"), "KvGet", sent).message
    shown = "'\\u202e" + "j" * 114 + "'... (186 more characters)"
    assert f"may not call KvGet for job {shown}; use that job's token" in message, message


def test_every_rpc_has_a_scope_rule() -> None:
    methods = set(pb.DESCRIPTOR.services_by_name["Rendezvous"].methods_by_name)
    assert methods == set(POLICY)  # one policy table entry per method, none stale
    assert methods == JOB_METHODS | {"ListJobs", "Calls", "CallBatches"}


# -- against a daemon ---------------------------------------------------------


def job_token(d: DaemonProcess, tmp_path: Path, job: str) -> Path:
    path = tmp_path / f"job-{job}"
    done = subprocess.run(
        [*CLI, "token", "--job", job, "--admin-token-file", str(d.token_file), str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert d.token not in done.stdout + done.stderr
    assert path.stat().st_mode & 0o777 == 0o600
    return path


def test_cli_derives_the_same_token_as_the_library(daemon: DaemonProcess, tmp_path: Path) -> None:
    path = job_token(daemon, tmp_path, "j1")
    read = read_job_token(path.read_text().strip(), [admin_key(daemon.token)])
    assert read is not None and read.issued is not None  # minted when the CLI ran
    assert path.read_text().strip() == derive_job_token(daemon.token, "j1", issued=read.issued)
    assert "j1" in path.read_text()  # the job is readable in clear


def test_job_token_works_for_its_own_job(
    daemon: DaemonProcess, tmp_path: Path, job_id: str
) -> None:
    token_file = job_token(daemon, tmp_path, job_id)
    with RendezvousClient(daemon.endpoint, job_id, token_file=token_file) as client:
        client.join(num_nodes=1, gpus_per_node=1, local_rank=0)
        client.start_heartbeat()
        client.barrier("b")
        client.kv_set("k", b"v")
        assert client.kv_get("k") == b"v"
        assert client.kv_add("n", 2) == 2
        assert client.kv_delete("k")
        assert client.get_job().summary.job_id == job_id
        assert [j.job_id for j in client.list_jobs()] == [job_id]
        client.leave()


def test_list_jobs_with_a_job_token_shows_only_its_job(
    daemon: DaemonProcess, tmp_path: Path, job_id: str
) -> None:
    other = job_id + "-other"
    _create(daemon, other)
    _create(daemon, job_id)
    with RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as admin:
        listed = {j.job_id for j in admin.list_jobs()}
        assert {job_id, other} <= listed
    token_file = job_token(daemon, tmp_path, job_id)
    with RendezvousClient(daemon.endpoint, job_id, token_file=token_file) as scoped:
        assert [j.job_id for j in scoped.list_jobs()] == [job_id]


def _create(d: DaemonProcess, job: str) -> None:
    """A 1x1 job, joined with the admin token (listed until it is forgotten)."""
    with RendezvousClient(d.endpoint, job, token=d.token) as client:
        client.join(num_nodes=1, gpus_per_node=1, local_rank=0)


def _body(method: str, job: str) -> bytes:
    request = getattr(pb, f"{method}Request")()
    if hasattr(request, "job_id"):
        request.job_id = job
    data: bytes = request.SerializeToString()
    return data


@pytest.mark.parametrize("method", [m for m in UNARY if m != "ListJobs"])
def test_job_token_is_refused_on_another_jobs_calls(daemon: DaemonProcess, method: str) -> None:
    token = derive_job_token(daemon.token, "mine")
    with grpc.insecure_channel(daemon.endpoint) as ch:
        error = raw(ch, method, _body(method, "theirs"), [("authorization", f"Bearer {token}")])
    assert error is not None and error.code() == grpc.StatusCode.PERMISSION_DENIED
    reason, meta = reason_of(error)
    assert reason == "SCOPE_DENIED" and meta["scope"] == "job:mine"
    assert "job:mine" in (error.details() or "") and "theirs" in (error.details() or "")
    assert token not in (error.details() or "")


def test_job_token_is_refused_on_another_jobs_heartbeat(daemon: DaemonProcess) -> None:
    token = derive_job_token(daemon.token, "mine")
    body = pb.HeartbeatRequest(job_id="theirs").SerializeToString()
    with grpc.insecure_channel(daemon.endpoint) as ch:
        stream = ch.stream_stream(f"/{SERVICE}/Heartbeat")
        with pytest.raises(grpc.RpcError) as info:
            list(stream(iter([body]), metadata=[("authorization", f"Bearer {token}")], timeout=5))
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert reason_of(info.value)[0] == "SCOPE_DENIED"


def test_job_token_is_refused_on_admin_only_calls(daemon: DaemonProcess) -> None:
    token = derive_job_token(daemon.token, "mine")
    with grpc.insecure_channel(daemon.endpoint) as ch:
        stream = ch.stream_stream(REFLECTION)
        with pytest.raises(grpc.RpcError) as info:
            list(stream(iter([b""]), metadata=[("authorization", f"Bearer {token}")], timeout=5))
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "job:mine" in (info.value.details() or "")
    assert "admin" in (info.value.details() or "")


def test_sdk_reports_a_scope_refusal(daemon: DaemonProcess, tmp_path: Path) -> None:
    token_file = job_token(daemon, tmp_path, "mine")
    with (
        RendezvousClient(daemon.endpoint, "theirs", token_file=token_file) as client,
        pytest.raises(AuthenticationError) as info,
    ):
        client.get_job()
    assert "job:mine" in str(info.value)


@pytest.mark.parametrize(
    "tamper",
    [
        lambda t: t[:-1] + ("0" if t[-1] != "0" else "1"),  # MAC changed
        lambda t: t.replace("mine", "mind", 1),  # job changed, MAC kept
        lambda t: t.rpartition(".")[0],  # no MAC
        lambda t: t.rpartition(".")[0] + "." + "0" * 64,
    ],
    ids=["mac", "job", "no-mac", "zero-mac"],
)
def test_tampered_job_token_is_unauthenticated(daemon: DaemonProcess, tamper: object) -> None:
    token = tamper(derive_job_token(daemon.token, "mine"))  # type: ignore[operator]
    with grpc.insecure_channel(daemon.endpoint) as ch:
        error = raw(ch, "GetJob", _body("GetJob", "mine"), [("authorization", f"Bearer {token}")])
    assert error is not None and error.code() == grpc.StatusCode.UNAUTHENTICATED


def test_token_derived_from_another_admin_token_is_unauthenticated(daemon: DaemonProcess) -> None:
    token = derive_job_token("another-admin-token-entirely", "mine")
    with grpc.insecure_channel(daemon.endpoint) as ch:
        error = raw(ch, "GetJob", _body("GetJob", "mine"), [("authorization", f"Bearer {token}")])
    assert error is not None and error.code() == grpc.StatusCode.UNAUTHENTICATED


def test_job_tokens_never_logged(daemon: DaemonProcess, tmp_path: Path, job_id: str) -> None:
    token = derive_job_token(daemon.token, job_id)
    with grpc.insecure_channel(daemon.endpoint) as ch:
        raw(ch, "GetJob", _body("GetJob", "x"), [("authorization", f"Bearer {token}")])
        raw(ch, "GetJob", _body("GetJob", "x"), [("authorization", f"Bearer {token}0")])
    log = daemon.log()
    assert token not in log and token.rpartition(".")[2] not in log
    assert daemon.token not in log


def test_daemon_refuses_a_job_token_as_its_own(tmp_path: Path, daemon: DaemonProcess) -> None:
    path = tmp_path / "tok"
    path.write_text(derive_job_token(daemon.token, "j") + "\n")
    path.chmod(0o600)
    done = subprocess.run(
        [*CLI, "serve", "--listen", "127.0.0.1:0", "--token-file", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2
    assert "job-scoped token" in done.stderr
    assert path.read_text().strip() not in done.stderr


def test_job_token_aborts_its_own_job_only(
    daemon: DaemonProcess, tmp_path: Path, job_id: str
) -> None:
    token_file = job_token(daemon, tmp_path, job_id)
    other = job_id + "-other"
    _create(daemon, other)
    with RendezvousClient(daemon.endpoint, job_id, token_file=token_file) as client:
        client.join(num_nodes=1, gpus_per_node=1, local_rank=0)
        with pytest.raises(AuthenticationError):
            client.abort("not mine", job_id=other)
        client.abort("a rank failed")
        assert client.get_job().summary.state == pb.JOB_STATE_ABORTED
    with RendezvousClient(daemon.endpoint, other, token=daemon.token) as admin:
        assert admin.get_job().summary.state != pb.JOB_STATE_ABORTED


# -- expiring job tokens ------------------------------------------------------


def test_an_expiring_token_grants_its_job_until_its_date_only() -> None:
    keys = [admin_key("a" * 32)]
    token = derive_job_token("a" * 32, "j.until-5", until=2_000_000_000)
    assert token.endswith(".until-2000000000")
    read = read_job_token(token, keys)
    assert read is not None and read.job == "j.until-5"
    assert not read.expired(1_999_999_999) and read.expired(2_000_000_000)
    # The date is under the MAC: a holder cannot move it.
    longer = token.replace("until-2000000000", "until-2000000001")
    assert read_job_token(longer, keys) is None
    assert read_job_token(token.replace("until-", "until-+"), keys) is None
    # A token without a date never expires, whatever its job id looks like.
    forever = read_job_token(derive_job_token("a" * 32, "j.until-5"), keys)
    assert forever is not None and forever.job == "j.until-5" and not forever.expired(10**12)


def test_cli_writes_a_token_valid_for_a_duration_and_the_daemon_takes_it(
    daemon: DaemonProcess, tmp_path: Path, job_id: str
) -> None:
    path = tmp_path / "job-token"
    done = subprocess.run(
        [*CLI, "token", "--job", job_id, "--admin-token-file", str(daemon.token_file),
         "--valid-for", "2h", str(path)],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    read = read_job_token(path.read_text().strip(), [admin_key(daemon.token)])
    assert read is not None and read.job == job_id and read.until is not None
    assert abs(read.until - (time.time() + 7200)) < 60
    assert f"valid until {read.expiry_text()}" in done.stdout
    with RendezvousClient(daemon.endpoint, job_id, token_file=path) as client:
        assert client.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10).rank == 0


def test_an_expired_job_token_is_refused_naming_its_job_and_date(
    daemon: DaemonProcess, job_id: str
) -> None:
    expired = derive_job_token(daemon.token, job_id, until=int(time.time()) - 1)
    with (
        RendezvousClient(daemon.endpoint, job_id, token=expired) as client,
        pytest.raises(AuthenticationError) as info,
    ):
        client.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
    date = read_job_token(expired, [admin_key(daemon.token)])
    assert date is not None
    assert f"job token for job {job_id!r} expired at {date.expiry_text()}" in str(info.value)
    assert "--valid-for" in str(info.value)
    assert expired not in str(info.value) and daemon.token not in str(info.value)
    # A forged date is just a wrong token: nothing about the job is told.
    forged = expired.rsplit(".", 1)[0] + f".until-{int(time.time()) + 3600}"
    with (
        RendezvousClient(daemon.endpoint, job_id, token=forged) as client,
        pytest.raises(AuthenticationError) as info,
    ):
        client.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
    assert "expired at" not in str(info.value)
    assert "missing or invalid bearer token" in str(info.value)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--valid-for", "1h"], "--valid-for applies to job tokens"),
        (["--job", "j", "--valid-for", "soon"], "is not a duration"),
        (["--job", "j", "--valid-for", "0s"], "is not a duration"),
        (["--job", "j", "--valid-for", "4000d"], "is not a duration"),
    ],
)
def test_cli_refuses_a_validity_it_cannot_honour(
    daemon: DaemonProcess, tmp_path: Path, args: list[str], says: str
) -> None:
    path = tmp_path / "t"
    done = subprocess.run(
        [*CLI, "token", *args, "--admin-token-file", str(daemon.token_file), str(path)],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and says in done.stderr, done.stderr
    assert not path.exists()


def test_cli_refuses_an_admin_token_file_without_a_job(tmp_path: Path) -> None:
    admin = tmp_path / "admin"
    subprocess.run([*CLI, "token", str(admin)], capture_output=True, timeout=30, check=True)
    path = tmp_path / "t"
    done = subprocess.run(
        [*CLI, "token", "--admin-token-file", str(admin), str(path)],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "--admin-token-file applies to job tokens: add --job JOB_ID" in done.stderr
    assert admin.read_text().strip() not in done.stderr + done.stdout
    assert not path.exists()


def test_cli_token_names_a_path_it_cannot_write(tmp_path: Path) -> None:
    done = subprocess.run(
        [*CLI, "token", str(tmp_path / "no-such-dir" / "token")],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert f"cannot write {tmp_path / 'no-such-dir' / 'token'}: No such file" in done.stderr
    assert "Traceback" not in done.stderr
