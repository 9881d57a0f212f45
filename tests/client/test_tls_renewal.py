"""A client re-reads its own mTLS certificate: renewed on disk (cert-manager, SPIFFE
SVIDs, ACME), it is the one the next connection shows, not the one the channel was
made with. A real daemon process over mTLS, with ``--state-dir``, killed and started
again in its place trusting only the CA of the renewed certificate: the old one is
refused at the next handshake, as an expired one would be."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from rendezvousd.client import (
    AsyncRendezvousClient,
    RendezvousClient,
    RendezvousError,
    TlsConfig,
)
from rendezvousd.client.connection import TlsFiles
from tests.support import (
    Pki,
    StatefulDaemon,
    launcher_cmd,
    make_pki,
    wait_for,
)

HEARTBEAT_TIMEOUT_S = "3"
#: Wide enough for a daemon's restart on a loaded machine; the test waits on events.
WINDOW_S = 30.0
JOIN = {"num_nodes": 1, "gpus_per_node": 1, "local_rank": 0, "timeout": 20}


def _files(tmp: Path, pki: Pki) -> TlsConfig:
    """The client's own copies of its certificate and key, which the test renews."""
    own = tmp / "client-tls"
    own.mkdir()
    for source, name in ((pki.client, "tls.crt"), (pki.client_key, "tls.key")):
        shutil.copy2(source, own / name)
    return TlsConfig(ca=pki.ca, cert=own / "tls.crt", key=own / "tls.key")


def _renew(tls: TlsConfig, cert: Path, key: Path) -> None:
    """``cert`` and ``key`` moved over the client's files, each whole (as cert-manager
    and the SPIFFE helper write them), the key kept 0600."""
    assert tls.cert is not None and tls.key is not None
    for source, target in ((key, tls.key), (cert, tls.cert)):
        tmp = target.with_suffix(".new")
        shutil.copy2(source, tmp)
        os.replace(tmp, target)


def _restart_trusting(d: StatefulDaemon, pki: Pki, client_ca: Path) -> None:
    """SIGKILL the daemon, start it again in its place (its jobs restored) with
    ``client_ca`` as the only CA its clients' certificates may be signed by."""
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


def _reattached(d: StatefulDaemon, pki: Pki, job: str) -> bool:
    """Whether the restored daemon has the member's heartbeat stream open again: asked
    with a certificate the restarted daemon accepts (the renewed one's CA)."""
    tls = TlsConfig(ca=pki.ca, cert=pki.rogue, key=pki.rogue_key)
    with RendezvousClient(d.current.endpoint, job, token=d.token, tls=tls) as probe:
        members = probe.get_job().members
    return len(members) == 1 and members[0].heartbeat_stream_open


@pytest.fixture
def mtls_daemon(tmp_path: Path) -> Iterator[tuple[StatefulDaemon, Pki]]:
    (tmp_path / "pki").mkdir()
    pki = make_pki(tmp_path / "pki")
    args = ("--heartbeat-timeout-s", HEARTBEAT_TIMEOUT_S, *pki.serve_args(mtls=True))
    with StatefulDaemon(tmp_path, *args) as d:  # killed however the test ends
        yield d, pki


def test_a_renewed_client_certificate_is_shown_at_the_reconnect(
    tmp_path: Path, mtls_daemon: tuple[StatefulDaemon, Pki]
) -> None:
    """Joined with certificate A; A renewed on disk as B; the daemon restarted trusting
    only B's CA. The member reattaches on B and keeps its membership (the node agent's
    and the torchrun agent's case: one client for the whole job). Before, it kept
    showing A, every handshake was refused, and it was lost: DaemonUnreachable."""
    d, pki = mtls_daemon
    tls = _files(tmp_path, pki)
    failures: queue.Queue[RendezvousError] = queue.Queue()
    with RendezvousClient(
        d.current.endpoint, "renewed", token=d.token, tls=tls, reconnect_window=WINDOW_S
    ) as member:
        joined = member.join(**JOIN)
        member.start_heartbeat(0.2, on_failure=failures.put)
        _renew(tls, pki.rogue, pki.rogue_key)
        _restart_trusting(d, pki, pki.rogue_ca)
        wait_for("the heartbeat stream back", lambda: _reattached(d, pki, "renewed"), WINDOW_S)
        member.kv_set("after", b"renewal")  # its calls go on the renewed channel too
        assert member.kv_get("after") == b"renewal"
        assert failures.empty(), failures.get()
        assert member.membership is not None
        assert member.membership.generation == joined.generation
        member.raise_if_failed()
        # One new channel, made at the redial, not one per call or beat after it.
        assert member._c.files is not None and member._c.files.renewals == 1
        member.leave()


