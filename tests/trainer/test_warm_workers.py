"""``rendezvous-python`` and the node's warm fork server (``trainer/torchrun/warm.py``),
without torch: the server preloads ``decimal`` instead, and the shim is started as
torchrun starts a worker (its own session, its stdout and stderr redirected). The
real-torchrun test is tests/torchrun/test_torchrun.py's warm-workers test."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from rendezvousd.trainer.torchrun import warm
from tests.support import wait_for

WORKER = """
import json, os, signal, subprocess, sys, time
# What a training script starts (a DataLoader worker, a helper): in the worker's group.
child = subprocess.Popen(["sleep", "60"]).pid if "child" in sys.argv else None
print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0), "child": child,
    "argv": sys.argv, "x": os.environ.get("X"), "cwd": os.getcwd(),
    "preloaded": "decimal" in sys.modules,
    "cpus": sorted(os.sched_getaffinity(0)),
    "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    "sigterm": signal.getsignal(signal.SIGTERM) is signal.SIG_DFL}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
if "sleep" in sys.argv:
    time.sleep(60)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[warm.WarmServer]:
    s = warm.start_server(["decimal"], {**os.environ, "OMP_NUM_THREADS": "1"})
    yield s
    s.stop()


class Shim:
    def __init__(
        self, tmp: Path, args: list[str], env: Mapping[str, str], cpus: set[int] | None = None
    ) -> None:
        self.out, self.err = tmp / f"out-{time.monotonic_ns()}", tmp / f"err-{time.monotonic_ns()}"
        cmd = [sys.executable, "-m", "rendezvousd.trainer.torchrun.warm", *args]
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen(
                cmd,
                env=dict(env),
                stdout=out,
                stderr=err,
                cwd=tmp,
                start_new_session=True,
                preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus),
            )

    def report(self) -> dict[str, Any]:
        wait_for("the worker's first line", lambda: self.out.read_text().endswith("\n"), 30)
        return dict(json.loads(self.out.read_text().splitlines()[0]))

    def wait(self) -> int:
        return self.proc.wait(30)


@pytest.fixture
def shim(tmp_path: Path, server: warm.WarmServer) -> Iterator[Any]:
    (tmp_path / "w.py").write_text(WORKER)
    base = {**os.environ, "OMP_NUM_THREADS": "1", warm.ENV_WARM_SOCKET: server.socket_path}
    started: list[Shim] = []

    def start(*args: str, cpus: set[int] | None = None, **env: str) -> Shim:
        s = Shim(tmp_path, list(args), {**base, **env}, cpus)
        started.append(s)
        return s

    yield start
    for s in started:
        if s.proc.poll() is None:
            os.killpg(s.proc.pid, signal.SIGKILL)
            s.proc.wait()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_a_forked_worker_is_what_python_would_have_run(shim: Any, tmp_path: Path) -> None:
    # Pinned to CPU 0 as torchrun's NUMA binding pins a worker (numactl --physcpubind).
    s = shim("-u", "w.py", "3", "a", "b", X="hello", cpus={0})
    r = s.report()
    assert s.wait() == 3
    assert r["preloaded"] is True  # forked from the server, not a fresh interpreter
    assert r["ppid"] != s.proc.pid and r["sid"] == r["pid"]  # its own session
    assert r["argv"] == ["w.py", "3", "a", "b"] and r["x"] == "hello"
    assert r["cwd"] == str(tmp_path)
    assert r["cpus"] == [0]
    # A fresh interpreter's dispositions, not the server's (which ignores them).
    assert r["sigint"] is True and r["sigterm"] is True
    assert s.err.read_text() == "to stderr\n"  # the shim's stderr, and nothing else


def test_a_module_runs_as_python_m_would(shim: Any) -> None:
    s = shim("-m", "json.tool", "--help")
    assert s.wait() == 0
    assert "json.tool" in s.out.read_text() and s.err.read_text() == ""


