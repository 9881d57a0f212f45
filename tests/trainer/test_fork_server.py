"""The node's fork server (``_fork_server``, ``worker_boot.ForkServer``): a spare it
forks sees what a cold one (``_agent_boot``) sees, and ends as an interpreter
does; its exit reaches the agent with its status; no worker outlives its agent,
nor what it started (a cold worker's too: ``_group_watch``), none inherits another's channel or the server's socket; the agent falls back to
cold spares when the server refuses one or dies."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rendezvousd.trainer.agent import worker_boot
from rendezvousd.trainer.agent.worker_boot import (
    Booted,
    ForkedProcess,
    ForkServer,
    fork_server_wanted,
    start,
)
from tests.support import DaemonProcess, descendants, launcher_cmd

pytestmark = pytest.mark.skipif(
    not hasattr(os, "pidfd_open") or not sys.platform.startswith("linux"),
    reason="the fork server needs Linux pidfds",
)

# Writes what it sees to $FACTS, then ends the way $ENDING says.
WORKER = r"""
import atexit, json, os, signal, stat, sys, threading, time
facts = {
    "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    "sighup": signal.getsignal(signal.SIGHUP) == signal.SIG_DFL,
    "name": __name__,
    "argv": sys.argv,
    "path0": sys.path[0],
    "local_rank": os.environ.get("LOCAL_RANK"),
    "omp": os.environ.get("OMP_NUM_THREADS"),
    "agent_pid_env": os.environ.get("RENDEZVOUSD_AGENT_PID"),
    "ppid": os.getppid(),
    "numpy_preloaded": "numpy" in sys.modules,
    "channel": int(os.environ["RENDEZVOUSD_AGENT_FD"]),
    "sockets": sorted(
        int(fd) for fd in os.listdir("/proc/self/fd")
        if os.path.exists(f"/proc/self/fd/{fd}")
        and stat.S_ISSOCK(os.stat(f"/proc/self/fd/{fd}").st_mode)
    ),
}
with open(os.environ["FACTS"], "w") as fh:
    json.dump(facts, fh)
ending = os.environ.get("ENDING", "exit")
if ending == "child":  # a process of its own, as a DataLoader's worker is
    import subprocess
    child = subprocess.Popen(["sleep", "600"])
    with open(os.environ["FACTS"] + ".child", "w") as fh:
        fh.write(str(child.pid))
if ending in ("sleep", "child"):
    time.sleep(600)
def late():
    time.sleep(0.2)
    with open(os.environ["FACTS"] + ".thread", "w") as fh:
        fh.write("joined")
atexit.register(lambda: open(os.environ["FACTS"] + ".atexit", "w").write("ran"))
threading.Thread(target=late).start()
sys.stdout.write("unflushed output")
if ending == "raise":
    raise RuntimeError("the script failed")