async def test_the_asyncio_client_shows_a_renewed_certificate_at_the_reconnect(
    tmp_path: Path, mtls_daemon: tuple[StatefulDaemon, Pki]
) -> None:
    """The twin: the same renewal, seen by the asyncio client's heartbeat task."""
    d, pki = mtls_daemon
    tls = _files(tmp_path, pki)
    failures: list[RendezvousError] = []
    async with AsyncRendezvousClient(
        d.current.endpoint, "renewed-aio", token=d.token, tls=tls, reconnect_window=WINDOW_S
    ) as member:
        joined = await member.join(**JOIN)
        member.start_heartbeat(0.2, on_failure=failures.append)
        _renew(tls, pki.rogue, pki.rogue_key)
        await asyncio.to_thread(_restart_trusting, d, pki, pki.rogue_ca)
        await asyncio.to_thread(
            wait_for,
            "the heartbeat stream back",
            lambda: _reattached(d, pki, "renewed-aio"),
            WINDOW_S,
        )
        await member.kv_set("after", b"renewal")
        assert await member.kv_get("after") == b"renewal"
        assert not failures, failures
        assert member.membership is not None
        assert member.membership.generation == joined.generation
        member.raise_if_failed()
        await member.leave()


async def test_the_asyncio_clients_member_table_follows_the_renewal(
    tmp_path: Path, mtls_daemon: tuple[StatefulDaemon, Pki]
) -> None:
    """The asyncio client reads a slim join's table over a blocking channel of its own
    (``_tables``). It follows the renewal the client's channel took: the table of a
    join made after the renewal and the daemon's restart is read. Before, that channel,
    made at the first read, kept the old certificate, and every later read was refused
    at the handshake."""
    d, pki = mtls_daemon
    tls = _files(tmp_path, pki)
    async with AsyncRendezvousClient(
        d.current.endpoint, "table-aio", token=d.token, tls=tls, call_timeout=15
    ) as member:
        before = await member.join(**JOIN)
        # Its first read makes the table's channel, with the certificate of now.
        assert [m.rank for m in await asyncio.to_thread(lambda: before.members)] == [0]
        member.start_heartbeat(0.2)
        _renew(tls, pki.rogue, pki.rogue_key)
        await asyncio.to_thread(_restart_trusting, d, pki, pki.rogue_ca)
        await asyncio.to_thread(
            wait_for, "the member back", lambda: _reattached(d, pki, "table-aio"), WINDOW_S
        )
        assert member._c.files is not None and member._c.files.renewals == 1
        # The generation's table fetched again, as its first read fetched it: over
        # the table's channel (``Membership.members`` keeps what it read).
        fetch = member._s.page_fetcher("table-aio", before.generation, 0, member._s.instance_id)
        page = await asyncio.to_thread(fetch, 0)
        assert [m.rank for m in page.members] == [0]
        # One renewal taken, by whichever channel noticed it first; the other followed.
        assert member._c.files.renewals == 1
        await member.leave()


