"""A daemon token rotated under running rendezvous-run jobs, by operations.md's runbook
(the new token added to the daemon's token file and the daemon restarted, the nodes'
token files switched, the old token removed and the daemon restarted): real daemon
processes on one port with ``--state-dir``, real launchers on loopback.

Found by an operator review (h115, D1): every job died within 1.5 s of the old token's
removal, because the agent read its token file once at start; the daemon logged
nothing about the refusals and recorded each rank as "node unreachable"."""

from __future__ import annotations

import secrets
import subprocess
from pathlib import Path

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client import RendezvousClient
from tests.support import (
    ROOT,
    WORKERS,
    DaemonProcess,
    free_port,
    json_lines,
    launcher_cmd,
    scrape,
    spawn_daemon,
    wait_for,
    write_token,
)

WORKER = str(WORKERS / "elastic_worker.py")


class RotatingDaemon:
    """A daemon with ``--state-dir`` on a fixed port, restarted (SIGTERM, as an
    operator does) with the token lines its token file should hold."""

    def __init__(self, tmp: Path, tokens: list[str], *flags: str) -> None:
        self.tmp, self.port = tmp, free_port()
        self.flags = ("--state-dir", str(tmp / "state"), "--metrics-listen", "127.0.0.1:0", *flags)
        self.logs: list[Path] = []
        self.current = self._spawn(tokens)

    def _spawn(self, tokens: list[str]) -> DaemonProcess:
        # spawn_daemon writes its token argument as the file's text: one line each.
        d = spawn_daemon(
            self.tmp, *self.flags, token="\n".join(tokens), listen=f"127.0.0.1:{self.port}"
        )
        self.logs.append(d.log_path)
        return d

    def restart(self, tokens: list[str]) -> None:
        assert self.current.terminate() == 0, self.current.log()
        self.current = self._spawn(tokens)

    def log(self) -> str:
        return "\n".join(p.read_text() for p in self.logs)

    def kill(self) -> None:
        self.current.kill()


def _node(
    d: DaemonProcess, job: str, tmp: Path, rank: int, token_file: Path
) -> subprocess.Popen[bytes]:
    cmd = launcher_cmd(2, rank, 2, endpoint=d.endpoint, token_file=token_file)
    cmd += ["--job-id", job, "--heartbeat-interval-s", "0.5", "--max-restarts", "2"]
    # 15 s of steps: the job must outlast two daemon restarts on a loaded machine. Once
    # the test saw what it waits for, it touches tmp / "hurry" and the rest run unpaced.
    cmd += [WORKER, "--steps", "300", "--step-s", "0.05", "--hurry-file", str(tmp / "hurry")]
    with (tmp / f"node{rank}.out").open("w") as out, (tmp / f"node{rank}.err").open("w") as err:
        return subprocess.Popen(cmd, stdout=out, stderr=err, cwd=ROOT)


def _said(tmp: Path) -> str:
    return "\n---\n".join((tmp / f"node{r}.err").read_text() for r in range(2))


