"""Example data-parallel training script: a small MLP on deterministic synthetic data.

Run under the launcher, e.g. (one line per simulated node):

    rendezvous-run --nnodes 2 --node-rank 0 --nproc-per-node 2 --rdzv-endpoint 127.0.0.1:29420 \\
        --token-file TOKEN --config trainer/configs/multinode_smoke.toml -m rendezvousd.trainer.example

Written against the array module ``xp`` (``devices.array_module``): numpy on
the host with the cpu backend, CuPy on GPU ``local_rank`` with nccl, where the
parameters, gradients, data and collective buffers all live on the device.
Every step, rank 0 also computes the gradient of the whole global batch in one
process, on the host from the same data, and records how far the all-reduced
gradient (copied to the host) is from it: the seed's "gradient correctness
against the single-node baseline on identical data", measured on every run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from rendezvousd.common.log_time import UtcFormatter
from rendezvousd.trainer.agent.state_copy import NOTHING, StepState, agree_on_step
from rendezvousd.trainer.checkpoint import (
    checkpoint_path,
    checkpoint_step,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from rendezvousd.trainer.comm.communicator import ReduceOp
from rendezvousd.trainer.comm.devices import (
    array_module,
    device_for,
    set_device,
    to_device,
    to_host,
)
from rendezvousd.trainer.data import CURSOR_KEY, DataCursor, ShardedLoader, remaining_indices
from rendezvousd.trainer.distributed import init_distributed
from rendezvousd.trainer.errors import CheckpointError, TrainerError
from rendezvousd.trainer.topology import MultiNodeTopology

log = logging.getLogger("rendezvousd.example")
Array = npt.NDArray[Any]
# numpy or CuPy, whichever ``xp`` the run uses.
XArray = Any
PARAMS = ("w1", "b1", "w2", "b2")


def make_data(samples: int, features: int, seed: int) -> tuple[Array, Array]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((samples, features)).astype(np.float32)
    true_w = rng.standard_normal((features, 1)).astype(np.float32)
    y = np.tanh(x @ true_w) + 0.05 * rng.standard_normal((samples, 1)).astype(np.float32)
    return x, y.astype(np.float32)


def init_params(features: int, hidden: int, seed: int) -> dict[str, Array]:
    rng = np.random.default_rng(seed + 1)
    # float32 weights and float64 biases: two dtypes, so bucketing splits by dtype.
    return {
        "w1": (rng.standard_normal((features, hidden)) / np.sqrt(features)).astype(np.float32),
        "b1": np.zeros(hidden, dtype=np.float64),
        "w2": (rng.standard_normal((hidden, 1)) / np.sqrt(hidden)).astype(np.float32),
        "b2": np.zeros(1, dtype=np.float64),
    }


def loss_and_grads(
    p: dict[str, XArray], x: XArray, y: XArray, xp: Any = np
) -> tuple[float, dict[str, XArray]]:
    """Mean squared error of a one-hidden-layer tanh MLP and its exact gradients.

    Every array must live in ``xp``'s memory: CuPy will not mix device and host.
    """
    h_pre = x @ p["w1"] + p["b1"]
    h = xp.tanh(h_pre)
    out = h @ p["w2"] + p["b2"]
    diff = out - y
    n = x.shape[0]
    loss = float(xp.mean(diff**2))
    d_out = 2.0 * diff / n
    d_h = (d_out @ p["w2"].T) * (1.0 - h**2)
    grads = {
        "w1": (x.T @ d_h).astype(p["w1"].dtype),
        "b1": d_h.sum(axis=0).astype(p["b1"].dtype),
        "w2": (h.T @ d_out).astype(p["w2"].dtype),
        "b2": d_out.sum(axis=0).astype(p["b2"].dtype),
    }
    return loss, grads


def global_batch(
    samples: int, topo: MultiNodeTopology, cursor: DataCursor, batch: int, seed: int
) -> Array:
    """Every rank's batch at ``cursor``, concatenated: what one process would see."""
    parts = []
    for r in range(topo.world_size):
        idx = remaining_indices(samples, topo.world_size, r, cursor, seed)
        parts.append(idx[:batch])
    return np.concatenate(parts)


