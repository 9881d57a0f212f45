"""The single-node file transport: real worker processes, each a ``RendezvousClient``
of the daemon that local_rank 0 starts on a UNIX socket in the shared directory.

Seed catalogue: ``file_rendezvous_round_trips_id_bytes`` and
``file_rendezvous_receive_times_out_when_rank0_never_publishes``.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client._session import UNIQUE_ID_BYTES
from rendezvousd.client.errors import (
    DaemonUnavailable,
    DuplicateRank,
    InvalidRequest,
    KeyNotFound,
    PeerFailed,
    RendezvousError,
    RendezvousTimeout,
)
from rendezvousd.client.sync import RendezvousClient
from rendezvousd.client.transport import FileRendezvous, Rendezvous, connect
from rendezvousd.trainer.comm.store import JobStore
from tests.support import WORKERS, parallel, rest_of_stdout, wait_for

WORKER = WORKERS / "file_worker.py"
WORLD = 4
OTHER_UID = 65534  # nobody


# -- helpers --------------------------------------------------------------------


def spawn(
    cfg: dict[str, Any],
    *,
    unique_id: bytes | None = None,
    stderr: IO[bytes] | int = subprocess.DEVNULL,
) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), json.dumps({**cfg, "id_on_stdin": unique_id is not None})],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
    )
    if unique_id is not None:
        tell(proc, unique_id.hex())
    return proc


def tell(proc: subprocess.Popen[bytes], line: str = "go") -> None:
    assert proc.stdin is not None
    proc.stdin.write(line.encode() + b"\n")
    proc.stdin.flush()


def next_event(proc: subprocess.Popen[bytes], expected: str) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"worker exited early with {proc.wait()} while the test waited for {expected!r}"
    event: dict[str, Any] = json.loads(line)
    assert event["event"] == expected, event
    return event


def finish(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> dict[str, dict[str, Any]]:
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()
    out = rest_of_stdout(proc, timeout)
    events = (json.loads(line) for line in out.decode().splitlines() if line.strip())
    return {e["event"]: e for e in events}


def kill_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def process_gone(pid: int) -> bool:
    # An orphaned daemon may stay a zombie when PID 1 does not reap: that is gone too.
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return True
    return fields[0] in ("Z", "X")


def id_forms(unique_id: bytes) -> list[bytes]:
    return [
        unique_id,
        unique_id.hex().encode(),
        unique_id.hex().upper().encode(),
        base64.b64encode(unique_id),
        base64.b64encode(unique_id)[:40],
        base64.urlsafe_b64encode(unique_id)[:40],
    ]


def assert_id_not_in_files(root: Path, unique_id: bytes) -> list[Path]:
    files = [p for p in root.rglob("*") if p.is_file()]
    for path in files:
        data = path.read_bytes()
        for form in id_forms(unique_id):
            assert form not in data, f"{path} holds the unique id"
    return files


# -- four workers, one job -------------------------------------------------------


@pytest.fixture(scope="module")
def roundtrip(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Runs 1 node x 4 workers once; their logs go to files beside the directory."""
    base = tmp_path_factory.mktemp("rt")
    directory = base / "rdv"  # created by whichever worker gets there first
    unique_id = os.urandom(UNIQUE_ID_BYTES)
    cfg = {"path": str(directory), "job_id": "rt", "gpus_per_node": WORLD, "mode": "roundtrip"}
    procs = []
    try:
        for rank in range(WORLD):
            with open(base / f"rank{rank}.err", "wb") as err:
                procs.append(
                    spawn(
                        {**cfg, "local_rank": rank},
                        unique_id=unique_id if rank == 0 else None,
                        stderr=err,
                    )
                )
        joined = [next_event(p, "joined") for p in procs]
        live = {
            "names": sorted(p.name for p in directory.iterdir()),
            "dir_mode": stat.S_IMODE(directory.stat().st_mode),
            "token_mode": stat.S_IMODE((directory / "rt.token").stat().st_mode),
            "socket_is_socket": stat.S_ISSOCK((directory / "rt.sock").lstat().st_mode),
        }
        assert_id_not_in_files(base, unique_id)  # while the daemon holds the id
        others = procs[1:]
        entered = [next_event(p, "barrier_enter") for p in others]
        tell(procs[0])
        zero_entered = next_event(procs[0], "barrier_enter")
        passed = [next_event(p, "barrier_pass") for p in procs]
        asked = [next_event(p, "kv_ask_late") for p in others]
        tell(procs[0])
        late_set = next_event(procs[0], "kv_set_late")
        results = [finish(p) for p in procs]
        codes = [p.wait(timeout=30) for p in procs]
    finally:
        kill_all(procs)
    yield {
        "base": base,
        "dir": directory,
        "id": unique_id,
        "codes": codes,
        "joined": joined,
        "live": live,
        "entered": entered,
        "zero_entered": zero_entered,
        "passed": passed,
        "asked": asked,
        "late_set": late_set,
        "results": results,
    }