def test_a_token_rotated_by_the_runbook_keeps_a_running_two_node_job_alive(
    tmp_path: Path,
) -> None:
    """Before: both launchers gave up with AuthenticationError (restarts left) within
    seconds of the old token's removal. Now each node's client reads its token file
    again when its token is refused, sends the new one, and the job finishes in its
    first generation: no restart spent, no worker started again."""
    old, new = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    client_token = tmp_path / "node-token"
    write_token(client_token, old)
    daemon = RotatingDaemon(tmp_path, [old])
    job = "rotate-running"
    nodes = [_node(daemon.current, job, tmp_path, r, client_token) for r in range(2)]
    out = [tmp_path / f"node{r}.out" for r in range(2)]

    def resumed() -> int:
        return sum(1 for p in out for e in json_lines(p) if e.get("event") == "resumed")

    try:
        wait_for("the job to train", lambda: resumed() == 4, timeout=60)
        daemon.restart([old, new])  # 1. the new token added
        write_token(client_token, new)  # 2. the nodes' token file switched
        daemon.restart([new])  # 3. the old one removed
        # The job trains on with the new token: its progress reaches the new daemon.
        with RendezvousClient(daemon.current.endpoint, job, token=new) as probe:

            def stepping() -> bool:
                view = probe.get_job()
                return view.summary.state == pb.JOB_STATE_RUNNING and all(
                    m.heartbeat_stream_open for m in view.members
                )

            wait_for("the job's heartbeats on the new daemon", stepping, timeout=30)
        (tmp_path / "hurry").touch()
        codes = [n.wait(120) for n in nodes]
    finally:
        for n in nodes:
            if n.poll() is None:
                n.kill()
                n.wait(10)
        daemon.kill()
    said = _said(tmp_path)
    assert codes == [0, 0], said
    events = [e for p in out for e in json_lines(p)]
    ready = [e for e in events if e.get("event") == "ready"]
    # One generation: four workers started once, none restarted.
    assert len(ready) == 4 and all(e["restart_count"] == 0 for e in ready), said
    assert len([e for e in events if e.get("event") == "done"]) == 4, said
    assert "restart 1 of" not in said, said
    # The nodes say they picked the new token up; no token's text anywhere.
    assert "holds another token now (rotated)" in said, said
    log = daemon.log()
    assert "refused Heartbeat from" in log or "refused CallBatches from" in log, log
    for text in (said, log):
        assert old not in text and new not in text


def test_a_node_whose_token_was_removed_is_told_so_and_not_lost_as_unreachable(
    tmp_path: Path,
) -> None:
    """The old token removed while a node still holds it (its file not switched):
    before, the agent failed with a bare AuthenticationError, the daemon logged
    nothing, and recorded the node as "no heartbeat for 3.0 s (node unreachable)".
    Now the daemon logs the refusal (peer, method; never the token), counts it, and
    words the loss by the refused token; the agent's message asks about a rotation."""
    old, new = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    client_token = tmp_path / "node-token"
    write_token(client_token, old)
    daemon = RotatingDaemon(tmp_path, [old], "--heartbeat-timeout-s", "3")
    job = "rotate-forgotten"
    nodes = [_node(daemon.current, job, tmp_path, r, client_token) for r in range(2)]
    out = [tmp_path / f"node{r}.out" for r in range(2)]

    def resumed() -> int:
        return sum(1 for p in out for e in json_lines(p) if e.get("event") == "resumed")

    try:
        wait_for("the job to train", lambda: resumed() == 4, timeout=60)
        daemon.restart([new])  # the old token removed; the nodes' file not switched
        with RendezvousClient(daemon.current.endpoint, job, token=new) as probe:
            wait_for(
                "the job to fail", lambda: probe.get_job().summary.state != pb.JOB_STATE_RUNNING, 30
            )
            view = probe.get_job()
        codes = [n.wait(90) for n in nodes]
        metrics = scrape(daemon.current.metrics_url)
    finally:
        for n in nodes:
            if n.poll() is None:
                n.kill()
                n.wait(10)
        daemon.kill()
    said = _said(tmp_path)
    assert codes == [2, 2], said  # a join refused for the setup: no restart helps
    assert "was it rotated?" in said, said
    causes = " | ".join(m.cause for m in view.failed) + " | " + view.last_failure.cause
    assert "unreachable" not in causes, (causes, daemon.log())
    assert "refused for their token" in causes, (causes, daemon.log())
    log = daemon.log()
    assert "unreachable" not in log.split("serving on")[-1], log
    refusals = [
        ln
        for ln in log.splitlines()
        if "refused Heartbeat from" in ln or "refused CallBatches from" in ln
    ]
    assert refusals and "127.0.0.1" in refusals[0], log
    # Rate-limited: one line per host per minute, whatever the nodes' retries.
    assert len(refusals) == 1, refusals
    assert metrics['rendezvousd_auth_refused_total{method="Heartbeat"}'] >= 1, metrics
    for text in (said, log, str(metrics)):
        assert old not in text and new not in text
