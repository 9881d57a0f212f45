"""The daemon says at start when its call limit could take more memory than its
cgroup's limit leaves (``rendezvousd/common/memory_limit.py``): the default
``--max-concurrent-rpcs`` is ~3 GiB of open calls against the shipped container's
1 GiB, and nothing said so (helper-166's noisy-neighbour review)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from rendezvousd.common.limits import Limits
from rendezvousd.common.memory_limit import calls_that_fit, cgroup_memory_limit, warn_at_start
from tests.support import wait_for, write_token

GIB = 2**30
UNLIMITED_V1 = "9223372036854771712"


def _tree(root: Path, cgroup: str, files: dict[str, str]) -> Path:
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(cgroup)
    for name, text in files.items():
        path = root / "sys/fs/cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return root


def test_a_systemd_units_memory_max_is_read_under_cgroup_v2(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        "0::/system.slice/rendezvousd.service\n",
        {
            "memory.max": "max",
            "system.slice/memory.max": "max",
            "system.slice/rendezvousd.service/memory.max": str(GIB),
        },
    )
    assert cgroup_memory_limit(root) == (
        GIB,
        "sys/fs/cgroup/system.slice/rendezvousd.service/memory.max",
    )


def test_the_lowest_limit_above_the_process_counts_under_cgroup_v1(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        "9:name=systemd:/\n4:memory:/kubepods/pod1/c1\n0::/\n",
        {
            "memory/memory.limit_in_bytes": UNLIMITED_V1,
            "memory/kubepods/memory.limit_in_bytes": UNLIMITED_V1,
            "memory/kubepods/pod1/memory.limit_in_bytes": str(2 * GIB),
            "memory/kubepods/pod1/c1/memory.limit_in_bytes": UNLIMITED_V1,
        },
    )
    assert cgroup_memory_limit(root) == (
        2 * GIB,
        "sys/fs/cgroup/memory/kubepods/pod1/memory.limit_in_bytes",
    )


def test_no_limit_and_no_cgroup_file_are_none(tmp_path: Path) -> None:
    assert cgroup_memory_limit(tmp_path) is None
    unlimited = _tree(tmp_path / "u", "0::/\n", {"memory.max": "max"})
    assert cgroup_memory_limit(unlimited) is None


def test_the_default_call_limit_is_said_to_outgrow_a_1_gib_daemon(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = _tree(tmp_path, "0::/\n", {"memory.max": str(GIB)})
    fits = calls_that_fit(GIB, Limits())
    assert 10_000 < fits < Limits().max_concurrent_rpcs
    with caplog.at_level(logging.WARNING, logger="rendezvousd"):
        warn_at_start(Limits(), root)
    (said,) = [r.getMessage() for r in caplog.records]
    assert "max_concurrent_rpcs=100000 open calls could take ~3.1 GiB" in said, said
    assert "memory limit of 1.0 GiB (sys/fs/cgroup/memory.max)" in said, said
    assert f"--max-concurrent-rpcs (RENDEZVOUSD_MAX_CONCURRENT_RPCS) to {fits} or less" in said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rendezvousd"):
        warn_at_start(Limits(max_concurrent_rpcs=fits), root)
    assert caplog.records == []


def _memory_cgroup() -> tuple[Path, str] | None:
    """A new memory cgroup this test may put a process in (v1 or v2), and the file that
    sets its limit; None where none can be made (not root, no memory controller)."""
    name = f"rdzv-memtest-{uuid.uuid4().hex[:8]}"
    for base, limit in (
        (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"),
        (Path("/sys/fs/cgroup"), "memory.max"),
    ):
        if not (base / "cgroup.procs").exists():
            continue
        try:
            (base / name).mkdir()
        except OSError:
            continue
        if (base / name / limit).exists():
            return base / name, limit
        (base / name).rmdir()
    return None


def test_a_daemon_in_a_1_gib_cgroup_says_its_call_limit_outgrows_it(tmp_path: Path) -> None:
    made = _memory_cgroup()
    if made is None:
        pytest.skip("cannot make a memory cgroup here (needs root and a memory controller)")
    cgroup, limit_file = made
    try:
        (cgroup / limit_file).write_text(str(GIB))
        token = tmp_path / "token"
        write_token(token)
        # The daemon joins the cgroup before it starts: the shell writes its own pid,
        # then becomes the daemon.
        procs = cgroup / "cgroup.procs"
        serve = [sys.executable, "-m", "rendezvousd", "serve", "--listen", "127.0.0.1:0"]
        serve += ["--token-file", str(token), "--insecure-plaintext"]
        log = tmp_path / "daemon.log"
        with log.open("w") as err:
            daemon = subprocess.Popen(
                ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *serve],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env={**os.environ, "RENDEZVOUSD_MAX_CONCURRENT_RPCS": "100000"},
            )
        try:
            assert daemon.stdout is not None
            assert daemon.stdout.readline().startswith("rendezvousd: serving on "), log.read_text()
            wait_for("the warning", lambda: "max_concurrent_rpcs=100000" in log.read_text(), 10)
            said = log.read_text()
            assert "this daemon's memory limit of 1.0 GiB" in said, said
            assert "--max-concurrent-rpcs (RENDEZVOUSD_MAX_CONCURRENT_RPCS) to " in said, said
        finally:
            daemon.terminate()
            daemon.wait(30)
    finally:
        for _ in range(50):
            try:
                cgroup.rmdir()
                break
            except OSError:  # its last process still leaving
                subprocess.run(["sleep", "0.1"], check=False)
