"""The status page in a real browser (headless Debian Chromium) against a real daemon
and a real 2-node x 2-worker CPU job: log in, watch the job run, kill a worker, see
the failure and the next generation appear without a reload; a token for another
job sees nothing, and no token gets the login page only."""

from __future__ import annotations

import contextlib
import os
import platform
import re
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rendezvousd.common.version import build_id, installed_version
from rendezvousd.server.scope import derive_job_token
from tests.daemon.browser import Chromium, chromium_missing
from tests.support import ROOT, WORKERS, DaemonProcess, json_lines, launcher_cmd, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(chromium_missing() is not None, reason=str(chromium_missing())),
]

SCREENSHOT = ROOT / "artifacts" / "status-page.png"
UTC_CLOCK = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"


@pytest.fixture
def browser() -> Iterator[Chromium]:
    with Chromium() as b:
        yield b


def _launch(
    d: DaemonProcess, job: str, tmp: Path, node: int, *flags: str
) -> tuple[subprocess.Popen[str], Path]:
    out = tmp / f"node{node}.out"
    cmd = launcher_cmd(2, node, 2, endpoint=d.endpoint, token_file=d.token_file, job=job)
    cmd += ["--heartbeat-interval-s", "0.5", "--max-restarts", "1", *flags]
    cmd += [str(WORKERS / "elastic_worker.py"), "--steps", "1000000", "--step-s", "0.05"]
    with out.open("w") as stdout:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    return proc, out


def _text(b: Chromium) -> str:
    return str(b.evaluate("document.body.innerText"))


