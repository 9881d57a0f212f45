"""A worker relaying a broken link it heard of from a neighbour (rank 3: "lost rank 1
(reported by rank 2)") reports first, the witness (rank 2) 0.1 s later, within the
daemon's window: the daemon records the witness first (``rounds._witness_first``).
Node 1's agent read its own workers' exits, rank 3's first, and named rank 3 "failed
first" beside the daemon's record, and its summary with it; on real launchers and a
real daemon, with the two reports timed as a cut's relay race made them (h160)."""

from __future__ import annotations

import contextlib
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from rendezvousd.client import NotFound, RendezvousClient
from tests.support import ROOT, DaemonProcess, launcher_cmd, wait_for

#: Ranks 2 and 3 (node 1) fail as a cut's witness and its relay do: the relay's report
#: first (it raised 0.55 s sooner, and waits 0.5 s longer for word of a failure), then
#: the witness's; each worker lingers after its report (its ring's and device's
#: teardown), the relay's exit read by its agent after both reports went.
SCRIPT = """
import sys, time
import numpy as np
from rendezvousd.trainer.distributed import init_distributed
from rendezvousd.trainer.errors import PeerConnectionError

rank = -1
try:
    with init_distributed() as ctx:
        rank = ctx.rank
        ctx.communicator.all_reduce(np.zeros(4))  # every rank is here: one start
        if rank == 3:
            relayed = PeerConnectionError("rank 3: lost rank 1 (reported by rank 2): reset")
            relayed.reported_by = 2
            raise relayed
        if rank == 2:
            time.sleep(0.55)
            raise PeerConnectionError("rank 2: lost rank 1: its host answered nothing")
        time.sleep(60)  # stopped by its agent long before
except PeerConnectionError:
    time.sleep(0.3 if rank == 3 else 3.0)
    sys.exit(1)
"""


def _launch(
    d: DaemonProcess, job_id: str, tmp_path: Path, script_text: str
) -> tuple[list[subprocess.Popen[bytes]], list[Path]]:
    script = tmp_path / "relay.py"
    script.write_text(script_text)
    errs = [tmp_path / f"node{n}.err" for n in range(2)]
    procs = []
    for n, err in enumerate(errs):
        cmd = launcher_cmd(2, n, 2, endpoint=d.endpoint, token_file=d.token_file, job=job_id)
        with err.open("w") as out:
            procs.append(
                subprocess.Popen(
                    [*cmd, "--max-restarts", "0", str(script)],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=ROOT,
                )
            )
    return procs, errs


def test_the_agent_names_the_witness_the_daemon_recorded_not_its_relay(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path
) -> None:
    d = start_daemon()
    procs, errs = _launch(d, job_id, tmp_path, SCRIPT)
    try:
        codes = [p.wait(90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    said = [e.read_text() for e in errs]
    assert all(c != 0 for c in codes), (codes, said)
    for text in said:
        assert "root cause: rank 2 (node 1, local rank 0)" in text, text
    node1 = said[1]
    assert re.search(r"worker rank 2 \(pid \d+\) failed first", node1), node1
    assert not re.search(r"worker rank 3 \(pid \d+\) failed first", node1), node1
    assert "  1. generation 1: rank 2 on host " in node1, node1  # its summary too


def test_a_node_whose_daemon_died_with_the_failure_names_its_own_workers_report(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path
) -> None:
    """The daemon killed once the relay's report reached it, before the witness's (as
    when it runs on the node that failed). Node 1's agent tried to pass the witness's
    report on for the outage window (10 s: a restart may be on its way), then took
    the heartbeat's verdict, "DaemonUnreachable ... no peer is known to have failed",
    as the failure: its workers' "lost rank 1" was dropped. Its own workers' first
    report is the cause it knows, the witness before its relay (the daemon's rule)."""
    d = start_daemon()
    procs, errs = _launch(
        d, job_id, tmp_path, SCRIPT.replace("time.sleep(0.55)", "time.sleep(0.8)")
    )
    try:
        with RendezvousClient(d.endpoint, job_id, token=d.token) as probe:

            def reported() -> bool:
                with contextlib.suppress(NotFound):  # before the first node's join
                    return len(probe.get_job().failed) > 0
                return False

            wait_for("the relay's report", reported, timeout=60)
        d.proc.kill()
        killed = time.monotonic()
        wait_for("node 1 to give up", lambda: "gave up after" in errs[1].read_text(), timeout=60)
        took = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
    node1 = errs[1].read_text()
    # The report's outage window (10 s), and no more: the daemon is not asked again.
    assert took < 20, (took, node1)
    assert re.search(r"worker rank 2 \(pid \d+\) failed first", node1), node1
    assert "could not report the failure to the daemon" in node1, node1
    summary = node1[node1.index("gave up after") :]
    assert "  1. generation 1: rank 2 on host " in summary, summary
    assert "lost rank 1: its host answered nothing" in summary, summary
    assert "DaemonUnreachable" not in summary, summary
