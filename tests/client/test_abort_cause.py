"""An abort's cause told as data (AbortJobRequest.cause): what peers act on, never the
words of its reason, which any caller of abort() chooses."""

from __future__ import annotations

import queue

import pytest

from rendezvousd.client import InvalidRequest, JobAborted, RendezvousClient, RendezvousError
from rendezvousd.client.membership import LOOPBACK_ADDRESS, loopback_refused
from tests.support import LOOPBACK_SENTENCE as SENTENCE
from tests.support import DaemonProcess, parallel


@pytest.mark.parametrize("cause", ["", LOOPBACK_ADDRESS])
def test_a_loopback_refusal_is_told_by_its_cause_not_by_its_words(
    daemon: DaemonProcess, job_id: str, cause: str
) -> None:
    """An abort in loopback_conflict's very words but without the cause is an abort
    like any other (before, its peers took it for the loopback refusal: rendezvous-run
    exited 2, its restarts unused); with the cause, it is the refusal, on the heartbeat
    stream's event and in the daemon's error alike."""
    a = RendezvousClient(daemon.endpoint, job_id, token=daemon.token)
    b = RendezvousClient(daemon.endpoint, job_id, token=daemon.token)
    try:
        join = {"num_nodes": 1, "gpus_per_node": 2, "timeout": 20}
        parallel([lambda: a.join(local_rank=0, **join), lambda: b.join(local_rank=1, **join)])
        failures: queue.Queue[RendezvousError] = queue.Queue()
        b.start_heartbeat(0.2, on_failure=failures.put)
        a.abort(SENTENCE, cause=cause)
        heard = failures.get(timeout=10)
        assert isinstance(heard, JobAborted), heard
        assert heard.abort_reason == SENTENCE, heard.abort_reason
        assert (heard.abort_cause, loopback_refused(heard)) == (cause, bool(cause))
        with pytest.raises(JobAborted) as info:  # the daemon's own JOB_ABORTED error
            b.barrier(timeout=5)
        assert info.value.abort_reason == SENTENCE, info.value
        assert (info.value.abort_cause, loopback_refused(info.value)) == (cause, bool(cause))
    finally:
        a.close()
        b.close()


def test_an_unknown_abort_cause_is_refused_before_it_is_sent(
    daemon: DaemonProcess, job_id: str
) -> None:
    with (
        RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as c,
        pytest.raises(InvalidRequest) as info,
    ):
        c.abort("over", cause="LOOPBACK")
    message = str(info.value)
    assert "abort() cause='LOOPBACK' is not an abort cause" in message, message
    assert "LOOPBACK_ADDRESS" in message, message


@pytest.mark.parametrize("close", [False, True])
def test_a_close_is_told_as_data_on_the_event_and_in_the_error(
    daemon: DaemonProcess, job_id: str, close: bool
) -> None:
    """Whether an abort closed the run (``close_run``) is data on the heartbeat
    stream's event and in the daemon's JOB_ABORTED error, "false" too, so that a reader
    (the torchrun handler) tells a close from an abort in a close's words, and a
    daemon from before (nothing said) from both. The event said nothing: peers matched
    the reason's words."""
    words = "rendezvous closed by torchrun: or so it says"
    a = RendezvousClient(daemon.endpoint, job_id, token=daemon.token)
    b = RendezvousClient(daemon.endpoint, job_id, token=daemon.token)
    try:
        join = {"num_nodes": 1, "gpus_per_node": 2, "timeout": 20}
        parallel([lambda: a.join(local_rank=0, **join), lambda: b.join(local_rank=1, **join)])
        failures: queue.Queue[RendezvousError] = queue.Queue()
        b.start_heartbeat(0.2, on_failure=failures.put)
        if close:
            assert a.close_run(words, generation=1)
        else:
            a.abort(words)
        heard = failures.get(timeout=10)
        assert isinstance(heard, JobAborted), heard
        said = "true" if close else "false"
        assert (heard.metadata.get("closed"), heard.closed) == (said, close), heard.metadata
        # Heard on its stream, a member's: "placed" as in the daemon's error below (the
        # barrier may raise either: the failure heard, or the daemon's answer).
        assert heard.metadata.get("placed") == ("true" if close else None), heard.metadata
        with pytest.raises(JobAborted) as info:  # the daemon's own JOB_ABORTED error
            b.barrier(timeout=5)
        assert (info.value.metadata.get("closed"), info.value.closed) == (said, close)
        assert info.value.metadata.get("placed") == ("true" if close else None)
    finally:
        a.close()
        b.close()
