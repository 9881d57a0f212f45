"""A client without the CA (plaintext) against a TLS daemon is told so at once.

Before, the SDK waited for the daemon through the whole connect timeout, retried,
and after about a minute called it unreachable ("is the daemon running?"), while
the daemon logged a failed handshake for every reconnect.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from rendezvousd.client import (
    AsyncRendezvousClient,
    AuthenticationError,
    DaemonUnavailable,
    RendezvousClient,
)
from rendezvousd.client.connection import (
    TLS_SNIFF_TIMEOUT_S,
    RetryPolicy,
    channel_options,
    speaks_tls,
)
from tests.support import DaemonProcess, Pki, free_port, launcher_cmd

#: The SDK's words (its keyword), and rendezvous-run's (its flag and variable).
SPEAKS_TLS = "speaks TLS: pass tls=TlsConfig(ca=PATH), the CA that signed its certificate"
LAUNCHER_SPEAKS_TLS = "speaks TLS: pass --tls-ca PATH (or set $RENDEZVOUSD_TLS_CA), the CA"
#: Long enough that waiting for it (the old behaviour) fails the test's time limit.
CONNECT_TIMEOUT_S = 30.0
PROMPTLY_S = 5.0


def _one_clients_lines() -> int:
    """The "Handshake failed" lines one plaintext client can leave: gRPC's attempt, its
    transparent retry of a call the dropped connection never sent (seen under CPU load,
    about 1 run in 8), and the channel's own reconnects, which go on in the background
    while the SDK asks the daemon directly (up to TLS_SNIFF_TIMEOUT_S on a starved
    machine: a CI run saw 3 lines within 0.5 s), at the SDK's reconnect backoff with
    gRPC's -20 % jitter. Each further client adds at least one line."""
    options = dict(channel_options(RetryPolicy(), None))
    backoff, maximum = (
        options["grpc.initial_reconnect_backoff_ms"],
        options["grpc.max_reconnect_backoff_ms"],
    )
    assert isinstance(backoff, int) and isinstance(maximum, int)
    lines, at = 2, 0.8 * backoff
    while at <= TLS_SNIFF_TIMEOUT_S * 1000:
        lines += 1
        backoff = min(int(backoff * 1.6), maximum)
        at += 0.8 * backoff
    return lines


HANDSHAKE_LINES_MAX = _one_clients_lines()


def _tls_daemon(start_daemon: Callable[..., DaemonProcess], pki: Pki, mtls: bool) -> DaemonProcess:
    return start_daemon(*pki.serve_args(mtls=mtls))


@pytest.mark.parametrize("mtls", [False, True], ids=["tls", "mtls"])
def test_sync_client_without_the_ca_is_told_the_daemon_speaks_tls(
    pki: Pki, start_daemon: Callable[..., DaemonProcess], job_id: str, mtls: bool
) -> None:
    d = _tls_daemon(start_daemon, pki, mtls)
    started = time.monotonic()
    with (
        RendezvousClient(d.endpoint, job_id, token=d.token, connect_timeout=CONNECT_TIMEOUT_S) as c,
        pytest.raises(AuthenticationError) as info,
    ):
        c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
    assert time.monotonic() - started < PROMPTLY_S, "it waited for the connect timeout"
    assert f"the daemon at {d.endpoint} {SPEAKS_TLS}" in str(info.value)
    assert d.token not in str(info.value)


@pytest.mark.parametrize("mtls", [False, True], ids=["tls", "mtls"])
async def test_asyncio_client_without_the_ca_is_told_the_daemon_speaks_tls(
    pki: Pki, start_daemon: Callable[..., DaemonProcess], job_id: str, mtls: bool
) -> None:
    d = _tls_daemon(start_daemon, pki, mtls)
    started = time.monotonic()
    client = AsyncRendezvousClient(
        d.endpoint, job_id, token=d.token, connect_timeout=CONNECT_TIMEOUT_S
    )
    try:
        with pytest.raises(AuthenticationError) as info:
            await asyncio.wait_for(
                client.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10),
                CONNECT_TIMEOUT_S / 2,
            )
    finally:
        await client.close()
    assert time.monotonic() - started < PROMPTLY_S, "it waited for the connect timeout"
    assert f"the daemon at {d.endpoint} {SPEAKS_TLS}" in str(info.value)


