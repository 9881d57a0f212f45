"""A job stuck forming names its missing node (an operator review, D5): three
``rendezvous-run`` nodes, each on a host of its own name (a UTS namespace), of which
node 1 never comes. While nodes 0 and 2 wait, GetJob, ``rendezvousd status JOB`` and
the status page's JSON list both (node rank, host, instance, when) and say node rank 1
is missing; they gave only a count ("2 node(s) waiting to join", an empty grid). At the
join deadline each agent names the nodes joined and node 1; node 2, whose wait ends
after node 0's, says node 0 came and its own wait ended first, where it read
"needs min_nodes=3 and node 0's id" and sent the operator to node 0's host."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rendezvousd.client import NotFound, RendezvousClient
from tests.support import ROOT, DaemonProcess, launcher_cmd, run_launcher, wait_for

JOIN_TIMEOUT_S = 15


def _on_host(name: str) -> list[str]:
    return ["unshare", "--uts", "sh", "-c", f'hostname {name} && exec "$@"', "sh"]


@contextmanager
def _node(
    d: DaemonProcess, job: str, rank: int, host: str, tmp: Path
) -> Iterator[subprocess.Popen[str]]:
    script = tmp / "w.py"
    # A worker starts (a warm spare) before its job forms, and waits for its rank here.
    script.write_text(
        "from rendezvousd.trainer.distributed import init_distributed\n"
        "with init_distributed():\n    pass\n"
    )
    cmd = launcher_cmd(3, rank, 2, endpoint=d.endpoint, token_file=d.token_file, job=job)
    cmd += ["--join-timeout-s", str(JOIN_TIMEOUT_S), "--max-restarts", "0", str(script)]
    proc = subprocess.Popen(
        [*_on_host(host), *cmd],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


def _joining(d: DaemonProcess, job: str) -> list[tuple[int | None, str]]:
    with RendezvousClient(d.endpoint, job, token=d.token) as probe:
        try:
            got = probe.get_job()
        except NotFound:
            return []
    return [(n.node_rank if n.HasField("node_rank") else None, n.host) for n in got.joining]


def test_a_job_stuck_forming_names_the_nodes_joined_and_the_missing_one(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path
) -> None:
    d = start_daemon("--metrics-listen", "127.0.0.1:0")
    with _node(d, job_id, 0, "fm-n0", tmp_path) as zero:
        wait_for("node 0 to join", lambda: _joining(d, job_id) == [(0, "fm-n0")], timeout=30)
        # Node 2 joins after node 0, so node 0's wait ends first (the review's race).
        with _node(d, job_id, 2, "fm-n2", tmp_path) as two:
            both = [(0, "fm-n0"), (2, "fm-n2")]
            wait_for("node 2 to join", lambda: _joining(d, job_id) == both, timeout=30)

            # GetJob: the nodes joined, and what is missing.
            with RendezvousClient(d.endpoint, job_id, token=d.token) as probe:
                job = probe.get_job()
            assert [n.instance_tag for n in job.joining] and all(
                len(n.instance_tag) == 8 and n.joined_ms_ago < JOIN_TIMEOUT_S * 1000
                for n in job.joining
            ), job
            assert (list(job.missing_node_ranks), job.nodes_needed, job.min_nodes) == ([1], 1, 3)

            # rendezvousd status JOB: the two nodes by rank and host, their grid rows
            # joining, and the node rank missing.
            status = subprocess.run(
                [sys.executable, "-m", "rendezvousd.cli", "status", "--endpoint", d.endpoint,
                 "--token-file", str(d.token_file), job_id],
                capture_output=True, text=True, timeout=30, check=False,
            )  # fmt: skip
            out = status.stdout
            assert status.returncode == 0, status.stderr
            assert "    joined: node 0 on fm-n0 (" in out and ", node 2 on fm-n2 (" in out, out
            assert "    missing: node rank 1 (no node agent joined with that node rank)" in out
            rows = [line.split() for line in out.splitlines() if "fm-n" in line and "J" in line]
            # A forming node has no address yet (ADDRESS "-").
            assert ["0", "fm-n0", "-", "JJ", "-", "-"] in rows, rows
            assert ["2", "fm-n2", "-", "JJ", "-", "-"] in rows, rows

            # The status page's JSON: the same, and the grid's rows joining.
            base = d.metrics_url.removesuffix("/metrics")
            request = urllib.request.Request(
                f"{base}/api/jobs/{job_id}", headers={"Authorization": f"Bearer {d.token}"}
            )
            with urllib.request.urlopen(request, timeout=10) as answer:
                page = json.load(answer)
            forming = page["forming"]
            assert [(n["node"], n["host"]) for n in forming["joined"]] == both, forming
            assert forming["missing_node_ranks"] == [1] and forming["nodes_needed"] == 1
            assert forming["missing"] == "node rank 1 (no node agent joined with that node rank)"
            assert [(r["node"], r["host"], r["seats"]) for r in page["nodes"]["rows"]] == [
                (0, "fm-n0", "JJ"),
                (2, "fm-n2", "JJ"),
            ], page["nodes"]

            # Each agent's deadline message: the nodes joined, and node 1.
            _, said_zero = zero.communicate(timeout=JOIN_TIMEOUT_S + 30)
            _, said_two = two.communicate(timeout=JOIN_TIMEOUT_S + 30)
    assert zero.returncode != 0 and two.returncode != 0
    never = "no node agent joined as node 1: start it (rendezvous-run --node-rank 1)"
    assert (
        "2 node(s) joined of the min_nodes=3 it needs (node 0 on fm-n0, node 2 on fm-n2)"
        in said_zero
    ), said_zero
    assert never in said_zero, said_zero
    # Node 2's wait ended after node 0's: node 0 came, and is not what is missing.
    assert "node 0's id" not in said_two, said_two
    assert "1 node(s) joined of the min_nodes=3 it needs (node 2 on fm-n2); node 0 on fm-n0 " \
        "joined too, but its own wait ended at its deadline" in said_two, said_two  # fmt: skip
    assert never in said_two, said_two
    # And while it waited, the agent's note named the nodes and the missing one.
    assert "node(s) joined (node 0 on fm-n0 (" in said_two, said_two
    assert ", missing node rank 1 (no node agent joined with that node rank)" in said_two
    assert d.token not in said_zero + said_two


def test_a_lone_node_that_waited_twice_is_told_to_start_the_missing_node(
    start_daemon: Callable[..., DaemonProcess], job_id: str, tmp_path: Path
) -> None:
    """h122 D2: one node of a 2:3 job, one restart, 4 s waits. Its join timed out (a
    failure, restart 1), and its re-join's deadline named its own first join as
    another node that came: "every node the job needs came, but not within one
    another's waits: start them within --join-timeout-s of each other", where only it
    ever came, and the wait that ran out was --rejoin-timeout-s."""
    d = start_daemon()
    script = tmp_path / "w.py"
    # A warm spare starts before the job forms, and waits for its rank here.
    script.write_text(
        "from rendezvousd.trainer.distributed import init_distributed\n"
        "with init_distributed():\n    pass\n"
    )
    cmd = launcher_cmd("2:3", "auto", 1, endpoint=d.endpoint, token_file=d.token_file, job=job_id)
    cmd += ["--max-restarts", "1", "--join-timeout-s", "4", "--rejoin-timeout-s", "4"]
    done = run_launcher([*cmd, str(script)], timeout=90, cwd=ROOT)
    assert done.returncode == 1, done.stderr
    last = done.stderr[done.stderr.index("gave up after 1 restart") :]
    second = last[last.index("\n  2. ") :]
    assert "1 more node(s) never joined: start the missing node agents" in second, last
    assert "every node the job needs came" not in last, last
    assert "joined too" not in last, last
