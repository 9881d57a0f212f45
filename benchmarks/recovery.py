"""Recovery: how fast ``rendezvous-run --max-restarts`` trains again after a kill -9,
how many steps it loses, and whether the final model equals a fault-free run's.

    python benchmarks/recovery.py --json-out recovery.json

One daemon on loopback, 3 simulated nodes x 2 CPU workers (the example MLP);
``--backend nccl`` makes them 6 NCCL ranks on GPU 0, each its own NCCL host (the
shared-device mode of scripts/gpu_check.sh: sockets on loopback, a one-GPU check of the
recovery path on NCCL, not a measure of NVLink). Runs:
``fault_free``; ``worker_kill`` (kill -9 of one worker at step k);
``node_kill_replaced`` (kill -9 of a node's agent at step k, its workers die
with it, and a fresh agent for that node is started at once, as a scheduler
would); ``node_kill_standby`` (the same kill, with a fourth agent started beside the
three as ``--standby --node-rank auto``: it waits beyond ``--nnodes 3``, spares warm,
and takes the lost node's place; nothing is started after the kill);
``node_kill_shrink`` (``--nnodes 2:3``: the job goes on with 2 nodes).
``--busy N`` runs N CPU-bound loops (separate processes) through every scenario, the
same for each: the load of a shared machine, which a fresh agent's imports feel most.
Recovery time is from the kill to the first step of the next generation (from
every rank's step log); steps lost is the newest step reached before the kill
minus the step the job resumed at. ``--repeat N`` runs each fault scenario N
times and reports every run and the median. Prints one JSON document.

Each fault run also reports ``milestones_s``, where its time went (seconds after
the kill): the daemon's transitions from its log (the failed generation, the next
one formed), and the launchers' and workers' milestones from
``RENDEZVOUSD_TRACE_FILE`` (``trainer/agent/_trace.py``): survivors told and their
workers stopped, the replacement's launcher, its spares started (and its fork server ready) and ready, every
node joined and assigned, every worker attached and its ring up, the first step.
The project's modules are byte-compiled first (``byte_compile``), so that the
figures do not depend on ``PYTHONDONTWRITEBYTECODE``.

**torchrun side by side** (run with ``scripts/torch_venv.sh``'s python; without torch
the report says it was skipped): the same 3 nodes x 2 workers on loopback, gloo,
``torchrun --max-restarts 3 --monitor-interval 0.1``, a stock training script
(tests/workers/torch_worker.py: one all-reduce per step, the same step pause), the
``worker_kill``, ``node_kill_shrink`` and ``node_kill_standby`` (a fourth agent for
``--nnodes 3``, started with the three: c10d keeps it in its redundancy list, ours stands
by; the node killed is one that trains) faults at the same step, with four rendezvous
backends: ``c10d`` as shipped, ``c10d`` with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
(the setting shared/ANCHORS.md found it needs to restart at all), ``rendezvousd``
(ours, through torch's plugin point), and ``rendezvousd-warm``: ours with
``PYTHON_EXEC=rendezvous-python``, whose workers are forked from a per-node server that
imported torch once (``trainer/torchrun/warm.py``). Both c10d runs use its best
documented settings (``--rdzv-conf``, integer seconds): ``last_call_timeout=1`` and a
keep-alive of ``keep_alive_interval=1,keep_alive_max_attempt=3`` (30 s and 3 x 5 s by
default). c10d's store lives in one agent: agent 0's (``is_host``), and on every backend
the fault hits the highest rank outside node 0, so the store's host is never killed, as
our separate daemon is never killed (killing it ends a c10d job: no restart; with the
host left to chance, 2 of 5 runs killed it). Everything else is the same in all
four: the script, torchrun's flags, the faults; the warm server's own start (its
import of torch, while the first round forms) is before the kill, as every agent's
and worker's start-up is. A node kill SIGKILLs the agent and every
process below it (torch starts each worker in a session of its own, so its workers
would outlive a SIGKILLed agent; a dead machine's do not).
Each run reports whether a next round trained at all, and the time from the kill to
its first step and to every rank's; a stock script restarts from step 0. It then waits
for the survivors' agents and judges their exit codes (``survivors_exited_0``): a case's
``finished`` counts the runs whose every survivor exited 0, and its
``recovery_s_median`` is over those runs only. It also
reports when the survivors' agents started new workers (``workers_restarted_s``: the
failure's detection and the new round's rendezvous), apart from the workers' own
start-up (``import torch`` is ~2.5 s of CPU each here), which no rendezvous shortens:
only ``rendezvousd-warm``'s workers skip it.

The observer must not compete with what it measures (2 cores): it reads the
step log incrementally and looks every 10 ms; the times it reports come from
the workers' own step timestamps, not from when it looked.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import importlib.util
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from _report import emit

from rendezvousd.cli.embedded import EmbeddedDaemon, spawn
from rendezvousd.common.log_time import STAMP, STAMP_FORMAT
from rendezvousd.trainer.agent._trace import TRACE_ENV
from rendezvousd.trainer.comm.devices import SHARED_DEVICE_ENV

ROOT = Path(__file__).resolve().parents[1]

TARGETS = {"recovery_s_max": 1.0, "steps_lost_max": 1}
NODES, PER_NODE = 3, 2


class StepLog:
    """The workers' shared step log, read incrementally (only new whole lines)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.steps: list[dict[str, Any]] = []
        self._offset = 0

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return self.steps
        with self.path.open("rb") as fh:
            fh.seek(self._offset)
            data = fh.read()
        end = data.rfind(b"\n") + 1  # a line being written waits for the next look
        self._offset += end
        for line in data[:end].splitlines():
            try:
                self.steps.append(json.loads(line))
            except ValueError:
                continue  # interleaved writers garbled one line; the others count
        return self.steps


