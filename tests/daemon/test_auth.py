"""Authentication and transport security against a real daemon process.

The matrix uses raw gRPC channels with generic (bytes-in, bytes-out) calls so it
can reach every method, unknown ones and reflection included, with exactly the
metadata it chooses. No assertion message ever contains a token.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client import AuthenticationError, RendezvousClient, TlsConfig
from tests.support import ROOT, DaemonProcess, Pki, write_token

Metadata = Sequence[tuple[str, str | bytes]]
SERVICE = "rendezvous.v1.Rendezvous"
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
UNARY_METHODS = [
    f"/{SERVICE}/{m}"
    for m in pb.DESCRIPTOR.services_by_name["Rendezvous"].methods_by_name
    if m != "Heartbeat"
]
STREAM_METHODS = [f"/{SERVICE}/Heartbeat", REFLECTION]
UNKNOWN_METHODS = [f"/{SERVICE}/Nope", "/other.Svc/X"]
ALL_METHODS = UNARY_METHODS + STREAM_METHODS + UNKNOWN_METHODS
LIST_SERVICES = reflection_pb2.ServerReflectionRequest(list_services="*").SerializeToString()
GRPCURL = (
    str(Path(sys.executable).parent / "grpcurl")
    if (Path(sys.executable).parent / "grpcurl").exists()
    else shutil.which("grpcurl")
)


def _identity(data: bytes) -> bytes:
    return data


def call(
    channel: grpc.Channel, method: str, metadata: Metadata | None, timeout: float = 5.0
) -> grpc.StatusCode:
    """The status of one call with an empty body (streams: one empty message)."""
    try:
        if method in STREAM_METHODS:
            body = LIST_SERVICES if method == REFLECTION else b""
            stream = channel.stream_stream(
                method, request_serializer=_identity, response_deserializer=_identity
            )(iter([body]), metadata=metadata, timeout=timeout)
            # The first answer (or the error) is all we need; then hang up.
            for _ in stream:
                stream.cancel()
                break
        else:
            channel.unary_unary(
                method, request_serializer=_identity, response_deserializer=_identity
            )(b"", metadata=metadata, timeout=timeout)
    except grpc.RpcError as exc:
        code: grpc.StatusCode = exc.code()
        return grpc.StatusCode.OK if code is grpc.StatusCode.CANCELLED else code
    return grpc.StatusCode.OK


@pytest.fixture(scope="module")
def channel(daemon: DaemonProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(daemon.endpoint) as ch:
        yield ch


def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


# name -> metadata builder (given the right token); never shown with the token.
BAD_METADATA: dict[str, Callable[[str], Metadata | None]] = {
    "no metadata": lambda t: None,
    "other headers only": lambda t: [("x-token", t), ("x-authorization", f"Bearer {t}")],
    "wrong token": lambda t: bearer(secrets.token_urlsafe(32)),
    "token prefix": lambda t: bearer(t[:-1]),
    "token plus a char": lambda t: bearer(t + "x"),
    "Bearer without token": lambda t: [("authorization", "Bearer")],
    "Bearer and a space": lambda t: [("authorization", "Bearer ")],
    "Basic scheme": lambda t: [("authorization", "Basic xyz")],
    "Basic scheme, right token": lambda t: [("authorization", f"Basic {t}")],
    "token without scheme": lambda t: [("authorization", t)],
    "duplicate, both right": lambda t: bearer(t) + bearer(t),
    "duplicate, right and wrong": lambda t: bearer(t) + bearer("w" * 43),
    "duplicate, wrong and right": lambda t: bearer("w" * 43) + bearer(t),
}


@pytest.mark.parametrize("case", list(BAD_METADATA))
def test_bad_metadata_is_unauthenticated_on_every_method(
    daemon: DaemonProcess, channel: grpc.Channel, case: str
) -> None:
    metadata = BAD_METADATA[case](daemon.token)
    wrong = {m: call(channel, m, metadata) for m in ALL_METHODS}
    wrong = {m: c.name for m, c in wrong.items() if c is not grpc.StatusCode.UNAUTHENTICATED}
    assert not wrong, f"{case}: these methods did not answer UNAUTHENTICATED: {wrong}"


def test_right_token_passes_auth_on_every_method(
    daemon: DaemonProcess, channel: grpc.Channel
) -> None:
    codes = {m: call(channel, m, bearer(daemon.token)) for m in ALL_METHODS}
    refused = [m for m, c in codes.items() if c is grpc.StatusCode.UNAUTHENTICATED]
    assert not refused, f"the right token was refused on {refused}"
    # Empty requests are answered by the handlers themselves.
    assert codes[f"/{SERVICE}/ListJobs"] is grpc.StatusCode.OK
    assert codes[f"/{SERVICE}/GetJob"] is grpc.StatusCode.INVALID_ARGUMENT  # empty job id
    assert codes[f"/{SERVICE}/Join"] is grpc.StatusCode.INVALID_ARGUMENT
    assert codes[f"/{SERVICE}/Heartbeat"] is grpc.StatusCode.INVALID_ARGUMENT
    assert codes[REFLECTION] is grpc.StatusCode.OK
    for method in UNKNOWN_METHODS:
        assert codes[method] is grpc.StatusCode.UNIMPLEMENTED, method
    # The scheme is case-insensitive (RFC 7235) and surrounding blanks are ignored.
    for value in (f"bearer {daemon.token}", f"BEARER  {daemon.token} "):
        code = call(channel, f"/{SERVICE}/ListJobs", [("authorization", value)])
        assert code is grpc.StatusCode.OK, "scheme/blank variant of the right token refused"


def test_reflection_with_token_lists_services(daemon: DaemonProcess, channel: grpc.Channel) -> None:
    stream = channel.stream_stream(
        REFLECTION,
        request_serializer=_identity,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )(iter([LIST_SERVICES]), metadata=bearer(daemon.token), timeout=5)
    response = next(stream)
    stream.cancel()
    names = {s.name for s in response.list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names


def test_health_needs_no_token(daemon: DaemonProcess, channel: grpc.Channel) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    serving = health_pb2.HealthCheckResponse.SERVING
    for service in ("", SERVICE):
        request = health_pb2.HealthCheckRequest(service=service)
        assert stub.Check(request, timeout=5).status == serving
        # A wrong token does not break the exemption either.
        wrong = bearer("w" * 43)
        assert stub.Check(request, metadata=wrong, timeout=5).status == serving
    watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert next(watch).status == serving
    watch.cancel()
    with pytest.raises(grpc.RpcError) as info:
        stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
    assert info.value.code() is grpc.StatusCode.NOT_FOUND


def test_non_ascii_token_is_refused_locally_by_grpcio(
    daemon: DaemonProcess, channel: grpc.Channel
) -> None:
    # grpcio will not even send a non-ASCII header value: the call fails on the client.
    code = call(channel, f"/{SERVICE}/ListJobs", bearer(daemon.token + "é"))
    assert code is not grpc.StatusCode.OK


@pytest.mark.skipif(GRPCURL is None, reason="grpcurl binary not installed")
def test_non_ascii_token_on_the_wire_is_unauthenticated(daemon: DaemonProcess) -> None:
    # grpcurl (Go) does put non-ASCII bytes on the wire: the daemon must refuse them,
    # also when the rest of the value is the right token.
    assert GRPCURL is not None
    proto = ["-import-path", str(ROOT / "protos"), "-proto", "rendezvous/v1/rendezvous.proto"]
    runs = {}
    for label, token in (("after", daemon.token + "é"), ("inside", "ö" + daemon.token)):
        base = [GRPCURL, "-plaintext", "-max-time", "10", "-H", f"authorization: Bearer {token}"]
        for method in ("ListJobs", "Heartbeat") if label == "inside" else ("Join",):
            runs[f"{method} ({label})"] = [
                *base, *proto, "-d", "{}", daemon.endpoint, f"{SERVICE}/{method}"
            ]  # fmt: skip
        if label == "inside":
            runs["reflection list"] = [*base, daemon.endpoint, "list"]
    procs = {
        name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, cmd in runs.items()
    }
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=30)
        assert proc.returncode != 0, f"{name} accepted a non-ASCII token"
        assert "Unauthenticated" in err, f"{name}: {err[-300:].replace(daemon.token, '<token>')}"


def test_token_never_logged(start_daemon: Callable[..., DaemonProcess], job_id: str) -> None:
    d = start_daemon("--log-level", "DEBUG")
    wrong = secrets.token_urlsafe(32)
    with grpc.insecure_channel(d.endpoint) as ch:
        for metadata in (bearer(wrong), bearer(d.token) + bearer(d.token), None):
            assert call(ch, f"/{SERVICE}/ListJobs", metadata) is grpc.StatusCode.UNAUTHENTICATED
        assert call(ch, f"/{SERVICE}/Nope", bearer(d.token)) is grpc.StatusCode.UNIMPLEMENTED
    with RendezvousClient(d.endpoint, job_id, token=d.token) as client:
        client.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        client.kv_set("k", b"v")
    assert d.terminate() == 0
    log = d.log()
    assert "rendezvousd stopped" in log  # the log was captured at all
    assert d.token not in log, "the daemon's token appears in its log"
    assert wrong not in log, "a presented (wrong) token appears in the daemon's log"


# -- start-up refusals ---------------------------------------------------------


def _spawn_serve(*args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RENDEZVOUSD_")}
    return subprocess.Popen(
        [sys.executable, "-m", "rendezvousd.cli", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _refused(proc: subprocess.Popen[str], timeout: float = 30.0) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of a ``serve`` that is expected to refuse to start."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=10)
        pytest.fail(f"rendezvousd serve kept running instead of refusing: {out} {err[-500:]}")
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def refusals(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, str, str]]:
    """Real ``rendezvousd serve`` processes that must refuse to start, run concurrently
    (each is a ~0.5 s interpreter start). Maps a case to (status, stdout, stderr, token)."""
    tmp = tmp_path_factory.mktemp("refusals")
    listen = ("--listen", "127.0.0.1:0")
    readable = tmp / "token-644"
    readable_token = write_token(readable)
    readable.chmod(0o644)
    short = tmp / "short"
    short.write_text("Q" * 15 + "\n")
    short.chmod(0o600)
    good = tmp / "good"
    good_token = write_token(good)
    cases = {
        "mode-644": ((*listen, "--token-file", str(readable)), readable_token),
        "short": ((*listen, "--token-file", str(short)), "Q" * 15),
        "missing": (listen, ""),
        "plaintext": (("--listen", "0.0.0.0:0", "--token-file", str(good)), good_token),
    }
    procs = {name: (_spawn_serve(*args), token) for name, (args, token) in cases.items()}
    return {name: (*_refused(proc), token) for name, (proc, token) in procs.items()}


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("mode-644", ["chmod 600"]),
        ("short", ["shorter than 16 characters"]),
        ("missing", ["no token configured"]),
        ("plaintext", ["refusing to serve plaintext", "--insecure-plaintext"]),
    ],
)
def test_refuses_to_serve_says_why_and_never_shows_the_token(
    refusals: dict[str, tuple[int, str, str, str]], case: str, says: list[str]
) -> None:
    """A token file readable by others, a too short token, none at all, plaintext on
    a non-loopback address."""
    code, out, err, token = refusals[case]
    assert code != 0
    for reason in says:
        assert reason in err
    assert "serving" not in out
    if token:  # the "missing" case has none to leak
        assert token not in err + out


@pytest.fixture
def serve_in_process(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Callable[..., tuple[int, str]]:
    """``rendezvousd serve`` in this process for more refusal variants; should it get
    past its checks, it returns 99 instead of serving."""
    from rendezvousd.cli import serve as cli

    async def would_serve(*args: object, **kwargs: object) -> int:
        return 99

    monkeypatch.setattr(cli, "_run", would_serve)
    monkeypatch.setattr(cli, "_raise_fd_limit", lambda _connections: None)
    for name in list(os.environ):
        if name.startswith("RENDEZVOUSD_"):
            monkeypatch.delenv(name)

    def serve(*args: str) -> tuple[int, str]:
        code = cli.main(["serve", *args])
        return code, capsys.readouterr().err

    return serve


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o444])
def test_refuses_token_file_mode_variants(
    tmp_path: Path, serve_in_process: Callable[..., tuple[int, str]], mode: int
) -> None:
    path = tmp_path / "token"
    token = write_token(path)
    path.chmod(mode)
    code, err = serve_in_process("--listen", "127.0.0.1:0", "--token-file", str(path))
    assert code == 2 and "chmod 600" in err
    assert token not in err
    path.chmod(0o600)  # the same file is accepted once private
    assert serve_in_process("--listen", "127.0.0.1:0", "--token-file", str(path))[0] == 99


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("Zq9-tiny", "shorter than 16 characters"),
        ("Zq9 Xv8-middle-0123456789", "spaces/control/non-ASCII characters"),
        ("good-token-0123456789\nZq9short", "shorter than 16 characters"),  # every line counts
        ("\n\n", "holds no token"),
    ],
)
def test_refuses_token_variants(
    tmp_path: Path,
    serve_in_process: Callable[..., tuple[int, str]],
    content: str,
    message: str,
) -> None:
    path = tmp_path / "token"
    path.write_text(content + "\n")
    path.chmod(0o600)
    code, err = serve_in_process("--listen", "127.0.0.1:0", "--token-file", str(path))
    assert code == 2 and message in err
    for line in content.split():
        assert line not in err


@pytest.mark.parametrize("listen", ["[::]:0", "10.1.2.3:0", "example.invalid:0"])
def test_refuses_plaintext_variants(
    tmp_path: Path, serve_in_process: Callable[..., tuple[int, str]], listen: str
) -> None:
    path = tmp_path / "token"
    write_token(path)
    code, err = serve_in_process("--listen", listen, "--token-file", str(path))
    assert code == 2 and "refusing to serve plaintext" in err
    for loopback in ("127.0.0.1:0", "[::1]:0", "localhost:0"):
        assert serve_in_process("--listen", loopback, "--token-file", str(path))[0] == 99
    opt_in = ("--listen", listen, "--token-file", str(path), "--insecure-plaintext")
    assert serve_in_process(*opt_in)[0] == 99


def test_insecure_plaintext_opt_in_serves_non_loopback(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    # With the explicit opt-in it starts, and still wants the token.
    d = start_daemon("--insecure-plaintext", listen="0.0.0.0:0")
    with grpc.insecure_channel(f"127.0.0.1:{d.port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        status = stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        assert call(ch, f"/{SERVICE}/ListJobs", None) is grpc.StatusCode.UNAUTHENTICATED
        assert call(ch, f"/{SERVICE}/ListJobs", bearer(d.token)) is grpc.StatusCode.OK


def test_second_daemon_on_same_port_fails(start_daemon: Callable[..., DaemonProcess]) -> None:
    first = start_daemon()
    code, out, err = _refused(
        _spawn_serve("--listen", first.endpoint, "--token-file", str(first.token_file))
    )
    assert code != 0
    assert "cannot bind" in err
    assert "serving" not in out
    assert first.proc.poll() is None, "the first daemon died"
    with grpc.insecure_channel(first.endpoint) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        assert call(ch, f"/{SERVICE}/ListJobs", bearer(first.token)) is grpc.StatusCode.OK


# -- TLS and mTLS ----------------------------------------------------------------


def _tls_health(endpoint: str, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    channel = (
        grpc.secure_channel(endpoint, credentials)
        if credentials is not None
        else grpc.insecure_channel(endpoint)
    )
    with channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
        except grpc.RpcError as exc:
            code: grpc.StatusCode = exc.code()
            return code
    return grpc.StatusCode.OK


def test_tls_daemon(pki: Pki, start_daemon: Callable[..., DaemonProcess], job_id: str) -> None:
    d = start_daemon(*pki.serve_args())
    assert "tls=True" in d.log()
    with RendezvousClient(
        d.endpoint, job_id, token=d.token, tls=TlsConfig(ca=pki.ca), connect_timeout=10
    ) as client:
        m = client.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        assert (m.rank, m.world_size) == (0, 1)
        assert client.get_job().summary.job_id == job_id
    # Plaintext to the TLS port, or a client that does not trust the CA: no answer.
    assert _tls_health(d.endpoint, None) is not grpc.StatusCode.OK
    rogue_trust = grpc.ssl_channel_credentials(pki.rogue_ca.read_bytes())
    assert _tls_health(d.endpoint, rogue_trust) is not grpc.StatusCode.OK
    assert _tls_health(d.endpoint, grpc.ssl_channel_credentials(pki.ca.read_bytes())) is (
        grpc.StatusCode.OK
    )
    # TLS does not replace the token.
    with grpc.secure_channel(d.endpoint, grpc.ssl_channel_credentials(pki.ca.read_bytes())) as ch:
        assert call(ch, f"/{SERVICE}/ListJobs", None) is grpc.StatusCode.UNAUTHENTICATED
        assert call(ch, f"/{SERVICE}/ListJobs", bearer(d.token)) is grpc.StatusCode.OK


def test_mtls_requires_a_client_certificate_from_the_ca(
    pki: Pki, start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    d = start_daemon(*pki.serve_args(mtls=True))
    ca = pki.ca.read_bytes()
    assert _tls_health(d.endpoint, grpc.ssl_channel_credentials(ca)) is not grpc.StatusCode.OK
    rogue = grpc.ssl_channel_credentials(ca, pki.rogue_key.read_bytes(), pki.rogue.read_bytes())
    assert _tls_health(d.endpoint, rogue) is not grpc.StatusCode.OK
    good = grpc.ssl_channel_credentials(ca, pki.client_key.read_bytes(), pki.client.read_bytes())
    assert _tls_health(d.endpoint, good) is grpc.StatusCode.OK
    tls = TlsConfig(ca=pki.ca, cert=pki.client, key=pki.client_key)
    with RendezvousClient(d.endpoint, job_id, token=d.token, tls=tls) as client:
        m = client.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        assert m.world_size == 1
        client.kv_set("k", b"v")
        assert client.kv_get("k", wait=False) == b"v"
    # A certificate does not replace the token either.
    with grpc.secure_channel(d.endpoint, good) as ch:
        assert call(ch, f"/{SERVICE}/ListJobs", None) is grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("no client certificate", "requires a client certificate (mTLS)"),
        ("daemon signed by another CA", "TLS handshake with rendezvousd"),
        ("client certificate from another CA", "requires a client certificate (mTLS)"),
        ("a server name the certificate does not list", "Hostname Verification"),
    ],
)
def test_sdk_names_a_tls_refusal_at_once_instead_of_waiting_for_the_daemon(
    pki: Pki, start_daemon: Callable[..., DaemonProcess], job_id: str, case: str, expected: str
) -> None:
    d = start_daemon(*pki.serve_args(mtls=True))
    tls = {
        "no client certificate": TlsConfig(ca=pki.ca),
        "daemon signed by another CA": TlsConfig(
            ca=pki.rogue_ca, cert=pki.client, key=pki.client_key
        ),
        "client certificate from another CA": TlsConfig(
            ca=pki.ca, cert=pki.rogue, key=pki.rogue_key
        ),
        "a server name the certificate does not list": TlsConfig(
            ca=pki.ca, cert=pki.client, key=pki.client_key, server_name="wrong.example"
        ),
    }[case]
    started = time.monotonic()
    with (
        RendezvousClient(d.endpoint, job_id, token=d.token, tls=tls, connect_timeout=30) as c,
        pytest.raises(AuthenticationError, match=re.escape(expected)) as info,
    ):
        c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
    assert time.monotonic() - started < 5, "the refusal waited for the connect timeout"
    assert d.endpoint in str(info.value)


def test_health_and_status_commands_speak_tls(
    pki: Pki, start_daemon: Callable[..., DaemonProcess]
) -> None:
    d = start_daemon(*pki.serve_args())
    tls = ["--tls-ca", str(pki.ca), "--tls-server-name", "localhost"]
    base = [sys.executable, "-m", "rendezvousd.cli"]
    health = subprocess.run(
        [*base, "health", "--endpoint", d.endpoint, *tls],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert health.returncode == 0, health.stderr
    status = subprocess.run(
        [*base, "status", "--endpoint", d.endpoint, "--token-file", str(d.token_file), *tls],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0 and "JOB" in status.stdout, status.stderr
    plain = subprocess.run(
        [*base, "health", "--endpoint", d.endpoint, "--timeout", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert plain.returncode != 0


@pytest.mark.parametrize("command", ["health", "status"])
@pytest.mark.parametrize(
    ("flags", "said"),
    [
        # gRPC's core aborted the process (SIGABRT) on a certificate without its key.
        (("--tls-ca", "ca", "--tls-cert", "client"), "without --tls-key: a client certificate"),
        (("--tls-ca", "ca", "--tls-key", "client_key"), "without --tls-cert: a client certificate"),
        (("--tls-cert", "client", "--tls-key", "client_key"), "needs --tls-ca"),
        (("--tls-ca", "missing"), "cannot read --tls-ca"),
        (("--tls-ca", "root"), "cannot read --tls-ca"),
    ],
)
def test_probe_commands_name_a_tls_flag_that_cannot_work(
    pki: Pki, start_daemon: Callable[..., DaemonProcess], command: str,
    flags: tuple[str, ...], said: str,
) -> None:  # fmt: skip
    d = start_daemon(*pki.serve_args(mtls=True))
    paths = {"missing": pki.root / "missing.pem", "root": pki.root}
    args = [flag if flag.startswith("--") else str(paths.get(flag) or getattr(pki, flag))
            for flag in flags]  # fmt: skip
    if command == "status":
        args += ["--token-file", str(d.token_file)]
    done = subprocess.run(
        [sys.executable, "-m", "rendezvousd.cli", command, "--endpoint", d.endpoint, *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert said in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert "TlsConfig" not in done.stderr and "=:" not in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (("--tls-ca", "rogue_ca"), "CERTIFICATE_VERIFY_FAILED"),
        (("--tls-ca", "ca"), "Socket closed"),  # no client certificate: mTLS refuses it
        (("--tls-ca", "ca", "--tls-cert", "rogue", "--tls-key", "rogue_key"), "Socket closed"),
    ],
)
def test_health_says_why_a_tls_daemon_refused_it(
    pki: Pki, start_daemon: Callable[..., DaemonProcess], flags: tuple[str, ...], said: str
) -> None:
    d = start_daemon(*pki.serve_args(mtls=True))
    args = [f if f.startswith("--") else str(getattr(pki, f)) for f in flags]
    done = subprocess.run(
        [sys.executable, "-m", "rendezvousd.cli", "health", "--endpoint", d.endpoint,
         "--tls-server-name", "localhost", "--timeout", "5", *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"the TLS handshake with {d.endpoint} failed (" in done.stderr, done.stderr
    assert said in done.stderr and "--tls-client-ca also needs" in done.stderr
    # Said once, by the CLI: gRPC's own INFO line per failed handshake is not kept.
    assert "Handshake failed" not in done.stderr, done.stderr


def test_health_with_tls_says_the_daemon_speaks_plaintext(pki: Pki, daemon: DaemonProcess) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "rendezvousd.cli", "health", "--endpoint", daemon.endpoint,
         "--tls-ca", str(pki.ca), "--timeout", "5"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"the daemon at {daemon.endpoint} does not speak TLS: drop --tls-ca" in done.stderr
