"""Job state to and from plain records (pure: no files here).

``job_record``/``restore_job`` are one job's row for the SQLite store; ``dump``/``load``
are the whole-state JSON document of the old ``state.json`` (read once, to import it).

What survives a restart: jobs, generations, membership (and which members' SDK
predates instance ids), barrier counts, the key-value store, the digests of used ids,
why a forming generation failed on a conflicting joiner, when each loss was, a close
of the job's run (``Job.closed``), and the job's failure history (its last failure and
how many generations failed). What never does: the unique id itself (a bearer
credential) and tokens. On restore, a job that was still
forming is fenced by a new generation (its members redo the join, rank 0 with a
fresh id); a running job keeps running and its members reattach their
heartbeats within the heartbeat timeout.
"""

from __future__ import annotations

import base64
import math
import time
from collections.abc import Mapping
from typing import Any

from rendezvousd.common import validation
from rendezvousd.common.limits import Limits
from rendezvousd.common.model import (
    AbortCause,
    FailedInfo,
    JobFailure,
    JobState,
    JoinMode,
    MemberState,
    Transition,
)
from rendezvousd.errors import Code, Reason, RendezvousFault
from rendezvousd.state import kv as kvrules
from rendezvousd.state import placement
from rendezvousd.state.id_history import IdHistory
from rendezvousd.state.job import BarrierState, Closed, Job, Member, Node
from rendezvousd.state.machine import RendezvousState

SCHEMA = 1

#: Unix time minus this process's monotonic clock, read once: a job's ``state_since``
#: (monotonic, which dies with the process) is kept as Unix time, so the job TTL and
#: the age `status` shows go on across a restart instead of starting again. One
#: constant keeps a record the same from commit to commit (an unchanged row is not
#: written again).
_WALL_OFFSET = time.time() - time.monotonic()


def dump(state: RendezvousState) -> dict[str, Any]:
    return {"schema": SCHEMA, "jobs": [_job(job) for job in state.jobs.values()]}