def test_file_rendezvous_round_trips_id_bytes(roundtrip: dict[str, Any]) -> None:
    assert roundtrip["codes"] == [0] * WORLD
    expected = hashlib.sha256(roundtrip["id"]).hexdigest()
    joined = roundtrip["joined"]
    assert [j["rank"] for j in joined] == list(range(WORLD))
    for j in joined:
        assert j["id_len"] == UNIQUE_ID_BYTES
        assert j["id_sha256"] == expected
        assert (j["world_size"], j["generation"]) == (WORLD, 1)
    host = socket.gethostname()
    table = [[r, 0, r, host] for r in range(WORLD)]
    assert all(j["members"] == table for j in joined)
    assert all("done" in r for r in roundtrip["results"])
    # Only local_rank 0 started a daemon.
    assert joined[0]["daemon_pid"] and all(j["daemon_pid"] is None for j in joined[1:])


def test_barrier_waits_for_every_rank(roundtrip: dict[str, Any]) -> None:
    # The others entered first; none may pass before rank 0 entered.
    zero_entered = roundtrip["zero_entered"]["t"]
    assert all(e["t"] < zero_entered for e in roundtrip["entered"])
    assert all(p["t"] > zero_entered for p in roundtrip["passed"])


def test_kv_get_waits_for_a_later_set(roundtrip: dict[str, Any]) -> None:
    assert all(a["t"] < roundtrip["late_set"]["t"] for a in roundtrip["asked"])
    values = {str(r): f"value-{r}" for r in range(WORLD)}
    for result in roundtrip["results"]:
        assert result["kv"]["values"] == values
        assert bytes.fromhex(result["kv"]["late"]) == b"\x00\xffpayload"


def test_id_never_written_to_any_file(roundtrip: dict[str, Any]) -> None:
    live = roundtrip["live"]
    # While running: the directory is private and holds the socket and its token only.
    assert live["names"] == ["rt.sock", "rt.token"]
    assert live["dir_mode"] == 0o700 and live["token_mode"] == 0o600
    assert live["socket_is_socket"]
    files = assert_id_not_in_files(roundtrip["base"], roundtrip["id"])
    assert sorted(p.name for p in files) == [f"rank{r}.err" for r in range(WORLD)]


def test_rank0_close_stops_its_daemon_and_cleans_up(roundtrip: dict[str, Any]) -> None:
    pid = roundtrip["joined"][0]["daemon_pid"]
    wait_for("the embedded daemon to exit", lambda: process_gone(pid), 20)
    assert list(roundtrip["dir"].iterdir()) == []


# -- joins that cannot succeed ------------------------------------------------------


def test_file_rendezvous_receive_times_out_when_rank0_never_publishes(tmp_path: Path) -> None:
    rv = FileRendezvous(tmp_path / "never", "never")
    started = time.monotonic()
    with pytest.raises(RendezvousTimeout) as info:
        rv.join(num_nodes=1, gpus_per_node=2, local_rank=1, timeout=0.5)
    assert 0.4 <= time.monotonic() - started < 5.0
    message = str(info.value)
    assert str(tmp_path / "never" / "never.sock") in message
    assert "local_rank 0 is running" in message and "same path" in message
    assert info.value.missing_ranks == [0]
    rv.close()


def test_no_path_serves_a_world_of_one_in_a_private_temporary_directory() -> None:
    rv = connect("file", job_id="solo")
    with rv:
        m = rv.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=30)
        assert isinstance(rv, FileRendezvous) and rv.socket_path is not None
        directory = rv.socket_path.parent
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        assert (m.rank, m.world_size, m.generation) == (0, 1, 1)
        assert m.unique_id.hex() not in repr(m) + repr(rv)
        rv.kv_set("k", b"v")
        assert rv.kv_get("k", wait=False) == b"v"
        with pytest.raises(KeyNotFound):
            rv.kv_get("absent", wait=False)
        rv.barrier()
    assert not directory.exists()


