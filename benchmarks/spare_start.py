"""A warm spare's start-up CPU: a cold one (``_agent_boot``, a fresh interpreter)
against one the node's fork server forks (``_fork_server``), and the server's own.

    python benchmarks/spare_start.py --rounds 2 --spares 4

Each spare runs a probe that imports what a spare of the example imports
(``rendezvousd.trainer.example``) and reports its own CPU (``getrusage``: a forked
child counts only what it spends after the fork). Rounds alternate cold and forked;
a forked round's server is given time to finish its imports first, as when a
restart takes its spares from a server that is long ready. Prints one JSON document:
the median CPU per spare of each kind and every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rendezvousd.trainer.agent.worker_boot import Booted, ForkServer, boot

PROBE = """
import json, os, resource
import rendezvousd.trainer.example  # what a spare of the example imports
r = resource.getrusage(resource.RUSAGE_SELF)
with open(os.environ["PROBE_OUT"], "a") as fh:
    fh.write(json.dumps(r.ru_utime + r.ru_stime) + "\\n")
"""


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--spares", type=int, default=4)
    args = p.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cpu: dict[str, list[float]] = {"cold": [], "forked": [], "server": []}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "probe.py"
        script.write_text(PROBE)
        for _ in range(args.rounds):
            for kind in ("cold", "forked"):
                out = Path(tmp) / f"{kind}.out"
                out.unlink(missing_ok=True)
                server = ForkServer.start(env) if kind == "forked" else None
                if server is not None:
                    time.sleep(3.0)
                for slot in range(args.spares):
                    spare_env = {**env, "LOCAL_RANK": str(slot), "PROBE_OUT": str(out)}
                    started: Booted | None = None
                    if server is not None:
                        started = server.spawn(slot, [str(script)], spare_env)
                        assert started is not None, "the fork server took no spare"
                    else:
                        started = boot(slot, [str(script)], spare_env)
                    started.proc.wait(120)
                    started.sock.close()
                cpu[kind] += [float(line) for line in out.read_text().split()]
                if server is not None:
                    cpu["server"].append(_cpu_s(server.proc.pid))
                    server.close()
    report: dict[str, Any] = {
        "load_average": os.getloadavg(),
        "median_cpu_s": {k: round(statistics.median(v), 4) for k, v in cpu.items() if v},
        "cpu_s": {k: [round(x, 4) for x in v] for k, v in cpu.items()},
    }
    json.dump(report, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
