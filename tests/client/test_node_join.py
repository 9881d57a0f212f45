"""Node-level joins through the SDK against a real daemon process: node agents join
once per node, heartbeat once per node, report failures, and re-join elastically."""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client import (
    AsyncRendezvousClient,
    DuplicateRank,
    InvalidRequest,
    LimitExceeded,
    NodeMembership,
    NotFound,
    PeerFailed,
    RendezvousClient,
    RendezvousError,
)
from rendezvousd.trainer.agent.node_agent import describe_remote
from tests.daemon.test_blackhole import BlackHoleProxy
from tests.support import (
    WORKERS,
    DaemonProcess,
    GatedProxy,
    free_port,
    parallel,
    scrape,
    spawn_daemon,
    wait_for,
    write_token,
)

ID0 = b"\x07" * 128


def clients(d: DaemonProcess, job: str, n: int) -> list[RendezvousClient]:
    return [RendezvousClient(d.endpoint, job, token=d.token) for _ in range(n)]


@pytest.fixture
def agents(daemon: DaemonProcess, job_id: str) -> Iterator[list[RendezvousClient]]:
    made = clients(daemon, job_id, 3)
    yield made
    for c in made:
        c.close()


def join_all(
    agents: list[RendezvousClient], low: int, high: int, gpus: int = 2, **kw: object
) -> list[NodeMembership]:
    results = parallel(
        [
            lambda c=c, i=i: c.join_node(  # type: ignore[misc]
                min_nodes=low, max_nodes=high, gpus_per_node=gpus, host=f"node{i}", timeout=20, **kw
            )
            for i, c in enumerate(agents)
        ]
    )
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def test_two_nodes_of_two_form_with_rank_blocks_and_one_id(
    agents: list[RendezvousClient],
) -> None:
    made: list[int] = []

    def factory() -> bytes:
        made.append(1)
        return ID0

    ms = join_all(agents[:2], 2, 2, id_factory=factory)
    assert made == [1]  # only node 0 makes the id
    assert sorted(m.node_rank for m in ms) == [0, 1]
    assert all(m.unique_id == ID0 and m.world_size == 4 and m.num_nodes == 2 for m in ms)
    for m in ms:
        assert m.first_rank == m.node_rank * 2
        w = m.membership_for(1)
        assert (w.rank, w.local_rank, w.world_size) == (m.first_rank + 1, 1, 4)
        assert [x.rank for x in w.members] == [0, 1, 2, 3]
        assert w.members[w.rank].host == f"node{ms.index(m)}"
    assert "unique_id" not in repr(ms[0]) and ms[0].member_instance_id(0) not in repr(ms[0])
    # Nor in the client's session (a traceback showing its frames' locals shows it),
    # which held the agent's instance id and the seat it names at its next join_node.
    for agent in agents[:2]:
        session = repr(agent._s)
        assert agent._s.instance_id not in session and agent._s.held not in session
        assert ID0.hex() not in session and repr(ID0) not in session


def test_elastic_forms_with_min_after_last_call(agents: list[RendezvousClient]) -> None:
    ms = join_all(agents[:2], 1, 3, last_call=0.3)
    assert [m.num_nodes for m in ms] == [2, 2]


def test_elastic_forms_at_once_with_max(agents: list[RendezvousClient]) -> None:
    # A last call far beyond the join timeout: only reaching max_nodes can form it.
    ms = join_all(agents[:2], 1, 2, last_call=300)
    assert [m.num_nodes for m in ms] == [2, 2]


def test_elastic_aio_forms_with_min(daemon: DaemonProcess, job_id: str) -> None:
    async def main() -> list[NodeMembership]:
        async with (
            AsyncRendezvousClient(daemon.endpoint, job_id, token=daemon.token) as a,
            AsyncRendezvousClient(daemon.endpoint, job_id, token=daemon.token) as b,
        ):
            ms = await asyncio.wait_for(
                asyncio.gather(
                    a.join_node(min_nodes=2, max_nodes=4, gpus_per_node=1, last_call=0.2),
                    b.join_node(min_nodes=2, max_nodes=4, gpus_per_node=1, last_call=0.2),
                ),
                20,
            )
            return list(ms)

    ms = asyncio.run(main())
    assert sorted(m.node_rank for m in ms) == [0, 1] and ms[0].unique_id == ms[1].unique_id


