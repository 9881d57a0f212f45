"""protocol.md: a PEER_FAILED error carries, after its ErrorInfo, "one
`rendezvous.v1.FailedMember` ... per loss, for the first 8, each cause cut to 120 bytes
to keep the trailer small", while GetJob carries every loss with its whole cause. The
numbers are the documented ones, written out."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from rendezvousd.client import PeerFailed, RendezvousClient
from tests.support import DaemonProcess

LOSSES = 12
DETAILED = 8  # "for the first 8"
CAUSE_BYTES = 120  # "each cause cut to 120 bytes"


def _cause(i: int) -> str:
    """A 32 KiB cause (the most the daemon keeps whole), told apart by its head."""
    head = f"worker {i:02d} failed: "
    return head + "x" * (32 * 1024 - len(head))


def test_a_peer_failed_error_details_the_first_8_losses_cut_and_get_job_keeps_all_whole(
    start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    d = start_daemon()
    with RendezvousClient(d.endpoint, job_id, token=d.token) as agent:
        node = agent.join_node(min_nodes=1, max_nodes=1, gpus_per_node=LOSSES + 1, timeout=20)
        for i in range(LOSSES):  # local rank 12 survives, and asks
            agent.report_failure(i, _cause(i), timeout=10)
        # Both transports: a call on the call stream (its status in the Reply) and a
        # unary call (its status in the trailer).
        for call_stream in (True, False):
            with RendezvousClient(
                d.endpoint, job_id, token=d.token, call_stream=call_stream
            ) as survivor:
                survivor.attach(node.membership_for(LOSSES), node.member_instance_id(LOSSES))
                with pytest.raises(PeerFailed) as told:
                    survivor.barrier("b", timeout=10)
            error = told.value
            assert error.ranks == list(range(LOSSES)), (call_stream, error.ranks)
            assert [f.rank for f in error.failed] == list(range(DETAILED)), call_stream
            for i, f in enumerate(error.failed):
                assert f.cause == _cause(i)[:CAUSE_BYTES], (call_stream, i, f.cause)
        job = agent.get_job()
    assert [f.rank for f in job.failed] == list(range(LOSSES))
    assert [f.cause for f in job.failed] == [_cause(i) for i in range(LOSSES)]