def test_the_page_follows_a_job_through_a_failure_without_a_reload(
    start_daemon: Callable[..., DaemonProcess],
    browser: Chromium,
    job_id: str,
    tmp_path: Path,
) -> None:
    d = start_daemon("--metrics-listen", "127.0.0.1:0", "--heartbeat-timeout-s", "3")
    base = d.metrics_url.removesuffix("/metrics")
    nodes = [_launch(d, job_id, tmp_path, n) for n in range(2)]
    # A third agent stands by: a worker's death loses no node, so it stays parked.
    nodes.append(_launch(d, job_id, tmp_path, 2, "--standby", "--node-rank", "auto"))
    try:
        # No token: the login page only, and the API says 401 to the browser too.
        browser.navigate(base + "/")
        browser.wait_for("the login form", "!!document.querySelector('form[action=\"/login\"]')")
        assert job_id not in _text(browser)
        assert browser.evaluate("fetch('/api/jobs').then(r => r.status)") == 401

        # Another job's token: logged in, and sees no job at all.
        browser.log_in(base, derive_job_token(d.token, "another-job"))
        wait_for(
            "the job to exist",
            lambda: any(e.get("event") == "ready" for _, out in nodes for e in json_lines(out)),
            timeout=60,
        )
        browser.evaluate("location.reload(); true")
        browser.wait_for("a fresh update", "document.body.dataset.ready === '1'")
        browser.wait_for("the empty overview", "!document.getElementById('nojobs').hidden")
        assert job_id not in _text(browser)
        assert browser.evaluate("document.querySelectorAll('#jobs tbody tr').length") == 0
        browser.evaluate("document.querySelector('header form').submit(); true")
        browser.wait_for("the login form", "!!document.querySelector('form[action=\"/login\"]')")

        # The admin token: the job, its grid, and (admin only) the Abort button.
        browser.log_in(base, d.token)
        browser.navigate(f"{base}/#job={job_id}")
        browser.wait_for(
            "the job RUNNING with four active ranks",
            "document.getElementById('job-state').textContent === 'RUNNING' && "
            "document.querySelectorAll('#grid .seat.A').length === 4",
            timeout=60,
        )
        assert not browser.evaluate("document.getElementById('abort').hidden")
        assert job_id in _text(browser)
        # Each node's advertised address, the one its peers dial (h145 F5): here every
        # node's route to the daemon on 127.0.0.1.
        addresses = browser.evaluate(
            "[...document.querySelectorAll('#grid tbody tr')].map(tr => tr.children[2].textContent)"
        )
        assert addresses == ["127.0.0.1", "127.0.0.1"], addresses
        assert browser.evaluate("document.querySelector('#grid thead').innerText").split() == [
            "Node",
            "Host",
            "Address",
            "Ranks",
            "Heartbeat",
            "Step",
        ]
        # Which daemon answers, in the header (its build beside it on hover): a page
        # open across an upgrade said nothing of which rendezvousd it read.
        version = installed_version()
        assert "+" + build_id() in version  # its build too (h139 F3)
        assert browser.evaluate("document.getElementById('version').textContent") == version
        build = browser.evaluate("document.getElementById('version').title")
        said_build = f"version {version}, build {build_id()}, python {platform.python_version()}"
        assert f"{said_build}, grpcio " in build, build
        assert "protocol rendezvous.v1, state_schema 3" in build, build
        said = browser.evaluate(
            "fetch('/api/jobs').then(r => r.json()).then(j => j.daemon_version)"
        )
        assert said == version
        browser.wait_for(
            "the standby counted apart",
            "document.getElementById('waiting').textContent === '1' && "
            "document.getElementById('standbys').textContent === "
            '"1 of them standing by for a lost node\'s slot"',
            timeout=60,
        )
        # Gone on a reload: proves the updates below came without one.
        browser.evaluate("window.__noReload = 1; true")

        victim = _ready_rank(nodes, 3)
        os.kill(victim["pid"], signal.SIGKILL)
        browser.wait_for(
            "the failure in the generation timeline",
            "[...document.querySelectorAll('#timeline li')].some(li => "
            "li.innerText.includes('FAILED') && li.innerText.includes('rank 3 on'))",
            timeout=60,
        )
        browser.wait_for(
            "generation 2 named re-formed in the timeline",
            "[...document.querySelectorAll('#timeline li')].some(li => "
            "li.innerText.includes('gen 2') && li.innerText.includes('re-formed'))",
            timeout=60,
        )
        # Each entry's time is UTC, marked, as the daemon's and rendezvous-run's log
        # lines are stamped (it was the browser's local time, with no zone).
        stamps = browser.evaluate(
            "[...document.querySelectorAll('#timeline li')].map(li => li.firstChild.textContent)"
        )
        assert stamps and all(re.fullmatch(UTC_CLOCK, s) for s in stamps), stamps
        browser.wait_for(
            "generation 2 RUNNING",
            "document.getElementById('job-state').textContent === 'RUNNING' && "
            "document.getElementById('job-facts').textContent.includes('generation 2') && "
            "document.querySelectorAll('#grid .seat.A').length === 4",
            timeout=60,
        )
        assert browser.evaluate("window.__noReload") == 1
        # The example saves its state every step: the agents' heartbeats carry the steps
        # and their restart budget (one restart used, of --max-restarts).
        browser.wait_for(
            "the step rate drawn",
            "document.getElementById('spark-title').textContent === 'Steps per second' && "
            "/step \\d+ · restarts 1 used/.test(document.getElementById('job-facts').textContent) "
            "&& [...document.querySelectorAll('#grid tbody tr')].every("
            "tr => /^\\d+$/.test(tr.lastChild.textContent))",
            timeout=60,
        )
        overview = browser.evaluate(
            "[...document.querySelectorAll('#jobs tbody tr')].map(tr => tr.innerText)"
        )
        assert len(overview) == 1 and "generation 1: rank 3 on" in overview[0], overview
        page = _text(browser)
        assert d.token not in page
        browser.screenshot(SCREENSHOT)
        assert SCREENSHOT.stat().st_size > 10_000

        # Abort, confirmed in the dialog: the job and its workers stop, and the page says who.
        browser.accept_dialogs()
        browser.evaluate("document.getElementById('abort').click(); true")
        browser.wait_for(
            "the job ABORTED",
            "document.getElementById('job-state').textContent === 'ABORTED' && "
            "document.getElementById('job-facts').textContent.includes('by admin session')",
        )
        assert browser.evaluate("document.getElementById('abort').hidden")
        wait_for(
            "the abort in the log", lambda: f"job {job_id} aborted by admin session" in d.log()
        )
    finally:
        for proc, _ in nodes:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def _ready_rank(nodes: list[tuple[subprocess.Popen[str], Path]], rank: int) -> dict[str, Any]:
    def found() -> dict[str, Any] | None:
        events = [e for _, out in nodes for e in json_lines(out) if e.get("event") == "ready"]
        return next((e for e in events if e.get("rank") == rank), None)

    wait_for(f"rank {rank} to be ready", lambda: found() is not None, timeout=60)
    event = found()
    assert event is not None
    return event