def _wait(what: str, check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.01)  # poll interval of an observer, not a synchronisation


class Run:
    def __init__(
        self, d: EmbeddedDaemon, daemon_log: Path, work: Path, name: str, args: argparse.Namespace
    ) -> None:
        self.d, self.work, self.name, self.args = d, work / name, name, args
        self.work.mkdir(parents=True)
        self.log = self.work / "steps.jsonl"
        self.steps = StepLog(self.log)
        self.launched_at: dict[int, float] = {}
        self.nodes: dict[int, subprocess.Popen[bytes]] = {}
        # Each node's latest launcher's stderr.
        self.errs: dict[int, Path] = {}
        # Every launcher of this run, the killed one's too, by pid: node.
        self.launchers: dict[int, int] = {}
        self.trace = self.work / "trace.jsonl"
        self.env = {**os.environ, TRACE_ENV: str(self.trace)}
        if args.backend == "nccl":
            # Every rank on the one GPU, each its own NCCL host (devices.prepare_nccl).
            self.env[SHARED_DEVICE_ENV] = "1"
        # The daemon's log is shared by every run: this run's lines start here.
        self.daemon_log = daemon_log
        self.daemon_log_from = daemon_log.stat().st_size

    def launch(self, node: int, nnodes: str, restarts: int, *, standby: bool = False) -> None:
        """Node ``node``'s launcher; a standby's takes whichever node rank is freed."""
        a = self.args
        cmd = [
            sys.executable,
            "-m",
            "rendezvousd.trainer.agent.launcher",
            "--nnodes",
            nnodes,
            *(["--standby", "--node-rank", "auto"] if standby else ["--node-rank", str(node)]),
            "--nproc-per-node",
            str(PER_NODE),
            "--rdzv-endpoint",
            self.d.endpoint,
            "--token-file",
            str(self.d.token_file),
            "--job-id",
            self.name,
            "--max-restarts",
            str(restarts),
            "--last-call-s",
            "0.3",
            "--rejoin-timeout-s",
            "30",
            "--backend",
            a.backend,
            "-m",
            "rendezvousd.trainer.example",
            "--steps",
            str(a.steps),
            "--step-sleep",
            str(a.step_sleep),
            "--step-log",
            str(self.log),
            "--result-dir",
            str(self.work / "results"),
            "--log-every",
            "1000",
        ]
        self.errs[node] = self.work / f"node{node}-{len(self.nodes)}.err"
        err = self.errs[node].open("w")
        self.launched_at[node] = time.time()
        self.nodes[node] = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=err, env=self.env
        )
        self.launchers[self.nodes[node].pid] = node

    def wait(self, timeout: float) -> dict[int, int]:
        return {n: p.wait(timeout) for n, p in self.nodes.items()}

    def kill_all(self) -> None:
        for p in self.nodes.values():
            if p.poll() is None:
                p.kill()

    def result(self) -> dict[str, Any]:
        ranks = sorted((self.work / "results").glob("rank-*.json"))
        docs = [json.loads(r.read_text()) for r in ranks]
        if not docs:
            return {"error": "no results"}
        r0 = next(d for d in docs if d["rank"] == 0)
        return {
            "final_loss": r0["final_loss"],
            "params_sha256": r0["params_sha256"],
            "generation": r0["generation"],
            "restart_count": r0["restart_count"],
            "world_size": r0["world_size"],
        }

    def at_step(self, k: int) -> dict[int, int]:
        """Wait until rank 0 finished step k; rank -> pid of the current generation."""
        _wait(f"step {k}", lambda: any(s["step"] >= k for s in self.steps.read()), 120)
        steps = self.steps.read()
        gen = max(s["gen"] for s in steps)
        return {s["rank"]: s["pid"] for s in steps if s["gen"] == gen}

    def recovered(self, killed_at: float, world: int) -> bool:
        """All ``world`` ranks of a generation newer than the killed one have stepped."""
        steps = self.steps.read()
        old = max((s["gen"] for s in steps if s["t"] <= killed_at), default=0)
        return len({s["rank"] for s in steps if s["gen"] > old}) >= world

    def recovery(self, killed_at: float) -> dict[str, Any]:
        steps = self.steps.read()
        before = [s for s in steps if s["t"] <= killed_at]
        old_gen = max(s["gen"] for s in before)
        reached = max(s["step"] for s in before)
        after = [s for s in steps if s["gen"] > old_gen]
        if not after:
            return {"error": "no step after the kill"}
        first = min(after, key=lambda s: s["t"])
        resumed_at = min(s["step"] for s in after) - 1
        by_rank: dict[int, float] = {}
        for s in sorted(after, key=lambda s: s["t"]):
            by_rank.setdefault(s["rank"], round(s["t"] - killed_at, 3))
        return {
            "recovery_s": round(first["t"] - killed_at, 3),
            # Every rank's first step of the new generation (they step together).
            "first_step_s_by_rank": dict(sorted(by_rank.items())),
            "steps_reached_before_kill": reached,
            "resumed_at_step": resumed_at,
            "steps_lost": reached - resumed_at,
            "new_generation": first["gen"],
        }


