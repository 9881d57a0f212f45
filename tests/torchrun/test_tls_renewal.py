"""torchrun's handler (``--rdzv-backend rendezvousd``) through a renewal of its mTLS
client certificate: the handler holds one SDK client for the whole job, which re-reads
its TLS files at its reconnect (``tests/client/test_tls_renewal.py`` for the SDK's own)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.client.test_tls_renewal import _files, _reattached, _renew
from tests.support import ENV_WORKER, Pki, StatefulDaemon, Torchrun, make_pki, torch_steps, wait_for

pytestmark = pytest.mark.slow

#: The handler's client waits for its daemon that long (it has no reconnect window of
#: its own): wide enough for a daemon's restart on a loaded machine. At 3 s the agent
#: gave up on the restarted daemon, "unreachable for 3.0 s (window 3 s)", 3 runs in 5.
HEARTBEAT_TIMEOUT_S = "15"


def restart_trusting(d: StatefulDaemon, pki: Pki, client_ca: Path) -> None:
    """SIGKILL the daemon, start it again in its place (its jobs restored) trusting
    only ``client_ca`` for its clients' certificates."""
    d.current.kill()
    d.flags = (
        "--state-dir",
        str(d.tmp / "state"),
        "--heartbeat-timeout-s",
        HEARTBEAT_TIMEOUT_S,
        *pki.serve_args(),
        "--tls-client-ca",
        str(client_ca),
    )
    d.start_again()


@pytest.fixture
def mtls_daemon(tmp_path: Path) -> Iterator[tuple[StatefulDaemon, Pki]]:
    (tmp_path / "pki").mkdir()
    pki = make_pki(tmp_path / "pki")
    args = ("--heartbeat-timeout-s", HEARTBEAT_TIMEOUT_S, *pki.serve_args(mtls=True))
    with StatefulDaemon(tmp_path, *args) as d:
        yield d, pki


def test_a_torchrun_job_outlives_its_certificates_renewal_and_a_restart(
    torchrun: Callable[..., Torchrun],
    tmp_path: Path,
    job_id: str,
    mtls_daemon: tuple[StatefulDaemon, Pki],
) -> None:
    """A torchrun job over mTLS; its client certificate and key renewed on disk (another
    CA), the daemon SIGKILLed and started again with --state-dir trusting only the new
    CA. The handler's client shows the renewed certificate at its reconnect: the node
    reattaches, its workers go on without a restart and the job ends 0, no
    AuthenticationError said."""
    d, pki = mtls_daemon
    tls = _files(tmp_path, pki)
    log, stop = tmp_path / "steps.jsonl", tmp_path / "stop"
    conf = f"token_file={d.token_file},tls_ca={tls.ca},tls_cert={tls.cert},tls_key={tls.key}"
    worker = ("--steps", "100000", "--step-log", str(log), "--stop-file", str(stop))
    agent = torchrun(d.current, job_id, "1", *worker, nproc=1, conf=conf, script=ENV_WORKER)
    wait_for("the job to step", lambda: bool(torch_steps(log)), timeout=120)
    _renew(tls, pki.rogue, pki.rogue_key)
    restart_trusting(d, pki, pki.rogue_ca)
    try:
        wait_for("the node back", lambda: _reattached(d, pki, job_id), 60)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the agent said: {agent.stderr()[-6000:]}") from None
    stepped = len(torch_steps(log))
    wait_for("the job to step on", lambda: len(torch_steps(log)) > stepped + 5, timeout=30)
    stop.touch()
    assert agent.wait(120) == 0, agent.stderr()[-3000:]
    err = agent.stderr()
    assert "AuthenticationError" not in err and "handshake" not in err, err[-3000:]
    steps = torch_steps(log)
    assert {s["restart"] for s in steps} == {0}, steps[-3:]
