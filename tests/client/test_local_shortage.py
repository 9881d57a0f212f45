"""A connect that fails for want of this host's own resources (descriptors, local
ports) is named with its fix and said at once: it was "a connect fails: Too many open
files. Check that it runs and listens there", after the whole connect_timeout, and a
node agent then retried it for its join's timeout (an operator review)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support import DaemonProcess, launcher_cmd, write_token

# Joins after this process has used up its open-file limit (its channel made first).
_OUT_OF_FILES = textwrap.dedent(
    """
    import os, sys
    from rendezvousd.client import RendezvousClient, RendezvousError
    c = RendezvousClient(
        sys.argv[1], "no-files", token=os.environ["TEST_TOKEN"], connect_timeout=60
    )
    held = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    try:
        c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=60)
    except RendezvousError as exc:
        print(type(exc).__name__, exc, dict(exc.metadata))
    else:
        print("joined")
    """
)


def test_a_process_out_of_open_files_is_told_to_raise_its_limit_not_to_check_the_daemon(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon()
    done = subprocess.run(
        ["prlimit", "--nofile=64:64", sys.executable, "-c", _OUT_OF_FILES, d.endpoint],
        env={**os.environ, "TEST_TOKEN": d.token},
        capture_output=True,
        text=True,
        timeout=50,  # under connect_timeout: a client that waits it out fails here
        check=False,
    )
    said = done.stdout
    assert said.startswith("DaemonUnavailable"), (said, done.stderr)
    assert "this process ran out of open files (this process's open-file limit is 64)" in said
    assert "raise this process's open-file limit (ulimit -n" in said
    assert "Check that it runs" not in said
    assert "'local_shortage': 'open_files'" in said
    assert d.token not in said + done.stderr


# In a network namespace of its own whose ephemeral port range is two ports: a daemon,
# then plain connections to it until no local port is left, then the command after.
_NO_PORTS = textwrap.dedent(
    """
    import re, socket, subprocess, sys
    from pathlib import Path
    from rendezvousd.cli.embedded import serve_command
    token = Path(sys.argv[1])
    d = subprocess.Popen(
        serve_command("127.0.0.1:0", token), stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True,
    )
    try:
        endpoint = re.search(r"serving on (\\S+)", d.stdout.readline()).group(1)
        host, port = endpoint.rsplit(":", 1)
        held = []
        try:
            while len(held) < 100:
                held.append(socket.create_connection((host, int(port)), timeout=5))
        except OSError:
            pass
        args = [a.replace("ENDPOINT", endpoint) for a in sys.argv[2:]]
        done = subprocess.run(args, capture_output=True, text=True, timeout=50)
        print(done.returncode)
        print(done.stdout + done.stderr)
    finally:
        d.kill()
        d.wait(10)
    """
)

_JOIN = textwrap.dedent(
    """
    import os, sys
    from rendezvousd.client import RendezvousClient, RendezvousError
    c = RendezvousClient(sys.argv[1], "no-ports", token_file=sys.argv[2], connect_timeout=60)
    try:
        c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=60)
    except RendezvousError as exc:
        print(type(exc).__name__, exc, dict(exc.metadata))
    else:
        print("joined")
    """
)


def _without_local_ports(token: Path, *argv: str) -> tuple[int, str]:
    """``argv`` (ENDPOINT: the daemon's) run on a host with no local port left."""
    setup = "ip link set lo up && echo '40000 40001' > /proc/sys/net/ipv4/ip_local_port_range"
    cmd = ["unshare", "--net", "sh", "-c", f'{setup} && exec "$@"', "sh"]
    if subprocess.run([*cmd, "true"], capture_output=True, check=False).returncode != 0:
        pytest.skip("no network namespace of its own here (unshare --net needs root)")
    done = subprocess.run(
        [*cmd, sys.executable, "-c", _NO_PORTS, str(token), *argv],
        capture_output=True,
        text=True,
        timeout=55,  # under connect_timeout and the join's: waiting either out fails here
        check=False,
    )
    assert done.returncode == 0, done.stderr
    code, _, said = done.stdout.partition("\n")
    return int(code), said


def test_a_host_out_of_local_ports_is_named_and_not_waited_out(tmp_path: Path) -> None:
    token = tmp_path / "token"
    write_token(token)
    _, said = _without_local_ports(token, sys.executable, "-c", _JOIN, "ENDPOINT", str(token))
    assert said.startswith("DaemonUnavailable"), said
    assert "this host ran out of local ports for new connections; widen " in said
    assert "net.ipv4.ip_local_port_range" in said
    assert "Check that it runs" not in said
    assert "'local_shortage': 'local_ports'" in said


def test_a_node_agent_out_of_local_ports_stops_at_once_instead_of_retrying(
    tmp_path: Path,
) -> None:
    """rendezvous-run said "trying again every 1 s for up to 20 s" and retried the
    join for its whole timeout, though no daemon coming up could help."""
    token = tmp_path / "token"
    write_token(token)
    script = tmp_path / "train.py"
    script.write_text(
        "from rendezvousd.trainer.distributed import init_distributed\n"
        "with init_distributed():\n"
        "    print('trained')\n"
    )
    agent = launcher_cmd(1, 0, 1, endpoint="ENDPOINT", token_file=token, job="no-ports-agent")
    code, said = _without_local_ports(
        token, *agent, "--connect-timeout-s", "60", "--join-timeout-s", "120", str(script)
    )
    assert code != 0, said
    assert "this host ran out of local ports" in said, said
    assert "trying again every" not in said, said
    assert "trained" not in said