# The daemon's log line of a generation's transition (INFO), with its milliseconds:
# when it noticed the loss, and when the next generation formed.
TRANSITION = re.compile(
    rf"^({STAMP.pattern}) \w+ [\w.]+: job (\S+) generation (\d+): (\S+) -> (\S+)"
)


def daemon_transitions(run: Run) -> list[tuple[float, str, int, str]]:
    """(time, job, generation, new state) of this run's transitions in the daemon's log."""
    with run.daemon_log.open("rb") as fh:
        fh.seek(run.daemon_log_from)
        text = fh.read().decode("utf-8", "replace")
    out = []
    for line in text.splitlines():
        if (m := TRANSITION.match(line)) is not None:
            # The stamp is UTC, marked (``log_time``), with milliseconds.
            t = datetime.strptime(m[1], STAMP_FORMAT).timestamp()
            out.append((t, m[2], int(m[3]), m[5]))
    return out


def breakdown(
    run: Run, killed_at: float, first_step: float, killed: int | None, replaced: bool
) -> dict[str, Any]:
    """Where the time from the kill to the first step went: the milestones of the
    daemon (its log), every node's launcher and workers (``RENDEZVOUSD_TRACE_FILE``),
    in seconds after the kill. A milestone of several processes is the last of them
    (the next one waits for all); ``replacement_*`` are the fresh node's own.
    ``killed``: the node whose launcher was killed, if any; ``replaced``: whether
    a fresh launcher took its place."""
    events = []
    if run.trace.exists():
        for line in run.trace.read_text().splitlines():
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))
    window = [e for e in events if killed_at <= e["t"] <= first_step]
    new_pid = run.nodes[killed].pid if killed is not None and replaced else None
    survivors = {p for p, n in run.launchers.items() if n != killed}

    def at(t: float | None) -> float | None:
        return None if t is None else round(t - killed_at, 3)

    def last(event: str, pids: set[int] | None = None, *, parent: bool = False) -> float | None:
        ts = [
            e["t"]
            for e in window
            if e["event"] == event and (pids is None or e["ppid" if parent else "pid"] in pids)
        ]
        return at(max(ts)) if ts else None

    transitions = daemon_transitions(run)
    failed = [t for t, job, _, new in transitions if job == run.name and new == "FAILED"]
    formed = [t for t, job, _, new in transitions if job == run.name and new == "RUNNING"]
    out: dict[str, Any] = {
        # The log's milliseconds are truncated: a loss in the kill's millisecond is at -0.001.
        "daemon_failed_generation_s": at(
            min((t for t in failed if t >= killed_at - 0.001), default=None)
        ),
        "survivors_heard_s": last("failure-heard", survivors),
        "survivors_stopped_workers_s": last("stopped", survivors),
        "survivors_rejoining_s": last("join-start", survivors),
    }
    if new_pid is not None and killed is not None:
        out.update(
            {
                "replacement_launched_s": at(run.launched_at[killed]),
                "replacement_main_s": last("launcher-main", {new_pid}),
                "replacement_spares_started_s": last("spares-started", {new_pid}),
                # Its fork server's imports done (absent with cold spares).
                "replacement_fork_server_ready_s": last(
                    "fork-server-ready", {new_pid}, parent=True
                ),
                "replacement_joining_s": last("join-start", {new_pid}),
                "replacement_spares_ready_s": last("spare-ready", {new_pid}, parent=True),
            }
        )
    out.update(
        {
            "daemon_formed_s": at(min((t for t in formed if t >= killed_at), default=None)),
            "every_node_joined_s": last("joined"),
            "every_node_assigned_s": last("assigned"),
            "every_worker_assigned_s": last("assignment-heard"),
            "every_worker_attached_s": last("attached"),
            "every_ring_up_s": last("ring-up"),
            "first_step_s": at(first_step),
        }
    )
    return out


