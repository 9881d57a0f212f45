"""Log lines carry a stamp a reader on another host can place: UTC, marked with its
``Z`` (``rendezvousd.common.log_time``). The daemon's log said the host's local time
with no zone (``2026-12-07 11:24:12,225``), and rendezvous-run's lines had no time at
all: the lines of hosts in other zones could not be put in one order. Both programs run
here in a zone 5 h 30 min from UTC, so a local time cannot pass for UTC."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from rendezvousd.common.log_time import STAMP, STAMP_FORMAT
from tests.support import DaemonProcess

AWAY = {"TZ": "Asia/Kolkata"}  # UTC+05:30, no DST


def _placed(line: str, before: float, after: float) -> None:
    """``line`` starts with a UTC stamp of a time between ``before`` and ``after``."""
    stamp = STAMP.match(line)
    assert stamp is not None, line
    at = datetime.strptime(stamp.group(), STAMP_FORMAT).timestamp()
    assert before - 1 <= at <= after + 1, (line, before, after)


def test_the_daemons_log_lines_are_stamped_in_utc(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    before = time.time()
    d = start_daemon(env=AWAY)
    after = time.time()
    (serving,) = [line for line in d.log().splitlines() if "serving on" in line]
    _placed(serving, before, after)
    assert " INFO rendezvousd" in serving, serving


def test_rendezvous_runs_lines_are_stamped_in_utc(tmp_path: Path) -> None:
    before = time.time()
    run = subprocess.run(
        [sys.executable, "-m", "rendezvousd.trainer.agent.launcher", "--nnodes", "0",
         "train.py"],
        env={**os.environ, **AWAY}, capture_output=True, text=True, timeout=120,
        cwd=tmp_path, check=False,
    )  # fmt: skip
    after = time.time()
    assert run.returncode == 2, run.stderr
    lines = run.stderr.splitlines()
    assert lines and any(" rendezvous-run: error: " in line for line in lines), run.stderr
    for line in lines:
        _placed(line, before, after)
