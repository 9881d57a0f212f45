"""Joins against a real daemon process: worlds, rejections, id rules, inspection."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import subprocess
import sys
import threading

import pytest

from rendezvousd.client import (
    AsyncRendezvousClient,
    DuplicateRank,
    IdConflict,
    InvalidRequest,
    Membership,
    RendezvousClient,
    RendezvousTimeout,
    TopologyMismatch,
)
from tests.support import DaemonProcess, InProcessDaemon, worker_cmd


def test_two_nodes_by_two_workers_as_real_processes(daemon: DaemonProcess, job_id: str) -> None:
    procs = [
        subprocess.Popen(
            worker_cmd(daemon, job_id, 2, 2, n, g, "--action", "leave"),
            stdout=subprocess.PIPE,
            text=True,
        )
        for n in range(2)
        for g in range(2)
    ]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], outs
    joined = [json.loads(o.splitlines()[0]) for o in outs]
    assert sorted(j["rank"] for j in joined) == [0, 1, 2, 3]
    assert {j["world_size"] for j in joined} == {4}
    assert len({j["id_sha256"] for j in joined}) == 1  # every rank got the same id


async def test_sixteen_nodes_by_eight_gpus_async(
    inproc_daemon: InProcessDaemon, job_id: str
) -> None:
    nodes, gpus = 16, 8
    clients = [inproc_daemon.client(job_id) for _ in range(nodes * gpus)]
    try:
        results: list[Membership] = await asyncio.gather(
            *[
                c.join(
                    num_nodes=nodes,
                    gpus_per_node=gpus,
                    node_rank=i // gpus,
                    local_rank=i % gpus,
                    host=f"node{i // gpus}",
                    timeout=60,
                )
                for i, c in enumerate(clients)
            ]
        )
        assert sorted(m.rank for m in results) == list(range(128))
        assert {m.unique_id for m in results} == {results[0].unique_id}
        assert len(results[0].unique_id) == 128
        # The join answer is slim: the table is fetched on demand. The daemon runs in
        # this event loop, so the fetch must not block it.
        table = await clients[5].fetch_members()
        assert table is results[5].members
        assert [m.rank for m in table] == list(range(128))
        assert all(m.host == f"node{m.node_rank}" for m in table)
        await asyncio.gather(*[c.barrier("after-join", timeout=30) for c in clients])
    finally:
        await asyncio.gather(*[c.close() for c in clients])


def _join_thread(
    d: DaemonProcess, job: str, out: dict[int, object], **kw: object
) -> threading.Thread:
    def run() -> None:
        c = RendezvousClient(d.endpoint, job, token=d.token)
        try:
            m = c.join(**kw)  # type: ignore[arg-type]
            out[m.rank] = m
        except Exception as exc:
            out[-1 - len(out)] = exc
        finally:
            c.close()

    t = threading.Thread(target=run)
    t.start()
    return t


def test_assigned_node_ranks_group_local_ranks_by_host(daemon: DaemonProcess, job_id: str) -> None:
    out: dict[int, object] = {}
    threads = [
        _join_thread(
            daemon, job_id, out, num_nodes=2, gpus_per_node=2, local_rank=g, host=h, timeout=30
        )
        for h in ("hostB", "hostA")
        for g in (1, 0)
    ]
    for t in threads:
        t.join(60)
    members = [m for k, m in out.items() if k >= 0]
    assert len(members) == 4, out
    by_host = {(m.members[m.rank].host, m.node_rank) for m in members}  # type: ignore[attr-defined]
    assert len({h for h, _ in by_host}) == 2 and len(by_host) == 2  # one node rank per host


def test_a_relaunch_beside_the_running_run_is_told_that_run_still_runs(
    daemon: DaemonProcess, job_id: str
) -> None:
    """A second srun step (same job id) while the first still trains: its ranks were told
    to give each worker its own node_rank, and searched their numbering for the fault."""
    running = [RendezvousClient(daemon.endpoint, job_id, token=daemon.token) for _ in range(2)]
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            joins = [
                pool.submit(c.join, num_nodes=1, gpus_per_node=2, local_rank=g, timeout=30)
                for g, c in enumerate(running)
            ]
            for j in joins:
                j.result(60)
        for c in running:
            c.start_heartbeat(0.5)
        with (
            RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as relaunch,
            pytest.raises(DuplicateRank) as refused,
        ):
            relaunch.join(num_nodes=1, gpus_per_node=2, local_rank=1, timeout=10)
        said = str(refused.value)
        assert f"another run of job '{job_id}' is still running (generation 1, 2 ranks" in said
        assert f"`rendezvousd status {job_id}` shows that run" in said, said
        assert "node_rank=None" not in said, said
    finally:
        for c in running:
            c.close()


async def _park_rank_2(
    d: InProcessDaemon, job_id: str, *, timeout: float
) -> tuple[AsyncRendezvousClient, asyncio.Task[Membership]]:
    """A 2 x 2 job's rank 2 (node 1, local rank 0), parked in its Join for ``timeout`` s."""
    client = d.client(job_id)
    joined = asyncio.create_task(
        client.join(num_nodes=2, gpus_per_node=2, node_rank=1, local_rank=0, timeout=timeout)
    )
    await d.until("rank 2 parked in Join", lambda: d.members_present(job_id) == 1)
    return client, joined


