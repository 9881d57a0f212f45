"""The agent -> worker hand-off and what the worker builds from it: one definition
of the id size, one typed assignment, the reducer and the rank-0 log line."""

from __future__ import annotations

import ast
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from rendezvousd.trainer.bucketing import GradSpec, MiB, plan_buckets
from tests.support import ROOT, DaemonProcess, launcher_cmd

PACKAGES = ("rendezvousd", "client", "trainer")


def _module_constants(path: Path) -> dict[str, object]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = node.value.value
    return out


def test_the_unique_id_size_is_defined_in_one_module() -> None:
    defining = [
        f"{path.relative_to(ROOT)}:{name}"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if "_gen" not in path.parts
        for name, value in _module_constants(path).items()
        if name.endswith("ID_BYTES") and value == 128
    ]
    assert defining == ["rendezvousd/common/validation.py:UNIQUE_ID_BYTES"]


WORKER = """\
import json, logging, os, sys
from pathlib import Path

import numpy as np

logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
# The worker must not need the config file: it is broken before init_distributed.
Path(os.environ["RENDEZVOUSD_CONFIG"]).write_text("this is [not TOML")
from rendezvousd.trainer.distributed import init_distributed

with init_distributed() as ctx:
    grads = [np.zeros(1000, np.float32) for _ in range(8)]
    reducer = ctx.reducer(grads)
    report = {
        "rank": ctx.rank,
        "world_size": ctx.world_size,
        "buckets": [list(b.grads) for b in reducer.buckets],
        "config_env": sorted(k for k in os.environ if k.startswith("RENDEZVOUSD_BUCKET")),
    }
    reducer.close()
Path(sys.argv[1], f"rank{ctx.rank}.json").write_text(json.dumps(report))
"""


@pytest.fixture(scope="module")
def elastic_run(
    daemon: DaemonProcess, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, list[dict[str, Any]]]:
    """One launcher of an elastic 1..2-node job that forms with its one node (2
    workers), the token given only through RENDEZVOUSD_TOKEN_FILE, bucket sizes
    only in the config file: its stderr and its workers' reports."""
    tmp = tmp_path_factory.mktemp("handoff")
    config = tmp / "trainer.toml"
    config.write_text("[distributed]\nbucket_cap_mib = 0.008\nfirst_bucket_mib = 0.004\n")
    script = tmp / "worker.py"
    script.write_text(WORKER)
    cmd = launcher_cmd("1:2", "auto", 2, endpoint=daemon.endpoint, job="handoff")
    cmd += ["--config", str(config), "--last-call-s", "0.2", str(script), str(tmp)]
    env = {**os.environ, "RENDEZVOUSD_TOKEN_FILE": str(daemon.token_file)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done.stderr, [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


def test_the_configured_bucket_sizes_reach_ctx_reducer_through_the_handoff(
    elastic_run: tuple[str, list[dict[str, Any]]],
) -> None:
    _, reports = elastic_run
    specs = [GradSpec((1000,), "float32", 4)] * 8
    configured = plan_buckets(
        specs, cap_bytes=int(0.008 * MiB), first_bucket_bytes=int(0.004 * MiB)
    )
    assert len(configured) > len(plan_buckets(specs))  # the defaults would make one bucket
    for report in reports:
        assert report["buckets"] == [list(b.grads) for b in configured], report
        # Handed over, not through the environment, and not from the (broken) file.
        assert report["config_env"] == [], report


def test_the_rank0_line_names_the_formed_world_and_that_the_job_authenticates(
    elastic_run: tuple[str, list[dict[str, Any]]],
) -> None:
    stderr, reports = elastic_run
    assert [r["world_size"] for r in reports] == [2, 2]
    lines = [line for line in stderr.splitlines() if line.startswith("distributed: ")]
    assert len(lines) == 1, stderr  # rank 0's only
    line = lines[0]
    assert "world_size=2 " in line and "num_nodes=1 (elastic 1..2)" in line, line
    assert "auth=token," in line and "tls=off" in line, line
    assert "bucket_cap_mib=0.008" in line, line
