"""Where arrays live: numpy on the host for the cpu backend, CuPy on a GPU for nccl.

Training code written against the returned array module ("xp") runs unchanged
on both. CuPy is never imported here: the module object comes from
``nccl._import_cupy``, the package's one CuPy seam, so the cpu backend never
touches CuPy and tests can inject a fake there.

Device arrays refuse implicit conversion (``np.asarray`` raises on a CuPy
array), so every crossing between host and device goes through ``to_host`` and
``to_device`` and is explicit.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, MutableMapping
from typing import Any

import numpy as np
import numpy.typing as npt

from rendezvousd.trainer.comm import nccl
from rendezvousd.trainer.errors import ConfigError, DeviceCountError


def array_module(backend: str) -> Any:
    """numpy for ``backend`` "cpu", CuPy for "nccl"; ConfigError if CuPy is missing."""
    if backend == "cpu":
        return np
    if backend != "nccl":
        raise ConfigError(f"backend {backend!r} has no array module; expected 'cpu' or 'nccl'")
    try:
        return nccl._import_cupy()
    except Exception as exc:  # ImportError, or a CUDA library failing to load
        raise ConfigError(
            f"backend 'nccl' keeps arrays on the GPU with CuPy, which does not import here "
            f"({type(exc).__name__}: {exc}); install rendezvousd[gpu-cuda12] or "
            "rendezvousd[gpu-cuda13] to match the CUDA driver, or use backend 'cpu'"
        ) from exc


def is_device_array(array: object) -> bool:
    """True for a CuPy (device) array; never imports CuPy to find out."""
    return nccl.is_cupy_array(array)


def set_device(xp: Any, local_rank: int) -> None:
    """Make GPU ``local_rank`` current before anything is allocated; no-op on numpy.

    One process drives one GPU, the one its node-local rank names: without this
    every rank on a node would allocate on device 0, where its communicator is not.
    """
    if xp is np:
        return
    xp.cuda.Device(local_rank).use()


def to_host(array: Any) -> npt.NDArray[Any]:
    """``array`` as a host numpy array: a device-to-host copy for CuPy, as-is for numpy."""
    if is_device_array(array):
        host: npt.NDArray[Any] = nccl._import_cupy().asnumpy(array)
        return host
    return np.asarray(array)


def to_device(array: Any, xp: Any) -> Any:
    """``array`` in ``xp``'s memory: a host-to-device copy for CuPy, as-is for numpy."""
    if xp is np:
        return to_host(array)
    if is_device_array(array):
        return array
    return xp.asarray(array)


#: Test mode: every local rank on GPU 0, each process its own NCCL "host".
SHARED_DEVICE_ENV = nccl.SHARED_DEVICE_ENV


def shares_one_device(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``RENDEZVOUSD_NCCL_SHARED_DEVICE=1`` asks for all ranks on GPU 0.

    Stock NCCL refuses two ranks on one device ("Duplicate GPU detected"); ranks in
    processes with different ``NCCL_HOSTID`` (sockets on loopback, no InfiniBand)
    are treated as separate hosts instead. That is how a machine with one GPU runs
    world > 1 (the GPU check); it measures no NVLink or PCIe path, only sockets.
    """
    return (os.environ if env is None else env).get(SHARED_DEVICE_ENV, "") == "1"


def check_local_devices(local_rank: int, per_node: int | None) -> None:
    """Before NCCL init: why this worker's GPU cannot be used, said first, in CUDA's words
    (no CuPy, no NCCL library, no driver or a driver too old, no device), as a
    ``ConfigError``; then, where ``per_node`` (the node's worker count) is known, a
    ``DeviceCountError`` when fewer GPUs are visible than workers, each of which drives
    the GPU its local rank names. Both name LOCAL_RANK and CUDA_VISIBLE_DEVICES: without
    this the first read 'found 0 devices' and the second failed in NCCL init's
    ``Device(n)``, on every restart."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = (
        f"LOCAL_RANK={local_rank}, CUDA_VISIBLE_DEVICES="
        f"{'(unset)' if visible is None else repr(visible)}"
    )
    reason = nccl.unavailable_reason()
    if reason is not None:
        raise ConfigError(f"backend 'nccl' cannot run here ({where}): {reason}")
    if per_node is None or shares_one_device():
        return
    count = nccl.device_count()
    if count < per_node:
        raise DeviceCountError(
            f"this node runs {per_node} workers, each on the GPU its local rank names, but "
            f"CUDA sees {count} ({where}); run at most {count} per node (rendezvous-run "
            "--nproc-per-node, gpus_per_node), make more GPUs visible, or set "
            f"{SHARED_DEVICE_ENV}=1 to test every rank on GPU 0"
        )


def device_for(local_rank: int, env: Mapping[str, str] | None = None) -> int:
    """The GPU this worker drives: its local rank, or 0 in the shared-device mode."""
    return 0 if shares_one_device(env) else local_rank


def warm_spare(local_rank: int) -> str | None:
    """A spare's head start on its GPU while it waits for its assignment: CuPy and
    its NCCL bindings imported and the device's primary context made, which a new
    worker otherwise does after it is assigned, on a restart's critical path
    (docs/benchmarks.md, "The GPU path on an H200"). No NCCL call: NCCL reads its
    environment at its first, which ``prepare_nccl`` sets after the assignment.

    Returns why the spare stays off the GPU, or None. A device in an exclusive compute
    mode is left alone: there the spare's context would lock out the running worker
    of its slot. The context costs GPU memory for as long as the spare waits."""
    cupy = nccl._import_cupy()
    device = device_for(local_rank)
    mode = int(cupy.cuda.runtime.getDeviceProperties(device)["computeMode"])
    if mode != _COMPUTE_MODE_DEFAULT:
        return f"GPU {device} is in compute mode {mode}, not the default (shared) mode"
    cupy.cuda.Device(device).use()
    # A call that needs the context: CUDA makes it here, not at the first allocation.
    cupy.cuda.runtime.deviceSynchronize()
    return None


#: cudaComputeModeDefault: several processes may hold contexts on the device.
_COMPUTE_MODE_DEFAULT = 0


def prepare_nccl(slot: int | None, env: MutableMapping[str, str] | None = None) -> None:
    """Before the first NCCL call of this process (NCCL reads its environment then):
    in the shared-device mode, give this process its own NCCL host identity.

    ``slot`` must differ between the processes on this machine: the global rank where it
    is known (under the agent, so that several simulated nodes can share one GPU), else
    None for this process's id. Not the local rank: each simulated node's local rank 0
    would be one NCCL "host" with the others, and NCCL refuses their shared GPU."""
    environ = os.environ if env is None else env
    if not shares_one_device(environ):
        return
    name = f"pid{os.getpid()}" if slot is None else str(slot)
    environ.setdefault("NCCL_HOSTID", f"{socket.gethostname()}-rendezvousd-{name}")
    environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    environ.setdefault("NCCL_IB_DISABLE", "1")
