"""The SDK's deadlines go by the monotonic clock: a wall clock stepped back (NTP, a
host that booted without it) while a client waits for its daemon does not lengthen
the wait."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.support import free_port

# The client module's wall clock steps back an hour a second into the wait. Only the
# module's own view of it is stepped (gRPC core's clock is not), which is what its
# arithmetic sees; the wait ran in a child so that a wait that never ends fails the
# test at the child's deadline instead of hanging it.
_WAIT = textwrap.dedent(
    """
    import sys, time, types
    from rendezvousd.client import DaemonUnavailable, RendezvousClient
    from rendezvousd.client import sync

    start, real = time.monotonic(), time.time

    def stepped() -> float:
        return real() - (3600.0 if time.monotonic() - start > 1.0 else 0.0)

    sync.time = types.SimpleNamespace(monotonic=time.monotonic, sleep=time.sleep, time=stepped)
    try:
        with RendezvousClient(sys.argv[1], "j", token="t" * 32, connect_timeout=3) as c:
            c.join(num_nodes=1, gpus_per_node=1, node_rank=0, local_rank=0, timeout=3)
    except DaemonUnavailable as exc:
        print("unavailable:", exc)
    """
)


def test_a_wall_clock_stepped_back_does_not_lengthen_the_wait_for_a_daemon() -> None:
    """The wait's deadline was wall-clock: stepped back an hour, a client whose daemon
    was not up waited an hour more than its connect_timeout (killed at 40 s, still in
    ``_ready_within``)."""
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    try:
        done = subprocess.run(
            [sys.executable, "-c", _WAIT, endpoint], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the wait outlived its connect_timeout by far: {exc}") from None
    assert done.returncode == 0, done.stdout + done.stderr
    assert "unavailable:" in done.stdout, done.stdout + done.stderr