sys.exit(7)
"""


def _server(env: dict[str, str]) -> ForkServer:
    notes: list[str] = []
    server = ForkServer.start(env, note=notes.append)
    assert server is not None
    return server


def _spare_env(tmp_path: Path, name: str, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "LOCAL_RANK": "1",
        "FACTS": str(tmp_path / name),
        **extra,
    }


def _run(server: ForkServer, script: Path, env: dict[str, str]) -> tuple[Booted, int]:
    booted = server.spawn(1, [str(script), "--lr", "0.1"], env)
    assert booted is not None, "the server did not take the spare"
    assert isinstance(booted.proc, ForkedProcess)
    code = booted.proc.wait(120)
    booted.sock.close()
    return booted, code


def _cold_dispositions() -> tuple[bool, bool, bool]:
    """SIGINT, SIGTERM and SIGHUP as WORKER reports them in a fresh interpreter started
    from here: default, unless this run inherited them ignored (a shell's `&` ignores
    SIGINT in its children, nohup SIGHUP), which a fresh interpreter keeps too."""
    code = "\n".join(WORKER.splitlines()[:6]) + "\n}\nprint(json.dumps(facts))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    facts = json.loads(out.stdout)
    return facts["sigint"], facts["sigterm"], facts["sighup"]


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "scripts" / "train.py"
    path.parent.mkdir()
    path.write_text(WORKER)
    return path


@pytest.mark.parametrize("value", ["0", "false", "No", "OFF", " off "])
def test_every_usual_spelling_of_off_turns_the_fork_server_off(value: str) -> None:
    """Only "0" did: "false", "no" and "off" kept the server on."""
    env = {**os.environ, "RENDEZVOUSD_FORK_SERVER": value}
    # The switch itself: ForkServer.start is None on a host without pidfd_open too.
    assert fork_server_wanted(env) is False
    assert ForkServer.start(env) is None


@pytest.mark.parametrize("value", ["1", "True", "yes", "ON"])
def test_every_usual_spelling_of_on_keeps_the_fork_server(value: str) -> None:
    env = {**os.environ, "RENDEZVOUSD_FORK_SERVER": value}
    assert fork_server_wanted(env) is True
    _server(env).close()


def test_a_fork_server_switch_that_is_neither_is_refused_naming_the_variable() -> None:
    from rendezvousd.trainer.errors import ConfigError

    with pytest.raises(ConfigError, match=r"\$RENDEZVOUSD_FORK_SERVER='flase' is not a switch"):
        ForkServer.start({**os.environ, "RENDEZVOUSD_FORK_SERVER": "flase"})


def test_a_forked_spare_sees_what_a_cold_one_does_and_exits_as_an_interpreter_does(
    tmp_path: Path, script: Path
) -> None:
    base = {**os.environ, "OMP_NUM_THREADS": "1"}
    server = _server(base)
    try:
        env = _spare_env(tmp_path, "facts")
        _, code = _run(server, script, env)
        facts = json.loads((tmp_path / "facts").read_text())
    finally:
        server.close()
    assert code == 7  # SystemExit's code
    assert facts["name"] == "__main__"
    assert facts["argv"] == [str(script), "--lr", "0.1"]
    assert facts["path0"] == str(script.parent)
    assert facts["local_rank"] == "1"  # its slot's env from the first instruction
    assert facts["omp"] == "1"
    assert facts["agent_pid_env"] is None
    # The signals the server ignores are the worker's as in a fresh interpreter.
    assert (facts["sigint"], facts["sigterm"], facts["sighup"]) == _cold_dispositions()
    # Forked by the server, with numpy already imported: the start-up it saves.
    assert facts["ppid"] == server.proc.pid
    assert facts["numpy_preloaded"] is True
    # Its channel is its only socket: not the server's control socket.
    assert facts["sockets"] == [facts["channel"]]
    assert (tmp_path / "facts.atexit").read_text() == "ran"
    assert (tmp_path / "facts.thread").read_text() == "joined"


def test_stdout_is_flushed_and_an_uncaught_exception_exits_1_with_its_traceback(
    tmp_path: Path, script: Path
) -> None:
    # The server inherits the launcher's stdio: run the agent's side in a child
    # whose output we capture.
    probe = f"""
import os, sys
from rendezvousd.trainer.agent.worker_boot import ForkServer
server = ForkServer.start({{**os.environ, "OMP_NUM_THREADS": "1"}})
env = {{**os.environ, "OMP_NUM_THREADS": "1", "FACTS": {str(tmp_path / "facts")!r}}}
for ending in ("raise", "exit"):
    booted = server.spawn(0, [{str(script)!r}], {{**env, "ENDING": ending}})
    print("code", ending, booted.proc.wait(120), flush=True)