#: A training script's start (a warm spare runs it up to init_distributed()), which must
#: never get past it when the launcher cannot join.
UNASSIGNED_WORKER = (
    "from rendezvousd.trainer.distributed import init_distributed\n"
    "init_distributed()\n"
    "raise SystemExit('a worker was assigned a rank without a rendezvous')\n"
)


def test_launcher_without_the_ca_names_the_tls_daemon_and_stops(
    pki: Pki, start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path
) -> None:
    d = _tls_daemon(start_daemon, pki, mtls=False)
    script = tmp_path / "worker.py"
    script.write_text(UNASSIGNED_WORKER)
    started = time.monotonic()
    # The old launcher waited out two connect timeouts (about a minute).
    run = subprocess.run(
        [
            *launcher_cmd(1, 0, 1, endpoint=d.endpoint, token_file=d.token_file, job=job_id),
            "--max-restarts",
            "2",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=45,
    )
    elapsed = time.monotonic() - started
    assert run.returncode != 0, run.stderr
    assert f"the daemon at {d.endpoint} {LAUNCHER_SPEAKS_TLS}" in run.stderr, run.stderr
    assert "TlsConfig" not in run.stderr and "tls_ca" not in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and "assigned a rank without" not in run.stderr
    assert elapsed < 20, f"{elapsed:.1f} s: {run.stderr}"
    # Its first client's attempt; its restarts and root-cause query ask directly.
    d.terminate()
    assert 1 <= d.log().count("Handshake failed") <= HANDSHAKE_LINES_MAX, d.log()


def test_launcher_with_the_wrong_ca_says_so_in_its_own_words_only(
    pki: Pki, start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path
) -> None:
    """gRPC core logs each failed handshake at INFO on the client too: the launcher's
    stderr had three "Handshake failed ..." lines around its own message, which says
    the same and what to do."""
    d = _tls_daemon(start_daemon, pki, mtls=False)
    script = tmp_path / "worker.py"
    script.write_text(UNASSIGNED_WORKER)

    def run(**verbosity: str) -> str:
        env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
        done = subprocess.run(
            [
                *launcher_cmd(1, 0, 1, endpoint=d.endpoint, token_file=d.token_file, job=job_id),
                *("--tls-ca", str(pki.rogue_ca), "--tls-server-name", "localhost", str(script)),
            ],
            capture_output=True,
            text=True,
            timeout=45,
            env=env | verbosity,
        )
        assert done.returncode == 2, done.stderr  # the setup's error: no restart helps
        assert "CERTIFICATE_VERIFY_FAILED" in done.stderr, done.stderr
        # Its flags: it was told to check "tls_ca", which rendezvous-run does not take.
        said = "Check --tls-ca (it must have signed the daemon's certificate) and --tls-server-name"
        assert said in done.stderr, done.stderr
        assert "TlsConfig" not in done.stderr and "tls_ca" not in done.stderr, done.stderr
        return done.stderr

    assert "Handshake failed" not in (err := run()), err
    # A threshold the user chose is theirs.
    assert "Handshake failed" in (err := run(GRPC_VERBOSITY="INFO")), err


def test_a_plaintext_client_still_waits_for_a_daemon_not_up_yet(job_id: str) -> None:
    """Nothing listening is not TLS: the patient check runs (and here times out)."""
    endpoint = f"127.0.0.1:{free_port()}"
    with (
        RendezvousClient(endpoint, job_id, token="t" * 32, connect_timeout=1.5) as c,
        pytest.raises(DaemonUnavailable, match=re.escape(endpoint)) as info,
    ):
        c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
    assert "speaks TLS" not in str(info.value)


def test_speaks_tls_tells_the_daemons_apart(
    pki: Pki, start_daemon: Callable[..., DaemonProcess]
) -> None:
    assert speaks_tls(_tls_daemon(start_daemon, pki, mtls=False).endpoint)
    assert speaks_tls(_tls_daemon(start_daemon, pki, mtls=True).endpoint)
    assert not speaks_tls(start_daemon().endpoint)
    assert not speaks_tls(f"127.0.0.1:{free_port()}")
    assert not speaks_tls("dns:///localhost:1")  # a gRPC target form it does not resolve


def test_plaintext_client_leaves_one_handshake_line_in_the_daemons_log(
    pki: Pki, start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    d = _tls_daemon(start_daemon, pki, mtls=False)
    with (
        RendezvousClient(d.endpoint, job_id, token=d.token, connect_timeout=CONNECT_TIMEOUT_S) as c,
        pytest.raises(AuthenticationError),
    ):
        c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
    d.terminate()
    # gRPC's attempt (its HTTP/2 preface is not TLS: WRONG_VERSION_NUMBER); the SDK's
    # own look (a ClientHello) ends before a handshake fails, so adds no other line.
    lines = [line for line in d.log().splitlines() if "Handshake failed" in line]
    assert 1 <= len(lines) <= HANDSHAKE_LINES_MAX, d.log()
    assert all("WRONG_VERSION_NUMBER" in line for line in lines), d.log()


def test_health_and_status_without_the_ca_say_the_daemon_speaks_tls_alike(
    pki: Pki, start_daemon: Callable[..., DaemonProcess]
) -> None:
    """`status` exited 3 (an RPC refused) where `health` exits 2 (unreachable) for the
    same plaintext connect, and gave the SDK's advice, naming $RENDEZVOUSD_TLS_CA and
    tls_ca=, which the command does not read."""
    d = _tls_daemon(start_daemon, pki, mtls=False)
    plain = start_daemon()
    name = ["--tls-server-name", "localhost"]
    cases = [
        (d, [], f"the daemon at {d.endpoint} speaks TLS: pass --tls-ca"),
        # The review: a wrong CA, and a CA at a plaintext daemon, still exited 3 from
        # status (2 from health), naming the SDK's tls_ca and tls_server_name.
        (d, ["--tls-ca", str(pki.rogue_ca), *name], "--tls-ca"),
        (plain, ["--tls-ca", str(pki.ca), *name], "does not speak TLS"),
    ]
    for daemon, flags, said in cases:
        for command in (["health"], ["status", "--token-file", str(daemon.token_file)]):
            run = subprocess.run(
                [sys.executable, "-m", "rendezvousd.cli", *command, "--endpoint",
                 daemon.endpoint, "--timeout", "10", *flags],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert run.returncode == 2, (command, flags, run.stderr)
            assert said in run.stderr, (command, flags, run.stderr)
            for sdk_word in (
                "RENDEZVOUSD_TLS_CA",
                "tls_ca",
                "tls_server_name",
                "TlsConfig",
                "tls=",
            ):
                assert sdk_word not in run.stderr, (command, flags, run.stderr)


def test_a_daemon_found_speaking_tls_then_restarted_without_it_is_joined(
    pki: Pki, start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    """The process remembers the TLS daemon only to ask it again directly, not to
    refuse a daemon that has since dropped TLS on the same address."""
    tls = _tls_daemon(start_daemon, pki, mtls=False)
    with (
        RendezvousClient(tls.endpoint, job_id, token=tls.token) as c,
        pytest.raises(AuthenticationError, match=re.escape(SPEAKS_TLS)),
    ):
        c.check_health()
    tls.kill()
    plain = start_daemon(listen=tls.endpoint)
    with RendezvousClient(plain.endpoint, job_id, token=plain.token) as c:
        m = c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        assert m.world_size == 1


def test_a_later_plaintext_client_in_the_process_leaves_no_handshake_line(
    pki: Pki, start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    """What keeps a launcher's restarts and root-cause query from adding lines (their
    clients ask the daemon directly): one client's lines vary with load, a later
    client's must be none."""
    d = _tls_daemon(start_daemon, pki, mtls=False)

    def refused() -> int:
        with (
            RendezvousClient(d.endpoint, job_id, token=d.token, connect_timeout=30) as c,
            pytest.raises(AuthenticationError, match=re.escape(SPEAKS_TLS)),
        ):
            c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        # Settled: no line for 1.5 s after the client closed its channel, longer than
        # gRPC's first reconnect backoff (1 s, +-20 %): with 0.5 s a fresh-clone CI run
        # counted the first client's late line for the second client.
        seen = -1
        while (count := d.log().count("Handshake failed")) != seen:
            seen = count
            time.sleep(1.5)
        return count

    first = refused()
    assert first >= 1, d.log()
    assert refused() == first, d.log()