def test_a_worker_that_left_joins_the_next_generation_through_the_same_daemon() -> None:
    # The trainer's retry: leave, then join again for a fresh generation and id.
    with connect("file", job_id="again") as rv:
        first = rv.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=30)
        assert isinstance(rv, FileRendezvous) and rv.daemon is not None
        daemon = rv.daemon
        rv.leave()
        second = rv.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=30)
        assert (first.generation, second.generation) == (1, 2)
        assert second.unique_id != first.unique_id
        assert rv.daemon is daemon


def test_no_path_with_a_larger_world_names_the_fix() -> None:
    rv = connect("file", path=None, job_id="lonely")
    with pytest.raises(InvalidRequest, match=r"path=.*rendezvous-run") as info:
        rv.join(num_nodes=1, gpus_per_node=2, local_rank=0, timeout=5)
    assert info.value.job_id == "lonely"
    assert isinstance(rv, FileRendezvous) and rv.daemon is None and rv.socket_path is None


def test_a_second_local_rank0_joins_the_live_daemon_and_is_refused(tmp_path: Path) -> None:
    zero, one = FileRendezvous(tmp_path, "dup"), FileRendezvous(tmp_path, "dup")
    try:
        parallel(
            [
                lambda: one.join(num_nodes=1, gpus_per_node=2, local_rank=1, timeout=30),
                lambda: zero.join(num_nodes=1, gpus_per_node=2, local_rank=0, timeout=30),
            ],
            30.0,
        )
        assert zero.membership is not None and one.membership is not None
        intruder = FileRendezvous(tmp_path, "dup")
        with pytest.raises(DuplicateRank):
            intruder.join(num_nodes=1, gpus_per_node=2, local_rank=0, timeout=10)
        assert intruder.daemon is None
        parallel([lambda: zero.barrier("ok", timeout=10), lambda: one.barrier("ok", timeout=10)])
        assert zero.failure is None and one.failure is None
    finally:
        parallel([one.leave, zero.leave], 30.0)
        one.close()
        zero.close()
    assert list(tmp_path.iterdir()) == []


