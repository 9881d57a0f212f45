"""rendezvous-run nodes of two rendezvousd versions, and a daemon older than the node
agents: refused at the join, the newcomer's launcher exiting 2 at once with words that
name both versions and what to upgrade (the nodes already joined go on waiting). Both used to burn every restart: the nodes formed and
failed in the CPU ring's handshake ("lost rank 3 on HOST (exit code 1)"), and JoinNode
on an older daemon read "failed with UNIMPLEMENTED" then "raise --max-restarts"."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support import (
    DaemonProcess,
    daemon_without_rendezvous,
    launcher_cmd,
    run_launcher,
    stderr_of_all,
    unstamped,
    wait_for,
    write_token,
)

# A worker that waits for its rank (it never gets one): a script ending first would be
# a failure of its own, counted before the refusal.
WAITS = (
    "from rendezvousd.trainer.distributed import init_distributed\n"
    "with init_distributed():\n    pass\n"
)
# rendezvous-run whose ring speaks another wire version (argv[1]; "": an agent from
# before version reporting), as an older or newer rendezvousd's would.
OTHER_VERSION = [
    "-c",
    "import sys; from rendezvousd.trainer.comm import ring_wire; "
    "ring_wire.WIRE_VERSION = sys.argv.pop(1); "
    "from rendezvousd.trainer.agent.launcher import main; sys.exit(main())",
]
# rendezvous-run of another build of this release (argv[1], "0.1.0+gdeadbee.dirty"),
# as a node upgraded to another commit says it: its ring and joins unchanged.
OTHER_BUILD = [
    "-c",
    "import sys; from rendezvousd.common import version; said = sys.argv.pop(1); "
    "version.installed_version = lambda: said; "
    "from rendezvousd.trainer.agent.launcher import main; sys.exit(main())",
]
ON_HOST_OLD_NODE = ["unshare", "--uts", "sh", "-c", 'hostname old-node && exec "$@"', "sh"]


def _joined(d: DaemonProcess, job_id: str) -> bool:
    from rendezvousd.client import NotFound, RendezvousClient

    with RendezvousClient(d.endpoint, job_id, token=d.token) as probe:
        try:
            return probe.get_job().id_published
        except NotFound:
            return False


@pytest.mark.parametrize("other", ["RDVRING2", ""], ids=["older-ring", "before-versions"])
def test_nodes_of_two_versions_are_refused_at_the_join_naming_both(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path, other: str
) -> None:
    from rendezvousd.trainer.comm.ring_wire import WIRE_VERSION

    d = start_daemon()
    script = tmp_path / "w.py"
    script.write_text(WAITS)
    flags = ["--max-restarts", "3", "--join-timeout-s", "60", str(script)]
    node0 = [*launcher_cmd(2, 0, 2, endpoint=d.endpoint, token_file=d.token_file, job=job_id)]
    node1 = launcher_cmd(2, 1, 2, endpoint=d.endpoint, token_file=d.token_file, job=job_id)
    node1 = [*ON_HOST_OLD_NODE, sys.executable, *OTHER_VERSION, other, *node1[3:]]
    started = time.monotonic()
    first = subprocess.Popen([*node0, *flags], stderr=subprocess.PIPE, text=True)
    try:
        wait_for("node 0 to join", lambda: _joined(d, job_id), timeout=30)
        second = run_launcher([*node1, *flags], timeout=60)
        # Only the newcomer is refused: node 0 goes on waiting for a node of its
        # version (it exited 2 too, the forming generation failed by the other's word).
        assert first.poll() is None, first.stderr
        assert _joined(d, job_id)
    finally:
        first.terminate()
        _, first_err = first.communicate(timeout=60)
    # At once (process start-ups included), not at a join timeout, no restart used.
    assert time.monotonic() - started < 30
    here = socket.gethostname()
    err = second.stderr
    assert second.returncode == 2, err
    assert "joining failed: VersionMismatch" in err, err
    assert "gave up after 0 restarts (max_restarts=3); 1 failure" in err, err
    assert "upgrade every node of the job to the same rendezvousd" in err, err
    assert "no restart can change that" in err and "raise --max-restarts" not in err, err
    assert f"{WIRE_VERSION!r}" in err, err
    assert "'old-node'" in err and f"'{here}'" in err, err
    assert "VersionMismatch" not in first_err and "restart 1" not in first_err, first_err
    theirs = repr(other) if other else "not said (a rendezvous-run from before version reporting"
    said = "on host 'old-node' runs another rendezvousd version than the node agents joined"
    assert said in err, err
    assert f"its wire version is {theirs}" in err, err
    assert "refused a joiner (VERSION_MISMATCH; the forming generation goes on)" in d.log()


def test_a_daemon_older_than_join_node_ends_the_launcher_saying_to_upgrade_it(
    tmp_path: Path, job_id: str
) -> None:
    token = tmp_path / "token"
    write_token(token)
    script = tmp_path / "w.py"
    script.write_text(WAITS)
    with daemon_without_rendezvous() as endpoint:
        run = run_launcher(
            [*launcher_cmd(1, 0, 1, endpoint=endpoint, token_file=token, job=job_id),
             "--max-restarts", "3", str(script)],
            timeout=60,
        )  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert "gave up after 0 restarts (max_restarts=3); 1 failure" in run.stderr, run.stderr
    assert f"joining failed: VersionMismatch: JoinNode on rendezvousd at {endpoint}" in run.stderr
    assert f"the daemon at {endpoint} predates JoinNode" in run.stderr, run.stderr
    assert "upgrade the daemon first" in run.stderr, run.stderr
    assert "no restart can change that" in run.stderr, run.stderr
    assert "raise --max-restarts" not in run.stderr, run.stderr


# A worker joining by rank (no agent) whose ring speaks the wire version in argv[1].
PER_RANK_WORKER = """
import sys
from rendezvousd.trainer.comm import ring_wire
ring_wire._MAGIC = sys.argv[1].encode()
from rendezvousd.trainer.distributed import init_distributed
with init_distributed():
    pass
