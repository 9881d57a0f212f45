"""The SDK's refusals in the SDK's words, and each caller's mapping of its advice to
its own flags: rendezvous-run's (``in_launchers_words``) and ``rendezvousd status``'s
(``_FLAG_WORDS``). torchrun's is tested with torch (tests/torchrun)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import grpc
import pytest

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from rendezvousd.cli.probe import _FLAG_WORDS, _flag_words
from rendezvousd.client import (
    AuthenticationError,
    DaemonUnreachable,
    InvalidRequest,
    RendezvousClient,
    TlsConfig,
)
from rendezvousd.client._calls import Blocking, Calls, Reachable
from rendezvousd.client._multiplex import rich_status, status_error
from rendezvousd.client._session import DAEMON_CHECK_ADVICE, DAEMON_LOST_ADVICE
from rendezvousd.client.connection import TLS_WORDS
from rendezvousd.client.errors import TOKEN_ADVICE, from_rpc_error
from rendezvousd.server.scope import derive_job_token
from rendezvousd.trainer.agent.launcher_words import in_launchers_words
from tests.support import DaemonProcess

#: Words the SDK's own advice must not say: flags and variables of its callers, and
#: keywords it does not take (``tls_ca=``).
NOT_THE_SDKS = ("--tls", "--token-file", "RENDEZVOUSD_TLS_CA", "tls_ca", "tls_cert")


def _refused(
    code: grpc.StatusCode, reason: str, details: str, *, method: str = "PublishId", rank: int = 3
) -> Any:
    exc = status_error(rich_status(code, reason, details))
    return from_rpc_error(exc, endpoint="h:1", method=method, job_id="j", rank=rank)


def test_publish_id_from_another_rank_is_a_misuse_not_a_token_or_tls_problem() -> None:
    """NOT_RANK_ZERO fell to PERMISSION_DENIED's class: AuthenticationError, told to
    check the token and TLS settings (torchrun: a connection error)."""
    error = _refused(
        grpc.StatusCode.PERMISSION_DENIED,
        "NOT_RANK_ZERO",
        "only global rank 0 (node 0's) supplies the unique id of job 'j' generation 1; "
        "rank 3 on 'h1' sent PublishId",
    )
    assert type(error) is InvalidRequest and error.reason == "NOT_RANK_ZERO"
    assert error.message.startswith("PublishId on rendezvousd at h:1 (job 'j', rank 3): only")
    assert "token" not in error.message and "TLS" not in error.message, error.message


def test_a_job_token_of_another_job_is_told_to_use_that_jobs_token() -> None:
    """SCOPE_DENIED stays an AuthenticationError (the launcher's setup error) but is
    not blamed on TLS: the token is valid, for another job."""
    error = _refused(
        grpc.StatusCode.PERMISSION_DENIED,
        "SCOPE_DENIED",
        "a token scoped to job:mine may not call Join for job 'j'; use that job's token "
        "or the admin token",
        method="Join",
    )
    assert type(error) is AuthenticationError and error.reason == "SCOPE_DENIED"
    assert "TLS" not in error.message, error.message
    assert f"give this client job 'j''s token {TOKEN_ADVICE}" in error.message, error.message
    assert "`rendezvousd token --job j --admin-token-file" in error.message, error.message
    assert error.message.endswith("or the admin token"), error.message


def test_a_refused_token_names_what_the_sdk_reads() -> None:
    error = _refused(grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED", "invalid token")
    assert type(error) is AuthenticationError
    assert "token (token= / token_file=, or $RENDEZVOUSD_TOKEN_FILE / $RENDEZVOUSD_TOKEN)" in (
        error.message
    )
    assert not any(word in error.message for word in NOT_THE_SDKS), error.message


def test_the_sdks_tls_advice_names_its_keywords_only() -> None:
    for advice in TLS_WORDS:
        assert "TlsConfig" in advice or "tls=" in advice, advice
        assert not any(word in advice for word in NOT_THE_SDKS), advice


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ({"cert": "/tmp/c.pem"}, "TlsConfig(cert=/tmp/c.pem) without key=: a client "),
        ({"key": "/tmp/k.pem"}, "TlsConfig(key=/tmp/k.pem) without cert=: a client "),
    ],
)
def test_half_a_client_pair_is_refused_in_tls_configs_words(
    given: dict[str, str], said: str
) -> None:
    """It named --tls-cert and --tls-key, flags of our CLIs, to an SDK user."""
    with pytest.raises(InvalidRequest) as info:
        TlsConfig(ca=Path("/tmp/ca.pem"), **given)  # type: ignore[arg-type]
    message = str(info.value)
    assert message.startswith(said), message
    assert "certificate and its key go together (mutual TLS needs both); give both" in message
    assert "--tls" not in message, message


def test_from_paths_without_a_ca_names_its_arguments() -> None:
    with pytest.raises(InvalidRequest) as info:
        TlsConfig.from_paths(None, cert="/tmp/c.pem")
    message = str(info.value)
    assert message.startswith("TlsConfig.from_paths(cert=/tmp/c.pem) without ca=:"), message
    assert "--tls" not in message, message


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ({"cert": "/tmp/c.pem"}, "--tls-cert /tmp/c.pem without --tls-key: a client"),
        ({"key": "/tmp/k.pem"}, "--tls-key /tmp/k.pem without --tls-cert: a client"),
    ],
)
def test_status_says_tlsconfigs_refusal_in_its_flags(given: dict[str, str], said: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        TlsConfig.from_paths("/tmp/ca.pem", **given)
    assert _flag_words(str(info.value)).startswith(said), _flag_words(str(info.value))
    with pytest.raises(InvalidRequest) as info:
        TlsConfig.from_paths(None, **given)
    assert "without --tls-ca: a client certificate or key needs --tls-ca," in _flag_words(
        str(info.value)
    )


@pytest.mark.parametrize("advice", [*TLS_WORDS, TOKEN_ADVICE])
def test_status_and_the_launcher_say_every_sdk_advice_in_their_flags(advice: str) -> None:
    """``_FLAG_WORDS`` holds the SDK's phrases literally (the CLI imports the client
    late): each must still be one the SDK says."""
    assert advice in dict(_FLAG_WORDS), advice
    error = AuthenticationError(f"refused: {advice}, or not")
    for said in (_flag_words(str(error)), in_launchers_words(error)):
        assert "TlsConfig" not in said and "tls=" not in said and "token=" not in said, said
        assert "--tls-" in said or "--token-file" in said, said


def test_the_launcher_says_what_it_does_once_the_daemon_is_lost() -> None:
    """It read the SDK's "then restart the job if it cannot finish", while it restarts
    the node and joins again itself."""
    error = DaemonUnreachable(f"rendezvousd at h:1 has been unreachable ... {DAEMON_LOST_ADVICE}")
    said = in_launchers_words(error)
    assert "restart the job" not in said, said
    assert "stops its workers and, if --max-restarts allows, joins again" in said, said


def _lost_during(job_id: str, rank: int | None) -> DaemonUnreachable:
    """A parked call's daemon loss, its window 0 s and nothing listening there."""
    calls = Calls("127.0.0.1:1", job_id, {"token": "t" * 32, "reconnect_window": 0})
    steps = calls.back_within("ListJobs" if not job_id else "Join", rank)
    answer: Any = None
    with pytest.raises(DaemonUnreachable) as info:
        for _ in range(10):
            step = steps.send(answer)
            answer = False if isinstance(step, Reachable | Blocking) else None
    return info.value


