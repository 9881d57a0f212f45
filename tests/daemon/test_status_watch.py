"""``rendezvousd status --watch``: on a terminal it redraws as the job changes; piped,
it prints one snapshot and exits (a script can read it)."""

from __future__ import annotations

import os
import pty
import select
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.cli.serve import main
from rendezvousd.client import RendezvousClient
from tests.support import ROOT, DaemonProcess, free_port, parallel, wait_for


def _status(d: DaemonProcess, job: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rendezvousd.cli",
        "status",
        "--endpoint",
        d.endpoint,
        "--token-file",
        str(d.token_file),
        "--watch",
        "0.2",
        job,
    ]


def test_watch_piped_prints_one_snapshot(daemon: DaemonProcess, job_id: str) -> None:
    with RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as c:
        c.join(num_nodes=1, gpus_per_node=1, node_rank=0, local_rank=0, host="piped-host")
        out = subprocess.run(_status(daemon, job_id), capture_output=True, text=True, timeout=30)
        c.leave()
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("JOB ") == 1 and "piped-host" in out.stdout
    assert "\x1b[" not in out.stdout


def test_watch_on_a_terminal_redraws_as_the_job_changes(daemon: DaemonProcess, job_id: str) -> None:
    primary, secondary = pty.openpty()
    proc = subprocess.Popen(_status(daemon, job_id), stdout=secondary, stderr=secondary)
    os.close(secondary)
    seen = ""

    def read_until(needle: str, timeout: float = 20) -> None:
        nonlocal seen
        deadline = time.monotonic() + timeout
        while needle not in seen:
            assert time.monotonic() < deadline, f"never drew {needle!r}: {seen[-500:]!r}"
            if select.select([primary], [], [], 0.2)[0]:
                seen += os.read(primary, 65536).decode(errors="replace")

    try:
        read_until("does not exist")  # no such job yet: the watcher keeps going
        with RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as c:
            c.join(num_nodes=1, gpus_per_node=1, node_rank=0, local_rank=0, host="tty-host")
            read_until("RUNNING")
            c.leave()
        read_until("ENDED")
        assert "tty-host" in seen and seen.count("\x1b[H\x1b[2J") >= 3
        assert proc.poll() is None  # still watching
    finally:
        proc.terminate()
        proc.wait(10)
        os.close(primary)