def job_record(job: Job) -> dict[str, Any]:
    """Everything of ``job`` that survives a restart except its key-value store."""
    return {
        "job_id": job.job_id,
        "num_nodes": job.num_nodes,
        "gpus_per_node": job.gpus_per_node,
        "generation": job.generation,
        "state": job.state.name,
        "state_since_unix": _unix(job.state_since),
        "members": [
            {
                "rank": m.rank,
                "node_rank": m.node_rank,
                "local_rank": m.local_rank,
                "host": m.host,
                "address": m.address,
                "instance_id": m.instance_id,
                "state": m.state.name,
                # Its calls named no instance id (``seats._without_instance_id``): kept, so
                # that its loss after a restart still says why. Absent otherwise.
                **({"old_sdk": True} if m.without_instance_id else {}),
                **_heard(job, m),
            }
            for m in job.gen.members.values()
        ],
        "host_nodes": dict(job.gen.host_nodes),  # a copy: a writer thread encodes it
        "id_digest": (job.id_digest() or b"").hex(),
        # Oldest first: the order the bounded history forgets them in.
        "used_id_digests": [d.hex() for d in job.used_id_digests],
        "failed": [
            {
                "rank": f.rank,
                "host": f.host,
                "cause": f.cause,
                # When it was lost (absent in older rows: not known after a restart).
                **({} if f.lost_at is None else {"lost_unix": _unix(f.lost_at)}),
            }
            for f in job.gen.failed
        ],
        # The job's failure history, which outlives its generations: a restart had
        # left "restarts 2 used" with no cause anywhere. Absent in older rows (none).
        **({"failures": job.failures} if job.failures else {}),
        **(
            {}
            if job.last_failure is None
            else {
                "last_failure": {
                    "generation": job.last_failure.generation,
                    "cause": job.last_failure.cause,
                    "at_unix": _unix(job.last_failure.at),
                }
            }
        ),
        "abort_reason": job.gen.abort_reason,
        # Absent when none (and in older rows): an older daemon reads the row as before.
        **(
            {}
            if job.gen.abort_cause is AbortCause.UNSPECIFIED
            else {"abort_cause": job.gen.abort_cause.name}
        ),
        # Why a forming generation failed with no member lost (a joiner's topology or
        # version): what GetJob and the status page show, and what late joiners are
        # told within a heartbeat timeout of it. Absent when none (and in older rows).
        **({} if job.gen.conflict is None else {"conflict": _conflict_record(job.gen.conflict)}),
        "barriers": {name: b.completed for name, b in job.gen.barriers.items()},
        # Node joins (absent in rows written before them: a per-rank job).
        "join_mode": job.gen.join_mode.value,
        "min_nodes": job.min_nodes,
        "max_nodes": job.max_nodes,
        # How long its next forming waits for more nodes past min_nodes. Absent in older
        # rows, which restored it as 0 s: the survivors of a scale-up after a restart
        # re-formed alone at once, and the parked newcomer aborted each such generation
        # again (h139 F4).
        **({"last_call_s": job.last_call_s} if job.last_call_s else {}),
        # What its node agents speak to each other (absent in rows written before it,
        # and while unknown: the next joiner sets it).
        **({} if job.wire_version is None else {"wire_version": job.wire_version}),
        # A close of the job's run (AbortJob with ``close``): after a restart the node
        # agents launched before it are still refused as closed, where they were let
        # in, or a standby parked, to wait for nodes that had stopped for good. Absent
        # when none (and in older rows).
        **({} if job.closed is None else {"closed": _closed_record(job.closed)}),
        "nodes": [
            {
                "node_rank": n.node_rank,
                "host": n.host,
                "instance_id": n.instance_id,
                "state": n.state.name,
                "addresses": list(n.addresses),
                **_heard(job, n),
            }
            for n in job.gen.node_at.values()
        ],
        # A generation forming after a failure: the seats kept for the nodes expected
        # back, kept again in the generation a restart fences this one with.
        "kept_seats": placement.seats_kept(job) if job.state is JobState.FORMING else {},
        # Written by a draining daemon only (``resume_silence``).
        **({} if job.drained_at is None else {"drained_unix": _unix(job.drained_at)}),
        # Written by a draining daemon only (``_state_since``).
        **(
            {}
            if job.state_age_at_drain is None
            else {"state_age_s": round(job.state_age_at_drain, 3)}
        ),
    }


def _heard(job: Job, seat: Member | Node) -> dict[str, float]:
    """When a draining daemon last heard ``seat``, and its cadence once it beat twice
    (``resume_silence``); nothing in any other row."""
    if job.drained_at is None:
        return {}
    gap = {} if seat.beat_gap is None else {"beat_gap_s": round(seat.beat_gap, 3)}
    return {"heard_unix": _unix(seat.last_seen), **gap}


def _unix(monotonic: float) -> float:
    """A time on this process's monotonic clock as Unix seconds, as rows keep it."""
    return round(monotonic + _WALL_OFFSET, 3)


def unix(monotonic: float) -> float:
    """``_unix``, for what the daemon keeps beside the rows in the same frame (a job's
    end): a wall clock stepped after start-up moves none of them."""
    return _unix(monotonic)


def _closed_record(closed: Closed) -> dict[str, Any]:
    return {
        "at_unix": _unix(closed.at),
        "reason": closed.reason,
        "generation": closed.generation,
        **({} if closed.cause is AbortCause.UNSPECIFIED else {"cause": closed.cause.name}),
    }


def _closed(raw: Mapping[str, Any], generation: int, now: float) -> Closed | None:
    """The record's close of the job's run (absent: none), checked as the AbortJob that
    made it was: a reason the daemon would take, a generation the job reached."""
    if "closed" not in raw:
        return None
    row = _map(raw, "closed")
    reason = _str(row, "reason")
    try:
        validation.text_field("closed.reason", reason, Limits().max_reason_bytes, required=True)
    except RendezvousFault as fault:
        raise ValueError(fault.message) from None
    named = _str(row, "cause") if "cause" in row else ""
    cause = AbortCause.__members__.get(named, AbortCause.UNSPECIFIED)
    return Closed(
        _unix_time(row, "at_unix", now), reason, _int(row, "generation", 1, generation), cause
    )