def test_a_daemon_lost_during_a_call_is_worded_as_the_heartbeats_loss() -> None:
    """It ended "then start the job again", which torchrun's handler did not rewrite
    (it rewrites the heartbeat's DAEMON_LOST_ADVICE), and said "(job ''" to
    `rendezvousd status`, a client of no job."""
    member = str(_lost_during("j", 2))
    assert "during Join (job 'j', rank 2) and was not back within 0 s" in member, member
    assert member.endswith(DAEMON_LOST_ADVICE) and "start the job again" not in member
    status = str(_lost_during("", None))
    assert "during ListJobs and was not back" in status and "job" not in status, status
    assert status.endswith(DAEMON_CHECK_ADVICE), status


# -- refusals of a real daemon ------------------------------------------------------


def test_a_real_publish_id_from_rank_one_is_an_invalid_request(
    daemon: DaemonProcess, job_id: str
) -> None:
    auth = (("authorization", f"Bearer {daemon.token}"),)

    def join(local: int) -> pb.JoinRequest:
        return pb.JoinRequest(
            job_id=job_id,
            topology=pb.Topology(num_nodes=1, gpus_per_node=2),
            node_rank=0,
            local_rank=local,
            host="h0",
            instance_id=f"i{local}",
            wait_timeout_ms=10_000,
        )

    with grpc.insecure_channel(daemon.endpoint) as channel:
        stub = pb_grpc.RendezvousStub(channel)
        first = stub.Join(join(0), timeout=10, metadata=auth)
        assert first.id_required
        parked = stub.Join.future(join(1), timeout=10, metadata=auth)
        wait_parked(daemon, job_id)
        publish = pb.PublishIdRequest(
            job_id=job_id,
            generation=first.generation,
            rank=1,
            instance_id="i1",
            unique_id=b"\x01" * 128,
        )
        with pytest.raises(grpc.RpcError) as info:
            stub.PublishId(publish, timeout=10, metadata=auth)
        parked.cancel()
    error = from_rpc_error(
        info.value, endpoint=daemon.endpoint, method="PublishId", job_id=job_id, rank=1
    )
    assert type(error) is InvalidRequest and error.reason == "NOT_RANK_ZERO", error
    assert f"(job {job_id!r}, rank 1): only global rank 0" in error.message, error.message
    assert "token" not in error.message and "TLS" not in error.message, error.message


