"""Job state to and from a JSON document (pure: no files here).

What survives a restart: jobs, generations, membership, barrier counts, the
key-value store and the digests of used ids. What never does: the unique id
itself (a bearer credential) and tokens. On restore, a job that was still
forming is fenced by a new generation (its members redo the join, rank 0 with a
fresh id); a running job keeps running and its members reattach their
heartbeats within the heartbeat timeout.
"""

from __future__ import annotations

import base64
from typing import Any

from rendezvousd.job import BarrierState, Job, Member
from rendezvousd.model import FailedInfo, JobState, MemberState, Transition
from rendezvousd.state import RendezvousState

SCHEMA = 1


def dump(state: RendezvousState) -> dict[str, Any]:
    return {"schema": SCHEMA, "jobs": [_job(job) for job in state.jobs.values()]}


def _job(job: Job) -> dict[str, Any]:
    return {
        "job_id": job.job_id,
        "num_nodes": job.num_nodes,
        "gpus_per_node": job.gpus_per_node,
        "generation": job.generation,
        "state": job.state.name,
        "members": [
            {
                "rank": m.rank,
                "node_rank": m.node_rank,
                "local_rank": m.local_rank,
                "host": m.host,
                "address": m.address,
                "instance_id": m.instance_id,
                "state": m.state.name,
            }
            for m in job.members.values()
        ],
        "host_nodes": job.host_nodes,
        "id_digest": (job.id_digest() or b"").hex(),
        "used_id_digests": sorted(d.hex() for d in job.used_id_digests),
        "failed": [{"rank": f.rank, "host": f.host, "cause": f.cause} for f in job.failed],
        "abort_reason": job.abort_reason,
        "barriers": {name: b.completed for name, b in job.barriers.items()},
        "kv": {key: base64.b64encode(value).decode("ascii") for key, value in job.kv.items()},
    }


def load(state: RendezvousState, doc: dict[str, Any], now: float) -> None:
    """Rebuild ``state`` from ``dump`` output. Raises KeyError/ValueError/TypeError if malformed."""
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"unsupported state schema {doc.get('schema')!r} (expected {SCHEMA})")
    for raw in doc["jobs"]:
        job = Job(
            str(raw["job_id"]),
            int(raw["num_nodes"]),
            int(raw["gpus_per_node"]),
            int(raw["generation"]),
            JobState[raw["state"]],
            now,
        )
        job.used_id_digests = {bytes.fromhex(d) for d in raw["used_id_digests"]}
        if raw["id_digest"]:
            job.restored_id_digest = bytes.fromhex(raw["id_digest"])
            job.used_id_digests.add(job.restored_id_digest)
        if job.state is JobState.FORMING:
            # Mid-bootstrap: nobody can have the id from us any more. Fence it.
            job.state = JobState.ENDED
            job.open_generation(now)
            state.jobs[job.job_id] = job
            state.take_effects()
            state._effects.append(
                Transition(
                    job.job_id,
                    job.generation,
                    None,
                    JobState.FORMING,
                    "fenced by a new generation after restart",
                )
            )
            continue
        for m in raw["members"]:
            member = Member(
                int(m["rank"]),
                int(m["node_rank"]),
                int(m["local_rank"]),
                str(m["host"]),
                str(m["address"]),
                str(m["instance_id"]),
                MemberState[m["state"]],
            )
            member.last_seen = now  # a full heartbeat timeout to reattach
            job.members[member.rank] = member
        job.left = sum(m.state is MemberState.LEFT for m in job.members.values())
        job.host_nodes = {str(h): int(n) for h, n in raw["host_nodes"].items()}
        job.failed = [
            FailedInfo(int(f["rank"]), str(f["host"]), str(f["cause"])) for f in raw["failed"]
        ]
        job.abort_reason = str(raw["abort_reason"])
        job.barriers = {str(n): BarrierState(completed=int(c)) for n, c in raw["barriers"].items()}
        job.kv = {str(k): base64.b64decode(v) for k, v in raw["kv"].items()}
        job.kv_bytes = sum(len(k) + len(v) for k, v in job.kv.items())
        if job.state is JobState.RUNNING:
            job.member_table = tuple(job.members[r].info() for r in sorted(job.members))
            job.restored = True
        state.jobs[job.job_id] = job
        state._effects.append(Transition(job.job_id, job.generation, None, job.state, "restored"))
