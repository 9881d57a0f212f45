"""Automatic recovery across real network hosts: the node agents restart the job after
a worker's death, and shrink an elastic job after a whole node's death, losing at most
one step, with the same final model as a fault-free run."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.multihost.cluster import Cluster, Node
from tests.support import json_lines, wait_for

STEPS = (
    "--steps", "60", "--log-every", "10", "--step-sleep", "0.02",
    "--samples", "1024", "--hidden", "32",
)  # fmt: skip


def _unpaced(steps: tuple[str, ...]) -> tuple[str, ...]:
    """``steps`` without the pretend compute: for a fault-free reference run, which no
    test waits on (the pause only gives a faulty run's test time to act; the model it
    trains does not depend on it)."""
    at = steps.index("--step-sleep")
    return (*steps[: at + 1], "0", *steps[at + 2 :])


def _step_log(cluster: Cluster, job: str) -> Path:
    return cluster.workdir / f"{job}.steps"


def _launch(
    cluster: Cluster,
    job: str,
    nnodes: str,
    flags: tuple[str, ...] = (),
    steps: tuple[str, ...] = STEPS,
) -> list[Node]:
    args = (*steps, "--step-log", str(_step_log(cluster, job)))
    return cluster.launch(
        3, 2, job=job, launcher_args=("--nnodes", nnodes, *flags), example_args=args
    )


def _wait_training(log: Path, rank: int) -> None:
    wait_for(
        f"rank {rank} to train",
        lambda: any(e["rank"] == rank and e["step"] >= 10 for e in json_lines(log)),
        60,
    )


def _lost_steps(log: list[dict[str, Any]], start_step: int) -> int:
    """Steps the first generation completed that the next one did again."""
    first = min(e["gen"] for e in log)
    done = max(e["step"] for e in log if e["gen"] == first)
    return done - start_step


def _hosts_by_rank(results: list[dict[str, Any]]) -> dict[int, str]:
    """Which host (hostname) ran each rank of the finished job."""
    assert all(r["node_rank"] == r["rank"] // 2 for r in results), results
    return {r["rank"]: r["host"] for r in results}


def test_a_killed_worker_is_recovered_on_every_host_like_a_fault_free_run(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = make_cluster(3)
    straight = _launch(cluster, "straight", "3", steps=_unpaced(STEPS))
    assert cluster.wait(straight) == [0, 0, 0], "\n".join(n.summary() for n in straight)
    reference = {r["params_sha256"] for r in cluster.results("straight")}
    assert len(reference) == 1

    nodes = _launch(cluster, "recover", "3", ("--max-restarts", "1"))
    log = _step_log(cluster, "recover")
    _wait_training(log, 3)
    victim = next(e["pid"] for e in json_lines(log) if e["rank"] == 3)
    os.kill(victim, signal.SIGKILL)
    assert cluster.wait(nodes) == [0, 0, 0], "\n".join(n.summary() for n in nodes)
    results = cluster.results("recover")
    assert sorted(r["rank"] for r in results) == list(range(6))
    assert {r["restart_count"] for r in results} == {1}
    assert {r["params_sha256"] for r in results} == reference  # bit-identical model
    assert _lost_steps(json_lines(log), min(r["start_step"] for r in results)) <= 1
    # h2 heard of its own worker's death first and joined the new round first, yet
    # every node kept its ranks: rank 0 (the id, the checkpoints) stays on h1.
    assert _hosts_by_rank(results) == {r: f"h{1 + r // 2}" for r in range(6)}
    for n in (nodes[0], nodes[2]):  # the other hosts were told who died, and why
        assert "lost rank 3 on h2" in n.text() and "SIGKILL" in n.text(), n.summary()


def test_a_lost_host_shrinks_the_elastic_job_to_the_surviving_hosts(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = make_cluster(3)
    nodes = _launch(cluster, "shrink", "2:3", ("--max-restarts", "1"))
    log = _step_log(cluster, "shrink")
    _wait_training(log, 5)
    nodes[2].proc.kill()  # the whole node: its agent, and with it its workers
    codes = cluster.wait(nodes)
    assert codes[:2] == [0, 0], "\n".join(n.summary() for n in nodes[:2])
    results = cluster.results("shrink")
    survivors = [r for r in results if r["restart_count"] == 1]
    assert sorted(r["rank"] for r in survivors) == [0, 1, 2, 3]
    assert {(r["world_size"], r["num_nodes"]) for r in survivors} == {(4, 2)}
    assert _hosts_by_rank(survivors) == {0: "h1", 1: "h1", 2: "h2", 3: "h2"}
    assert len({r["params_sha256"] for r in survivors}) == 1
    assert _lost_steps(json_lines(log), min(r["start_step"] for r in survivors)) <= 1
    for n in nodes[:2]:
        assert "on h3" in n.text(), n.summary()


@pytest.mark.parametrize("spare_flag", ["--standby", "--standby-if-full"])
def test_a_standby_host_takes_the_place_of_a_lost_host(
    make_cluster: Callable[..., Cluster], spare_flag: str
) -> None:
    """--nnodes 3 on h1..h3 and a standby agent on h4 (--standby, or a node started
    once the job runs that finds its world full, --standby-if-full): h3's node dies,
    h4 is called into its slot across the network and the job ends with 6 ranks and
    the model a fault-free run trains."""
    cluster = make_cluster(4)
    # Long enough for a node started once the job trains to stand by before the kill.
    steps = tuple("200" if a == "60" else a for a in STEPS)
    straight = _launch(cluster, "straight", "3", steps=_unpaced(steps))
    assert cluster.wait(straight) == [0, 0, 0], "\n".join(n.summary() for n in straight)
    reference = {r["params_sha256"] for r in cluster.results("straight")}

    flags = ("--max-restarts", "1")
    nodes = _launch(cluster, "standby", "3", flags, steps)
    log = _step_log(cluster, "standby")
    if spare_flag == "--standby-if-full":
        # The job runs, its world full: h4 joins as any node, then stands by.
        wait_for("the job to train", lambda: bool(json_lines(log)), 60)
    (spare,) = cluster.launch(
        3,
        2,
        job="standby",
        launcher_args=("--nnodes", "3", *flags, spare_flag, "--node-rank", "auto"),
        example_args=(*steps, "--step-log", str(log)),
        nodes=[3],  # on h4
    )
    wait_for("the standby to stand by", lambda: "standing by" in spare.text(), 60)
    _wait_training(log, 5)
    nodes[2].proc.kill()  # h3's whole node: its agent, and with it its workers
    codes = cluster.wait([nodes[0], nodes[1], spare])
    assert codes == [0, 0, 0], "\n".join(n.summary() for n in (*nodes, spare))
    results = cluster.results("standby")
    assert sorted(r["rank"] for r in results) == list(range(6))
    assert {r["world_size"] for r in results} == {6}
    assert {r["params_sha256"] for r in results} == reference  # bit-identical model
    assert _lost_steps(json_lines(log), min(r["start_step"] for r in results)) <= 1
    assert "standby called: this node is node 2 of generation 2" in spare.text(), spare.summary()
    assert _hosts_by_rank(results) == {0: "h1", 1: "h1", 2: "h2", 3: "h2", 4: "h4", 5: "h4"}
    if spare_flag == "--standby-if-full":
        assert "has all its 3 nodes: standing by" in spare.text(), spare.summary()
    for n in nodes[:2]:
        assert "on h3" in n.text(), n.summary()


def test_a_node_started_while_the_job_re_forms_cannot_take_a_survivors_seat(
    make_cluster: Callable[..., Cluster],
) -> None:
    """--nnodes 2 on h1, h2, every node started alike (--standby-if-full --node-rank
    auto); h3 stands by.
    h1's agent is stopped (SIGSTOP) so that it cannot re-join at once, and h2's node
    dies: h3 is called into h2's slot and the next generation keeps h1's seat. h4,
    started now (a rescheduled pod), finds the world full and stands by instead of
    taking h1's seat; h1, continued, re-joins its seat across the network and trains to
    the end with its state (at most one step lost), beside h3. (The daemon keeps a seat
    one heartbeat timeout: 30 s here, so that a slow start of h4 cannot outlast it.)"""
    cluster = make_cluster(4, "--heartbeat-timeout-s", "30")
    steps = tuple("200" if a == "60" else a for a in STEPS)
    flags = ("--max-restarts", "1", "--standby-if-full", "--node-rank", "auto")
    job = "kept"
    log = _step_log(cluster, job)
    nodes = cluster.launch(
        2,
        2,
        job=job,
        launcher_args=("--nnodes", "2", *flags),
        example_args=(*steps, "--step-log", str(log)),
    )

    def spare(index: int) -> Node:
        (started,) = cluster.launch(
            2,
            2,
            job=job,
            launcher_args=("--nnodes", "2", *flags),
            example_args=(*steps, "--step-log", str(log)),
            nodes=[index],
        )
        return started

    wait_for("the job to train", lambda: bool(json_lines(log)), 60)
    h3 = spare(2)
    wait_for("h3 to stand by", lambda: "standing by" in h3.text(), 60)
    _wait_training(log, 3)
    nodes[0].proc.send_signal(signal.SIGSTOP)  # h1's agent: it cannot re-join yet
    try:
        nodes[1].proc.kill()  # h2's whole node
        wait_for(
            "h3 to open the next generation, h1's seat kept",
            lambda: cluster.job_facts(job)["seats_kept"] == 1,
            30,
        )
        h4 = spare(3)
        wait_for("h4 to stand by", lambda: "standing by" in h4.text(), 60)
        # It says why the world is full: seats kept for the nodes re-joining.
        assert "re-forming after a failure, its 2 seats taken or kept" in h4.text(), h4.summary()
        assert cluster.job_facts(job)["seats_kept"] == 1
    finally:
        nodes[0].proc.send_signal(signal.SIGCONT)
    codes = cluster.wait([nodes[0], h3, h4])
    assert codes == [0, 0, 0], "\n".join(n.summary() for n in (*nodes, h3, h4))
    results = cluster.results(job)
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3], results
    assert len({r["generation"] for r in results}) == 1 and {r["world_size"] for r in results} == {
        4
    }
    # h1's workers restarted once in it (h3's, called, started fresh), and the job
    # resumed from the state h1 held.
    assert sum(r["restart_count"] == 1 for r in results) == 2, results
    # h3 opened the generation, h1 came back into it later: h1 is node 0 again.
    assert _hosts_by_rank(results) == {0: "h1", 1: "h1", 2: "h3", 3: "h3"}
    assert _lost_steps(json_lines(log), min(r["start_step"] for r in results)) <= 1
    assert "standby called" in h3.text(), h3.summary()
    assert "not needed" in h4.text(), h4.summary()


def test_a_node_relaunched_on_another_host_waits_for_its_frozen_predecessors_seat(
    make_cluster: Callable[..., Cluster],
) -> None:
    """--nnodes 2 on h1, h2; h2's agent freezes (SIGSTOP: a hung host), and node 1 is
    started again on h3 with the same --node-rank, as a scheduler moving a pod would.
    Its join is refused DuplicateRank while the frozen agent holds the seat: that was
    fatal at once (two nodes given one rank), so the replacement gave up and the job
    failed once the daemon lost h2. Now it asks again until the daemon has lost h2
    (its heartbeat timeout, 8 s here, so the relaunch asks before then), and the job
    ends on h1 and h3."""
    cluster = make_cluster(3, "--heartbeat-timeout-s", "8")
    # Long enough that the job cannot end before the daemon loses the frozen agent.
    steps = tuple("500" if a == "60" else a for a in STEPS)
    job = "moved"
    log = _step_log(cluster, job)
    flags = ("--nnodes", "2", "--max-restarts", "1")
    nodes = cluster.launch(
        2, 2, job=job, launcher_args=flags, example_args=(*steps, "--step-log", str(log))
    )
    _wait_training(log, 3)
    nodes[1].proc.send_signal(signal.SIGSTOP)  # h2's agent
    (moved,) = cluster.launch(
        2,
        2,
        job=job,
        launcher_args=(*flags[:2], "--max-restarts", "0"),
        example_args=(*steps, "--step-log", str(log)),
        nodes=[1],
        on_host=3,  # h3
    )
    codes = cluster.wait([nodes[0], moved])
    assert codes == [0, 0], "\n".join(n.summary() for n in (*nodes, moved))
    assert "is held by the node agent on h2, a node this one replaces" in moved.text()
    assert "no restart used" in moved.text(), moved.summary()
    results = cluster.results(job)
    final = max(r["generation"] for r in results)
    assert _hosts_by_rank([r for r in results if r["generation"] == final]) == {
        0: "h1", 1: "h1", 2: "h3", 3: "h3"
    }  # fmt: skip
