"""A job put back to its last committed record, after the commit of a later change failed.

The record (``snapshot.job_record``) holds everything durable about a job. What no
record holds, but a job needs to go on serving, is kept from the job in memory while
that still describes the record's generation: rank 0's id (only its digest is ever
written), the member table, heartbeat ages and streams, node agents' arrival, the
forming timers, a goodbye (its Leave undone: the member's end is still no loss), a
loss found by a stream's end or silence (undone: the attendee is still dead).
Whatever was only in memory otherwise (parked calls, barrier arrivals,
forming nodes, a member that joined or left since the commit) is gone. Pure, like the
state machine it feeds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rendezvousd.common.model import JobState
from rendezvousd.state.job import Attendee, Job
from rendezvousd.storage import snapshot


def durable_job(
    record: Mapping[str, Any], kv: dict[str, bytes], live: Job | None, now: float, *, hold_s: float
) -> Job:
    """The job ``record`` (its last committed row, with ``kv`` its committed store)
    describes, keeping from ``live`` (the job in memory, if any) what no row holds;
    ``hold_s``: how long seats the record keeps are kept again when nothing in memory
    keeps them any more."""
    job = snapshot.job_from_record(record, kv, now)
    if live is None or live.generation != job.generation:
        # Nothing in memory describes this generation any more: as after a restart,
        # whose fenced generation keeps the record's seats for the nodes expected back
        # (a generation forming after a failure, its change and a later one's in one
        # commit that failed). Without them a newcomer, or the very one whose join was
        # undone, took a survivor's seat.
        _only_digest(job)
        if job.state is JobState.FORMING:
            snapshot.keep_again(job, snapshot.kept_seats(record, job.max_nodes), hold_s, now)
        return job
    if live.state is job.state:
        job.state_since = live.state_since  # the job TTL and the conflict window go on
    if job.gen.restored_id_digest is not None and live.id_digest() == job.gen.restored_id_digest:
        job.gen.unique_id, job.gen.restored_id_digest = (
            live.gen.unique_id,
            live.gen.restored_id_digest,
        )
    _only_digest(job)
    if job.state is not JobState.FORMING and live.gen.member_table:
        job.gen.member_table = live.gen.member_table
    for rank, member in job.gen.members.items():
        was = live.gen.members.get(rank)
        if was is not None and was.instance_id == member.instance_id:
            _keep_liveness(member, was)
    for node in job.gen.nodes.values():
        had = live.gen.nodes.get(node.instance_id)
        if had is not None and had.node_rank == node.node_rank:
            _keep_liveness(node, had)
            node.named, node.arrived, node.kept = had.named, had.arrived, had.kept
    if job.state is JobState.FORMING:
        job.gen.id_deadline = live.gen.id_deadline
    job.last_call_s, job.gen.last_arrival = live.last_call_s, live.gen.last_arrival
    job.gen.id_node = live.gen.id_node
    job.gen.woken, job.gen.rejoin_expected = set(live.gen.woken), live.gen.rejoin_expected
    job.gen.owed, job.gen.owed_until = dict(live.gen.owed), live.gen.owed_until
    for inst, node in live.gen.nodes.items():
        if node.kept and inst not in job.gen.nodes:  # its join was undone: kept again
            job.gen.owed[node.kept] = node.host
    job.standbys_called = set(live.standbys_called)
    job.gen.gone = set(live.gen.gone)  # a final goodbye is kept, as any goodbye is
    return job


def _only_digest(job: Job) -> None:
    """Without the id itself the generation is in the state a restart leaves it in."""
    if job.gen.unique_id is None and job.gen.restored_id_digest is not None:
        job.used_id_digests.add(job.gen.restored_id_digest)  # a later generation refuses it
        job.gen.restored = job.state is JobState.RUNNING


def _keep_liveness(kept: Attendee, was: Attendee) -> None:
    """The same attendee: its heartbeat stream (by token), silence and goodbye carry over."""
    kept.last_seen, kept.beat_gap, kept.beaten = was.last_seen, was.beat_gap, was.beaten
    kept.stream_token, kept.stream_open = was.stream_token, was.stream_open
    kept.cut_at = was.cut_at  # its time to re-attach, not a loss the undo forgets
    kept.said_goodbye = was.said_goodbye
    # A loss undone: still dead, since then (``Attendee.lost_as``).
    kept.lost_as, kept.lost_at = was.lost_as, was.lost_at
    kept.peer, kept.connection = was.peer, was.connection