def scenario(
    d: EmbeddedDaemon, daemon_log: Path, work: Path, name: str, args: argparse.Namespace
) -> dict[str, Any]:
    run = Run(d, daemon_log, work, name, args)
    nnodes = f"2:{NODES}" if name == "node_kill_shrink" else str(NODES)
    restarts = 0 if name == "fault_free" else 3
    world = (NODES - 1 if name == "node_kill_shrink" else NODES) * PER_NODE
    try:
        start_load = round(os.getloadavg()[0], 2)
        for n in range(NODES):
            run.launch(n, nnodes, restarts)
        if name == "node_kill_standby":
            run.launch(NODES, nnodes, restarts, standby=True)
            err = run.errs[NODES]
            _wait("the standby to stand by", lambda: "standing by" in err.read_text(), 120)
        out: dict[str, Any] = {"load_1m_at_start": start_load}
        if name != "fault_free":
            pids = run.at_step(args.kill_step)
            killed_at = time.time()
            if name == "worker_kill":
                os.kill(pids[2 * PER_NODE - 1], signal.SIGKILL)  # node 1, local rank 1
            else:
                run.nodes[NODES - 1].send_signal(signal.SIGKILL)
                if name == "node_kill_replaced":
                    run.nodes[NODES - 1].wait(10)
                    run.launch(NODES - 1, nnodes, restarts)
                    out["replacement_started_s"] = round(run.launched_at[NODES - 1] - killed_at, 3)
            _wait("the next generation's first step", lambda: run.recovered(killed_at, world), 60)
            out.update(run.recovery(killed_at))
            if "recovery_s" in out:
                killed = None if name == "worker_kill" else NODES - 1
                first = killed_at + out["recovery_s"] + 0.001  # it is rounded to the ms
                replaced = name == "node_kill_replaced"
                out["milestones_s"] = breakdown(run, killed_at, first, killed, replaced)
        codes = run.wait(180)
        if name in ("node_kill_shrink", "node_kill_standby"):
            codes.pop(NODES - 1)  # SIGKILLed on purpose
        out["exit_codes"] = codes
        out.update(run.result())
        return out
    finally:
        run.kill_all()