def _conflict_record(fault: RendezvousFault) -> dict[str, Any]:
    return {
        "code": fault.code.name,
        "reason": fault.reason.value,
        "message": fault.message,
        "metadata": dict(fault.metadata),  # a copy: a writer thread encodes it
    }


def _conflict(raw: Mapping[str, Any]) -> RendezvousFault | None:
    """The record's conflict, as its joiners were told it (absent: none)."""
    if "conflict" not in raw:
        return None
    row = _map(raw, "conflict")
    code, reason = _str(row, "code"), _str(row, "reason")
    if code not in Code.__members__:
        raise ValueError(f"conflict.code must be one of {', '.join(Code.__members__)}")
    if reason not in Reason.__members__:
        raise ValueError(f"conflict.reason must be one of {', '.join(Reason.__members__)}")
    metadata = _map(row, "metadata")
    if not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("conflict.metadata must map names to strings")
    return RendezvousFault(Code[code], Reason[reason], _str(row, "message"), metadata)


def _job(job: Job) -> dict[str, Any]:
    record = job_record(job)
    record["kv"] = {k: base64.b64encode(v).decode("ascii") for k, v in job.gen.kv.items()}
    return record


def load(state: RendezvousState, doc: dict[str, Any], now: float) -> None:
    """Rebuild ``state`` from ``dump`` output. Raises KeyError/ValueError/TypeError if malformed."""
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"unsupported state schema {doc.get('schema')!r} (expected {SCHEMA})")
    for raw in doc["jobs"]:
        kv = {str(k): base64.b64decode(v, validate=True) for k, v in _map(raw, "kv").items()}
        restore_job(state, raw, kv, now)


_MAX_INT = 2**63 - 1
# Counters that only grow (generations, barrier rounds) must leave room to grow: SQLite
# stores at most 2**63 - 1, and a restored generation of 2**63 - 1 made the next one an
# OverflowError in the commit. 2**62 more is more than any job can use up (at 150
# generations a second, 10**9 years), so only a hand-edited row gets near it.
MAX_COUNTER = 2**62
# Far above any limit; stored sizes are checked against it, not the current flags,
# so a restart with a lower --max-members-per-job still restores existing jobs. The
# world (a product) too: 2**20 x 2**20 overflowed ListJobs' uint32 world size.
_MAX_WORLD = 1 << 20


def _int(raw: Mapping[str, Any], name: str, low: int = 0, high: int = _MAX_INT) -> int:
    value = raw.get(name)
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in {low}..{high}, not {value!r}")
    return value


def _str(raw: Mapping[str, Any], name: str) -> str:
    value = raw.get(name)
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, not {value!r}")
    return value


def _map(raw: Mapping[str, Any], name: str) -> dict[str, Any]:
    value = raw.get(name)
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be an object, not {type(value).__name__}")
    return value


def _list(raw: Mapping[str, Any], name: str) -> list[Any]:
    value = raw.get(name)
    if not isinstance(value, list):
        raise ValueError(f"{name} must be a list, not {type(value).__name__}")
    return value


def _rows(raw: Mapping[str, Any], name: str) -> list[dict[str, Any]]:
    rows = _list(raw, name)
    if not all(isinstance(row, dict) for row in rows):
        raise ValueError(f"{name}[] must be objects")
    return rows


def _member_state(row: Mapping[str, Any], table: str) -> MemberState:
    state = _str(row, "state")
    if state not in MemberState.__members__:
        raise ValueError(f"{table}[].state must be one of {', '.join(MemberState.__members__)}")
    return MemberState[state]


def _instance_id(raw: Mapping[str, Any], table: str) -> str:
    value = _str(raw, "instance_id")
    if not value:
        # Calls are bound to the instance that joined: an empty one would match a
        # caller that names none, and let any token holder act as this member.
        raise ValueError(f"{table}[].instance_id must not be empty")
    return value


def _job_id(raw: Mapping[str, Any]) -> str:
    value = _str(raw, "job_id")
    try:
        return validation.job_id(value)
    except RendezvousFault as fault:
        raise ValueError(fault.message) from None