def test_a_seat_kept_for_a_survivor_is_shown_while_it_is_kept(
    start_daemon: Callable[..., DaemonProcess], browser: Chromium, job_id: str
) -> None:
    """Node agents through the SDK: a and b run, b's agent dies and the standby s
    opens generation 2; until the survivor a re-joins, the page says the seat kept
    for it, and the line goes once a is back."""
    from rendezvousd.client import RendezvousClient

    d = start_daemon("--metrics-listen", "127.0.0.1:0")  # 10 s: the seat is kept that long
    base = d.metrics_url.removesuffix("/metrics")
    a, b, s = (RendezvousClient(d.endpoint, job_id, token=d.token) for _ in range(3))
    kw: dict[str, Any] = dict(min_nodes=2, max_nodes=2, gpus_per_node=2, timeout=30)
    try:
        joined = [threading.Thread(target=c.join_node, kwargs=kw) for c in (a, b)]
        for t in joined:
            t.start()
        for t in joined:
            t.join(30)
        a.start_heartbeat(0.2)
        b.start_heartbeat(0.2)
        spare = threading.Thread(target=s.join_node, kwargs=dict(kw, standby=True), daemon=True)
        spare.start()
        wait_for("the standby to park", lambda: a.get_job().standbys == 1)
        browser.log_in(base, d.token)
        browser.navigate(f"{base}/#job={job_id}")
        browser.wait_for(
            "the job RUNNING", "document.getElementById('job-state').textContent === 'RUNNING'"
        )
        b.close()
        browser.wait_for(
            "the kept seat",
            "/^1 seat\\(s\\) kept for nodes re-joining after the failure \\(\\d+ s more\\)$/"
            ".test(document.getElementById('kept').textContent) && "
            "!document.getElementById('kept').hidden",
            timeout=8,
        )
        # The table's row of the job shown is drawn from the panel's own answer: the two
        # never disagree, e.g. RUNNING gen 1 in the table beside FORMING gen 2 here.
        row = browser.evaluate(
            "[...document.querySelectorAll('#jobs tbody tr')].map(tr => tr.innerText)[0]"
        )
        assert "FORMING" in row and "\t2\t" in row, row
        browser.screenshot(KEPT_SCREENSHOT)
        assert KEPT_SCREENSHOT.stat().st_size > 10_000
        a.join_node(**kw)
        spare.join(20)
        browser.wait_for(
            "generation 2 RUNNING, nothing kept",
            "document.getElementById('job-state').textContent === 'RUNNING' && "
            "document.getElementById('job-facts').textContent.includes('generation 2') && "
            "document.getElementById('kept').hidden",
        )
    finally:
        for c in (a, b, s):
            c.close()


KEPT_SCREENSHOT = ROOT / "artifacts" / "status-page-kept-seat.png"


