"""Node joins in the state machine: node agents join once for all their local ranks,
heartbeat once per node, report their workers' failures, and re-join elastically.

A generation is joined either per rank (``RendezvousState.join``) or per node (here),
never both. Forming: the generation forms when max_nodes nodes joined, or when at
least min_nodes joined and ``last_call`` passed since the last arrival (checked on
each arrival and each tick), once node 0's id is known. While it runs with fewer
than max_nodes nodes, another node parks for the next generation and the running
nodes hear NODES_WAITING; when the generation ends the parked node is placed in
the next one. Pure, like the rest of the state machine.
"""

from __future__ import annotations

from rendezvousd import nodes, placement, validation, waits
from rendezvousd.errors import Reason, RendezvousFault
from rendezvousd.escape import bounded
from rendezvousd.job import Job, Node
from rendezvousd.model import (
    EventKind,
    FailedInfo,
    JobState,
    JoinMode,
    MemberState,
    NodeJoinResult,
    Parked,
)
from rendezvousd.nodes import NodeJoinArgs
from rendezvousd.state_core import TERMINAL, StateCore

#: The least time between two NODES_WAITING events of one job (the first is at once).
NODES_WAITING_INTERVAL_S = 0.5


class NodeJoins(StateCore):
    # -- joining ------------------------------------------------------------

    def join_node(self, args: NodeJoinArgs, now: float) -> NodeJoinResult | Parked:
        self._check_not_draining()
        nodes.check(args, self.limits)
        job = self._job_for_node_join(args, now)
        node = job.gen.nodes.get(args.instance_id)
        if job.state is JobState.RUNNING:
            if node is not None and job.gen.unique_id is None:
                # Restored after a restart: the id never reached the disk, so this
                # node can no longer be given it. Fence the generation.
                self._lose_seated(job, node, "daemon restarted before this node got the id", now)
                raise job.generation_fault()
            if node is not None:
                return nodes.result(job, node)  # a retry of a formed node's JoinNode
            return self._park_scaleup(job, args, now)
        if job.state in TERMINAL:
            raise job.generation_fault()
        added = node is None
        if node is None:
            if len(job.gen.nodes) >= job.max_nodes:
                raise nodes.world_full(job, args.host)
            if args.node_rank is not None and (other := job.gen.nodes.named_at.get(args.node_rank)):
                raise nodes.duplicate_node(job, args, other.host)
            node = Node(
                args.instance_id,
                args.host,
                args.addresses,
                args.node_rank or 0,
                args.node_rank is not None,
                now,
            )
            job.gen.nodes[args.instance_id] = node
            job.gen.last_arrival = now
        if args.unique_id:
            if nodes.holder(job) is not node:
                raise validation.invalid(
                    Reason.INVALID_ID,
                    f"only node 0 of job {job.job_id!r} supplies the unique id; the node "
                    f"agent on {args.host!r} is not node 0",
                    job_id=job.job_id,
                )
            placement.accept_id(job, 0, args.unique_id)
            job.gen.id_node, job.gen.id_deadline = node.instance_id, None
        self._settle_holder(job, now)
        if self._try_form(job, now):
            return nodes.result(job, node)
        if nodes.holder(job) is node and job.gen.unique_id is None:
            # Held until this JoinNode's own deadline, like rank 0's id_required.
            job.gen.id_deadline = now + (args.wait_s or self.timing.default_wait_s)
            return nodes.id_required(job)
        try:
            parked = self._park(job, waits.WaitKind.NODE, -1, node.instance_id, now)
        except RendezvousFault:
            if added:  # refused for capacity: the slot stays free for the retry
                self._remove_node(job, node, now)
            raise
        job.gen.node_waiters[parked.waiter] = node.instance_id
        return parked

    def _job_for_node_join(self, args: NodeJoinArgs, now: float) -> Job:
        job = self.jobs.get(args.job_id)
        if job is None:
            job = self._open_job(args.job_id, args.max_nodes, args.gpus_per_node, now)
        elif job.state in TERMINAL and args.instance_id not in job.gen.nodes:
            expected = nodes.expected_back(job)
            self._next_generation(job, now)
            job.gen.rejoin_expected = expected
        if job.state is JobState.FORMING and not job.gen.members and not job.gen.nodes:
            # Nobody waits on this generation yet: the first node sets its bounds.
            job.gen.join_mode = JoinMode.NODE
            job.num_nodes, job.gpus_per_node = args.max_nodes, args.gpus_per_node
            job.min_nodes, job.max_nodes = args.min_nodes, args.max_nodes
            job.last_call_s = args.last_call_s or self.timing.default_last_call_s
            return job
        if job.gen.join_mode is not JoinMode.NODE:
            raise nodes.mode_mismatch(job, JoinMode.NODE, args.host)
        asked = (args.min_nodes, args.max_nodes, args.gpus_per_node)
        if (job.min_nodes, job.max_nodes, job.gpus_per_node) != asked:
            fault = job.topology_conflict(args.host, asked)
            raise self._conflict(job, fault, now)
        return job

    def _park_scaleup(self, job: Job, args: NodeJoinArgs, now: float) -> Parked:
        if job.num_nodes + len(set(job.scaleup_waiters.values()) | {args.instance_id}) > (
            job.max_nodes
        ):
            raise nodes.world_full(job, args.host)
        parked = self._park(job, waits.WaitKind.SCALEUP, -1, args.instance_id, now)
        job.scaleup_waiters[parked.waiter] = args.instance_id
        self._tell_waiting(job, now)
        return parked

    def _tell_waiting(self, job: Job, now: float) -> None:
        """NODES_WAITING to the running nodes when the count of parked nodes changed:
        the first change at once (it is what makes the agents re-form), later ones at
        most every NODES_WAITING_INTERVAL_S, the latest count, from the tick (200 nodes
        parking one by one made 200 events for every node)."""
        if job.state is not JobState.RUNNING:
            return
        count = len(set(job.scaleup_waiters.values()))
        if count == job.gen.waiting_told:
            return
        if job.gen.waiting_told and now - job.gen.waiting_told_at < NODES_WAITING_INTERVAL_S:
            return  # the tick tells the latest count
        job.gen.waiting_told, job.gen.waiting_told_at = count, now
        self._notify(job, EventKind.NODES_WAITING, nodes_waiting=count)

    def _settle_holder(self, job: Job, now: float) -> None:
        """Keeps the id with node 0: an id from a node that is no longer node 0 is
        dropped, and a parked node that became node 0 is asked for one."""
        head = nodes.holder(job)
        if job.gen.unique_id is not None and (head is None or head.instance_id != job.gen.id_node):
            job.remember_id()
            job.gen.unique_id, job.gen.id_node = None, ""
        if head is None or job.gen.unique_id is not None or job.gen.holder_seen == head.instance_id:
            return
        # Node 0 is answered id_required at once rather than parked, so its parked
        # call, if any, predates its becoming node 0: look once per new node 0, not on
        # every join (that look was O(parked nodes) a join, quadratic in all).
        job.gen.holder_seen = head.instance_id
        for waiter, instance in list(job.gen.node_waiters.items()):
            if instance == head.instance_id:
                del job.gen.node_waiters[waiter]
                self._wake(waiter, nodes.id_required(job))
                # Its SDK answers at once; one heartbeat timeout is ample to hear it.
                job.gen.id_deadline = now + self.timing.heartbeat_timeout_s

    def _try_form(self, job: Job, now: float) -> bool:
        """Forms the generation if it may form now; whether it did."""
        count = len(job.gen.nodes)
        if (
            job.state is not JobState.FORMING
            or job.gen.join_mode is not JoinMode.NODE
            or count < job.min_nodes
        ):
            return False
        if (
            count < job.max_nodes
            and now < job.gen.last_arrival + job.last_call_s
            and not nodes.everyone_back(job)
        ):
            return False
        ranks = nodes.assignment(job)
        if job.gen.unique_id is None or ranks is None:
            return False
        nodes.place(job, ranks)
        self._form(job, now, f"{count} node(s) joined ({job.world_size} ranks)")
        return True

    def _remove_node(self, job: Job, node: Node, now: float) -> None:
        """A forming node gave up: its slot is free, and node 0 may be another now."""
        if job.state is not JobState.FORMING or node.instance_id in job.gen.node_waiters.values():
            return
        job.gen.nodes.pop(node.instance_id, None)
        self._settle_holder(job, now)
        if not job.gen.nodes:
            job.state_since = now

    # -- waits that end (called by RendezvousState.cancel_wait) ------------------

    def _node_wait_ended(
        self, job: Job, w: waits.Waiter, waiter: int, now: float, *, timed_out: bool
    ) -> RendezvousFault | None:
        waited = f"{now - w.since:.1f} s"
        if w.kind is waits.WaitKind.SCALEUP:
            job.scaleup_waiters.pop(waiter, None)
            self._tell_waiting(job, now)
            return nodes.scaleup_timeout(job, waited) if timed_out else None
        job.gen.node_waiters.pop(waiter, None)
        node = job.gen.nodes.get(w.key)
        if node is None:
            return None
        if timed_out:
            fault = nodes.nodes_incomplete(job, waited)
            self._remove_node(job, node, now)
            return fault
        if job.state is JobState.FORMING and w.key not in job.gen.node_waiters.values():
            cause = "its JoinNode was cancelled (node agent died or disconnected)"
            rank = nodes.provisional_first_rank(job, node)
            loss = FailedInfo(rank, node.host, cause, node.node_rank, 0, now)
            self._joiner_died(job, node, loss, f"node agent on {node.host}", now)
        return None

    # -- a formed node ------------------------------------------------------------

    def report_failure(
        self,
        job_id: str,
        generation: int,
        node_rank: int,
        instance_id: str,
        local_rank: int,
        cause: str,
        now: float,
    ) -> None:
        # Any text is a cause (a traceback has newlines): kept bounded, escaped only
        # where shown. Refusing it would leave a healthy rank, lost after, as the root cause.
        cause = bounded(cause) or "its node agent reported a failure without a cause"
        job, node = self._seated(
            job_id, generation, node_rank, instance_id, JoinMode.NODE, running=False
        )
        validation.rank_in_range(
            "local_rank", local_rank, "gpus_per_node", job.gpus_per_node, job_id=job_id
        )
        member = job.gen.members[job.rank_of(node.node_rank, local_rank)]
        if member.state in (MemberState.ACTIVE, MemberState.JOINING):
            self._lose(job, [member], cause, now, told=node.node_rank)
