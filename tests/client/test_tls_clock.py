"""A TLS handshake refused for a certificate's dates is told as a clock to check.

TLS checks a certificate's validity against the verifying host's own clock: a node
that booted without NTP, meeting certificates valid from today, was told to check its
CA and server name, and under mTLS to give the certificate and key it gave. Here the
certificates' dates lie outside the (right) clocks instead, which the handshake
cannot tell from a clock that is off."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from rendezvousd.client import RendezvousClient, RendezvousError, TlsConfig
from rendezvousd.client.connection import TLS_CHECK_ADVICE
from tests.support import DaemonProcess

DAY = timedelta(days=1)
CLI = (sys.executable, "-m", "rendezvousd.cli")


def _pki(
    root: Path, *, server: tuple[datetime, datetime], client: tuple[datetime, datetime]
) -> dict[str, Path]:
    import trustme

    ca = trustme.CA()
    paths: dict[str, Path] = {}
    for name, blob in (("ca", ca.cert_pem),):
        paths[name] = root / f"{name}.pem"
        blob.write_to_path(str(paths[name]))
    for name, (start, end), identities in (
        ("server", server, ("localhost", "127.0.0.1")),
        ("client", client, ("worker.test",)),
    ):
        leaf = ca.issue_cert(*identities, not_before=start, not_after=end)
        paths[name] = root / f"{name}.pem"
        leaf.cert_chain_pems[0].write_to_path(str(paths[name]))
        paths[f"{name}_key"] = root / f"{name}.key"
        leaf.private_key_pem.write_to_path(str(paths[f"{name}_key"]))
        paths[f"{name}_key"].chmod(0o600)
    return paths


def _said(daemon: DaemonProcess, tls: TlsConfig) -> str:
    with (
        pytest.raises(RendezvousError) as refused,
        RendezvousClient(
            daemon.endpoint, "j", token=daemon.token, tls=tls, connect_timeout=20
        ) as c,
    ):
        c.join(num_nodes=1, gpus_per_node=1, node_rank=0, local_rank=0, timeout=20)
    return str(refused.value)


def _stamp(at: datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.mark.parametrize(
    ("start", "end", "reason"),
    [(DAY, 30 * DAY, "certificate is not yet valid"), (-30 * DAY, -DAY, "certificate has expired")],
)
def test_a_daemon_certificate_refused_for_its_dates_says_to_check_the_clock(
    tmp_path: Path,
    start_daemon: Callable[..., DaemonProcess],
    start: timedelta,
    end: timedelta,
    reason: str,
) -> None:
    now = datetime.now(UTC).replace(microsecond=0)
    pki = _pki(tmp_path, server=(now + start, now + end), client=(now - DAY, now + DAY))
    d = start_daemon("--tls-cert", str(pki["server"]), "--tls-key", str(pki["server_key"]))
    said = _said(d, TlsConfig(ca=pki["ca"]))
    assert reason in said, said
    assert "check this host's clock (it reads 20" in said, said
    window = f"from {_stamp(now + start)} to {_stamp(now + end)}"
    assert f"(the daemon's certificate is valid {window})" in said, said
    assert TLS_CHECK_ADVICE not in said, said
    # The daemon cannot see which client refused it (gRPC hands no failed handshake to
    # Python); its own certificate's dates against its own clock it can say at start-up.
    state = "not yet valid" if start > timedelta(0) else "expired"
    assert f"TLS certificate {pki['server']} is valid {window}, and this host's clock" in d.log()
    assert f"every client whose clock is right refuses it ({state})" in d.log()
    # `rendezvousd health` said to check --tls-ca and --tls-server-name.
    health = subprocess.run(
        [*CLI, "health", "--endpoint", d.endpoint, "--tls-ca", str(pki["ca"]), "--timeout", "10"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert health.returncode != 0, health.stderr
    assert reason in health.stderr and "check this host's clock (it reads" in health.stderr
    assert f"(the daemon's certificate is valid {window})" in health.stderr, health.stderr


def test_an_mtls_daemon_turning_away_a_certificate_out_of_its_dates_names_them(
    tmp_path: Path, start_daemon: Callable[..., DaemonProcess]
) -> None:
    """A daemon checks a client's certificate against its own clock and closes the
    connection without a word: the client names the certificate's dates beside its
    own clock, where they disagree, and otherwise says the daemon's clock may be off."""
    now = datetime.now(UTC).replace(microsecond=0)
    pki = _pki(tmp_path, server=(now - DAY, now + DAY), client=(now + DAY, now + 2 * DAY))
    d = start_daemon(
        "--tls-cert",
        str(pki["server"]),
        "--tls-key",
        str(pki["server_key"]),
        "--tls-client-ca",
        str(pki["ca"]),
    )
    said = _said(d, TlsConfig(ca=pki["ca"], cert=pki["client"], key=pki["client_key"]))
    window = f"from {_stamp(now + DAY)} to {_stamp(now + 2 * DAY)}"
    assert f"this client's certificate {pki['client']} is valid {window}" in said, said
    assert "which this host's clock (it reads 20" in said, said
    assert "check this host's clock, or renew the certificate" in said, said


FAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")


@pytest.mark.skipif(not FAKETIME.exists(), reason="libfaketime is not installed")
def test_an_mtls_daemon_whose_clock_is_behind_is_named_as_a_clock_to_check(
    tmp_path: Path, start_daemon: Callable[..., DaemonProcess]
) -> None:
    """The daemon's wall clock two days behind (libfaketime; its monotonic clock and
    this host's clocks are left alone): a client certificate valid from yesterday is
    "not yet valid" to it. The client was told to give the certificate and key it
    gave."""
    now = datetime.now(UTC).replace(microsecond=0)
    pki = _pki(tmp_path, server=(now - 30 * DAY, now + DAY), client=(now - DAY, now + DAY))
    env = {
        "LD_PRELOAD": str(FAKETIME),
        "FAKETIME": "-2d",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }
    d = start_daemon(
        "--tls-cert",
        str(pki["server"]),
        "--tls-key",
        str(pki["server_key"]),
        "--tls-client-ca",
        str(pki["ca"]),
        env=env,
    )
    said = _said(d, TlsConfig(ca=pki["ca"], cert=pki["client"], key=pki["client_key"]))
    window = f"from {_stamp(now - DAY)} to {_stamp(now + DAY)}"
    assert "the daemon's host's clock may be outside the certificate's validity" in said, said
    assert f"({pki['client']} is valid {window}; this host's clock reads 20" in said, said
    assert "check the daemon's host's clock" in said, said
