"""A join's answer (Join's, JoinNode's) and GetMembers' on the wire.

The member table is the same for every rank of a generation, so everything made
from it (its messages, its digest, its encoding as Join's or JoinNode's repeated
field) is made once per generation and reused. A slim answer (what current SDKs ask
for) carries only the digest: its size, and the daemon's work for it, do not grow
with the world; the table is served on demand by GetMembers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.common import member_table
from rendezvousd.common.escape import cut_middle
from rendezvousd.common.limits import Timing
from rendezvousd.common.model import FailedInfo, JoinResult, MemberInfo


@dataclass
class _Table:
    members: tuple[MemberInfo, ...]
    messages: list[pb.Member] = field(default_factory=list)
    digest: bytes = b""
    # Answer message type name -> the table as that message's repeated field.
    encoded: dict[str, bytes] = field(default_factory=dict)


class JoinAnswers:
    def __init__(self, timing: Timing) -> None:
        self.timing = timing
        self._tables: dict[tuple[str, int], _Table] = {}

    def forget(self, job_id: str, generation: int) -> None:
        """The generation stopped running: its table is not needed any more."""
        self._tables.pop((job_id, generation), None)

    def _table(
        self, job_id: str, generation: int, members: tuple[MemberInfo, ...], keep: bool = True
    ) -> _Table:
        key = (job_id, generation)
        table = self._tables.get(key)
        if table is None or table.members is not members:
            table = _Table(members)
            table.messages = [member_message(m) for m in members]
            table.digest = member_table.digest(table.messages)
            if keep:
                self._tables[key] = table
        return table

    def join(self, result: JoinResult, *, slim: bool = False) -> bytes:
        """A join's answer in its joiner's shape: a worker's (Join, PublishId) as a
        JoinResponse, a node agent's as a JoinNodeResponse; both say the seat's world."""
        header = (pb.JoinNodeResponse if result.local_rank is None else pb.JoinResponse)(
            job_id=result.job_id,
            generation=result.generation,
            node_rank=result.node_rank,
            world_size=result.world_size,
            id_required=result.id_required,
            unique_id=result.unique_id,
            heartbeat_timeout_ms=int(self.timing.heartbeat_timeout_s * 1000),
        )
        if isinstance(header, pb.JoinNodeResponse):
            header.num_nodes, header.gpus_per_node = result.num_nodes, result.gpus_per_node
            header.member_instance_ids.extend(result.member_instance_ids)
        else:
            header.rank, header.local_rank = result.rank, result.local_rank or 0
        if not result.members:
            return header.SerializeToString()
        # The header with the table's digest and, unless ``slim``, the table: concatenated
        # protobuf encodings merge and repeated fields append, so the table's encoding as
        # the header's repeated field is made once and appended to each answer's header.
        table = self._table(header.job_id, header.generation, result.members)
        header.table_digest = table.digest
        if slim:
            return header.SerializeToString()
        kind = type(header).__name__
        encoded = table.encoded.get(kind)
        if encoded is None:
            encoded = type(header)(members=table.messages).SerializeToString()
            table.encoded[kind] = encoded
        return header.SerializeToString() + encoded

    def members(
        self,
        job_id: str,
        generation: int,
        members: tuple[MemberInfo, ...],
        start: int,
        count: int,
        *,
        keep: bool = True,
    ) -> pb.GetMembersResponse:
        """One page of the table: ranks ``start`` .. ``start + count - 1`` (clipped)."""
        table = self._table(job_id, generation, members, keep)
        count = min(count or member_table.PAGE_MAX, member_table.PAGE_MAX)
        return pb.GetMembersResponse(
            members=table.messages[start : start + count],
            world_size=len(members),
            table_digest=table.digest,
        )


def member_message(m: MemberInfo) -> pb.Member:
    return pb.Member(
        rank=m.rank, node_rank=m.node_rank, local_rank=m.local_rank, host=m.host, address=m.address
    )


def failed_member(f: FailedInfo, now: float, cause_bytes: int | None = None) -> pb.FailedMember:
    """``f`` on the wire; ``cause_bytes``: its cause cut to that many bytes, its middle
    left out (an error's trailer is small), else whole."""
    cause = f.cause if cause_bytes is None else cut_middle(f.cause, cause_bytes)
    return pb.FailedMember(
        rank=f.rank,
        host=f.host,
        cause=cause,
        node_rank=f.node_rank or 0,
        local_rank=f.local_rank or 0,
        # At least 1 when known: 0 is "unknown" (a loss from before a restart), and a
        # loss pushed within its millisecond read as unknown to the rank told at once
        # while a later caller got its time.
        age_ms=max(1, int((now - f.lost_at) * 1000)) if f.lost_at is not None else 0,
    )
