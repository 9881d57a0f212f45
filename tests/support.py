"""Helpers shared by the test packages: daemon processes, worker commands, ports, threads."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import queue
import random
import re
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rendezvousd.cli.embedded import serve_command
from rendezvousd.client import AsyncRendezvousClient, RendezvousClient, RendezvousError
from rendezvousd.common.log_time import STAMP
from rendezvousd.common.model import JobView
from rendezvousd.daemon import Daemon
from rendezvousd.trainer.torchrun.store_port import ephemeral_range

ROOT = Path(__file__).resolve().parents[1]
_SERVING = re.compile(r"rendezvousd: serving on (\S+)")


@dataclass
class DaemonProcess:
    endpoint: str
    token: str
    token_file: Path
    proc: subprocess.Popen[str]
    log_path: Path
    metrics_url: str = ""

    @property
    def port(self) -> int:
        return int(self.endpoint.rsplit(":", 1)[1])

    def log(self) -> str:
        return self.log_path.read_text()

    def reload(self, said: str) -> str:
        """SIGHUP (as `systemctl reload`), then the log line of that reload: the next
        one containing ``said``."""
        before = self.log().count(said)
        self.proc.send_signal(signal.SIGHUP)
        wait_for("the reload's log line", lambda: self.log().count(said) > before)
        assert self.proc.poll() is None, "SIGHUP ended the daemon"
        return [line for line in self.log().splitlines() if said in line][-1]

    def terminate(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def benchmark_module(monkeypatch: pytest.MonkeyPatch, script: str) -> Any:
    """benchmarks/``script`` as a module; it imports its siblings as a script does."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    path = ROOT / "benchmarks" / script
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_token(path: Path, token: str | None = None) -> str:
    token = token or secrets.token_urlsafe(32)
    path.write_text(token + "\n")
    path.chmod(0o600)
    return token


def _line_reader(fd: int, deadline: float) -> Callable[[], str | None]:
    """The next line from ``fd`` ("" at its end), or None once ``deadline`` passes: a
    daemon stuck before its first line (a start-up blocked in a read) fails the test
    then, not hangs it in a read. Raw reads, so that a line already in a buffer is
    never waited for as if it were still to come."""
    pending = b""

    def next_line() -> str | None:
        nonlocal pending
        while b"\n" not in pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                line, pending = pending, b""
                return line.decode()
            pending += chunk
        line, _, pending = pending.partition(b"\n")
        return line.decode() + "\n"

    return next_line


def spawn_daemon(
    tmp: Path,
    *args: str,
    token: str | None = None,
    env: dict[str, str] | None = None,
    listen: str = "127.0.0.1:0",
    timeout: float = 20.0,
    prefix: Sequence[str] = (),
) -> DaemonProcess:
    """A daemon process with a fresh token; ``prefix`` wraps its command line
    (e.g. ``ip netns exec HOST`` to run it on a namespace host)."""
    tmp.mkdir(parents=True, exist_ok=True)
    token_file = tmp / f"token-{secrets.token_hex(4)}"
    token = write_token(token_file, token)
    log_path = tmp / f"daemon-{secrets.token_hex(4)}.log"
    cmd = [*prefix, *serve_command(listen, token_file, *args)]
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=log, text=True, env={**os.environ, **(env or {})}
        )
    assert proc.stdout is not None
    next_line = _line_reader(proc.stdout.fileno(), time.monotonic() + timeout)
    line: str | None = ""
    while (line := next_line()) is not None:
        if not line:  # its stdout ended: it is exiting
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
            raise RuntimeError(f"daemon exited with {proc.returncode}: {log_path.read_text()}")
        match = _SERVING.search(line)
        if match:
            daemon = DaemonProcess(match.group(1), token, token_file, proc, log_path)
            if "--metrics-listen" in args:
                daemon.metrics_url = (next_line() or "").split(" on ", 1)[1].strip()
            return daemon
    proc.kill()
    raise RuntimeError(f"daemon did not start: {line!r} {log_path.read_text()}")


