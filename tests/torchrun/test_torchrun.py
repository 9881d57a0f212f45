"""``torchrun --rdzv-backend rendezvousd``: real torchrun agents, a real daemon on
127.0.0.1 (the same across network hosts: tests/multihost/test_torchrun.py). Their
workers train with gloo (torch_worker.py) where a test asserts what torch trains in
the world formed; where it asserts the rendezvous (ranks, worlds, restarts, the agents'
words and exit codes), they are ENV_WORKER's, which do not import torch."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rendezvousd.client import RendezvousClient
from rendezvousd.trainer.torchrun.store_port import ephemeral_range
from tests.support import (
    ENV_WORKER,
    WORKERS,
    ClosedDoor,
    DaemonProcess,
    Pki,
    StatefulDaemon,
    Torchrun,
    descendants,
    free_port,
    parallel,
    scrape,
    spawn_daemon,
    standby_replaces_a_killed_node,
    survivors_trained_on,
    three_nodes_stuck_at_step_two,
    torch_steps,
    wait_for,
    write_token,
)

pytestmark = pytest.mark.slow


#: What the agents, all on this machine, are named by: its hostname, not their address
#: (127.0.0.1), as rendezvous-run's nodes are.
HOST = socket.gethostname()
HOST_RE = re.escape(HOST)

#: The handler's CLOSE_WAIT_S (its module imports torch, which this process lacks).
CLOSE_WAIT_S = 35.0


def _job_state(d: DaemonProcess, job: str) -> str:
    with RendezvousClient(d.endpoint, job, token=d.token) as probe:
        from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb

        return str(pb.JobState.Name(probe.get_job().summary.state))


def _nodes_waiting(d: DaemonProcess, job: str) -> int:
    with RendezvousClient(d.endpoint, job, token=d.token) as probe:
        return probe.get_job().nodes_waiting


def _nodes_joined(d: DaemonProcess, job: str) -> int:
    """Nodes in the job's forming generation; 0 before the job exists."""
    from rendezvousd.client import NotFound

    try:
        return _nodes_waiting(d, job)
    except NotFound:
        return 0


def _rpcs(d: DaemonProcess, method: str) -> float:
    assert d.metrics_url is not None
    return sum(
        v
        for k, v in scrape(d.metrics_url).items()
        if k.startswith("rendezvousd_rpc_duration_seconds_count") and f'"{method}"' in k
    )


def test_a_two_node_job_trains_with_one_join_per_agent(
    start_daemon: Callable[..., DaemonProcess],
    torchrun: Callable[..., Torchrun],
    tmp_path: Path,
    job_id: str,
) -> None:
    d = start_daemon("--metrics-listen", "127.0.0.1:0")
    log = tmp_path / "steps.jsonl"
    typo = {"RENDEZVOUSD_LAST_CALL_TIMEOUTS": "1"}  # said, and ignored: no harm done
    agents = [
        torchrun(d, job_id, "2", "--steps", "5", "--step-log", str(log), env=env)
        for env in (typo, None)
    ]
    for a in agents:
        assert a.wait(120) == 0, a.stderr()[-3000:]
    said = (
        "rendezvousd: $RENDEZVOUSD_LAST_CALL_TIMEOUTS is set, but no rendezvousd program "
        "reads it: did you mean RENDEZVOUSD_LAST_CALL_TIMEOUT? (ignored)"
    )
    assert agents[0].stderr().count(said) == 1 and said not in agents[1].stderr()
    steps = torch_steps(log)
    assert {s["rank"] for s in steps} == {0, 1, 2, 3}
    assert {s["world"] for s in steps} == {4}
    assert max(s["step"] for s in steps) == 5
    # The workers' TCPStore listened outside the ephemeral range (store_port), where no
    # outgoing connection could take its port before it listened.
    low, high = ephemeral_range()
    assert all(not low <= s["master_port"] <= high for s in steps), steps
    # One JoinNode per agent, plus node 0's repeat carrying the id the protocol asks for.
    assert _rpcs(d, "JoinNode") == 3
    # Both agents left after their workers succeeded: a clean end, nobody blamed.
    assert _job_state(d, job_id) == "JOB_STATE_ENDED"
    # torchrun's own rdzv keys (rank, and timeout from --rdzv-timeout) are no user's:
    # nothing is said of them (a first version warned of timeout on every launch).
    assert all("not read by the rendezvousd backend" not in a.stderr() for a in agents)


def test_a_killed_peer_node_restarts_the_survivors_from_the_daemons_push(
    start_daemon: Callable[..., DaemonProcess],
    torchrun: Callable[..., Torchrun],
    tmp_path: Path,
    job_id: str,
) -> None:
    """Workers of the 3-node world hang after step 2, as if stuck in a collective: only
    their agent can get them out. torch counts only local failures, so what restarts
    the survivors is num_nodes_waiting() > 0 after the daemon's push, and it spends
    none of their --max-restarts 1 (their workers' restart count stays 0; with none
    left they stop instead: the test below). --nnodes 2:3 lets the two survivors
    re-form without the dead node."""
    d = start_daemon()
    log = tmp_path / "steps.jsonl"
    agents = three_nodes_stuck_at_step_two(torchrun, d, job_id, log)
    killed_at = time.time()
    agents[2].kill()
    after = survivors_trained_on(agents, log)
    # The survivors heard the loss from the daemon, naming it: a node (each agent is a
    # node of one rank to the daemon, whose "lost rank 1" read as a worker's rank), and
    # what the next round waits for.
    for a in agents[:2]:
        err = a.stderr()
        assert re.search(rf"round 1 failed: lost node [0-2] on {HOST_RE} \(", err), err[-2000:]
        told = "forms (--nnodes 2:3) once the nodes left re-join (at least 2), not for the lost"
        assert told in err and "waits up to 600 s (join_timeout)" in err, err[-2000:]
    first = min(s["t"] for s in after)
    print(f"kill -> survivors training again: {first - killed_at:.2f} s")


def _two_nodes_at_step_two(
    torchrun: Callable[..., Torchrun],
    d: DaemonProcess,
    job: str,
    log: Path,
    nnodes: str,
    max_restarts: int,
) -> list[Torchrun]:
    """Two agents of one worker each, whose 2-rank worlds hang after step 2, as if stuck
    in a collective with a dead peer: only the daemon's push can move them. A
    join_timeout of 60 s: a survivor waiting for a replacement shows as one. Workers
    without torch (ENV_WORKER): what the callers assert is the agents', and a hung
    worker does what a stuck collective would."""
    worker = ["--steps", "4", "--step-log", str(log), "--hang-after", "2", "--hang-world", "2"]
    conf = f"token_file={d.token_file},join_timeout=60"
    agents = [
        torchrun(
            d,
            job,
            nnodes,
            *worker,
            nproc=1,
            conf=conf,
            max_restarts=max_restarts,
            script=ENV_WORKER,
        )
        for _ in range(2)
    ]
    wait_for(
        "both ranks at step 2",
        lambda: len({s["rank"] for s in torch_steps(log) if s["step"] == 2}) == 2,
        timeout=120,
    )
    return agents


def _stops_when_its_peer_dies(survivor: Torchrun, victim: Torchrun, log: Path) -> str:
    """Kills ``victim`` (agent and workers): ``survivor`` must stop its workers and exit
    non-zero within seconds, with torch's RendezvousError naming the lost node, and
    re-form nothing. Returns that error's line."""
    mine = [s["pid"] for s in torch_steps(log) if s["pid"] in descendants(survivor.proc.pid)]
    assert mine, torch_steps(log)
    steps_before = len(torch_steps(log))
    killed_at = time.monotonic()
    victim.kill()
    try:
        code = survivor.wait(15)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the survivor still runs 15 s after the kill:\n{survivor.stderr()[-3000:]}")
    stopped_after = time.monotonic() - killed_at
    err = survivor.stderr()
    assert code != 0, err[-3000:]
    raised = [ln for ln in err.splitlines() if ln.startswith("torch.distributed.elastic")]
    assert raised and raised[-1].startswith(
        "torch.distributed.elastic.rendezvous.api.RendezvousError: "
    ), err[-3000:]
    assert re.search(rf"lost node [01] on {HOST_RE} \(.+\)", raised[-1]), raised[-1]
    # The handler found torch's agent (the lookup a torch upgrade could break).
    assert "cannot read torch's remaining restarts" not in err, err[-3000:]
    # Stopped, not re-formed: no step since the kill, and no worker left behind.
    assert len(torch_steps(log)) == steps_before
    assert not [pid for pid in mine if Path(f"/proc/{pid}").exists()], mine
    print(f"kill -> survivor exited ({code}): {stopped_after:.2f} s")
    return raised[-1]


@pytest.mark.parametrize("nnodes", ["2", "1:2"])
def test_a_survivor_with_no_restarts_left_stops_when_a_peer_dies(
    start_daemon: Callable[..., DaemonProcess],
    torchrun: Callable[..., Torchrun],
    tmp_path: Path,
    job_id: str,
    nnodes: str,
) -> None:
    """--max-restarts 0 is "no restart": the survivor of a killed peer stops its
    workers and exits non-zero within seconds, naming the lost node and why it stops,
    as stock c10d's survivors do (their collectives break). It used to restart its
    workers into the next round and wait join_timeout for the lost node's replacement
    (fixed size), or re-form a world of one (elastic, 1:2)."""
    d = start_daemon()
    log = tmp_path / "steps.jsonl"
    survivor, victim = _two_nodes_at_step_two(torchrun, d, job_id, log, nnodes, 0)
    raised = _stops_when_its_peer_dies(survivor, victim, log)
    assert "no restarts left (--max-restarts 0)" in raised, raised


