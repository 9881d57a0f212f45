"""What a join says while it waits for its job to form (rendezvous-run's joins, a
torchrun agent's, and a worker's own per-rank join under ``init_distributed``): the
nodes (ranks) joined of those the generation needs, the seats kept for nodes
re-joining, or the next re-form that takes a newcomer in, asked of the daemon
(``GetJob``) on a thread of its own so that the join is never held up.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client.errors import RendezvousError
from rendezvousd.common.escape import escape
from rendezvousd.common.limits import Timing

#: A join still waiting this long says what it waits for, and again every
#: ``FORMING_NOTE_EVERY_S``: the launcher was silent for the whole join timeout (600 s
#: by default) while a node was missing, the rendezvous hang users know from torchrun.
FORMING_NOTE_S = 5.0
FORMING_NOTE_EVERY_S = 30.0


#: The daemon's --last-call-s unless set: what a join that names no last call gets.
DAEMON_LAST_CALL_S = Timing().default_last_call_s


def forming_note(
    job: pb.GetJobResponse,
    fewest: int,
    waited_s: float,
    limit_s: float,
    last_call_s: float = 0.0,
    held: int | None = None,
) -> str:
    """What a waiting join waits for, from the daemon's view of the job: the nodes
    joined so far against those the generation needs, or, while it runs, the next
    re-form that takes this node in. ``last_call_s``: the last call this node's join
    named (0: none, the daemon's own); ``held``: the generation this node last held a
    seat in (None: none)."""
    # Here, not at the top: grid loads the daemon's model module, which a node's
    # start must not pay for (test_launcher_startup); a note comes 5 s into a wait.
    from rendezvousd.common import grid

    s = job.summary
    most = s.topology.num_nodes
    named = f"job '{escape(s.job_id)}' generation {s.generation}"
    bound = f"waiting up to {limit_s:g} s in all"
    if s.state == pb.JOB_STATE_RUNNING and s.generation == held:
        # Its own generation, still running at the daemon: one restored by a daemon
        # restart while this node's join was on its way, or not yet told this node
        # stopped its workers. Its join ends that generation when it lands. "Runs with 1
        # node(s): this node is taken in when it next re-forms" read, for a job of one
        # node, as a job running without its only node (an operator review).
        return (
            f"{named}, which this node held, still runs at the daemon after "
            f"{waited_s:.0f} s (the daemon was away, or has not yet heard this node stopped "
            f"its workers): this node's join, once it lands, ends that generation and the "
            f"job re-forms with this node ({bound})"
        )
    if s.state == pb.JOB_STATE_RUNNING and any(
        m.state == pb.MEMBER_STATE_LEFT for m in job.members
    ):
        # Its previous run is finishing (a member left): this node waits for its last
        # node's exit, then starts the job id's next run. Said as a re-form it waited
        # for, the user re-running a job read a wait on a healthy run.
        still = sorted(
            {
                (m.member.node_rank, m.member.host)
                for m in job.members
                if m.state == pb.MEMBER_STATE_ACTIVE
            }
        )
        holding = ", ".join(f"node {r} on '{escape(h)}'" for r, h in still[:8])
        more = f" and {len(still) - 8} more" if len(still) > 8 else ""
        return (
            f"{named}, the job id's previous run, is still finishing after {waited_s:.0f} s: "
            f"{len(still)} of its {most} node(s) have not left ({holding}{more}); this node "
            f"joins the job's next run once they have exited ({bound})"
        )
    if s.state == pb.JOB_STATE_RUNNING:
        return (
            f"{named} runs with {most} node(s) after {waited_s:.0f} s: this node is taken "
            f"in when it next re-forms ({bound})"
        )
    joined = job.nodes_waiting - job.standbys
    need = str(most) if fewest == most else f"{fewest} (up to {most})"
    kept = f", {job.seats_kept} seat(s) kept for nodes re-joining" if job.seats_kept else ""
    said = f"still waiting for {named} to form after {waited_s:.0f} s: {joined} node(s) joined"
    if job.joining:
        # Which nodes, on which hosts: a count alone left a 64-node job's operator to
        # find the missing node by elimination (a daemon from before the field sends none).
        said += (
            " ("
            + grid.joined_nodes(
                (n.node_rank if n.HasField("node_rank") else None, n.host, n.joined_ms_ago / 1000)
                for n in job.joining
            )
            + ")"
        )
    if fewest < most and joined >= fewest:
        # Elastic, with enough nodes: it forms at its last call, not at the timeout
        # (said so, it read as a wait for a node that was missing: review). How long,
        # in seconds: "within its last call" left the reader to guess (a torchrun
        # review). The daemon does not say which last call the generation's first node
        # set: this node's own, or the daemon's default it named none.
        call = (
            f"{last_call_s:g} s (its last call)"
            if last_call_s
            else f"its last call (the daemon's --last-call-s, {DAEMON_LAST_CALL_S:g} s unless set)"
        )
        said += (
            f", the {fewest} it needs at least{kept}: it forms with them once no other node "
            f"joins for {call}, or at once when {most} have ({bound})"
        )
    else:
        said += f" of the {need} it needs{kept}"
        missing = grid.missing_nodes(job.missing_node_ranks, job.nodes_needed, job.min_nodes)
        said += f", missing {missing}" if job.min_nodes and missing else ""
        said += f"; {bound}, then this ends naming what is missing"
    return said + _previous_run(job, "node")


def _previous_run(job: pb.GetJobResponse, who: str) -> str:
    """Where the job's previous run ended before this join: a pod restarted after its
    job succeeded, say, opened a run nobody else will join, and would wait out its join
    timeout without a word of why. "" otherwise."""
    if not job.HasField("previous_run_ended_ms"):
        return ""
    return (
        f". The job's previous run ended {_ago(job.previous_run_ended_ms / 1000)} ago "
        "(every member left), and a join after that starts a new run: a "
        f"{who} meant for the run that ended is not needed and may stop"
    )


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def rank_note(
    job: pb.GetJobResponse, waited_s: float, limit_s: float, host: str, local_rank: int
) -> str | None:
    """What a worker's own per-rank join (``init_distributed`` without an agent) waits
    for: the ranks joined of the world, and which are missing. None when another
    worker on this host says it: the lowest local rank joined there speaks, one line
    per host as rendezvous-run's one per node, where every rank of a 64-node srun job
    repeating it buried the line (and rank 0 alone is silent when it is the missing
    one)."""
    from rendezvousd.common import grid  # not at the top: see forming_note

    s = job.summary
    named = f"job '{escape(s.job_id)}' generation {s.generation}"
    bound = f"waiting up to {limit_s:g} s in all"
    if s.state != pb.JOB_STATE_FORMING:
        # Joined while an earlier run of the job id winds down: its members leave,
        # then this join opens the next run.
        still = sorted(m.member.rank for m in job.members if m.state == pb.MEMBER_STATE_ACTIVE)
        if not still:
            return None  # the generation just ended: the next note sees this join's own
        return (
            f"{named}, an earlier run of this job id, is still running after "
            f"{waited_s:.0f} s ({len(still)} of its {s.world_size} ranks active): this "
            f"rank joins the job id's next run once they have left; if that run is not "
            f"yours, stop this one or give it a fresh job id "
            f"(`rendezvousd status {escape(s.job_id)}` shows it; {bound})"
        )
    here = [
        m.member.local_rank
        for m in job.members
        if m.state == pb.MEMBER_STATE_JOINING and m.member.host == host
    ]
    if any(r < local_rank for r in here):
        return None
    joined = [m.member.rank for m in job.members if m.state == pb.MEMBER_STATE_JOINING]
    said = (
        f"still waiting for {named} to form after {waited_s:.0f} s: {len(joined)} of "
        f"{s.world_size} ranks joined"
    )
    missing = grid.missing_ranks(s.world_size, joined)
    said += f", missing {missing}" if missing else ", rank 0's id not yet published"
    said += f"; {bound}, then this ends naming what is missing"
    return said + _previous_run(job, "worker")


@contextlib.contextmanager
def saying_what_it_waits_for(
    get_job: Callable[[], pb.GetJobResponse],
    say: Callable[[str], None],
    fewest: int,
    limit_s: float,
    began: float,
    last_call_s: float = 0.0,
    held: int | None = None,
) -> Iterator[None]:
    """While the join in this block waits: after ``FORMING_NOTE_S``, then every
    ``FORMING_NOTE_EVERY_S``, ``say`` what it waits for (``forming_note``; ``began``:
    when the node began to join, on the monotonic clock; ``last_call_s``: the last call its
    join names, 0 for the daemon's; ``held``: the generation it last held a seat in). Only a join that itself has
    waited says so: one asked again every second (a held --node-rank, the daemon away)
    is refused, not waiting for the job."""
    with _noting(
        get_job,
        say,
        lambda job: forming_note(job, fewest, time.monotonic() - began, limit_s, last_call_s, held),
    ):
        yield


@contextlib.contextmanager
def saying_what_its_rank_waits_for(
    get_job: Callable[[], pb.GetJobResponse],
    say: Callable[[str], None],
    limit_s: float,
    began: float,
    host: str,
    local_rank: int,
) -> Iterator[None]:
    """``saying_what_it_waits_for`` for a worker's own per-rank join: ``rank_note``,
    at the same pace (``host``: the one the join names; ``local_rank``: its own)."""
    with _noting(
        get_job,
        say,
        lambda job: rank_note(job, time.monotonic() - began, limit_s, host, local_rank),
    ):
        yield


@contextlib.contextmanager
def _noting(
    get_job: Callable[[], pb.GetJobResponse],
    say: Callable[[str], None],
    word: Callable[[pb.GetJobResponse], str | None],
) -> Iterator[None]:
    done = threading.Event()

    def watch() -> None:
        wait = FORMING_NOTE_S
        while not done.wait(wait):
            wait = FORMING_NOTE_EVERY_S
            try:
                job = get_job()
            except RendezvousError:
                continue  # best effort: the join itself says what failed
            note = word(job)
            if note is not None and not done.is_set():
                say(note)

    threading.Thread(target=watch, daemon=True, name="rendezvous-forming").start()
    try:
        yield
    finally:
        done.set()
