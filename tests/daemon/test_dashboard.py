"""deploy/grafana's dashboard and deploy/prometheus' alert rules name only metrics a
live daemon exports (scraped after a join, a failure, a commit and a refused call)."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from rendezvousd.client import AuthenticationError, RendezvousClient
from tests.support import ROOT, DaemonProcess, scrape, wait_for, worker_cmd

DASHBOARD = ROOT / "deploy/grafana/rendezvousd.json"
ALERTS = ROOT / "deploy/prometheus/alerts.yml"
_NAME = re.compile(r"\brendezvousd_[a-z_]+\b")


def _dashboard_exprs() -> list[str]:
    exprs = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("expr", "query") and isinstance(value, str):
                    exprs.append(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(json.loads(DASHBOARD.read_text()))
    return exprs


def _alert_exprs() -> dict[str, str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return {r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"]}


def test_the_dashboard_and_alerts_cover_what_the_issue_asks() -> None:
    alerts = _alert_exprs()
    # Not serving, storage, repeated failures, late heartbeats (issue 22, item 2).
    for name in (
        "RendezvousdDown",
        "RendezvousdNotServing",
        "RendezvousdStorageUnavailable",
        "RendezvousdJobsFailingRepeatedly",
        "RendezvousdHeartbeatsLate",
        # A limit near and refusing, a restart, refused tokens (h147 F3, F7).
        "RendezvousdNearLimit",
        "RendezvousdRefusedByLimit",
        "RendezvousdRestarted",
        "RendezvousdAuthRefused",
    ):
        assert name in alerts
    titles = [p["title"] for p in json.loads(DASHBOARD.read_text())["panels"]]
    for word in (
        "RPC rate",
        "latency",
        "Jobs by state",
        "Members",
        "Failures",
        "Storage",
        "Rejected",
    ):
        assert any(word in t for t in titles), word


def test_every_metric_they_name_exists(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path
) -> None:
    d = start_daemon(
        "--metrics-listen",
        "127.0.0.1:0",
        "--heartbeat-timeout-s",
        "3",
        "--state-dir",
        str(tmp_path / "state"),
    )
    victim = subprocess.Popen(
        worker_cmd(d, job_id, 1, 2, 0, 1, "--hold-s", "60"), stdout=subprocess.PIPE, text=True
    )
    try:
        with RendezvousClient(d.endpoint, job_id, token=d.token) as c:
            c.join(
                num_nodes=1,
                gpus_per_node=2,
                node_rank=0,
                local_rank=0,
                unique_id=b"\x17" * 128,
                timeout=20,
            )
            c.start_heartbeat(0.2)
            wait_for(
                "both heartbeat streams",
                lambda: scrape(d.metrics_url)["rendezvousd_heartbeat_streams"] == 2,
            )
            victim.send_signal(signal.SIGKILL)
            victim.wait(10)
            wait_for(
                "the failure to be counted",
                lambda: scrape(d.metrics_url).get("rendezvousd_failures_detected_total") == 1,
            )
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait(10)
    with (
        RendezvousClient(d.endpoint, "x", token="wrong-token-but-long-enough") as bad,
        contextlib.suppress(AuthenticationError),
    ):
        bad.list_jobs()
    samples = scrape(d.metrics_url)
    exported = {name.split("{", 1)[0] for name in samples}
    named = {
        name
        for expr in [*_dashboard_exprs(), *_alert_exprs().values()]
        for name in _NAME.findall(expr)
    }
    assert len(named) >= 10
    assert named <= exported, sorted(named - exported)
    # The restart alert's series is the process collector's, not ours: it exists too.
    assert "process_start_time_seconds" in exported
    # And the series the alerts key on move as they say.
    assert samples['rendezvousd_job_transitions_total{state="failed"}'] == 1
    assert samples["rendezvousd_serving"] == 1
    assert samples['rendezvousd_storage_commit_seconds_count{outcome="ok"}'] >= 1
