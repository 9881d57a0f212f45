"""Entry point of a worker process the node agent starts: arm the parent-death
signal, then run the user's script or module as ``__main__`` in this process.

Arming it here instead of in a ``preexec_fn`` lets the agent spawn spares while
its gRPC and reaper threads run (a ``preexec_fn`` is unsafe once threads exist).
The agent's pid travels in ``RENDEZVOUSD_AGENT_PID``: if it is no longer our
parent when the signal is armed, the agent died in between and no signal would
ever come, so the worker must not start unsupervised. Its channel's descriptor
travels in ``RENDEZVOUSD_AGENT_FD`` (read by ``agent_worker``). Both names live
here, the one module the agent's side (``worker_boot``) and the worker's share
that imports nothing heavy: the launcher imports it before it starts its spares,
and a worker without ``subprocess`` or the agent's side.

    python -m rendezvousd.trainer.agent._agent_boot SCRIPT [ARGS...]
    python -m rendezvousd.trainer.agent._agent_boot -m MODULE [ARGS...]
"""

from __future__ import annotations

import contextlib
import os
import runpy
import signal
import sys

ENV_AGENT_PID = "RENDEZVOUSD_AGENT_PID"
ENV_AGENT_FD = "RENDEZVOUSD_AGENT_FD"
#: Set by the agent for a spare that should make its GPU's context while it waits
#: (``spare_gpu_context``, nccl backend); read by ``init_distributed``.
ENV_SPARE_GPU = "RENDEZVOUSD_SPARE_GPU"
PR_SET_PDEATHSIG = 1


def die_with_parent(expected: int | None, signum: int = signal.SIGKILL) -> None:
    """Arm ``signum`` on the parent's death; exit at once (126) if the parent is no
    longer ``expected`` (it died before the signal was armed)."""
    if sys.platform.startswith("linux"):
        # Here: the launcher imports this module for its names, before its spares start.
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
            os._exit(126)
    if expected is not None and os.getppid() != expected:
        os._exit(126)


def signal_group(pid: int, signum: int) -> None:
    """Signal worker ``pid``'s process group (its session, ``main``), which holds what
    the worker started; only ``pid`` while it has none yet (it is still starting).
    Only while ``pid`` is unreaped: its zombie keeps the number from being reused."""
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def die_with_agent(signum: int = signal.SIGKILL) -> None:
    """``die_with_parent`` for the agent ``RENDEZVOUSD_AGENT_PID`` names."""
    expected = os.environ.pop(ENV_AGENT_PID, "")
    die_with_parent(int(expected) if expected else None, signum)


def run_target(argv: list[str]) -> None:
    """Run ``SCRIPT [ARGS...]`` or ``-m MODULE [ARGS...]`` as ``__main__`` here, as
    ``python`` would (``sys.argv``; ``sys.path[0]``: the script's directory)."""
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


def main() -> None:
    die_with_agent()
    # A session (and process group) of its own, as torchrun starts each worker: the
    # agent signals the whole group, so the worker's own children (DataLoader
    # workers, helpers it started) are stopped with it instead of outliving it.
    os.setsid()
    argv = sys.argv[1:]
    if not argv:
        sys.exit("usage: python -m rendezvousd.trainer.agent._agent_boot [-m] TARGET [ARGS...]")
    run_target(argv)


if __name__ == "__main__":
    main()
