"""protocol.md, ReportFailure: a worker relaying a failure it heard of from another
rank sends that rank as ``witness_rank``, and the witness's own report, coming within
a second, is recorded as the generation's first loss; a report without one (an older
SDK) keeps the order the daemon recorded, whatever its cause says."""

from __future__ import annotations

from collections.abc import Callable

from rendezvousd.client import RendezvousClient
from tests.support import DaemonProcess

#: Rank 1 relays the break of a link it did not see: rank 2 saw it.
RELAYED = "PeerConnectionError: rank 1: lost rank 0 (reported by rank 2): reset"
SEEN = "PeerConnectionError: rank 2: lost rank 0: its host answered nothing for 10 s"


def _losses(d: DaemonProcess, job_id: str, *, witness_rank: int | None) -> list[int]:
    with RendezvousClient(d.endpoint, job_id, token=d.token) as agent:
        agent.join_node(min_nodes=1, max_nodes=1, gpus_per_node=3, timeout=20)
        if witness_rank is None:  # as an older SDK, which has no such keyword
            agent.report_failure(1, RELAYED, timeout=10)
        else:
            agent.report_failure(1, RELAYED, timeout=10, witness_rank=witness_rank)
        agent.report_failure(2, SEEN, timeout=10)
        return [f.rank for f in agent.get_job().failed]


def test_the_witness_named_as_data_is_the_root_cause_of_record(
    start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    assert _losses(start_daemon(), job_id, witness_rank=2) == [2, 1]


def test_a_report_without_a_witness_keeps_its_order_though_its_words_name_one(
    start_daemon: Callable[..., DaemonProcess], job_id: str
) -> None:
    assert _losses(start_daemon(), job_id, witness_rank=None) == [1, 2]
