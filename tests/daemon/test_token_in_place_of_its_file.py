"""A token given where its file's path belongs (``RENDEZVOUSD_TOKEN_FILE="$(cat tok)"``)
is never echoed: the daemon, ``rendezvousd status``, the SDK and ``rendezvous-run`` say
that the value looks like a token, not which token it is."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from rendezvousd.cli.embedded import write_token_file
from tests.support import write_token


def _run(args: list[str], tmp: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("RENDEZVOUSD_")}
    return subprocess.run(
        args, capture_output=True, text=True, timeout=60, check=False, cwd=tmp, env={**base, **env}
    )


def _refused_unseen(done: subprocess.CompletedProcess[str], token: str, code: int) -> None:
    said = done.stdout + done.stderr
    assert token not in said and token[:12] not in said, said
    assert done.returncode == code and "Traceback" not in said, said
    assert "looks like a token rather than a path" in said, said
    assert "$RENDEZVOUSD_TOKEN" in said, said


@pytest.fixture
def token(tmp_path: Path) -> str:
    # The very kind the reviewer pasted: what `rendezvousd token` writes.
    return write_token_file(tmp_path / "tok")


def test_serve_does_not_echo_a_token_given_as_its_token_file(tmp_path: Path, token: str) -> None:
    cli = [sys.executable, "-m", "rendezvousd.cli", "serve", "--listen", "127.0.0.1:0"]
    _refused_unseen(_run([*cli, f"--token-file={token}"], tmp_path), token, 2)
    _refused_unseen(_run(cli, tmp_path, RENDEZVOUSD_TOKEN_FILE=token), token, 2)


def test_status_does_not_echo_a_token_given_as_its_token_file(tmp_path: Path, token: str) -> None:
    cli = [sys.executable, "-m", "rendezvousd.cli", "status", "--endpoint", "127.0.0.1:1"]
    _refused_unseen(_run([*cli, f"--token-file={token}"], tmp_path), token, 1)
    _refused_unseen(_run(cli, tmp_path, RENDEZVOUSD_TOKEN_FILE=token), token, 1)


def test_the_launcher_does_not_echo_a_token_given_as_its_token_file(
    tmp_path: Path, token: str
) -> None:
    launcher = Path(sys.executable).with_name("rendezvous-run")
    (tmp_path / "train.py").write_text("")
    args = [str(launcher), "--rdzv-endpoint", "127.0.0.1:1", "--nnodes", "1", "train.py"]
    _refused_unseen(_run(args, tmp_path, RENDEZVOUSD_TOKEN_FILE=token), token, 2)


def test_a_missing_path_is_still_named(tmp_path: Path) -> None:
    """Only what could be a token is kept back: a mistyped path is shown, to be found."""
    write_token(tmp_path / "token")
    missing = tmp_path / "rendezvous" / "token.txt"
    cli = [sys.executable, "-m", "rendezvousd.cli", "serve", "--listen", "127.0.0.1:0"]
    done = _run([*cli, "--token-file", str(missing)], tmp_path)
    assert done.returncode == 2, done.stderr
    assert f"cannot read token file {missing}: No such file or directory" in done.stderr


def test_what_looks_like_a_token() -> None:
    from rendezvousd.common.secret_files import looks_like_token

    minted = [secrets.token_urlsafe(32) for _ in range(200)]
    assert all(looks_like_token(t) for t in minted)
    assert looks_like_token(secrets.token_hex(16))
    assert looks_like_token("rdzv-job.train.1700000000.issued-1.abcdef0123456789")
    assert looks_like_token("q2Xv/9+ZkT0pR3mA8cLw1nYb")  # openssl rand -base64
    # Tokens with dots, which the daemon takes, were shown whole (a review).
    assert looks_like_token("eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.SflKxwRJSMeKKF2QT4fw")
    assert looks_like_token("hvs.CAESIJlU8mzqYzWk3l9fSx1Tq2k")
    for path in (
        "/etc/rendezvousd/token",
        "rendezvous_token",
        "secrets/rendezvous-token",
        "/run/secrets/rdzv-token",
        "token.txt",
        "./rendezvousToken2",
        "rendezvous.token.file",
        "/var/lib/rendezvousd/job-token-2",
        "short",
    ):
        assert not looks_like_token(path), path