def test_a_survivor_that_used_its_restarts_stops_when_a_peer_dies(
    start_daemon: Callable[..., DaemonProcess],
    torchrun: Callable[..., Torchrun],
    tmp_path: Path,
    job_id: str,
) -> None:
    """--max-restarts 1, which the survivor spends on its own worker's failure; the
    other agent, restarted by the daemon's push, spends none and re-forms as before.
    When that peer is killed next, the survivor has none left: it stops, saying so."""
    d = start_daemon()
    log = tmp_path / "steps.jsonl"
    survivor, victim = _two_nodes_at_step_two(torchrun, d, job_id, log, "2", 1)
    first = {s["pid"] for s in torch_steps(log)}
    (worker,) = [pid for pid in first if pid in descendants(survivor.proc.pid)]
    os.kill(worker, signal.SIGKILL)
    wait_for(
        "both ranks of the second round at step 2",
        lambda: (
            len({s["rank"] for s in torch_steps(log) if s["pid"] not in first and s["step"] == 2})
            == 2
        ),
        timeout=120,
    )
    # TORCHELASTIC_RESTART_COUNT: the survivor spent its restart, the push cost its
    # peer none.
    second = [s for s in torch_steps(log) if s["pid"] not in first]
    mine = {s["pid"] for s in second} & set(descendants(survivor.proc.pid))
    assert {s["restart"] for s in second if s["pid"] in mine} == {1}, second
    assert {s["restart"] for s in second if s["pid"] not in mine} == {0}, second
    raised = _stops_when_its_peer_dies(survivor, victim, log)
    assert "no restarts left (--max-restarts 1, all used)" in raised, raised


def _three_nodes_at_step_two(
    torchrun: Callable[..., Torchrun],
    d: DaemonProcess,
    job: str,
    log: Path,
    nnodes: str,
    restarts: tuple[int, int, int],
    nproc: tuple[int, int, int] = (1, 1, 1),
) -> list[Torchrun]:
    """Three agents whose first world hangs after step 2, as if stuck in a
    collective: only the daemon's push moves them. join_timeout 40 s: a survivor
    still waiting for the nodes it lacks shows as one. Workers without torch, as
    in ``_two_nodes_at_step_two``."""
    world = sum(nproc)
    worker = ["--steps", "4", "--step-log", str(log), "--hang-after", "2", "--hang-world"]
    conf = f"token_file={d.token_file},join_timeout=40"
    agents = [
        torchrun(
            d,
            job,
            nnodes,
            *worker,
            str(world),
            nproc=n,
            conf=conf,
            max_restarts=r,
            script=ENV_WORKER,
        )
        for n, r in zip(nproc, restarts, strict=True)
    ]
    wait_for(
        f"all {world} ranks at step 2",
        lambda: len({s["rank"] for s in torch_steps(log) if s["step"] == 2}) == world,
        timeout=120,
    )
    return agents


def test_a_survivor_waiting_for_a_replacement_outlives_a_second_loss_and_names_the_missing(
    start_daemon: Callable[..., DaemonProcess],
    torchrun: Callable[..., Torchrun],
    tmp_path: Path,
    job_id: str,
) -> None:
    """--nnodes 3: B is killed; A and C restart their workers and wait in the next
    round's JoinNode for a replacement; then C is killed too. That round failed on
    C's cancelled JoinNode and A, with a restart left, exited 1 ("generation 2
    failed ... restart the job"); now it joins the next round for what is left of
    join_timeout, says which nodes it waits for, and trains with two replacements."""
    d = start_daemon("--heartbeat-timeout-s", "4")
    log = tmp_path / "steps.jsonl"
    # C runs two workers: the first world (4 ranks) hangs, the replacements' (3) not.
    a, b, c = _three_nodes_at_step_two(torchrun, d, job_id, log, "3", (1, 1, 1), (1, 1, 2))
    b.kill()
    wait_for("A to restart into round 2", lambda: "round 1 failed" in a.stderr(), 30)
    wait_for("A and C to wait in round 2", lambda: _nodes_waiting(d, job_id) == 2, 30)
    c.kill()
    wait_for("A to re-join", lambda: a.proc.poll() is not None or "failed while" in a.stderr(), 30)
    assert a.proc.poll() is None, a.stderr()[-3000:]
    said = f"generation 2 failed while it formed: lost the node joining from {HOST} in round 2"
    assert said in a.stderr(), a.stderr()[-3000:]
    # The waiting note names both nodes the round lacks (the daemon only counts them).
    missing = "Lost since the job last formed: node"
    wait_for("A to say what it waits for", lambda: missing in a.stderr(), 30)
    note = next(ln for ln in a.stderr().splitlines() if missing in ln)
    assert "in round 1 (node agent's heartbeat stream closed)" in note, note
    assert f"the node joining from {HOST} in round 2 (its JoinNode was cancelled" in note, note
    assert "start torchrun agents of this --rdzv-id in their places" in note, note
    first = {s["pid"] for s in torch_steps(log)}
    worker = ["--steps", "4", "--step-log", str(log)]
    conf = f"token_file={d.token_file},join_timeout=40"
    new = [
        torchrun(d, job_id, "3", *worker, nproc=1, conf=conf, script=ENV_WORKER) for _ in range(2)
    ]
    for agent in (a, *new):
        assert agent.wait(90) == 0, agent.stderr()[-3000:]
    after = [s for s in torch_steps(log) if s["pid"] not in first]
    assert {s["world"] for s in after} == {3} and max(s["step"] for s in after) == 4


@pytest.mark.parametrize("nnodes", ["3", "2:3"])
def test_an_agent_out_of_restarts_closes_a_rendezvous_its_survivor_cannot_form(
    start_daemon: Callable[..., DaemonProcess],
    torchrun: Callable[..., Torchrun],
    tmp_path: Path,
    job_id: str,
    nnodes: str,
) -> None:
    """B is killed; C has no restarts left and stops; A has one and re-joins. A
    then waited join_timeout for the two nodes missing (40 s here, 600 by default);
    now C closes the rendezvous as it stops, as c10d's shutdown() does and as the
    gave-up path does when the job cannot go on without its node: A ends within
    seconds with torch's RendezvousClosedError naming C's stop."""
    d = start_daemon("--heartbeat-timeout-s", "4")
    log = tmp_path / "steps.jsonl"
    a, b, c = _three_nodes_at_step_two(torchrun, d, job_id, log, nnodes, (1, 1, 0))
    b.kill()
    try:
        codes = [c.wait(20), a.wait(20)]
    except subprocess.TimeoutExpired:
        pytest.fail(f"an agent still runs 20 s after the kill:\n{a.stderr()[-3000:]}")
    assert codes[0] != 0 and codes[1] != 0, codes
    assert "no restarts left (--max-restarts 0)" in c.stderr(), c.stderr()[-3000:]
    assert "closed the rendezvous: the other nodes cannot form" in c.stderr(), c.stderr()[-3000:]
    raised = [ln for ln in a.stderr().splitlines() if ln.startswith("torch.distributed.elastic")]
    assert raised and raised[-1].startswith(
        "torch.distributed.elastic.rendezvous.api.RendezvousClosedError: "
    ), a.stderr()[-3000:]
    assert f"torchrun's agent on {HOST} stopped: round 1 failed (lost node" in raised[-1]
    bounds = nnodes if ":" in nnodes else f"{nnodes}:{nnodes}"
    said = (
        f"no restarts left (--max-restarts 0); the job cannot go on without it (--nnodes {bounds}"
    )
    assert said in raised[-1], raised[-1]


def test_an_agent_out_of_restarts_closes_the_rendezvous_for_a_survivor_that_re_joins_late(
    start_daemon: Callable[..., DaemonProcess],
    torchrun: Callable[..., Torchrun],
    tmp_path: Path,
    job_id: str,
) -> None:
    """As above, but A is held (SIGSTOP) as B is killed, and let go only after C gave
    up watching for A's re-join (CLOSE_WAIT_S, 35 s) and exited. C could close only
    a round A had opened by re-joining: A re-joined after C was gone, opened the next
    round and waited its whole join_timeout (40 s here, 600 by default) there. Now C
    closes the failed round at the daemon as it stops, and A's late re-join is
    refused at once, naming C's stop."""
    d = start_daemon("--heartbeat-timeout-s", "4")
    log = tmp_path / "steps.jsonl"
    a, b, c = _three_nodes_at_step_two(torchrun, d, job_id, log, "3", (1, 1, 0))
    # Held before the loss, not after: A hears B's loss only once let go. (A round
    # that failed watches no survivor's heartbeat: holding A loses nothing of it.)
    os.kill(a.proc.pid, signal.SIGSTOP)
    try:
        b.kill()
        try:
            code = c.wait(CLOSE_WAIT_S + 30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"C still runs {CLOSE_WAIT_S + 30} s after the kill:\n{c.stderr()[-3000:]}")
        assert code != 0 and "no restarts left (--max-restarts 0)" in c.stderr(), c.stderr()[-3000:]
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
    try:
        code = a.wait(25)
    except subprocess.TimeoutExpired:
        pytest.fail(f"A still runs 25 s after it was let go:\n{a.stderr()[-3000:]}")
    raised = [ln for ln in a.stderr().splitlines() if ln.startswith("torch.distributed.elastic")]
    assert code != 0 and raised, a.stderr()[-3000:]
    assert raised[-1].startswith(
        "torch.distributed.elastic.rendezvous.api.RendezvousClosedError: "
    ), raised[-1]
    assert f"torchrun's agent on {HOST} stopped: round 1 failed (lost node" in raised[-1]
    assert "was closed" in raised[-1] and "after this node was launched" in raised[-1]
    assert "closed the rendezvous" in c.stderr(), c.stderr()[-3000:]