def test_stale_socket_of_a_killed_rank0_is_replaced(tmp_path: Path) -> None:
    stale = tmp_path / "stale.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(stale))
    dead.close()  # a socket file nobody listens on
    with FileRendezvous(tmp_path, "stale") as rv:
        rv.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=30)
        assert rv.daemon is not None
    assert list(tmp_path.iterdir()) == []


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    rv = FileRendezvous(tmp_path / "args", "args")
    with pytest.raises(InvalidRequest, match="daemon transport"):
        rv.join(num_nodes=2, gpus_per_node=1, local_rank=0)
    with pytest.raises(InvalidRequest, match="job id"):
        FileRendezvous(tmp_path, "../escape")
    long_dir = tmp_path / ("d" * 120)
    with pytest.raises(InvalidRequest, match="shorter directory"):
        FileRendezvous(long_dir, "j").join(num_nodes=1, gpus_per_node=1, local_rank=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d" * 120]


# -- same user only -------------------------------------------------------------------


def test_a_shared_sticky_directory_is_refused_without_advice_to_chmod_it(tmp_path: Path) -> None:
    """Given /tmp itself (root's own, for root), the advice was "run 'chmod 700 /tmp'"."""
    sticky = tmp_path / "tmp-like"
    sticky.mkdir()
    sticky.chmod(0o1777)
    with pytest.raises(InvalidRequest, match="shared directory every user may write to") as info:
        FileRendezvous(sticky, "j").join(num_nodes=1, gpus_per_node=1, local_rank=0)
    assert "chmod" not in str(info.value) and str(sticky / "rendezvous-j") in str(info.value)


def test_directory_open_to_others_or_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(InvalidRequest, match=r"open to group or others.*chmod 700"):
        FileRendezvous(shared, "j").join(num_nodes=1, gpus_per_node=1, local_rank=0)
    if os.getuid() == 0:
        foreign = tmp_path / "foreign"
        foreign.mkdir(mode=0o700)
        os.chown(foreign, OTHER_UID, OTHER_UID)
        with pytest.raises(InvalidRequest, match=f"belongs to uid {OTHER_UID}"):
            FileRendezvous(foreign, "j").join(num_nodes=1, gpus_per_node=2, local_rank=1)
    assert not list(shared.iterdir())


# Starts as root so it can load Python (under /root), then drops to the other uid.
_INTRUDER = """
import json, os, socket, sys
from rendezvousd.client.transport import connect
from rendezvousd.client.errors import RendezvousError
directory, job, uid = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.setgroups([])
os.setgid(uid)
os.setuid(uid)
out = {}
try:
    connect("file", path=directory, job_id=job).join(
        num_nodes=1, gpus_per_node=2, local_rank=1, timeout=5)
    out["join"] = "joined"
except RendezvousError as exc:
    out["join"] = type(exc).__name__ + ": " + exc.message
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(directory + "/" + job + ".sock")
    out["socket"] = "connected"
except OSError as exc:
    out["socket"] = type(exc).__name__
try:
    open(directory + "/" + job + ".token").read()
    out["token"] = "read"
except OSError as exc:
    out["token"] = type(exc).__name__
print(json.dumps(out))
"""


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a process as another uid")
def test_a_process_of_another_user_cannot_use_it(tmp_path: Path) -> None:
    # Not under pytest's 0700 base: the other user must reach the parent to be
    # stopped by the directory's own owner and mode.
    parent = Path(tempfile.mkdtemp(prefix="rdv-guard-"))
    parent.chmod(0o755)
    directory = parent / "rdv"
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, parent, ignore_errors=True)
        zero = cleanup.enter_context(FileRendezvous(directory, "guard"))
        # Rank 0 waits for rank 1 in a thread while the other user tries to be rank 1.
        holder: list[BaseException] = []

        def hold() -> None:
            try:
                zero.join(num_nodes=1, gpus_per_node=2, local_rank=0, timeout=20)
            except BaseException as exc:
                holder.append(exc)

        thread = threading.Thread(target=hold)
        thread.start()
        wait_for("rank 0's socket", lambda: (directory / "guard.sock").exists(), 20)
        result = subprocess.run(
            [sys.executable, "-c", _INTRUDER, str(directory), "guard", str(OTHER_UID)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        out = json.loads(result.stdout)
        assert out["join"].startswith("InvalidRequest") and "belongs to uid 0" in out["join"]
        assert out["socket"] == "PermissionError" and out["token"] == "PermissionError"
        # The intruder did not take rank 1: our own rank 1 still gets it.
        ours = FileRendezvous(directory, "guard")
        m = ours.join(num_nodes=1, gpus_per_node=2, local_rank=1, timeout=20)
        thread.join(30)
        assert not holder and m.rank == 1
        ours.leave()
        ours.close()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to own a link as another uid")
def test_a_path_through_another_users_link_is_refused(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    # Another user's link, in a sticky /tmp say: they may repoint it at any moment.
    for link, path in ((tmp_path / "last", None), (tmp_path / "middle", "sub")):
        link.symlink_to(mine)
        os.lchown(link, OTHER_UID, OTHER_UID)
        target = link / path if path else link
        with pytest.raises(InvalidRequest, match=rf"{link} is a symbolic link owned by uid 65534"):
            FileRendezvous(target, "j").join(num_nodes=1, gpus_per_node=2, local_rank=1, timeout=5)
    assert list(mine.iterdir()) == []
    # Root's links and our own are followed.
    ours = tmp_path / "ours"
    ours.symlink_to(mine)
    with FileRendezvous(ours, "ok") as rv:
        assert rv.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=30).rank == 0


def test_a_waiting_rank_keeps_the_directory_it_checked(tmp_path: Path) -> None:
    """Rank 1 opens the directory once: what its path names later does not matter."""
    checked, moved = tmp_path / "checked", tmp_path / "moved"
    one = FileRendezvous(checked, "pinned")
    joined: list[Any] = []
    thread = threading.Thread(
        target=lambda: joined.append(
            one.join(num_nodes=1, gpus_per_node=2, local_rank=1, timeout=30)
        )
    )
    thread.start()

    def opened() -> bool:
        # Rank 1's descriptor of the directory, not only the directory: between its
        # mkdir and its open a rename here would hand it the new one, as it should.
        fds = Path("/proc/self/fd")
        return any(_link(fds / fd) == str(checked) for fd in os.listdir(fds))

    wait_for("rank 1 to open the directory", opened, 20)
    checked.rename(moved)  # e.g. swapped for another user's directory
    checked.mkdir(mode=0o700)
    zero = FileRendezvous(moved, "pinned")
    try:
        assert zero.join(num_nodes=1, gpus_per_node=2, local_rank=0, timeout=30).rank == 0
        thread.join(30)
        assert [m.rank for m in joined] == [1]
        assert list(checked.iterdir()) == []
        parallel([one.leave, zero.leave], 30.0)
    finally:
        one.close()
        zero.close()


# Binds the socket as root in our directory, then listens as the other uid (the
# credentials SO_PEERCRED reports are the listener's), and counts what it receives.
_IMPOSTOR = """
import os, socket, sys, threading
path, uid = sys.argv[1], int(sys.argv[2])
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(path)
os.setgroups([])
os.setgid(uid)
os.setuid(uid)
server.listen(16)
received = [0]
def serve():
    while True:
        conn, _ = server.accept()
        threading.Thread(target=drain, args=(conn,), daemon=True).start()
def drain(conn):
    while data := conn.recv(65536):
        received[0] += len(data)
threading.Thread(target=serve, daemon=True).start()
print("listening", flush=True)
sys.stdin.read()
print(received[0], flush=True)
"""


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a process as another uid")
def test_a_socket_served_by_another_user_is_refused_before_anything_is_sent(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "rdv"
    directory.mkdir(mode=0o700)
    impostor = subprocess.Popen(
        [sys.executable, "-c", _IMPOSTOR, str(directory / "job.sock"), str(OTHER_UID)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert impostor.stdout is not None and impostor.stdout.readline() == "listening\n"
        (directory / "job.token").write_text("a-token-that-must-stay-here\n")
        rv = FileRendezvous(directory, "job")
        with pytest.raises(InvalidRequest, match=rf"process {impostor.pid} of uid {OTHER_UID}"):
            rv.join(num_nodes=1, gpus_per_node=2, local_rank=1, timeout=5)
        rv.close()
        received, _ = impostor.communicate("", timeout=30)
        assert received.strip() == "0", "bytes reached the other user's socket"
    finally:
        impostor.kill()
        impostor.wait(10)


# -- failure detection -------------------------------------------------------------


def _wait_streams_open(directory: Path, job_id: str, ranks: list[int]) -> None:
    client = RendezvousClient(
        f"unix:{directory / (job_id + '.sock')}", job_id, token_file=directory / f"{job_id}.token"
    )
    try:
        wait_for(
            f"the heartbeat streams of ranks {ranks}",
            lambda: (
                {m.member.rank for m in client.get_job().members if m.heartbeat_stream_open}
                >= set(ranks)
            ),
            10,
        )
    finally:
        client.close()


def run_with_victim(
    tmp_path: Path, victim: int, heartbeat: bool
) -> tuple[list[dict[str, dict[str, Any]]], int]:
    world = 3
    cfg = {"path": str(tmp_path / "rdv"), "job_id": "kill", "gpus_per_node": world}
    procs = [
        spawn(
            {
                **cfg,
                "local_rank": r,
                "mode": "victim" if r == victim else "hold",
                "heartbeat": heartbeat,
            }
        )
        for r in range(world)
    ]
    try:
        joined = [next_event(p, "joined") for p in procs]
        for r, proc in enumerate(procs):
            if r != victim:
                next_event(proc, "holding")
        # Every stream up first: a victim killed before its stream is up is found only
        # by the heartbeat timeout (10 s), and a survivor whose stream comes up only
        # after the failure is refused, so rank 0's daemon waits out that timeout for
        # it before exiting. This test is about streams that were there.
        _wait_streams_open(
            tmp_path / "rdv", "kill", [r for r in range(world) if heartbeat or r != victim]
        )
        procs[victim].send_signal(signal.SIGKILL)
        survivors = [p for r, p in enumerate(procs) if r != victim]
        heard = [(next_event(p, "barrier_error"), next_event(p, "callback")) for p in survivors]
        results = [
            {"barrier_error": e, "callback": c, **finish(p)}
            for (e, c), p in zip(heard, survivors, strict=True)
        ]
        return results, joined[0]["daemon_pid"]
    finally:
        kill_all(procs)


@pytest.mark.parametrize(
    ("victim", "heartbeat"),
    [(2, True), (0, False)],
    ids=["nonzero-rank", "rank0-without-heartbeat"],
)
def test_killed_worker_is_reported_as_peer_failed(
    tmp_path: Path, victim: int, heartbeat: bool
) -> None:
    # Rank 0 with no heartbeat stream: only its daemon seeing its stdin close can
    # tell the survivors, so this also proves the daemon dies with rank 0.
    results, daemon_pid = run_with_victim(tmp_path, victim, heartbeat)
    for result in results:
        error = result["barrier_error"]
        assert error["kind"] == "PeerFailed", error
        # A survivor that closed its stream after hearing may be listed too.
        assert str(victim) in error["ranks"].split(",")
        assert f"lost rank {victim} " in error["message"]
        assert error["after"] < 15.0
        callback = result["callback"]
        assert callback["kind"] == "PeerFailed"
        assert str(victim) in callback["ranks"].split(","), callback
    if victim == 0:
        wait_for("the daemon of the killed rank 0 to exit", lambda: process_gone(daemon_pid), 20)


def test_rank0_keeps_serving_until_every_rank_left(tmp_path: Path) -> None:
    zero, one = FileRendezvous(tmp_path, "slow"), FileRendezvous(tmp_path, "slow")
    zero_left = threading.Event()
    seen: dict[str, Any] = {}

    def rank_one() -> None:
        one.join(num_nodes=1, gpus_per_node=2, local_rank=1, timeout=30)
        client = RendezvousClient(
            f"unix:{one.socket_path}", "slow", token_file=tmp_path / "slow.token"
        )
        try:
            wait_for("rank 0 to leave", lambda: client.get_job().summary.members_present == 1, 20)
        finally:
            client.close()
        seen["value"] = one.kv_get("from0", timeout=10)
        seen["zero_returned_early"] = zero_left.is_set()
        one.leave()
        one.close()

    def rank_zero() -> None:
        zero.join(num_nodes=1, gpus_per_node=2, local_rank=0, timeout=30)
        zero.kv_set("from0", b"hello")
        zero.leave()
        zero_left.set()
        zero.close()

    assert parallel([rank_one, rank_zero], 30.0) == [None, None]
    assert seen == {"value": b"hello", "zero_returned_early": False}
    assert one.failure is None
    assert list(tmp_path.iterdir()) == []


def test_a_report_failure_reaches_the_other_ranks_with_its_cause(tmp_path: Path) -> None:
    # As through a daemon of one's own: the peers read the reported cause, not
    # "heartbeat stream closed", on their heartbeat and in their next call.
    zero, one = FileRendezvous(tmp_path, "cause"), FileRendezvous(tmp_path, "cause")
    heard: list[RendezvousError] = []
    try:
        parallel(
            [
                lambda: one.join(num_nodes=1, gpus_per_node=2, local_rank=1, timeout=30),
                lambda: zero.join(num_nodes=1, gpus_per_node=2, local_rank=0, timeout=30),
            ],
            30.0,
        )
        zero.start_heartbeat(0.2, heard.append)
        one.start_heartbeat(0.2)
        one.report_failure(1, "ValueError: batch 7 is empty", timeout=10)
        with pytest.raises(PeerFailed) as info:
            zero.barrier("next", timeout=20)
        wait_for("rank 0's heartbeat to hear it", lambda: bool(heard), 20)
    finally:
        parallel([one.leave, zero.leave], 30.0)
        one.close()
        zero.close()
    for error in (info.value, heard[0]):
        assert isinstance(error, PeerFailed) and error.ranks == [1], repr(error)
        assert "lost rank 1 " in error.message, error.message
        assert "ValueError: batch 7 is empty" in error.message, error.message
        assert "heartbeat stream closed" not in error.message, error.message


def test_a_call_under_way_when_rank0s_daemon_goes_away_names_the_loss_of_rank_0(
    tmp_path: Path,
) -> None:
    # Rank 0 left and closed, its leave waiting 0.2 s for the others, while rank 1
    # still waits for a key: rank 0's daemon waits its heartbeat timeout (10 s) for
    # rank 1, then shuts down under the call, which fails as losing rank 0 (not a
    # bare CANCELLED or UNAVAILABLE of a daemon that will never come back).
    zero = FileRendezvous(tmp_path, "gone", leave_timeout=0.2)
    one = FileRendezvous(tmp_path, "gone")
    seen: dict[str, Any] = {}

    def wait_for_a_key() -> None:
        started = time.monotonic()
        try:
            one.kv_get("never-set", timeout=120)
        except RendezvousError as exc:
            seen["error"], seen["after"] = exc, time.monotonic() - started

    try:
        parallel(
            [
                lambda: one.join(num_nodes=1, gpus_per_node=2, local_rank=1, timeout=30),
                lambda: zero.join(num_nodes=1, gpus_per_node=2, local_rank=0, timeout=30),
            ],
            30.0,
        )
        zero.start_heartbeat(0.2)
        one.start_heartbeat(0.2)
        socket_path = one.socket_path
        waiter = threading.Thread(target=wait_for_a_key, daemon=True)
        waiter.start()
        zero.leave()
        zero.close()
        waiter.join(60)
    finally:
        one.close()
        zero.close()
    assert not waiter.is_alive(), "rank 1's call still waits for the daemon rank 0 took away"
    error = seen["error"]
    assert type(error) is PeerFailed and error.ranks == [0], repr(error)
    assert error.reason == "PEER_FAILED" and error.method == "KvGet", repr(error)
    assert f"lost rank 0 (its rendezvous daemon at {socket_path} shut down" in error.message
    assert "rank 0 exited or closed the rendezvous" in error.message, error.message
    assert seen["after"] < 60.0


def test_a_call_made_after_rank0s_daemon_is_gone_names_the_loss_of_rank_0_at_once(
    tmp_path: Path,
) -> None:
    """Rank 1, without a heartbeat, calls after rank 0 has left and its daemon is
    gone: the call waited for the daemon 60 s (two 30 s waits for a connection), then
    raised DaemonUnavailable, "there is no socket", without naming rank 0. Rank 0's
    daemon never comes back: its socket gone is rank 0's loss."""
    zero = FileRendezvous(tmp_path, "left", leave_timeout=0.2)
    one = FileRendezvous(tmp_path, "left")
    try:
        parallel(
            [
                lambda: one.join(num_nodes=1, gpus_per_node=2, local_rank=1, timeout=30),
                lambda: zero.join(num_nodes=1, gpus_per_node=2, local_rank=0, timeout=30),
            ],
            30.0,
        )
        socket_path = one.socket_path
        zero.leave()
        zero.close()  # its daemon gone with it, within its heartbeat timeout
        assert not Path(socket_path).exists()
        started = time.monotonic()
        with pytest.raises(PeerFailed) as info:
            one.kv_set("k", b"v")
        took = time.monotonic() - started
    finally:
        one.close()
        zero.close()
    assert info.value.ranks == [0] and info.value.method == "KvSet", repr(info.value)
    assert f"lost rank 0 (its rendezvous daemon at {socket_path} is gone" in str(info.value)
    assert took < 5.0, took


def test_a_relative_path_is_not_looked_up_again_after_the_process_changes_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whether rank 0's daemon is gone was asked of the socket's path by name: after a
    chdir (a run directory of its own, as Hydra makes), a relative path named nothing,
    and every call of rank 1 raised "lost rank 0" with rank 0 alive."""
    monkeypatch.chdir(tmp_path)
    zero, one = FileRendezvous("rdzv", "cd"), FileRendezvous("rdzv", "cd")
    try:
        parallel(
            [
                lambda: one.join(num_nodes=1, gpus_per_node=2, local_rank=1, timeout=30),
                lambda: zero.join(num_nodes=1, gpus_per_node=2, local_rank=0, timeout=30),
            ],
            30.0,
        )
        (tmp_path / "elsewhere").mkdir()
        os.chdir(tmp_path / "elsewhere")
        one.kv_set("k", b"v")
        assert zero.kv_get("k", timeout=10) == b"v"
    finally:
        one.close()
        zero.close()


class _DaemonGoneUnderTheCall:
    """A worker's client whose heartbeat already heard the cause when rank 0's daemon
    went away under a call."""

    def __init__(self, failure: RendezvousError) -> None:
        self.failure = failure
        self.membership = None

    def kv_get(self, key: str, wait: bool, timeout: float | None) -> bytes:
        raise DaemonUnavailable(
            "cancelled", code="CANCELLED", method="KvGet", endpoint="unix:gone.sock", rank=1
        )

    def close(self) -> None:
        pass


def test_a_call_cut_by_rank0s_exit_raises_the_cause_the_heartbeat_already_heard(
    tmp_path: Path,
) -> None:
    # Rank 0's daemon tells the cause (a peer's own) on the heartbeat stream, then
    # exits with rank 0: the call it cut short raises that cause, not "lost rank 0".
    heard = PeerFailed("lost rank 2 (CUDA error: out of memory)", metadata={"ranks": "2"})
    rv = FileRendezvous(tmp_path, "heard")
    rv._client = _DaemonGoneUnderTheCall(heard)  # type: ignore[assignment]
    with pytest.raises(PeerFailed) as info:
        rv.kv_get("k", timeout=5)
    assert info.value is heard
    assert isinstance(info.value.__cause__, DaemonUnavailable)
    rv.close()


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


def test_connect_picks_the_transport(tmp_path: Path) -> None:
    assert isinstance(connect("file", path=tmp_path, job_id="j"), FileRendezvous)
    assert isinstance(connect("file", job_id="j"), FileRendezvous)
    token = tmp_path / "token"
    token.write_text("secret\n")
    token.chmod(0o600)
    client = connect("daemon", endpoint="127.0.0.1:1", job_id="j", token_file=token)
    assert isinstance(client, RendezvousClient)
    client.close()
    with pytest.raises(InvalidRequest, match="unknown"):
        connect("carrier-pigeon", job_id="j")
    with pytest.raises(InvalidRequest, match="endpoint/token_file"):
        connect("file", endpoint="127.0.0.1:1", job_id="j")
    with pytest.raises(InvalidRequest, match="endpoint="):
        connect("daemon", path=tmp_path, job_id="j")


def _link(path: Path) -> str | None:
    try:
        return os.readlink(path)
    except OSError:  # closed meanwhile
        return None


def test_a_file_rendezvous_says_its_call_route_as_the_client_does(tmp_path: Path) -> None:
    # ctx.rendezvous.call_route raised AttributeError on the file transport, where the
    # docs say both transports have it (a docs follower's review).
    rv = FileRendezvous(tmp_path / "route", "route")
    assert rv.call_route == "none"
    with rv:
        rv.join(num_nodes=1, gpus_per_node=1, node_rank=0, local_rank=0)
        assert rv.call_route in {"stream", "unary"}


def test_rank0s_close_after_a_failure_the_others_heard_does_not_wait_a_heartbeat_timeout(
    tmp_path: Path,
) -> None:
    """Rank 0's daemon, told its parent left, waits for the members still active to
    hear why before it stops. A failed generation's survivors stay active once their
    streams closed, so it waited the whole heartbeat timeout (10 s) for members that
    were gone: rank 0's close took ~10 s after every failure. A member whose stream
    ended is not waited for."""
    zero, one = FileRendezvous(tmp_path, "quick"), FileRendezvous(tmp_path, "quick")
    try:
        parallel(
            [
                lambda: one.join(num_nodes=1, gpus_per_node=2, local_rank=1, timeout=30),
                lambda: zero.join(num_nodes=1, gpus_per_node=2, local_rank=0, timeout=30),
            ],
            30.0,
        )
        zero.start_heartbeat(0.2, lambda _: None)
        one.start_heartbeat(0.2, lambda _: None)
        probe = RendezvousClient(
            f"unix:{zero.socket_path}", "quick", token_file=tmp_path / "quick.token"
        )
        try:

            def streams_open() -> int:
                return sum(m.heartbeat_stream_open for m in probe.get_job().members)

            wait_for("both heartbeat streams", lambda: streams_open() == 2, 20)
            one.close()  # without leaving: rank 1 is lost, rank 0 survives
            failed = pb.JOB_STATE_FAILED
            wait_for("rank 1's loss", lambda: probe.get_job().summary.state == failed, 20)
        finally:
            probe.close()
        daemon = zero.daemon
        assert daemon is not None
        began = time.monotonic()
        zero.close()
        took = time.monotonic() - began
    finally:
        one.close()
        zero.close()
    assert daemon.proc.poll() is not None
    assert took < 5.0, took  # the old wait: the whole heartbeat timeout, 10 s