def test_torchruns_sigterm_reaches_the_worker_and_the_shim_dies_of_it(shim: Any) -> None:
    s = shim("w.py", "0", "sleep")
    r = s.report()
    os.killpg(s.proc.pid, signal.SIGTERM)  # what torchrun's close() does
    assert s.wait() == -signal.SIGTERM
    wait_for("the worker to end", lambda: not _alive(r["pid"]), 10)


def test_a_sigkilled_shim_takes_its_worker_with_it(shim: Any) -> None:
    s = shim("w.py", "0", "sleep")
    r = s.report()
    os.killpg(s.proc.pid, signal.SIGKILL)
    assert s.wait() == -signal.SIGKILL
    wait_for("the orphaned worker to be killed", lambda: not _alive(r["pid"]), 10)


def test_a_sigkilled_shim_takes_what_its_worker_started_with_it(shim: Any) -> None:
    """The server killed the worker's pid alone: what it started ran on under init
    (review h158, 2a)."""
    s = shim("w.py", "0", "sleep", "child")
    r = s.report()
    os.killpg(s.proc.pid, signal.SIGKILL)
    assert s.wait() == -signal.SIGKILL
    wait_for("the worker's child to be killed", lambda: not _alive(r["child"]), 10)


AGENT = """
import os, sys, time
from rendezvousd.trainer.torchrun import warm
server = warm.start_server(["decimal"], {**os.environ, "OMP_NUM_THREADS": "1"})
print(server.socket_path, server.proc.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("killed", ["agent", "its-group"])
def test_nothing_a_warm_worker_started_outlives_its_sigkilled_agent(
    tmp_path: Path, killed: str
) -> None:
    """torchrun's agent SIGKILLed (alone, or with its process group as a terminal or a
    scheduler does): the server died with it (SIGKILL as its parent-death signal, and in
    the agent's group), its workers with the server, and what they started ran on
    under init, holding ports, memory or a GPU (review h158, 2a). The server now kills
    each worker's group first."""
    (tmp_path / "w.py").write_text(WORKER)
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert agent.stdout is not None
        path, server = agent.stdout.readline().split()
        env = {**os.environ, "OMP_NUM_THREADS": "1", warm.ENV_WARM_SOCKET: path}
        s = Shim(tmp_path, ["w.py", "0", "sleep", "child"], env)
        r = s.report()
        assert r["preloaded"] is True and r["ppid"] == int(server)  # forked, warm
        if killed == "agent":
            agent.kill()
        else:
            os.killpg(agent.pid, signal.SIGKILL)
        agent.wait(10)
        wait_for("the warm worker to die", lambda: not _alive(r["pid"]), 10)
        wait_for("what the worker started to die", lambda: not _alive(r["child"]), 10)
        wait_for("the server to exit", lambda: not _alive(int(server)), 10)
        s.wait()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(agent.pid, signal.SIGKILL)
        agent.wait(10)


def test_a_killed_worker_is_the_shims_death_by_the_same_signal(shim: Any) -> None:
    s = shim("w.py", "0", "sleep")
    os.kill(s.report()["pid"], signal.SIGKILL)
    assert s.wait() == -signal.SIGKILL


def test_the_servers_death_kills_its_workers_and_the_shim_says_so(
    shim: Any, server: warm.WarmServer
) -> None:
    s = shim("w.py", "0", "sleep")
    r = s.report()
    # The worker may print before its server has told the shim "spawned" (the child
    # can run first): a server killed in between leaves the shim unanswered, and it
    # starts the script cold, rightly (the forked worker died with the server), which
    # sleeps past this wait (a CI run, once). The answer follows the fork at once.
    time.sleep(0.5)
    server.proc.kill()
    assert s.wait() == 1
    assert "lost the fork server" in s.err.read_text()
    wait_for("the worker to die with its server", lambda: not _alive(r["pid"]), 10)


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        (["-X", "dev", "w.py", "0"], {}, "interpreter flag '-X'"),
        (["w.py", "0"], {"OMP_NUM_THREADS": "4"}, "OMP_NUM_THREADS differ"),
        (["w.py", "0"], {warm.ENV_WARM_SOCKET: "/nonexistent/sock"}, "did not answer"),
        (["w.py", "0"], {warm.ENV_WARM_SOCKET: ""}, None),
    ],
)
def test_what_cannot_start_warm_starts_cold_in_the_shims_place(
    shim: Any, args: list[str], env: dict[str, str], says: str | None
) -> None:
    s = shim(*args, **env)
    r = s.report()
    assert s.wait() == 0
    assert r["preloaded"] is False and r["pid"] == s.proc.pid  # exec'd: the same process
    err = s.err.read_text()
    if says is None:  # no server on this node: cold is the plan, not news
        assert err == "to stderr\n"
    else:
        assert "rendezvous-python: starting cold: " in err and says in err, err