def test_an_agent_stopped_by_sigterm_tells_the_survivors_so(
    start_daemon: Callable[..., DaemonProcess],
    torchrun: Callable[..., Torchrun],
    tmp_path: Path,
    job_id: str,
) -> None:
    """A SIGTERM (a Kubernetes pod deleted; SIGINT, Ctrl-C, is the same path) raises
    torch's SignalException in the agent, whose launcher then skips shutdown(): the
    survivors used to hear "heartbeat stream closed" once it was gone. The handler's
    wrap of torch's signal handler tells them the signal, before its workers stop: the
    stopped agent's workers take STOP_DELAY_S to stop (a checkpoint on preemption), and
    the survivors hear it well within that (told at the agent's exit alone, as without
    the wrap, they heard it after)."""
    d = start_daemon()
    log = tmp_path / "steps.jsonl"
    slow = ((), (), ("--stop-delay", "5"))
    agents = three_nodes_stuck_at_step_two(torchrun, d, job_id, log, script=ENV_WORKER, extras=slow)
    told = f"(torchrun's agent on {HOST} was stopped by SIGTERM)"
    stopped = time.monotonic()
    os.kill(agents[2].proc.pid, signal.SIGTERM)  # the agent only: it stops its workers
    wait_for("a survivor to hear the signal", lambda: told in agents[0].stderr(), timeout=60)
    heard_s = time.monotonic() - stopped
    assert heard_s < 4.0, (heard_s, agents[0].stderr()[-2000:])  # its workers take 5 s
    assert agents[2].wait(60) != 0
    survivors_trained_on(agents, log)
    for a in agents[:2]:
        err = a.stderr()
        assert re.search(
            rf"round 1 failed: lost node [0-2] on {HOST_RE} " + re.escape(told), err
        ), err[-2000:]
        assert "heartbeat stream closed" not in err, err[-2000:]
    assert "was stopped by SIGTERM; telling the other nodes" in agents[2].stderr()


def test_an_agent_stopped_by_ctrl_c_gives_no_advice_to_take_part_as_it_stops(
    start_daemon: Callable[..., DaemonProcess],
    torchrun: Callable[..., Torchrun],
    tmp_path: Path,
    job_id: str,
) -> None:
    """Ctrl-C (SIGINT to the agent's process group; torch's workers have sessions of
    their own) of an agent whose workers take 4 s to stop, as a checkpoint on
    preemption does. The survivors open the next generation meanwhile, and the stopping
    agent's heartbeat, still beating for the round it left, heard the daemon's answer
    to a stale generation: it printed "... is at generation 2, the call named generation
    1; rejoin to take part in the current generation", advice to a process that exits (a
    torchrun user's review, 2 runs of 2). It says only that it was stopped. A heartbeat
    timeout of 3 s beats every second: 4 beats in the stop's 4 s (the default's 3.3 s
    cadence gave 8 s 2 beats)."""
    d = start_daemon("--heartbeat-timeout-s", "3")
    log = tmp_path / "steps.jsonl"
    slow = ((), (), ("--stop-delay", "4"))
    agents = three_nodes_stuck_at_step_two(torchrun, d, job_id, log, script=ENV_WORKER, extras=slow)
    signalled = time.monotonic()
    os.killpg(agents[2].proc.pid, signal.SIGINT)
    assert agents[2].wait(90) != 0
    print(f"SIGINT -> the agent exited: {time.monotonic() - signalled:.2f} s (workers: 4 s)")
    survivors_trained_on(agents, log)
    err = agents[2].stderr()
    assert "was stopped by SIGINT; telling the other nodes" in err, err[-3000:]
    assert "rejoin to take part" not in err and "the call named generation" not in err, err[-3000:]


def test_warm_workers_are_forked_from_the_nodes_server_after_a_kill(
    start_daemon: Callable[..., DaemonProcess],
    torchrun: Callable[..., Torchrun],
    torch_python: str,
    tmp_path: Path,
    job_id: str,
) -> None:
    """PYTHON_EXEC=rendezvous-python: every worker, the first round's and the restarted
    round's after a worker is SIGKILLed, starts with torch already imported (forked
    from the node's warm server), and the job trains to its end with the same exit
    code as with cold workers."""
    d = start_daemon()
    log = tmp_path / "steps.jsonl"
    shim = str(Path(torch_python).parent / "rendezvous-python")
    warm = {"PYTHON_EXEC": shim}
    worker = ("--steps", "30", "--step-log", str(log))
    agents = [torchrun(d, job_id, "2", *worker, max_restarts=1, env=warm) for _ in range(2)]
    wait_for(
        "all 4 ranks at step 2",
        lambda: len({s["rank"] for s in torch_steps(log) if s["step"] >= 2}) == 4,
        timeout=120,
    )
    first_round = {s["pid"] for s in torch_steps(log)}
    victim = next(s for s in torch_steps(log) if s["rank"] == 3)
    os.kill(victim["pid"], signal.SIGKILL)
    for a in agents:
        assert a.wait(120) == 0, a.stderr()[-3000:]
    steps = torch_steps(log)
    restarted = [s for s in steps if s["pid"] not in first_round]
    assert {s["rank"] for s in restarted} == {0, 1, 2, 3}
    assert max(s["step"] for s in restarted) == 30
    assert all(s["warm"] for s in steps), [s for s in steps if not s["warm"]][:3]
    for a in agents:
        assert "starting cold" not in a.stderr(), a.stderr()[-3000:]
    # The kill reached torchrun as the worker's own death (its exit code reports it).
    errs = [a.stderr() for a in agents]
    assert any("exitcode: -9" in e for e in errs), errs[0][-2000:] + errs[1][-2000:]


def _refused(
    torchrun: Callable[..., Torchrun], d: DaemonProcess | None, job: str, tmp: Path, **kw: Any
) -> str:
    """A one-node torchrun that must fail before training; its stderr."""
    agent = torchrun(d, job, "1", "--step-log", str(tmp / "steps"), **kw)
    assert agent.wait(60) != 0
    return agent.stderr()


def test_a_wrong_token_is_torchs_connection_error_with_our_message(
    start_daemon: Callable[..., DaemonProcess],
    torchrun: Callable[..., Torchrun],
    tmp_path: Path,
    job_id: str,
) -> None:
    d = start_daemon()
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-token\n")
    wrong.chmod(0o600)
    err = _refused(torchrun, d, job_id, tmp_path, conf=f"token_file={wrong}")
    assert "RendezvousConnectionError" in err, err[-3000:]
    assert f"rendezvousd at {d.endpoint}, job {job_id!r}" in err
    assert "not-the-token" not in err
    # In torchrun's words: it has no --token-file (found by review).
    assert (
        "check that the token (--rdzv-conf token_file=PATH, or RENDEZVOUSD_TOKEN_FILE / "
        "RENDEZVOUSD_TOKEN) and TLS settings" in err
    ), err[-3000:]
    assert "--token-file" not in err, err[-3000:]


def test_no_token_tells_torchrun_to_pass_rdzv_conf_token_file(
    start_daemon: Callable[..., DaemonProcess],
    torchrun: Callable[..., Torchrun],
    tmp_path: Path,
    job_id: str,
) -> None:
    """Said "pass token= or token_file=": the SDK's keywords, which torchrun has
    neither of (--rdzv-conf token= is refused as no key of the backend)."""
    d = start_daemon()
    err = _refused(torchrun, d, job_id, tmp_path, conf="connect_timeout=5")
    assert "RendezvousConnectionError" in err or "RendezvousError" in err, err[-3000:]
    assert (
        "no rendezvous token: pass --rdzv-conf token_file=PATH, or RENDEZVOUSD_TOKEN_FILE / "
        "RENDEZVOUSD_TOKEN" in err
    ), err[-3000:]
    assert "token= or token_file=" not in err, err[-3000:]


def test_a_tls_daemon_without_the_ca_tells_torchrun_to_pass_rdzv_conf_tls_ca(
    start_daemon: Callable[..., DaemonProcess],
    torchrun: Callable[..., Torchrun],
    pki: Pki,
    tmp_path: Path,
    job_id: str,
) -> None:
    """The SDK's advice names our CLI's --tls-ca, which torchrun does not have: the
    torchrun user reads the --rdzv-conf key (and the variable) instead, and the SDK's
    words are not shown above torch's error either."""
    d = start_daemon(*pki.serve_args())
    err = _refused(torchrun, d, job_id, tmp_path)
    raised = [ln for ln in err.splitlines() if "RendezvousConnectionError" in ln]
    assert raised, err[-3000:]
    said = "speaks TLS: pass --rdzv-conf tls_ca=PATH (or set RENDEZVOUSD_TLS_CA)"
    assert said in raised[-1], err[-3000:]
    assert "--tls-ca" not in err, err[-3000:]