async def test_rejections_name_the_problem(inproc_daemon: InProcessDaemon, job_id: str) -> None:
    d = inproc_daemon
    holder_client, holder = await _park_rank_2(d, job_id, timeout=3)
    async with d.client(job_id) as c:
        with pytest.raises(DuplicateRank, match="rank 2"):
            await c.join(num_nodes=2, gpus_per_node=2, node_rank=1, local_rank=0, timeout=2)
        with pytest.raises(InvalidRequest, match="node_rank=2 is out of range"):
            await c.join(num_nodes=2, gpus_per_node=2, node_rank=2, local_rank=0, timeout=2)
        for bad, message in ((b"x" * 5, "exactly 128 bytes"), (bytes(128), "all zero")):
            with pytest.raises(InvalidRequest, match=message):
                await c.join(
                    num_nodes=2,
                    gpus_per_node=2,
                    node_rank=0,
                    local_rank=0,
                    unique_id=bad,
                    timeout=2,
                )
    with pytest.raises(RendezvousTimeout) as timeout:
        await holder
    await holder_client.close()
    assert timeout.value.missing_ranks == [0, 1, 3] and "missing ranks" in str(timeout.value)


async def test_topology_mismatch_fails_the_waiting_joiner_too(
    inproc_daemon: InProcessDaemon, job_id: str
) -> None:
    d = inproc_daemon
    holder_client, holder = await _park_rank_2(d, job_id, timeout=30)
    async with d.client(job_id) as c:
        with pytest.raises(TopologyMismatch, match=r"num_nodes=2 gpus_per_node=2.*num_nodes=3"):
            await c.join(
                num_nodes=3, gpus_per_node=2, node_rank=1, local_rank=1, host="odd", timeout=2
            )
    # The parked joiner is told at once, not at its 30 s join timeout.
    with pytest.raises(TopologyMismatch, match="'odd'") as info:
        await asyncio.wait_for(holder, 5)
    await holder_client.close()
    assert info.value.metadata["requested_topology"] == "3x2"


async def test_second_different_id_is_refused_and_first_kept(
    inproc_daemon: InProcessDaemon, job_id: str
) -> None:
    d = inproc_daemon
    first, second = b"\x11" * 128, b"\x22" * 128
    async with d.client(job_id) as rank0, d.client(job_id) as c:
        t0 = asyncio.create_task(
            rank0.join(
                num_nodes=1, gpus_per_node=2, node_rank=0, local_rank=0, unique_id=first, timeout=20
            )
        )
        await d.until("rank 0 parked in Join", lambda: d.members_present(job_id) == 1)
        # The PublishId path: a second "rank 0" instance cannot overwrite the id.
        with pytest.raises((IdConflict, DuplicateRank)):
            await c.join(
                num_nodes=1, gpus_per_node=2, node_rank=0, local_rank=0, unique_id=second, timeout=2
            )
        m = await c.join(num_nodes=1, gpus_per_node=2, node_rank=0, local_rank=1, timeout=20)
        assert m.unique_id == first
        assert (await t0).unique_id == first
        await c.leave()
        await rank0.leave()


def test_inspection_shows_members_but_never_the_id(daemon: DaemonProcess, job_id: str) -> None:
    uid = b"\x5a" * 128
    with RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as c:
        c.join(
            num_nodes=1,
            gpus_per_node=1,
            node_rank=0,
            local_rank=0,
            unique_id=uid,
            host="inspect-host",
        )
        job = c.get_job()
        assert job.summary.world_size == 1 and job.id_published
        assert job.members[0].member.host == "inspect-host"
        assert uid not in job.SerializeToString()
        assert any(j.job_id == job_id for j in c.list_jobs())
        c.leave()
    status = subprocess.run(
        [
            sys.executable,
            "-m",
            "rendezvousd.cli",
            "status",
            "--endpoint",
            daemon.endpoint,
            "--token-file",
            str(daemon.token_file),
            job_id,
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert status.returncode == 0, status.stderr
    assert job_id in status.stdout and "inspect-host" in status.stdout and "ENDED" in status.stdout
    assert uid.hex() not in daemon.log() and daemon.token not in daemon.log()


async def test_join_storm_beyond_grpc_pending_call_limits(
    daemon: DaemonProcess, job_id: str
) -> None:
    """gRPC core cancels pending calls past 1000/3000 unless the daemon raises the
    limits; 3200 ranks parked at once in one job must all be answered."""
    import grpc

    from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
    from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc

    world = 3200
    # 16 connections: each may open --max-concurrent-streams (256) calls at once,
    # and a client queues any more behind them.
    conns = 16
    channels = [
        grpc.aio.insecure_channel(daemon.endpoint, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(conns)
    ]
    stubs = [pb_grpc.RendezvousStub(c) for c in channels]
    auth = (("authorization", f"Bearer {daemon.token}"),)

    async def join(rank: int) -> int:
        request = pb.JoinRequest(
            job_id=job_id,
            topology=pb.Topology(num_nodes=world, gpus_per_node=1),
            node_rank=rank,
            local_rank=0,
            host=f"h{rank}",
            instance_id=f"i{rank}",
            wait_timeout_ms=60_000,
            unique_id=b"\x01" * 128 if rank == 0 else b"",
        )
        response = await stubs[rank % conns].Join(request, timeout=90, metadata=auth)
        return int(response.rank)

    try:
        ranks = await asyncio.gather(*[join(r) for r in range(world)])
        assert sorted(ranks) == list(range(world))
    finally:
        await asyncio.gather(*[c.close() for c in channels])