def test_another_users_connection_is_refused(server: warm.WarmServer) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to connect as another user")
    # An abstract socket has no file permissions: the uid check is all there is.
    assert server.socket_path.startswith("@")
    nobody = subprocess.run(
        [sys.executable, "-c", _AS_NOBODY, server.socket_path], capture_output=True, text=True
    )
    assert nobody.stdout.strip() == "refused", nobody.stdout + nobody.stderr


_AS_NOBODY = """
import os, socket, sys
from rendezvousd.trainer.agent._fork_server import recv, send
os.setgid(65534); os.setuid(65534)  # after the imports: nobody cannot read them
c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
c.connect("\\0" + sys.argv[1][1:])
try:
    send(c, {"op": "spawn", "argv": ["x"], "env": {}, "cwd": "/"}, [0, 1, 2])
    print("refused" if recv(c)[0] is None else "answered")
except OSError:
    print("refused")
"""


def test_a_shim_gone_before_the_server_read_its_request_gets_no_worker() -> None:
    """The server reads a spawn request only after its imports; a shim that died
    meanwhile (torchrun stopped the round) left its request behind: no fork for it."""
    from rendezvousd.trainer.torchrun.warm import _hung_up

    gone, shim = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    alive, shim2 = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    shim.send(b'{"op": "spawn"}')
    shim.close()
    assert gone.recv(100)  # the request, read as the server reads it
    assert _hung_up(gone)
    assert not _hung_up(alive)
    for s in (gone, alive, shim2):
        s.close()


_FORK_FAILS_ONCE = """
import os, sys
from rendezvousd.trainer.torchrun import warm
real, calls = os.fork, []
def fork():
    calls.append(1)
    if len(calls) == 1:
        raise BlockingIOError(11, "Resource temporarily unavailable")
    return real()
os.fork = fork
warm.serve_main(sys.argv[1], os.getppid(), ["decimal"])
"""


def test_a_failed_fork_starts_that_worker_cold_and_the_server_serves_on(
    tmp_path: Path,
) -> None:
    """The server is every warm worker's parent: one worker's trouble (here the
    process limit, EAGAIN) must not end it, or every running worker dies with it."""
    (tmp_path / "w.py").write_text(WORKER)
    path = str(tmp_path / "server.sock")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen(
        [sys.executable, "-c", _FORK_FAILS_ONCE, path], env=env, stdout=subprocess.PIPE
    )
    try:
        assert server.stdout is not None and server.stdout.readline() == b"listening\n"
        env[warm.ENV_WARM_SOCKET] = path
        first = Shim(tmp_path, ["w.py", "0"], env)
        assert first.wait() == 0 and first.report()["preloaded"] is False
        assert "starting cold: the fork server starts it cold: fork failed" in first.err.read_text()
        second = Shim(tmp_path, ["w.py", "4"], env)
        assert second.wait() == 4 and second.report()["preloaded"] is True
    finally:
        server.kill()
        server.wait()
