"""The daemon's own CPU per call, beside a bare grpc.aio server's: where a call's cost is.

    python benchmarks/rpc_cost.py [--calls 6000] [--concurrency 32] [--state-dir]

Kinds. KvGet, KvSet and Barrier (a job of one rank, so it never waits), made by the SDK
per --transports: "stream", its default (every call on the client's one CallBatches
stream; the calls queued when the stream writes next share a message: with
--concurrency 32 in flight from one client, ~32 per message), and "unary"
(``call_stream=False``: one gRPC call each); gRPC's Health.Check; and heartbeats:
--streams one-rank jobs, each member's beats on a raw Heartbeat stream, --calls in all,
sent as fast as HTTP/2 flow control lets them (the daemon acknowledges only the first
and then every tenth of its timeout), then half-closed; the round ends when every
stream has ended (the daemon reads that end as the member's loss, inside the clock).

How both sides are measured, alike. One client process (asyncio, one channel) per
server, started after it; each kind is a warm-up round, then a measured round of the
same. The parent reads the server process's CPU (its POSIX CPU clock: user + system of
every thread, the daemon's SQLite writer with --state-dir included, to the
nanosecond; /proc's ticks where that clock cannot be read) and the client's, when the
client says the measured round starts and again when it has ended, and divides by the
calls. Start-up, imports, joins, connects and the streams' opening (a heartbeat
stream's first frames may race the clock, alike on both sides) are outside the clock
on both sides, and so is the close of the heartbeat members' own clients. The client
also reads the messages its connections sent and received in the round (gRPC's
channelz counters): ``messages_sent``, ``messages_received``, ``calls_per_message``.

The anchors: a bare ``grpc.aio.server()`` (``_bare_grpc.py``), in its own process, on
the same event loop as the daemon (``--event-loop``: asyncio's own, the daemon's
default, or uvloop), measured after the daemon in the same run. Each of our kinds is
divided by the anchor of its own transport (``rendezvousd_over_floor``; ``floor`` says,
per kind, what its anchor is and its CPU per call):

- Unary calls (``health``, ``*_unary``): grpcio-health-checking's Health.Check, the
  same client loop (--calls, --concurrency at a time).
- The SDK's stream (``*_stream``): the same method and messages on a bare
  ``CallBatches``: CallBatch messages of the same requests (the same fields and sizes,
  the same bearer metadata), as many messages for as many calls as our stream sent in
  this run (the calls spread evenly over them), at most --concurrency calls unanswered,
  the next message sent as soon as there is room; each batch is answered at once by one
  ReplyBatch of a canned Reply per call, of the call's field and our reply's size
  (a Barrier's sequence within a byte).
  Why these messages and not bytes echoed back: the wire is then the same both ways
  (the same frames, sizes and messages each way: compare ``messages_received``), and
  the server does what any server of the protocol must do per call (gRPC decodes the
  CallBatch, as the daemon's deserializer does; the id and field are read; the Reply is
  written by hand, as the daemon writes its own), and nothing more. An echo of bytes
  would answer no call, and would put the requests, not replies, on the wire back.
  Dividing a batched stream's per-call CPU by a unary call's instead would credit the
  batching to the daemon.
- Heartbeats: a bare ``Heartbeat``: as many streams, the same beats (a member's
  HeartbeatRequest, decoded by gRPC), sent and ended the same way; it acknowledges the
  first beat and then one a second at most, as the daemon does at its default timeout.

The floors' client is this benchmark's own loop, not the SDK: its client CPU is not
the SDK's. What our daemon adds to a floor is its interceptors (auth, decode guard,
budget), metrics, the state machine, per call on the stream its dispatch and deadline,
per heartbeat stream the member's attach and loss, and (with --state-dir) the SQLite
commit. ``no_floor_for`` names a kind whose anchor was not measured (none, unless a
kind is added). Prints one JSON document.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _bare_grpc import KV_VALUE, BatchedCalls, message_sizes, messages
from _proc import cpu_s
from _report import emit

KINDS = ("kv_get", "kv_set", "barrier", "health", "heartbeat")


async def _client(args: argparse.Namespace) -> None:
    """Tells the parent "go KIND" before each measured round and "done KIND N SENT
    RECEIVED" after (N calls; the messages this process sent and received meanwhile)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
    from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc

    counted: list[tuple[int, int]] = []

    def say(*words: object) -> None:
        print(*words, flush=True)
        sys.stdin.readline()  # the parent has read the CPU clock

    def go(kind: str) -> None:
        counted[:] = [messages()]
        say("go", kind)

    def done(kind: str, calls: int) -> None:
        sent, received = messages()
        say("done", kind, calls, sent - counted[0][0], received - counted[0][1])

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
                go(kind)
            if per_name:
                await asyncio.gather(*[lane() for _ in range(args.concurrency)])
            else:
                await asyncio.gather(*[one() for _ in range(args.calls)])
        done(kind, args.calls // args.concurrency * args.concurrency if per_name else args.calls)

    channel = grpc.aio.insecure_channel(args.endpoint)
    health = health_pb2_grpc.HealthStub(channel)
    stub = pb_grpc.RendezvousStub(channel)
    per_stream = max(1, args.calls // args.streams)

    async def heartbeats(open_stream: Any) -> None:
        """--streams streams (a fresh set per round), each sending its share of the beats
        as fast as HTTP/2 flow control lets it, then half-closing; the round ends when
        every stream has ended. ``open_stream(job, ready, started)`` readies a stream
        (outside the clock) and says so in ``ready``, sends once ``started`` is set, and
        returns what to close once the round is measured (outside the clock too)."""
        for measured in (False, True):
            started, ready = asyncio.Event(), []
            streams = [
                asyncio.create_task(open_stream(f"cost-{measured:d}-{i}", ready, started))
                for i in range(args.streams)
            ]
            while len(ready) < args.streams:
                await asyncio.sleep(0.01)
            if measured:
                go("heartbeat")
            started.set()
            closers = await asyncio.gather(*streams)
            if measured:
                done("heartbeat", per_stream * args.streams)
            for close in closers:
                await close()

    async def send_beats(request: Any, started: asyncio.Event, metadata: Any) -> None:
        async def requests() -> Any:
            await started.wait()
            for _ in range(per_stream):
                yield request

        async for _event in stub.Heartbeat(requests(), metadata=metadata, timeout=120):
            pass

    if args.bare:
        await rounds("health", lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=30))
        # What the SDK sends: its bearer token (the daemon's is 43 characters), and the
        # requests of a member of a one-rank job.
        metadata = (("authorization", "Bearer " + "t" * 43),)
        member = {
            "job_id": "cost-solo-stream",
            "generation": 1,
            "rank": 0,
            "instance_id": secrets.token_hex(16),
        }
        requests = {
            "kv_get": pb.KvGetRequest(key="k", wait_timeout_ms=30_000, **member),
            "kv_set": pb.KvSetRequest(key="k", value=KV_VALUE, **member),
            "barrier": pb.BarrierRequest(name="b0", sequence=100, wait_timeout_ms=30_000, **member),
        }
        stream = BatchedCalls(channel, metadata, args.concurrency)
        for plan in filter(None, args.plans.split(",")):
            kind, calls, sent = plan.split(":")
            field = kind.removesuffix("_stream")
            sizes = message_sizes(int(calls), int(sent), args.concurrency)
            await stream.round(field, requests[field], sizes)  # the warm-up
            go(kind)
            done(kind, await stream.round(field, requests[field], sizes))
        await stream.close()

        async def bare_beats(job: str, ready: list[int], started: asyncio.Event) -> Any:
            request = pb.HeartbeatRequest(
                job_id=job, generation=1, rank=0, instance_id=secrets.token_hex(16)
            )
            ready.append(1)
            await send_beats(request, started, metadata)
            return _nothing

        await heartbeats(bare_beats)
        return

    from rendezvousd.client import AsyncRendezvousClient

    solo = AsyncRendezvousClient(
        args.endpoint,
        f"cost-solo-{args.transport}",
        token_file=args.token_file,
        call_stream=args.transport == "stream",
    )
    await solo.join(num_nodes=1, gpus_per_node=1, node_rank=0, local_rank=0, timeout=60)
    solo.start_heartbeat()
    await solo.kv_set("k", KV_VALUE)
    await rounds("kv_get", lambda: solo.kv_get("k"))
    await rounds("kv_set", lambda: solo.kv_set("k", KV_VALUE))
    # One rank's rounds of a barrier are ordered, and names are capped: 32 names, each
    # called by one task in turn.
    names = itertools.cycle([f"b{i}" for i in range(args.concurrency)])
    await rounds("barrier", lambda: solo.barrier(next(names), timeout=30), per_name=True)
    await solo.leave()
    await solo.close()
    if args.sdk_only:
        return
    await rounds("health", lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=30))

    # Heartbeats: one-rank jobs, each member's beats on a raw stream (its end is the
    # member's loss: a fresh set of jobs per round); the daemon acknowledges only every
    # tenth of its timeout. The members' own clients close after the round.
    metadata = (("authorization", f"Bearer {args.token}"),)

    async def beats(job: str, ready: list[int], started: asyncio.Event) -> Any:
        c = AsyncRendezvousClient(args.endpoint, job, token_file=args.token_file)
        await c.join(num_nodes=1, gpus_per_node=1, node_rank=0, local_rank=0, timeout=60)
        ready.append(1)
        # The member's own beat, as the SDK's session builds it (a private seam: the
        # SDK has no public way to send one beat).
        await send_beats(c._s.heartbeat_request(), started, metadata)
        return c.close

    await heartbeats(beats)


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread's, ended threads' too) process ``pid``
    has used: its POSIX CPU clock (Linux's clock id for a pid, as clock_getcpuclockid
    makes it), read to the nanosecond. /proc's utime + stime is the same sum in 10 ms
    ticks: 48 ms of CPU, a stream floor's 6,000 calls, would be ±20 %. That where the
    clock cannot be read."""
    try:
        return time.clock_gettime((~pid << 3) | 2)
    except OSError:
        return cpu_s(pid)


async def _nothing() -> None:
    """What a bare stream leaves to close after its round."""


def _measure(pid: int, client: subprocess.Popen[str]) -> dict[str, dict[str, float]]:
    assert client.stdout is not None and client.stdin is not None
    out: dict[str, dict[str, float]] = {}
    started: dict[str, tuple[float, float, float]] = {}
    for line in client.stdout:
        words = line.split()
        if words and words[0] == "go":
            started[words[1]] = (_cpu_s(pid), _cpu_s(client.pid), time.perf_counter())
        elif words and words[0] == "done":
            cpu0, client0, t0 = started[words[1]]
            calls, sent, received = map(int, words[2:5])
            out[words[1]] = {
                "calls": calls,
                "cpu_us_per_call": round(1e6 * (_cpu_s(pid) - cpu0) / calls, 1),
                "client_cpu_us_per_call": round(1e6 * (_cpu_s(client.pid) - client0) / calls, 1),
                "calls_per_s": round(calls / (time.perf_counter() - t0), 1),
                # On the client's connections (gRPC's channelz), while it was measured.
                "messages_sent": sent,
                "messages_received": received,
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
    with tempfile.TemporaryDirectory() as tmp:
        persist = ["--state-dir", str(Path(tmp) / "state")] if args.state_dir else []
        loop = ("--event-loop", args.event_loop)
        daemon = spawn(Path(tmp), "--log-level", "WARNING", *loop, *persist, exit_with_parent=True)
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
    ours = report["rendezvousd"]
    for v in ours.values():
        v["calls_per_message"] = round(v["calls"] / max(1, v["messages_sent"]), 2)
    # The bare server after ours: its stream floor sends the calls per message our
    # stream sent in this run (each stream kind's calls over the messages it took).
    plans = ",".join(
        f"{k}:{v['calls']}:{v['messages_sent']}" for k, v in ours.items() if _batched(k)
    )
    bare = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("_bare_grpc.py")), args.event_loop],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert bare.stdout is not None
        port = bare.stdout.readline().strip()
        client = _spawn_client(args, f"127.0.0.1:{port}", "--bare", "--plans", plans)
        report["bare_grpc_aio"] = floors = _measure(bare.pid, client)
    finally:
        bare.kill()
        bare.wait()
    for v in floors.values():
        v["calls_per_message"] = round(v["calls"] / max(1, v["messages_sent"]), 2)
    # Like with like: each of our kinds against the bare server's of its transport.
    # Unary calls against Health.Check; the calls batched on our CallBatches stream
    # against the bare CallBatches echo sent as many calls per message; the heartbeat
    # stream's beats against the bare Heartbeat stream's.
    report["floor"] = {}
    for k in ours:
        if _unary(k):
            floor_kind, what = "health", _UNARY_FLOOR
        elif k == "heartbeat":
            floor_kind, what = "heartbeat", _HEARTBEAT_FLOOR
        else:
            floor_kind, what = k, _STREAM_FLOOR
        if floor_kind in floors:
            report["floor"][k] = {
                "transport": "unary" if _unary(k) else "stream",
                "call": what,
                "bare_kind": floor_kind,
                "calls_per_message": floors[floor_kind]["calls_per_message"],
                "cpu_us_per_call": floors[floor_kind]["cpu_us_per_call"],
            }
    # (A floor of 0: under /proc's 10 ms tick, too few --calls to divide by.)
    report["rendezvousd_over_floor"] = {
        k: round(v["cpu_us_per_call"] / report["floor"][k]["cpu_us_per_call"], 2)
        if report["floor"].get(k, {}).get("cpu_us_per_call")
        else None
        for k, v in ours.items()
    }
    report["no_floor_for"] = {
        k: "no bare kind of its transport was measured" for k in ours if k not in report["floor"]
    }
    report["load_average_at_end"] = os.getloadavg()[0]
    return report


_UNARY_FLOOR = "grpc.health.v1.Health/Check on a bare grpc.aio server: one unary call each"
_STREAM_FLOOR = (
    "CallBatches on a bare grpc.aio server (_bare_grpc.py): the same CallBatch messages, "
    "as many calls per message as ours were sent, each batch answered at once by one "
    "ReplyBatch of canned Replies of the calls' fields"
)
_HEARTBEAT_FLOOR = (
    "Heartbeat on a bare grpc.aio server (_bare_grpc.py): the same beats on as many "
    "streams, each beat decoded, the first and then one a second acknowledged"
)


def _unary(kind: str) -> bool:
    """Whether ``kind`` (a key of the report's "rendezvousd") is one unary call each."""
    return kind == "health" or kind.endswith("_unary")


def _batched(kind: str) -> bool:
    """Whether ``kind`` is the SDK's calls on its CallBatches stream."""
    return kind.endswith("_stream")


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
    p.add_argument("--plans", default="", help="(the bare client's) KIND:CALLS:MESSAGES,...")
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
