"""The one gate of the tests on real CuPy + NCCL devices: what is missing, how many
devices there are, and the marks that skip (or, with ``RENDEZVOUSD_REQUIRE_GPU=1``,
as scripts/gpu_check.sh sets, fail) a module where they are missing."""

from __future__ import annotations

import os

import pytest

from rendezvousd.trainer.comm import nccl

MISSING = nccl.unavailable_reason()
DEVICES = 0 if MISSING is not None else nccl.device_count()
REASON = f"needs CuPy with NCCL and a CUDA device: {MISSING}"

if DEVICES == 0 and os.environ.get("RENDEZVOUSD_REQUIRE_GPU") == "1":
    raise RuntimeError(f"RENDEZVOUSD_REQUIRE_GPU=1 but the GPU tests cannot run: {REASON}")

GPU_MARKS = [pytest.mark.gpu, pytest.mark.skipif(DEVICES == 0, reason=REASON)]
