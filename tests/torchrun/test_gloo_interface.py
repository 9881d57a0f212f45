"""docs/trainer.md: the handler points gloo at the interface that holds the address the
agent advertises (its workers' MASTER_ADDR), "unless you set GLOO_SOCKET_IFNAME"; gloo
otherwise resolves the hostname, which on many hosts is 127.0.0.1 or nothing, and its
full mesh then fails across hosts. Run in the torch venv: the handler imports torch."""

from __future__ import annotations

import json
import subprocess

_CASES = """
import json
from rendezvousd.trainer.torchrun.handler import point_gloo_at

out = {}
for name, address, env in [
    ("loopback", "127.0.0.1", {}),
    ("chosen", "127.0.0.1", {"GLOO_SOCKET_IFNAME": "eth9"}),
    ("not here", "192.0.2.77", {}),
]:
    out[name] = [point_gloo_at(address, env), env]
print(json.dumps(out))
"""


def test_gloo_is_pointed_at_the_advertised_interface_unless_the_user_chose_one(
    torch_python: str,
) -> None:
    done = subprocess.run(
        [torch_python, "-c", _CASES], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["loopback"] == ["lo", {"GLOO_SOCKET_IFNAME": "lo"}], out
    assert out["chosen"] == [None, {"GLOO_SOCKET_IFNAME": "eth9"}], out
    assert out["not here"] == [None, {}], out
