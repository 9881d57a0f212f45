"""A training cluster on namespace hosts: rendezvousd on h0, one node per other host.

Nodes run ``rendezvous-run`` with the training example, exactly as a user would on
separate machines; nothing sets an address by hand. Each worker writes its result
as ``results/rank-N.json``; each launcher's stderr is kept for the assertions.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import trustme

from rendezvousd.common.log_time import STAMP, STAMP_FORMAT
from rendezvousd.trainer.demo.netns import SUBNET, Host, Hosts
from tests.support import DaemonProcess, launcher_cmd, spawn_daemon

EXAMPLE = ("-m", "rendezvousd.trainer.example")
# A line's UTC stamp (the example's workers log as the daemon and rendezvous-run do).
_STAMP = re.compile(rf"^({STAMP.pattern}) ")


@dataclass
class Node:
    index: int
    host: Host
    proc: subprocess.Popen[str]
    lines: list[tuple[float, str]] = field(default_factory=list)
    reader: threading.Thread | None = None

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def summary(self) -> str:
        """For a failed assertion: what the launcher itself said (the cause and the
        root cause), then the last lines — worker logs would crowd out the cause."""
        own = [line for _, line in self.lines if "rendezvous-run" in line]
        tail = [line for _, line in self.lines[-10:] if line not in own]
        return "\n".join([f"--- node {self.index} on {self.host.name}:", *own, "...", *tail])

    def first(self, needle: str) -> float | None:
        """When the first stderr line containing ``needle`` was logged (epoch seconds)."""
        for seen, line in self.lines:
            if needle in line:
                stamp = _STAMP.match(line)
                if stamp:
                    return datetime.strptime(stamp.group(1), STAMP_FORMAT).timestamp()
                return seen
        return None

    def worker_pids(self) -> list[int]:
        """The workers of this node, in start order: the children of its fork server
        (which forks them), then any other child of the launcher (a spare started cold
        after the server was lost); without a server, the launcher's children."""
        kids = _children(self.proc.pid)
        for pid in kids:
            with contextlib.suppress(OSError):
                if b"_fork_server" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return _children(pid) + [k for k in kids if k != pid]
        return kids


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    with contextlib.suppress(OSError):
        return [int(p) for p in path.read_text().split()]
    return []


def _pump(stream: IO[str], sink: list[tuple[float, str]]) -> None:
    for line in stream:
        sink.append((time.time(), line.rstrip("\n")))