def _world(num_nodes: int, gpus_per_node: int, what: str) -> None:
    if num_nodes * gpus_per_node > _MAX_WORLD:
        raise ValueError(
            f"the world {what} x gpus_per_node = {num_nodes} x {gpus_per_node} exceeds "
            f"{_MAX_WORLD} ranks"
        )


def kept_seats(raw: Mapping[str, Any], max_nodes: int) -> dict[str, str]:
    """The record's kept seats (absent in rows written before them: none)."""
    if "kept_seats" not in raw:
        return {}
    kept = _map(raw, "kept_seats")
    if len(kept) > max_nodes:
        raise ValueError(f"kept_seats holds {len(kept)} seats for max_nodes={max_nodes}")
    for instance_id, host in kept.items():
        if not instance_id or len(instance_id) > 128 or not isinstance(host, str):
            raise ValueError("kept_seats must map instance ids (1..128 characters) to hosts")
    return dict(kept)


def _digest(text: object, name: str) -> bytes:
    if not isinstance(text, str) or len(text) != 64:
        raise ValueError(f"{name} must be a 64-digit hex SHA-256 digest")
    return bytes.fromhex(text)


def restore_job(
    state: RendezvousState,
    raw: Mapping[str, Any],
    kv: dict[str, bytes],
    now: float,
    *,
    alive_unix: float | None = None,
) -> None:
    """Put one stored job back into ``state`` after a restart; a malformed record raises
    ValueError (types and ranges are checked, so a hand-edited row cannot corrupt the
    daemon). ``alive_unix``: when the daemon before was last known alive, if known."""
    job = job_from_record(raw, kv, now)
    # A row from before the last call was kept: the daemon's default, as a join that
    # names none gets, not 0 s, which formed the next generation with min_nodes at once
    # (h139 F4).
    job.last_call_s = job.last_call_s or state.timing.default_last_call_s
    if job.gen.restored_id_digest is not None:
        # Only the digest survives: a later generation must still refuse this id.
        job.used_id_digests.add(job.gen.restored_id_digest)
    detail = "restored"
    if job.state is JobState.FAILED and job.gen.failed:
        # What failed it, as the log said then: the restore's line said no more than
        # "FAILED (restored)", and the cause was left in old log lines only.
        first = job.gen.failed[0]
        more = f" (and {len(job.gen.failed) - 1} more)" if len(job.gen.failed) > 1 else ""
        detail = f"restored: {first.describe()}{more}"
    elif job.state is JobState.FAILED and job.gen.conflict is not None:
        detail = f"restored: {job.gen.conflict.message}"
    elif job.state is JobState.ABORTED:
        detail = f"restored: {job.gen.abort_reason}"
    if job.state is JobState.FORMING:
        # Mid-bootstrap: nobody can have the id from us any more. Fence it.
        kept = kept_seats(raw, job.max_nodes)
        job.state = JobState.ENDED
        job.open_generation(now)  # FORMING again
        keep_again(job, kept, state.timing.hold_s, now)
        detail = "fenced by a new generation after restart"
    elif job.state is JobState.RUNNING and job.gen.members and job.gen.left == len(job.gen.members):
        # Every member left (a replay-marked LOST one read back LEFT, ``job_from_record``,
        # which the old daemon's count missed): no Leave is to come, a tick looks only
        # at active members and only an ended job expires, so it ends here, as its last
        # Leave would have ended it (rounds.member_left).
        job.state = JobState.ENDED
        job.state_since = now
        detail = "restored: every member left"
    elif job.state is JobState.RUNNING:
        job.gen.restored = True
        timeout = state.timing.heartbeat_timeout_s
        resume_silence(job, raw, now, timeout)
        down = outage(raw, alive_unix)
        if down is not None and down >= timeout and job.gen.join_mode is JoinMode.NODE:
            # Every node agent gave up on the daemon meanwhile: said here, and its
            # re-joins end the generation in these words (``joins.join``).
            job.gen.outage_s = down
            detail = (
                f"restored after the daemon was down {down:.1f} s, longer than the "
                f"nodes' {timeout:g} s reconnect window: its node agents have stopped "
                "their workers, and the generation ends as they join again"
            )
    state.jobs[job.job_id] = job
    # Still the state it was stored in (not ended or fenced here): its stored Unix time
    # (checked by ``job_from_record``) is when it entered it.
    as_stored = job.state.name == raw["state"] and "state_since_unix" in raw
    state.calls.emit(
        Transition(
            job.job_id,
            job.generation,
            None,
            job.state,
            detail,
            job.world_size,
            restored=True,
            since=job.state_since,
            since_unix=min(float(raw["state_since_unix"]), time.time()) if as_stored else None,
        )
    )


