"""Join answers whose size does not grow with the world: the slim flag, the table
digest, GetMembers pages, and the SDK's lazy, digest-checked ``Membership.members``."""

from __future__ import annotations

import grpc
import pytest

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2_grpc as pb_grpc
from rendezvousd.client import DuplicateRank, NotFound, ProtocolError, RendezvousClient
from rendezvousd.client.membership import LazyTable
from rendezvousd.common import member_table
from tests.daemon.raw_calls import join_request
from tests.support import DaemonProcess, parallel

ID = b"\x05" * 128


def _raw_join(stub: pb_grpc.RendezvousStub, token: str, job: str, local: int, slim: bool) -> bytes:
    request = join_request(
        job,
        3,
        local,
        host="h",
        address=f"10.0.0.1:{5000 + local}",
        unique_id=ID if local == 0 else b"",
        instance_id=f"inst-{local}",
        slim=slim,
    )
    response = stub.Join(request, timeout=20, metadata=(("authorization", f"Bearer {token}"),))
    return bytes(response.SerializeToString())


def test_old_sdks_get_the_table_and_slim_sdks_only_its_digest(
    daemon: DaemonProcess, job_id: str
) -> None:
    with grpc.insecure_channel(daemon.endpoint) as ch:
        stub = pb_grpc.RendezvousStub(ch)
        answers = parallel(
            [lambda i=i: _raw_join(stub, daemon.token, job_id, i, i != 1) for i in range(3)]  # type: ignore[misc]
        )
        full, slim = pb.JoinResponse.FromString(answers[1]), pb.JoinResponse.FromString(answers[2])
        assert [m.rank for m in full.members] == [0, 1, 2] and not slim.members
        assert full.table_digest == slim.table_digest == member_table.digest(full.members)
        assert len(answers[2]) < len(answers[1])
        meta = (("authorization", f"Bearer {daemon.token}"),)
        page = stub.GetMembers(
            pb.GetMembersRequest(
                job_id=job_id, generation=1, rank=2, instance_id="inst-2", start_rank=1
            ),
            timeout=10,
            metadata=meta,
        )
        assert [m.rank for m in page.members] == [1, 2] and page.world_size == 3
        assert page.members[0].address == "10.0.0.1:5001"
        assert page.table_digest == full.table_digest
        one = stub.GetMembers(
            pb.GetMembersRequest(
                job_id=job_id, generation=1, rank=2, instance_id="inst-2", max_members=1
            ),
            timeout=10,
            metadata=meta,
        )
        assert [m.rank for m in one.members] == [0]
        with pytest.raises(grpc.RpcError) as info:  # the token alone is not membership
            stub.GetMembers(
                pb.GetMembersRequest(job_id=job_id, generation=1, rank=2, instance_id="x"),
                timeout=10,
                metadata=meta,
            )
        assert info.value.code() is grpc.StatusCode.ALREADY_EXISTS


def test_sdk_fetches_the_table_lazily_and_checks_its_digest(
    daemon: DaemonProcess, job_id: str
) -> None:
    clients = [RendezvousClient(daemon.endpoint, job_id, token=daemon.token) for _ in range(4)]
    try:
        ms = parallel(
            [
                lambda c=c, i=i: c.join(  # type: ignore[misc]
                    num_nodes=2, gpus_per_node=2, local_rank=i % 2, node_rank=i // 2, timeout=20
                )
                for i, c in enumerate(clients)
            ]
        )
        m = ms[3]
        assert isinstance(m._table, LazyTable) and not m._table.loaded
        assert [x.rank for x in m.members] == [0, 1, 2, 3]
        assert m._table.loaded and m.num_nodes == 2
    finally:
        for c in clients:
            c.close()
    # a closed client still reads its (slim) table, as before slim answers existed
    assert [x.rank for x in ms[0].members] == [0, 1, 2, 3]


def test_a_table_that_does_not_match_the_digest_is_refused() -> None:
    real = [pb.Member(rank=r, host=f"h{r}") for r in range(3)]
    forged = [pb.Member(rank=r, host="evil") for r in range(3)]
    digest = member_table.digest(real)

    def pages(members: list[pb.Member]) -> LazyTable:
        return LazyTable(
            lambda start: pb.GetMembersResponse(
                members=members[start : start + 2], world_size=3, table_digest=digest
            ),
            3,
            digest,
        )

    assert [m.host for m in pages(real).load()] == ["h0", "h1", "h2"]
    with pytest.raises(ProtocolError, match="does not match the digest"):
        pages(forged).load()


def test_get_members_is_refused_before_the_generation_forms(
    daemon: DaemonProcess, job_id: str
) -> None:
    with RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as c:
        with pytest.raises(NotFound):
            c._call("GetMembers", pb.GetMembersRequest(job_id=job_id, generation=1))
        ms = c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        request = pb.GetMembersRequest(
            job_id=job_id, generation=ms.generation, rank=0, instance_id="other"
        )
        with pytest.raises(DuplicateRank):
            c._call("GetMembers", request)