def test_a_call_in_flight_on_a_replaced_channel_is_answered(
    tmp_path: Path, mtls_daemon: tuple[StatefulDaemon, Pki]
) -> None:
    """A renewal taken while a call waits on the channel (the heartbeat's, after its
    stream broke, looks whatever the channel's state): the waiting call is answered,
    not cancelled, and the replaced channel is kept until the client closes (no look
    can tell when a blocking unary call on it has ended: ``RendezvousClient._replaced``)."""
    d, pki = mtls_daemon
    tls = _files(tmp_path, pki)
    with RendezvousClient(d.current.endpoint, "in-flight", token=d.token, tls=tls) as member:
        member.join(**JOIN)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(member.kv_get, "later", timeout=60)
            old = member._channel
            wait_for("the wait in flight", lambda: old._call_state.managed_calls > 0, 10)
            _renew(tls, pki.client, pki.client_key)
            assert member._renew(unless_ready=False)  # as the heartbeat's redial does
            assert member._channel is not old and member._replaced == [old]
            member.kv_set("later", b"answered")
            assert waiting.result(30) == b"answered"
        member.leave()
    assert member._replaced == []


def test_a_half_written_renewal_keeps_the_working_certificate_and_says_so_once(
    tmp_path: Path,
    mtls_daemon: tuple[StatefulDaemon, Pki],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The certificate replaced and its key not yet (they do not match): the channel
    made with the old pair stays, the member reattaches on it after the daemon's
    restart (which still trusts the old pair), and one WARNING names the files,
    never the key's bytes."""
    caplog.set_level(logging.WARNING, logger="rendezvousd.client")
    d, pki = mtls_daemon
    tls = _files(tmp_path, pki)
    assert tls.cert is not None and tls.key is not None
    key_pem = tls.key.read_text()
    failures: queue.Queue[RendezvousError] = queue.Queue()
    with RendezvousClient(
        d.current.endpoint, "half", token=d.token, tls=tls, reconnect_window=WINDOW_S
    ) as member:
        member.join(**JOIN)
        member.start_heartbeat(0.2, on_failure=failures.put)
        tmp = tls.cert.with_suffix(".new")
        shutil.copy2(pki.rogue, tmp)
        os.replace(tmp, tls.cert)  # the key is still the old certificate's
        _restart_trusting(d, pki, pki.ca)

        def back() -> bool:
            tls_probe = TlsConfig(ca=pki.ca, cert=pki.client, key=pki.client_key)
            with RendezvousClient(
                d.current.endpoint, "half", token=d.token, tls=tls_probe
            ) as probe:
                members = probe.get_job().members
            return len(members) == 1 and members[0].heartbeat_stream_open

        wait_for("the heartbeat stream back on the old pair", back, WINDOW_S)
        member.kv_set("after", b"restart")
        assert failures.empty(), failures.get()
        said = [r.getMessage() for r in caplog.records if "do not work together" in r.getMessage()]
        assert len(said) == 1, said
        assert str(tls.cert) in said[0] and str(tls.key) in said[0], said[0]
        assert "keeps the certificate it connected with" in said[0], said[0]
        assert all(key_pem.strip() not in r.getMessage() for r in caplog.records)
        assert "PRIVATE KEY" not in "\n".join(r.getMessage() for r in caplog.records)
        member.leave()


def test_a_call_made_after_the_renewal_shows_the_renewed_certificate(
    tmp_path: Path, mtls_daemon: tuple[StatefulDaemon, Pki]
) -> None:
    """No heartbeat to notice it (an inspecting client, `rendezvousd status`'s): the
    call that finds no connection makes the channel anew (the call core's ``Renew``)
    and is answered. Before, the old certificate's refusal was its answer: "closes
    every TLS connection during the handshake"."""
    d, pki = mtls_daemon
    tls = _files(tmp_path, pki)
    with RendezvousClient(d.current.endpoint, token=d.token, tls=tls) as inspector:
        assert inspector.list_jobs() == []
        _renew(tls, pki.rogue, pki.rogue_key)
        _restart_trusting(d, pki, pki.rogue_ca)
        assert inspector.list_jobs() == []


async def test_the_asyncio_clients_call_after_the_renewal_shows_the_renewed_certificate(
    tmp_path: Path, mtls_daemon: tuple[StatefulDaemon, Pki]
) -> None:
    """The twin of the call's renewal."""
    d, pki = mtls_daemon
    tls = _files(tmp_path, pki)
    async with AsyncRendezvousClient(d.current.endpoint, token=d.token, tls=tls) as inspector:
        assert await inspector.list_jobs() == []
        _renew(tls, pki.rogue, pki.rogue_key)
        await asyncio.to_thread(_restart_trusting, d, pki, pki.rogue_ca)
        assert await inspector.list_jobs() == []


_STEPPING = """\
import sys, time
from pathlib import Path
from rendezvousd.trainer.distributed import init_distributed
with init_distributed() as ctx:
    step = 0
    while not Path(sys.argv[2]).exists():
        ctx.progress(step)
        if step == 3:
            Path(sys.argv[1]).touch()
        step += 1
        time.sleep(0.05)
"""


def test_a_node_agent_outlives_its_certificates_renewal_and_a_restart(
    tmp_path: Path, mtls_daemon: tuple[StatefulDaemon, Pki]
) -> None:
    """rendezvous-run's agent, one client for the whole job: its certificate renewed on
    disk, the daemon restarted trusting only the renewed one's CA; the node reattaches
    and its worker finishes (exit 0). Before, the agent lost the daemon and stopped
    its worker."""
    d, pki = mtls_daemon
    tls = _files(tmp_path, pki)
    script, stepping, stop = tmp_path / "w.py", tmp_path / "stepping", tmp_path / "stop"
    script.write_text(_STEPPING)
    cmd = launcher_cmd(1, 0, 1, endpoint=d.current.endpoint, token_file=d.token_file)
    flags = ["--tls-ca", str(tls.ca), "--tls-cert", str(tls.cert), "--tls-key", str(tls.key)]
    agent = subprocess.Popen(
        [*cmd, "--job-id", "agent-renewed", *flags, str(script), str(stepping), str(stop)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for("the worker to step", stepping.exists, timeout=60)
        _renew(tls, pki.rogue, pki.rogue_key)
        _restart_trusting(d, pki, pki.rogue_ca)
        wait_for("the node back", lambda: _reattached(d, pki, "agent-renewed"), WINDOW_S)
        stop.touch()
        _out, err = agent.communicate(timeout=60)
    finally:
        agent.kill()
    assert agent.returncode == 0, err
    assert "unreachable" not in err, err


def test_the_files_decide_once_per_state_and_take_the_pair_once_it_is_whole(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``TlsFiles``, the decision both twins ask: nothing while the files are the
    channel's; a half-written pair refused and said once however often it is asked;
    the pair taken once its key follows, and then nothing again."""
    caplog.set_level(logging.WARNING, logger="rendezvousd.client")
    (tmp_path / "pki").mkdir()
    pki = make_pki(tmp_path / "pki")
    tls = _files(tmp_path, pki)
    assert tls.cert is not None and tls.key is not None
    files = TlsFiles(tls)
    assert not files.changed(0) and files.renewed("127.0.0.1:1", 0) is None
    tmp = tls.cert.with_suffix(".new")
    shutil.copy2(pki.rogue, tmp)
    os.replace(tmp, tls.cert)  # the certificate renewed, its key not yet
    assert files.changed(0)
    assert files.renewed("127.0.0.1:1", 0) is None
    assert not files.changed(0) and files.renewed("127.0.0.1:1", 0) is None
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "do not work together yet" in said[0], said
    assert "127.0.0.1:1" in said[0] and "PRIVATE KEY" not in said[0], said
    _renew(tls, pki.rogue, pki.rogue_key)  # now the key, the pair whole
    renewal = files.renewed("127.0.0.1:1", 0)
    assert renewal is not None and renewal[0] == 1 and files.renewals == 1
    assert not files.changed(1) and files.renewed("127.0.0.1:1", 1) is None
    # A channel made before it (another of the client's) is behind and is told so,
    # with no read of the files: one renewal, followed by every channel.
    assert files.changed(0) and files.renewed("127.0.0.1:1", 0) == renewal
    assert files.renewals == 1
