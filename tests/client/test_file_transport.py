"""The single-node file transport: real worker processes over rank 0's UNIX socket.

Seed catalogue: ``file_rendezvous_round_trips_id_bytes`` and
``file_rendezvous_receive_times_out_when_rank0_never_publishes``.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rendezvousd.client import _file_wire as wire
from rendezvousd.client import file_transport
from rendezvousd.client._session import UNIQUE_ID_BYTES
from rendezvousd.client.errors import (
    AuthenticationError,
    InvalidRequest,
    KeyNotFound,
    PeerFailed,
    ProtocolError,
    RendezvousError,
    RendezvousTimeout,
)
from rendezvousd.client.file_transport import FileRendezvous
from rendezvousd.client.sync import RendezvousClient
from rendezvousd.client.transport import Rendezvous, connect
from rendezvousd.trainer.store import JobStore
from tests.support import WORKERS

WORKER = WORKERS / "file_worker.py"
WORLD = 4


# -- helpers --------------------------------------------------------------------


def spawn(
    cfg: dict[str, Any],
    *,
    unique_id: bytes | None = None,
    stdout: IO[bytes] | int = subprocess.PIPE,
    stderr: IO[bytes] | int = subprocess.DEVNULL,
    cwd: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start a worker; with ``wait_for_go`` in cfg it holds after joining until go()."""
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), json.dumps({**cfg, "id_on_stdin": unique_id is not None})],
        stdin=subprocess.PIPE,
        stdout=stdout,
        stderr=stderr,
        cwd=cwd,
    )
    assert proc.stdin is not None
    if unique_id is not None:
        proc.stdin.write(unique_id.hex().encode() + b"\n")
        proc.stdin.flush()
    if not cfg.get("wait_for_go"):
        go(proc)
    return proc


def go(proc: subprocess.Popen[bytes]) -> None:
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.write(b"go\n")
            proc.stdin.close()
        proc.stdin = None  # so communicate() does not flush it