def _summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One run as it is; several: the median run's figures, and every run."""
    if len(results) == 1:
        return results[0]
    times = [r.get("recovery_s", 99.0) for r in results]
    median = sorted(results, key=lambda r: r.get("recovery_s", 99.0))[len(results) // 2]
    return {
        **median,
        "recovery_s": statistics.median(times),
        "recovery_s_runs": times,
        "runs": results,
    }


TORCH_WORKER = Path(__file__).resolve().parents[1] / "tests" / "workers" / "torch_worker.py"
TORCHRUN_BACKENDS = ("c10d", "c10d-unshared-store", "rendezvousd", "rendezvousd-warm")
TORCHRUN_FAULTS = ("worker_kill", "node_kill_shrink", "node_kill_standby")


class TorchrunRun:
    """3 torchrun agents x 2 gloo workers of tests/workers/torch_worker.py (a stock
    script: no checkpoint, so a restarted round trains from step 0); NCCL workers on
    GPU 0 with ``--backend nccl``."""

    def __init__(
        self,
        work: Path,
        backend: str,
        fault: str,
        args: argparse.Namespace,
        d: EmbeddedDaemon,
        port: int,
    ) -> None:
        self.work, self.backend, self.fault, self.args = work, backend, fault, args
        self.work.mkdir(parents=True)
        self.log = self.work / "steps.jsonl"
        self.steps = StepLog(self.log)
        nnodes = f"2:{NODES}" if fault == "node_kill_shrink" else str(NODES)
        if backend.startswith("rendezvousd"):
            rdzv = [
                "--rdzv-backend",
                "rendezvousd",
                "--rdzv-endpoint",
                d.endpoint,
                "--rdzv-conf",
                f"token_file={d.token_file}",
            ]
        else:
            # c10d at its best documented settings (--rdzv-conf, all integers in
            # seconds): its last call (min < max) defaults to 30 s, 1 s is its smallest,
            # against rendezvous-run's 0.3 s; a dead node is noticed when its keep-alive
            # is keep_alive_max_attempt x keep_alive_interval old, 3 x 5 s by default,
            # 3 x 1 s here (ours hears a killed agent's stream close at once).
            rdzv = [
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-conf",
                "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3",
            ]
        self.cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            nnodes,
            "--nproc-per-node",
            str(PER_NODE),
            *rdzv,
            "--rdzv-id",
            f"{backend}-{fault}",
            "--max-restarts",
            "3",
            "--monitor-interval",
            "0.1",
            str(TORCH_WORKER),
            "--steps",
            str(args.steps),
            "--step-sleep",
            str(args.step_sleep),
            "--step-log",
            str(self.log),
            "--backend",
            "nccl" if args.backend == "nccl" else "gloo",
        ]
        self.env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if backend == "c10d-unshared-store":
            self.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        if backend == "rendezvousd-warm":
            # torchrun starts each worker through our shim, forked from the node's
            # warm server (torch imported once per node, not once per worker).
            self.env["PYTHON_EXEC"] = str(Path(sys.executable).parent / "rendezvous-python")
        self.agents: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        # node_kill_standby: a fourth agent for --nnodes 3, which c10d keeps in its
        # redundancy list and ours stands by (whichever agent comes last).
        for n in range(NODES + (self.fault == "node_kill_standby")):
            err = (self.work / f"agent{n}.err").open("w")
            cmd = self.cmd
            if self.backend.startswith("c10d"):
                # c10d's store lives in one agent (by default the first to bind its
                # port): agent 0's, named so, and never the node killed (``run``), as
                # our daemon is never killed. Killing it ends the whole job (seen: no
                # restart), a c10d limit these runs leave out rather than hit at random.
                at = cmd.index("--rdzv-conf") + 1
                cmd = [*cmd[:at], f"{cmd[at]},is_host={int(n == 0)}", *cmd[at + 1 :]]
            # Its own session: a node kill takes the agent and its workers, as a
            # machine's death would (torchrun's workers outlive a SIGKILLed agent).
            self.agents.append(
                subprocess.Popen(
                    cmd,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    env=self.env,
                    start_new_session=True,
                )
            )

    def run(self) -> dict[str, Any]:
        world = (NODES - 1 if self.fault == "node_kill_shrink" else NODES) * PER_NODE
        self.start()
        try:
            _wait(
                f"step {self.args.kill_step} on every rank",
                lambda: (
                    len({s["rank"] for s in self.steps.read() if s["step"] >= self.args.kill_step})
                    == NODES * PER_NODE
                ),
                180,
            )
            before = self.steps.read()
            old_pids = {s["pid"] for s in before}
            # The highest rank outside agent 0's node (every backend alike: c10d's
            # store is in agent 0, ``start``), and the agent whose node it is on (not
            # the one standing by).
            host_tree = _tree(self.agents[0].pid)
            victim = max((s for s in before if s["pid"] not in host_tree), key=lambda s: s["rank"])
            node = next(a for a in self.agents if victim["pid"] in _tree(a.pid))
            killed_at = time.time()
            if self.fault == "worker_kill":
                os.kill(victim["pid"], signal.SIGKILL)
            else:
                _kill_node(node.pid)

            def new_round() -> list[dict[str, Any]]:
                return [s for s in self.steps.read() if s["pid"] not in old_pids]

            out: dict[str, Any] = {"steps_reached_before_kill": max(s["step"] for s in before)}
            survivors = [a for a in self.agents if a is not node or self.fault == "worker_kill"]
            # When the survivors' agents start new workers: the failure's detection and
            # the new round's rendezvous, without the workers' own start-up (import
            # torch, init_process_group), which no rendezvous can shorten.
            old_tree = {p for a in survivors for p in _tree(a.pid)}

            def restarted() -> bool:
                if "workers_restarted_s" not in out and any(
                    p not in old_tree for a in survivors for p in _tree(a.pid)
                ):
                    out["workers_restarted_s"] = round(time.time() - killed_at, 3)
                return "workers_restarted_s" in out

            with contextlib.suppress(RuntimeError):
                _wait("the survivors' agents to start new workers", restarted, 120)
            try:
                _wait(
                    "every rank of the next round to step",
                    lambda: len({s["rank"] for s in new_round()}) >= world,
                    120,
                )
            except RuntimeError:
                out["restarted"] = False
                out["error"] = "no next round trained within 120 s of the kill"
                return out
            after = new_round()
            first = min(s["t"] for s in after)
            by_rank: dict[int, float] = {}
            for s in sorted(after, key=lambda s: s["t"]):
                by_rank.setdefault(s["rank"], round(s["t"] - killed_at, 3))
            out.update(
                {
                    "restarted": True,
                    "recovery_s": round(first - killed_at, 3),
                    "all_ranks_s": max(by_rank.values()),
                    "resumed_at_step": min(s["step"] for s in after) - 1,
                    "world_after": world,
                }
            )
            out.update(_survivors_exit([_exit_code(a, 180) for a in survivors]))
            return out
        finally:
            for a in self.agents:
                _kill_node(a.pid)
                a.wait(10)


