"""A daemon that comes back under its name at a new address (a rescheduled pod behind a
headless Service, DNS failover): a client's channel looked the name up again at most
every 30 s (gRPC's default), so it dialled the dead address past the 10 s heartbeat
window and every job lost its running generation (h170, on namespace hosts). The client
runs in a mount namespace of its own whose /etc/hosts points the name at 127.0.0.2, then,
rewritten in place, at 127.0.0.3 (the native resolver reads the file on each lookup)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support import free_port, spawn_daemon, with_own_mounts, write_token

NAME = "rdzv-moved.test"

CLIENT = """
import json, sys, time
from rendezvousd.client import RendezvousClient
from rendezvousd.client.errors import RendezvousError

endpoint, job, token = sys.argv[1:4]
c = RendezvousClient(endpoint, job, token=token, call_timeout=2.0)
c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
c.start_heartbeat(0.5)
print(json.dumps({"joined": True}), flush=True)
sys.stdin.readline()  # the daemon has moved
moved = time.monotonic()
while True:
    try:
        job_seen = c.get_job()
        break
    except RendezvousError:
        if time.monotonic() - moved > 40:
            raise
took = time.monotonic() - moved
failure = c.failure
print(json.dumps({"took": took, "failure": None if failure is None else str(failure),
                  "generation": job_seen.summary.generation}), flush=True)
"""


def test_a_client_follows_its_daemons_name_to_a_new_address(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.2 {NAME}\n")
    port, token_file = free_port(), tmp_path / "tok"
    token = write_token(token_file)
    state = ("--state-dir", str(tmp_path / "state"))
    old = spawn_daemon(tmp_path / "old", *state, token=token, listen=f"127.0.0.2:{port}")
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    cmd = [sys.executable, str(script), f"{NAME}:{port}", "moved", token]
    client = subprocess.Popen(
        with_own_mounts(f"mount --bind {hosts} /etc/hosts", cmd),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    new = None
    try:
        assert client.stdout is not None and client.stdin is not None
        assert json.loads(client.stdout.readline()) == {"joined": True}, client.stderr
        old.proc.kill()
        old.proc.wait(10)
        new = spawn_daemon(tmp_path / "new", *state, token=token, listen=f"127.0.0.3:{port}")
        # In place (the bind mount holds the file's inode), as a DNS answer changes.
        with hosts.open("r+") as f:
            f.write(f"127.0.0.3 {NAME}\n")
        client.stdin.write("moved\n")
        client.stdin.flush()
        out, err = client.communicate(timeout=60)
    finally:
        for d in (old, new):
            if d is not None and d.proc.poll() is None:
                d.proc.kill()
                d.proc.wait(10)
        if client.poll() is None:
            client.kill()
            client.wait(10)
    assert client.returncode == 0, err
    seen = json.loads(out.splitlines()[-1])
    # Within the daemon's heartbeat timeout (10 s), with room: the job goes on.
    assert seen["took"] < 5, (seen, err)
    assert seen["failure"] is None and seen["generation"] == 1, (seen, err)
