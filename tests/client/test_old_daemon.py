"""A daemon older than the method an SDK calls answers UNIMPLEMENTED ("Method not
found!"): the SDK's one error seam says so, and what to do (upgrade the daemon first),
as a VersionMismatch no retry changes; it read "failed with UNIMPLEMENTED: Method not
found!" as a ProtocolError, which a node agent took for a transient failure."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from google.rpc import status_pb2

from rendezvousd.client import ProtocolError, RendezvousClient, VersionMismatch
from rendezvousd.client._multiplex import status_error
from rendezvousd.client.errors import from_rpc_error
from rendezvousd.common.version import installed_version
from tests.support import DaemonProcess, daemon_without_rendezvous, write_token


def test_unimplemented_is_a_daemon_older_than_the_method() -> None:
    exc = status_error(status_pb2.Status(code=12, message="Method not found!").SerializeToString())
    assert exc.code() is grpc.StatusCode.UNIMPLEMENTED
    error = from_rpc_error(exc, endpoint="e:1", method="JoinNode", job_id="j")
    assert isinstance(error, VersionMismatch) and isinstance(error, ProtocolError)
    assert (error.code, error.reason) == ("UNIMPLEMENTED", "")
    assert str(error).startswith("JoinNode on rendezvousd at e:1 (job 'j'): the daemon at e:1 ")
    assert "predates JoinNode (an older rendezvousd" in str(error)
    assert "'Method not found!'" in str(error)
    assert "upgrade the daemon first" in str(error)
    # Its version unknown (it said none), this client's own named beside it.
    this = installed_version()
    said = "[daemon: rendezvousd unknown (a rendezvousd from before it said its version, "
    assert said in str(error) and f"this client: rendezvousd {this}]" in str(error), error
    assert error.daemon_version == ""


def test_a_version_mismatch_names_the_daemons_version(
    start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    """The daemon's answers say which rendezvousd it runs (ErrorInfo ``daemon_version``):
    a VersionMismatch named both nodes' wire versions, never the daemon's."""
    d = start_daemon()
    this = installed_version()
    with (
        RendezvousClient(d.endpoint, job_id, token=d.token) as first,
        RendezvousClient(d.endpoint, job_id, token=d.token) as other,
    ):
        first.join_node(min_nodes=1, max_nodes=1, gpus_per_node=1, timeout=20, wire_version="A")
        with pytest.raises(VersionMismatch) as info:
            other.join_node(min_nodes=1, max_nodes=1, gpus_per_node=1, timeout=20, wire_version="B")
    error = info.value
    assert error.daemon_version == this
    assert f"[daemon: rendezvousd {this}; this client: rendezvousd {this}]" in str(error), error


def test_join_node_against_a_daemon_without_it_says_to_upgrade_the_daemon(
    tmp_path: Path,
) -> None:
    token = tmp_path / "token"
    write_token(token)
    with (
        daemon_without_rendezvous() as endpoint,
        RendezvousClient(endpoint, "j", token_file=token) as client,
    ):
        started = time.monotonic()
        with pytest.raises(VersionMismatch) as info:
            client.join_node(min_nodes=1, max_nodes=1, gpus_per_node=1, timeout=30)
        error = info.value
    assert time.monotonic() - started < 10  # no retries: it cannot change
    assert f"the daemon at {endpoint} predates JoinNode" in str(error), error
    assert "upgrade the daemon first" in str(error)