def outage(raw: Mapping[str, Any], alive_unix: float | None) -> float | None:
    """How long the daemon was down, by ``raw``'s drain (a drained restart) or else
    by when the daemon before was last alive; None when neither is known."""
    last = float(raw["drained_unix"]) if "drained_unix" in raw else alive_unix
    return None if last is None else max(0.0, time.time() - last)


#: How far past its own cadence an attendee may be silent at a drain and still count
#: as beating (a beat's jitter on a loaded host).
BEAT_SLACK = 1.5

#: The least a restored member or node is given to reattach after a drained restart,
#: however long it had been silent before: the restart's own seconds are no silence
#: of the clients that are there, and they reattach as soon as the daemon serves.
REATTACH_S = 2.0


def resume_silence(job: Job, raw: Mapping[str, Any], now: float, timeout: float) -> None:
    """Each attendee's silence goes on from where the draining daemon left it.

    A restored member or node was given a whole heartbeat timeout from the restore. A
    node cut off just before a restart (SIGTERM) was then lost a timeout after the
    restart, seconds after its peers' own links had noticed its silence, and the
    witness that reported first was named as the root cause. Its SDK counts its
    reconnect window from the drain too. A row from a daemon down longer than a
    timeout (every client gave up by then), or from no drain: a whole timeout."""
    if "drained_unix" not in raw:
        return
    drained = _unix_time(raw, "drained_unix", now)
    if now - drained >= timeout:
        return
    longest = max(0.0, timeout - REATTACH_S)

    def resume(seat: Member | Node | None, row: Mapping[str, Any]) -> None:
        if seat is None or "heard_unix" not in row:
            return
        heard = _unix_time(row, "heard_unix", now)
        # One heard within its own cadence was beating: its silence starts with the
        # drain, as its SDK's reconnect window does (from its last beat, a healthy
        # member was given up to a beat interval less than its SDK gives itself). A
        # cadence not known yet (one beat: its gap was from its join) is taken as the
        # longest the SDK beats at (its default).
        gap = (
            _seconds(row, "beat_gap_s")
            if "beat_gap_s" in row
            else validation.longest_beat_s(timeout)
        )
        if drained - heard <= BEAT_SLACK * gap:
            heard = drained
        seat.last_seen = now - min(now - heard, longest)

    for row in _rows(raw, "members"):
        resume(job.gen.members.get(row["rank"]), row)
    for row in _rows(raw, "nodes"):
        resume(job.gen.node_at.get(row["node_rank"]), row)


def keep_again(job: Job, kept: dict[str, str], hold_s: float, now: float) -> None:
    """``job``'s forming generation keeps ``kept`` (a record's kept seats) for a fresh
    hold: its survivors still re-join, and a newcomer must not take their seats."""
    if kept:
        job.gen.rejoin_expected = len(kept)
        placement.keep_seats(job, dict(kept), hold_s, now)


