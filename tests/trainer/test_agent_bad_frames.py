"""A worker that sends its node agent a bad frame is that worker's failure: the agent
(rendezvous-run, on a real daemon) names the frame, reports the rank lost with that
cause, and its reader thread neither dies with a traceback nor lets the worker run on."""

from __future__ import annotations

import subprocess

import pytest

from rendezvousd.client import RendezvousClient
from tests.support import ROOT, WORKERS, DaemonProcess, launcher_cmd

WORKER = str(WORKERS / "bad_frame_worker.py")

CAUSES = {
    "nested": "frame header nests deeper than 32 levels",
    "huge": f"frame announces a {1 << 40}-byte payload; the limit is {(64 << 30) + 4096}",
    "step": f"state step {1 << 62} is not an integer in 0..{(1 << 53) - 1}",
    "garbage": "frame header is not JSON",
    "call": "DecodeError",
}


def _launch(d: DaemonProcess, job: str, nnodes: int, *worker_args: str) -> tuple[int, str]:
    cmd = launcher_cmd(nnodes, 0, 1, endpoint=d.endpoint, token_file=d.token_file, job=job)
    done = subprocess.run(
        [*cmd, "--max-restarts", "0", WORKER, *worker_args],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
    )
    return done.returncode, done.stderr


@pytest.mark.parametrize("kind", sorted(CAUSES))
def test_a_bad_frame_from_a_worker_is_its_failure_with_the_cause(
    daemon: DaemonProcess, job_id: str, kind: str
) -> None:
    code, err = _launch(daemon, job_id, 1, "--frame", kind)
    assert code == 1, err
    assert "Traceback" not in err and "Exception in thread" not in err, err
    failed_first = [line for line in err.splitlines() if "failed first, with" in line]
    assert len(failed_first) == 1, err
    assert "worker rank 0 (pid" in failed_first[0], err
    assert "failed first, with a bad frame on its agent channel: " in failed_first[0], err
    assert CAUSES[kind] in failed_first[0], err
    assert "gave up after 0 restarts" in err, err
    # The daemon holds the same cause: every other node is told what failed.
    with RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as client:
        failed = list(client.get_job().failed)
    assert [f.rank for f in failed] == [0], failed
    assert failed[0].cause.startswith(f"a bad frame on its agent channel: {CAUSES[kind]}")


def test_a_bad_frame_from_a_spare_ends_it_as_a_failure_before_assignment(
    daemon: DaemonProcess, job_id: str
) -> None:
    # Two nodes, one launched: the agent waits in join_node while its spare misbehaves.
    code, err = _launch(daemon, job_id, 2, "--frame", "nested", "--before-assign")
    assert code == 1, err
    assert "Traceback" not in err and "Exception in thread" not in err, err
    assert "worker rank 0 (pid" in err, err
    assert (
        "failed first, with a bad frame on its agent channel: frame header nests deeper than "
        "32 levels (stopped before it was assigned a rank)" in err
    ), err
    # Listed once: the spare's death was recorded twice, "2 failures" of one.
    assert "gave up after 0 restarts (max_restarts=0); 1 failure, oldest first:" in err, err
    assert "\n  2. " not in err, err
