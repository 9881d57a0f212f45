"""The fault a change gets when it cannot be made durable (``STORAGE_UNAVAILABLE``).

Raised by the persister and by the servicer for the calls a failed commit
released; the fault becomes a gRPC status in ``server/fault_status.py`` like any other.
"""

from __future__ import annotations

from rendezvousd.errors import Code, Reason, RendezvousFault

STORAGE_UNAVAILABLE = Reason.STORAGE_UNAVAILABLE


def storage_unavailable(
    job_id: str, *, waiting: bool = False, goodbye: bool = False, cause: str | None = None
) -> RendezvousFault:
    """A change could not be made durable, so it was not applied (no paths: they are
    the operator's business, logged by the daemon, not the caller's); ``waiting``: the
    words for a parked call released because its job was put back to its durable state;
    ``goodbye``: for a Leave, which the undo keeps (``Attendee.said_goodbye``);
    ``cause``: why, where it is the daemon's operator's to fix and not the disk's (it
    ran out of open files)."""
    cannot = "the daemon cannot write its state storage" + (
        "" if cause is None else f" ({cause}: its operator must raise its open-file limit)"
    )
    if goodbye:
        said = (
            f"{cannot}: this goodbye from job {job_id!r} "
            "is kept in its memory and written once storage is back, nothing to retry "
            "(a daemon restarted before then forgets it)"
        )
    else:
        what = (
            f"job {job_id!r} was put back to its last durable state and this waiting call released"
            if waiting
            else f"this change to job {job_id!r} was not applied"
        )
        said = f"{cannot}, so {what}; retry once the daemon's health is SERVING again"
    return RendezvousFault(Code.UNAVAILABLE, STORAGE_UNAVAILABLE, said, {"job_id": job_id})


def kept_goodbye(fault: RendezvousFault, job_id: str) -> RendezvousFault:
    """What a Leave's caller is told when the commit of its goodbye failed: the undo
    keeps a formed generation's goodbye (``Attendee.said_goodbye``), so it is not told
    "not applied; retry" as other changes are. Any other fault as it is."""
    return (
        storage_unavailable(job_id, goodbye=True) if fault.reason is STORAGE_UNAVAILABLE else fault
    )
