"""Starting a worker process: the agent's side of ``_agent_boot``.

A worker starts for one local rank ("slot") with torchrun's names for it in its
environment, one end of a fresh ``socketpair`` inherited as its private channel
(only the descriptor number travels, in ``RENDEZVOUSD_AGENT_FD``) and the
agent's pid. This module imports neither numpy nor gRPC, so that the launcher
can start a node's first spares right after reading its settings: a fresh node
then pays its own start-up and its spares' side by side, instead of one after
the other (docs/benchmarks.md, "Recovery"). ``warm_workers`` wraps what it
starts into a ``WorkerProcess``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rendezvousd.trainer.agent._agent_boot import ENV_AGENT_FD, ENV_AGENT_PID

if TYPE_CHECKING:
    from rendezvousd.trainer.config import DistributedConfig


@dataclass(frozen=True)
class Booted:
    """A worker process just started for local rank ``slot``, and this side's
    socket of its channel."""

    slot: int
    proc: subprocess.Popen[bytes]
    sock: socket.socket


def boot(slot: int, cmd: Sequence[str], env: Mapping[str, str]) -> Booted:
    """Start ``cmd`` (a script, or ``-m`` and a module) under ``_agent_boot``.

    Call from the agent's main thread only: the parent-death signal the worker
    arms fires when the *thread* that forked it exits."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    child_env = {**env, ENV_AGENT_FD: str(theirs.fileno()), ENV_AGENT_PID: str(os.getpid())}
    argv = [sys.executable, "-m", "rendezvousd.trainer.agent._agent_boot", *cmd]
    try:
        proc = subprocess.Popen(argv, env=child_env, pass_fds=(theirs.fileno(),))
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return Booted(slot, proc, ours)


def fixed_node_rank(config: DistributedConfig) -> int | None:
    """This node's rank in every generation, when the config fixes it: a fixed job
    size (not elastic) and a given node rank (not 'auto')."""
    if not config.is_multi_node:
        return 0
    if config.fewest_nodes != config.num_nodes:
        return None  # a shrunk generation renumbers the nodes
    return config.node_rank


def slot_env(config: DistributedConfig, local_rank: int) -> dict[str, str]:
    """torchrun's names a spare for ``local_rank`` starts with, for user code (the
    worker itself reads its place from the assignment). The global ones
    (``RANK``, ``WORLD_SIZE``, ``NODE_RANK``) only when every generation gives this
    node the same ranks (``fixed_node_rank``); otherwise the assignment sets them
    in ``init_distributed()``."""
    per_node = config.local_world_size
    env = {"LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(per_node)}
    node_rank = fixed_node_rank(config)
    if node_rank is not None:
        env.update(
            RANK=str(node_rank * per_node + local_rank),
            WORLD_SIZE=str(config.num_nodes * per_node),
            NODE_RANK=str(node_rank),
            GROUP_RANK=str(node_rank),
        )
    return env


def boot_spares(
    config: DistributedConfig, cmd: Sequence[str], env: Mapping[str, str]
) -> list[Booted]:
    """One spare per local rank of this node, each with its slot's names."""
    booted: list[Booted] = []
    try:
        for slot in range(config.local_world_size):
            booted.append(boot(slot, cmd, {**env, **slot_env(config, slot)}))
    except BaseException:
        discard(booted)
        raise
    return booted


def discard(booted: Sequence[Booted]) -> None:
    """Stop processes no agent took over (the launcher failed before it had one)."""
    for b in booted:
        with contextlib.suppress(ProcessLookupError):
            b.proc.kill()
    for b in booted:
        with contextlib.suppress(subprocess.TimeoutExpired):
            b.proc.wait(5.0)  # SIGKILL: bounded unless the kernel is stuck
        b.sock.close()
