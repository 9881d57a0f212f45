"""A worker under rendezvous-run whose node agent the test stops (SIGSTOP) while the
worker makes a relayed daemon call: it reports how that call ended, how long it took
and which way its calls go now. It writes straight to the stdout it shares with the
stopped agent, and leaves without a word to the agent (which cannot read it).

``fill`` (second argument): first it saves a state far larger than its channel to the
agent, from a thread, so that the call's frame finds the channel full and held."""

from __future__ import annotations

import os
import select
import sys
import threading
import time
from pathlib import Path

import numpy as np
from report import emit

from rendezvousd.client import RendezvousError
from rendezvousd.trainer.distributed import init_distributed

go = Path(sys.argv[1])  # created by the test once the agent is stopped
ctx = init_distributed()
rdzv = ctx.rendezvous
emit("ready", rank=ctx.topology.rank, route=rdzv.call_route)
while not go.exists():
    time.sleep(0.05)
if sys.argv[2:] == ["fill"]:
    state = {"w": np.zeros(16 << 20)}  # 128 MiB: the stopped agent reads none of it
    threading.Thread(target=ctx.save_state, args=(1, state), daemon=True).start()
    # Until the state's send holds the channel and the socket takes no more: a fixed
    # 0.5 s was short of that under load (the state still being copied), the call's
    # frame went out first, waited unanswered and ended RELAY_STALLED.
    assert ctx.agent is not None
    channel = ctx.agent.channel
    full = time.monotonic() + 60
    while not (channel._send_lock.locked() and not select.select([], [channel.sock], [], 0)[1]):
        if time.monotonic() > full:
            emit("answered", error="the channel never filled", message="", took=0.0)
            os._exit(0)
        time.sleep(0.05)
started = time.monotonic()
try:
    rdzv.kv_get("never", timeout=3.0)
    emit("answered", error="", reason="", message="", took=time.monotonic() - started)
except RendezvousError as exc:
    emit(
        "answered",
        error=type(exc).__name__,
        reason=exc.reason or "",
        message=str(exc),
        took=time.monotonic() - started,
        route=rdzv.call_route,
    )
os._exit(0)
