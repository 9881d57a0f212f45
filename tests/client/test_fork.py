"""A client used in a forked child (a DataLoader worker, say) is refused at once.

gRPC's channel and threads do not survive a fork: the child's call hung inside gRPC
core past its deadline (3 runs in 6), or failed after two attempts blaming a daemon
that was fine. The child's exit must not hang on the parent's client either.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

from tests.support import DaemonProcess

SCRIPT = r"""
import json, os, sys, time
from rendezvousd.client import RendezvousClient, InvalidRequest

def child_calls(c):
    outcome = []
    for name, call in {calls}:
        try:
            call()
            outcome.append([name, "answered"])
        except InvalidRequest as exc:
            outcome.append([name, "InvalidRequest", str(exc)])
        except BaseException as exc:
            outcome.append([name, type(exc).__name__, str(exc)])
    return outcome

{main}
"""

SYNC_MAIN = r"""
with RendezvousClient(sys.argv[1], sys.argv[2], token=sys.argv[3], call_timeout=5) as c:
    c.list_jobs()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        started = time.monotonic()
        outcome = child_calls(c)
        os.write(w, json.dumps([outcome, time.monotonic() - started]).encode())
        sys.exit(0)  # through the with block's exit and atexit, as a real child's
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    _, status = os.waitpid(pid, 0)
    c.list_jobs()  # the parent's client still works
print(json.dumps({"child": json.loads(data), "status": status}))
"""


def test_a_forked_childs_calls_are_refused_at_once_and_it_exits_cleanly(
    daemon: DaemonProcess, job_id: str
) -> None:
    calls = '[("list_jobs", c.list_jobs), ("start_heartbeat", c.start_heartbeat)]'
    script = SCRIPT.format(calls=calls, main=SYNC_MAIN)
    run = subprocess.Popen(
        [sys.executable, "-c", script, daemon.endpoint, job_id, daemon.token],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a child hung in gRPC core goes with the group below
    )
    try:
        out, err = run.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    assert run.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    outcome, took = result["child"]
    assert result["status"] == 0, result
    assert [o[:2] for o in outcome] == [
        ["list_jobs", "InvalidRequest"],
        ["start_heartbeat", "InvalidRequest"],
    ], outcome
    assert "is a fork of it" in outcome[0][2] and "make a new client in the child" in outcome[0][2]
    assert took < 2, took
