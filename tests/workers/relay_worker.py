"""A worker under rendezvous-run that exchanges keys with its peers and meets them in
a barrier through the daemon, then reports which transport its calls took (the
agent's relay, ``client.relay``) and how many calls of each kind it sent on it."""

from __future__ import annotations

from report import emit

from rendezvousd.trainer.distributed import init_distributed

with init_distributed() as ctx:
    rdzv = ctx.rendezvous
    rank, world = ctx.topology.rank, ctx.topology.world_size
    rdzv.kv_set(f"relay/{rank}", str(rank * 10).encode())
    rdzv.barrier("relay", timeout=30)
    peer = rdzv.kv_get(f"relay/{(rank + 1) % world}", timeout=30)
    mux = rdzv._mux  # type: ignore[attr-defined]
    emit(
        "relayed",
        rank=rank,
        peer_value=peer.decode(),
        transport=type(mux).__name__,
        route=rdzv.call_route,
        sent=dict(mux.sent),
        unary=mux.unary,
    )