def torchrun_side(args: argparse.Namespace, d: EmbeddedDaemon, work: Path) -> dict[str, Any]:
    """torchrun --max-restarts 3 on the same 3 x 2 and the same faults: with its c10d
    backend (as shipped, and with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which the
    anchors found it needs to restart at all) and with ours."""
    if importlib.util.find_spec("torch") is None:
        return {
            "skipped": "torch is not importable here: run with scripts/torch_venv.sh's "
            "python to measure torchrun side by side"
        }
    report: dict[str, Any] = {}
    for backend in filter(None, args.torchrun_backends.split(",")):
        for fault in filter(None, args.torchrun_faults.split(",")):
            runs = []
            for i in range(max(1, args.repeat)):
                port = _free_port()
                run = TorchrunRun(
                    work / f"torchrun-{backend}-{fault}-{i}", backend, fault, args, d, port
                )
                runs.append(run.run())
                print(
                    json.dumps({"torchrun": backend, "fault": fault, **runs[-1]}),
                    file=sys.stderr,
                    flush=True,
                )
            report[f"{backend}/{fault}"] = _torchrun_summary(runs)
    return report


def _exit_code(agent: subprocess.Popen[bytes], timeout: float) -> int | None:
    """The agent's exit status, or None if it is still running after ``timeout``
    (killed with the rest in ``run``'s cleanup)."""
    try:
        return agent.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def _survivors_exit(codes: list[int | None]) -> dict[str, Any]:
    """The survivors' agents' ends, judged: after a restart the job must still finish
    its ``--steps`` (torchrun exits 0). A round that trained again and then failed,
    or hung (None), is no recovery, however fast its first step came."""
    out: dict[str, Any] = {"exit_codes": codes, "survivors_exited_0": all(c == 0 for c in codes)}
    if not out["survivors_exited_0"]:
        out["error"] = (
            f"the survivors' torchrun agents ended with {codes} (None: still running after "
            "180 s), not 0: the restarted round did not finish its steps; see the agents' "
            "stderr in --keep's folder"
        )
    return out