def agree_on_start(
    ckpt_dir: Path | None,
    topo: MultiNodeTopology,
    comm: Any,
    params: dict[str, XArray],
    xp: Any = np,
    restored: StepState | None = None,
) -> tuple[int, dict[str, Any]]:
    """The step every rank resumes at and its metadata's data cursor (``CURSOR_KEY``,
    absent if the state had none); ``params`` then hold that step's state on all.

    Each rank offers the newest step it can restore: the state its node agent
    kept (``restored``, after an automatic restart) and, on rank 0 only, its
    newest checkpoint (they may exist on its node's disk alone). The largest
    wins, and the lowest rank offering it broadcasts its parameters, so a node
    without the files or the copy resumes from the same step and bytes.
    Nothing offered: everyone starts at step 0 from rank 0's initial values.
    The data cursor goes with the parameters, from the same rank: the step alone
    does not say where the data is once the world size changed.
    The steps travel in ``xp`` arrays: NCCL reduces device memory only.
    """
    offered, meta = NOTHING, {}
    if restored is not None:
        offered = load_state(restored.arrays(), params, xp, restored.step)
        meta = restored.meta
    if ckpt_dir is not None and topo.is_global_rank_zero:
        latest = latest_checkpoint(ckpt_dir)
        if latest is None:
            log.info("resume: no checkpoint in %s", ckpt_dir)
        elif checkpoint_step(latest) > offered:
            offered, meta = load_into(latest, params, xp)
            log.info("resume: %s, step %d", latest, offered)
    step, root = agree_on_step(comm, offered, xp)
    for name in PARAMS:
        comm.broadcast(params[name], root=root)
    if step == NOTHING:
        return 0, {}
    # [has a cursor, epoch, consumed]; a malformed one is refused by resume_at.
    saved = meta.get(CURSOR_KEY)
    fields = saved if isinstance(saved, dict) else {}
    values = [fields.get("epoch"), fields.get("consumed")]
    values = [v if type(v) is int and 0 <= v < 2**62 else -1 for v in values]
    cursor = xp.array([int(saved is not None), *values], dtype=np.int64)
    comm.broadcast(cursor, root=root)
    if topo.is_global_rank_zero:
        log.info("resume: step %d from rank %d", step, root)
    has, epoch, consumed = (int(v) for v in to_host(cursor))
    return step, ({CURSOR_KEY: {"epoch": epoch, "consumed": consumed}} if has else {})


def load_state(arrays: dict[str, Array], params: dict[str, XArray], xp: Any, step: int) -> int:
    """Copy an agent-held step state into ``params``; its step, or NOTHING if it
    does not fit this model (then it is not offered, rather than trained on)."""
    if (why := _mismatch(arrays, params)) is not None:
        log.warning("the node agent's state copy does not match this model (%s); not offered", why)
        return NOTHING
    for name in PARAMS:
        params[name][...] = to_device(arrays[name], xp)
    return step


def load_into(path: Path, params: dict[str, XArray], xp: Any = np) -> tuple[int, dict[str, Any]]:
    """Copy a checkpoint's parameters into ``params`` (in ``xp``'s memory); its step
    and metadata.
    Loud if unusable: silently starting over would discard the run the user asked
    to continue."""
    try:
        arrays, meta = load_checkpoint(path, xp=xp)
        if (why := _mismatch(arrays, params)) is not None:
            raise CheckpointError(
                f"checkpoint {path} does not match this model: {why}; resume with the same "
                "--features/--hidden, or from another checkpoint directory"
            )
        step = meta.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"checkpoint {path} has no valid step (step={step!r})")
    except CheckpointError as exc:
        raise CheckpointError(f"rank 0 cannot resume: {exc}") from exc
    for name in PARAMS:
        params[name][...] = arrays[name]
    return step, meta


def _mismatch(arrays: dict[str, Any], params: dict[str, XArray]) -> str | None:
    """Which saved array does not fit this model's parameter, or None when all fit."""
    for name in PARAMS:
        saved, want = arrays.get(name), params[name]
        if saved is None or saved.shape != want.shape or saved.dtype != want.dtype:
            found = None if saved is None else (saved.shape, str(saved.dtype))
            return f"{name} is {found}, expected {(want.shape, str(want.dtype))}"
    return None


def params_digest(params: dict[str, XArray]) -> str:
    """SHA-256 of the parameters' host bytes: equal digests mean bit-identical models,
    whichever memory they live in."""
    digest = hashlib.sha256()
    for name in PARAMS:
        digest.update(np.ascontiguousarray(to_host(params[name])).tobytes())
    return digest.hexdigest()


