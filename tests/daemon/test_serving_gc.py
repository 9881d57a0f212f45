"""``rendezvousd serve`` runs the cyclic GC as a daemon needs it (``daemon.serving_gc``):
start-up frozen, collections rarer; cyclic garbage is still collected."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from rendezvousd.daemon import GC_YOUNG_THRESHOLD
from tests.support import write_token

# Run in a process of its own (the GC is process-wide): serve until the "serving on"
# line, then stdin's end (--exit-with-parent) stops the daemon, and at exit the
# process says how its GC was left.
_SERVE = """
import atexit, gc, sys
atexit.register(lambda: print("gc", *gc.get_threshold(), gc.get_freeze_count(), flush=True))
from rendezvousd.cli.serve import main
sys.exit(main(["serve", "--listen", "127.0.0.1:0", "--token-file", sys.argv[1],
               "--exit-with-parent", "--drain-grace-s", "1"]))
"""


def test_serve_freezes_start_up_and_raises_the_young_threshold(tmp_path: Path) -> None:
    token = tmp_path / "token"
    write_token(token)
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVE, str(token)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        first = proc.stdout.readline()
        assert first.startswith("rendezvousd: serving on"), first
        out, err = proc.communicate(input="", timeout=30)  # stdin's end: it stops
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    threshold0, threshold1, threshold2, frozen = map(int, out.split("gc", 1)[1].split())
    assert (threshold0, threshold1, threshold2) == (GC_YOUNG_THRESHOLD, 10, 10)
    # Start-up's objects (modules, classes, the server): tens of thousands.
    assert frozen > 10_000


_AFTER = """
import gc, weakref
from rendezvousd.daemon import serving_gc
serving_gc()

class Cycle:
    pass

first = Cycle()
first.other = Cycle()
first.other.other = first
alive = weakref.ref(first)
del first
gc.collect()
print(alive() is None)
"""


def test_cyclic_garbage_made_after_start_up_is_still_collected() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _AFTER], capture_output=True, text=True, timeout=30, check=True
    )
    assert done.stdout.strip() == "True", done.stderr
