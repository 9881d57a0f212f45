"""The example trainer with the fake CuPy of tests/trainer/fake_cupy/ at the
CuPy seam, so its nccl backend runs "on a GPU" on a machine without one.
Arguments are the example's own."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.trainer import fake_cupy

fake_cupy.install_globally()

from rendezvousd.trainer import example  # noqa: E402

sys.exit(example.main())
