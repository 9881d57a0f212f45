"""Finished jobs held until --job-ttl-s do not bury the live ones: ``rendezvousd status``
lists forming and running jobs and counts the finished ones in one line (``--all`` lists
them), and the status page's ``/api/jobs`` lists live jobs first and the finished ones a
bounded page at a time, with their count (h147 finding 6: ~1,000 held jobs made
``status`` 190-275 KB and seconds, ``/api/jobs`` 400 KB)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest

from rendezvousd.client import PeerFailed, RendezvousClient
from rendezvousd.server.scope import derive_job_token
from rendezvousd.web.status_page import FINISHED_PAGE
from tests.daemon.test_status_page import api, request
from tests.support import DaemonProcess, spawn_daemon

UID = b"\x33" * 128
# More than the page's first page of finished jobs: the JSON must bound them.
ENDED = [f"fin-ended-{i:02}" for i in range(FINISHED_PAGE + 2)]
FAILED = "fin-failed"
ABORTED = "fin-aborted"
LIVE = "fin-live"


def _join(c: RendezvousClient) -> None:
    c.join(num_nodes=1, gpus_per_node=1, node_rank=0, local_rank=0, unique_id=UID, timeout=20)


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """A daemon holding 22 ended jobs, then 1 failed and 1 aborted (finished in this
    order), and 1 running (kept running)."""
    d = spawn_daemon(tmp_path_factory.mktemp("held"), "--metrics-listen", "127.0.0.1:0")
    try:
        with ExitStack() as stack:
            for job in ENDED:
                with RendezvousClient(d.endpoint, job, token=d.token) as c:
                    _join(c)
                    c.leave()
            with RendezvousClient(d.endpoint, FAILED, token=d.token) as c:
                _join(c)
                c.start_heartbeat(0.2)
                with pytest.raises(PeerFailed):
                    c.report_failure(0, "the test fails it")
                    c.barrier("never", timeout=20)
            with RendezvousClient(d.endpoint, ABORTED, token=d.token) as c:
                _join(c)
                c.abort("the test aborts it", job_id=ABORTED)
            live = stack.enter_context(RendezvousClient(d.endpoint, LIVE, token=d.token))
            _join(live)
            live.start_heartbeat(0.2)
            yield d
    finally:
        d.kill()


def _status(d: DaemonProcess, *args: str) -> str:
    base = {k: v for k, v in os.environ.items() if not k.startswith("RENDEZVOUSD_")}
    done = subprocess.run(
        [sys.executable, "-m", "rendezvousd.cli", "status", "--endpoint", d.endpoint,
         "--token-file", str(d.token_file), *args],
        capture_output=True, text=True, timeout=60, env=base,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def _rows(out: str) -> list[str]:
    """The job ids of the table's job lines (members are indented)."""
    table = out.split("\nJOB ", 1)[1].splitlines()[1:]
    return [line.split()[0] for line in table if line and not line[0].isspace() and line[0] != "+"]


def test_status_lists_live_jobs_and_counts_the_finished_ones(held: DaemonProcess) -> None:
    out = _status(held)
    assert _rows(out) == [LIVE], out
    said = "+ 24 finished jobs held (ended 22, failed 1, aborted 1): --all lists them"
    assert out.rstrip().endswith(said), out
    # Piped, --watch is the same one snapshot.
    watched = _status(held, "--watch", "0.2")
    assert _rows(watched) == [LIVE] and watched.endswith(out.splitlines()[-1] + "\n"), watched


def test_status_all_lists_every_job_and_a_named_finished_job_still_shows(
    held: DaemonProcess,
) -> None:
    out = _status(held, "--all")
    assert sorted(_rows(out)) == sorted([*ENDED, FAILED, ABORTED, LIVE]), out
    assert "finished" not in out and "aborted: the test aborts it" in out, out
    one = _status(held, ENDED[0])
    assert _rows(one) == [ENDED[0]] and "ENDED" in one, one


def test_status_with_only_finished_jobs_says_none_is_live(held: DaemonProcess) -> None:
    # A job token's ListJobs lists its own job only: here an ended one.
    token = held.token_file.parent / "ended.token"
    token.write_text(derive_job_token(held.token, ENDED[1]))
    token.chmod(0o600)
    base = {k: v for k, v in os.environ.items() if not k.startswith("RENDEZVOUSD_")}
    done = subprocess.run(
        [sys.executable, "-m", "rendezvousd.cli", "status", "--endpoint", held.endpoint,
         "--token-file", str(token)],
        capture_output=True, text=True, timeout=60, env=base,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip().endswith(
        "(no forming or running jobs)\n+ 1 finished job held (ended 1): --all lists them"
    ), done.stdout


def _ids(overview: Any) -> list[str]:
    return [j["job_id"] for j in overview["jobs"]]


def test_the_pages_json_lists_live_jobs_first_and_a_bounded_page_of_finished_ones(
    held: DaemonProcess,
) -> None:
    newest = [ABORTED, FAILED, *reversed(ENDED)]  # the most recently finished first
    counts = {"total": 24, "by_state": {"ENDED": 22, "FAILED": 1, "ABORTED": 1}}
    first = api(held, "/api/jobs", token=held.token)
    assert _ids(first) == [LIVE, *newest[:FINISHED_PAGE]], _ids(first)
    assert first["finished"] == {**counts, "offset": 0, "limit": FINISHED_PAGE}
    assert [j["state"] for j in first["jobs"][:3]] == ["RUNNING", "ABORTED", "FAILED"]
    # Paged on, as the page's "show more" and scripts ask; 0 for the live jobs alone.
    paged = api(held, "/api/jobs?finished_offset=2&finished_limit=3", token=held.token)
    assert _ids(paged) == [LIVE, *newest[2:5]], _ids(paged)
    assert paged["finished"] == {**counts, "offset": 2, "limit": 3}
    assert _ids(api(held, "/api/jobs?finished_limit=0", token=held.token)) == [LIVE]
    every = api(held, "/api/jobs?finished_limit=100000", token=held.token)
    assert _ids(every) == [LIVE, *newest] and every["finished"]["limit"] == 1024
    status, _, body = request(held, "GET", "/api/jobs?finished_limit=all", token=held.token)
    assert status == 400 and b"finished_limit are numbers" in body, body
    # A finished job is still shown whole by its own path.
    assert api(held, f"/api/jobs/{ENDED[0]}", token=held.token)["state"] == "ENDED"
    # A job token sees its own job only, counted alike.
    mine = api(held, "/api/jobs", token=derive_job_token(held.token, FAILED))
    assert _ids(mine) == [FAILED]
    assert mine["finished"]["by_state"] == {"ENDED": 0, "FAILED": 1, "ABORTED": 0}
