"""benchmarks/rendezvous_scale.py keeps what it measured when an anchor cannot run.

An ``--anchor-timeout`` shorter than the anchor's client processes' ``import torch``
made ``_race`` raise, and the run ended with a traceback and no JSON: our cases,
already measured, were lost. Now the anchor's failure is a result of its own (no wall
time, its ranks as errors, why and what to do), beside ours. No timed assertion."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.support import ROOT


def test_an_anchor_that_cannot_start_is_reported_beside_our_measured_case(
    torch_python: str, tmp_path: Path
) -> None:
    out = tmp_path / "scale.json"
    run = subprocess.run(
        [
            torch_python,
            str(ROOT / "benchmarks" / "rendezvous_scale.py"),
            "--ranks",
            "4",
            "--agents",
            "--conditions",
            "connected",
            "--processes",
            "1",
            # Far shorter than any import of torch: the anchor's children are never ready.
            "--anchor-timeout",
            "0.2",
            "--json-out",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    ours, anchor = json.loads(out.read_text())["results"]
    assert ours["system"] == "rendezvousd" and ours["wall_s"] is not None
    assert ours["ok"] == 4 and ours["errors"] == {}
    # Stopped by SIGTERM and drained: a daemon left waiting for its silent ranks was
    # killed (-9) after EmbeddedDaemon.stop's 30 s, in every case of ours.
    assert ours["daemon_exit"] == 0, ours
    assert anchor["system"] == "torch.TCPStore" and anchor["condition"] == "connected"
    assert anchor["wall_s"] is None and anchor["ok"] == 0
    assert anchor["errors"] == {"anchor not run": 4}
    assert "--anchor-timeout (now 0.2 s)" in anchor["anchor_failed"]
    assert "not ready within 0.2 s" in anchor["anchor_failed"]
