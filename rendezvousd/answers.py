"""Join's and JoinNode's answers on the wire, with the member table encoded once per
generation: it is the same for every rank, and at thousands of ranks encoding it per
answer would cost more than the whole rendezvous."""

from __future__ import annotations

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.limits import Timing
from rendezvousd.model import JoinResult, MemberInfo, NodeJoinResult


class JoinAnswers:
    def __init__(self, timing: Timing) -> None:
        self.timing = timing
        # (job, generation, answer message) -> the table and its encoding: Join's and
        # JoinNode's answers carry it in different fields.
        self._tables: dict[tuple[str, int, str], tuple[tuple[MemberInfo, ...], bytes]] = {}

    def forget(self, job_id: str, generation: int) -> None:
        """The generation stopped running: its tables are not needed any more."""
        for message in ("join", "node"):
            self._tables.pop((job_id, generation, message), None)

    def join(self, result: JoinResult) -> bytes:
        header = pb.JoinResponse(
            job_id=result.job_id,
            generation=result.generation,
            rank=result.rank,
            world_size=result.world_size,
            node_rank=result.node_rank,
            local_rank=result.local_rank,
            id_required=result.id_required,
            unique_id=result.unique_id,
            heartbeat_timeout_ms=int(self.timing.heartbeat_timeout_s * 1000),
        ).SerializeToString()
        return header + self._table(result.job_id, result.generation, "join", result.members)

    def _table(
        self, job_id: str, generation: int, message: str, members: tuple[MemberInfo, ...]
    ) -> bytes:
        """The member table encoded as ``message``'s repeated field, cached per generation."""
        if not members:
            return b""
        key = (job_id, generation, message)
        cached = self._tables.get(key)
        if cached is None or cached[0] is not members:
            encoded = [
                pb.Member(
                    rank=m.rank,
                    node_rank=m.node_rank,
                    local_rank=m.local_rank,
                    host=m.host,
                    address=m.address,
                )
                for m in members
            ]
            table = (
                pb.JoinResponse(members=encoded)
                if message == "join"
                else pb.JoinNodeResponse(members=encoded)
            ).SerializeToString()
            cached = (members, table)
            self._tables[key] = cached
        # Concatenated protobuf encodings merge, and repeated fields append.
        return cached[1]

    def join_node(self, result: NodeJoinResult) -> bytes:
        header = pb.JoinNodeResponse(
            job_id=result.job_id,
            generation=result.generation,
            node_rank=result.node_rank,
            num_nodes=result.num_nodes,
            gpus_per_node=result.gpus_per_node,
            world_size=result.num_nodes * result.gpus_per_node,
            id_required=result.id_required,
            unique_id=result.unique_id,
            member_instance_ids=result.member_instance_ids,
            heartbeat_timeout_ms=int(self.timing.heartbeat_timeout_s * 1000),
        ).SerializeToString()
        return header + self._table(result.job_id, result.generation, "node", result.members)