def test_status_of_a_job_draws_the_pages_grid(daemon: DaemonProcess, job_id: str) -> None:
    """`status JOB`: the job's line, then a row per node with one letter per local rank
    (the status page's letters), its host, heartbeat age and step, and the budget."""
    agents = [RendezvousClient(daemon.endpoint, job_id, token=daemon.token) for _ in range(2)]
    try:
        members = parallel(
            [
                lambda c=c, i=i: c.join_node(  # type: ignore[misc]
                    min_nodes=2,
                    max_nodes=2,
                    gpus_per_node=3,
                    host=f"grid-host-{i}",
                    addresses=[f"198.19.150.{10 + i}"] * 3,
                    timeout=20,
                )
                for i, c in enumerate(agents)
            ]
        )
        for c, m in zip(agents, members, strict=True):
            # Node 1's local rank 1 (rank 4) is the slowest, and is lost below.
            steps = [10 + m.node_rank, 2 if m.node_rank == 1 else None, 12]
            c.report_progress(steps, restarts_used=1, max_restarts=4)
            c.start_heartbeat(0.1)
        wait_for(
            "both nodes' steps",
            lambda: sum(m.HasField("step") for m in agents[0].get_job().members) == 5,
        )
        running = subprocess.run(
            [*_status(daemon, job_id)[:-3], job_id], capture_output=True, text=True, timeout=30
        )
        node1 = next(i for i, m in enumerate(members) if m.node_rank == 1)
        agents[node1].report_failure(1, "boom")
        wait_for("the loss", lambda: bool(agents[0].get_job().failed))
        failed = subprocess.run(
            [*_status(daemon, job_id)[:-3], job_id], capture_output=True, text=True, timeout=30
        )
    finally:
        for c in agents:
            c.close()
    assert running.returncode == failed.returncode == 0, running.stderr + failed.stderr
    out = running.stdout
    rows = {line.split()[0]: line.split() for line in out.splitlines()[5:7]}
    host = {m.node_rank: f"grid-host-{i}" for i, m in enumerate(members)}
    # Each node's advertised address (its route to the daemon), which peers dial: a
    # multi-homed host's wrong pick was visible only in GetJob (h145 F5).
    assert "NODE  HOST" in out and " ADDRESS " in out, out
    address = {m.node_rank: f"198.19.150.{10 + i}" for i, m in enumerate(members)}
    assert rows["0"][1:4] == [host[0], address[0], "AAA"] and rows["0"][-1] == "10", out
    assert rows["1"][1:4] == [host[1], address[1], "AAA"] and rows["1"][-1] == "2", out
    assert "step 2 · restarts 1 used, 3 left" in out
    assert "A active, H late heartbeat, X lost" in out
    row1 = next(line.split() for line in failed.stdout.splitlines() if host[1] in line)
    assert row1[3][1] == "X", failed.stdout  # local rank 1 of node 1: rank 4
    assert f"lost rank 4 on {host[1]}: boom" in failed.stdout
    # The job's step is its slowest ACTIVE rank's, as on the status page (JobView.step):
    # lost rank 4's step 2 is no longer where the job stands.
    assert "step 10 · restarts" in failed.stdout, failed.stdout


def test_status_of_a_generation_a_joiner_failed_says_why(
    daemon: DaemonProcess, job_id: str
) -> None:
    """A forming generation failed by a joiner of another topology has no lost member:
    `status` showed FAILED and nothing else, the refusal only in the joiners' words and
    the daemon's log. GetJob carries it (``conflict``). (A joiner of another version is
    refused alone: the generation goes on.)"""
    from rendezvousd.client import NotFound, RendezvousError, TopologyMismatch

    joiners = [RendezvousClient(daemon.endpoint, job_id, token=daemon.token) for _ in range(2)]

    def join(i: int, host: str, nodes: int) -> object:
        return joiners[i].join_node(
            min_nodes=2, max_nodes=nodes, gpus_per_node=1, host=host, timeout=20
        )

    def published() -> bool:
        try:
            return joiners[1].get_job().id_published
        except NotFound:
            return False

    try:
        waiting: list[object] = [None]

        def first() -> None:
            try:
                waiting[0] = join(0, "new-host", 2)
            except RendezvousError as exc:
                waiting[0] = exc

        threading.Thread(target=first, daemon=True).start()
        wait_for("node 0 to join", published)
        with pytest.raises(TopologyMismatch):
            join(1, "old-host", 3)
        wait_for("node 0 to hear it", lambda: waiting[0] is not None)
        job = joiners[0].get_job()
        shown = subprocess.run(
            [*_status(daemon, job_id)[:-3], job_id], capture_output=True, text=True, timeout=30
        )
    finally:
        for c in joiners:
            c.close()
    assert isinstance(waiting[0], TopologyMismatch), waiting
    assert "on host 'old-host' asked for" in job.conflict, job.conflict
    assert shown.returncode == 0, shown.stderr
    assert "FAILED" in shown.stdout, shown.stdout
    said = "    refused: job "
    assert said in shown.stdout and "on host 'old-host' asked for" in shown.stdout, shown.stdout