def _torchrun_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One backend and fault's runs: how many restarted, how many of those then finished
    (every survivor's agent exited 0), and the median recovery of the finished ones
    only: a run whose restarted round failed is not a recovery to time."""
    restarted = [r for r in runs if r.get("restarted")]
    finished = [r for r in restarted if r.get("survivors_exited_0")]
    return {
        "restarted": f"{len(restarted)} of {len(runs)}",
        "finished": f"{len(finished)} of {len(runs)}",
        "recovery_s_median": (
            statistics.median([r["recovery_s"] for r in finished]) if finished else None
        ),
        "runs": runs,
    }


def _tree(agent: int) -> list[int]:
    """``agent`` and every process below it, from /proc."""
    pids, todo = [agent], [agent]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            with contextlib.suppress(OSError):
                kids = [int(c) for c in (task / "children").read_text().split()]
                pids += kids
                todo += kids
    return pids


def _kill_node(agent: int) -> None:
    """SIGKILL a torchrun agent and every process below it, as a machine's death would:
    torch starts each worker in a session of its own, so they outlive their agent."""
    for pid in _tree(agent):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def byte_compile() -> bool:
    """Compile the project's modules once, before anything is timed. An editable
    install leaves them uncompiled, and with ``PYTHONDONTWRITEBYTECODE`` set (as on
    the development machines) every process would compile them again (a spare's
    imports: ~150 ms more CPU, docs/benchmarks.md): the figures would then depend on
    the environment, not the code.
    Whether every module compiled."""
    return all(
        compileall.compile_dir(ROOT / part, quiet=1, workers=1)
        for part in ("rendezvousd", "client", "trainer")
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kill-step", type=int, default=20)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--json-out", default=None)
    p.add_argument(
        "--repeat", type=int, default=1, help="runs of each fault scenario (median reported)"
    )
    p.add_argument(
        "--scenarios",
        default="fault_free,worker_kill,node_kill_replaced,node_kill_standby,node_kill_shrink",
    )
    p.add_argument(
        "--busy", type=int, default=0, help="CPU-bound loops running through every scenario"
    )
    p.add_argument(
        "--daemon-flag",
        action="append",
        default=[],
        metavar="FLAG",
        help="pass FLAG to the daemon, e.g. --daemon-flag=--event-loop=uvloop (repeatable; "
        "its environment's RENDEZVOUSD_* settings do not reach it)",
    )
    p.add_argument(
        "--backend",
        choices=("cpu", "nccl"),
        default="cpu",
        help="the workers' communicator; nccl puts every rank on GPU 0 (a one-GPU check)",
    )
    p.add_argument("--keep", default=None, help="work in this folder and keep its logs")
    p.add_argument("--no-torchrun", action="store_true", help="rendezvous-run alone")
    p.add_argument("--torchrun-backends", default=",".join(TORCHRUN_BACKENDS), help="torchrun side")
    p.add_argument("--torchrun-faults", default=",".join(TORCHRUN_FAULTS), help="torchrun side")
    args = p.parse_args()
    report: dict[str, Any] = {
        "nodes": NODES,
        "workers_per_node": PER_NODE,
        "steps": args.steps,
        "kill_step": args.kill_step,
        "cpus": os.cpu_count(),
        "targets": TARGETS,
        "busy_loops": args.busy,
        "backend": args.backend,
        "daemon_flags": args.daemon_flag,
    }
    report["byte_compiled"] = byte_compile()
    with contextlib.ExitStack() as stack:
        # --keep: the runs' logs (daemon, launchers, steps, traces) stay for a post-mortem.
        tmp = args.keep or stack.enter_context(tempfile.TemporaryDirectory(prefix="recovery-"))
        Path(tmp).mkdir(parents=True, exist_ok=True)
        daemon_log = Path(tmp) / "daemon.log"
        with daemon_log.open("w") as log:
            # INFO: the transitions the milestones read (a few lines per generation).
            d = spawn(
                Path(tmp),
                "--log-level",
                "INFO",
                *args.daemon_flag,
                exit_with_parent=True,
                stderr=log.fileno(),
            )
        busy = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)
        ]
        try:
            for name in filter(None, args.scenarios.split(",")):
                runs = 1 if name == "fault_free" else max(1, args.repeat)
                results = [
                    scenario(d, daemon_log, Path(tmp) / str(i), name, args) for i in range(runs)
                ]
                report[name] = _summary(results)
            if not args.no_torchrun:
                report["torchrun"] = torchrun_side(args, d, Path(tmp))
        finally:
            for loop in busy:
                loop.kill()
            d.stop()
    base = report.get("fault_free", {})
    for name in ("worker_kill", "node_kill_replaced", "node_kill_standby", "node_kill_shrink"):
        if name in report and "final_loss" in base:
            r = report[name]
            each = r.get("runs", [r])
            r["final_loss_bit_identical"] = all(
                x.get("params_sha256") == base.get("params_sha256")
                and x.get("final_loss") == base.get("final_loss")
                for x in each
            )
            r["meets_targets"] = (
                r.get("recovery_s", 99) <= TARGETS["recovery_s_max"]
                and max(x.get("steps_lost", 99) for x in each) <= TARGETS["steps_lost_max"]
            )
    emit(report, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
