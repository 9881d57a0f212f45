"""Files systemd loaded for the service (LoadCredential=, in $CREDENTIALS_DIRECTORY).

With DynamicUser, systemd ≥ 254 lets the service's user read a credential through an
ACL entry, which ``stat`` shows as group-read (0440; systemd/systemd#29435). That
directory is the service's own, read-only, and no other user can enter it, so the
group bits of a file in it give nobody else access: the token file and the TLS key are
accepted there whatever their group bits. Everywhere else the checks stay as they were.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from rendezvousd.errors import ConfigError
from rendezvousd.server.auth import read_token_file
from tests.support import DaemonProcess, Pki

CREDENTIALS_ENV = "CREDENTIALS_DIRECTORY"


def _credentials(tmp_path: Path, name: str = "credentials") -> Path:
    """A directory laid out as systemd leaves it: read-only, nobody else may enter."""
    directory = tmp_path / name
    directory.mkdir(mode=0o700)
    return directory


def _seal(directory: Path) -> None:
    directory.chmod(0o500)


def _tls_daemon_with_a_credential_key(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path, pki: Pki, mode: int
) -> DaemonProcess:
    """A TLS daemon whose private key, of ``mode``, lies in a credentials directory."""
    creds = _credentials(tmp_path)
    shutil.copy(pki.server_key, creds / "tls.key")
    (creds / "tls.key").chmod(mode)
    _seal(creds)
    return start_daemon(
        "--tls-cert",
        str(pki.server),
        "--tls-key",
        str(creds / "tls.key"),
        env={CREDENTIALS_ENV: str(creds)},
    )


def _token(path: Path, mode: int = 0o440) -> str:
    token = secrets.token_urlsafe(32)
    path.write_text(token + "\n")
    path.chmod(mode)
    return token


@pytest.fixture(autouse=True)
def _no_inherited_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CREDENTIALS_ENV, raising=False)


def test_a_group_readable_token_in_the_credentials_directory_is_accepted_and_logged(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    creds = _credentials(tmp_path)
    token = _token(creds / "token")
    _seal(creds)
    daemon = start_daemon(
        "--token-file", str(creds / "token"), token=token, env={CREDENTIALS_ENV: str(creds)}
    )
    log = daemon.log()
    assert "$CREDENTIALS_DIRECTORY" in log and "-r--r-----" in log, log
    assert token not in log


def test_the_credentials_directory_is_found_by_its_real_path(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    creds = _credentials(tmp_path)
    token = _token(creds / "token")
    _seal(creds)
    (tmp_path / "link").symlink_to(creds)
    # The env var through a link, the file by its real path.
    start_daemon(
        "--token-file",
        str(creds / "token"),
        token=token,
        env={CREDENTIALS_ENV: str(tmp_path / "link")},
    )


@pytest.mark.parametrize("where", ["unset", "elsewhere"])
def test_a_group_readable_token_outside_it_is_refused_as_before(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path, where: str
) -> None:
    path = tmp_path / "token"
    token = _token(path)
    env = {} if where == "unset" else {CREDENTIALS_ENV: str(_credentials(tmp_path))}
    with pytest.raises(RuntimeError, match=r"accessible by group/others \(mode -r--r-----\)"):
        start_daemon("--token-file", str(path), token=token, env=env)


def test_a_link_in_the_credentials_directory_to_a_file_elsewhere_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    outside = tmp_path / "token"
    _token(outside)
    creds = _credentials(tmp_path)
    (creds / "token").symlink_to(outside)
    _seal(creds)
    monkeypatch.setenv(CREDENTIALS_ENV, str(creds))
    with pytest.raises(ConfigError, match="accessible by group/others"):
        read_token_file(creds / "token")


@pytest.mark.parametrize("mode", [0o444, 0o404, 0o640 | 0o004])
def test_others_bits_are_refused_even_in_the_credentials_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int
) -> None:
    creds = _credentials(tmp_path)
    _token(creds / "token", mode)
    _seal(creds)
    monkeypatch.setenv(CREDENTIALS_ENV, str(creds))
    with pytest.raises(ConfigError, match="accessible by group/others"):
        read_token_file(creds / "token")


@pytest.mark.parametrize("directory_mode", [0o755, 0o770, 0o705])
def test_a_directory_others_can_enter_or_group_can_write_is_no_credentials_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, directory_mode: int
) -> None:
    creds = _credentials(tmp_path)
    _token(creds / "token")
    creds.chmod(directory_mode)
    monkeypatch.setenv(CREDENTIALS_ENV, str(creds))
    with pytest.raises(ConfigError, match="accessible by group/others"):
        read_token_file(creds / "token")


def test_an_empty_or_root_credentials_directory_grants_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "token"
    _token(path)
    for value in ("", "/"):
        monkeypatch.setenv(CREDENTIALS_ENV, value)
        with pytest.raises(ConfigError, match="accessible by group/others"):
            read_token_file(path)


def test_a_group_readable_tls_key_in_the_credentials_directory_is_accepted(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path, pki: Pki
) -> None:
    daemon = _tls_daemon_with_a_credential_key(start_daemon, tmp_path, pki, 0o440)
    log = daemon.log()
    assert "tls=True" in log
    assert "TLS private key" in log and "$CREDENTIALS_DIRECTORY" in log, log


@pytest.mark.parametrize("where", ["unset", "elsewhere"])
def test_a_group_readable_tls_key_outside_it_is_refused_as_before(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path, pki: Pki, where: str
) -> None:
    key = tmp_path / "server.key"
    shutil.copy(pki.server_key, key)
    key.chmod(0o440)
    env = {} if where == "unset" else {CREDENTIALS_ENV: str(_credentials(tmp_path))}
    with pytest.raises(RuntimeError, match=r"mode 0440, more than 0600.*chmod 600"):
        start_daemon("--tls-cert", str(pki.server), "--tls-key", str(key), env=env)


def test_a_tls_key_others_can_read_is_refused_in_the_credentials_directory(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path, pki: Pki
) -> None:
    with pytest.raises(RuntimeError, match=r"mode 0444"):
        _tls_daemon_with_a_credential_key(start_daemon, tmp_path, pki, 0o444)


def test_the_acl_systemd_writes_is_accepted_there(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    """The file as systemd ≥ 254 leaves it: 0400 plus a user ACL entry (mask r--)."""
    import struct

    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm (tmpfs, which keeps POSIX ACLs)")
    creds = Path(os.path.realpath(shm)) / f"rdzv-creds-{secrets.token_hex(4)}"
    creds.mkdir(mode=0o700)
    try:
        token = _token(creds / "token", 0o400)

        def entry(tag: int, perm: int, who: int = 0xFFFFFFFF) -> bytes:
            return struct.pack("<HHI", tag, perm, who)

        acl = struct.pack("<I", 2) + b"".join(
            # user::r--, user:65534:r--, group::---, mask::r--, other::---
            (entry(0x01, 4), entry(0x02, 4, 65534), entry(0x04, 0), entry(0x10, 4), entry(0x20, 0))
        )
        try:
            os.setxattr(creds / "token", "system.posix_acl_access", acl)
        except OSError as exc:
            pytest.skip(f"cannot set a POSIX ACL here: {exc.strerror}")
        assert (creds / "token").stat().st_mode & 0o777 == 0o440
        _seal(creds)
        start_daemon(
            "--token-file", str(creds / "token"), token=token, env={CREDENTIALS_ENV: str(creds)}
        )
    finally:
        creds.chmod(0o700)
        shutil.rmtree(creds)
