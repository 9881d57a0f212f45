"""The daemon's own CPU per call, beside a bare grpc.aio server's: where a call's cost is.

    python benchmarks/rpc_cost.py [--calls 6000] [--concurrency 32] [--state-dir]

A client process (asyncio, one channel) makes --calls calls of each kind, --concurrency
at a time, after a warm-up round of the same; the parent reads the daemon's CPU seconds
(/proc, user + system) before and after each kind and divides. Kinds: KvGet, KvSet,
Barrier (a job of one rank, so it never waits), gRPC's Health.Check, and heartbeats
(--streams members of one job, each with a raw Heartbeat stream sending the next beat
as soon as the daemon acknowledges the last, counted from the acknowledgements).
The SDK's calls (KvGet, KvSet, Barrier) are measured per --transports: "stream", the
SDK's default (every call on the client's one CallBatches stream, where the calls
queued when the stream writes next share a message: with --concurrency 32 in flight
from one client, several per message), and "unary" (``call_stream=False``: one gRPC
call each); the client's own CPU per call is read too.

The anchor is the floor Python gRPC sets: the same client loop against a bare
``grpc.aio.server()`` holding only grpcio-health-checking's servicer, in its own process,
measured the same way, on the same event loop as the daemon (``--event-loop``: asyncio's
own, the daemon's default, or uvloop). Start-up, imports and connects are outside the measurement on
both sides. What our daemon adds to the floor is its interceptors (auth, decode guard,
budget), metrics, the state machine and (with --state-dir) the SQLite commit handed to
its writer thread, whose CPU is counted too.

The floor is a unary call, so ``rendezvousd_over_floor`` divides only our unary calls by
it: Health.Check and the SDK's calls with ``--transports unary`` (``kv_get_unary``...),
one gRPC call each on both sides. The SDK's stream transport (``*_stream``: several calls
per CallBatches message, their number set by what is queued when the stream writes) and
the heartbeat stream's beats get ``null`` there, with the reason in ``no_floor_for``:
dividing a batched stream's per-call CPU by a unary call's would credit us with the
batching as if it were the daemon's economy. Their floor would be a bare grpc.aio
stream-stream echo sent the same number of calls per message, which this benchmark does
not build; their absolute ``cpu_us_per_call`` is still reported. ``floor`` says what the
floor is. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _proc import cpu_s
from _report import emit

KINDS = ("kv_get", "kv_set", "barrier", "health", "heartbeat")


async def _client(args: argparse.Namespace) -> None:
    """Tells the parent "go KIND" before each measured round and "done KIND N" after."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
    from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
    from rendezvousd.client import AsyncRendezvousClient

    def say(*words: object) -> None:
        print(*words, flush=True)
        sys.stdin.readline()  # the parent has read the CPU clock

    async def rounds(kind: str, call: Any, per_name: bool = False) -> None:
        sem = asyncio.Semaphore(args.concurrency)

        async def one() -> None:
            async with sem:
                await call()

        async def lane() -> None:  # one task's share of the calls, in order
            for _ in range(args.calls // args.concurrency):
                await call()

        for measured in (False, True):
            if measured:
                say("go", kind)
            if per_name:
                await asyncio.gather(*[lane() for _ in range(args.concurrency)])
            else:
                await asyncio.gather(*[one() for _ in range(args.calls)])
        calls = args.calls // args.concurrency * args.concurrency if per_name else args.calls
        say("done", kind, calls)

    channel = grpc.aio.insecure_channel(args.endpoint)
    health = health_pb2_grpc.HealthStub(channel)
    if args.bare:
        await rounds("health", lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=30))
        return
    token = args.token
    solo = AsyncRendezvousClient(
        args.endpoint,
        f"cost-solo-{args.transport}",
        token_file=args.token_file,
        call_stream=args.transport == "stream",
    )
    await solo.join(num_nodes=1, gpus_per_node=1, node_rank=0, local_rank=0, timeout=60)
    solo.start_heartbeat()
    await solo.kv_set("k", b"v" * 64)
    await rounds("kv_get", lambda: solo.kv_get("k"))
    await rounds("kv_set", lambda: solo.kv_set("k", b"v" * 64))
    # One rank's rounds of a barrier are ordered, and names are capped: 32 names, each
    # called by one task in turn.
    names = itertools.cycle([f"b{i}" for i in range(args.concurrency)])
    await rounds("barrier", lambda: solo.barrier(next(names), timeout=30), per_name=True)
    await solo.leave()
    await solo.close()
    if args.sdk_only:
        return
    await rounds("health", lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=30))

    # Heartbeats: --streams one-rank jobs (a fresh set per round: a stream's end is
    # its member's loss), each sending its share of the beats on a raw stream as fast
    # as HTTP/2 flow control lets it, then half-closing; the daemon acknowledges only
    # every tenth of its timeout, so the round ends when every stream has ended.
    stub = pb_grpc.RendezvousStub(channel)
    metadata = (("authorization", f"Bearer {token}"),)
    per_stream = max(1, args.calls // args.streams)

    async def beats(job: str, ready: list[int], started: asyncio.Event) -> int:
        c = AsyncRendezvousClient(args.endpoint, job, token_file=args.token_file)
        await c.join(num_nodes=1, gpus_per_node=1, node_rank=0, local_rank=0, timeout=60)
        ready.append(1)
        # The member's own beat, as the SDK's session builds it (a private seam: the
        # SDK has no public way to send one beat).
        request: pb.HeartbeatRequest = c._s.heartbeat_request()

        async def requests() -> Any:
            await started.wait()
            for _ in range(per_stream):
                yield request

        async for _event in stub.Heartbeat(requests(), metadata=metadata, timeout=120):
            pass
        await c.close()
        return per_stream

    for measured in (False, True):
        started, ready = asyncio.Event(), []
        streams = [
            asyncio.create_task(beats(f"cost-{measured:d}-{i}", ready, started))
            for i in range(args.streams)
        ]
        # Every member joined before the clock starts (the joins are not beats).
        while len(ready) < args.streams:
            await asyncio.sleep(0.01)
        if measured:
            say("go", "heartbeat")
        started.set()
        sent = sum(await asyncio.gather(*streams))
    say("done", "heartbeat", sent)


def _measure(pid: int, client: subprocess.Popen[str]) -> dict[str, dict[str, float]]:
    assert client.stdout is not None and client.stdin is not None
    out: dict[str, dict[str, float]] = {}
    started: dict[str, tuple[float, float, float]] = {}
    for line in client.stdout:
        words = line.split()
        if words and words[0] == "go":
            started[words[1]] = (cpu_s(pid), cpu_s(client.pid), time.perf_counter())
        elif words and words[0] == "done":
            cpu0, client0, t0 = started[words[1]]
            calls = int(words[2])
            out[words[1]] = {
                "calls": calls,
                "cpu_us_per_call": round(1e6 * (cpu_s(pid) - cpu0) / calls, 1),
                "client_cpu_us_per_call": round(1e6 * (cpu_s(client.pid) - client0) / calls, 1),
                "calls_per_s": round(calls / (time.perf_counter() - t0), 1),
            }
        client.stdin.write("\n")
        client.stdin.flush()
    if client.wait(120) != 0:
        raise SystemExit(f"client failed with exit {client.returncode}")
    return out


def _spawn_client(args: argparse.Namespace, endpoint: str, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--role",
            "client",
            "--endpoint",
            endpoint,
            "--calls",
            str(args.calls),
            "--concurrency",
            str(args.concurrency),
            "--streams",
            str(args.streams),
            *extra,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


_BARE_SERVER = """
import asyncio, sys, grpc
from grpc_health.v1 import _async as health, health_pb2_grpc
async def main():
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    print(server.add_insecure_port("127.0.0.1:0"), flush=True)
    await server.start()
    await server.wait_for_termination()
if sys.argv[1] == "uvloop":
    import uvloop
    factory = uvloop.new_event_loop
else:
    factory = None
with asyncio.Runner(loop_factory=factory) as runner:
    runner.run(main())
"""


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rendezvousd.cli.embedded import spawn

    report: dict[str, Any] = {
        "benchmark": "rpc_cost",
        "calls": args.calls,
        "concurrency": args.concurrency,
        "streams": args.streams,
        "state_dir": bool(args.state_dir),
        "load_average_at_start": os.getloadavg()[0],
    }
    report["event_loop"] = args.event_loop
    bare = subprocess.Popen(
        [sys.executable, "-c", _BARE_SERVER, args.event_loop], stdout=subprocess.PIPE, text=True
    )
    try:
        assert bare.stdout is not None
        port = bare.stdout.readline().strip()
        client = _spawn_client(args, f"127.0.0.1:{port}", "--bare")
        report["bare_grpc_aio"] = _measure(bare.pid, client)
    finally:
        bare.kill()
        bare.wait()
    with tempfile.TemporaryDirectory() as tmp:
        persist = ["--state-dir", str(Path(tmp) / "state")] if args.state_dir else []
        loop = ("--event-loop", args.event_loop)
        daemon = spawn(Path(tmp), "--log-level", "WARNING", *loop, *persist)
        try:
            token = ("--token-file", str(daemon.token_file))
            for n, transport in enumerate(args.transports.split(",")):
                # The heartbeats and the health check do not use the SDK's calls:
                # measured once, with the first transport.
                extra = ("--transport", transport, *(("--sdk-only",) if n else ()))
                client = _spawn_client(args, daemon.endpoint, *token, *extra)
                measured = _measure(daemon.proc.pid, client)
                report.setdefault("rendezvousd", {}).update(
                    {k: v for k, v in measured.items() if k in ("health", "heartbeat")}
                )
                report["rendezvousd"].update(
                    {
                        f"{k}_{transport}": v
                        for k, v in measured.items()
                        if k not in ("health", "heartbeat")
                    }
                )
        finally:
            daemon.proc.terminate()
            daemon.proc.wait(30)
    # Like with like: the floor is a bare server's unary call, so only our unary calls
    # are divided by it; the calls batched on our CallBatches stream and the heartbeat
    # stream's beats have no bare floor of their transport here (null; see the docstring).
    floor = report["bare_grpc_aio"]["health"]["cpu_us_per_call"]
    report["floor"] = {
        "transport": "unary",
        "call": "grpc.health.v1.Health/Check on a bare grpc.aio server",
        "cpu_us_per_call": floor,
    }
    report["rendezvousd_over_floor"] = {
        k: round(v["cpu_us_per_call"] / floor, 2) if _unary(k) else None
        for k, v in report["rendezvousd"].items()
    }
    report["no_floor_for"] = {
        k: "a stream's calls against a unary floor would compare different transports"
        for k in report["rendezvousd"]
        if not _unary(k)
    }
    report["load_average_at_end"] = os.getloadavg()[0]
    return report


def _unary(kind: str) -> bool:
    """Whether ``kind`` (a key of the report's "rendezvousd") is one unary call each."""
    return kind == "health" or kind.endswith("_unary")


def _client_main(args: argparse.Namespace) -> None:
    args.token = Path(args.token_file).read_text().strip() if args.token_file else ""
    asyncio.run(_client(args))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--calls", type=int, default=6000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--streams", type=int, default=32, help="heartbeat streams (members)")
    p.add_argument("--state-dir", action="store_true", help="the daemon persists to SQLite")
    p.add_argument(
        "--event-loop",
        default="asyncio",
        choices=["asyncio", "uvloop"],
        help="the servers' event loop, the daemon's and the anchor's alike",
    )
    p.add_argument("--json-out")
    p.add_argument("--role", default="parent", choices=["parent", "client"])
    p.add_argument("--endpoint")
    p.add_argument("--token-file")
    p.add_argument("--bare", action="store_true")
    p.add_argument(
        "--transports",
        default="stream,unary",
        help="the SDK's calls: on its Calls stream, unary calls, or both (comma-separated)",
    )
    p.add_argument("--transport", default="stream", choices=["stream", "unary"])
    p.add_argument("--sdk-only", action="store_true")
    args = p.parse_args()
    if args.role == "client":
        _client_main(args)
        return
    emit(run(args), args.json_out)


if __name__ == "__main__":
    main()
