"""A training script with a life of its own, as the h157 review ran it: two ranks,
started per rank or by rendezvous-run, each printing JSON event lines.

``threads``: two threads of each rank all-reduce their own values at once (``sums``:
how many results were another thread's sum, and what each thread raised).
``fork-exit``: rank 1 forks inside the ``with init_distributed()`` block; the child
(under rendezvous-run, after a ``ctx.progress()``: ``child``) leaves the block by
``sys.exit(0)`` (``fork-raise``: by an exception); the parent then trains on
(``trained``). ``fork-use``: the child all-reduces on the parent's
communicator and says what it raised (``child``), then ends by ``os._exit``.
``twice``: rank 1 calls ``init_distributed()`` again (``second``), then both train on.
"""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
from report import emit

from rendezvousd.trainer.distributed import DistributedContext, init_distributed

STEPS = 5


def train(ctx: DistributedContext) -> None:
    comm = ctx.communicator
    for _ in range(STEPS):
        a = np.full(16, float(comm.rank + 1))
        comm.all_reduce(a)
        assert (a == 3.0).all(), a  # ranks 0 and 1: 1 + 2
    emit("trained", rank=comm.rank, steps=STEPS)


def threads(ctx: DistributedContext) -> None:
    comm = ctx.communicator
    wrong: list[float] = []
    errors: list[str] = []
    start = threading.Barrier(2, timeout=30)

    def run(value: float) -> None:
        try:
            start.wait()
            for _ in range(200):
                a = np.full(1000, value)
                comm.all_reduce(a)
                if not (a == 2 * value).all():
                    wrong.append(float(a[0]))
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    workers = [threading.Thread(target=run, args=(v,), name=f"T{v:g}") for v in (1.0, 7.0)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(90)
    alive = [t.name for t in workers if t.is_alive()]
    emit("sums", rank=comm.rank, wrong=wrong, errors=errors, alive=alive)


def fork(ctx: DistributedContext, mode: str) -> None:
    comm = ctx.communicator
    comm.barrier()
    if comm.rank == 1:
        pid = os.fork()
        if pid == 0:
            if mode == "fork-use":
                try:
                    comm.all_reduce(np.ones(16))
                    said = "no error"
                except Exception as exc:
                    said = f"{type(exc).__name__}: {exc}"
                emit("child", said=said)
                os._exit(0)
            if ctx.agent is not None:  # under rendezvous-run: a frame to the agent
                try:
                    ctx.progress(1)
                    said = "no error"
                except Exception as exc:
                    said = f"{type(exc).__name__}: {exc}"
                emit("child", said=said)
            if mode == "fork-raise":
                raise RuntimeError("the child's own error")
            sys.exit(0)  # leaves the parent's ``with`` block, in the child
        _, status = os.waitpid(pid, 0)
        emit("forked", status=status)
    train(ctx)


def twice(ctx: DistributedContext) -> None:
    if ctx.rank == 1:
        changed: list[str] = []
        try:
            init_distributed()
            said = "no error"
        except Exception as exc:
            said = f"{type(exc).__name__}: {exc}"
            # What the re-raise in this process's words lost of the daemon's answer.
            daemons = vars(exc.__cause__) if exc.__cause__ is not None else {}
            changed = sorted(
                k for k in {*vars(exc), *daemons} if vars(exc).get(k) != daemons.get(k)
            )
        emit("second", said=said, changed=changed)
    train(ctx)


def main() -> int:
    mode = sys.argv[1]
    with init_distributed() as ctx:
        emit("joined", rank=ctx.rank, transport=getattr(ctx.communicator, "transport", ""))
        if mode == "threads":
            threads(ctx)
        elif mode.startswith("fork"):
            fork(ctx, mode)
        elif mode == "twice":
            twice(ctx)
    emit("left", rank=ctx.rank, pid=os.getpid())
    return 0


if __name__ == "__main__":
    sys.exit(main())