def bus_bandwidth(comm: Any, xp: Any = np, mib: float = 8.0, iters: int = 3) -> float:
    """nccl-tests busbw = S/t * 2(n-1)/n for an all-reduce of ``mib`` MiB, GB/s.

    ``barrier`` drains the collectives (NCCL's are asynchronous to the host), so
    the timed span covers them, not just their launch.
    """
    buf = xp.ones(int(mib * 1024 * 1024 / 4), dtype=np.float32)
    comm.all_reduce(buf)  # warm-up: connections and buffers
    comm.barrier()
    started = time.perf_counter()
    for _ in range(iters):
        comm.all_reduce(buf)
    comm.barrier()
    elapsed = (time.perf_counter() - started) / iters
    n = comm.world_size
    return float(buf.nbytes / elapsed * 2 * (n - 1) / n / 1e9) if n > 1 else 0.0


def train(args: argparse.Namespace) -> dict[str, Any]:
    # Generated on the host, so every backend trains on the same bytes; the host
    # copies also feed rank 0's single-process baseline. The same on every rank, so
    # made before joining: under rendezvous-run a spare makes them while it waits
    # for its assignment, not on a restart's path after it.
    x_host, y_host = make_data(args.samples, args.features, args.seed)
    initial = init_params(args.features, args.hidden, args.seed)
    ctx = init_distributed(args.config)
    try:
        topo, comm = ctx.topology, ctx.communicator
        xp = array_module(ctx.config.backend)
        # Before the first allocation: every array below belongs on this rank's GPU.
        set_device(xp, device_for(topo.local_rank))
        x, y = to_device(x_host, xp), to_device(y_host, xp)
        params = {k: to_device(v, xp) for k, v in initial.items()}
        ckpt_dir = Path(args.checkpoint_dir) if args.checkpoint_dir else None
        if ckpt_dir is not None and topo.is_global_rank_zero:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
        start_step, saved = agree_on_start(
            ckpt_dir if args.resume else None, topo, comm, params, xp, ctx.restored
        )
        grads = {k: xp.zeros_like(v) for k, v in params.items()}
        reducer = ctx.reducer([grads[k] for k in PARAMS])
        reducer.verify_layout(ctx.rendezvous, topo.rank, topo.world_size, timeout=60)
        loader = ShardedLoader(x, y, batch_size=args.batch, topology=topo, seed=args.seed)
        # Where the data is, in samples, not steps: a world of another size since the
        # state was saved re-shards the rest of the epoch instead of replaying or
        # skipping epochs (steps per epoch depend on the world size).
        cursor = loader.resume_at(start_step, saved)
        step_log = Path(args.step_log) if args.step_log else None
        max_diff, loss = 0.0, float("nan")
        step = start_step
        started = time.perf_counter()
        while step < args.steps:
            at = cursor
            idx, cursor = loader.batch_at(at)
            idx_x = to_device(idx, xp)
            local_loss, local = loss_and_grads(params, x[idx_x], y[idx_x], xp)
            # Later layers' gradients exist first in backprop: mark them ready first.
            for i in reversed(range(len(PARAMS))):
                grads[PARAMS[i]][...] = local[PARAMS[i]]
                reducer.mark_ready(i)
            reducer.wait()
            loss_buf = xp.array([local_loss], dtype=np.float64)
            comm.all_reduce(loss_buf, ReduceOp.AVG)
            loss = float(loss_buf[0])
            if topo.is_global_rank_zero:
                gidx = global_batch(args.samples, topo, at, args.batch, args.seed)
                host_params = {k: to_host(v) for k, v in params.items()}
                _, full = loss_and_grads(host_params, x_host[gidx], y_host[gidx])
                # np.max, not max(): a NaN must stick and fail the check, where
                # max(0.0, nan) is 0.0 and would report a diverged run as exact.
                diffs = [np.max(np.abs(to_host(grads[k]) - full[k])) for k in PARAMS]
                max_diff = float(np.max([max_diff, *diffs]))
                if step % args.log_every == 0 or step == args.steps - 1:
                    log.info(
                        "step %d/%d loss %.5f max|grad - baseline| %.2e",
                        step + 1,
                        args.steps,
                        loss,
                        max_diff,
                    )
            for k in PARAMS:
                params[k] -= (args.lr * grads[k]).astype(params[k].dtype)
            step += 1
            # The node agent keeps it: a restart loses at most this one step.
            state_meta = {"step": step, "loss": loss, CURSOR_KEY: cursor.to_meta()}
            ctx.save_state(step, params, state_meta)
            if step_log is not None:
                # One short O_APPEND write per line: ranks share the file.
                line: dict[str, Any] = {"rank": topo.rank, "pid": os.getpid()}
                line.update(gen=ctx.generation, world=topo.world_size, step=step, t=time.time())
                # The step's samples (after their batch's step), so a log can show
                # every sample of an epoch seen once across restarts and resizes.
                line.update(epoch=at.epoch, consumed=at.consumed, samples=idx.tolist())
                with step_log.open("a") as fh:
                    fh.write(json.dumps(line) + "\n")
            every = args.checkpoint_every
            if ckpt_dir is not None and every > 0 and step % every == 0 and step < args.steps:
                # A checkpoint of one rank's replica is worth keeping only if all agree.
                ctx.check_replicas(params)
                save_checkpoint(checkpoint_path(ckpt_dir, step), params, state_meta, rank=topo)
            if args.step_sleep:
                time.sleep(args.step_sleep)  # stands in for a longer forward/backward
        train_s = time.perf_counter() - started
        # Drifted replicas train on silently; say which ranks before reporting a result.
        ctx.check_replicas(params)
        busbw = bus_bandwidth(comm, xp)
        ctx.rendezvous.raise_if_failed()
        wrote = False
        # A run resumed at its last step trains none and knows no loss: rewriting the
        # checkpoint it resumed from would only replace the recorded loss with NaN.
        final = None if ckpt_dir is None else checkpoint_path(ckpt_dir, step)
        if final is not None and (step > start_step or not final.exists()):
            final_meta = {"step": step, "loss": loss, CURSOR_KEY: cursor.to_meta()}
            wrote = save_checkpoint(final, params, final_meta, rank=topo)
        reducer.close()
        result = {
            "rank": topo.rank,
            "world_size": topo.world_size,
            "num_nodes": topo.num_nodes,
            "gpus_per_node": topo.gpus_per_node,
            # Which node and machine ran this rank: a re-formed job keeps each node's
            # ranks on that node (the multihost tests check it host by host).
            "node_rank": topo.node_rank,
            "host": socket.gethostname(),
            "start_step": start_step,
            "steps": step - start_step,
            "params_sha256": params_digest(params),
            "final_loss": loss,
            "max_abs_grad_diff_vs_single_process": max_diff,
            "rendezvous_s": round(ctx.rendezvous_s, 4),
            "generation": ctx.generation,
            "restart_count": ctx.restart_count,
            "allreduce_busbw_gbps": round(busbw, 3),
            "train_s": round(train_s, 3),
            "checkpoint_written": wrote,
            "buckets": len(reducer.buckets),
            "backend": comm.backend,
            "collective_transport": getattr(comm, "transport", comm.backend),
            # How this rank's daemon calls travelled: "relayed" through its node agent
            # under rendezvous-run (client.relay).
            "daemon_calls": ctx.rendezvous.call_route,
        }
    except BaseException as exc:
        ctx.close(clean=False, error=exc)
        raise
    ctx.close()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", default=None, help="TOML config (default: $RENDEZVOUSD_CONFIG)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=64, help="per-rank batch size")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument(
        "--step-sleep", type=float, default=0.0, help="seconds of pretend compute per step"
    )
    p.add_argument(
        "--checkpoint-dir", default=None, help="rank 0 writes checkpoints here (its own disk)"
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=50,
        help="checkpoint every N steps, and at the end (0: only at the end)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from rank 0's newest checkpoint; every rank gets its step and state",
    )
    p.add_argument("--result-dir", default=None, help="each rank writes rank-N.json here")
    p.add_argument(
        "--step-log",
        default=None,
        help=(
            "every rank appends one JSON line per step (rank, pid, generation, step, time, "
            "the data cursor the step began at (epoch, consumed) and this rank's sample indices)"
        ),
    )
    args = p.parse_args(argv)
    # Stamped as the daemon's and rendezvous-run's lines are (UTC, marked), so that
    # no host's time zone keeps them from merging; the merge is in order only as far as
    # the hosts' clocks agree (each stamps by its own).
    said = logging.StreamHandler(sys.stderr)
    said.setFormatter(UtcFormatter("%(asctime)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[said])
    if args.checkpoint_every < 0:
        p.error(f"--checkpoint-every={args.checkpoint_every} must be >= 0 (0: only at the end)")
    if args.resume and not args.checkpoint_dir:
        # Else it would quietly start over at step 0: there is nowhere to resume from.
        p.error("--resume needs --checkpoint-dir (where rank 0's checkpoints are)")
    try:
        result = train(args)
    except TrainerError as exc:
        log.error("%s", exc)
        return 1
    if args.result_dir:
        out = Path(args.result_dir) / f"rank-{result['rank']}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
