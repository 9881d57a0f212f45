"""A worker that sends its node agent one bad frame (``--frame``), then keeps its alive
beats going and waits: only the agent's reading of that frame can end it.

``--before-assign``: sent while still a spare (after ``ready``, before any
assignment), else once assigned. Frames:

- ``nested``: a JSON header nested 100,000 levels deep (json's RecursionError);
- ``huge``: a state frame announcing a 2**40-byte payload it never sends;
- ``step``: a well-formed state frame for step 2**62;
- ``garbage``: a header that is not UTF-8 JSON;
- ``call``: a relayed daemon call whose payload is not a Call.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import threading

import numpy as np

from rendezvousd.trainer.agent.agent_worker import AgentLink

PREFIX = struct.Struct("!IQ")


def frame(kind: str) -> bytes:
    if kind == "nested":
        body = b'{"kind": "progress", "x": ' + b"[" * 100_000
        return PREFIX.pack(len(body), 0) + body
    if kind == "huge":
        body = json.dumps({"kind": "state", "step": 1, "arrays": []}).encode()
        return PREFIX.pack(len(body), 1 << 40) + body
    if kind == "call":
        body, payload = json.dumps({"kind": "call"}).encode(), b"\xff\xff\xff\xff"
        return PREFIX.pack(len(body), len(payload)) + body + payload
    if kind == "garbage":
        body = b"\xff\xfe not json"
        return PREFIX.pack(len(body), 0) + body
    raise ValueError(kind)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--frame", choices=["nested", "huge", "step", "garbage", "call"], required=True)
    p.add_argument("--before-assign", action="store_true")
    args = p.parse_args()
    link = AgentLink.from_env(os.environ)
    assert link is not None
    if args.before_assign:
        link.channel.send("ready", {"pid": os.getpid()})
        link.channel.sock.sendall(frame(args.frame))
        threading.Event().wait(30)
        return 3
    link.wait_assignment()
    # Before start(): its alive beats must not interleave with the raw frame.
    if args.frame == "step":
        link.save_state(1 << 62, {"w": np.zeros(2)}, {})
    else:
        link.channel.sock.sendall(frame(args.frame))
    stopped = threading.Event()
    link.start(lambda cause: stopped.set())
    stopped.wait(30)
    return 3


if __name__ == "__main__":
    sys.exit(main())
