"""What a forming generation failed on with no member lost (a joiner's topology or
version, ``GetJobResponse.conflict``) and which members' SDK predates instance ids:
kept over a daemon restart, as ``wire_version`` is, and the conflict shown on the
status page's job view (a real daemon, restarted on its state dir, and a real headless
Chromium)."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from rendezvousd.common.model import JobState
from rendezvousd.errors import DaemonError
from rendezvousd.state.job import OLD_SDK
from rendezvousd.state.machine import RendezvousState
from rendezvousd.storage.persistence import Persister
from tests.daemon.browser import Chromium, chromium_missing
from tests.daemon.raw_calls import bearer
from tests.daemon.test_old_sdk import formed, refused_without_id
from tests.daemon.test_versions import NEW, first, node, refused
from tests.support import ROOT, DaemonProcess, free_port, write_token

SCREENSHOT = ROOT / "artifacts" / "status-page-conflict.png"


def _restarted(sm: RendezvousState, tmp_path: Path) -> RendezvousState:
    saver = Persister(tmp_path, sm)
    saver.restore()  # a database opened for a state that holds jobs writes them all
    saver.close()
    back = RendezvousState()
    Persister(tmp_path, back).restore()
    return back


def test_a_topology_conflict_is_kept_over_a_restart_and_still_told_to_late_joiners(
    tmp_path: Path,
) -> None:
    sm = RendezvousState()
    first(sm, node("a", NEW))
    told = refused(sm, node("b", NEW, hi=3))
    assert told.reason == "TOPOLOGY_MISMATCH"
    back = _restarted(sm, tmp_path)
    job = back.jobs["j"]
    assert job.state is JobState.FAILED and not job.gen.failed
    assert back.view("j", 2.0).conflict == told.message
    assert job.gen.conflict is not None and job.gen.conflict.metadata == told.metadata
    # Within a heartbeat timeout of it, a late node of that launch still hears it.
    late = refused(back, node("c", NEW), 2.0)
    assert late.reason == "TOPOLOGY_MISMATCH" and late.message.startswith(told.message)


def test_a_hand_edited_conflict_is_a_clear_startup_error(tmp_path: Path) -> None:
    sm = RendezvousState()
    first(sm, node("a", NEW))
    refused(sm, node("b", NEW, hi=3))
    saver = Persister(tmp_path, sm)
    saver.restore()
    saver.close()
    db = sqlite3.connect(tmp_path / "state.db")
    db.execute("UPDATE jobs SET detail = json_set(detail, '$.conflict.reason', 'NO_SUCH')")
    db.commit()
    db.close()
    with pytest.raises(DaemonError, match=r"conflict\.reason must be one of"):
        Persister(tmp_path, RendezvousState()).restore()


def test_an_old_sdks_mark_is_kept_over_a_restart_and_its_loss_says_why(tmp_path: Path) -> None:
    """Its call without an instance id was refused, and its worker fails on that; the
    daemon restarts before its loss is found: the loss still names the old SDK, not
    only the silence."""
    sm = RendezvousState()
    formed(sm)
    refused_without_id(sm)
    back = _restarted(sm, tmp_path)
    assert back.jobs["j"].gen.members[1].without_instance_id
    assert not back.jobs["j"].gen.members[0].without_instance_id
    # Restored members have a heartbeat timeout from the restore (the process's clock)
    # to reattach: rank 0 does and beats on; rank 1 never comes back.
    later = time.monotonic() + back.timing.heartbeat_timeout_s + 1.0
    back.attach_stream("j", 1, 0, "w0", later)
    back.tick(later)
    lost = back.jobs["j"].gen.failed
    assert [f.rank for f in lost] == [1] and lost[0].cause.startswith(f"{OLD_SDK}: upgrade it")


@pytest.mark.skipif(chromium_missing() is not None, reason=str(chromium_missing()))
def test_the_status_page_shows_a_conflict_kept_over_a_restart(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    """Two node agents of different topologies: the forming generation fails with no
    member lost. After a restart, GetJob still says why, and so does the job view."""
    port, token = free_port(), write_token(tmp_path / "tok")
    flags = ("--state-dir", str(tmp_path / "state"), "--metrics-listen", "127.0.0.1:0")

    def join_node(d: DaemonProcess, inst: str, nodes: int) -> grpc.RpcError | None:
        request = pb.JoinNodeRequest(
            job_id="mixed",
            min_nodes=2,
            max_nodes=nodes,
            gpus_per_node=1,
            host=f"host-{inst}",
            instance_id=inst,
            wire_version=NEW,
            wait_timeout_ms=5000,
        )
        with grpc.insecure_channel(d.endpoint) as channel:
            try:
                pb_grpc.RendezvousStub(channel).JoinNode(request, metadata=bearer(d), timeout=10)
            except grpc.RpcError as exc:
                return exc
        return None

    d = start_daemon(*flags, token=token, listen=f"127.0.0.1:{port}")
    assert join_node(d, "a", 2) is None  # node 0, asked for the id
    mismatch = join_node(d, "b", 3)
    assert mismatch is not None and mismatch.code() is grpc.StatusCode.FAILED_PRECONDITION
    told = mismatch.details()
    assert d.terminate() == 0
    d = start_daemon(*flags, token=token, listen=f"127.0.0.1:{port}")
    with grpc.insecure_channel(d.endpoint) as channel:
        job = pb_grpc.RendezvousStub(channel).GetJob(
            pb.GetJobRequest(job_id="mixed"), metadata=bearer(d), timeout=5
        )
    assert job.summary.state == pb.JOB_STATE_FAILED and not job.failed
    assert job.conflict == told
    base = d.metrics_url.removesuffix("/metrics")
    with Chromium() as browser:
        browser.log_in(base, d.token)
        browser.navigate(f"{base}/#job=mixed")
        shown = browser.wait_for(
            "the conflict in the job view",
            "!document.getElementById('conflict-box').hidden && "
            "document.getElementById('conflict').textContent",
            timeout=10,
        )
        assert "but the node agent on host 'host-b' asked for" in shown, shown
        assert shown == told
        assert browser.evaluate("document.getElementById('nofailed').hidden") is False
        # A failed job is a finished one: its row is under the live jobs' table.
        overview = browser.evaluate("document.querySelector('#finished-jobs td.cause').textContent")
        assert overview.startswith("job 'mixed' generation 1 has "), overview
        browser.screenshot(SCREENSHOT)
    assert SCREENSHOT.stat().st_size > 10_000
