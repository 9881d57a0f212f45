"""A real worker process for tests: join, then run a scripted action.

Prints one JSON line per event on stdout so the test can follow it:
{"event": "joined", "rank": ...}, {"event": "error", "type": ..., "ranks": ...}.
"""

from __future__ import annotations

import argparse
import sys
import threading

from report import emit, joined

from rendezvousd.client import RendezvousClient, RendezvousError


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--endpoint", required=True)
    p.add_argument("--token-file", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--node-rank", type=int)
    p.add_argument("--local-rank", type=int, required=True)
    p.add_argument("--host", default=None)
    p.add_argument("--action", choices=["hold", "barrier", "kv-wait", "leave"], default="hold")
    p.add_argument("--hold-s", type=float, default=60.0)
    p.add_argument("--heartbeat-s", type=float, default=0.5)
    args = p.parse_args()
    client = RendezvousClient(
        args.endpoint, args.job, token_file=args.token_file, connect_timeout=10
    )
    try:
        m = client.join(
            num_nodes=args.nodes,
            gpus_per_node=args.gpus,
            node_rank=args.node_rank,
            local_rank=args.local_rank,
            host=args.host,
            timeout=30,
        )
        joined(m)
        failed = threading.Event()
        client.start_heartbeat(args.heartbeat_s, on_failure=lambda _error: failed.set())
        if args.action == "barrier":
            client.barrier("sync", timeout=args.hold_s)
            emit("barrier-passed")
        elif args.action == "kv-wait":
            client.kv_get("never-set", timeout=args.hold_s)
        elif args.action == "leave":
            client.leave()
            emit("left")
            return 0
        else:
            failed.wait(args.hold_s)
        client.raise_if_failed()
        emit("done")
        return 0
    except RendezvousError as exc:
        emit(
            "error",
            type=type(exc).__name__,
            message=str(exc),
            ranks=exc.metadata.get("ranks", ""),
            reason=exc.reason,
        )
        return 3
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