"""


def test_a_ring_of_another_version_is_the_cause_the_daemon_records_not_retried(
    daemon: DaemonProcess, job_id: str, tmp_path: Path
) -> None:
    """Workers joining by rank meet in the ring's handshake, which names the other
    version; that was retried as a transient setup failure (every rank aborting with
    "communicator setup failed transiently") and then recorded as nothing better than
    that abort or "heartbeat stream closed", the version only in a traceback."""
    from rendezvousd.client import RendezvousClient

    script = tmp_path / "w.py"
    script.write_text(PER_RANK_WORKER)
    env = {
        **os.environ,
        "RENDEZVOUSD_ENDPOINT": daemon.endpoint,
        "RENDEZVOUSD_TOKEN_FILE": str(daemon.token_file),
        "RENDEZVOUSD_JOB_ID": job_id,
        "RENDEZVOUSD_NUM_NODES": "2",
        "RENDEZVOUSD_GPUS_PER_NODE": "1",
        "RENDEZVOUSD_LOCAL_RANK": "0",
        "RENDEZVOUSD_RETRIES": "2",
    }
    workers = [
        subprocess.Popen(
            [sys.executable, str(script), magic],
            env={**env, "RENDEZVOUSD_NODE_RANK": str(node)},
            stderr=subprocess.PIPE,
            text=True,
        )
        for node, magic in enumerate(["RDVRING3", "RDVRING4"])
    ]
    errors = stderr_of_all(workers)
    assert all(w.returncode != 0 for w in workers), errors
    assert all("PeerVersionMismatch" in e for e in errors), errors
    with RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as probe:
        job = probe.get_job()
    # Not retried: a fresh generation meets the same peer of another version.
    assert job.summary.generation == 1, job
    assert job.failed, job
    cause = job.failed[0].cause
    assert cause.startswith("PeerVersionMismatch: rank "), cause
    assert "runs another version of rendezvousd (wire version" in cause, cause
    assert "every node of a job must run the same rendezvousd version" in cause, cause


def test_nodes_of_two_builds_of_one_release_train_together(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path
) -> None:
    """A build id is said, never compared (h139 F3): only the ring's wire version
    refuses a node. A node whose rendezvousd says another build of this release joins
    beside this checkout's, the job forms and both finish; each says its own build."""
    import importlib.metadata

    from rendezvousd.common.version import installed_version
    from rendezvousd.trainer.comm.ring_wire import WIRE_VERSION

    d = start_daemon()
    script = tmp_path / "w.py"
    script.write_text(WAITS)
    flags = ["--max-restarts", "0", "--join-timeout-s", "60", str(script)]
    other = f"{importlib.metadata.version('rendezvousd')}+gdeadbee.dirty"
    assert other != installed_version()
    node0 = launcher_cmd(2, 0, 2, endpoint=d.endpoint, token_file=d.token_file, job=job_id)
    node1 = launcher_cmd(2, 1, 2, endpoint=d.endpoint, token_file=d.token_file, job=job_id)
    node1 = [sys.executable, *OTHER_BUILD, other, *node1[3:]]
    first = subprocess.Popen([*node0, *flags], stderr=subprocess.PIPE, text=True)
    try:
        second = run_launcher([*node1, *flags], timeout=120)
        _, first_err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate(timeout=30)
    assert (first.returncode, second.returncode) == (0, 0), first_err + second.stderr
    for err, said in ((first_err, installed_version()), (second.stderr, other)):
        assert "VersionMismatch" not in err, err
        start = f"rendezvous-run: rendezvousd {said} (ring wire version {WIRE_VERSION})"
        assert start in unstamped(err), err
    assert "VERSION_MISMATCH" not in d.log()
