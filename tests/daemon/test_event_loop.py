"""``--event-loop``: the daemon runs on asyncio's own loop by default and on uvloop when
asked, serving the same calls on either; a loop it cannot have is a clear start-up error."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from rendezvousd.client.sync import RendezvousClient
from tests.support import DaemonProcess, write_token


@pytest.mark.parametrize(
    ("flags", "loop"), [((), "asyncio"), (("--event-loop", "uvloop"), "uvloop")]
)
def test_the_daemon_serves_on_the_event_loop_it_names(
    start_daemon: Callable[..., DaemonProcess],
    job_id: str,
    flags: tuple[str, ...],
    loop: str,
) -> None:
    d = start_daemon(*flags)
    with RendezvousClient(d.endpoint, job_id, token=d.token, connect_timeout=10) as client:
        client.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        client.start_heartbeat()
        client.kv_set("k", b"v")
        assert client.kv_get("k", timeout=5) == b"v"
        client.barrier("b", timeout=5)
        client.leave()
    assert f"event loop {loop})" in d.log(), d.log()


# uvloop made unimportable, as on a platform without its wheel.
_NO_UVLOOP = """
import sys
sys.modules["uvloop"] = None
from rendezvousd.cli.serve import main
sys.exit(main(["serve", "--listen", "127.0.0.1:0", "--token-file", sys.argv[1],
               "--event-loop", "uvloop"]))
"""


def test_a_missing_uvloop_is_a_start_up_error_that_names_the_way_out(tmp_path: Path) -> None:
    token = tmp_path / "token"
    write_token(token)
    proc = subprocess.run(
        [sys.executable, "-c", _NO_UVLOOP, str(token)], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 2, proc.stderr
    assert "uvloop is not installed" in proc.stderr
    assert "--event-loop asyncio" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "serving on" not in proc.stdout
