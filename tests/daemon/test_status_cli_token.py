"""``rendezvousd status`` without a token names the CLI's own ways to give one (the
flag and the env vars), not the SDK's keyword arguments, and exits 1 (bad arguments)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support import DaemonProcess


def _status(daemon: DaemonProcess, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("RENDEZVOUSD_")}
    return subprocess.run(
        [sys.executable, "-m", "rendezvousd.cli", "status", "--endpoint", daemon.endpoint, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**base, **env},
    )


def test_status_without_a_token_names_the_flag_and_env_vars(daemon: DaemonProcess) -> None:
    done = _status(daemon)
    assert done.returncode == 1, done
    assert "--token-file" in done.stderr, done.stderr
    assert "$RENDEZVOUSD_TOKEN_FILE" in done.stderr and "$RENDEZVOUSD_TOKEN" in done.stderr
    assert "token=" not in done.stderr and "token_file=" not in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_status_takes_the_token_from_the_flag_or_either_env_var(daemon: DaemonProcess) -> None:
    for args, env in (
        (("--token-file", str(daemon.token_file)), {}),
        ((), {"RENDEZVOUSD_TOKEN_FILE": str(daemon.token_file)}),
        ((), {"RENDEZVOUSD_TOKEN": daemon.token}),
    ):
        done = _status(daemon, *args, **env)
        assert done.returncode == 0, (args, list(env), done.stderr)
        assert done.stdout.startswith(f"daemon {daemon.endpoint}: rendezvousd "), done.stdout


def test_status_into_a_closed_pipe_exits_as_sigpipe_would_without_a_traceback(
    daemon: DaemonProcess,
) -> None:
    """``rendezvousd status | head -3`` ended in a BrokenPipeError traceback once head
    had its lines (an observability review)."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line: every write fails
    base = {k: v for k, v in os.environ.items() if not k.startswith("RENDEZVOUSD_")}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "rendezvousd.cli", "status", "--endpoint", daemon.endpoint,
             "--token-file", str(daemon.token_file)],
            stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60, env=base,
        )  # fmt: skip
    finally:
        os.close(write_end)
    assert done.returncode == 141, done.stderr
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
