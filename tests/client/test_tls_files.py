"""A client's TLS files are checked when the client is made, naming the file.

gRPC takes a CA that is no PEM, a key that is not the certificate's, or a missing
file without a word: the channel then never connects, and the first call waited out
its whole connect deadline (a minute by default) to report "nothing listens there".
A client key others can read is refused as the client's token file is.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from rendezvousd.client import InvalidRequest, RendezvousClient, TlsConfig
from tests.support import DaemonProcess, Pki, launcher_cmd


def _refused(daemon: DaemonProcess, tls: TlsConfig) -> str:
    started = time.monotonic()
    with pytest.raises(InvalidRequest) as refused:
        RendezvousClient(daemon.endpoint, "j", token=daemon.token, tls=tls, connect_timeout=60)
    assert time.monotonic() - started < 10  # not after the connect deadline
    return str(refused.value)


@pytest.fixture
def tls_daemon(pki: Pki, start_daemon: Callable[..., DaemonProcess]) -> DaemonProcess:
    return start_daemon(*pki.serve_args(mtls=True))


def test_a_ca_that_is_not_pem_is_refused_naming_it(
    pki: Pki, tls_daemon: DaemonProcess, tmp_path: Path
) -> None:
    der = tmp_path / "ca.der"
    der.write_bytes(b"0\x82\x01\x0a" + bytes(64))  # what a DER certificate starts like
    said = _refused(tls_daemon, TlsConfig(ca=der, cert=pki.client, key=pki.client_key))
    assert f"TLS CA {der} is not a PEM certificate bundle" in said, said
    assert "openssl x509 -inform der" in said and "listens" not in said, said


def test_a_missing_ca_is_refused_naming_it(pki: Pki, tls_daemon: DaemonProcess) -> None:
    missing = pki.root / "nowhere.pem"
    said = _refused(tls_daemon, TlsConfig(ca=missing))
    assert said == f"cannot read TLS CA {missing}: No such file or directory", said


def test_a_key_that_is_not_the_certificates_is_refused_naming_both(
    pki: Pki, tls_daemon: DaemonProcess
) -> None:
    said = _refused(tls_daemon, TlsConfig(ca=pki.ca, cert=pki.client, key=pki.rogue_key))
    assert f"TLS private key {pki.rogue_key} does not belong to certificate {pki.client}" in said


@pytest.mark.parametrize("cert_mode", [0o644, 0o600], ids=oct)
def test_a_certificate_and_key_given_swapped_are_named_swapped(
    cert_mode: int, pki: Pki, tls_daemon: DaemonProcess, tmp_path: Path
) -> None:
    """The certificate given as the key was refused for its mode (0644, as certificates
    are), with advice to chmod it; at 0600, as a certificate OpenSSL could not load."""
    cert, key = tmp_path / "client.pem", tmp_path / "client.key"
    shutil.copyfile(pki.client, cert)
    shutil.copyfile(pki.client_key, key)
    cert.chmod(cert_mode)
    key.chmod(0o600)
    said = _refused(tls_daemon, TlsConfig(ca=pki.ca, cert=key, key=cert))
    # In the SDK's words only: it said "cert= (--tls-cert)", a flag no SDK user has.
    assert said == (
        f"TLS private key {cert} holds a certificate and no private key, and the "
        f"certificate {key} holds a private key: the two look swapped; give the client "
        "certificate as TlsConfig's cert and its private key as TlsConfig's key"
    ), said
    assert "PRIVATE" not in said.replace("private", "")


def _swapped_pair(pki: Pki, folder: Path) -> tuple[Path, Path]:
    """(the file given as the certificate, the one given as the key): the key file and
    the certificate, given the wrong way round."""
    cert, key = folder / "client.pem", folder / "client.key"
    shutil.copyfile(pki.client, cert)
    shutil.copyfile(pki.client_key, key)
    key.chmod(0o600)
    return key, cert


@pytest.mark.parametrize("command", ["health", "status", "rendezvous-run"])
def test_commands_name_a_swapped_pair_in_their_own_flags(
    command: str, pki: Pki, tls_daemon: DaemonProcess, tmp_path: Path
) -> None:
    """Each said the SDK's "give the client certificate as cert= (--tls-cert)": a
    keyword its user has not got, beside the flag it has."""
    as_cert, as_key = _swapped_pair(pki, tmp_path)
    tls = ["--tls-ca", str(pki.ca), "--tls-cert", str(as_cert), "--tls-key", str(as_key)]
    if command == "rendezvous-run":
        cmd = launcher_cmd(1, 0, 1, endpoint=tls_daemon.endpoint, job="swapped")
        script = tmp_path / "train.py"
        script.write_text("raise SystemExit(3)\n")
        cmd += ["--token-file", str(tls_daemon.token_file), *tls, str(script)]
        flags = (
            "give the client certificate as --tls-cert (or $RENDEZVOUSD_TLS_CERT) and its "
            "private key as --tls-key (or $RENDEZVOUSD_TLS_KEY)"
        )
    else:
        cmd = [sys.executable, "-m", "rendezvousd.cli", command]
        cmd += ["--endpoint", tls_daemon.endpoint, *tls]
        if command == "status":
            cmd += ["--token-file", str(tls_daemon.token_file)]
        flags = "give the client certificate as --tls-cert and its private key as --tls-key"
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    said = done.stderr
    assert f"TLS private key {as_key} holds a certificate" in said, said
    assert f"the two look swapped; {flags}" in said, said
    assert "TlsConfig" not in said and "cert=" not in said and "key=" not in said, said
    # A setup error: the launcher's exit 2, as its other refused settings.
    assert done.returncode == (2 if command == "rendezvous-run" else 1), (done.returncode, said)


@pytest.mark.parametrize("which", ["ca", "cert", "key"])
@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_tls_path_that_is_no_file_is_refused_naming_it_not_waited_on(
    which: str, kind: str, pki: Pki, tls_daemon: DaemonProcess, tmp_path: Path
) -> None:
    """A FIFO given as the CA or certificate hung the client's constructor in its read
    (no deadline); a directory given as the key escaped as IsADirectoryError naming a
    descriptor number, which leaked."""
    path = tmp_path / which
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    else:
        path.mkdir(mode=0o700)
    files = {"ca": pki.ca, "cert": pki.client, "key": pki.client_key, which: path}
    said = _refused(tls_daemon, TlsConfig(**files))
    assert f"{path} is not a regular file" in said, said
    assert str(path) not in _open_files()


def _open_files() -> list[str]:
    """What this process's descriptors name."""
    names = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own, closed since
            names.append(os.readlink(f"/proc/self/fd/{fd}"))
    return names