def test_status_skips_a_job_forgotten_between_listing_and_reading_it(
    start_daemon: Callable[..., DaemonProcess],
    job_id: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    d = start_daemon("--job-ttl-s", "0.5")
    with RendezvousClient(d.endpoint, job_id, token=d.token) as c:
        c.join(num_nodes=1, gpus_per_node=1, node_rank=0, local_rank=0)
        c.leave()
    listed = RendezvousClient.list_jobs

    def list_then_forget(client: RendezvousClient) -> list[pb.JobSummary]:
        jobs = listed(client)
        assert [j.job_id for j in jobs] == [job_id]
        # The daemon forgets the job after ListJobs answered, before `status` reads it.
        wait_for("the job forgotten", lambda: listed(client) == [], timeout=20)
        return jobs

    monkeypatch.setattr(RendezvousClient, "list_jobs", list_then_forget)
    # --all: a finished job is read (GetJob) only when listed, not counted.
    args = ["status", "--endpoint", d.endpoint, "--token-file", str(d.token_file), "--all"]
    assert main(args) == 0, capsys.readouterr().err
    assert "(no jobs)" in capsys.readouterr().out


def test_status_exit_codes_tell_a_daemon_down_from_a_refused_call(
    daemon: DaemonProcess, job_id: str
) -> None:
    """health's codes: 1 bad arguments, 2 unreachable, 3 the call failed."""
    base = [sys.executable, "-m", "rendezvousd.cli", "status", "--token-file"]
    cases = [
        (["/nonexistent", "--endpoint", daemon.endpoint], 1, "cannot read token file"),
        # Within --timeout: one wait for the daemon, not the SDK's retry after it (twice).
        (
            ["--timeout", "1", "--endpoint", f"127.0.0.1:{free_port()}"],
            2,
            # Named by this command's flag: no status user passes connect_timeout.
            "connected to within 1 s (--timeout)",
        ),
        (["--timeout", "1", "--endpoint", f"127.0.0.1:{free_port()}"], 2, "nothing listens there"),
        (["--endpoint", daemon.endpoint, job_id], 3, "does not exist"),
    ]
    for args, code, said in cases:
        token = [] if args[0].startswith("/") else [str(daemon.token_file)]
        done = subprocess.run([*base, *token, *args], capture_output=True, text=True, timeout=60)
        assert (done.returncode, said in done.stderr) == (code, True), (args, done.stderr)


def test_status_says_it_still_waits_for_a_daemon_down_as_its_own_words(tmp_path: Path) -> None:
    """Past 5 s the SDK says it still waits for the daemon. ``status`` printed that through
    Python's last-resort handler, without the command's name, as "job '': ...", and in
    the SDK's keyword (connect_timeout) where the command has --timeout."""
    token = tmp_path / "token"
    token.write_text("t" * 32)
    token.chmod(0o600)
    done = subprocess.run(
        [sys.executable, "-m", "rendezvousd.cli", "status", "--token-file", str(token),
         "--timeout", "6.5", "--endpoint", f"127.0.0.1:{free_port()}"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    first = done.stderr.splitlines()[0]
    assert first.startswith("rendezvousd status: rendezvousd at 127.0.0.1:"), done.stderr
    assert "not reached after 5 s" in first and "(--timeout)" in first, done.stderr
    assert "job ''" not in done.stderr and "connect_timeout" not in done.stderr, done.stderr


def test_health_of_a_service_the_daemon_does_not_have_names_it(daemon: DaemonProcess) -> None:
    """The health service answers NOT_FOUND without details: the command printed
    "Check failed: NOT_FOUND: ", ending at the colon."""
    done = subprocess.run(
        [sys.executable, "-m", "rendezvousd.cli", "health", "--service", "nope",
         "--endpoint", daemon.endpoint],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert "has no service 'nope'" in done.stderr, done.stderr
    assert "'rendezvous.v1.Rendezvous'" in done.stderr, done.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["health", "--timeout", "-1"],  # gRPC took it as passed: "cannot reach" a live daemon
        ["health", "--timeout", "inf"],
        ["status", "--timeout", "nan"],
        ["status", "--watch", "0"],  # redrew without a pause
        ["status", "--watch", "-1"],  # time.sleep's ValueError, on a terminal
    ],
)
def test_probe_commands_refuse_seconds_they_cannot_wait(
    daemon: DaemonProcess, args: list[str]
) -> None:
    if args[0] == "status":
        args = [*args, "--token-file", str(daemon.token_file)]
    done = subprocess.run(
        [sys.executable, "-m", "rendezvousd.cli", *args, "--endpoint", daemon.endpoint],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    # 1, as grpc_health_probe: argparse's own 2 is what they say of an unreachable daemon.
    assert done.returncode == 1, done.stderr
    assert f"argument {args[1]}: '{args[2]}' is not a number of seconds" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("command", ["health", "status"])
@pytest.mark.parametrize("endpoint", ["", "localhost", "127.0.0.1:99999"])
def test_probe_commands_refuse_a_malformed_endpoint_as_bad_arguments(
    tmp_path: Path, command: str, endpoint: str
) -> None:
    # health handed it to gRPC: its core's log lines and exit 3, an RPC failure.
    token = tmp_path / "token"
    token.write_text("t" * 32 + "\n")
    token.chmod(0o600)
    more = ["--token-file", str(token)] if command == "status" else []
    done = subprocess.run(
        [sys.executable, "-m", "rendezvousd.cli", command, "--endpoint", endpoint, *more],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith(f"rendezvousd {command}: endpoint={endpoint!r} "), done.stderr
    assert done.stderr.count("\n") == 1, done.stderr  # nothing of gRPC's core


def _inspecting_commands() -> list[str]:
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text.split("## Inspecting", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    lines = block.splitlines()
    return [line.split("#", 1)[0].rstrip() for line in lines if line.startswith("rendezvousd ")]


@pytest.mark.parametrize("command", _inspecting_commands())
def test_the_documented_probe_commands_parse(command: str) -> None:
    # The docs showed `status ... --watch [JOB]`, whose JOB --watch read as its seconds.
    from rendezvousd.cli.serve import build_parser

    for job in ("", "jt1") if "[JOB]" in command else ("",):
        line = command.replace("[JOB]", job).replace("[SECONDS]", "")
        args = build_parser().parse_args(shlex.split(line)[1:])
        assert getattr(args, "job", None) == (job or None), line


def test_status_names_the_daemons_version_and_a_client_learns_it(
    daemon: DaemonProcess, job_id: str
) -> None:
    """Every daemon said 0.1.0 only in its own log: `status` could not tell which
    rendezvousd answered (a daemon upgraded or not). ListJobs and GetJob say it."""
    import importlib.metadata

    from rendezvousd.cli.probe import daemon_line
    from rendezvousd.common.version import build_id

    # The build too (h139 F3: two builds of one release both said 0.1.0).
    version = f"{importlib.metadata.version('rendezvousd')}+{build_id()}"
    with RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as c:
        assert c.daemon_version() == ""  # not asked yet
        c.join(num_nodes=1, gpus_per_node=1, node_rank=0, local_rank=0, timeout=20)
        assert c.daemon_version() == ""
        assert c.get_job().daemon_version == version
        assert c.daemon_version() == version
        for job in ("", job_id):  # the table of every job, and one job's view
            shown = subprocess.run(
                [*_status(daemon, job)[:-3], *([job] if job else [])],
                capture_output=True, text=True, timeout=30, check=False,
            )  # fmt: skip
            assert shown.returncode == 0, shown.stderr
            head, _, rest = shown.stdout.partition("\n")
            assert head == f"daemon {daemon.endpoint}: rendezvousd {version}", shown.stdout
            assert rest.startswith("JOB "), shown.stdout
        c.leave()
    # A daemon from before the field answers "": said as unknown, not as a blank.
    older = daemon_line("127.0.0.1:1", "")
    assert older == "daemon 127.0.0.1:1: rendezvousd unknown (a rendezvousd from before 2026-12-07)"