def test_report_failure_reaches_the_other_node_and_getjob_names_the_rank(
    agents: list[RendezvousClient],
) -> None:
    ms = join_all(agents[:2], 2, 2)
    reporter = next(i for i, m in enumerate(ms) if m.node_rank == 1)
    other = 1 - reporter
    heard: list[RendezvousError] = []
    got = threading.Event()
    agents[reporter].start_heartbeat(0.2)
    agents[other].start_heartbeat(0.2, on_failure=lambda e: (heard.append(e), got.set()))
    agents[reporter].report_failure(1, "worker exited with signal 9")
    assert got.wait(10)
    assert len(heard) == 1 and isinstance(heard[0], PeerFailed)
    assert heard[0].method == "Heartbeat" and heard[0].metadata["ranks"] == "3"
    assert f"node{reporter}" in heard[0].message
    assert "worker exited with signal 9" in heard[0].message
    failed = list(agents[0].get_job().failed)
    assert (failed[0].rank, failed[0].cause) == (3, "worker exited with signal 9")
    assert failed[0].host == f"node{reporter}"


def test_two_ranks_lost_on_two_hosts_are_each_named_with_their_own_host(
    daemon: DaemonProcess, job_id: str, agents: list[RendezvousClient]
) -> None:
    # Hosts in the opposite order to the ranks, and rank 2 lost before rank 1: an
    # answer that sorts ranks and hosts separately pairs rank 1 with "a-host".
    hosts = ["survivor", "z-host", "a-host"]
    results = parallel(
        [
            lambda c=c, i=i: c.join_node(  # type: ignore[misc]
                min_nodes=3, max_nodes=3, gpus_per_node=1, host=hosts[i], node_rank=i, timeout=20
            )
            for i, c in enumerate(agents)
        ]
    )
    ms: list[NodeMembership] = []
    for r in results:
        assert isinstance(r, NodeMembership), r
        ms.append(r)
    heard: list[RendezvousError] = []
    got = threading.Event()
    agents[0].start_heartbeat(0.2, on_failure=lambda e: (heard.append(e), got.set()))
    agents[2].report_failure(0, "worker exited with signal 9")
    assert got.wait(10)
    agents[1].report_failure(0, "hung: no progress for 60.0 s")
    wait_for("both losses recorded", lambda: len(agents[0].get_job().failed) == 2)
    # The event every survivor hears: the first loss, with its own host.
    assert isinstance(heard[0], PeerFailed)
    assert [(f.rank, f.host, f.node_rank) for f in heard[0].failed] == [(2, "a-host", 2)]
    assert heard[0].failed[0].cause == "worker exited with signal 9"
    # A call on the failed generation: both losses, in the order they happened.
    worker = clients(daemon, job_id, 1)[0]
    try:
        worker.attach(ms[0].membership_for(0), ms[0].member_instance_id(0))
        with pytest.raises(PeerFailed) as caught:
            worker.barrier("b", timeout=5)
    finally:
        worker.close()
    error = caught.value
    assert [(f.rank, f.host) for f in error.failed] == [(2, "a-host"), (1, "z-host")]
    assert error.ranks == [2, 1]
    # Each host once, in the order of its first loss (not sorted: "a-host" lost first).
    assert error.hosts == ["a-host", "z-host"]
    assert error.generation == ms[0].generation == 1
    assert [f.cause for f in error.failed] == [
        "worker exited with signal 9",
        "hung: no progress for 60.0 s",
    ]
    assert "rank 2 on a-host (worker exited" in error.message
    assert "rank 1 on z-host (hung" in error.message
    # What a node agent (and so its launcher) blames: the first loss, on its own host.
    assert describe_remote(error)[1:] == (2, "a-host")
    assert describe_remote(heard[0])[1:] == (2, "a-host")
    # In the agent's words, the losses without the SDK user's remedy (the agent acts).
    said = describe_remote(error)[0]
    assert said.startswith(f"PeerFailed: job {job_id!r} generation 1 failed: lost rank 2")
    assert "restart the job" not in said and "rank 1 on z-host (hung" in said, said


def test_a_long_multiline_cause_is_kept_whole_and_shown_escaped(
    agents: list[RendezvousClient],
) -> None:
    ms = join_all(agents[:2], 2, 2)
    reporter = next(i for i, m in enumerate(ms) if m.node_rank == 1)
    other = 1 - reporter
    heard: list[RendezvousError] = []
    got = threading.Event()
    agents[other].start_heartbeat(0.2, on_failure=lambda e: (heard.append(e), got.set()))
    # Report only once the stream is up: a stream opened after the failure hears it
    # as its call's error, whose details carry causes cut short (a status stays small).
    first = ms[other].first_rank
    wait_for(
        "the other node's heartbeat stream",
        lambda: any(
            s.member.rank == first and s.heartbeat_stream_open
            for s in agents[other].get_job().members
        ),
    )
    cause = "RuntimeError: line1\nline2" + "x" * 5000 + "\x1b[31m"
    agents[reporter].report_failure(1, cause)
    assert got.wait(10)
    assert isinstance(heard[0], PeerFailed) and heard[0].failed[0].cause == cause
    # One line, escaped, shortened: the message names the rank, not 5,000 x's.
    assert "\n" not in heard[0].message and "\x1b" not in heard[0].message
    assert "rank 3 on node" in heard[0].message and "line1\\x0aline2" in heard[0].message
    assert len(heard[0].message) < 1000, heard[0].message
    assert agents[other].get_job().failed[0].cause == cause