def test_a_new_run_opened_after_the_job_ended_is_shown_as_such(
    start_daemon: Callable[..., DaemonProcess], browser: Chromium, job_id: str
) -> None:
    """A one-node run ends (its node leaves), then a node of a two-node launch joins the
    same job id: the page says the generation forming is a new run and when the last
    one ended, which a late pod of the run that ended would otherwise wait in unseen."""
    from rendezvousd.client import RendezvousClient, RendezvousError

    d = start_daemon("--metrics-listen", "127.0.0.1:0")
    base = d.metrics_url.removesuffix("/metrics")
    first, late = (RendezvousClient(d.endpoint, job_id, token=d.token) for _ in range(2))
    try:
        first.join_node(min_nodes=1, max_nodes=1, gpus_per_node=2, timeout=30)
        first.start_heartbeat(0.2)
        first.leave()
        kw: dict[str, Any] = dict(min_nodes=2, max_nodes=2, gpus_per_node=2, timeout=30)

        def wait_in_it() -> None:
            with contextlib.suppress(RendezvousError):  # ended by the close below
                late.join_node(**kw)

        waiting = threading.Thread(target=wait_in_it, daemon=True)
        waiting.start()
        wait_for("generation 2 to form", lambda: late.get_job().summary.generation == 2)
        browser.log_in(base, d.token)
        browser.navigate(f"{base}/#job={job_id}")
        browser.wait_for(
            "the new run",
            "/^a new run of this job id: its previous run ended \\d+\\.\\d s ago "
            "\\(every member left\\)$/.test(document.getElementById('rerun').textContent) && "
            "!document.getElementById('rerun').hidden && "
            "document.getElementById('job-state').textContent === 'FORMING'",
            timeout=8,
        )
        browser.screenshot(RERUN_SCREENSHOT)
        assert RERUN_SCREENSHOT.stat().st_size > 10_000
    finally:
        for c in (first, late):
            c.close()


RERUN_SCREENSHOT = ROOT / "artifacts" / "status-page-new-run.png"


FORMING_SCREENSHOT = ROOT / "artifacts" / "status-page-forming.png"


def test_a_job_stuck_forming_shows_the_nodes_joined_and_the_missing_node_rank(
    start_daemon: Callable[..., DaemonProcess], browser: Chromium, job_id: str
) -> None:
    """Nodes 0 and 2 of three wait, node 1 never comes (an operator review, D5): the
    page lists both (node rank, host, instance, when), draws their rows joining, and
    says node rank 1 is missing, where it showed a count and an empty grid."""
    from rendezvousd.client import NotFound, RendezvousClient, RendezvousError

    d = start_daemon("--metrics-listen", "127.0.0.1:0")
    base = d.metrics_url.removesuffix("/metrics")
    clients = [RendezvousClient(d.endpoint, job_id, token=d.token) for _ in range(2)]
    kw: dict[str, Any] = dict(min_nodes=3, max_nodes=3, gpus_per_node=2, timeout=60)

    def join(c: Any, rank: int, host: str) -> None:
        with contextlib.suppress(RendezvousError):  # the abort below ends the wait
            c.join_node(node_rank=rank, host=host, **kw)

    joins = [
        threading.Thread(target=join, args=(clients[0], 0, "fm-host-a"), daemon=True),
        threading.Thread(target=join, args=(clients[1], 2, "fm-host-c"), daemon=True),
    ]
    try:
        for t in joins:
            t.start()

        def both_joined() -> bool:
            try:
                return len(clients[0].get_job().joining) == 2
            except NotFound:
                return False  # not yet created

        wait_for("both nodes to join", both_joined)
        browser.log_in(base, d.token)
        browser.navigate(f"{base}/#job={job_id}")
        browser.wait_for(
            "the forming panel with both nodes",
            "document.getElementById('job-state').textContent === 'FORMING' && "
            "!document.getElementById('forming').hidden && "
            "document.querySelectorAll('#joined li').length === 2",
        )
        joined = sorted(
            browser.evaluate("[...document.querySelectorAll('#joined li')].map(li => li.innerText)")
        )
        assert joined[0].startswith("node 0 on fm-host-a joined "), joined
        assert joined[1].startswith("node 2 on fm-host-c joined "), joined
        assert all("instance " in j for j in joined), joined
        assert browser.evaluate("document.getElementById('missing').textContent") == (
            "missing: node rank 1 (no node agent joined with that node rank)"
        )
        rows = browser.evaluate(
            "[...document.querySelectorAll('#grid tbody tr')].map(tr => "
            "[tr.children[0].textContent, tr.children[1].textContent, "
            "tr.children[2].textContent, tr.querySelectorAll('.seat.J').length, "
            "tr.children[4].textContent])"
        )
        # Joining seats have no heartbeat yet: "—", where the page showed "0.0 s"; nor
        # an address (a forming node's is not shown).
        assert rows == [["0", "fm-host-a", "—", 2, "—"], ["2", "fm-host-c", "—", 2, "—"]], rows
        browser.screenshot(FORMING_SCREENSHOT)
        assert FORMING_SCREENSHOT.stat().st_size > 10_000
        clients[0].abort("test over")
        for t in joins:
            t.join(20)
        browser.wait_for(
            "the panel gone once the job is aborted",
            "document.getElementById('job-state').textContent === 'ABORTED' && "
            "document.getElementById('forming').hidden",
        )
    finally:
        for c in clients:
            c.close()