@pytest.mark.parametrize("mode", [0o644, 0o604, 0o620], ids=oct)
def test_a_client_key_others_can_read_is_refused(
    mode: int, pki: Pki, tls_daemon: DaemonProcess, tmp_path: Path
) -> None:
    key = tmp_path / "client.key"
    shutil.copyfile(pki.client_key, key)
    key.chmod(mode)
    said = _refused(tls_daemon, TlsConfig(ca=pki.ca, cert=pki.client, key=key))
    assert f"TLS private key {key} can be read or changed by other users" in said, said
    assert "can act as this client" in said and f"chmod 600 {key}" in said, said


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o440], ids=oct)
def test_a_client_key_only_its_owner_and_group_can_read_is_used(
    mode: int, pki: Pki, tls_daemon: DaemonProcess, job_id: str, tmp_path: Path
) -> None:
    key = tmp_path / "client.key"
    shutil.copyfile(pki.client_key, key)
    key.chmod(mode)
    tls = TlsConfig(ca=pki.ca, cert=pki.client, key=key)
    with RendezvousClient(tls_daemon.endpoint, job_id, token=tls_daemon.token, tls=tls) as c:
        assert c.list_jobs() is not None  # through mutual TLS: no certificate, no call


@pytest.mark.parametrize("command", ["health", "status"])
def test_probe_commands_name_a_ca_that_is_not_pem(
    command: str, tls_daemon: DaemonProcess, tmp_path: Path
) -> None:
    bogus = tmp_path / "ca.pem"
    bogus.write_text("not a certificate\n")
    args = ["--endpoint", tls_daemon.endpoint, "--tls-ca", str(bogus)]
    if command == "status":
        args += ["--token-file", str(tls_daemon.token_file)]
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "rendezvousd.cli", command, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert f"TLS CA {bogus} is not a PEM certificate bundle" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and time.monotonic() - started < 20, done.stderr


def test_tls_paths_may_be_str(pki: Pki, tls_daemon: DaemonProcess, job_id: str) -> None:
    """A str path raised a bare AttributeError ('str' has no read_bytes) when the
    client was made; from_paths and the settings took str all along."""
    tls = TlsConfig(ca=str(pki.ca), cert=str(pki.client), key=str(pki.client_key))  # type: ignore[arg-type]
    assert tls.ca == pki.ca and tls.key == pki.client_key
    with RendezvousClient(tls_daemon.endpoint, job_id, token=tls_daemon.token, tls=tls) as c:
        assert c.list_jobs() is not None


@pytest.mark.parametrize(
    ("given", "said"),
    [({"ca": 5}, "TlsConfig(ca=5)"), ({"server_name": 5}, "TlsConfig(server_name=5)")],
)
def test_tls_settings_of_the_wrong_type_are_refused(given: dict[str, object], said: str) -> None:
    with pytest.raises(InvalidRequest, match=re.escape(said)):
        TlsConfig(**given)  # type: ignore[arg-type]