def test_killed_node_process_fails_the_generation(
    daemon: DaemonProcess, job_id: str, agents: list[RendezvousClient]
) -> None:
    cmd = [sys.executable, str(WORKERS / "node_worker.py"), "--endpoint", daemon.endpoint]
    cmd += ["--token-file", str(daemon.token_file), "--job", job_id, "--nodes", "2:2"]
    proc = subprocess.Popen(
        [*cmd, "--gpus", "2", "--host", "doomed"], stdout=subprocess.PIPE, text=True
    )
    try:
        m = agents[0].join_node(min_nodes=2, max_nodes=2, gpus_per_node=2, host="ok", timeout=20)
        got = threading.Event()
        heard: list[RendezvousError] = []
        agents[0].start_heartbeat(0.2, on_failure=lambda e: (heard.append(e), got.set()))
        assert proc.stdout is not None
        assert json.loads(proc.stdout.readline())["event"] == "joined"
        proc.kill()
        assert got.wait(10)
        assert isinstance(heard[0], PeerFailed) and "doomed" in heard[0].message
        # the killed node's ranks are the first lost (survivors' streams close after)
        lost = {f.rank for f in list(agents[0].get_job().failed)[:2]}
        assert lost == {r for r in range(4) if r // 2 != m.node_rank}
    finally:
        proc.kill()
        proc.wait(10)


def test_attached_worker_uses_barrier_and_kv_and_a_wrong_instance_is_refused(
    daemon: DaemonProcess, job_id: str, agents: list[RendezvousClient]
) -> None:
    ms = join_all(agents[:2], 2, 2)
    for c in agents[:2]:
        c.start_heartbeat(0.2)
    workers = clients(daemon, job_id, 4)
    try:
        for m in ms:
            for local in range(2):
                w = workers[m.first_rank + local]
                w.attach(m.membership_for(local), m.member_instance_id(local))
        workers[0].kv_set("k", b"v")
        assert workers[3].kv_get("k", timeout=5) == b"v"
        parallel([lambda w=w: w.barrier("b", timeout=10) for w in workers])  # type: ignore[misc]
        intruder = clients(daemon, job_id, 1)[0]
        intruder.attach(ms[0].membership_for(0), ms[1].member_instance_id(0))
        with pytest.raises(DuplicateRank):
            intruder.kv_set("k", b"forged")
        intruder.close()
        with pytest.raises(InvalidRequest):
            workers[0].attach(ms[0].membership_for(0), "")
    finally:
        for w in workers:
            w.close()


def test_a_node_rank_held_by_another_agent_is_refused_naming_both_ways_to_fix_it(
    agents: list[RendezvousClient],
) -> None:
    def first() -> None:
        with contextlib.suppress(RendezvousError):  # cancelled when the fixture closes it
            agents[0].join_node(
                min_nodes=2, max_nodes=2, gpus_per_node=1, node_rank=0, host="first", timeout=20
            )

    def first_holds_the_id() -> bool:
        try:
            return agents[2].get_job().id_published
        except NotFound:
            return False

    threading.Thread(target=first, daemon=True).start()
    wait_for("node 0 to join with the id", first_holds_the_id)
    with pytest.raises(DuplicateRank) as caught:
        agents[1].join_node(
            min_nodes=2, max_nodes=2, gpus_per_node=1, node_rank=0, host="second", timeout=5
        )
    message = str(caught.value)
    assert "node_rank=0" in message and "node agent on first" in message, message
    # --nnodes 2 needs a node rank: "(or none)" named a way that does not exist.
    assert "give each node a distinct --node-rank (0..1), or --node-rank auto" in message
    assert "(or none)" not in message


def test_a_silent_partition_is_named_as_silence_not_as_a_closed_stream(
    start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    """A node behind a black hole (no FIN, no RST: bytes vanish) keeps its stream open
    and silent: survivors hear it named as silence once the heartbeat timeout passed.
    (A real cut cable, whose unacknowledged packets end the connection early, is
    tests/multihost/test_faults.py's.)"""
    d = start_daemon("--heartbeat-timeout-s", "3")
    proxy = BlackHoleProxy(d.port)
    cut_off = RendezvousClient(f"127.0.0.1:{proxy.port}", job_id, token=d.token)
    survivor = RendezvousClient(d.endpoint, job_id, token=d.token)
    heard: queue.Queue[RendezvousError] = queue.Queue()
    try:
        joined = parallel(
            [
                lambda c=c, h=h: c.join_node(  # type: ignore[misc]
                    min_nodes=2, max_nodes=2, gpus_per_node=1, host=h, timeout=20
                )
                for c, h in ((cut_off, "partitioned"), (survivor, "survivor"))
            ]
        )
        assert all(isinstance(m, NodeMembership) for m in joined), joined
        cut_off.start_heartbeat(0.2)
        survivor.start_heartbeat(0.2, on_failure=heard.put)
        # Cut once both streams are attached: a node never attached is a stray's loss.
        wait_for(
            "both nodes' streams",
            lambda: all(m.heartbeat_stream_open for m in survivor.get_job().members),
        )
        proxy.cut()
        started = time.monotonic()
        error = heard.get(timeout=20)
        elapsed = time.monotonic() - started
    finally:
        cut_off.close()
        survivor.close()
        proxy.close()
    assert isinstance(error, PeerFailed), error
    silence = "no heartbeat for 3.0 s (node unreachable)"
    assert [(f.host, f.cause) for f in error.failed] == [("partitioned", silence)], error
    assert f"on partitioned ({silence})" in error.message, error.message
    assert elapsed >= 3 - 0.2 - 0.2, elapsed  # its last beat came at most 0.2 s before


def test_rejoin_of_next_generation_gets_a_fresh_id(agents: list[RendezvousClient]) -> None:
    first = join_all(agents[:2], 2, 2)
    agents[0].abort("restart", generation=first[0].generation)
    second = join_all(agents[:2], 2, 2)
    assert second[0].generation == first[0].generation + 1
    assert second[0].unique_id == second[1].unique_id != first[0].unique_id


def test_nodes_waiting_reaches_a_running_node_and_scale_up_rejoins(
    agents: list[RendezvousClient],
) -> None:
    (m,) = join_all(agents[:1], 1, 2, last_call=0.1)
    counts: list[int] = []
    agents[0].start_heartbeat(0.2, on_nodes_waiting=counts.append)
    box: list[object] = []
    joiner = threading.Thread(
        target=lambda: box.append(
            agents[1].join_node(
                min_nodes=1, max_nodes=2, gpus_per_node=2, host="late", timeout=20, last_call=0.1
            )
        ),
        daemon=True,
    )
    joiner.start()
    wait_for("NODES_WAITING", lambda: agents[0].nodes_waiting() == 1)
    assert counts == [1]
    agents[0].abort("scale-up", generation=m.generation)
    again = agents[0].join_node(min_nodes=1, max_nodes=2, gpus_per_node=2, host="n0", timeout=20)
    joiner.join(20)
    assert not joiner.is_alive()
    late = box[0]
    assert isinstance(late, NodeMembership)
    assert again.generation == late.generation == m.generation + 1
    assert again.num_nodes == 2 and {again.node_rank, late.node_rank} == {0, 1}


def test_an_attached_worker_cannot_open_a_heartbeat_stream_of_its_own(
    daemon: DaemonProcess, job_id: str, agents: list[RendezvousClient]
) -> None:
    """Nodes heartbeat, ranks do not: a rank's own stream in a node generation is
    refused, so the worker closing it cannot fail its healthy job."""
    ms = join_all(agents[:2], 2, 2)
    (worker,) = clients(daemon, job_id, 1)
    worker.attach(ms[0].membership_for(1), ms[0].member_instance_id(1))
    heard: list[RendezvousError] = []
    got = threading.Event()
    worker.start_heartbeat(0.2, on_failure=lambda e: (heard.append(e), got.set()))
    assert got.wait(10)
    assert heard[0].reason == "JOIN_MODE_MISMATCH", heard[0]
    assert "attach(), not start_heartbeat()" in heard[0].message
    worker.close()
    job = agents[0].get_job()
    assert job.summary.state == pb.JobState.JOB_STATE_RUNNING, job.failed


def test_a_node_whose_workers_all_left_hears_the_job_end_as_no_failure(
    daemon: DaemonProcess, job_id: str, agents: list[RendezvousClient]
) -> None:
    """Every rank's worker leave()s (the job finished): the agents' node heartbeats then
    hear JOB_ENDED, which is the job's normal end, not a failure to report. The soak
    counted 31-52 such on_failure calls per run when its workers left before agents."""
    ms = join_all(agents[:2], 2, 2, gpus=1)
    heard: list[RendezvousError] = []
    for c in agents[:2]:
        c.start_heartbeat(0.1, on_failure=heard.append)
    workers = clients(daemon, job_id, 2)
    try:
        for m, w in zip(ms, workers, strict=True):
            w.attach(m.membership_for(0), m.member_instance_id(0))
        for w in workers:
            w.leave()
        wait_for("the job to end", lambda: agents[2].get_job().summary.state == pb.JOB_STATE_ENDED)
        # Several beats (0.1 s apart) and the ENDED push have had their chance.
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and not heard:
            time.sleep(0.05)
        assert heard == []
        for c in agents[:2]:
            c.raise_if_failed()
            c.leave()  # one warning at most: the job is over
    finally:
        for w in workers:
            w.close()


def test_a_standby_waits_beyond_max_nodes_is_shown_and_takes_a_lost_nodes_slot(
    daemon: DaemonProcess, agents: list[RendezvousClient]
) -> None:
    """Over the wire: a standby JoinNode parks on a full world (a plain one gets
    WORLD_FULL), GetJob and ``status`` show it, the running node hears no
    NODES_WAITING, and when that node's stream closes the standby is answered with
    the next generation, which forms at once without the last call."""
    from rendezvousd.cli.probe import render_job

    (m,) = join_all(agents[:1], 1, 1, last_call=30.0)
    counts: list[int] = []
    agents[0].start_heartbeat(0.2, on_nodes_waiting=counts.append)
    with pytest.raises(LimitExceeded) as full:
        agents[2].join_node(min_nodes=1, max_nodes=1, gpus_per_node=2, host="plain", timeout=5)
    assert full.value.reason == "WORLD_FULL"
    box: list[object] = []
    spare = threading.Thread(
        target=lambda: box.append(
            agents[1].join_node(
                min_nodes=1, max_nodes=1, gpus_per_node=2, host="spare", timeout=30, standby=True
            )
        ),
        daemon=True,
    )
    spare.start()
    wait_for("the standby to park", lambda: agents[0].get_job().standbys == 1)
    job = agents[0].get_job()
    assert job.nodes_waiting == 1 and job.summary.state == pb.JobState.JOB_STATE_RUNNING
    assert "1 node(s) waiting to join (1 standing by)" in render_job(job)
    time.sleep(0.5)  # a NODES_WAITING would have reached the running node by now
    assert counts == [] and agents[0].nodes_waiting() == 0
    agents[0].close()  # the running node's agent dies: its stream closes
    spare.join(20)
    assert not spare.is_alive()
    (called,) = box
    assert isinstance(called, NodeMembership), called
    assert called.generation == m.generation + 1 and called.num_nodes == 1


def test_a_replacement_cannot_take_a_survivors_seat_in_the_next_generation(
    tmp_path: Path, job_id: str
) -> None:
    """Over the wire, the race a ``--standby-if-full`` node or a rescheduled pod
    starts: a and b run, a standby s parks; b's agent dies and s is called. A plain
    JoinNode r arrives before the survivor a re-joins: r is refused WORLD_FULL (a's
    seat is kept), GetJob, ``status`` and the status page show the kept seat, and a,
    whose SDK names the seat it held, forms generation 2 with s. (Its own daemon: the
    seat is kept one heartbeat timeout, the default 10 s, not the shared daemon's 3.)"""
    from rendezvousd.cli.probe import render_job
    from tests.daemon.test_status_page import api

    daemon = spawn_daemon(tmp_path, "--metrics-listen", "127.0.0.1:0")
    a, b, s, r = clients(daemon, job_id, 4)
    try:
        kw: dict[str, object] = dict(min_nodes=2, max_nodes=2, gpus_per_node=1, timeout=20)
        first = parallel([lambda: a.join_node(**kw), lambda: b.join_node(**kw)])  # type: ignore[arg-type]
        assert all(isinstance(m, NodeMembership) for m in first), first
        a.start_heartbeat(0.2)
        b.start_heartbeat(0.2)
        box: list[object] = []
        spare = threading.Thread(
            target=lambda: box.append(s.join_node(**kw, standby=True)),  # type: ignore[arg-type]
            daemon=True,
        )
        spare.start()
        wait_for("the standby to park", lambda: a.get_job().standbys == 1)
        b.close()  # b's agent dies: its stream closes without a Leave
        gen2 = first[0].generation + 1
        wait_for("s to open generation 2", lambda: a.get_job().summary.generation == gen2)
        with pytest.raises(LimitExceeded) as full:
            r.join_node(**kw)  # type: ignore[arg-type]
        assert full.value.reason == "WORLD_FULL" and full.value.metadata["seats_kept"] == "1"
        assert "seat(s) kept for nodes re-joining" in str(full.value)
        job = a.get_job()
        assert job.seats_kept == 1 and 0 < job.seats_kept_ms <= 10_000
        assert "1 seat(s) kept for nodes re-joining after the failure (" in render_job(job)
        page = api(daemon, f"/api/jobs/{job_id}", token=daemon.token)
        assert page["seats_kept"] == 1 and 0 < page["seats_kept_s"] <= 10
        again = a.join_node(**kw)  # type: ignore[arg-type]
        spare.join(20)
        (called,) = box
        assert isinstance(called, NodeMembership), called
        assert again.generation == called.generation == gen2
        assert {again.node_rank, called.node_rank} == {0, 1} and again.num_nodes == 2
        assert a.get_job().seats_kept == 0
    finally:
        for c in (a, b, s, r):
            c.close()
        daemon.kill()


def test_a_daemon_killed_while_seats_are_kept_keeps_them_after_its_restart(
    tmp_path: Path, job_id: str
) -> None:
    """Over the wire with SIGKILL: a and b run, b's agent dies, the standby s opens
    generation 2 keeping a's seat, and the daemon is killed. Restarted on its state
    directory, it fences generation 2 with generation 3, which keeps the seats: a
    newcomer is refused WORLD_FULL, and a (naming its seat) and s form it."""
    port = free_port()
    token = write_token(tmp_path / "tok")
    flags = ("--state-dir", str(tmp_path / "state"))
    d = spawn_daemon(tmp_path, *flags, token=token, listen=f"127.0.0.1:{port}")
    a, b, s, r = (RendezvousClient(d.endpoint, job_id, token=token) for _ in range(4))
    kw: dict[str, object] = dict(min_nodes=2, max_nodes=2, gpus_per_node=1, timeout=20)
    d2: DaemonProcess | None = None
    try:
        parallel([lambda: a.join_node(**kw), lambda: b.join_node(**kw)])  # type: ignore[arg-type]
        b.start_heartbeat(0.2)
        box: list[object] = []

        def stand_by() -> None:
            try:
                box.append(s.join_node(**kw, standby=True))  # type: ignore[arg-type]
            except RendezvousError as exc:
                box.append(exc)

        spare = threading.Thread(target=stand_by, daemon=True)
        spare.start()
        wait_for("the standby to park", lambda: a.get_job().standbys == 1)
        b.close()
        wait_for("s to open generation 2", lambda: a.get_job().seats_kept == 1)
        d.kill()  # SIGKILL: s's parked join is cut; its SDK sends it again (one retry)
        d2 = spawn_daemon(tmp_path, *flags, token=token, listen=f"127.0.0.1:{port}")
        job = a.get_job()
        assert job.summary.generation == 3 and job.seats_kept >= 1, job
        with pytest.raises(LimitExceeded) as full:
            r.join_node(**kw)  # type: ignore[arg-type]
        assert "seat(s) kept" in str(full.value)
        joined: list[object] = []

        def survive() -> None:
            try:
                joined.append(a.join_node(**kw))  # type: ignore[arg-type]
            except RendezvousError as exc:
                joined.append(exc)

        survivor = threading.Thread(target=survive, daemon=True)
        survivor.start()
        spare.join(25)
        first = list(box)
        if box and isinstance(box[0], RendezvousError):
            # The standby's join, cut by the SIGKILL, gave up under load (its 20 s or
            # its one retry spent before the restarted daemon answered; seen in two
            # loaded fresh-clone runs of ~12): it asks again, as rendezvous-run's
            # standby loop does.
            box[:] = [s.join_node(**kw, standby=True)]  # type: ignore[arg-type]
        survivor.join(25)
        (again,) = joined
        assert isinstance(again, NodeMembership), (again, first)
        (called,) = box
        assert isinstance(called, NodeMembership), (called, first)
        assert again.generation == called.generation == 3 and again.num_nodes == 2
    finally:
        for c in (a, b, s, r):
            c.close()
        (d2 or d).kill()


def test_a_loss_told_within_its_millisecond_still_has_its_time() -> None:
    """age_ms 0 means "unknown" (a loss from before a restart): one pushed within the
    millisecond it happened gave the rank told at once lost_at None, while a caller
    refused later got a time."""
    import time

    from rendezvousd.client.errors import FailedMember, failed_members
    from rendezvousd.common.members import FailedInfo
    from rendezvousd.server.answers import failed_member

    now = time.monotonic()
    told = failed_members([failed_member(FailedInfo(1, "h", "gone", 0, 1, now), now)])
    unknown = failed_members([failed_member(FailedInfo(1, "h", "gone", 0, 1, None), now)])
    assert isinstance(told[0], FailedMember) and told[0].lost_at is not None
    assert abs(told[0].lost_at - time.time()) < 1.0
    assert unknown[0].lost_at is None


def test_status_shows_a_generation_opened_after_the_job_ended_as_a_new_run(
    agents: list[RendezvousClient],
) -> None:
    """Over the wire: one node's run ends (it leaves), then a node of a two-node launch
    joins the same job id and waits; GetJob and ``status`` say that generation 2 is a
    new run and how long ago the last one ended. Once it forms, neither says it."""
    from rendezvousd.cli.probe import render_job

    join_all(agents[:1], 1, 1)
    agents[0].start_heartbeat(0.2)
    agents[0].leave()
    kw: dict[str, object] = dict(min_nodes=2, max_nodes=2, gpus_per_node=2, timeout=20)
    late = threading.Thread(target=agents[1].join_node, kwargs=kw, daemon=True)
    started = time.monotonic()
    late.start()
    wait_for("generation 2 to open", lambda: agents[2].get_job().summary.generation == 2)
    job = agents[2].get_job()
    assert job.summary.state == pb.JobState.JOB_STATE_FORMING
    assert 0 <= job.previous_run_ended_ms <= (time.monotonic() - started + 5) * 1000
    assert "a new run of this job id: its previous run ended " in render_job(job)
    agents[2].join_node(**kw)  # the run's second node: it forms
    late.join(30)
    formed = agents[2].get_job()
    assert formed.summary.state == pb.JobState.JOB_STATE_RUNNING, formed.summary
    assert not formed.HasField("previous_run_ended_ms")
    assert "a new run" not in render_job(formed)


def test_close_run_closes_a_failed_generation_to_the_nodes_launched_before_it(
    daemon: DaemonProcess, job_id: str, agents: list[RendezvousClient]
) -> None:
    """``close_run`` (docs/protocol.md, "A closed run"): node b fails and leaves for good;
    closing the failed generation (an ``abort`` of it changes nothing) refuses node a's
    re-join (launched before the close) with ``JobAborted`` naming the reason, where it
    opened the next generation and waited there; a node launched after the close
    starts a new run of the job id: it parks as any joiner."""
    from rendezvousd.client import JobAborted, RendezvousTimeout

    launched = time.monotonic()
    a, b, probe = agents
    joined = parallel(
        [
            lambda c=c: c.join_node(  # type: ignore[misc]
                min_nodes=2, max_nodes=2, gpus_per_node=1, timeout=20, launched=launched
            )
            for c in (a, b)
        ]
    )
    assert all(isinstance(m, NodeMembership) for m in joined), joined
    b.report_failure(0, "exit code -9")
    b.leave(final=True)
    assert probe.close_run("closed: node b stopped, no restarts left", generation=1) is True
    with pytest.raises(JobAborted) as info:
        a.join_node(min_nodes=2, max_nodes=2, gpus_per_node=1, timeout=20, launched=launched)
    said = str(info.value)
    assert "was closed" in said and "closed: node b stopped, no restarts left" in said, said
    assert probe.get_job().summary.generation == 1  # nothing opened
    late = RendezvousClient(daemon.endpoint, job_id, token=daemon.token)
    with late, pytest.raises(RendezvousTimeout):
        late.join_node(
            min_nodes=2, max_nodes=2, gpus_per_node=1, timeout=1, launched=time.monotonic()
        )


def test_a_run_closed_on_a_setup_error_tells_its_cause_to_the_nodes_it_refuses(
    agents: list[RendezvousClient],
) -> None:
    """A node agent that leaves on a setting of its own (its --ring-host gone from its
    host) closes the failed generation with the cause ``SETUP_ERROR``: a node that
    re-joins after the close is refused with that cause as data, which rendezvous-run
    ends on as a setup error (exit 2); the refusal carried only the words, and the
    node used a restart on it."""
    from rendezvousd.client import JobAborted
    from rendezvousd.client.membership import SETUP_ERROR

    launched = time.monotonic()
    a, b, _ = agents
    kw: dict[str, Any] = dict(min_nodes=2, max_nodes=2, gpus_per_node=1, timeout=20)
    joined = parallel([lambda c=c: c.join_node(launched=launched, **kw) for c in (a, b)])  # type: ignore[misc]
    assert all(isinstance(m, NodeMembership) for m in joined), joined
    b.report_failure(0, "its ring broke")
    b.leave()
    a.leave()
    words = "node 1 (host h2) left: its ring address is no longer an address of that host"
    assert b.close_run(words, cause=SETUP_ERROR) is True
    with pytest.raises(JobAborted) as info:
        a.join_node(launched=launched, **kw)
    assert info.value.closed, info.value
    assert (info.value.abort_cause, info.value.abort_reason) == (SETUP_ERROR, words)


def test_a_standby_parked_as_the_run_is_closed_hears_the_close_at_once(
    daemon: DaemonProcess, job_id: str, agents: list[RendezvousClient]
) -> None:
    """A standby parked beside a full world when the run is closed (``close_run`` of
    the failed generation, as a torchrun agent out of restarts makes it) is answered
    at once, ``JobAborted`` with ``closed``, naming the close: it stayed parked until its
    wait ended (no slot freed: every node of the failed round stays) and heard the
    close only on the join after. Node a, re-joining, is refused as closed too."""
    from rendezvousd.client import JobAborted

    launched = time.monotonic()
    a, b, probe = agents
    shape = {"min_nodes": 2, "max_nodes": 2, "gpus_per_node": 1, "launched": launched}
    joined = parallel([lambda c=c: c.join_node(timeout=20, **shape) for c in (a, b)])
    assert all(isinstance(m, NodeMembership) for m in joined), joined
    with RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as spare:
        answer: queue.Queue[object] = queue.Queue()

        def stand_by() -> None:
            try:
                answer.put(spare.join_node(timeout=60, standby=True, **shape))
            except Exception as exc:  # the answer under test, whatever it is
                answer.put(exc)

        threading.Thread(target=stand_by, daemon=True).start()
        wait_for("the standby to park", lambda: probe.get_job().standbys == 1)
        b.report_failure(0, "exit code 1")
        assert probe.get_job().standbys == 1  # no slot freed: it stays parked
        b.leave(final=True)
        assert probe.close_run("closed: node b stopped, no restarts left", generation=1)
        got = answer.get(timeout=30)
    assert isinstance(got, JobAborted) and got.closed, got
    said = str(got)
    assert "closed while this standby node waited" in said, said
    assert got.abort_reason == "closed: node b stopped, no restarts left", said
    with pytest.raises(JobAborted) as info:
        a.join_node(timeout=20, **shape)
    assert info.value.closed, info.value


def test_the_last_node_to_give_up_closes_the_run_for_a_standby_between_its_asks(
    daemon: DaemonProcess, job_id: str, agents: list[RendezvousClient]
) -> None:
    """Every node of a failed generation leaves for good (a final Leave: out of
    restarts): the run is closed, so a standby launched before, asking again as its
    wait ended, is refused as closed, naming the failure, and opens nothing. It took
    a seat in a new generation of the dead job and waited there, every join timeout,
    for ever (h122 D1)."""
    from rendezvousd.client import JobAborted

    launched = time.monotonic()
    a, b, probe = agents
    shape = {"min_nodes": 2, "max_nodes": 2, "gpus_per_node": 1, "launched": launched}
    joined = parallel([lambda c=c: c.join_node(timeout=20, **shape) for c in (a, b)])
    assert all(isinstance(m, NodeMembership) for m in joined), joined
    b.report_failure(0, "exit code -9")
    b.leave(final=True)
    a.leave(final=True)
    spare = RendezvousClient(daemon.endpoint, job_id, token=daemon.token)
    with spare, pytest.raises(JobAborted) as info:
        spare.join_node(timeout=20, standby=True, **shape)
    assert info.value.closed, info.value
    said = str(info.value)
    assert "every node of generation 1 gave up (no restarts left) or was stopped" in said, said
    assert "exit code -9" in said, said
    summary = probe.get_job().summary
    assert (summary.generation, summary.state) == (1, pb.JOB_STATE_FAILED), summary


@pytest.mark.parametrize("call_stream", [True, False])
def test_a_join_node_cut_while_its_round_forms_joins_the_next_round(
    daemon: DaemonProcess, job_id: str, call_stream: bool
) -> None:
    """A node agent's JoinNode cut by a connection blip while its round forms: the
    daemon reads the cut as the agent's death and fails the round, and the SDK's retry
    of the same join was answered PeerFailed naming this very node (by host alone: a
    FailedMember carries no instance id), which torchrun's handler listed as "the node
    joining from <its own host>" to replace. The retry now joins the next round. Unary
    too, where gRPC's own retry re-sends the JoinNode, unseen by the SDK."""
    proxy = GatedProxy(daemon.port)
    cut = RendezvousClient(proxy.endpoint, job_id, token=daemon.token, call_stream=call_stream)
    other = RendezvousClient(daemon.endpoint, job_id, token=daemon.token)
    join = {"min_nodes": 2, "max_nodes": 2, "gpus_per_node": 1, "timeout": 30}
    outcome: list[object] = []

    def join_cut() -> None:
        try:
            outcome.append(cut.join_node(host="cut-node", **join))
        except RendezvousError as exc:
            outcome.append(exc)

    try:
        t = threading.Thread(target=join_cut, daemon=True)
        t.start()

        def round_state() -> int | None:
            try:
                return other.get_job().summary.state
            except NotFound:
                return None

        wait_for("the cut node parked", lambda: round_state() == pb.JOB_STATE_FORMING)
        wait_for(
            "its JoinNode parked", lambda: scrape(daemon.metrics_url)["rendezvousd_waiters"] >= 1
        )
        proxy.gate.clear()
        proxy.cut()
        wait_for("the daemon to read the cut", lambda: round_state() == pb.JOB_STATE_FAILED)
        proxy.gate.set()
        # The retry first, while the round it was cut from is the job's latest.
        wait_for(
            "the cut node's retry answered",
            lambda: bool(outcome) or other.get_job().summary.generation == 2,
            20,
        )
        assert not outcome, outcome  # before: PeerFailed naming "cut-node", itself
        m = other.join_node(host="other-node", **join)
        t.join(30)
        (got,) = outcome
        assert isinstance(got, NodeMembership), got
        assert got.generation == m.generation == 2
    finally:
        cut.close()
        other.close()
        proxy.close()