def serve_refused(
    tmp: Path, state_dir: Path, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    """``rendezvousd serve --state-dir`` expected to refuse to start: its exit and output
    (with a fresh token, on 127.0.0.1:0)."""
    token = tmp / f"token-{secrets.token_hex(4)}"
    write_token(token)
    return subprocess.run(
        serve_command("127.0.0.1:0", token, "--state-dir", str(state_dir)),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def with_own_mounts(setup: str, cmd: Sequence[str]) -> list[str]:
    """``cmd`` run after the shell line ``setup`` in a mount namespace of its own, as
    root there: the mounts it makes (a full or read-only tmpfs) vanish with it, and
    nothing of the host's changes. Skips the test where no such namespace is allowed."""
    probe = ["unshare", "--mount", "--map-root-user", "true"]
    try:
        allowed = subprocess.run(probe, capture_output=True, check=False).returncode == 0
    except FileNotFoundError:
        allowed = False
    if not allowed:
        pytest.skip("no mount namespace here (unshare --mount --map-root-user)")
    return ["unshare", "--mount", "--map-root-user", "sh", "-c", f'{setup} && exec "$@"', "sh",
            *cmd]  # fmt: skip


REQUIRE_HOSTS = "RENDEZVOUSD_TEST_REQUIRE_HOSTS"


def need_hosts(what: str) -> None:
    """Skips a test that needs namespace hosts where they cannot be built, or fails it
    where ``RENDEZVOUSD_TEST_REQUIRE_HOSTS=1`` says they must be: scripts/test.sh sets it
    when run as root, so CI cannot pass with the cross-host claims (the cut-off node,
    the cut between nodes, the torchrun hosts, the README's --hosts demo) silently
    skipped."""
    from rendezvousd.trainer.demo.netns import unavailable_reason

    reason = unavailable_reason()
    if reason is None:
        return
    if os.environ.get(REQUIRE_HOSTS) == "1":
        pytest.fail(f"{what} need network namespaces, and {REQUIRE_HOSTS}=1: {reason}")
    pytest.skip(f"{what} need network namespaces: {reason}")


def job_name(request: pytest.FixtureRequest) -> str:
    """A job id unique to this test (ids are per daemon, daemons are per module)."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", request.node.name)[:100] + "-" + secrets.token_hex(3)


WORKERS = Path(__file__).resolve().parent / "workers"
# rendezvous-run itself on the fake GPU of tests/trainer/fake_cupy (after the python):
# node 0's agent makes the NCCL id.
FAKE_GPU_LAUNCHER = [
    "-c",
    "import sys; sys.path.insert(0, sys.argv.pop(1)); from tests.trainer import fake_cupy; "
    "fake_cupy.install_globally(); from rendezvousd.trainer.agent.launcher import main; "
    "sys.exit(main())",
    str(ROOT),
]


# A log line's UTC stamp (``rendezvousd.common.log_time``): the daemon's, rendezvous-run's.
_LINE_STAMP = re.compile(rf"^{STAMP.pattern} ", re.MULTILINE)


def unstamped(text: str) -> str:
    """``text`` with each line's leading log stamp taken off: what a line says."""
    return _LINE_STAMP.sub("", text)


def wait_for(what: str, check: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll observable state (GetJob, metrics, a socket) until ``check()`` holds."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.005)  # poll interval, not a synchronisation


def rest_of_stdout(proc: subprocess.Popen[Any], timeout: float) -> Any:
    """What is left of ``proc``'s stdout, up to its end, once it exited. Read through
    the same buffered stream as an earlier ``readline()``: ``communicate(timeout=...)``
    reads the pipe's descriptor and loses a line that arrived with the one read."""
    stream = proc.stdout
    assert stream is not None
    rest: list[Any] = []
    reader = threading.Thread(target=lambda: rest.append(stream.read()), daemon=True)
    reader.start()
    reader.join(timeout)
    if reader.is_alive():
        proc.kill()
        reader.join(10)
        raise subprocess.TimeoutExpired(proc.args, timeout)
    proc.wait(timeout)
    return rest[0]


def stderr_of_all(procs: Sequence[subprocess.Popen[str]], timeout: float = 60.0) -> list[str]:
    """Each process's stderr once it exited (each within ``timeout``); any still running
    when one overran is killed."""
    try:
        return [p.communicate(timeout=timeout)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def json_events(stream: Any, within: float = 60.0) -> Iterator[Any]:
    """The JSON lines a running process writes to ``stream``, each within ``within``
    seconds (queue.Empty past it: a test waiting for a line never hangs). Read by a
    thread: the pipe may stay open long after the lines the test waits for."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in stream], daemon=True).start()
    while True:
        line = lines.get(timeout=within)
        if line.startswith("{"):
            yield json.loads(line)


def stuck_agent_run(
    start: Callable[[list[str]], subprocess.Popen[str]], folder: Path, *worker_args: str
) -> dict[str, Any]:
    """rendezvous-run with ``tests/workers/stuck_agent_worker.py`` (``start`` gets the
    worker's arguments, ``worker_args`` after its own; returns the launcher started in
    a session of its own with stdout piped): its agent stopped (SIGSTOP) once the
    worker is ready, then the worker's relayed call. Returns how the call ended,
    checked for what every such run must show: the daemon's verdict on the silent
    node, heard on the worker's own channel."""
    go = folder / "go"
    agent = start([str(WORKERS / "stuck_agent_worker.py"), str(go), *worker_args])
    try:
        assert agent.stdout is not None
        events = json_events(agent.stdout)
        ready = next(events)
        assert ready["event"] == "ready" and ready["route"] == "relayed", ready
        agent.send_signal(signal.SIGSTOP)
        go.touch()
        answered: dict[str, Any] = next(events)
    finally:
        os.killpg(agent.pid, signal.SIGKILL)
        agent.communicate(timeout=30)
    assert answered["event"] == "answered", answered
    assert answered["error"] == "PeerFailed", answered
    # Either verdict names the silent node: stopped before it attached its heartbeat
    # stream (a fresh-clone CI run, under load), it never attached one.
    said = answered["message"]
    assert "no heartbeat" in said or "never attached its heartbeat stream" in said, answered
    assert answered["route"] == "unary", answered
    return answered


def json_lines(path: Path) -> list[Any]:
    """The JSON values in a file another process is still appending lines to: a line
    still being written, or one that is not JSON, is skipped; no file, no values."""
    if not path.exists():
        return []
    values = []
    for line in path.read_text().splitlines():
        try:
            values.append(json.loads(line))
        except ValueError:
            continue
    return values


def scrape(url: str) -> dict[str, float]:
    """A Prometheus text page as {'name{labels}': value}."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def members(d: DaemonProcess, job_id: str) -> list[Any]:
    """GetJob's member statuses for ``job_id``; empty before the job exists."""
    from rendezvousd.client import NotFound, RendezvousClient

    with RendezvousClient(d.endpoint, job_id, token=d.token) as probe:
        try:
            return list(probe.get_job().members)
        except NotFound:
            return []


def free_port() -> int:
    """A port nothing listens on, below the kernel's ephemeral range where it can: a
    test that restarts a daemon on its port must find it free again, and a port of
    that range can meanwhile go to any connect (the client's own redial, which then
    connects to itself) or to another test's bind to port 0 (seen: "Address already
    in use" at a restart)."""
    low, _ = ephemeral_range()
    for _ in range(100):
        port = random.randrange(10_000, low) if low > 11_000 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise RuntimeError("no free port below the ephemeral range after 100 tries")


def worker_cmd(
    d: DaemonProcess, job: str, nodes: int, gpus: int, node: int | None, local: int, *extra: str
) -> list[str]:
    """The command line of one SDK worker process (``workers/join_worker.py``)."""
    cmd = [
        sys.executable,
        str(WORKERS / "join_worker.py"),
        "--endpoint",
        d.endpoint,
        "--token-file",
        str(d.token_file),
        "--job",
        job,
        "--nodes",
        str(nodes),
        "--gpus",
        str(gpus),
        "--local-rank",
        str(local),
        *extra,
    ]
    return cmd + (["--node-rank", str(node)] if node is not None else [])


@contextlib.contextmanager
def daemon_without_rendezvous() -> Iterator[str]:
    """The endpoint of a real gRPC server that serves health (SERVING) and no method of
    rendezvous.v1: every call is answered UNIMPLEMENTED "Method not found!", as a
    daemon older than the method answers it."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    checks = health.HealthServicer()
    checks.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)


class ClosedDoor:
    """127.0.0.1:port, refusing connections (bound, not listening) until ``open()``,
    then forwarding each to the daemon at ``target``: a daemon a node cannot reach yet."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"

    def open(self) -> None:
        self.listener.listen()
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                near, _ = self.listener.accept()
            except OSError:
                return
            far = socket.create_connection(("127.0.0.1", self.target))
            for src, dst in ((near, far), (far, near)):
                threading.Thread(target=pump_bytes, args=(src, dst), daemon=True).start()


def pump_bytes(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


class GatedProxy:
    """TCP to a daemon, forwarded; ``cut()`` closes every connection so far, and while
    the gate is shut a new connection waits before it reaches the daemon: a blip whose
    cut the daemon reads before the client's retry arrives."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self._server.getsockname()[1]}"
        self.gate = threading.Event()
        self.gate.set()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                near, _ = self._server.accept()
                threading.Thread(target=self._forward, args=(near,), daemon=True).start()

    def _forward(self, near: socket.socket) -> None:
        if not self.gate.wait(30):
            near.close()
            return
        far = socket.create_connection(("127.0.0.1", self._port))
        with self._lock:
            self._sockets += [near, far]
        for src, dst in ((near, far), (far, near)):
            threading.Thread(target=pump_bytes, args=(src, dst), daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self.gate.set()
        self._server.close()
        self.cut()


# loopback_conflict's sentence, word for word (what peers of a loopback refusal matched,
# before its abort carried its cause): an abort reason any caller may write.
LOOPBACK_SENTENCE = (
    "rank 0 on host 'h1' advertises the loopback address '127.0.0.1', but job 'j' also "
    "has ranks on 'h2', which cannot reach it. Advertise an address of 'h1' that the "
    "other hosts can reach (rendezvousd.trainer: unset RENDEZVOUSD_RING_HOST, and "
    "workers advertise their address towards the daemon)"
)


def launcher_cmd(
    nnodes: int | str,
    node_rank: int | str,
    per_node: int | str,
    *,
    endpoint: str | None = None,
    token_file: Path | str | None = None,
    job: str | None = None,
) -> list[str]:
    """``rendezvous-run`` for one node, up to (not including) its own further flags."""
    cmd = [sys.executable, "-m", "rendezvousd.trainer.agent.launcher", "--nnodes", str(nnodes)]
    cmd += ["--node-rank", str(node_rank), "--nproc-per-node", str(per_node)]
    if endpoint is not None:
        cmd += ["--rdzv-endpoint", endpoint]
    if token_file is not None:
        cmd += ["--token-file", str(token_file)]
    if job is not None:
        cmd += ["--job-id", job]
    return cmd


def run_launcher(
    cmd: Sequence[str], *, timeout: float, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """A whole ``rendezvous-run`` (``launcher_cmd`` and its flags) to its end, its
    output captured."""
    return subprocess.run(
        list(cmd), capture_output=True, text=True, timeout=timeout, cwd=cwd, check=False
    )


def run_script_node(
    d: DaemonProcess, job: str, script: Path, source: str, *flags: str, timeout: float = 90
) -> subprocess.CompletedProcess[str]:
    """One node of two workers running ``source``, written to ``script``, under
    ``rendezvous-run`` with ``flags``, to its end."""
    script.write_text(source)
    cmd = launcher_cmd(1, 0, 2, endpoint=d.endpoint, token_file=d.token_file, job=job)
    return run_launcher([*cmd, *flags, str(script)], timeout=timeout)


def parallel(fns: Sequence[Callable[[], Any]], limit: float = 20.0) -> list[Any]:
    """Run each callable in its own thread; return results or the exceptions raised."""
    out: list[Any] = [None] * len(fns)

    def run(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as exc:
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(limit)
        assert not t.is_alive(), "a rank hung"
    return out


@dataclass
class Pki:
    """A CA, a server certificate for 127.0.0.1/localhost, a client certificate,
    and a second, unrelated CA with its own client certificate, as PEM files."""

    root: Path
    ca: Path
    server: Path
    server_key: Path
    client: Path
    client_key: Path
    rogue_ca: Path
    rogue: Path
    rogue_key: Path

    def serve_args(self, *, mtls: bool = False) -> tuple[str, ...]:
        """``rendezvousd serve``'s flags for TLS with this server certificate, and with
        ``mtls`` client certificates from this CA required too."""
        args = ("--tls-cert", str(self.server), "--tls-key", str(self.server_key))
        return (*args, "--tls-client-ca", str(self.ca)) if mtls else args


def make_pki(root: Path) -> Pki:
    import trustme

    def write(name: str, blob: trustme.Blob, *, private: bool = False) -> Path:
        path = root / name
        blob.write_to_path(str(path))
        if private:
            path.chmod(0o600)
        return path

    ca, rogue_ca = trustme.CA(), trustme.CA()
    server = ca.issue_cert("localhost", "127.0.0.1")
    client = ca.issue_cert("worker.test")
    rogue = rogue_ca.issue_cert("rogue.test")
    return Pki(
        root=root,
        ca=write("ca.pem", ca.cert_pem),
        server=write("server.pem", server.cert_chain_pems[0]),
        server_key=write("server.key", server.private_key_pem, private=True),
        client=write("client.pem", client.cert_chain_pems[0]),
        client_key=write("client.key", client.private_key_pem, private=True),
        rogue_ca=write("rogue-ca.pem", rogue_ca.cert_pem),
        rogue=write("rogue.pem", rogue.cert_chain_pems[0]),
        rogue_key=write("rogue.key", rogue.private_key_pem, private=True),
    )


@dataclass
class InProcessDaemon:
    """A daemon on this test's event loop: its state is inspectable directly.

    Only asyncio clients may call it (a blocking client would stall the loop
    that serves it); tests that need process death use ``daemon`` instead.
    """

    server: Daemon
    endpoint: str
    token: str

    def client(self, job_id: str) -> AsyncRendezvousClient:
        return AsyncRendezvousClient(self.endpoint, job_id, token=self.token)

    def view(self, job_id: str) -> JobView:
        return self.server.state.view(job_id, time.monotonic())

    def members_present(self, job_id: str) -> int:
        """Ranks that have joined (or are parked in Join); 0 before the job exists."""
        known = {v.job_id: v for v in self.server.state.views(time.monotonic())}
        return known[job_id].members_present if job_id in known else 0

    async def until(self, what: str, check: Callable[[], bool], timeout: float = 10.0) -> None:
        """Wait for ``check()`` to hold, on observable daemon state, not on a clock."""
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}")
            await asyncio.sleep(0.005)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first found, deepest last), from /proc."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            with contextlib.suppress(OSError):
                kids = [int(c) for c in (task / "children").read_text().split()]
                found += kids
                todo += kids
    return found


# --- torchrun (tests/torchrun, tests/multihost/test_torchrun.py) ----------------------

#: The torch venv's python (scripts/torch_venv.sh; scripts/test.sh sets it).
TORCH_PYTHON_ENV = "RENDEZVOUSD_TEST_TORCH_PYTHON"
TORCH_WORKER = WORKERS / "torch_worker.py"
#: torch_worker.py's arguments and step lines without torch (no collective): for tests
#: of the rendezvous whose workers hang where a collective with a lost peer would.
ENV_WORKER = WORKERS / "env_worker.py"


@dataclass
class Torchrun:
    """One torchrun agent (its own process group: a kill takes its workers too)."""

    proc: subprocess.Popen[str]
    log: Path
    out: Path

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """The agent and its workers, as a machine's death would: torch starts each
        worker in a session of its own, so killing the agent's group misses them."""
        if self.proc.poll() is None:
            for pid in [*descendants(self.proc.pid), self.proc.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.wait(10)

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")


def torch_steps(log: Path) -> list[dict[str, Any]]:
    """The step lines torch_worker.py appended to ``log`` so far."""
    return [s for s in json_lines(log) if isinstance(s, dict)]


def three_nodes_stuck_at_step_two(
    torchrun: Callable[..., Torchrun],
    d: DaemonProcess,
    job: str,
    log: Path,
    prefixes: Sequence[Sequence[str]] = ((), (), ()),
    env: Mapping[str, str] | None = None,
    script: Path = TORCH_WORKER,
    extras: Sequence[Sequence[str]] = ((), (), ()),
) -> list[Torchrun]:
    """Three torchrun agents (--nnodes 2:3, 2 workers each, --max-restarts 1) whose
    6-rank world hangs after step 2, as if stuck in a collective: only their agents
    can get them out. Returns once every rank reached step 2. One restart: an agent
    with none left stops when a peer is lost, rather than re-form (an agent whose
    workers hang never spends it: ``survivors_trained_on``). ``extras``: each agent's
    workers' further arguments."""
    worker = ["--steps", "4", "--step-log", str(log), "--hang-after", "2", "--hang-world", "6"]
    agents = [
        torchrun(d, job, "2:3", *worker, *x, max_restarts=1, prefix=p, env=env, script=script)
        for p, x in zip(prefixes, extras, strict=True)
    ]
    wait_for(
        "all 6 ranks at step 2",
        lambda: len({s["rank"] for s in torch_steps(log) if s["step"] == 2}) == 6,
        timeout=120,
    )
    return agents


def survivors_trained_on(agents: Sequence[Torchrun], log: Path) -> list[dict[str, Any]]:
    """The first two agents re-formed as a 4-rank world and trained it to the end,
    spending no restart (the daemon's push restarted them, not a local failure:
    TORCHELASTIC_RESTART_COUNT stayed 0); the steps of that world."""
    for a in agents[:2]:
        assert a.wait(90) == 0, a.stderr()[-3000:]
    after = [s for s in torch_steps(log) if s["world"] == 4]
    assert {s["rank"] for s in after} == {0, 1, 2, 3}
    assert max(s["step"] for s in after) == 4
    assert {s["restart"] for s in after} == {0}, after
    return after


def standby_replaces_a_killed_node(
    agents: Sequence[Torchrun], log: Path, steps: int, hurry: Path | None = None
) -> tuple[float, list[dict[str, Any]]]:
    """Three torchrun agents for --nnodes 2: once 4 ranks train and one agent stands
    by, a training agent is killed; the other two (the spare called into its slot)
    train a 4-rank world to step ``steps`` and exit 0. Returns when the kill was, and
    the steps of the new workers. ``hurry``: the workers' ``--hurry-file``, touched once
    every rank of the new world logged a step (the steps pace the first world only)."""
    wait_for(
        "4 ranks at step 2 and an agent standing by",
        lambda: (
            len({s["rank"] for s in torch_steps(log) if s["step"] >= 2}) == 4
            and any("standing by" in a.stderr() for a in agents)
        ),
        timeout=120,
    )
    (spare,) = [a for a in agents if "standing by" in a.stderr()]
    victim = next(a for a in agents if a is not spare)
    first_round = {s["pid"] for s in torch_steps(log)}
    killed_at = time.time()
    victim.kill()  # a training node: its agent and its workers
    if hurry is not None:
        wait_for(
            "the 4 ranks of the new world to step",
            lambda: (
                len({s["rank"] for s in torch_steps(log) if s["pid"] not in first_round}) == 4
                or any(a.proc.poll() is not None for a in agents if a is not victim)
            ),
            timeout=120,
        )
        hurry.touch()
    for a in agents:
        if a is not victim:
            assert a.wait(120) == 0, a.stderr()[-3000:]
    after = [s for s in torch_steps(log) if s["pid"] not in first_round]
    assert {s["rank"] for s in after} == {0, 1, 2, 3} and {s["world"] for s in after} == {4}
    assert max(s["step"] for s in after) == steps
    return killed_at, after


@contextlib.contextmanager
def node_with_a_standby(
    d: DaemonProcess, job: str
) -> Iterator[tuple[RendezvousClient, list[object], threading.Thread]]:
    """A running job of one node (max_nodes 1, heartbeating) and a standby JoinNode
    parked beside it in a thread. Yields the node's client, the standby's outcome (its
    membership or its error, once its join returns) and the thread."""
    with (
        RendezvousClient(d.endpoint, job, token=d.token) as node,
        RendezvousClient(d.endpoint, job, token=d.token) as spare,
    ):
        node.join_node(min_nodes=1, max_nodes=1, gpus_per_node=1, host="n0", timeout=20)
        node.start_heartbeat(0.2)
        outcome: list[object] = []

        def stand_by() -> None:
            try:
                outcome.append(
                    spare.join_node(
                        min_nodes=1,
                        max_nodes=1,
                        gpus_per_node=1,
                        host="s",
                        timeout=30,
                        standby=True,
                    )
                )
            except RendezvousError as exc:
                outcome.append(exc)

        thread = threading.Thread(target=stand_by, daemon=True)
        thread.start()
        yield node, outcome, thread


class StatefulDaemon:
    """A daemon with ``--state-dir`` on a fixed port and token, which a test SIGKILLs
    and starts again in its place (the new one restores its jobs); killed on exit."""

    def __init__(self, tmp: Path, *flags: str) -> None:
        self.tmp, self.port = tmp, free_port()
        self.token_file = tmp / "tok"
        self.token = write_token(self.token_file)
        self.flags = ("--state-dir", str(tmp / "state"), *flags)
        self.current = self._spawn()

    def _spawn(self) -> DaemonProcess:
        listen = f"127.0.0.1:{self.port}"
        return spawn_daemon(self.tmp, *self.flags, token=self.token, listen=listen)

    def start_again(self) -> None:
        """Start the daemon again in its place (the one before was killed)."""
        self.current = self._spawn()

    def outage_under_a_standby(self, job: str, stderr: Callable[[], str]) -> None:
        """SIGKILL the daemon while a standby (whose output ``stderr`` reads) waits, see
        it notice, start the daemon again, and see the standby parked on it again.

        The standby must be parked when the daemon dies: it says "standing by" before
        its call goes out, and a call made while the daemon is down waits for it
        (waitForReady) instead of failing, so it would see no outage to report."""
        self._standby_parked(job, "the standby parked")
        self.current.kill()
        wait_for("the standby to see the outage", lambda: "trying again" in stderr(), 30)
        self.current = self._spawn()
        self._standby_parked(job, "the standby parked again")

    def _standby_parked(self, job: str, what: str) -> None:
        with RendezvousClient(self.current.endpoint, job, token=self.token) as probe:
            wait_for(what, lambda: probe.get_job().standbys == 1, 30)

    def __enter__(self) -> StatefulDaemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.current.kill()
