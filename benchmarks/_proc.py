"""What the benchmarks read of a process from /proc: its CPU seconds and its memory."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far."""
    # After the command's closing parenthesis: state is field 3, utime 14, stime 15.
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def status_kib(pid: int, name: str = "VmRSS") -> int:
    """A KiB field of ``/proc/PID/status``: ``VmRSS`` (resident now), ``VmHWM`` (peak)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {name} in /proc/{pid}/status")
