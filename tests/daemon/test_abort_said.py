"""Any holder of a job's token may abort or close its run (docs/operations.md, "Who may
call what"); the daemon said the transition in the caller's own words and nothing of the
caller (h173: a forged "loopback address" cause ended every node as a setup error, its
sender logged nowhere). Each abort or close now names its caller's address and token."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from rendezvousd.client import RendezvousClient
from tests.support import DaemonProcess, wait_for


@pytest.mark.parametrize("call_stream", [True, False], ids=["calls-stream", "unary"])
def test_an_abort_and_a_close_say_who_asked(
    start_daemon: Callable[..., DaemonProcess], job_id: str, call_stream: bool
) -> None:
    d = start_daemon()
    with RendezvousClient(d.endpoint, job_id, token=d.token, call_stream=call_stream) as c:
        c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        c.abort("stop it")
    said = rf"job {re.escape(job_id)} generation 1: aborted by ipv4:127\.0\.0\.1:\d+ with the admin token"
    wait_for("the abort's line", lambda: re.search(said, d.log()) is not None)
    with RendezvousClient(d.endpoint, job_id, token=d.token, call_stream=call_stream) as c:
        c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        c.close_run("closed for good")
    said = rf"job {re.escape(job_id)} generation 2: closed by ipv4:127\.0\.0\.1:\d+ with the admin token"
    wait_for("the close's line", lambda: re.search(said, d.log()) is not None)