server.close()
"""
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "code raise 1" in done.stdout
    assert "code exit 7" in done.stdout
    assert done.stdout.count("unflushed output") == 2
    assert "Traceback (most recent call last)" in done.stderr
    assert "RuntimeError: the script failed" in done.stderr


def test_spares_inherit_no_other_spares_channel_and_a_signal_reaches_the_agent(
    tmp_path: Path, script: Path
) -> None:
    server = _server({**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        first = server.spawn(0, [str(script)], _spare_env(tmp_path, "a", ENDING="sleep"))
        assert first is not None and isinstance(first.proc, ForkedProcess)
        _wait_for(tmp_path / "a")
        second = server.spawn(1, [str(script)], _spare_env(tmp_path, "b", ENDING="sleep"))
        assert second is not None and isinstance(second.proc, ForkedProcess)
        _wait_for(tmp_path / "b")
        facts = json.loads((tmp_path / "b").read_text())
        assert facts["sockets"] == [facts["channel"]]
        # The first spare's channel: the agent's end sees EOF only once it exits.
        pid = first.proc.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        assert first.proc.wait_exited() == -signal.SIGKILL
        # The zombie is kept until the agent releases it: the pid cannot be reused.
        assert _state(pid) == "Z"
        first.proc.release()
        assert first.sock.recv(1) == b""
        second.proc.kill()
        assert second.proc.wait(120) == -signal.SIGKILL
        _wait_gone(pid)
    finally:
        server.close()


def test_a_spare_whose_thread_settings_differ_starts_cold(tmp_path: Path, script: Path) -> None:
    server = _server({**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        env = _spare_env(tmp_path, "facts", OMP_NUM_THREADS="4")
        assert server.spawn(0, [str(script)], env) is None
        booted = start(0, [str(script)], env, server)
        assert isinstance(booted.proc, subprocess.Popen)  # cold
        assert booted.proc.wait(120) == 7
        booted.sock.close()
        facts = json.loads((tmp_path / "facts").read_text())
        assert facts["omp"] == "4"
        assert facts["numpy_preloaded"] is False
    finally:
        server.close()


def test_the_fork_server_s_death_kills_its_workers_reports_them_lost_and_later_spares_start_cold(
    tmp_path: Path, script: Path
) -> None:
    server = _server({**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        booted = server.spawn(0, [str(script)], _spare_env(tmp_path, "a", ENDING="sleep"))
        assert booted is not None and isinstance(booted.proc, ForkedProcess)
        _wait_for(tmp_path / "a")
        pid = booted.proc.pid
        assert pid is not None
        server.proc.kill()
        assert booted.proc.wait_exited() == -signal.SIGKILL
        assert booted.proc.lost
        _wait_gone(pid)  # its parent-death signal
        assert server.unavailable is not None
        again = start(0, [str(script)], _spare_env(tmp_path, "b"), server)
        assert isinstance(again.proc, subprocess.Popen)
        assert again.proc.wait(120) == 7
        again.sock.close()
    finally:
        server.close()


def test_what_a_worker_started_dies_with_its_fork_server_though_the_agent_lives(
    tmp_path: Path, script: Path
) -> None:
    # The agent goes on (it restarts the job, cold), so nothing else would ever stop
    # the lost worker's own processes: one group leaked per worker and spare, per loss.
    server = _server({**os.environ, "OMP_NUM_THREADS": "1"})
    child = 0
    try:
        booted = server.spawn(0, [str(script)], _spare_env(tmp_path, "a", ENDING="child"))
        assert booted is not None and isinstance(booted.proc, ForkedProcess)
        _wait_for(tmp_path / "a.child")
        child = int((tmp_path / "a.child").read_text())
        server.proc.kill()
        assert booted.proc.wait_exited() == -signal.SIGKILL
        assert booted.proc.lost
        _wait_gone(child, within=10)
        booted.sock.close()
    finally:
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        server.close()


def test_a_server_stuck_in_an_import_is_given_up_and_its_spares_are_lost(
    tmp_path: Path, script: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The stop paths need each worker's pid: an unanswered request must not block them.
    monkeypatch.setattr(worker_boot, "ANSWER_S", 2.0)
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[2]))
    notes: list[str] = []
    server = ForkServer.start(
        {**os.environ, "OMP_NUM_THREADS": "1"},
        ["tests.trainer.fork_server_hang"],
        note=notes.append,
    )
    assert server is not None
    try:
        booted = server.spawn(0, [str(script)], _spare_env(tmp_path, "a"))
        assert booted is not None and isinstance(booted.proc, ForkedProcess)
        answered: list[int | None] = []
        asking = threading.Thread(target=lambda: answered.append(booted.proc.pid), daemon=True)
        asking.start()
        asking.join(30)
        assert not asking.is_alive(), "the pid of an unanswered spare blocked its caller"
        assert answered == [None]
        assert booted.proc.lost and booted.proc.wait_exited() == -signal.SIGKILL
        assert server.unavailable is not None and "no answer" in server.unavailable
        assert server.proc.wait(10) == -signal.SIGKILL
        booted.sock.close()
    finally:
        server.close()


# The agent alone, or its whole process group at once (`kill -9 -PGID`), which holds
# the fork server and the group watcher too unless they have sessions of their own.
KILLS = pytest.mark.parametrize("group", [False, True], ids=["agent", "its-group"])


def _kill_agent(proc: subprocess.Popen[str], group: bool) -> None:
    if group:
        os.killpg(proc.pid, signal.SIGKILL)
    else:
        proc.kill()
    proc.wait(30)


@KILLS
def test_no_forked_worker_nor_what_it_started_outlives_its_agent(
    tmp_path: Path, script: Path, group: bool
) -> None:
    # The worker dies of its parent-death signal; its own child (a DataLoader's
    # worker, say) has none, and ran on under init until the server killed its group.
    agent = f"""
