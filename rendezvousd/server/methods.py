"""What each Rendezvous method may do: the one table the token scopes and the servicer's
durability rules read, instead of a set of method names in each of them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Policy:
    # A job token may call it for its own job (it names one job and acts on it only).
    job_scoped: bool = True
    # Answered for every scope, but a job token sees only its own job.
    filtered: bool = False
    # Changes nothing: answered at once, read again should a commit it saw fail.
    read_only: bool = False
    # Its handler makes its change durable itself (``_durably``), before its effects.
    self_durable: bool = False
    # Applied even while storage is known to be down, not refused up front: a goodbye,
    # which a failed commit's undo keeps (``Attendee.said_goodbye``), so that the
    # member's end is not then read as its loss.
    goodbye: bool = False


_READ = Policy(read_only=True)
_DURABLE = Policy(self_durable=True)

POLICY: dict[str, Policy] = {
    "Join": Policy(),
    "PublishId": Policy(),
    # A node agent joins and reports its workers' failures for its own job.
    "JoinNode": Policy(),
    "ReportFailure": _DURABLE,
    # A member's lazy fetch of its generation's table (slim joins).
    "GetMembers": _READ,
    "Barrier": Policy(),
    "KvSet": _DURABLE,
    "KvGet": _READ,
    "KvAdd": _DURABLE,
    "KvCompareAndSet": _DURABLE,
    "KvDelete": _DURABLE,
    "Heartbeat": Policy(),
    "Leave": Policy(self_durable=True, goodbye=True),
    "GetJob": _READ,
    # The SDK's abort() (the trainer's NCCL init retry, a failing rank) aborts its own
    # job: a job token must be able to.
    "AbortJob": _DURABLE,
    "ListJobs": Policy(job_scoped=False, filtered=True, read_only=True),
    # Any valid token may open the stream: each call on it is authorized as its method.
    "Calls": Policy(job_scoped=False, filtered=True),
    "CallBatches": Policy(job_scoped=False, filtered=True),
}

# Not a Rendezvous method (reflection): only an admin token may call it.
_ADMIN_ONLY = Policy(job_scoped=False)


def policy(method: str) -> Policy:
    """``method``'s policy (bare name); an unknown method is admin-only."""
    return POLICY.get(method, _ADMIN_ONLY)