def events(text: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for line in text.splitlines():
        if line.strip():
            event = json.loads(line)
            out[event["event"]] = event
    return out


def next_event(proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"worker exited early with {proc.wait()}"
    event: dict[str, Any] = json.loads(line)
    return event


def finish(procs: list[subprocess.Popen[bytes]], timeout: float) -> list[dict[str, dict[str, Any]]]:
    deadline = time.monotonic() + timeout
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        results.append(events(out.decode()))
    return results


def kill_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


# -- four workers, one job -------------------------------------------------------


@pytest.fixture(scope="module")
def roundtrip(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Runs 1 node x 4 workers once; logs go to files in the shared directory."""
    directory = tmp_path_factory.mktemp("rdv")
    unique_id = os.urandom(UNIQUE_ID_BYTES)
    cfg = {"path": str(directory), "job_id": "rt", "gpus_per_node": WORLD, "mode": "roundtrip"}
    procs = []
    for rank in range(WORLD):
        with (
            open(directory / f"rank{rank}.out", "wb") as out,
            open(directory / f"rank{rank}.err", "wb") as err,
        ):
            procs.append(
                spawn(
                    {**cfg, "local_rank": rank},
                    unique_id=unique_id if rank == 0 else None,
                    stdout=out,
                    stderr=err,
                    cwd=directory,
                )
            )
    try:
        codes = [proc.wait(timeout=30) for proc in procs]
    finally:
        kill_all(procs)
    results = [events((directory / f"rank{r}.out").read_text()) for r in range(WORLD)]
    yield {"dir": directory, "id": unique_id, "codes": codes, "results": results}


def test_file_rendezvous_round_trips_id_bytes(roundtrip: dict[str, Any]) -> None:
    assert roundtrip["codes"] == [0] * WORLD
    expected = hashlib.sha256(roundtrip["id"]).hexdigest()
    joined = [r["joined"] for r in roundtrip["results"]]
    assert sorted(j["rank"] for j in joined) == list(range(WORLD))
    for j in joined:
        assert j["id_len"] == UNIQUE_ID_BYTES
        assert j["id_sha256"] == expected
        assert j["world_size"] == WORLD
        assert j["generation"] == 1
    host = socket.gethostname()
    table = [[r, 0, r, host] for r in range(WORLD)]
    assert all(j["members"] == table for j in joined)
    assert all("done" in r for r in roundtrip["results"])


def test_barrier_waits_for_every_rank(roundtrip: dict[str, Any]) -> None:
    # Rank 0 sleeps 0.5 s before entering; nobody may pass before it arrives.
    waits = [r["barrier"]["waited"] for r in roundtrip["results"][1:]]
    assert all(w >= 0.3 for w in waits), waits


def test_kv_set_get_with_wait(roundtrip: dict[str, Any]) -> None:
    values = {str(r): f"value-{r}" for r in range(WORLD)}
    for result in roundtrip["results"]:
        assert result["kv"]["values"] == values
        assert bytes.fromhex(result["kv"]["late"]) == b"\x00\xffpayload"


def test_id_never_written_to_any_file(roundtrip: dict[str, Any]) -> None:
    unique_id: bytes = roundtrip["id"]
    forms = [
        unique_id,
        unique_id.hex().encode(),
        unique_id.hex().upper().encode(),
        base64.b64encode(unique_id),
        base64.b64encode(unique_id)[:40],
    ]
    files = [p for p in roundtrip["dir"].rglob("*") if p.is_file()]
    assert files, "the workers' logs should be in the directory"
    for path in files:
        data = path.read_bytes()
        for form in forms:
            assert form not in data, f"{path.name} holds the unique id"
    # The socket is gone once every rank left; nothing else was left behind.
    assert not list(roundtrip["dir"].glob("*.sock"))
    assert sorted(p.name for p in files) == sorted(
        f"rank{r}.{ext}" for r in range(WORLD) for ext in ("out", "err")
    )


# -- join errors -------------------------------------------------------------------


@pytest.fixture(scope="module")
def bad_joins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """A 2-rank job, then a second rank 0, a second rank 1 and a mismatched rank 1."""
    path = str(tmp_path_factory.mktemp("bad") / "job.sock")
    base = {"path": path, "job_id": "bad", "gpus_per_node": 2, "mode": "join", "timeout": 15.0}
    # The first pair holds the job open until the intruders have been answered.
    members = [spawn({**base, "local_rank": r, "wait_for_go": True}) for r in (0, 1)]
    intruders: list[subprocess.Popen[bytes]] = []
    try:
        for proc in members:
            assert next_event(proc)["event"] == "joined"
        intruders += [
            spawn({**base, "local_rank": 0}),
            spawn({**base, "local_rank": 1}),
            spawn({**base, "local_rank": 1, "gpus_per_node": 3}),
        ]
        answers = finish(intruders, 20.0)
        for proc in members:
            go(proc)
        results = finish(members, 20.0)
        return {
            "members": {str(r): result for r, result in enumerate(results)},
            "rank0": answers[0],
            "rank1": answers[1],
            "mismatch": answers[2],
        }
    finally:
        kill_all(members + intruders)


def test_duplicate_local_rank_is_refused(bad_joins: dict[str, Any]) -> None:
    for who in ("rank0", "rank1"):
        error = bad_joins[who]["join_error"]
        assert error["kind"] == "DuplicateRank", error
        assert "already held" in error["message"]
    # The rightful holders were not disturbed.
    assert all("done" in r for r in bad_joins["members"].values())


def test_topology_mismatch_is_refused(bad_joins: dict[str, Any]) -> None:
    error = bad_joins["mismatch"]["join_error"]
    assert error["kind"] == "TopologyMismatch"
    assert "gpus_per_node=2" in error["message"] and "gpus_per_node=3" in error["message"]


def test_file_rendezvous_receive_times_out_when_rank0_never_publishes(tmp_path: Path) -> None:
    rv = FileRendezvous(tmp_path / "never.sock", "never")
    started = time.monotonic()
    with pytest.raises(RendezvousTimeout) as info:
        rv.join(num_nodes=1, gpus_per_node=2, local_rank=1, timeout=0.5)
    elapsed = time.monotonic() - started
    assert 0.3 <= elapsed < 3.0
    assert "never published" in str(info.value) and str(tmp_path / "never.sock") in str(info.value)
    assert info.value.missing_ranks == [0]
    rv.close()


def test_world_incomplete_names_missing_ranks(tmp_path: Path) -> None:
    with FileRendezvous(tmp_path, "partial") as rv:
        with pytest.raises(RendezvousTimeout) as info:
            rv.join(num_nodes=1, gpus_per_node=3, local_rank=0, timeout=0.3)
        assert info.value.missing_ranks == [1, 2]
    assert not list(tmp_path.iterdir())


# -- failure detection -------------------------------------------------------------


def run_with_victim(tmp_path: Path, victim: int) -> list[dict[str, dict[str, Any]]]:
    cfg = {"path": str(tmp_path), "job_id": "kill", "gpus_per_node": WORLD, "timeout": 15.0}
    procs = [
        spawn({**cfg, "local_rank": r, "mode": "victim" if r == victim else "hold"})
        for r in range(WORLD)
    ]
    try:
        for proc in procs:
            assert next_event(proc)["event"] == "joined"
        killed_at = time.monotonic()
        procs[victim].send_signal(signal.SIGKILL)
        others = [p for r, p in enumerate(procs) if r != victim]
        results = finish(others, 15.0)
        assert time.monotonic() - killed_at < 15.0
        return results
    finally:
        kill_all(procs)


@pytest.mark.parametrize("victim", [3, 0], ids=["nonzero-rank", "rank0"])
def test_killed_worker_is_reported_as_peer_failed(tmp_path: Path, victim: int) -> None:
    for result in run_with_victim(tmp_path, victim):
        error = result["barrier_error"]
        assert error["kind"] == "PeerFailed", error
        assert error["ranks"] == str(victim)
        assert f"lost rank {victim}" in error["message"]
        assert error["after"] < 15.0
        callback = result["callback"]
        assert callback["kind"] == "PeerFailed" and callback["ranks"] == str(victim)


def test_close_without_leave_fails_the_job_for_the_others(tmp_path: Path) -> None:
    seen: list[RendezvousError] = []
    zero, one = FileRendezvous(tmp_path, "quit"), FileRendezvous(tmp_path, "quit")
    thread = threading.Thread(
        target=lambda: one.join(num_nodes=1, gpus_per_node=2, local_rank=1, timeout=10)
    )
    thread.start()
    zero.join(num_nodes=1, gpus_per_node=2, local_rank=0, timeout=10)
    thread.join()
    zero.start_heartbeat(0.05, seen.append)
    one.close()
    with pytest.raises(PeerFailed) as info:
        zero.barrier("b", timeout=10)
    assert info.value.ranks == [1]
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen and isinstance(seen[0], PeerFailed)
    with pytest.raises(PeerFailed):
        zero.raise_if_failed()
    zero.close()


# -- lifetime and the socket file ---------------------------------------------------


def test_socket_is_private_and_removed_after_leave(tmp_path: Path) -> None:
    with FileRendezvous(tmp_path, "solo") as rv:
        m = rv.join(num_nodes=1, gpus_per_node=1, local_rank=0)
        mode = os.lstat(rv.path).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
        assert rv.path == tmp_path / "solo.sock"
        assert (m.rank, m.world_size, m.generation) == (0, 1, 1)
        assert m.unique_id.hex() not in repr(m) + repr(rv)
        rv.kv_set("k", b"v")
        assert rv.kv_get("k", wait=False) == b"v"
        with pytest.raises(KeyNotFound):
            rv.kv_get("absent", wait=False)
        with pytest.raises(RendezvousTimeout):
            rv.kv_get("absent", timeout=0.2)
        rv.barrier()
    assert not rv.path.exists()


def test_rank0_keeps_serving_until_every_rank_left(tmp_path: Path) -> None:
    zero, one = FileRendezvous(tmp_path, "slow"), FileRendezvous(tmp_path, "slow")
    got: list[bytes] = []

    def late_worker() -> None:
        one.join(num_nodes=1, gpus_per_node=2, local_rank=1, timeout=10)
        time.sleep(0.4)  # rank 0 has already left by now
        got.append(one.kv_get("from0", timeout=5))
        one.leave()
        one.close()

    thread = threading.Thread(target=late_worker)
    thread.start()
    zero.join(num_nodes=1, gpus_per_node=2, local_rank=0, timeout=10)
    zero.kv_set("from0", b"hello")
    started = time.monotonic()
    zero.leave()
    assert time.monotonic() - started >= 0.3
    zero.close()
    thread.join()
    assert got == [b"hello"]
    assert one.failure is None
    assert not (tmp_path / "slow.sock").exists()


def test_stale_socket_is_replaced_and_other_files_are_refused(tmp_path: Path) -> None:
    stale = tmp_path / "stale.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(stale))
    dead.close()  # a socket file nobody listens on, as a killed rank 0 leaves behind
    with FileRendezvous(stale, "stale") as rv:
        rv.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=5)
    assert not stale.exists()

    regular = tmp_path / "regular"
    regular.write_bytes(b"keep me")
    rv = FileRendezvous(regular, "regular")
    with pytest.raises(InvalidRequest, match="not a socket"):
        rv.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=5)
    rv.close()
    assert regular.read_bytes() == b"keep me"

    rv = FileRendezvous(tmp_path / "missing-dir" / "x.sock", "nodir")
    with pytest.raises(InvalidRequest, match="does not exist"):
        rv.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=5)


def test_server_owned_by_another_user_is_not_trusted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = wire.FileServer(tmp_path / "owner.sock", "owner", 2, os.urandom(128))
    assert server.start()
    try:
        monkeypatch.setattr(file_transport, "peer_ids", lambda s: (1, os.getuid() + 1))
        rv = FileRendezvous(tmp_path, "owner")
        with pytest.raises(AuthenticationError, match="not by this user"):
            rv.join(num_nodes=1, gpus_per_node=2, local_rank=1, timeout=5)
    finally:
        server.stop()
    assert not (tmp_path / "owner.sock").exists()


def test_client_of_another_user_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = wire.FileServer(tmp_path / "guard.sock", "guard", 2, os.urandom(128))
    assert server.start()
    try:
        monkeypatch.setattr(wire, "peer_ids", lambda s: (1, os.getuid() + 1))
        rv = FileRendezvous(tmp_path, "guard")
        with pytest.raises(AuthenticationError, match="only its own user"):
            rv.join(num_nodes=1, gpus_per_node=2, local_rank=1, timeout=5)
        rv.close()
    finally:
        server.stop()


# -- argument checks ----------------------------------------------------------------


def test_bad_arguments_are_refused_without_echoing_the_id(tmp_path: Path) -> None:
    rv = FileRendezvous(tmp_path, "args")
    with pytest.raises(InvalidRequest, match="daemon transport"):
        rv.join(num_nodes=2, gpus_per_node=1, local_rank=0)
    with pytest.raises(InvalidRequest, match="out of range"):
        rv.join(num_nodes=1, gpus_per_node=2, local_rank=2)
    short = b"\x07" * 64
    with pytest.raises(InvalidRequest, match="exactly 128 bytes") as info:
        rv.join(num_nodes=1, gpus_per_node=1, local_rank=0, unique_id=short)
    assert short.hex() not in str(info.value)
    with pytest.raises(InvalidRequest, match="all zero"):
        rv.join(num_nodes=1, gpus_per_node=1, local_rank=0, id_factory=lambda: bytes(128))
    with pytest.raises(InvalidRequest, match="job id"):
        FileRendezvous(tmp_path, "../escape")
    assert not list(tmp_path.iterdir())


# -- wire format ----------------------------------------------------------------------


@settings(deadline=None, max_examples=50)
@given(
    messages=st.lists(
        st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=20), max_size=4),
        min_size=1,
        max_size=5,
    ),
    cut=st.integers(min_value=1, max_value=64),
)
def test_frames_survive_any_split(messages: list[dict[str, Any]], cut: int) -> None:
    stream = b"".join(wire.encode(m) for m in messages)
    reader = wire.FrameReader()
    out: list[dict[str, Any]] = []
    for i in range(0, len(stream), cut):
        out.extend(reader.feed(stream[i : i + cut]))
    assert out == messages


def test_bad_frames_are_protocol_errors() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        wire.FrameReader().feed((wire.MAX_FRAME_BYTES + 1).to_bytes(4, "big"))
    with pytest.raises(ProtocolError, match="JSON object"):
        wire.FrameReader().feed(len(b"[1]").to_bytes(4, "big") + b"[1]")
    with pytest.raises(ProtocolError, match="valid UTF-8 JSON"):
        wire.FrameReader().feed((2).to_bytes(4, "big") + b"\xff{")


# -- one interface over both transports ---------------------------------------------------


def test_both_transports_satisfy_the_protocol(tmp_path: Path) -> None:
    file_rv: Rendezvous = FileRendezvous(tmp_path, "proto")
    daemon_rv: Rendezvous = RendezvousClient("127.0.0.1:1", "proto", token="t")
    store: JobStore = FileRendezvous(tmp_path, "proto")
    try:
        assert isinstance(file_rv, Rendezvous) and isinstance(daemon_rv, Rendezvous)
        assert isinstance(store, FileRendezvous)
    finally:
        daemon_rv.close()


def test_connect_picks_the_transport(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(connect("file", path=tmp_path, job_id="j"), FileRendezvous)
    token = tmp_path / "token"
    token.write_text("secret\n")
    client = connect("daemon", endpoint="127.0.0.1:1", job_id="j", token_file=token)
    assert isinstance(client, RendezvousClient)
    client.close()
    with pytest.raises(InvalidRequest, match="unknown"):
        connect("carrier-pigeon", job_id="j")
    with pytest.raises(InvalidRequest, match="path="):
        connect("file", job_id="j")
    with pytest.raises(InvalidRequest, match="endpoint="):
        connect("daemon", path=tmp_path, job_id="j")
