"""Resources running out under a serving daemon (an operator review, helper 146): a
closed stdout, a low open-file limit, a full filesystem; each named with what to do."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import time
from pathlib import Path

from rendezvousd.cli.embedded import serve_command
from rendezvousd.client import RendezvousClient
from tests.support import wait_for, write_token


def _serve(
    tmp: Path, *flags: str, prefix: tuple[str, ...] = ()
) -> tuple[subprocess.Popen[str], Path]:
    """A daemon whose stdout is a pipe nobody reads (closed here at once), and its log."""
    token = tmp / f"token-{secrets.token_hex(4)}"
    write_token(token)
    log = tmp / f"daemon-{secrets.token_hex(4)}.log"
    r, w = os.pipe()
    with log.open("w") as err:
        proc = subprocess.Popen(
            [*prefix, *serve_command("127.0.0.1:0", token, *flags)], stdout=w, stderr=err, text=True
        )
    os.close(w)
    os.close(r)
    return proc, log


def test_a_serving_daemon_whose_stdout_reader_left_keeps_serving(tmp_path: Path) -> None:
    """`rendezvousd serve | head -1`: the reader has the port and exits; the daemon's
    next ready line met the closed pipe and the daemon exited 141."""
    proc, log = _serve(tmp_path, "--metrics-listen", "127.0.0.1:0")
    try:
        wait_for("the closed stdout said", lambda: "stdout is closed" in log.read_text()
                 or proc.poll() is not None, timeout=20)  # fmt: skip
        text = log.read_text()
        assert proc.poll() is None, f"the daemon exited {proc.returncode}: {text}"
        assert "still serving, stdout now goes to /dev/null" in text, text
        found = re.search(r"rendezvousd: serving on ([^\s;]+)", text)
        assert found is not None, text
        token = next(tmp_path.glob("token-*")).read_text().strip()
        with RendezvousClient(found.group(1), "after-head", token=token) as c:
            c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
            c.kv_set("k", b"v")
        time.sleep(0.2)
        assert proc.poll() is None, log.read_text()
    finally:
        proc.kill()
        proc.wait(10)