def job_from_record(raw: Mapping[str, Any], kv: dict[str, bytes], now: float) -> Job:
    """The job ``raw`` (a ``job_record``) describes, exactly: no fencing, no id (only its
    digest, as ``restored_id_digest``), heartbeats as of ``now``, ``kv`` as its store.
    Raises ValueError when the record is malformed."""
    job_id = _job_id(raw)
    job_state = _str(raw, "state")
    if job_state not in JobState.__members__:
        raise ValueError(f"state must be one of {', '.join(JobState.__members__)}")
    job = Job(
        job_id,
        _int(raw, "num_nodes", 1, _MAX_WORLD),
        _int(raw, "gpus_per_node", 1, _MAX_WORLD),
        _int(raw, "generation", 1, MAX_COUNTER),
        JobState[job_state],
        now,
    )
    _world(job.num_nodes, job.gpus_per_node, "num_nodes")
    job.state_since = _state_since(raw, now)
    # Rows written before the history was bounded may hold more (sorted, so which ones
    # are kept is arbitrary then): the newest USED_ID_HISTORY are kept.
    job.used_id_digests = IdHistory(
        _digest(d, "used_id_digests[]") for d in _list(raw, "used_id_digests")
    )
    id_digest = _str(raw, "id_digest")
    if id_digest:
        job.gen.restored_id_digest = _digest(id_digest, "id_digest")
    for m in _rows(raw, "members"):
        member_state = _member_state(m, "members")
        member = Member(
            _int(m, "rank", 0, job.world_size - 1),
            _int(m, "node_rank", 0, job.num_nodes - 1),
            _int(m, "local_rank", 0, job.gpus_per_node - 1),
            _str(m, "host"),
            _str(m, "address"),
            _instance_id(m, "members"),
            state=member_state,
        )
        old_sdk = m.get("old_sdk", False)
        if not isinstance(old_sdk, bool):
            raise ValueError(f"members[].old_sdk must be true or false, not {old_sdk!r}")
        member.without_instance_id = old_sdk
        if member.rank != job.rank_of(member.node_rank, member.local_rank):
            raise ValueError(f"member rank {member.rank} does not match its node/local rank")
        member.last_seen = now  # a full heartbeat timeout to reattach
        # It may have beaten before the restart: its silence is not a missing
        # start_heartbeat() (rounds.silence_cause).
        member.stream_token = 1
        job.gen.members[member.rank] = member
    if job.state is JobState.RUNNING:
        for member in job.gen.members.values():
            if member.state is MemberState.LOST:
                # A loss fails the generation, so a running one holds no lost member but
                # one a replayed Join of a member that had left marked so (a daemon before
                # that was refused): it left, and counted as such, its job can end again.
                member.state = MemberState.LEFT
    job.gen.left = sum(m.state is MemberState.LEFT for m in job.gen.members.values())
    job.gen.host_nodes = {
        str(h): _int({"node": n}, "node", 0, job.num_nodes - 1)
        for h, n in _map(raw, "host_nodes").items()
    }
    failed = []
    for f in _rows(raw, "failed"):
        # Node and local rank follow from the rank; when it was lost, from Unix time
        # (absent in rows written before it was kept: not known).
        rank = _int(f, "rank", 0, job.world_size - 1)
        node_rank, local_rank = divmod(rank, job.gpus_per_node)
        lost_at = _unix_time(f, "lost_unix", now) if "lost_unix" in f else None
        failed.append(
            FailedInfo(rank, _str(f, "host"), _str(f, "cause"), node_rank, local_rank, lost_at)
        )
    job.gen.failed = failed
    job.failures = _int(raw, "failures", 0, MAX_COUNTER) if "failures" in raw else 0
    if "last_failure" in raw:
        last = _map(raw, "last_failure")
        job.last_failure = JobFailure(
            _int(last, "generation", 1, MAX_COUNTER),
            _str(last, "cause"),
            _unix_time(last, "at_unix", now),
        )
    job.gen.abort_reason = _str(raw, "abort_reason")
    if "abort_cause" in raw:
        # A newer daemon's cause this one does not know: an abort like any other.
        name = _str(raw, "abort_cause")
        job.gen.abort_cause = AbortCause.__members__.get(name, AbortCause.UNSPECIFIED)
    job.gen.conflict = _conflict(raw)
    job.gen.barriers = {
        str(n): BarrierState(completed=_int({"completed": c}, "completed", 0, MAX_COUNTER))
        for n, c in _map(raw, "barriers").items()
    }
    _restore_nodes(job, raw, now)
    if "last_call_s" in raw:
        job.last_call_s = _seconds(raw, "last_call_s")
    if "wire_version" in raw:
        job.wire_version = _str(raw, "wire_version")
        if len(job.wire_version.encode()) > placement.MAX_WIRE_VERSION:
            raise ValueError(f"wire_version is longer than {placement.MAX_WIRE_VERSION} bytes")
    job.closed = _closed(raw, job.generation, now)
    job.gen.kv = dict(kv)
    job.gen.kv_bytes = sum(kvrules.entry_bytes(k, v) for k, v in job.gen.kv.items())
    if job.state is JobState.RUNNING:
        if sorted(job.gen.members) != list(range(job.world_size)):
            raise ValueError("a RUNNING job must have every rank of its world as a member")
        job.gen.member_table = tuple(job.gen.members[r].info() for r in sorted(job.gen.members))
    return job