import os, sys, time
from rendezvousd.trainer.agent.worker_boot import ForkServer
server = ForkServer.start({{**os.environ, "OMP_NUM_THREADS": "1"}})
env = {{**os.environ, "OMP_NUM_THREADS": "1", "FACTS": {str(tmp_path / "facts")!r}, "ENDING": "child"}}
booted = server.spawn(0, [{str(script)!r}], env)
print(server.proc.pid, booted.proc.pid, flush=True)
time.sleep(600)
"""
    err = tmp_path / "agent.err"  # the server's stderr too (inherited)
    with err.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-c", agent],
            stdout=subprocess.PIPE,
            stderr=sink,
            text=True,
            start_new_session=True,
        )
    child = 0
    try:
        assert proc.stdout is not None
        server_pid, worker_pid = map(int, proc.stdout.readline().split())
        _wait_for(tmp_path / "facts.child")
        child = int((tmp_path / "facts.child").read_text())
        _kill_agent(proc, group)
        _wait_gone(server_pid)
        _wait_gone(worker_pid)
        _wait_gone(child, within=10)
        # The agent's death reaches the server twice (its socket's end, its parent-death
        # signal): the second, raised inside the stop the first began, cut it short
        # with a traceback (seen by helper-174 after a SIGKILLed rendezvous-run).
        assert "Traceback" not in err.read_text(), err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


@KILLS
def test_nor_does_what_a_cold_worker_started(tmp_path: Path, script: Path, group: bool) -> None:
    # --no-fork-server: the worker dies of its parent-death signal, its child ran on
    # under init until the node's group watcher (_group_watch) killed its group.
    agent = f"""
import os, sys, time
from rendezvousd.trainer.agent.worker_boot import boot
env = {{**os.environ, "FACTS": {str(tmp_path / "facts")!r}, "ENDING": "child"}}
booted = boot(0, [{str(script)!r}], env)
print(booted.proc.pid, flush=True)
time.sleep(600)
"""
    proc = subprocess.Popen(
        [sys.executable, "-c", agent], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    child = 0
    try:
        assert proc.stdout is not None
        worker_pid = int(proc.stdout.readline())
        _wait_for(tmp_path / "facts.child")
        child = int((tmp_path / "facts.child").read_text())
        watchers = [p for p in descendants(proc.pid) if p not in (worker_pid, child)]
        _kill_agent(proc, group)
        _wait_gone(worker_pid)
        _wait_gone(child, within=10)
        for watcher in watchers:
            _wait_gone(watcher, within=10)  # it exits with its agent too
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + 120  # a generous bound, not a timing assertion
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.02)


def _state(pid: int) -> str | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return text.rsplit(")", 1)[1].split()[0]


def _wait_gone(pid: int, within: float = 60.0) -> None:
    """Until ``pid`` is no live process (gone, or a zombie another parent reaps)."""
    deadline = time.monotonic() + within
    while _state(pid) not in (None, "Z"):
        assert time.monotonic() < deadline, f"pid {pid} still runs"
        time.sleep(0.02)


def test_a_server_that_runs_threads_after_its_imports_starts_its_spares_cold(
    tmp_path: Path, script: Path
) -> None:
    notes: list[str] = []
    server = ForkServer.start(
        {**os.environ, "OMP_NUM_THREADS": "1"},
        ["tests.trainer.fork_server_thread"],
        note=notes.append,
    )
    assert server is not None
    try:
        _, code = _run(server, script, _spare_env(tmp_path, "facts"))
        facts = json.loads((tmp_path / "facts").read_text())
    finally:
        server.close()
    assert code == 7
    # Still the server's child (its exit relayed the same way), but a fresh interpreter.
    assert facts["ppid"] == server.proc.pid
    assert facts["numpy_preloaded"] is False
    assert facts["local_rank"] == "1"
    assert (facts["sigint"], facts["sigterm"], facts["sighup"]) == _cold_dispositions()
    assert any("spares start cold" in n and "threads" in n for n in notes), notes


def test_numpy_s_openblas_threads_do_not_keep_a_one_worker_node_s_spares_cold(
    tmp_path: Path, script: Path
) -> None:
    """A node of one worker has no OMP_NUM_THREADS=1 (torchrun's rule is for more than
    one), so numpy's OpenBLAS started its pool in the server at import, and the server
    refused every fork: each spare started cold, with a note on every run."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["OPENBLAS_NUM_THREADS"] = "2"
    count = "import numpy, os; print(len(os.listdir('/proc/self/task')))"
    threads = subprocess.run([sys.executable, "-c", count], env=env, capture_output=True)
    if threads.stdout.strip() != b"2":
        pytest.skip(f"numpy's BLAS starts no threads at import here ({threads.stdout!r})")
    notes: list[str] = []
    server = ForkServer.start(env, note=notes.append)
    assert server is not None
    try:
        spare = {**env, "LOCAL_RANK": "1", "FACTS": str(tmp_path / "facts")}
        _, code = _run(server, script, spare)
        facts = json.loads((tmp_path / "facts").read_text())
    finally:
        server.close()
    assert code == 7
    assert facts["numpy_preloaded"] is True, notes  # forked, not cold
    assert not any("cold" in n for n in notes), notes