def test_tls_ca_against_a_plaintext_daemon_is_said_without_grpcs_handshake_line(
    start_daemon: Callable[..., DaemonProcess],
    torchrun: Callable[..., Torchrun],
    pki: Pki,
    tmp_path: Path,
    job_id: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gRPC core logs each failed TLS handshake at INFO ("Handshake failed ...
    WRONG_VERSION_NUMBER"), around the agent's own error, which names the failure and
    what to do (a torchrun user's review). The handler quiets gRPC as rendezvous-run
    does (GRPC_VERBOSITY=ERROR, set before grpc is imported); a threshold the user set
    is kept."""
    monkeypatch.delenv("GRPC_VERBOSITY", raising=False)
    d = start_daemon()
    conf = f"token_file={d.token_file},tls_ca={pki.ca},connect_timeout=5"

    def run(**env: str) -> str:
        err = _refused(torchrun, d, job_id, tmp_path, conf=conf, env=env)
        assert "drop tls_ca from --rdzv-conf" in err, err[-3000:]
        return err

    assert "Handshake failed" not in (err := run()), err[-3000:]
    assert "Handshake failed" in (err := run(GRPC_VERBOSITY="INFO")), err[-3000:]


@pytest.mark.parametrize(
    ("conf", "said", "unsaid"),
    [
        ("join_timeout=soon", "--rdzv-conf join_timeout='soon' is invalid", None),
        # Beyond what any SDK call carries: it was refused mid-rendezvous instead.
        ("join_timeout=1e12", "join_timeout must be a number of seconds from 0.001", None),
        # torch's own keys (timeout, is_host) are ignored; a typo of ours is not one of them.
        (
            "is_host=1,join_timout=5",
            "--rdzv-conf join_timout: not a key of the rendezvousd backend (did you mean "
            "join_timeout?)",
            "is_host:",
        ),
    ],
    ids=["bad value", "past 30 days", "misspelt key"],
)
def test_a_bad_rdzv_conf_is_refused_naming_the_key(
    start_daemon: Callable[..., DaemonProcess],
    torchrun: Callable[..., Torchrun],
    tmp_path: Path,
    job_id: str,
    conf: str,
    said: str,
    unsaid: str | None,
) -> None:
    d = start_daemon()
    err = _refused(torchrun, d, job_id, tmp_path, conf=f"token_file={d.token_file},{conf}")
    assert said in err, err[-3000:]
    if unsaid is not None:  # the misspelt key's message lists ours, not torch's
        assert "join_timeout" in err and unsaid not in err, err[-3000:]


def test_an_unreachable_daemon_is_torchs_connection_error_naming_it(
    torchrun: Callable[..., Torchrun],
    tmp_path: Path,
    job_id: str,
) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    token = tmp_path / "token"
    token.write_text("t" * 32 + "\n")
    token.chmod(0o600)
    conf = f"token_file={token},connect_timeout=1"
    err = _refused(torchrun, None, job_id, tmp_path, endpoint=endpoint, conf=conf)
    assert "RendezvousConnectionError" in err, err[-3000:]
    assert endpoint in err


def test_a_daemon_name_that_never_resolves_is_torchs_connection_error_after_connect_timeout(
    torchrun: Callable[..., Torchrun], tmp_path: Path, job_id: str
) -> None:
    """A name that does not resolve (yet: a Kubernetes Service before its pod is ready)
    ended the agent at once with our AddressError's traceback, not torch's error, where
    a port nobody listens on is waited for within connect_timeout (found by review)."""
    token = tmp_path / "token"
    token.write_text("t" * 32 + "\n")
    token.chmod(0o600)
    conf = f"token_file={token},connect_timeout=3"
    started = time.monotonic()
    quick = {"RES_OPTIONS": "timeout:1 attempts:1"}  # each lookup within a second
    err = _refused(
        torchrun, None, job_id, tmp_path, endpoint="nowhere.invalid:29400", conf=conf, env=quick
    )
    took = time.monotonic() - started
    assert "RendezvousConnectionError" in err and "AddressError" not in err, err[-3000:]
    assert "'nowhere.invalid' does not resolve yet" in err, err[-3000:]
    assert "cannot resolve 'nowhere.invalid' (asked for 3 s)" in err, err[-3000:]
    assert took > 3.0, took


def test_an_agent_started_before_its_daemon_says_it_waits_and_trains_once_it_is_up(
    torchrun: Callable[..., Torchrun], tmp_path: Path, job_id: str
) -> None:
    """A daemon's pod ready after the workers' (found by review): the agent was silent
    for up to connect_timeout (30 s), which reads as a hang; now it says after 5 s."""
    port = free_port()
    token = tmp_path / "token"
    secret = write_token(token)
    log = tmp_path / "steps.jsonl"
    agent = torchrun(
        None,
        job_id,
        "1",
        "--steps",
        "2",
        "--step-log",
        str(log),
        nproc=1,
        endpoint=f"127.0.0.1:{port}",
        conf=f"token_file={token},connect_timeout=60",
        script=ENV_WORKER,
    )
    said = (
        f"rendezvousd: job {job_id!r}: rendezvousd at 127.0.0.1:{port} not reached after 5 s: "
        "nothing listens there (connection refused); still trying, for up to 60 s "
        "(connect_timeout)"
    )
    wait_for("the agent to say it waits", lambda: said in agent.stderr(), timeout=30)
    d = spawn_daemon(tmp_path, token=secret, listen=f"127.0.0.1:{port}")
    try:
        assert agent.wait(90) == 0, agent.stderr()[-3000:]
    finally:
        d.kill()
    assert max(s["step"] for s in torch_steps(log)) == 2
    assert agent.stderr().count("not reached after") == 1


def test_agents_that_disagree_on_nnodes_get_torchs_rendezvous_error_with_ours(
    start_daemon: Callable[..., DaemonProcess],
    torchrun: Callable[..., Torchrun],
    tmp_path: Path,
    job_id: str,
) -> None:
    """Each agent is a node of one rank to the daemon (torchrun numbers its workers
    itself): only --nnodes must match, and the refusal says so in torchrun's words,
    not the daemon's "same --nnodes and --nproc-per-node" (here they differ too)."""
    d = start_daemon()
    log = str(tmp_path / "s")
    first = torchrun(d, job_id, "3", "--step-log", log, nproc=1)
    wait_for("the first agent's node to park", lambda: _parked(d, job_id), timeout=30)
    second = torchrun(d, job_id, "2", "--step-log", log, nproc=2)
    for a in (first, second):
        assert a.wait(60) != 0
    for err in (first.stderr(), second.stderr()):
        raised = [ln for ln in err.splitlines() if "api.RendezvousError" in ln]
        assert raised, err[-3000:]
        said = (
            f"job {job_id!r} has torchrun agents that gave --nnodes 3 (hosts so far: {HOST}), "
            f"but the agent on host {HOST!a} gave --nnodes 2; every agent of a job must "
            "give the same --nnodes (MIN:MAX; --nproc-per-node may differ between nodes)"
        )
        assert said in raised[-1], err[-3000:]
        assert "gpus_per_node" not in err and "and --nproc-per-node" not in err, err[-3000:]


def test_agents_with_different_nproc_per_node_train_one_world(
    start_daemon: Callable[..., DaemonProcess],
    torchrun: Callable[..., Torchrun],
    tmp_path: Path,
    job_id: str,
) -> None:
    """What the refusal above says may differ does: 1 + 2 workers make a world of 3."""
    d = start_daemon()
    log = tmp_path / "steps.jsonl"
    agents = [
        torchrun(d, job_id, "2", "--steps", "2", "--step-log", str(log), nproc=n) for n in (1, 2)
    ]
    for a in agents:
        assert a.wait(120) == 0, a.stderr()[-3000:]
    steps = torch_steps(log)
    assert {s["rank"] for s in steps} == {0, 1, 2} and {s["world"] for s in steps} == {3}


def test_a_daemon_killed_mid_run_ends_the_agent_with_torchs_connection_error(
    start_daemon: Callable[..., DaemonProcess],
    torchrun: Callable[..., Torchrun],
    tmp_path: Path,
    job_id: str,
) -> None:
    """As when c10d's store dies: once the daemon is silent for its heartbeat window,
    num_nodes_waiting() raises and the agent exits, naming the daemon. It does not
    restart its workers into a join that waits out connect_timeout (30 s)."""
    d = start_daemon("--heartbeat-timeout-s", "3")
    log = tmp_path / "steps.jsonl"
    agent = torchrun(d, job_id, "1", "--steps", "5000", "--step-log", str(log), script=ENV_WORKER)
    wait_for("the one-node job to train", lambda: bool(torch_steps(log)), timeout=120)
    d.kill()
    assert agent.wait(90) != 0
    err = agent.stderr()
    raised = [ln for ln in err.splitlines() if ln.startswith("torch.distributed.elastic")]
    assert raised and raised[-1].startswith(
        "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError"
    ), err[-3000:]
    # The heartbeat's verdict, not a failed join of a restarted worker group.
    assert d.endpoint in raised[-1] and "has been unreachable for" in raised[-1], raised
    # What this agent does, not the SDK's "restart the job if it cannot finish" (found
    # by review: the agent had already stopped its workers).
    assert "This agent stops its workers and exits" in raised[-1], raised
    assert "if it cannot finish" not in raised[-1], raised


def test_an_agent_that_gives_up_closes_a_job_that_cannot_go_on_and_the_survivor_ends_now(
    start_daemon: Callable[..., DaemonProcess],
    torchrun: Callable[..., Torchrun],
    tmp_path: Path,
    job_id: str,
) -> None:
    """--nnodes 2, --max-restarts 0: a worker of the second agent is killed, so that
    agent gives up, and no node could take its place: it closes the rendezvous, as
    c10d's shutdown() does. The first agent stops its stuck workers and ends with
    torch's RendezvousClosedError naming why, at once; it used to re-join and wait
    join_timeout (600 s) for a replacement. Its shutdown() then has no round to report
    on (it used to try, and warn that it could not)."""
    d = start_daemon()
    log = tmp_path / "steps.jsonl"
    worker = ["--steps", "4", "--step-log", str(log), "--hang-after", "2", "--hang-world", "4"]
    agents = [torchrun(d, job_id, "2", *worker, script=ENV_WORKER) for _ in range(2)]
    wait_for(
        "all 4 ranks at step 2",
        lambda: len({s["rank"] for s in torch_steps(log) if s["step"] == 2}) == 4,
        timeout=120,
    )
    victim = next(s for s in torch_steps(log) if s["rank"] == 3)
    os.kill(victim["pid"], signal.SIGKILL)
    assert [a.wait(60) != 0 for a in agents] == [True, True]
    # The survivor is the agent whose worker was not the one killed.
    (survivor,) = [e for e in (a.stderr() for a in agents) if "exitcode: -9" not in e]
    assert "RendezvousClosedError" in survivor, survivor[-3000:]
    assert "gave up: its workers failed" in survivor, survivor[-3000:]
    assert "cannot go on without it (--nnodes 2:2" in survivor, survivor[-3000:]
    assert "shutdown:" not in survivor, survivor[-3000:]
    # The job named once, not "job 'J': job 'J' generation 1 was aborted" (review).
    assert f"job {job_id!r}: job {job_id!r}" not in survivor, survivor[-3000:]
    # The same job launched again at once (the bug fixed) forms at once: the agents
    # that gave up said they will not re-join, so no seat is kept for them. Kept, the
    # new agents stood by for the whole hold, "re-forming after a failure".
    again_log = ["--steps", "1", "--step-log", str(tmp_path / "again.jsonl")]
    again = [torchrun(d, job_id, "2", *again_log, nproc=1, script=ENV_WORKER) for _ in range(2)]
    assert [a.wait(90) for a in again] == [0, 0], again[0].stderr()[-3000:]
    for a in again:
        assert "standing by" not in a.stderr(), a.stderr()[-3000:]
    assert "did not re-join within" not in d.log(), d.log()[-3000:]


def test_an_agent_that_gives_up_beside_a_standby_is_replaced_not_closed(
    start_daemon: Callable[..., DaemonProcess],
    torchrun: Callable[..., Torchrun],
    tmp_path: Path,
    job_id: str,
) -> None:
    """--nnodes 2 and a third agent standing by: the agent that gives up (its worker
    killed, --max-restarts 0) reports its failure instead of closing, since a node
    waits to take its place; the survivor and the standby train to the end."""
    d = start_daemon()
    log = tmp_path / "steps.jsonl"
    stop = tmp_path / "stop"
    # Trains until told: a fixed number of steps could end before the spare's torch
    # import did (2 loaded cores), and the spare would then form a job of its own.
    worker = ("--steps", "100000", "--step-log", str(log), "--stop-file", str(stop))
    quitter = torchrun(d, job_id, "2", *worker, max_restarts=0, script=ENV_WORKER)
    # One restart: a killed worker's gloo peers (torch_worker.py's) may fail before the
    # push comes; ENV_WORKER's do not, and the restart is kept for the same outcome.
    keeper = torchrun(d, job_id, "2", *worker, max_restarts=1, script=ENV_WORKER)
    wait_for(
        "4 ranks at step 2",
        lambda: len({s["rank"] for s in torch_steps(log) if s["step"] >= 2}) == 4,
        timeout=120,
    )
    spare = torchrun(d, job_id, "2", *worker, max_restarts=1, script=ENV_WORKER)
    wait_for("the third agent to stand by", lambda: "standing by" in spare.stderr(), 100)
    first_round = {s["pid"] for s in torch_steps(log)}
    pid = next(s["pid"] for s in torch_steps(log) if s["pid"] in descendants(quitter.proc.pid))
    os.kill(pid, signal.SIGKILL)
    assert quitter.wait(60) != 0

    def new_world() -> list[dict[str, Any]]:
        return [s for s in torch_steps(log) if s["pid"] not in first_round]

    wait_for(
        "4 new ranks at step 2",
        lambda: len({s["rank"] for s in new_world() if s["step"] >= 2}) == 4,
        timeout=120,
    )
    stop.touch()
    assert [keeper.wait(120), spare.wait(120)] == [0, 0], [
        a.stderr()[-3000:] for a in (keeper, spare)
    ]
    assert {s["world"] for s in new_world()} == {4}
    assert "cannot go on without it" not in keeper.stderr(), keeper.stderr()[-3000:]
    assert _job_state(d, job_id) == "JOB_STATE_ENDED"


def test_a_standby_called_into_a_job_that_cannot_form_exits_after_its_join_timeout(
    start_daemon: Callable[..., DaemonProcess],
    torchrun: Callable[..., Torchrun],
    tmp_path: Path,
    job_id: str,
) -> None:
    """--nnodes 2, --max-restarts 0, and a third agent standing by. Both training
    nodes are killed, and the standby, called into the next generation, waits there
    for a node that never comes. It stood by again and again, never exiting (192-283
    s until killed, a torchrun chaos run, where the survivor had stopped with no
    restarts left: that survivor now closes the rendezvous, the test below); now,
    once called, its join times out as any node's, naming what is missing."""
    # The killed nodes' seats are kept for their return (--seat-hold-s: the heartbeat
    # timeout, 10 s, by default) before the standby is called; neither returns, and
    # only what follows the call is in question here.
    d = start_daemon("--seat-hold-s", "1")
    log = tmp_path / "steps.jsonl"
    survivor, victim = _two_nodes_at_step_two(torchrun, d, job_id, log, "2", 0)
    # 3 s: what is asserted is that the called-in join ends at its own timeout with the
    # missing named; a longer one only waits longer (up to twice it: the rest of the
    # ask it was called in, then one more; a standby's wait that ends before it is
    # called is asked again, see its own test).
    conf = f"token_file={d.token_file},join_timeout=3"
    spare = torchrun(d, job_id, "2", "--steps", "4", nproc=1, conf=conf, max_restarts=0)
    wait_for("the third agent to stand by", lambda: "standing by" in spare.stderr(), 100)
    victim.kill()
    survivor.kill()
    killed = time.monotonic()
    code = spare.wait(60)
    took = time.monotonic() - killed
    err = spare.stderr()
    assert code != 0, err[-3000:]
    assert "was called into the job" in err, err[-3000:]
    assert "start the missing node agents" in err, err[-3000:]
    print(f"standby called into a job that cannot form: exited {took:.1f} s after the kill")


def test_a_survivor_out_of_restarts_closes_the_round_a_standby_was_called_into(
    start_daemon: Callable[..., DaemonProcess],
    torchrun: Callable[..., Torchrun],
    tmp_path: Path,
    job_id: str,
) -> None:
    """The chaos run above: --nnodes 2, a standby, and a training node killed. The
    survivor, with no restarts left, stops; the standby, called into the next round,
    waited for it two join_timeouts. The survivor now closes that round, which cannot
    form without it, and the standby ends at once with torch's RendezvousClosedError."""
    d = start_daemon()
    log = tmp_path / "steps.jsonl"
    survivor, victim = _two_nodes_at_step_two(torchrun, d, job_id, log, "2", 0)
    conf = f"token_file={d.token_file},join_timeout=30"
    spare = torchrun(d, job_id, "2", "--steps", "4", nproc=1, conf=conf, max_restarts=0)
    wait_for("the third agent to stand by", lambda: "standing by" in spare.stderr(), 100)
    victim.kill()
    try:
        codes = [survivor.wait(20), spare.wait(20)]
    except subprocess.TimeoutExpired:
        pytest.fail(f"the standby still waits 20 s after the kill:\n{spare.stderr()[-3000:]}")
    assert codes[0] != 0 and codes[1] != 0, codes
    raised = [ln for ln in spare.stderr().splitlines() if "RendezvousClosedError: " in ln]
    assert raised, spare.stderr()[-3000:]
    assert "the job cannot go on without it (--nnodes 2:2, 1 node(s) joining)" in raised[-1]


def test_the_last_node_out_of_restarts_closes_the_run_for_a_standby_between_its_asks(
    start_daemon: Callable[..., DaemonProcess],
    torchrun: Callable[..., Torchrun],
    tmp_path: Path,
    job_id: str,
) -> None:
    """--nnodes 2: one node killed, the other out of restarts, and nobody else in
    sight as it stops (a standby between two asks: its wait had just ended, or the
    daemon was unreachable to it). The stopping agent closed nothing ("nobody to
    tell"), and the standby, asking again, took the lost node's place in a round
    nobody else would join and waited its join_timeout there (600 s by default),
    then one more. Now the run is closed as MIN cannot be made, and the standby,
    launched before the close, is told so at once, as c10d's shutdown() closes."""
    from rendezvousd.client import JobAborted

    d = start_daemon()
    log = tmp_path / "steps.jsonl"
    survivor, victim = _two_nodes_at_step_two(torchrun, d, job_id, log, "2", 0)
    launched = time.monotonic()
    victim.kill()
    try:
        code = survivor.wait(60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the survivor still runs 60 s after the kill:\n{survivor.stderr()[-3000:]}")
    assert code != 0, survivor.stderr()[-3000:]
    spare = RendezvousClient(d.endpoint, job_id, token=d.token)
    with spare, pytest.raises(JobAborted) as info:
        spare.join_node(
            min_nodes=2, max_nodes=2, gpus_per_node=1, standby=True, launched=launched, timeout=20
        )
    assert info.value.closed, info.value
    assert "closed the rendezvous" in survivor.stderr(), survivor.stderr()[-3000:]
    assert "no restarts left (--max-restarts 0)" in str(info.value), info.value


def _listening_sockets(pid: int) -> int:
    """How many listening TCP sockets process ``pid`` holds (its own descriptors, matched
    against its network namespace's socket table by inode)."""
    listening = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # TCP_LISTEN
                    listening.add(fields[9])
    held = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            held += target.startswith("socket:[") and target[8:-1] in listening
    return held


def test_node_link_watch_off_keeps_a_torchrun_agent_from_listening_for_links(
    start_daemon: Callable[..., DaemonProcess],
    torchrun: Callable[..., Torchrun],
    tmp_path: Path,
    job_id: str,
) -> None:
    """``--rdzv-conf node_link_watch=0`` (docs/trainer.md, "From torchrun"): two agents
    of one round, the first with it. An agent keeps its node links through a listener
    of its own (``node_links``), which it publishes in the round's key-value store as
    the round forms, and closes once its neighbour linked. The second agent waits its
    setup timeout (join_timeout, 10 s here) for the first's address and says the link
    is not watched, still listening; the first, whose workers run as long, published
    nothing and holds no listener (an agent holds no other: its workers' TCPStore is
    in worker rank 0). With the setting ignored the two linked, and neither said so."""
    d = start_daemon()
    log = tmp_path / "steps.jsonl"
    worker = ["--steps", "4", "--step-log", str(log), "--hang-after", "2", "--hang-world", "2"]
    conf = f"token_file={d.token_file},join_timeout=10"
    off, on = (
        torchrun(d, job_id, "2", *worker, nproc=1, conf=conf + extra, script=ENV_WORKER)
        for extra in (",node_link_watch=0", "")
    )
    unwatched = re.compile(r"the link to node [01]'s agent is not watched in generation 1 \(")
    wait_for(
        "the second agent to say its link is not watched", lambda: unwatched.search(on.stderr()), 60
    )
    said = re.search(r"key 'node-link/([01])' of job .* was not set within 10\.0 s", on.stderr())
    assert said, on.stderr()[-3000:]
    assert {s["rank"] for s in torch_steps(log) if s["step"] >= 1} == {0, 1}, torch_steps(log)
    assert "not watched" not in off.stderr(), off.stderr()[-3000:]
    assert _listening_sockets(on.proc.pid) == 1, on.stderr()[-3000:]
    assert _listening_sockets(off.proc.pid) == 0, off.stderr()[-3000:]


def _parked(d: DaemonProcess, job: str) -> bool:
    """The job exists: the first agent's JoinNode created it and waits in it."""
    from rendezvousd.client import NotFound

    with RendezvousClient(d.endpoint, job, token=d.token) as probe:
        try:
            probe.get_job()
        except NotFound:
            return False
        return True


def test_the_agent_store_behaves_as_torchs_tcpstore(
    start_daemon: Callable[..., DaemonProcess],
    torch_python: str,
    job_id: str,
) -> None:
    """The same store operations on a TCPStore and on the handler's DaemonStore give
    the same answers (torch's agent and helpers rely on TCPStore's semantics)."""
    d = start_daemon()
    out = subprocess.run(
        [
            torch_python,
            str(WORKERS / "torch_store_contract.py"),
            d.endpoint,
            str(d.token_file),
            job_id,
        ],
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert results["daemon"] == results["tcpstore"], results
    assert len(results["daemon"]) >= 12
    assert results["closed"] == [True, "RendezvousClosedError"]
    assert results["shutdown"] == [True, True]


def test_shutdown_after_a_direct_next_rendezvous_closes_the_round_and_leaves_nothing_running(
    start_daemon: Callable[..., DaemonProcess], torch_python: str, job_id: str
) -> None:
    """A caller other than torch's agent (a launcher of its own): next_rendezvous(),
    then shutdown() twice. Every thread the handler started ends, no descriptor stays
    open, and the round is closed in words that blame no worker: it said "its workers
    failed and no restarts are left", which only torch's agent can know."""
    d = start_daemon()
    script = (
        "import json, os, sys, threading, time\n"
        "from torch.distributed.elastic.rendezvous import RendezvousParameters\n"
        "from rendezvousd.trainer.torchrun.handler import create_handler\n"
        "before = set(threading.enumerate())\n"
        "fds = len(os.listdir('/proc/self/fd'))\n"
        "params = RendezvousParameters(backend='rendezvousd', endpoint=sys.argv[1], "
        "run_id=sys.argv[2], min_nodes=1, max_nodes=1)\n"
        "handler = create_handler(params)\n"
        "info = handler.next_rendezvous()\n"
        "done = [handler.shutdown(), handler.shutdown()]\n"
        "for t in set(threading.enumerate()) - before:\n"
        "    t.join(10)\n"
        "left = sorted(t.name for t in set(threading.enumerate()) - before)\n"
        # gRPC closes a closed channel's descriptors on its own threads, within ~1 s.
        "for _ in range(100):\n"
        "    if len(os.listdir('/proc/self/fd')) <= fds:\n"
        "        break\n"
        "    time.sleep(0.1)\n"
        "print(json.dumps([info.world_size, done, left, len(os.listdir('/proc/self/fd')) - fds]))\n"
    )
    env = {**os.environ, "RENDEZVOUSD_TOKEN_FILE": str(d.token_file), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [torch_python, "-c", script, d.endpoint, job_id],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    world, done, left, fds = json.loads(out.stdout.strip().splitlines()[-1])
    assert (world, done, left, fds) == (1, [True, True], [], 0), out.stdout
    with RendezvousClient(d.endpoint, job_id, token=d.token) as probe:
        job = probe.get_job()
    assert "was shut down while its round ran, by a caller other than torch's" in job.abort_reason
    assert "workers failed" not in job.abort_reason, job.abort_reason


#: One torchrun agent's handler (torch's agent calls these): joins the job's round,
#: ``set_closed()`` if told to, then, once the daemon's push ends the round, prints
#: whether the handler reads the rendezvous as closed and what torch error it makes.
_CLOSE_READER = (
    "import json, os, sys, time\n"
    "from torch.distributed.elastic.rendezvous import RendezvousParameters\n"
    "from rendezvousd.trainer.torchrun.handler import _torch_error, create_handler\n"
    "params = RendezvousParameters(backend='rendezvousd', endpoint=sys.argv[1], "
    "run_id=sys.argv[2], min_nodes=2, max_nodes=2)\n"
    "handler = create_handler(params)\n"
    "handler.next_rendezvous()\n"
    "open(sys.argv[4], 'w').close()\n"
    "if sys.argv[3] == 'close':\n"
    "    # Once the other agent's round is formed too: a close in its bootstrap is\n"
    "    # another case (test_a_close_during_the_rounds_bootstrap_is_torchs_closed_error).\n"
    "    deadline = time.monotonic() + 60\n"
    "    while not os.path.exists(sys.argv[5]) and time.monotonic() < deadline:\n"
    "        time.sleep(0.02)\n"
    "    handler.set_closed()\n"
    "deadline = time.monotonic() + 30\n"
    "while handler._client.failure is None and time.monotonic() < deadline:\n"
    "    time.sleep(0.02)\n"
    "failure = handler._client.failure\n"
    "kind = None if failure is None else type(_torch_error(failure, 'next round')).__name__\n"
    "print(json.dumps([handler.is_closed(), kind]))\n"
    "handler.shutdown()\n"
)


@pytest.mark.parametrize("how", ["said", "set_closed"])
def test_agents_read_a_close_by_the_daemons_data_not_by_the_reasons_words(
    start_daemon: Callable[..., DaemonProcess],
    torch_python: str,
    job_id: str,
    how: str,
    tmp_path: Path,
) -> None:
    """An abort whose reason merely says "rendezvous closed by torchrun" (another client
    sent it) is no close: the agents read it as an abort (torch's RendezvousError, not
    RendezvousClosedError; they matched the words and read the rendezvous as closed).
    One agent's ``set_closed()`` closes the run at the daemon (``close_run``): the other
    agent reads the close by its data, and a node of the run joining later is refused
    as closed (it was a plain abort, and that node opened the next round)."""
    from rendezvousd.client import JobAborted

    d = start_daemon()
    launched = time.monotonic()
    env = {**os.environ, "RENDEZVOUSD_TOKEN_FILE": str(d.token_file), "OMP_NUM_THREADS": "1"}
    roles = ["close", "wait"] if how == "set_closed" else ["wait", "wait"]
    agents = [
        subprocess.Popen(
            [
                torch_python,
                "-c",
                _CLOSE_READER,
                d.endpoint,
                job_id,
                role,
                str(tmp_path / str(i)),
                str(tmp_path / str(1 - i)),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i, role in enumerate(roles)
    ]
    try:
        if how == "said":
            joined = [tmp_path / "0", tmp_path / "1"]
            wait_for("both agents' rounds", lambda: all(p.exists() for p in joined), 60)
            with RendezvousClient(d.endpoint, job_id, token=d.token) as other:
                other.abort("rendezvous closed by torchrun: so says another client", generation=1)
        outs = [a.communicate(timeout=90) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.wait(10)
    read = []
    for agent, (out, err) in zip(agents, outs, strict=True):
        assert agent.returncode == 0, err[-3000:]
        read.append(json.loads(out.strip().splitlines()[-1]))
    if how == "said":
        assert read == [[False, "RendezvousError"]] * 2, read
        return
    assert read[1] == [True, "RendezvousClosedError"], read
    with (
        RendezvousClient(d.endpoint, job_id, token=d.token) as late,
        pytest.raises(JobAborted) as info,
    ):
        late.join_node(timeout=5, launched=launched, min_nodes=2, max_nodes=2, gpus_per_node=1)
    assert info.value.closed, info.value
    assert "called set_closed()" in info.value.abort_reason, info.value


#: One torchrun agent's handler whose round's bootstrap (node 0's store address, read
#: by every other node through the daemon's store) is marked in a file, then prints
#: which torch error ``next_rendezvous()`` raised.
_BOOTSTRAP_READER = (
    "import json, sys\n"
    "from torch.distributed.elastic import rendezvous as torch_rdzv\n"
    "from torch.distributed.elastic.rendezvous import RendezvousParameters\n"
    "from rendezvousd.trainer.torchrun.handler import create_handler\n"
    "build = torch_rdzv.RendezvousStoreInfo.build\n"
    "def marked(*args, **kwargs):\n"
    "    open(sys.argv[3], 'w').close()\n"
    "    return build(*args, **kwargs)\n"
    "torch_rdzv.RendezvousStoreInfo.build = staticmethod(marked)\n"
    "params = RendezvousParameters(backend='rendezvousd', endpoint=sys.argv[1], "
    "run_id=sys.argv[2], min_nodes=2, max_nodes=2)\n"
    "handler = create_handler(params)\n"
    "try:\n"
    "    handler.next_rendezvous()\n"
    "    print(json.dumps(None))\n"
    "except Exception as exc:\n"
    "    print(json.dumps([type(exc).__name__, str(exc)]))\n"
)


def test_a_close_during_the_rounds_bootstrap_is_torchs_closed_error(
    start_daemon: Callable[..., DaemonProcess], torch_python: str, job_id: str, tmp_path: Path
) -> None:
    """Another agent's ``set_closed()`` (it gave up) while this agent's round is still
    reading node 0's store address from the daemon: ``next_rendezvous()`` raises torch's
    RendezvousClosedError, as for a close anywhere else in the round. It raised the
    store's DistStoreError (the bootstrap's read is a store call), which torch's agent
    does not read as a close; seen as a flaky test when the agent that closed was quick."""
    d = start_daemon()
    marker = tmp_path / "bootstrap"
    env = {**os.environ, "RENDEZVOUSD_TOKEN_FILE": str(d.token_file), "OMP_NUM_THREADS": "1"}
    with RendezvousClient(d.endpoint, job_id, token=d.token) as node0:
        # Node 0, the round's store owner, is this test: it never writes the store's
        # address, so the agent (node 1) waits in its bootstrap's read.
        formed = concurrent.futures.ThreadPoolExecutor(1).submit(
            node0.join_node,
            min_nodes=2,
            max_nodes=2,
            gpus_per_node=1,
            addresses=["127.0.0.1"],  # on the agent's host, as its address says
            timeout=60,
        )
        wait_for("node 0's join", lambda: _nodes_joined(d, job_id) == 1, 30)
        agent = subprocess.Popen(
            [torch_python, "-c", _BOOTSTRAP_READER, d.endpoint, job_id, str(marker)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            node = formed.result(60)
            assert node.node_rank == 0, node
            wait_for(
                "the agent's bootstrap", lambda: marker.exists() or agent.poll() is not None, 60
            )
            assert marker.exists(), agent.communicate(timeout=10)
            assert node0.close_run("CLOSED: the other agent gave up", generation=node.generation)
            out, err = agent.communicate(timeout=60)
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait(10)
    assert agent.returncode == 0, err[-3000:]
    kind, message = json.loads(out.strip().splitlines()[-1])
    assert kind == "RendezvousClosedError", (kind, message)
    assert "the other agent gave up" in message, message


def test_a_link_that_never_connected_is_called_an_unreachable_address_not_a_cut(
    start_daemon: Callable[..., DaemonProcess], torch_python: str, job_id: str
) -> None:
    """A torchrun agent whose link to the next node could not connect gives up at its
    next round. Where no link between the nodes ever connected, the address that node
    advertised is not reachable from here (its route to the daemon, on a network the
    nodes do not share, a multi-homed review): "the network between the nodes is cut"
    sent its user to the cables. A link that connected once and then could not is a
    cut. The words only: the hosts are tests/multihost's."""
    d = start_daemon()
    script = (
        "import json, sys\n"
        "from torch.distributed.elastic.rendezvous import RendezvousParameters\n"
        "from rendezvousd.trainer.agent.node_links import LinkSilent\n"
        "from rendezvousd.trainer.torchrun.handler import create_handler\n"
        "params = RendezvousParameters(backend='rendezvousd', endpoint=sys.argv[1], "
        "run_id=sys.argv[2], min_nodes=2, max_nodes=2)\n"
        "handler = create_handler(params)\n"
        "cause = 'could not link to node 1 on n2 (rank 1) at 198.19.145.12:38153: its host "
        "is unreachable (No route to host)'\n"
        "said = []\n"
        "for linked_once in (False, True):\n"
        "    handler._linked_once = linked_once\n"
        "    handler._link_silent(LinkSilent(1, cause, connected=False))\n"
        "    said.append(handler._unreachable)\n"
        "print(json.dumps(said))\n"
    )
    env = {**os.environ, "RENDEZVOUSD_TOKEN_FILE": str(d.token_file)}
    out = subprocess.run(
        [torch_python, "-c", script, d.endpoint, job_id],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    never, once = json.loads(out.stdout.strip().splitlines()[-1])
    assert "at 198.19.145.12:38153" in never, never
    assert "no link between the nodes ever connected" in never, never
    assert "--local-addr" in never and "cut" not in never, never
    assert "the network between the nodes is cut" in once, once


@pytest.mark.parametrize("first", ["torch", "ours"])
def test_the_entry_point_is_what_torch_loads(torch_python: str, first: str) -> None:
    """torch's registry finds ``rendezvousd`` among its out-of-tree handlers, whether
    torch's rendezvous package or our module is imported first (torch registers the
    handlers while importing that package, which our module itself imports)."""
    imports = {
        "torch": "import torch.distributed.elastic.rendezvous",
        "ours": "import rendezvousd.trainer.torchrun.handler",
    }[first]
    code = (
        f"{imports}; from torch.distributed.elastic.rendezvous import "
        "rendezvous_handler_registry as r; print(r._registry['rendezvousd'])"
    )
    out = subprocess.run([torch_python, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "create_handler" in out.stdout
    assert "Exception while registering" not in out.stderr, out.stderr[-2000:]


def test_a_node_beyond_max_nodes_stands_by_and_replaces_a_lost_node(
    start_daemon: Callable[..., DaemonProcess],
    torchrun: Callable[..., Torchrun],
    tmp_path: Path,
    job_id: str,
) -> None:
    """Three agents for --nnodes 2, as torch's redundancy list allows: the third stands
    by (no WORLD_FULL, no re-form of the full world), and when a node is killed it
    takes its place: the survivor and it train a 4-rank world to the end."""
    d = start_daemon()
    log = tmp_path / "steps.jsonl"
    hurry = tmp_path / "hurry"
    worker = ("--steps", "100", "--step-log", str(log), "--hurry-file", str(hurry))
    agents = [
        torchrun(d, job_id, "2", *worker, max_restarts=1, script=ENV_WORKER) for _ in range(3)
    ]
    killed_at, after = standby_replaces_a_killed_node(agents, log, 100, hurry)
    print(f"kill -> first step with the standby: {min(s['t'] for s in after) - killed_at:.2f} s")


def test_a_standing_by_node_exits_0_when_the_job_ends_without_it(
    start_daemon: Callable[..., DaemonProcess],
    torchrun: Callable[..., Torchrun],
    tmp_path: Path,
    job_id: str,
) -> None:
    d = start_daemon()
    log = tmp_path / "steps.jsonl"
    stop = tmp_path / "stop"
    # Trains until the spare stands by: a fixed number of steps once ended (in a full
    # run on 2 loaded cores) before the spare's torch import did, and the spare then
    # formed a job of its own.
    worker = ("--steps", "100000", "--step-log", str(log), "--stop-file", str(stop))
    first = torchrun(d, job_id, "1", *worker, script=ENV_WORKER)
    wait_for("the one-node job to train", lambda: bool(torch_steps(log)), timeout=120)
    spare = torchrun(d, job_id, "1", *worker, script=ENV_WORKER)  # the world is full: it stands by
    wait_for("the second agent to stand by", lambda: "standing by" in spare.stderr(), 100)
    stop.touch()
    codes = [first.wait(120), spare.wait(120)]
    assert codes == [0, 0], [a.stderr()[-3000:] for a in (first, spare)]
    assert "ended without needing this standby node" in spare.stderr(), spare.stderr()[-3000:]
    assert "Traceback" not in spare.stderr(), spare.stderr()[-3000:]


def test_a_standing_by_node_exits_0_when_the_rendezvous_is_closed(
    start_daemon: Callable[..., DaemonProcess],
    torchrun: Callable[..., Torchrun],
    tmp_path: Path,
    job_id: str,
) -> None:
    """The run is closed for good (``close_run``: here by the SDK, as a torchrun agent
    out of restarts does) while a second agent stands by: c10d ends a node of its
    redundancy list then without error ("terminating pending rendezvous"); the spare
    exits 0 at once, naming the close. It waited out its join_timeout (600 s by
    default), joined again and ended with RendezvousClosedError."""
    d = start_daemon()
    log = tmp_path / "steps.jsonl"
    stop = tmp_path / "stop"
    worker = ("--steps", "100000", "--step-log", str(log), "--stop-file", str(stop))
    first = torchrun(d, job_id, "1", *worker, script=ENV_WORKER)
    wait_for("the one-node job to train", lambda: bool(torch_steps(log)), timeout=120)
    spare = torchrun(d, job_id, "1", *worker, script=ENV_WORKER)  # the world is full: it stands by
    with RendezvousClient(d.endpoint, job_id, token=d.token) as probe:
        wait_for("the second agent to park", lambda: probe.get_job().standbys == 1, 100)
        generation = probe.get_job().summary.generation
        assert probe.close_run("closed by the operator: the job is done", generation=generation)
    try:
        code = spare.wait(30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the standby still waits 30 s after the close:\n{spare.stderr()[-3000:]}")
    finally:
        stop.touch()
        first.kill()
    err = spare.stderr()
    assert code == 0, err[-3000:]
    assert (
        "was closed (closed by the operator: the job is done); this standby node was not needed"
    ) in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]


def test_an_agent_launched_before_its_job_ended_exits_0_when_it_joins_after(
    start_daemon: Callable[..., DaemonProcess],
    torchrun: Callable[..., Torchrun],
    tmp_path: Path,
    job_id: str,
) -> None:
    """An agent launched while its job ran, whose join reaches the daemon only after
    the job's run ended (a slow pod, one rescheduled mid-run; here the daemon is
    out of its reach until then), exits 0 without starting workers. Before, it opened
    the job's next generation and, alone, trained the whole job again; c10d's own
    answer there is a RendezvousClosedError traceback."""
    d = start_daemon()
    door = ClosedDoor(d.port)
    late_log, log = tmp_path / "late.jsonl", tmp_path / "steps.jsonl"
    late = torchrun(d, job_id, "1", "--steps", "3", "--step-log", str(late_log),
                    endpoint=door.endpoint, script=ENV_WORKER)  # fmt: skip
    try:
        first = torchrun(d, job_id, "1", "--steps", "3", "--step-log", str(log), script=ENV_WORKER)
        assert first.wait(120) == 0, first.stderr()[-3000:]
        door.open()
        code = late.wait(120)
    finally:
        door.close()
    err = late.stderr()
    assert code == 0, err[-3000:]
    assert not late_log.exists() or not torch_steps(late_log), err[-3000:]
    assert "it was launched for the run that ended, which needs it no more" in err, err[-3000:]
    assert "this agent exits without starting workers" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]


def test_a_standing_by_agent_outlives_a_daemon_restart(
    torchrun: Callable[..., Torchrun], tmp_path: Path, job_id: str
) -> None:
    """The daemon (--state-dir) is SIGKILLed and restarted on its port while an agent
    stands by (``retries=0``: the SDK's own retry would wait out a short outage by
    itself): it asks again, parks again, and takes the place of the node killed after."""
    with StatefulDaemon(tmp_path, "--heartbeat-timeout-s", "15") as daemon:
        d = daemon.current
        log = tmp_path / "steps.jsonl"
        conf = f"token_file={daemon.token_file},retries=0"
        first = torchrun(
            d, job_id, "1", "--steps", "2000", "--step-log", str(log), conf=conf, script=ENV_WORKER
        )
        try:
            wait_for("the one-node job to train", lambda: bool(torch_steps(log)), timeout=120)
            spare_log = tmp_path / "spare-steps.jsonl"
            worker = ("--steps", "20", "--step-log", str(spare_log))
            spare = torchrun(d, job_id, "1", *worker, conf=conf, script=ENV_WORKER)
            wait_for("the second agent to stand by", lambda: "standing by" in spare.stderr(), 60)
            daemon.outage_under_a_standby(job_id, spare.stderr)
            first.kill()
            assert spare.wait(120) == 0, spare.stderr()[-3000:]
        finally:
            first.kill()
    steps = torch_steps(spare_log)
    assert {s["rank"] for s in steps} == {0, 1} and max(s["step"] for s in steps) == 20


def test_an_agent_waiting_for_the_others_says_what_it_waits_for_while_it_waits(
    start_daemon: Callable[..., DaemonProcess],
    torchrun: Callable[..., Torchrun],
    tmp_path: Path,
    job_id: str,
) -> None:
    """One agent of two: torchrun said nothing between the rendezvous' start and its
    timeout (600 s by default). The agent now logs, after 5 s, how many nodes joined
    of those the job needs, as rendezvous-run does, then times out as before."""
    d = start_daemon()
    conf = f"token_file={d.token_file},join_timeout=8"
    agent = torchrun(d, job_id, "2", "--step-log", str(tmp_path / "steps"), conf=conf)
    assert agent.wait(60) != 0
    err = agent.stderr()
    # Which node joined, on which host, and how many more it needs (an operator review:
    # a count alone named no node).
    said = re.compile(
        re.escape(
            f"still waiting for job '{job_id}' generation 1 to form after 5 s: 1 node(s) "
            f"joined (a node on {socket.gethostname()} ("
        )
        + r"\d+\.\ds ago"
        + re.escape(
            ")) of the 2 it needs, missing 1 more node(s) to reach min_nodes=2; waiting up "
            "to 8 s in all"
        )
    )
    assert said.search(err) and err.count("still waiting") == 1, err[-3000:]
    assert "RendezvousTimeoutError" in err, err[-3000:]
    assert "1 more node(s) never joined: start the missing node agents" in err, err[-3000:]


def test_torchruns_default_run_id_is_refused_naming_the_flag(
    start_daemon: Callable[..., DaemonProcess],
    torchrun: Callable[..., Torchrun],
    tmp_path: Path,
) -> None:
    """Left at torchrun's default ("none"), two unrelated launches on one daemon were
    one job: an elastic one scaled into the other's world, a fixed-size one stood by as
    its spare and exited 0 without running its script (a torchrun user's review)."""
    d = start_daemon()
    err = _refused(torchrun, d, "none", tmp_path)
    assert "--rdzv-id is torchrun's default 'none'" in err, err[-3000:]
    assert not (tmp_path / "steps").exists()


def test_a_loopback_node_address_beside_another_hosts_is_named(torch_python: str) -> None:
    """Node 0 reaching the daemon by ``localhost`` gave its workers MASTER_ADDR
    127.0.0.1: the other hosts' workers dialled themselves until gloo's timeout, nothing
    naming why (a torchrun user's review). Nodes simulated on one host all give loopback
    addresses, which stays fine."""
    script = (
        "import json\n"
        "from rendezvousd.trainer.torchrun.handler import loopback_problem as p\n"
        "print(json.dumps([p('127.0.0.1', 'localhost:29420', {'127.0.0.1', '10.0.0.2'}),"
        " p('127.0.0.1', 'localhost:29420', {'127.0.0.1', '127.0.0.3'}),"
        " p('10.0.0.1', 'h:29420', {'10.0.0.1', '127.0.0.1'})]))\n"
    )
    done = subprocess.run(
        [torch_python, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    far, simulated, not_mine = json.loads(done.stdout)
    assert "127.0.0.1 (its route to the daemon at localhost:29420) is loopback" in far
    assert "nodes at 10.0.0.2" in far and "--local-addr" in far
    assert simulated is None and not_mine is None


def test_a_job_id_run_again_while_its_last_run_finishes_trains_once_that_run_ended(
    start_daemon: Callable[..., DaemonProcess],
    torchrun: Callable[..., Torchrun],
    tmp_path: Path,
    job_id: str,
) -> None:
    """torchrun run again with the same --rdzv-id while the run before still finishes
    (one of its nodes left, the other has not): the new agents were refused WORLD_FULL,
    stood by, and exited 0 untrained when that run ended ("ended without needing this
    standby node"). They wait for its end, then form the next run and train."""
    d = start_daemon()
    old = [RendezvousClient(d.endpoint, job_id, token=d.token) for _ in range(2)]
    try:
        joined = parallel(
            [
                lambda c=c: c.join_node(min_nodes=2, max_nodes=2, gpus_per_node=1, timeout=30)
                for c in old
            ],
            40.0,
        )
        assert all(not isinstance(j, BaseException) for j in joined), joined
        for c in old:
            c.start_heartbeat()
        old[0].leave()  # done; the other node is still finishing (a last checkpoint)
        log = tmp_path / "steps.jsonl"
        agents = [
            torchrun(d, job_id, "2", "--steps", "3", "--step-log", str(log), script=ENV_WORKER)
            for _ in old
        ]
        wait_for("both agents to wait", lambda: _nodes_waiting(d, job_id) == 2, 100)
        assert _job_state(d, job_id) == "JOB_STATE_RUNNING"
        old[1].leave()
        codes = [a.wait(120) for a in agents]
    finally:
        for c in old:
            c.close()
    assert codes == [0, 0], [a.stderr()[-3000:] for a in agents]
    steps = torch_steps(log)
    assert {s["rank"] for s in steps} == {0, 1, 2, 3} and {s["world"] for s in steps} == {4}
    assert all("standby" not in a.stderr() for a in agents), [a.stderr()[-3000:] for a in agents]


def test_an_agent_finding_the_daemon_at_max_jobs_waits_for_room_and_trains(
    start_daemon: Callable[..., DaemonProcess],
    torchrun: Callable[..., Torchrun],
    tmp_path: Path,
    job_id: str,
) -> None:
    """A daemon holding --max-jobs jobs for a moment ended every torchrun agent launched
    meanwhile with torch's RendezvousError (an SRE review): it waits for room now,
    within join_timeout, saying once which limit it waits for."""
    d = start_daemon("--max-jobs", "1", "--job-ttl-s", "1")
    log = tmp_path / "steps.jsonl"
    with RendezvousClient(d.endpoint, f"{job_id}-holder", token=d.token) as holder:
        holder.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=30)
        holder.start_heartbeat()
        agent = torchrun(
            d, job_id, "1", "--steps", "2", "--step-log", str(log), nproc=1, script=ENV_WORKER
        )
        wait_for(
            "the agent to say the daemon is full",
            lambda: "daemon is full" in agent.stderr() or agent.proc.poll() is not None,
            timeout=120,
        )
        assert agent.proc.poll() is None, agent.stderr()[-3000:]
        holder.leave()
    assert agent.wait(120) == 0, agent.stderr()[-3000:]
    assert max(s["step"] for s in torch_steps(log)) == 2
    said = agent.stderr()
    assert said.count("daemon is full") == 1, said[-3000:]
    assert "its max_jobs limit, held by other jobs" in said and "--max-jobs" in said
