"""``rendezvousd serve`` refusals: /metrics exposure, TLS certificate/key pairs, empty paths,
``--exit-with-parent`` without a pipe on stdin, addresses it cannot bind, contradictory limits."""

from __future__ import annotations

import argparse
import os
import re
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from rendezvousd.cli import embedded
from rendezvousd.common.settings import OptionalPath
from rendezvousd.config import SCHEMA, ConfigError, DaemonConfig, load
from rendezvousd.errors import DaemonError
from tests.support import DaemonProcess, Pki, free_port, write_token


def _serve(tmp: Path, *args: str) -> tuple[int, str, str]:
    token = tmp / "token"
    if not token.exists():
        write_token(token)
    done = subprocess.run(
        [sys.executable, "-m", "rendezvousd.cli", "serve", "--token-file", str(token), *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return done.returncode, done.stdout, done.stderr


def test_a_metrics_port_in_use_names_the_flag_and_what_to_do(tmp_path: Path) -> None:
    """It said "cannot serve metrics on 127.0.0.1:P: Address already in use" only."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, err = _serve(
            tmp_path, "--listen", "127.0.0.1:0", "--metrics-listen", f"127.0.0.1:{port}"
        )
    assert code == 2 and "serving" not in out, err
    said = err.splitlines()[-1]
    assert said.startswith(
        f"rendezvousd: error: cannot serve metrics on --metrics-listen 127.0.0.1:{port}: "
        f"port {port} is in use by another process"
    ), err
    assert "give --metrics-listen another address (port 0: any free one)" in said, err


@pytest.mark.parametrize("piped", [True, False])
def test_an_embedded_daemon_that_did_not_start_says_where_its_error_is(
    tmp_path: Path, piped: bool, capfd: pytest.CaptureFixture[str]
) -> None:
    """It said "rendezvousd did not start (exit 2): ''": its empty first stdout line."""
    stderr = subprocess.PIPE if piped else None
    with pytest.raises(DaemonError) as caught:
        embedded.spawn(tmp_path, "--no-such-flag", stderr=stderr)
    said = str(caught.value)
    assert said.startswith("rendezvousd did not start (exit 2)"), said
    assert "''" not in said
    if piped:
        assert said.endswith("rendezvousd serve: error: unrecognized arguments: --no-such-flag")
    else:
        assert said.endswith("; its error is on stderr above"), said
        assert "unrecognized arguments: --no-such-flag" in capfd.readouterr().err


@pytest.mark.parametrize(
    ("command", "code", "own_flag"),
    [
        # health and status keep grpc_health_probe's codes: 1 is bad arguments, 2 the
        # daemon unreachable (operations.md).
        ("health", 1, "--service SERVICE"),
        ("status", 1, "--token-file TOKEN_FILE"),
        ("serve", 2, "--max-kv-bytes MAX_KV_BYTES"),
        ("token", 2, "--admin-token-file FILE"),
    ],
)
def test_an_unknown_flag_is_refused_by_its_subcommand_with_its_usage(
    tmp_path: Path, command: str, code: int, own_flag: str
) -> None:
    """``health --bogus`` printed the top-level usage (``{serve,token,health,status}``,
    none of health's flags) and ``rendezvousd: error:`` (an audit): argparse hands a
    subcommand's leftovers to the top-level parser."""
    args = {"health": ["--endpoint", "127.0.0.1:1"], "token": [str(tmp_path / "t")]}
    done = subprocess.run(
        [sys.executable, "-m", "rendezvousd.cli", command, *args.get(command, []), "--bogus"],
        capture_output=True, text=True, timeout=30, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == code, done.stderr
    assert done.stdout == "" and not (tmp_path / "t").exists()
    assert done.stderr.startswith(f"usage: rendezvousd {command} "), done.stderr
    assert own_flag in done.stderr, done.stderr
    said = done.stderr.splitlines()[-1]
    assert said == f"rendezvousd {command}: error: unrecognized arguments: --bogus", said


def test_metrics_on_a_non_loopback_address_without_tls_is_refused(tmp_path: Path) -> None:
    code, out, err = _serve(tmp_path, "--listen", "127.0.0.1:0", "--metrics-listen", "0.0.0.0:0")
    assert code == 2, err
    assert "refusing to serve /metrics in plaintext" in err
    assert "--insecure-metrics" in err and "serving" not in out


@pytest.mark.parametrize(
    ("args", "env", "origin"),
    [
        # Named by the words in the message, the metrics refusal blamed --listen.
        (
            ["--listen", "127.0.0.1:0"],
            {"RENDEZVOUSD_METRICS_LISTEN": "0.0.0.0:9464"},
            "(metrics_listen from $RENDEZVOUSD_METRICS_LISTEN)",
        ),
        ([], {"RENDEZVOUSD_LISTEN": "0.0.0.0:1"}, "(listen from $RENDEZVOUSD_LISTEN)"),  # none
    ],
)
def test_a_refusal_names_where_its_value_came_from(
    tmp_path: Path, args: list[str], env: dict[str, str], origin: str
) -> None:
    token = tmp_path / "token"
    write_token(token)
    done = subprocess.run(
        [sys.executable, "-m", "rendezvousd.cli", "serve", "--token-file", str(token), *args],
        capture_output=True, text=True, timeout=30, check=False, env={**os.environ, **env},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.rstrip().endswith(origin), done.stderr


def test_a_last_call_of_0_in_the_environment_says_rendezvous_run_reads_it_too(
    tmp_path: Path,
) -> None:
    """RENDEZVOUSD_LAST_CALL_S=0 is rendezvous-run's "the daemon's default"; set where
    both start, it refused the daemon with no word of the launcher."""
    token = tmp_path / "token"
    write_token(token)
    done = subprocess.run(
        [sys.executable, "-m", "rendezvousd.cli", "serve", "--token-file", str(token),
         "--listen", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=30, check=False,
        env={**os.environ, "RENDEZVOUSD_LAST_CALL_S": "0"},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "$RENDEZVOUSD_LAST_CALL_S='0' is invalid: last_call_s must be" in done.stderr
    assert (
        "rendezvous-run reads this variable too, where 0 means the daemon's default: set it "
        "for the launcher only, not in the daemon's environment" in done.stderr
    ), done.stderr
    assert "Traceback" not in done.stderr


def test_insecure_metrics_opt_in_serves_on_any_address(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon("--metrics-listen", "0.0.0.0:0", "--insecure-metrics")
    port = d.metrics_url.rsplit(":", 1)[1].split("/")[0]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as page:
        assert b"rendezvousd_waiters" in page.read()


def test_metrics_on_loopback_needs_no_opt_in(start_daemon: Callable[..., DaemonProcess]) -> None:
    d = start_daemon("--metrics-listen", "127.0.0.1:0")
    assert d.metrics_url.startswith("http://127.0.0.1:")


def test_cert_key_mismatch_is_named(tmp_path: Path, pki: Pki) -> None:
    key_text = pki.rogue_key.read_text()
    tls = ("--tls-cert", str(pki.server), "--tls-key", str(pki.rogue_key))
    code, _, err = _serve(tmp_path, "--listen", "127.0.0.1:0", *tls)
    assert code == 2, err
    assert "does not belong to certificate" in err
    assert "another rendezvousd" not in err
    assert key_text.splitlines()[1] not in err


def test_a_key_that_is_not_pem_is_named(tmp_path: Path, pki: Pki) -> None:
    bogus = tmp_path / "bogus.key"
    bogus.write_text("not a key\n")
    bogus.chmod(0o600)
    code, _, err = _serve(
        tmp_path, "--listen", "127.0.0.1:0", "--tls-cert", str(pki.server), "--tls-key", str(bogus)
    )
    assert code == 2, err
    assert f"cannot load TLS certificate {pki.server} with key {bogus}" in err


@pytest.mark.parametrize(
    "content", ["not a certificate\n", "", "DER"], ids=["text", "empty", "der"]
)
def test_a_client_ca_that_is_not_pem_is_named(tmp_path: Path, pki: Pki, content: str) -> None:
    bogus = tmp_path / "clients-ca.pem"
    if content == "DER":
        der = ssl.PEM_cert_to_DER_cert(pki.ca.read_text())
        bogus.write_bytes(der)
    else:
        bogus.write_text(content)
    tls = pki.serve_args()
    code, out, err = _serve(
        tmp_path, "--listen", "127.0.0.1:0", *tls, "--tls-client-ca", str(bogus)
    )
    assert code == 2, err
    assert f"TLS client CA {bogus} (--tls-client-ca) is not a PEM certificate bundle" in err
    assert "another rendezvousd" not in err and "serving" not in out


def test_matching_pair_serves(start_daemon: Callable[..., DaemonProcess], pki: Pki) -> None:
    d = start_daemon(*pki.serve_args())
    assert d.proc.poll() is None


def test_metrics_are_served_over_tls_with_the_daemons_certificate(
    pki: Pki, start_daemon: Callable[..., DaemonProcess]
) -> None:
    d = start_daemon(*pki.serve_args(), "--metrics-listen", "127.0.0.1:0")
    assert d.metrics_url.startswith("https://127.0.0.1:"), d.metrics_url
    context = ssl.create_default_context(cafile=str(pki.ca))
    page = urllib.request.urlopen(d.metrics_url, timeout=5, context=context).read()
    assert b"rendezvousd_jobs" in page
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(d.metrics_url.replace("https", "http"), timeout=5).read()


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({"tls_cert": "c.pem"}, "tls_cert and tls_key go together"),
        ({"tls_key": "k.pem"}, "tls_cert and tls_key go together"),
        ({"tls_client_ca": "ca.pem"}, "tls_client_ca (mTLS) needs tls_cert and tls_key"),
    ],
)
def test_tls_settings_that_cannot_work_alone_are_refused(fields: dict[str, str], said: str) -> None:
    """Half a certificate pair, or a client CA with no certificate to serve TLS with,
    refused when the config is built (before any file is read), naming the pair."""
    with pytest.raises(ConfigError, match=re.escape(said)):
        DaemonConfig(listen="127.0.0.1:0", **fields)  # type: ignore[arg-type]


def test_a_config_file_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    config = tmp_path / "rendezvousd.toml"
    config.write_bytes(b"listen = '127.0.0.1:0'\n# caf\xe9 (Latin-1)\n")
    code, _, err = _serve(tmp_path, "--config", str(config))
    assert code == 2 and "Traceback" not in err, err
    assert f"config file {config} could not be read as TOML" in err


_PATH_SETTINGS = [
    key for key, option in SCHEMA.options.items() if isinstance(option.kind, OptionalPath)
]


@pytest.mark.parametrize("blank", ["", " ", "\t"], ids=["empty", "space", "tab"])
@pytest.mark.parametrize("source", ["flag", "env", "toml"])
@pytest.mark.parametrize("key", _PATH_SETTINGS)
def test_an_empty_path_setting_is_refused_not_taken_as_unset(
    tmp_path: Path, key: str, source: str, blank: str
) -> None:
    """An unset $CA in a unit file's ``--tls-client-ca "$CA"`` served TLS that took
    clients with no certificate, and a blank state dir ran with no persistence, both
    without a word: every optional path setting refuses an empty value, naming it
    and where it came from."""
    option = SCHEMA.options[key]
    assert option.env is not None and option.flag is not None
    env: dict[str, str] = {}
    overrides: dict[str, object] = {}
    config_file = None
    if source == "env":
        env[option.env] = blank
        origin = f"${option.env}"
    elif source == "flag":
        # What argparse's type (the option's own parser) sees, via the schema.
        with pytest.raises(argparse.ArgumentTypeError, match="must be a path, not empty"):
            SCHEMA._arg_type(option)(blank)
        overrides[key] = blank
        origin = option.flag
    else:
        config_file = tmp_path / "rendezvousd.toml"
        config_file.write_text(f"{key} = {blank!r}\n".replace("'", '"'))
        origin = f"{key} in {config_file}"
    with pytest.raises(ConfigError) as refused:
        load(config_file, env=env, overrides=overrides)
    said = str(refused.value)
    assert said.startswith(f"{origin}={blank!r} is invalid: {key} must be a path"), said
    assert "leave the setting out" in said


def test_an_empty_client_ca_flag_stops_serve(tmp_path: Path, pki: Pki) -> None:
    """The reviewer's case: TLS served, and a client with no certificate let in."""
    code, out, err = _serve(
        tmp_path, "--listen", "127.0.0.1:0", *pki.serve_args(), "--tls-client-ca", ""
    )
    assert code == 2 and "Traceback" not in err and "serving" not in out, err
    assert "argument --tls-client-ca: '' must be a path, not empty" in err
    env = {**os.environ, "RENDEZVOUSD_STATE_DIR": " "}
    done = subprocess.run(
        [sys.executable, "-m", "rendezvousd.cli", "serve", "--token-file", str(tmp_path / "token"),
         "--listen", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=30, check=False, env=env,
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "$RENDEZVOUSD_STATE_DIR=' ' is invalid: state_dir must be a path" in done.stderr


@pytest.mark.parametrize(
    ("stdin", "what"),
    [
        ("devnull", "a character device (such as /dev/null)"),  # systemd's default
        ("file", "a regular file"),
        ("closed", "closed"),
    ],
)
def test_exit_with_parent_refuses_a_stdin_that_is_not_a_pipe(
    tmp_path: Path, stdin: str, what: str
) -> None:
    # It printed 'serving on', then died of the event loop's PermissionError (or an
    # AttributeError on a closed stdin) with a traceback.
    token = tmp_path / "token"
    write_token(token)
    cmd = [sys.executable, "-m", "rendezvousd.cli", "serve", "--token-file", str(token),
           "--listen", "127.0.0.1:0", "--exit-with-parent"]  # fmt: skip
    with open(token) as regular:
        done = subprocess.run(
            cmd,
            stdin={"devnull": subprocess.DEVNULL, "file": regular}.get(stdin),
            preexec_fn=(lambda: os.close(0)) if stdin == "closed" else None,
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "serving" not in done.stdout and "Traceback" not in done.stderr
    assert f"--exit-with-parent: stdin is {what}; the flag needs stdin to be a pipe" in done.stderr


@pytest.mark.parametrize(
    ("where", "why"),
    [
        ("missing-dir", "directory {tmp}/nodir does not exist: create it first"),
        ("regular-file", "{tmp}/file exists and is a regular file, not a socket: move it aside"),
        ("same-port", "is the one --metrics-listen took a moment before"),
        ("port-in-use", "is in use by another process (is another rendezvousd already using"),
    ],
)
def test_a_failed_bind_names_its_cause(tmp_path: Path, where: str, why: str) -> None:
    # Each ended in gRPC's "Failed to bind ...; set GRPC_VERBOSITY=debug ..." and the
    # guess "is another rendezvousd already using it?".
    (tmp_path / "file").write_text("not a socket\n")
    port = free_port()
    listen = {
        "missing-dir": ["--listen", f"unix:{tmp_path}/nodir/s.sock"],
        "regular-file": ["--listen", f"unix:{tmp_path}/file"],
        "same-port": ["--listen", f"127.0.0.1:{port}", "--metrics-listen", f"127.0.0.1:{port}"],
        "port-in-use": ["--listen", f"127.0.0.1:{port}"],
    }[where]
    with socket.socket() as taken:
        if where == "port-in-use":
            taken.bind(("127.0.0.1", port))
            taken.listen()
        code, out, err = _serve(tmp_path, *listen)
    assert code == 2, err
    assert "serving" not in out
    said = err.splitlines()[-1]  # after gRPC core's own "Failed to add port" line
    assert said.startswith(f"rendezvousd: error: cannot bind {listen[1]}: "), err
    assert why.format(tmp=tmp_path) in said, err
    assert "GRPC_VERBOSITY" not in said, err
    if where != "port-in-use":
        assert "another rendezvousd" not in said, err


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (
            ["--default-wait-s", "900", "--max-wait-s", "600"],
            "default_wait_s=900 is above max_wait_s=600: a call naming no wait would still "
            "be cut to max_wait_s; lower default_wait_s to at most max_wait_s, or raise "
            "max_wait_s (default_wait_s from --default-wait-s; max_wait_s from --max-wait-s)",
        ),
        (
            ["--max-value-bytes", "100000", "--max-kv-bytes-per-job", "1000"],
            "max_value_bytes=100000 is above what one job may hold (max_kv_bytes_per_job=1000)"
            ": no value that large could ever be stored; lower max_value_bytes or raise "
            "max_kv_bytes_per_job (max_value_bytes from --max-value-bytes; "
            "max_kv_bytes_per_job from --max-kv-bytes-per-job)",
        ),
        (
            ["--max-value-bytes", "100000", "--max-kv-bytes", "150000"],
            "max_value_bytes=100000 is above what one job may hold (75000, half of "
            "max_kv_bytes=150000)",
        ),
        (
            ["--max-waiters-per-job", "9000", "--max-waiters", "4000"],
            "max_waiters_per_job=9000 is above max_waiters=4000: no job could ever park "
            "that many calls, since all jobs together park at most max_waiters; lower "
            "max_waiters_per_job to at most max_waiters, or raise max_waiters "
            "(max_waiters from --max-waiters; max_waiters_per_job from --max-waiters-per-job)",
        ),
        (
            ["--max-waiters-per-job", "20000"],
            "max_waiters_per_job=20000 is above max_waiters=16384",
        ),
        # Taken and silently cut to half at each KV write (an audit, F3).
        (
            ["--max-kv-bytes", "2000000", "--max-kv-bytes-per-job", "1900000"],
            "max_kv_bytes_per_job=1900000 is above half of max_kv_bytes=2000000 (1000000), "
            "all one job may hold: lower max_kv_bytes_per_job to at most 1000000, or raise "
            "max_kv_bytes to at least 3800000 (max_kv_bytes from --max-kv-bytes; "
            "max_kv_bytes_per_job from --max-kv-bytes-per-job)",
        ),
        (
            ["--max-kv-bytes-per-job", "200000000"],
            "max_kv_bytes_per_job=200000000 is above half of max_kv_bytes=134217728",
        ),
        # Both set, both lowered: refused too (only a value raised above its default
        # was, a review).
        (["--max-wait-s", "60", "--default-wait-s", "120"], "default_wait_s=120 is above"),
        (
            ["--max-value-bytes", "30000", "--max-kv-bytes-per-job", "20000"],
            "max_value_bytes=30000 is above what one job may hold",
        ),
    ],
)
def test_contradictory_limits_are_refused_naming_both(
    tmp_path: Path, flags: list[str], said: str
) -> None:
    # Started silently: the default wait cut to max_wait_s, a value limit no job could use.
    code, out, err = _serve(tmp_path, "--listen", "127.0.0.1:0", *flags)
    assert code == 2, err
    assert "serving" not in out
    assert err.startswith(f"rendezvousd: error: {said}"), err


@pytest.mark.parametrize(
    "settings",
    [
        {"max_wait_s": 1.0},  # the default wait is capped, as documented
        {"max_kv_bytes_per_job": 1000},  # the default value limit is capped by it
        {"max_kv_bytes": 20000},  # the default per-job share is capped at its half
        {"max_kv_bytes": 20000, "max_kv_bytes_per_job": 10000},  # exactly half
        {"default_wait_s": 60.0, "max_wait_s": 60.0},
        {"max_value_bytes": 1000, "max_kv_bytes_per_job": 1000},
    ],
)
def test_one_bound_lowered_alone_is_no_contradiction(settings: dict[str, float]) -> None:
    DaemonConfig(**settings)  # type: ignore[arg-type]


def _unprivileged(cmd: list[str]) -> list[str]:
    """``cmd`` as root of a user namespace of its own: root here, but without the
    host's CAP_NET_BIND_SERVICE, as a daemon run by an ordinary user is. Skips the
    test where no such namespace is allowed, or where any user may bind port 80."""
    if int(Path("/proc/sys/net/ipv4/ip_unprivileged_port_start").read_text()) <= 80:
        pytest.skip("any user may bind port 80 here (net.ipv4.ip_unprivileged_port_start)")
    probe = ["unshare", "--user", "--map-root-user", "true"]
    try:
        allowed = subprocess.run(probe, capture_output=True, check=False).returncode == 0
    except FileNotFoundError:
        allowed = False
    if not allowed:
        pytest.skip("no user namespace here (unshare --user --map-root-user)")
    return ["unshare", "--user", "--map-root-user", *cmd]


@pytest.mark.parametrize(
    ("listen", "why"),
    [
        # TEST-NET-1 (RFC 5737): an address no host here has (EADDRNOTAVAIL).
        ("192.0.2.1:0", "192.0.2.1 is not an address of this host: listen on one of its own"),
        # A port below net.ipv4.ip_unprivileged_port_start, without the capability (EACCES).
        ("127.0.0.1:80", "this user may not listen on port 80 (a privileged port here, or "),
    ],
)
def test_a_bind_to_an_address_not_of_this_host_or_a_port_not_allowed_names_it(
    tmp_path: Path, listen: str, why: str
) -> None:
    """operations.md: a failed bind names its cause: "an address not of this host"."""
    token = tmp_path / "token"
    write_token(token)
    cmd = [sys.executable, "-m", "rendezvousd.cli", "serve", "--token-file", str(token),
           "--listen", listen]  # fmt: skip
    if not listen.startswith("127."):
        cmd.append("--insecure-plaintext")  # else refused before any bind
    if listen.endswith(":80"):
        cmd = _unprivileged(cmd)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 2, done.stderr
    assert "serving" not in done.stdout
    said = done.stderr.splitlines()[-1]
    assert said.startswith(f"rendezvousd: error: cannot bind {listen}: "), done.stderr
    assert why in said, done.stderr
    assert "another rendezvousd" not in said and "GRPC_VERBOSITY" not in said, done.stderr