FINISHED_SCREENSHOT = ROOT / "artifacts" / "status-page-finished.png"
FINISHED_OPEN_SCREENSHOT = ROOT / "artifacts" / "status-page-finished-open.png"


def test_finished_jobs_are_counted_and_collapsed_under_the_live_ones(
    start_daemon: Callable[..., DaemonProcess], browser: Chromium, job_id: str
) -> None:
    """~1,000 finished jobs held until their TTL buried the few live ones in one table
    (h147 F6): the live jobs stand alone, the finished ones are counted, and open a page
    at a time, the newest first."""
    from rendezvousd.client import RendezvousClient
    from rendezvousd.web.status_page import FINISHED_PAGE

    d = start_daemon("--metrics-listen", "127.0.0.1:0")
    base = d.metrics_url.removesuffix("/metrics")
    one: dict[str, Any] = dict(num_nodes=1, gpus_per_node=1, node_rank=0, local_rank=0, timeout=20)
    ended = [f"done-{i:02}" for i in range(FINISHED_PAGE + 5)]  # this test's own daemon
    for job in ended:
        with RendezvousClient(d.endpoint, job, token=d.token) as c:
            c.join(**one)
            c.leave()
    with RendezvousClient(d.endpoint, job_id, token=d.token) as live:
        live.join(**one)
        live.start_heartbeat(0.2)
        browser.log_in(base, d.token)
        browser.navigate(f"{base}/")
        rows = "[...document.querySelectorAll('#jobs tbody tr')].map(tr => tr.dataset.job)"
        browser.wait_for("the live job alone", f"{rows}.length === 1")
        assert browser.evaluate(rows) == [job_id]
        count = f"{len(ended)} finished jobs held (ended {len(ended)})"
        browser.wait_for(
            "the finished ones counted, collapsed",
            f"document.getElementById('finished-count').textContent === {count!r}",
        )
        assert not browser.evaluate("document.getElementById('finished').open")
        assert not browser.evaluate("document.getElementById('finished').hidden")
        # The lone live job does not open by itself: 26 jobs are held.
        assert browser.evaluate("document.getElementById('job').hidden")
        browser.screenshot(FINISHED_SCREENSHOT)
        assert FINISHED_SCREENSHOT.stat().st_size > 10_000
        browser.evaluate("document.querySelector('#finished summary').click(); true")
        done = "[...document.querySelectorAll('#finished-jobs tbody tr')].map(tr => tr.dataset.job)"
        browser.wait_for("the first page", f"{done}.length === {FINISHED_PAGE}")
        assert browser.evaluate(done) == ended[::-1][:FINISHED_PAGE]  # the newest first
        assert browser.evaluate("document.getElementById('finished-shown').textContent") == (
            f"the newest {FINISHED_PAGE} of {len(ended)} shown"
        )
        more = browser.evaluate("document.getElementById('finished-more').textContent")
        assert more == "Show 5 more", more
        browser.evaluate("document.getElementById('finished-more').click(); true")
        browser.wait_for("every finished job", f"{done}.length === {len(ended)}")
        assert browser.evaluate("document.getElementById('finished-more').hidden")
        # A finished job opens as any other.
        browser.evaluate(f"location.hash = '#job={ended[0]}'; true")
        browser.wait_for(
            "the finished job's panel",
            f"document.getElementById('job-title').textContent === {ended[0]!r} && "
            "document.getElementById('job-state').textContent === 'ENDED'",
        )
        browser.evaluate("location.hash = ''; true")
        browser.wait_for("the panel closed", "document.getElementById('job').hidden")
        browser.screenshot(FINISHED_OPEN_SCREENSHOT)
