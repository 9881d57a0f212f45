"""rendezvous-run relays its workers' daemon calls (``client.relay``): two nodes of two
workers each exchange keys and meet in a barrier; every call went over the agent
channel to the agent's call stream, none on a stream of the worker's own, and the
daemon read the nodes' calls as CallBatches messages."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

from rendezvousd.client._calls import diagnosis_share
from rendezvousd.client._session import SLACK_S
from tests.support import ROOT, WORKERS, DaemonProcess, launcher_cmd, scrape, stuck_agent_run

WORKER = str(WORKERS / "relay_worker.py")


def test_workers_calls_go_through_their_node_agent(daemon: DaemonProcess, job_id: str) -> None:
    before = scrape(daemon.metrics_url).get("rendezvousd_calls_per_message_sum", 0.0)
    nodes = [
        subprocess.Popen(
            [
                *launcher_cmd(2, node, 2, endpoint=daemon.endpoint, token_file=daemon.token_file),
                "--job-id",
                job_id,
                "--max-restarts",
                "0",
                WORKER,
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in range(2)
    ]
    outs = [n.communicate(timeout=120) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], [err for _, err in outs]
    lines = [json.loads(x) for out, _ in outs for x in out.splitlines() if x.startswith("{")]
    relayed = sorted((x for x in lines if x["event"] == "relayed"), key=lambda x: x["rank"])
    assert [x["rank"] for x in relayed] == [0, 1, 2, 3]
    assert [x["peer_value"] for x in relayed] == ["10", "20", "30", "0"]
    for x in relayed:
        assert x["transport"] == "RelayedCalls" and not x["unary"], x
        assert x["route"] == "relayed", x
        # Its own three calls, and the ring's set-up before them, all relayed.
        assert x["sent"]["KvSet"] >= 1 and x["sent"]["Barrier"] >= 1, x
    calls = scrape(daemon.metrics_url)["rendezvousd_calls_per_message_sum"] - before
    assert calls >= sum(sum(x["sent"].values()) for x in relayed)


def test_a_worker_that_reads_no_replies_is_failed_not_waited_for(
    daemon: DaemonProcess, job_id: str
) -> None:
    """A worker floods relayed calls and reads no reply: its replies queue on a thread
    of its own (the node's call stream goes on), and past MAX_UNSENT_REPLIES the agent
    fails it with that cause; stopping it does not hang on its full channel."""
    cmd = launcher_cmd(1, 0, 1, endpoint=daemon.endpoint, token_file=daemon.token_file)
    done = subprocess.run(
        [*cmd, "--job-id", job_id, "--max-restarts", "0", str(WORKERS / "flood_worker.py")],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=90,
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert "it stopped reading its agent channel: 1024 replies" in done.stderr, done.stderr


def _one_node(daemon: DaemonProcess, job_id: str) -> Callable[[list[str]], subprocess.Popen[str]]:
    """Starts a one-node, one-worker rendezvous-run of ``worker`` (argv), in a session
    of its own, its output piped."""
    cmd = launcher_cmd(1, 0, 1, endpoint=daemon.endpoint, token_file=daemon.token_file)

    def start(worker: list[str]) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [*cmd, "--job-id", job_id, "--max-restarts", "0", *worker],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    return start


def test_a_worker_whose_agent_is_stopped_hears_the_daemons_verdict(
    daemon: DaemonProcess, job_id: str, tmp_path: Path
) -> None:
    """The node agent is stopped (SIGSTOP) under a worker's relayed call. The call goes
    unanswered through the agent; at its deadline (its 3 s wait plus the SDK's 5 s
    slack) the worker makes it on its own channel, where the daemon, which has heard
    no heartbeat from the node for its timeout (3 s here), names that as the cause
    (had the daemon not noticed yet, the re-made call's wait ends with the verdict).
    Before, the retry went through the stopped agent too, and after twice the deadline
    the worker blamed the daemon: "is the daemon running and reachable?"."""
    answered = stuck_agent_run(
        _one_node(daemon, job_id),
        tmp_path,
    )
    # The stall is told at the wire's deadline: the call's (3 s + the SDK's 5 s), less
    # the share kept for the look at why no answer came.
    limit = 3.0 + SLACK_S
    assert limit - diagnosis_share(limit) <= answered["took"] <= 25.0, answered


def test_a_worker_whose_stopped_agent_leaves_its_channel_full_still_hears_the_verdict(
    daemon: DaemonProcess, job_id: str, tmp_path: Path
) -> None:
    """The same, with the worker's channel full: it was saving a state far larger than
    the socket when the agent stopped, so its call's frame can be neither queued nor
    sent. After CALL_SEND_S (5 s) the call goes on the worker's own channel and hears
    the daemon's verdict. Before, the call waited for the stopped agent for ever."""
    answered = stuck_agent_run(
        _one_node(daemon, job_id),
        tmp_path,
        "fill",
    )
    assert 5.0 <= answered["took"] <= 20.0, answered
