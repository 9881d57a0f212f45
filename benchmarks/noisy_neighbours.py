"""Noisy neighbours: one job misbehaves, within its limits, on a shared daemon while
another trains; how much does the well-behaved job feel it?

    python benchmarks/noisy_neighbours.py --attacks kv_max,keys,waiters --seconds 20

A daemon with default settings and ``--state-dir`` serves job B, two members (asyncio
SDK clients, one process) that every --period-s each run a barrier, a KvSet of 1 KiB
and a KvGet of the other's key, timing each call, and job A, whose attacker
processes (--procs of them, each a client of its own with --concurrency calls in
flight) run one attack at a time for --seconds, with A's own job token (``admin_*``
attacks: the admin's token, as ``rendezvousd status`` has). Before the attacks, B runs
one quiet phase of the same length: its baseline.

Attacks: ``kv_max`` (KvSets of max_value_bytes values over as many keys as A's bytes
allow, as fast as possible), ``keys`` (small KvSets, ever new keys, past
max_keys_per_job), ``barriers`` (a one-member job's barrier rounds, as fast as
possible), ``waiters`` (KvGet waits on keys never set, as many as A may park),
``churn`` (join and leave, each a new generation), ``admin_status`` (GetJob and
ListJobs with the admin token), ``health`` (grpc.health Check flood, no token),
``streams`` (many members of one job, each its heartbeat stream).

Prints one JSON document: per phase, B's p50/p99/max latency per operation, its errors
by kind and whether a member of B was lost (B's job not RUNNING at the phase's end),
the daemon's CPU (seconds per second) and RSS, B's largest heartbeat age as the
daemon's metrics said it, and A's calls done and refused, by the limit its refusals
name.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from _proc import cpu_s, status_kib
from _report import emit

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.cli.embedded import spawn
from rendezvousd.client import AsyncRendezvousClient, LimitExceeded, RendezvousError
from rendezvousd.server.scope import derive_job_token

ATTACKS = ("kv_max", "keys", "barriers", "waiters", "churn", "admin_status", "health", "streams")


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _refusal(error: BaseException) -> str:
    if isinstance(error, LimitExceeded):
        return f"limit:{error.limit}"
    return type(error).__name__


# -- job A: the attacker, one process per --procs -----------------------------------


async def _attack(args: argparse.Namespace) -> dict[str, Any]:
    done = 0
    refused: Counter[str] = Counter()
    words: dict[str, str] = {}
    end = time.monotonic() + args.seconds
    job = args.job
    token = args.token

    def note(error: BaseException) -> None:
        kind = _refusal(error)
        refused[kind] += 1
        words.setdefault(kind, str(error)[:300])

    if args.attack == "health":
        from grpc import aio
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        async with aio.insecure_channel(args.endpoint) as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            async def check() -> None:
                nonlocal done
                while time.monotonic() < end:
                    try:
                        await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
                        done += 1
                    except Exception as error:
                        note(error)

            await asyncio.gather(*(check() for _ in range(args.concurrency)))
        return {"done": done, "refused": dict(refused), "words": words}

    if args.attack == "streams":
        # Members of one big job, each a client (and so a heartbeat stream) of its own.
        world = args.concurrency * args.nprocs
        clients = [
            AsyncRendezvousClient(args.endpoint, job, token=token) for _ in range(args.concurrency)
        ]

        async def member(i: int, c: AsyncRendezvousClient) -> None:
            nonlocal done
            try:
                await c.join(
                    num_nodes=world,
                    gpus_per_node=1,
                    local_rank=0,
                    node_rank=args.proc * args.concurrency + i,
                    timeout=args.seconds + 30,
                )
                c.start_heartbeat()
                done += 1
                while time.monotonic() < end:
                    await asyncio.sleep(0.5)
            except Exception as error:
                note(error)

        await asyncio.gather(*(member(i, c) for i, c in enumerate(clients)))
        for c in clients:
            try:
                await asyncio.wait_for(c.close(), 10)
            except Exception as error:
                note(error)
        return {"done": done, "refused": dict(refused), "words": words}

    client = AsyncRendezvousClient(args.endpoint, job, token=token, call_timeout=20)
    if args.attack not in ("churn", "admin_status"):
        # One member per attacker process, one job of --nprocs.
        await client.join(
            num_nodes=args.nprocs, gpus_per_node=1, local_rank=0, node_rank=args.proc, timeout=60
        )
        client.start_heartbeat()
    value = os.urandom(args.value_bytes)
    counter = 0

    async def one() -> None:
        nonlocal done, counter
        while time.monotonic() < end:
            counter += 1
            n = counter
            try:
                if args.attack == "kv_max":
                    # Keys cycled over what A's bytes allow (64 MiB / 32 KiB = 2048 keys,
                    # shared by the processes): each set replaces a value.
                    await client.kv_set(f"p{args.proc}/k{n % args.keys}", value)
                elif args.attack == "keys":
                    await client.kv_set(f"p{args.proc}/k{n}", b"x")
                elif args.attack == "barriers":
                    await client.barrier(f"b{n % 4}" if args.nprocs == 1 else "b")
                elif args.attack == "waiters":
                    try:
                        await client.kv_get(f"never/{n}", wait=True, timeout=args.seconds)
                    except RendezvousError as error:
                        if "Timeout" not in type(error).__name__:
                            raise
                elif args.attack == "churn":
                    c = AsyncRendezvousClient(args.endpoint, job, token=token)
                    try:
                        await c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=20)
                        c.start_heartbeat()
                        await c.leave(final=False)
                    finally:
                        await c.close()
                elif args.attack == "admin_status":
                    if n % 2:
                        await client.list_jobs()
                    else:
                        await client.get_job(args.victim_job)
                done += 1
            except Exception as error:
                note(error)
                if args.attack in ("keys", "kv_max", "waiters"):
                    await asyncio.sleep(0.01)

    await asyncio.gather(*(one() for _ in range(args.concurrency)))
    try:
        await asyncio.wait_for(client.close(), 10)
    except Exception as error:
        note(error)
    return {"done": done, "refused": dict(refused), "words": words}


# -- job B: the victim, in the driver's process --------------------------------------


class Victim:
    def __init__(self, endpoint: str, job: str, token: str) -> None:
        self.job = job
        self.clients = [AsyncRendezvousClient(endpoint, job, token=token) for _ in range(2)]
        self.latency: dict[str, list[float]] = {"barrier": [], "kv_set": [], "kv_get": []}
        self.errors: Counter[str] = Counter()
        self.words: dict[str, str] = {}
        self.stop = asyncio.Event()
        self.failures: list[str] = []

    async def join(self) -> None:
        await asyncio.gather(
            *(
                c.join(num_nodes=2, gpus_per_node=1, local_rank=0, node_rank=i, timeout=60)
                for i, c in enumerate(self.clients)
            )
        )
        for c in self.clients:
            c.start_heartbeat(on_failure=self._lost)

    def _lost(self, error: RendezvousError) -> None:
        self.failures.append(str(error)[:300])

    async def _timed(self, op: str, call: Any) -> None:
        started = time.perf_counter()
        try:
            await call
        except Exception as error:
            kind = f"{op}:{_refusal(error)}"
            self.errors[kind] += 1
            self.words.setdefault(kind, str(error)[:300])
            return
        self.latency[op].append((time.perf_counter() - started) * 1000)

    async def run(self, period_s: float) -> None:
        async def member(i: int, c: AsyncRendezvousClient) -> None:
            step = 0
            while not self.stop.is_set():
                step += 1
                await self._timed("barrier", c.barrier("step", timeout=30))
                await self._timed("kv_set", c.kv_set(f"r{i}", os.urandom(1024)))
                await self._timed("kv_get", c.kv_get(f"r{1 - i}", wait=True, timeout=30))
                await asyncio.sleep(period_s)

        await asyncio.gather(*(member(i, c) for i, c in enumerate(self.clients)))

    def summary(self) -> dict[str, Any]:
        return {
            "latency_ms": {
                op: {
                    "n": len(v),
                    "p50": round(_pct(v, 0.5), 2),
                    "p99": round(_pct(v, 0.99), 2),
                    "max": round(max(v, default=0.0), 2),
                }
                for op, v in self.latency.items()
            },
            "errors": dict(self.errors),
            "error_words": self.words,
            "failures_heard": self.failures[:3],
        }


def _metric(url: str, name: str, label: str = "") -> float | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name) and label in line and not line.startswith("#"):
            return float(line.rsplit(" ", 1)[1])
    return None


def _attackers(
    name: str, args: argparse.Namespace, endpoint: str, job: str, token: str, victim_job: str
) -> list[subprocess.Popen[str]]:
    """Job A's attacker processes for one phase; the token goes in their environment,
    never on a command line."""
    nprocs = 1 if name == "churn" else args.procs
    concurrency = args.concurrency if name != "waiters" else args.waiters // nprocs
    procs = []
    for p in range(nprocs):
        cmd = [
            sys.executable,
            __file__,
            *("--attacker", name, "--endpoint", endpoint, "--job", job),
            *("--victim-job", victim_job, "--proc", str(p), "--nprocs", str(nprocs)),
            *("--seconds", str(args.seconds), "--concurrency", str(concurrency)),
        ]
        env = dict(os.environ, RDZV_BENCH_TOKEN=token)
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env))
    return procs


async def _phase(
    name: str,
    args: argparse.Namespace,
    daemon_pid: int,
    endpoint: str,
    admin: str,
    metrics_url: str,
) -> dict[str, Any]:
    # A job B of its own per phase: one phase's loss does not hide the next's.
    victim = Victim(endpoint, f"b-{name}", derive_job_token(admin, f"b-{name}"))
    await victim.join()
    job_a = f"a-{name}-{secrets.token_hex(3)}"
    token_a = admin if name.startswith("admin") else derive_job_token(admin, job_a)
    procs = (
        [] if name == "baseline" else _attackers(name, args, endpoint, job_a, token_a, victim.job)
    )
    cpu0, t0 = cpu_s(daemon_pid), time.monotonic()
    rss_max = 0
    hb_age_max = 0.0
    runner = asyncio.create_task(victim.run(args.period_s))
    end = t0 + args.seconds + (5 if name != "baseline" else 0)
    while time.monotonic() < end:
        await asyncio.sleep(1)
        rss_max = max(rss_max, status_kib(daemon_pid))
        age = await asyncio.to_thread(_metric, metrics_url, "rendezvousd_heartbeat_age_max_seconds")
        hb_age_max = max(hb_age_max, age or 0.0)
    victim.stop.set()
    await asyncio.wait_for(runner, 60)
    cpu = (cpu_s(daemon_pid) - cpu0) / (time.monotonic() - t0)
    attackers: list[Any] = []
    for proc in procs:
        # Off the loop: B's heartbeats are tasks on it.
        out, _ = await asyncio.to_thread(proc.communicate, timeout=120)
        try:
            attackers.append(json.loads(out.strip().splitlines()[-1]))
        except (ValueError, IndexError):
            attackers.append({"unreadable": out[-300:]})
    state = await victim.clients[0].get_job(victim.job)
    for c in victim.clients:
        await c.leave(final=True)
        await c.close()
    report: dict[str, Any] = {
        "victim": victim.summary(),
        "victim_state": pb.JobState.Name(state.summary.state),
        "victim_lost": [f"rank {f.rank}: {f.cause}" for f in state.failed],
        "daemon_cpu_per_s": round(cpu, 3),
        "daemon_rss_max_mib": round(rss_max / 1024, 1),
        "heartbeat_age_max_s": round(hb_age_max, 2),
    }
    if procs:
        done = sum(a.get("done", 0) for a in attackers)
        refused: Counter[str] = Counter()
        words: dict[str, str] = {}
        for a in attackers:
            refused.update(a.get("refused", {}))
            words.update(a.get("words", {}))
        report["attacker"] = {"done": done, "refused": dict(refused), "words": words}
    print(json.dumps({name: report}), file=sys.stderr, flush=True)
    return report


async def _drive(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "state"
        state.mkdir()
        daemon = spawn(Path(tmp), "--state-dir", str(state), metrics=True, exit_with_parent=True)
        try:
            admin = (Path(tmp) / "token").read_text().split()[0]
            phases = {}
            for name in ["baseline", *args.attacks]:
                phases[name] = await _phase(
                    name, args, daemon.proc.pid, daemon.endpoint, admin, daemon.metrics_url
                )
            return {"settings": vars(args) | {"attacks": args.attacks}, "phases": phases}
        finally:
            daemon.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attacks", default=",".join(ATTACKS))
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--period-s", type=float, default=0.05)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--waiters", type=int, default=8000)
    parser.add_argument("--json-out")
    # The attacker's side (internal).
    parser.add_argument("--attacker", choices=ATTACKS)
    parser.add_argument("--endpoint")
    parser.add_argument("--job")
    parser.add_argument("--victim-job")
    parser.add_argument("--proc", type=int, default=0)
    parser.add_argument("--nprocs", type=int, default=1)
    parser.add_argument("--value-bytes", type=int, default=32768)
    parser.add_argument("--keys", type=int, default=900)
    args = parser.parse_args()
    if args.attacker:
        args.attack = args.attacker
        args.token = os.environ["RDZV_BENCH_TOKEN"]
        print(json.dumps(asyncio.run(_attack(args))))
        return
    args.attacks = [a for a in args.attacks.split(",") if a]
    emit(asyncio.run(_drive(args)), args.json_out)


if __name__ == "__main__":
    main()
