"""A real node agent process for tests: join_node, heartbeat, print one JSON line, hold.

The test kills it (kill -9) to see the daemon fail the generation when the node's one
heartbeat stream closes.
"""

from __future__ import annotations

import argparse
import json
import threading

from rendezvousd.client import RendezvousClient


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--endpoint", required=True)
    p.add_argument("--token-file", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--nodes", required=True, help="MIN:MAX")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--host", required=True)
    args = p.parse_args()
    low, high = (int(x) for x in args.nodes.split(":"))
    client = RendezvousClient(args.endpoint, args.job, token_file=args.token_file)
    m = client.join_node(
        min_nodes=low, max_nodes=high, gpus_per_node=args.gpus, host=args.host, timeout=30
    )
    client.start_heartbeat(0.2)
    print(json.dumps({"event": "joined", "node_rank": m.node_rank}), flush=True)
    threading.Event().wait(60)  # held until the test kills this process
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
