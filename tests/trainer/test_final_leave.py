"""A node agent's final Leave rides out a daemon restart within the reconnect window,
as its joins and barriers do: a job that finishes while its daemon (``--state-dir``)
is down and comes back is recorded ENDED, not FAILED for a node the restarted daemon
never heard from again (h139 F1)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client import RendezvousClient
from tests.support import ROOT, StatefulDaemon, launcher_cmd, wait_for

# Steps over the ring until told to finish (a file), then exits 0: the job's end is
# put where the test wants it, inside the daemon's outage.
_FINISHING = """\
import sys, time
from pathlib import Path
from rendezvousd.trainer.distributed import init_distributed
with init_distributed() as ctx:
    step = 0
    while not Path(sys.argv[2]).exists():
        ctx.communicator.barrier()
        ctx.progress(step)
        if step == 5:
            Path(sys.argv[1]).touch()
        step += 1
        time.sleep(0.05)
"""

# Longer than the SDK's leave timeout (2 s), the one try the final Leave made.
OUTAGE_S = 4.0


def test_a_job_that_ends_while_its_daemon_restarts_is_ended(tmp_path: Path) -> None:
    """The daemon SIGKILLed while the job runs; the workers finish and exit 0 while it is
    down; it starts again on its state OUTAGE_S later, within its heartbeat timeout.
    The agent's final Leave tried once for 2 s and gave up ("could not tell the
    daemon ... left"), and the restarted daemon recorded the finished job FAILED
    ("no heartbeat ... (node unreachable)"). Now the agent says it waits, tells the
    daemon once it is back, and the job is ENDED."""
    script, stepping, finish = tmp_path / "w.py", tmp_path / "stepping", tmp_path / "finish"
    script.write_text(_FINISHING)
    job = "ends-in-restart"
    with StatefulDaemon(tmp_path, "--heartbeat-timeout-s", "10") as daemon:
        d = daemon.current
        cmd = launcher_cmd(1, 0, 2, endpoint=d.endpoint, token_file=d.token_file, job=job)
        err = tmp_path / "agent.err"
        with err.open("w") as sink:
            agent = subprocess.Popen(
                [*cmd, "--max-restarts", "1", str(script), str(stepping), str(finish)],
                stdout=subprocess.DEVNULL,
                stderr=sink,
                cwd=ROOT,
            )
        try:
            wait_for("the workers to step", stepping.exists, timeout=60)
            daemon.current.kill()
            finish.touch()
            wait_for(
                "the agent's goodbye to find no daemon",
                lambda: (
                    "no daemon answers" in err.read_text() or "could not tell" in err.read_text()
                ),
                timeout=30,
            )
            time.sleep(OUTAGE_S)
            daemon.start_again()
            code = agent.wait(60)
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait(10)
        stderr = err.read_text()
        assert code == 0, stderr
        with RendezvousClient(daemon.current.endpoint, job, token=daemon.token) as probe:
            summary = probe.get_job().summary
    assert summary.state == pb.JOB_STATE_ENDED, (summary, stderr)
    assert "could not tell the daemon" not in stderr, stderr
    assert stderr.count("no daemon answers") == 1, stderr
