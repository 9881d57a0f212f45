"""The series deploy/prometheus/alerts.yml keys on move as its alerts need.

``increase()`` sees nothing of a series' first sample: a counter that appears at its
first event already at 1 shows no increase for it, and one that stays put during an
outage shows none either. So the labelled series the alerts use exist from start at 0,
and every failed rewrite during a storage outage counts as a failed commit.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from rendezvousd.client import RendezvousClient, RendezvousError
from tests.support import scrape, spawn_daemon, wait_for

FAILED = 'rendezvousd_storage_commit_seconds_count{outcome="failed"}'
OK = 'rendezvousd_storage_commit_seconds_count{outcome="ok"}'


def test_the_alerts_series_exist_from_start_and_failed_commits_grow_through_an_outage(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    d = spawn_daemon(tmp_path, "--state-dir", str(state), "--metrics-listen", "127.0.0.1:0")
    client = RendezvousClient(d.endpoint, "outage", token=d.token)
    try:
        fresh = scrape(d.metrics_url)
        assert fresh[FAILED] == 0
        assert fresh['rendezvousd_job_transitions_total{state="failed"}'] == 0
        for job_state in ("forming", "running", "aborted", "ended"):
            assert fresh[f'rendezvousd_job_transitions_total{{state="{job_state}"}}'] == 0
        client.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        shutil.rmtree(state)
        with pytest.raises(RendezvousError) as info:
            client.kv_set("k", b"v")
        assert info.value.reason == "STORAGE_UNAVAILABLE"
        first = scrape(d.metrics_url)[FAILED]
        assert first >= 1
        # Changes are refused up front meanwhile: only the daemon's retries (one a
        # tick) can keep increase() above 0 for as long as the outage lasts.
        wait_for(
            "failed retries to be counted",
            lambda: scrape(d.metrics_url)[FAILED] >= first + 2,
        )
        state.mkdir(mode=0o700)
        wait_for("serving again", lambda: scrape(d.metrics_url)["rendezvousd_serving"] == 1)
        after = scrape(d.metrics_url)
        assert after[OK] > fresh[OK]  # the rewrite that ended the outage
        client.kv_set("k", b"v")
        assert scrape(d.metrics_url)[FAILED] == after[FAILED]  # storage back: no more
    finally:
        client.close()
        d.kill()
