"""Two ranks of a CPU ring in a network namespace of their own (run under
``unshare --net``): rank 0's right neighbour, rank 1, is dialled at 198.18.118.2,
which has no route yet (argv[1] ``unreachable``: an unreachable route, EHOSTUNREACH;
``none``: no route at all, ENETUNREACH). With argv[2] ``heals`` the route appears
1.5 s on (the address added to this namespace's loopback) and the ring must form;
with ``never`` it does not, and the setup ends at its 2 s deadline. Prints one JSON
line: what happened, and the warnings the ring logged."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time

from rendezvousd.trainer.comm import ring_wire

PEER = "198.18.118.2"
SECRET = bytes(range(128))
route, ending = sys.argv[1], sys.argv[2]

subprocess.run(["ip", "link", "set", "lo", "up"], check=True, timeout=10)
if route == "unreachable":
    subprocess.run(["ip", "route", "add", "unreachable", f"{PEER}/32"], check=True, timeout=10)


class Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


said = Said()
logging.getLogger("rendezvousd.trainer").addHandler(said)


def heal() -> None:
    time.sleep(1.5)
    if route == "unreachable":
        subprocess.run(["ip", "route", "del", "unreachable", f"{PEER}/32"], check=True, timeout=10)
    subprocess.run(["ip", "addr", "add", f"{PEER}/32", "dev", "lo"], check=True, timeout=10)


left0 = ring_wire.create_listener("127.0.0.1")
# Every address: 198.18.118.2 exists only once the route heals.
left1 = ring_wire.create_listener("0.0.0.0")
addresses = {0: ("127.0.0.1", left0.getsockname()[1]), 1: (PEER, left1.getsockname()[1])}
timeout = 20.0 if ending == "heals" else 2.0
other: list[object] = []


def rank1() -> None:
    try:
        other.append(ring_wire.establish_ring(left1, addresses, SECRET, 1, 2, timeout))
    except Exception as exc:  # rank 0's failure ends rank 1's accept too
        other.append(exc)


threads = [threading.Thread(target=rank1, daemon=True)]
if ending == "heals":
    threads.append(threading.Thread(target=heal, daemon=True))
for thread in threads:
    thread.start()
started = time.monotonic()
try:
    left, right = ring_wire.establish_ring(left0, addresses, SECRET, 0, 2, timeout)
except Exception as exc:
    outcome = {"error": f"{type(exc).__name__}: {exc}"}
else:
    outcome = {"formed_after_s": time.monotonic() - started}
    left.close()
    right.close()
for thread in threads:
    thread.join(timeout + 5)
print(json.dumps({**outcome, "port": addresses[1][1], "warnings": said.lines}), flush=True)
