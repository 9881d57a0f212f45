"""The status page's generation timeline names what each change meant for the job:
a scale-up is not a failure, and a re-formed world that grew or shrank says so."""

from __future__ import annotations

import time

from rendezvousd.common.model import SCALE_UP_REASON, JobState, Transition
from rendezvousd.web.timeline import Timeline

F, R, A, X = JobState.FORMING, JobState.RUNNING, JobState.ABORTED, JobState.FAILED


def test_scale_up_grow_shrink_and_re_form_are_named() -> None:
    t = Timeline()
    for gen, old, new, detail, world in [
        (1, None, F, "created", 4),
        (1, F, R, "2 node(s) joined (4 ranks)", 4),
        (1, R, A, SCALE_UP_REASON, 4),
        (2, A, F, "new generation", 4),
        (2, F, R, "3 node(s) joined (6 ranks)", 6),
        (2, R, X, "lost rank 5 on h2 (signal SIGKILL)", 6),
        (3, X, F, "new generation", 6),
        (3, F, R, "2 node(s) joined (4 ranks)", 4),
        (3, R, X, "lost rank 1 on h0 (exit code 1)", 4),
        (4, X, F, "new generation", 4),
        (4, F, R, "2 node(s) joined (4 ranks)", 4),
    ]:
        t.record(Transition("j", gen, old, new, detail, world))
    changes = [(e.generation, e.new, e.change) for e in t.of("j") if e.change]
    assert changes == [
        (1, "ABORTED", "scale-up"),
        (2, "RUNNING", "grew 4 -> 6 ranks"),
        (3, "RUNNING", "shrank 6 -> 4 ranks"),
        (4, "RUNNING", "re-formed"),
    ]
    # Two failures (the job record counts them, ``Transition.failure``); the
    # scale-up's abort is a membership change, not counted.
    assert [(e.generation, e.new) for e in t.of("j") if e.new in ("FAILED", "ABORTED")] == [
        (1, "ABORTED"),
        (2, "FAILED"),
        (3, "FAILED"),
    ]
    assert not Transition("j", 1, R, A, SCALE_UP_REASON, 4).failure
    assert Transition("j", 3, R, X, "lost rank 1 on h0 (exit code 1)", 4).failure
    t.record(Transition("j", 4, R, None, "expired"))
    assert t.of("j") == []


def test_an_operators_abort_is_counted() -> None:
    t = Timeline()
    t.record(Transition("j", 1, F, R, "1 node(s) joined (2 ranks)", 2))
    abort = Transition("j", 1, R, A, "aborted from the status page by admin", 2)
    t.record(abort)
    assert abort.failure and t.of("j")[-1].change == ""


def test_a_restored_jobs_entry_is_stamped_with_when_it_entered_its_state() -> None:
    """After a restart the timeline's first entry for a failed job read the restart's
    time: the failure seemed to have just happened."""
    t = Timeline()
    an_hour_ago = time.monotonic() - 3600
    t.record(Transition("j", 2, None, X, "restored: rank 1 on h0 (boom)", 4, True, an_hour_ago))
    (entry,) = t.of("j")
    assert abs(entry.at - (time.time() - 3600)) < 60, entry
    assert entry.detail == "restored: rank 1 on h0 (boom)"