def wait_parked(daemon: DaemonProcess, job_id: str) -> None:
    """Until the daemon holds both of the job's seats (rank 1's join parked)."""
    done = threading.Event()
    with RendezvousClient(daemon.endpoint, token=daemon.token) as c:
        for _ in range(200):
            if len(c.get_job(job_id).members) == 2:
                done.set()
                break
            done.wait(0.05)
    assert done.is_set(), "rank 1's join never reached the daemon"


def test_a_real_join_with_another_jobs_token_is_told_to_use_this_jobs(
    daemon: DaemonProcess, job_id: str
) -> None:
    token = derive_job_token(daemon.token, "mine")
    with (
        RendezvousClient(daemon.endpoint, job_id, token=token) as c,
        pytest.raises(AuthenticationError) as info,
    ):
        c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
    message = str(info.value)
    assert info.value.reason == "SCOPE_DENIED", message
    assert f"`rendezvousd token --job {job_id} --admin-token-file" in message, message
    assert "TLS" not in message and token not in message, message


def test_a_daemon_bug_is_a_protocol_error_whatever_its_reason() -> None:
    """The daemon's call run without its auth interceptor's verdict is INTERNAL with
    SCOPE_DENIED: taken for AuthenticationError, the caller was told to use another
    job's token, when the daemon is to blame."""
    from rendezvousd.client import ProtocolError

    said = "the daemon ran a call without its auth interceptor's verdict (a daemon bug): refused"
    error = _refused(grpc.StatusCode.INTERNAL, "SCOPE_DENIED", f"{said}; report it")
    assert type(error) is ProtocolError and error.code == "INTERNAL"
    assert "token" not in error.message and "TLS" not in error.message, error.message
    assert error.message.endswith(f"{said}; report it"), error.message


def test_a_call_of_a_forming_generation_is_a_misuse() -> None:
    """NOT_RUNNING (ReportFailure, Barrier, GetMembers before the generation formed)
    had no class of its own: ProtocolError, "report it if it persists"."""
    error = _refused(
        grpc.StatusCode.FAILED_PRECONDITION,
        "NOT_RUNNING",
        "ReportFailure for rank 3 of job 'j' generation 1 refused: the generation is still forming",
        method="ReportFailure",
    )
    assert type(error) is InvalidRequest and error.reason == "NOT_RUNNING"


@pytest.mark.parametrize("code", [grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION])
def test_not_a_member_is_not_found_under_either_code(code: grpc.StatusCode) -> None:
    """NOT_FOUND from a daemon before 2026-12-07 (``fences.not_a_member``), the one
    code FAILED_PRECONDITION since: the same class."""
    from rendezvousd.client import NotFound

    error = _refused(code, "NOT_A_MEMBER", "rank 3 left job 'j'", method="Barrier")
    assert type(error) is NotFound and error.reason == "NOT_A_MEMBER"