@dataclass
class Cluster:
    hosts: Hosts
    daemon: DaemonProcess
    workdir: Path
    nodes: list[Node] = field(default_factory=list)

    @property
    def head(self) -> Host:
        return self.hosts[0]

    def launch(
        self,
        num_nodes: int,
        per_node: int,
        *,
        job: str,
        launcher_args: Sequence[str] = (),
        example_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        nodes: Sequence[int] | None = None,
        on_host: int | None = None,
        backend: str = "cpu",
        launcher: Sequence[str] = (),
        script: Sequence[str] = (),
    ) -> list[Node]:
        """Start ``rendezvous-run`` for ``nodes`` (default 0..num_nodes-1) on hosts h1,
        h2, ... (node n on h(n+1)), or all of them on host ``on_host``. ``launcher``:
        what runs it instead of ``python -m`` its module (a fake GPU's, say);
        ``script``: the workers' instead of the example (without its result dir)."""
        started = []
        for n in nodes if nodes is not None else range(num_nodes):
            cmd = launcher_cmd(
                num_nodes,
                n,
                per_node,
                endpoint=self.daemon.endpoint,
                token_file=self.daemon.token_file,
                job=job,
            )
            if launcher:
                cmd = [cmd[0], *launcher, *cmd[3:]]  # past "-m", the launcher's module
            cmd += ["--backend", backend, *launcher_args]
            if script:
                cmd += [*script, *example_args]
            else:
                cmd += [*EXAMPLE, "--result-dir", str(self.workdir / job / "results")]
                cmd += example_args
            host = self.hosts[on_host if on_host is not None else 1 + n]
            proc = host.popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            node = Node(n, host, proc)
            assert proc.stderr is not None
            node.reader = threading.Thread(
                target=_pump, args=(proc.stderr, node.lines), daemon=True
            )
            node.reader.start()
            started.append(node)
        self.nodes += started
        return started

    def wait(self, nodes: Sequence[Node], timeout: float = 90.0) -> list[int]:
        """The nodes' exit codes. Past ``timeout`` (below pytest's 120 s, which would
        end the test with no word of the nodes) the nodes are killed and the failure
        says what each launcher said, to tell a hang from a slow machine."""
        deadline = time.monotonic() + timeout
        codes: list[int] | None = None
        try:
            codes = [n.proc.wait(max(0.1, deadline - time.monotonic())) for n in nodes]
        except subprocess.TimeoutExpired:
            for n in nodes:
                n.proc.kill()
                n.proc.wait(10)
        for n in nodes:
            assert n.reader is not None
            n.reader.join(5)
        if codes is None:
            summaries = "\n".join(n.summary() for n in nodes)
            raise AssertionError(f"nodes still running after {timeout:.0f} s:\n{summaries}")
        return codes

    def results(self, job: str) -> list[dict[str, Any]]:
        folder = self.workdir / job / "results"
        return [json.loads(p.read_text()) for p in sorted(folder.glob("rank-*.json"))]

    def job_exists(self, job: str) -> bool:
        """Whether the daemon knows ``job`` (asked from h0)."""
        probe = (
            "import sys\n"
            "from rendezvousd.client import NotFound, RendezvousClient\n"
            "with RendezvousClient(sys.argv[1], sys.argv[2], token_file=sys.argv[3]) as c:\n"
            "    try:\n"
            "        c.get_job()\n"
            "    except NotFound:\n"
            "        sys.exit(1)\n"
        )
        cmd = [sys.executable, "-c", probe, self.daemon.endpoint, job, str(self.daemon.token_file)]
        return (
            subprocess.run(self.head.command(cmd), capture_output=True, timeout=30).returncode == 0
        )

    def job_facts(self, job: str) -> dict[str, Any]:
        """GetJob's generation, state, standbys and kept seats of ``job`` (asked from h0)."""
        probe = (
            "import json, sys\n"
            "from rendezvousd.client import RendezvousClient\n"
            "with RendezvousClient(sys.argv[1], sys.argv[2], token_file=sys.argv[3]) as c:\n"
            "    j = c.get_job()\n"
            "    print(json.dumps({'generation': j.summary.generation,\n"
            "                      'state': j.summary.state, 'standbys': j.standbys,\n"
            "                      'seats_kept': j.seats_kept}))\n"
        )
        cmd = [sys.executable, "-c", probe, self.daemon.endpoint, job, str(self.daemon.token_file)]
        out = subprocess.run(
            self.head.command(cmd), capture_output=True, text=True, timeout=30, check=True
        ).stdout
        facts: dict[str, Any] = json.loads(out)
        return facts

    def job_members(self, job: str) -> list[dict[str, Any]]:
        """The daemon's member table of ``job`` (asked from h0, where it is reachable),
        with each rank's last reported step (0 before its first); empty before the job
        exists."""
        probe = (
            "import json, sys\n"
            "from rendezvousd.client import NotFound, RendezvousClient\n"
            "with RendezvousClient(sys.argv[1], sys.argv[2], token_file=sys.argv[3]) as c:\n"
            "    try:\n"
            "        members = c.get_job().members\n"
            "    except NotFound:\n"
            "        members = []\n"
            "    print(json.dumps([{'rank': m.member.rank, 'host': m.member.host,\n"
            "                       'address': m.member.address, 'step': m.step}\n"
            "                      for m in members]))\n"
        )
        out = subprocess.run(
            self.head.command(
                [
                    sys.executable,
                    "-c",
                    probe,
                    self.daemon.endpoint,
                    job,
                    str(self.daemon.token_file),
                ]
            ),
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        members: list[dict[str, Any]] = json.loads(out)
        return members

    def stop(self) -> None:
        for node in self.nodes:
            if node.proc.poll() is None:
                node.proc.kill()
                node.proc.wait(10)
        self.daemon.kill()


def mutual_tls(folder: Path) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A CA, the daemon's certificate for h0 (198.18.N.1) and a client certificate,
    written to ``folder``: (the daemon's flags, a launcher's flags) for mutual TLS."""
    ca = trustme.CA()
    server = ca.issue_cert(str(SUBNET.network_address + 1), "rendezvousd.test")
    client = ca.issue_cert("worker.test")
    paths = {}
    for name, blob in {
        "ca.pem": ca.cert_pem,
        "server.pem": server.cert_chain_pems[0],
        "server.key": server.private_key_pem,
        "client.pem": client.cert_chain_pems[0],
        "client.key": client.private_key_pem,
    }.items():
        paths[name] = folder / name
        blob.write_to_path(str(paths[name]))
        paths[name].chmod(0o600)
    daemon = ("--tls-cert", str(paths["server.pem"]), "--tls-key", str(paths["server.key"]),
              "--tls-client-ca", str(paths["ca.pem"]))  # fmt: skip
    launcher = ("--tls-ca", str(paths["ca.pem"]), "--tls-cert", str(paths["client.pem"]),
                "--tls-key", str(paths["client.key"]))  # fmt: skip
    return daemon, launcher


def start_cluster(hosts: Hosts, workdir: Path, *daemon_flags: str, listen_port: int = 0) -> Cluster:
    """rendezvousd on h0 (plaintext unless TLS flags are given) and an empty cluster."""
    head = hosts[0]
    secure = "--tls-cert" in daemon_flags
    flags = [*daemon_flags] if secure else ["--insecure-plaintext", *daemon_flags]
    daemon = spawn_daemon(
        workdir, *flags, listen=f"{head.address}:{listen_port}", prefix=head.command([])
    )
    return Cluster(hosts, daemon, workdir)
