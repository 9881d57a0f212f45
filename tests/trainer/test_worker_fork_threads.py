"""A training script that forks and runs threads (the h157 review): two ranks of real
worker processes and a real daemon, started per rank (srun's way) and by
rendezvous-run. The worker is ``tests/workers/fork_thread_worker.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client import RendezvousClient
from tests.support import WORKERS, DaemonProcess, launcher_cmd, rest_of_stdout

WORKER = str(WORKERS / "fork_thread_worker.py")
TRANSPORTS = pytest.mark.parametrize(
    "shared_memory", [True, False], ids=["shared-memory", "tcp-ring"]
)


def _env(d: DaemonProcess, job: str, local: int, shared_memory: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RENDEZVOUSD_", "GRPC_"))}
    return {
        **env,
        "RENDEZVOUSD_ENDPOINT": d.endpoint,
        "RENDEZVOUSD_TOKEN_FILE": str(d.token_file),
        "RENDEZVOUSD_JOB_ID": job,
        "RENDEZVOUSD_NUM_NODES": "1",
        "RENDEZVOUSD_GPUS_PER_NODE": "2",
        "RENDEZVOUSD_NODE_RANK": "0",
        "RENDEZVOUSD_LOCAL_RANK": str(local),
        "RENDEZVOUSD_BACKEND": "cpu",
        "RENDEZVOUSD_CPU_SHARED_MEMORY": str(shared_memory).lower(),
        # Bounds a test whose ring was broken into a wait (the default is 300 s).
        "RENDEZVOUSD_COLLECTIVE_TIMEOUT_S": "20",
        "RENDEZVOUSD_JOIN_TIMEOUT_S": "60",
    }


def _per_rank(
    d: DaemonProcess, job: str, mode: str, tmp_path: Path, shared_memory: bool = False, **extra: str
) -> tuple[list[list[dict[str, Any]]], list[str], list[int]]:
    """Both ranks of ``mode`` to their end: each one's event lines, stderr, exit code."""
    procs, logs = [], []
    for local in (0, 1):
        log = tmp_path / f"rank{local}.err"
        logs.append(log)
        with log.open("w") as err:
            procs.append(
                subprocess.Popen(
                    [sys.executable, WORKER, mode],
                    env={**_env(d, job, local, shared_memory), **extra},
                    stdout=subprocess.PIPE,
                    stderr=err,
                    text=True,
                )
            )
    try:
        outs = [rest_of_stdout(p, 120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
    events = [
        [json.loads(line) for line in out.splitlines() if line.startswith("{")] for out in outs
    ]
    return events, [log.read_text() for log in logs], [p.returncode for p in procs]


def _of(events: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == name]


def _job_state(d: DaemonProcess, job: str) -> Any:
    with RendezvousClient(d.endpoint, job, token=d.token) as probe:
        return probe.get_job()


@TRANSPORTS
def test_two_threads_collectives_at_once_are_refused_and_stop_every_rank(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path, shared_memory: bool
) -> None:
    """Ranks pair collectives by start order and compare only op, type and size: two
    threads' all-reduces of 1.0 and 7.0 came back as 8.0 (198 of 400), no rank raised.
    Now the second thread's entry is refused and the communicator aborted, on every
    rank, so no sum is mixed past the collectives already in flight."""
    d = start_daemon()
    events, errs, _ = _per_rank(d, job_id, "threads", tmp_path, shared_memory)
    sums = [_of(e, "sums") for e in events]
    assert all(len(s) == 1 for s in sums), (events, errs)
    refused = []
    for (line,) in sums:
        assert line["alive"] == [], line
        # At most the collectives in flight when the first overlap was refused.
        assert len(line["wrong"]) <= 2, line
        assert line["errors"], line  # every rank stops, not one thread of one rank
        refused += [e for e in line["errors"] if "is in flight on this communicator" in e]
    said = [e for e in refused if e.startswith("CollectiveArgumentError: rank ")]
    assert said, sums  # the late thread's own; the rest read it through the abort
    assert "Make every collective from one thread" in said[0], said
    assert [e["transport"] for ev in events for e in _of(ev, "joined")] == [
        "shared-memory" if shared_memory else "tcp-ring"
    ] * 2


@pytest.mark.parametrize(
    ("mode", "shared_memory"),
    [("fork-exit", False), ("fork-exit", True), ("fork-raise", False)],
    ids=["sys.exit-tcp-ring", "sys.exit-shared-memory", "raise-tcp-ring"],
)
def test_a_forked_child_leaving_the_with_block_leaves_the_parents_job_alone(
    start_daemon: Callable[..., DaemonProcess],
    job_id: str,
    tmp_path: Path,
    mode: str,
    shared_memory: bool,
) -> None:
    """The child's close sent a FAIL frame and shut down the ring sockets it shares
    with its parent: both ranks failed, the healthy rank 0 blamed ("rank 1 gave up on
    this rank"). Now the child only drops its descriptors; the job trains on and ends."""
    d = start_daemon()
    events, errs, codes = _per_rank(d, job_id, mode, tmp_path, shared_memory)
    assert codes == [0, 0], (events, errs)
    assert [len(_of(e, "trained")) for e in events] == [1, 1], (events, errs)
    (forked,) = _of(events[1], "forked")
    assert forked["status"] == (0 if mode == "fork-exit" else 1 << 8), forked
    assert _job_state(d, job_id).summary.state == pb.JOB_STATE_ENDED, d.log()[-3000:]


@pytest.mark.parametrize("verbosity", [None, "INFO"], ids=["default", "INFO"])
def test_a_per_rank_worker_forks_without_grpcs_info_line_unless_asked(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path, verbosity: str | None
) -> None:
    """gRPC logged "fork_posix.cc ... skipping fork() handlers" at INFO on every fork of a
    worker started without rendezvous-run (every DataLoader worker, every epoch). The
    trainer defaults GRPC_VERBOSITY to ERROR, as rendezvous-run does; a user's stands."""
    d = start_daemon()
    extra = {} if verbosity is None else {"GRPC_VERBOSITY": verbosity}
    events, errs, codes = _per_rank(d, job_id, "fork-exit", tmp_path, **extra)
    assert codes == [0, 0], (events, errs)
    assert ("fork_posix" in errs[1]) is (verbosity == "INFO"), errs[1][-3000:]


@TRANSPORTS
def test_a_forked_childs_collective_is_refused_in_the_sdks_words(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path, shared_memory: bool
) -> None:
    """The child all-reduced on the parent's sockets: parent and child read each other's
    frames (an array read as a header, the healthy rank 0 blamed) or it waited out the
    collective timeout. Now it is refused at entry, and the parent trains on."""
    d = start_daemon()
    events, errs, codes = _per_rank(d, job_id, "fork-use", tmp_path, shared_memory)
    (child,) = _of(events[1], "child")
    said = child["said"]
    assert said.startswith("CommunicatorError: rank 1: all_reduce() refused: "), said
    assert "is a fork of it" in said and "do not survive a fork" in said, said
    assert codes == [0, 0], (events, errs)
    assert [len(_of(e, "trained")) for e in events] == [1, 1], (events, errs)


def test_a_second_init_distributed_in_one_process_says_this_process_holds_the_rank(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path
) -> None:
    """It read srun advice ("another run of job ... give this run a job id of its
    own"): the rank is held by this very process's open context."""
    d = start_daemon()
    events, errs, codes = _per_rank(d, job_id, "twice", tmp_path)
    (second,) = _of(events[1], "second")
    said = second["said"]
    assert said.startswith("DuplicateRank: init_distributed() refused: this process already "), said
    assert f"holds rank 1 of job {job_id!r} (an open context" in said, said
    assert second["changed"] == ["message"], second  # the daemon's answer kept whole
    assert "job id of its own" not in said, said
    assert codes == [0, 0], (events, errs)
    assert [len(_of(e, "trained")) for e in events] == [1, 1], (events, errs)


def test_under_rendezvous_run_a_forked_child_leaving_the_block_keeps_the_agent_channel(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path
) -> None:
    """The child's close also shut the worker's channel to its node agent: the parent
    was aborted ("the node agent closed the channel"), and the run's root cause named
    rank 1. Now the run ends with both ranks trained, and the child's own frame to the
    agent is refused."""
    d = start_daemon()
    cmd = launcher_cmd(1, 0, 2, endpoint=d.endpoint, token_file=d.token_file, job=job_id)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RENDEZVOUSD_")}
    run = subprocess.run(
        [*cmd, "--backend", "cpu", "--max-restarts", "0", WORKER, "fork-exit"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "RENDEZVOUSD_COLLECTIVE_TIMEOUT_S": "20"},
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(_of(events, "trained")) == 2, (events, run.stderr[-3000:])
    assert "root cause" not in run.stderr, run.stderr[-3000:]
    # Its frames would be cut into the worker's own on the channel they share.
    (child,) = _of(events, "child")
    assert child["said"].startswith("AgentChannelError: progress refused: this worker's "), child
    assert "is a fork of it" in child["said"], child