def _state_since(raw: Mapping[str, Any], now: float) -> float:
    """When the job entered its state, on this process's clock; ``now`` for rows
    written before it was kept, and never later than ``now`` (a clock set back).
    A job that ended before the restart expires ``job_ttl_s`` after its end, not
    after the restart: a daemon restarting more often than that never forgot one.

    A row a draining daemon wrote keeps the state's age then (``state_age_s``), which
    no clock of either process moves: the job goes on from that age, the time the
    daemon was down not counted (as no attendee's silence counts it). Its Unix time is
    read only from a row of a daemon that died without draining, or an older one: a
    restart whose wall clock is ahead of the old process's makes that job older by
    the difference (one behind is clamped to ``now``)."""
    if "state_age_s" in raw:
        return now - _seconds(raw, "state_age_s")
    if "state_since_unix" not in raw:
        return now
    return _unix_time(raw, "state_since_unix", now)


def _seconds(raw: Mapping[str, Any], name: str) -> float:
    """``raw[name]``, a finite number of seconds, not negative."""
    value = raw[name]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a number of seconds")
    if value < 0:
        raise ValueError(f"{name} must not be negative")
    return float(value)


def _unix_time(raw: Mapping[str, Any], name: str, now: float) -> float:
    """``raw[name]``, Unix seconds, on this process's monotonic clock; never later than
    ``now`` (a clock set back)."""
    since = raw[name]
    if isinstance(since, bool) or not isinstance(since, int | float) or not math.isfinite(since):
        raise ValueError(f"{name} must be a number of Unix seconds")
    return min(now, float(since) - _WALL_OFFSET)


def _restore_nodes(job: Job, raw: Mapping[str, Any], now: float) -> None:
    """A formed JoinNode generation's node agents; rows from before node joins have none."""
    stored = raw.get("join_mode", "rank" if job.gen.members else "")
    try:
        mode = JoinMode(stored)
    except ValueError:
        raise ValueError(f"join_mode must be '', 'rank' or 'node', not {stored!r}") from None
    job.gen.join_mode = mode
    if mode is not JoinMode.NODE:
        # A per-rank generation's bounds are its node count (rows never held them).
        job.min_nodes = job.max_nodes = job.num_nodes
        return
    job.min_nodes = _int(raw, "min_nodes", 1, _MAX_WORLD)
    job.max_nodes = _int(raw, "max_nodes", job.min_nodes, _MAX_WORLD)
    _world(job.max_nodes, job.gpus_per_node, "max_nodes")
    for n in _rows(raw, "nodes"):
        state = _member_state(n, "nodes")
        addresses = _list(n, "addresses")
        if not all(isinstance(a, str) for a in addresses):
            raise ValueError("nodes[].addresses must be strings")
        node = Node(
            _instance_id(n, "nodes"),
            _str(n, "host"),
            tuple(addresses),
            _int(n, "node_rank", 0, job.num_nodes - 1),
            False,
            now,
            state=state,
            last_seen=now,  # a full heartbeat timeout to reattach, like members
            # It may have attached before the restart: its silence is a loss like any
            # other, never a stray's (rounds.silence_cause).
            stream_token=1,
        )
        job.gen.nodes[node.instance_id] = node
        job.gen.node_at[node.node_rank] = node