def test_a_forked_child_of_a_server_that_shed_openblas_s_pool_multiplies_on_it(
    tmp_path: Path,
) -> None:
    """The pool OpenBLAS stopped at the server's first fork starts again in a child
    that multiplies, with the size the server's environment set."""
    probe = (
        "import numpy as np, os, sys\n"
        "from rendezvousd.trainer.agent._fork_server import shed_threads, thread_count\n"
        "before = thread_count()\n"
        "after = shed_threads()\n"
        "r, w = os.pipe()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    a = np.arange(40000.0).reshape(200, 200)\n"
        "    ok = bool(np.allclose(a @ np.eye(200), a))\n"
        "    os.write(w, f'{ok} {thread_count()}'.encode()); os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "print(before, after, os.read(r, 100).decode())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["OPENBLAS_NUM_THREADS"] = "2"
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    before, after, ok, child_threads = out.stdout.split()
    if before != "2":
        pytest.skip(f"numpy's BLAS starts no threads at import here ({before} threads)")
    assert (after, ok, child_threads) == ("1", "True", "2"), out.stdout


def _fork_server_of(launcher_pid: int) -> int | None:
    for pid in descendants(launcher_pid):
        with contextlib.suppress(OSError):
            if b"_fork_server" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    return None


def _children_of(pid: int) -> list[int]:
    with contextlib.suppress(OSError):
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return []


def test_spares_lost_with_their_fork_server_are_replaced_cold_and_use_no_restart(
    daemon: DaemonProcess, job_id: str, tmp_path: Path
) -> None:
    """No restart allowed: the spares the server took with it are no failure of the
    script; the node's agent starts others cold and the job trains to its end."""
    example = ["-m", "rendezvousd.trainer.example", "--steps", "5"]
    nodes: list[subprocess.Popen[str]] = []
    try:
        for rank in range(2):
            cmd = launcher_cmd(
                2, rank, 2, endpoint=daemon.endpoint, token_file=daemon.token_file, job=job_id
            )
            nodes.append(
                subprocess.Popen(
                    [*cmd, "--max-restarts", "0", *example],
                    stderr=subprocess.PIPE,
                    stdout=subprocess.DEVNULL,
                    text=True,
                    cwd=tmp_path,
                )
            )
            if rank == 1:
                break
            # Node 0 waits for node 1 in its join, its spares forked: lose its server.
            deadline = time.monotonic() + 120
            while (server := _fork_server_of(nodes[0].pid)) is None or len(
                _children_of(server)
            ) < 2:
                assert time.monotonic() < deadline, "node 0's fork server forked no spares"
                assert nodes[0].poll() is None
                time.sleep(0.02)
            os.kill(server, signal.SIGKILL)
        outs = [n.communicate(timeout=180)[1] for n in nodes]
    finally:
        for n in nodes:
            if n.poll() is None:
                n.kill()
                n.wait(30)
    assert [n.returncode for n in nodes] == [0, 0], "\n---\n".join(outs)
    assert "fork server unavailable" in outs[0], outs[0]
    assert "failed first" not in outs[0], outs[0]


@pytest.mark.parametrize(
    "text", ["torch,transformers", "torch:transformers", " torch : transformers ,"]
)
def test_a_preload_list_is_read_alike_with_commas_or_colons(text: str) -> None:
    """``--preload`` took ',' and torchrun's ``preload`` ':' (its --rdzv-conf separates
    settings by ','): each read the other's list as one module name, not preloaded."""
    from rendezvousd.trainer.agent._fork_server import module_names
    from rendezvousd.trainer.torchrun.config import load_settings

    assert module_names(text) == ["torch", "transformers"]
    assert load_settings({"preload": text}, {}).preload_modules() == ["torch", "transformers"]
    assert load_settings({}, {"RENDEZVOUSD_PRELOAD": text}).preload_modules() == [
        "torch",
        "transformers",
    ]
