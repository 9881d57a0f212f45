"""A wild step cannot pin a node agent's state copy (rendezvous-run on a real daemon):
a fresh worker's first state is held to ``MAX_STEP_ADVANCE`` past the agent's copy,
and a state frame from any worker but local rank 0 is dropped; either is said once
in the agent's log, naming the worker, and the next generation resumes from the
copy the honest steps made (helper-173's finding 1)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.support import ROOT, WORKERS, DaemonProcess, launcher_cmd

WORKER = str(WORKERS / "wild_state_worker.py")


def _launch(d: DaemonProcess, job: str, mode: str, tmp_path: Path) -> tuple[int, str]:
    cmd = launcher_cmd(1, 0, 2, endpoint=d.endpoint, token_file=d.token_file, job=job)
    done = subprocess.run(
        [*cmd, "--max-restarts", "2", WORKER, "--mode", mode, "--marker", str(tmp_path / "sent")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,
    )
    return done.returncode, done.stdout + done.stderr


def test_a_restarted_workers_wild_first_state_does_not_pin_the_copy(
    daemon: DaemonProcess, job_id: str, tmp_path: Path
) -> None:
    code, out = _launch(daemon, job_id, "restart", tmp_path)
    assert code == 0, out
    restored = sorted(re.findall(r"GEN 3 local_rank (\d) restored step (\S+)", out))
    assert restored == [("0", "6"), ("1", "6")], out
    said = [line for line in out.splitlines() if "past this node's copy" in line]
    assert len(said) == 1, out
    assert re.search(r"warning: worker local rank 0 \(pid \d+\) sent a state for step", said[0])
    assert f"step {1 << 52}, more than {1 << 20} steps" in said[0], said[0]
    assert "(step 6): not kept" in said[0], said[0]


def test_a_state_frame_from_another_local_rank_is_dropped(
    daemon: DaemonProcess, job_id: str, tmp_path: Path
) -> None:
    code, out = _launch(daemon, job_id, "other", tmp_path)
    assert code == 0, out
    restored = sorted(re.findall(r"GEN 2 local_rank (\d) restored step (\S+)", out))
    assert restored == [("0", "6"), ("1", "6")], out
    said = [line for line in out.splitlines() if "only local rank 0's worker" in line]
    assert len(said) == 1, out
    assert re.search(r"warning: worker local rank 1 \(pid \d+\) sent a state frame", said[0])
    assert f"(step {(1 << 53) - 1})" in said[0] and "dropped" in said[0], said[0]
