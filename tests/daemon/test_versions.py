"""Nodes of one job running different rendezvousd versions, in the pure state machine:
a node agent whose ``wire_version`` differs from the generation's nodes' is refused
VERSION_MISMATCH at its join, naming both hosts and both versions (the job used to
form, fail in the CPU ring's handshake and burn every restart on "exit code 1")."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from rendezvousd.common.model import JobState, JoinMode, JoinResult, Parked, Wake, Warn
from rendezvousd.errors import Code, RendezvousFault
from rendezvousd.state.machine import JoinArgs, RendezvousState
from rendezvousd.storage.persistence import Persister

ID, ID2 = b"\x02" * 128, b"\x03" * 128
NEW, OLD = "RDVRING3", "RDVRING2"


def node(
    inst: str, wire: str, *, lo: int = 2, hi: int = 2, uid: bytes = b"", standby: bool = False
) -> JoinArgs:
    return JoinArgs(
        "j",
        lo,
        hi,
        2,
        None,
        f"host-{inst}",
        (),
        uid,
        inst,
        60.0,
        last_call_s=1.0,
        standby=standby,
        wire_version=wire,
    )


def refused(sm: RendezvousState, args: JoinArgs, now: float = 1.0) -> RendezvousFault:
    with pytest.raises(RendezvousFault) as info:
        sm.join(args, now)
    return info.value


def first(sm: RendezvousState, args: JoinArgs, now: float = 0.0, uid: bytes = ID) -> Parked:
    """Node 0's two calls: asked for the id, then parked with it."""
    asked = sm.join(args, now)
    assert isinstance(asked, JoinResult) and asked.id_required
    parked = sm.join(replace(args, unique_id=uid), now)
    assert isinstance(parked, Parked)
    return parked


def woken(sm: RendezvousState) -> dict[int, object]:
    return {
        e.waiter: e.value if e.fault is None else e.fault
        for e in sm.take_effects()
        if isinstance(e, Wake)
    }


def running(sm: RendezvousState, wire: str, *, lo: int = 2, hi: int = 2) -> None:
    """Nodes a and b of ``wire`` formed generation 1."""
    first(sm, node("a", wire, lo=lo, hi=hi))
    sm.join(node("b", wire, lo=lo, hi=hi), 0.0)
    sm.tick(1.5)  # an elastic job forms at its last call (1 s)
    assert sm.jobs["j"].state is JobState.RUNNING
    sm.take_effects()


def test_a_node_of_another_version_is_refused_alone_naming_both() -> None:
    """Only the newcomer: its wire_version is its own word, so failing the forming
    generation on it let any JoinNode that sent another (a stale pod of an older
    rollout, anyone holding the job's token) end every node agent of the launch, each
    exiting on VERSION_MISMATCH with no restart."""
    sm = RendezvousState()
    parked = first(sm, node("a", NEW, lo=3, hi=3))
    sm.take_effects()
    f = refused(sm, node("b", OLD, lo=3, hi=3))
    assert f.code is Code.FAILED_PRECONDITION and f.reason == "VERSION_MISMATCH"
    assert "the node agent on host 'host-b'" in f.message and "'host-a'" in f.message
    assert "its wire version is 'RDVRING2', theirs 'RDVRING3'" in f.message, f.message
    assert "upgrade every node of the job to the same rendezvousd" in f.message
    assert f.metadata["wire_version"] == NEW and f.metadata["requested_wire_version"] == OLD
    assert f.metadata["offending_host"] == "host-b" and f.metadata["hosts"] == "host-a"
    assert f.metadata["job_id"] == "j" and f.metadata["generation"] == "1"
    job = sm.jobs["j"]
    assert job.state is JobState.FORMING and job.gen.conflict is None
    effects = sm.take_effects()
    assert parked.waiter not in {e.waiter for e in effects if isinstance(e, Wake)}
    # Counted and said for the operator, as a running generation's refusal is.
    said = [e for e in effects if isinstance(e, Warn)]
    assert [w.refused for w in said] == ["VERSION_MISMATCH"], said
    assert "the forming generation goes on" in said[0].message, said[0].message
    # Again and again: the node joined never hears of it, and the nodes of the
    # generation's version, joining right after, are not refused (the conflict was
    # told to every join of the job for a heartbeat timeout).
    for i in range(3):
        assert refused(sm, node(f"x{i}", OLD, lo=3, hi=3), 1.0 + i).reason == "VERSION_MISMATCH"
    assert isinstance(sm.join(node("b", NEW, lo=3, hi=3), 4.0), Parked)
    assert isinstance(sm.join(node("c", NEW, lo=3, hi=3), 4.0), JoinResult)
    told = woken(sm)[parked.waiter]
    assert isinstance(told, JoinResult), told
    assert job.state is JobState.RUNNING and job.generation == 1
    assert {n.host for n in job.gen.nodes.values()} == {"host-a", "host-b", "host-c"}


@pytest.mark.parametrize("old_first", [True, False])
def test_an_agent_from_before_version_reporting_beside_a_version_is_refused(
    old_first: bool,
) -> None:
    """An older agent sends no wire_version ("", the field's default): the daemon cannot
    tell one whose ring would work from one whose would not, so the mix is refused,
    worded as such, whichever came first."""
    sm = RendezvousState()
    waits, comes = ("", NEW) if old_first else (NEW, "")
    first(sm, node("a", waits))
    f = refused(sm, node("b", comes))
    assert f.reason == "VERSION_MISMATCH"
    said = "not said (a rendezvous-run from before version reporting, 2026-12-07"
    assert said in f.message, f.message
    wire = "its wire version is 'RDVRING3'" if old_first else "theirs 'RDVRING3'"
    assert wire in f.message, f.message


@pytest.mark.parametrize("wire", [NEW, ""], ids=["versioned", "before-versions"])
def test_nodes_of_one_version_form_as_before(wire: str) -> None:
    """Agents of one version form, and so do agents that all predate the field (and
    torchrun's, which send none)."""
    sm = RendezvousState()
    running(sm, wire)
    assert sm.jobs["j"].wire_version == wire


def test_a_scale_up_of_another_version_is_refused_and_the_running_job_goes_on() -> None:
    sm = RendezvousState()
    running(sm, NEW, hi=3)
    f = refused(sm, node("c", OLD, hi=3), 2.0)
    assert f.reason == "VERSION_MISMATCH" and "'host-c'" in f.message
    assert sm.jobs["j"].state is JobState.RUNNING  # the nodes of its version go on
    # One of its own version still parks for the next generation.
    assert isinstance(sm.join(node("d", NEW, hi=3), 2.0), Parked)


def test_a_standby_of_another_version_is_refused_and_the_job_it_backs_goes_on() -> None:
    sm = RendezvousState()
    running(sm, NEW)
    f = refused(sm, node("s", OLD, standby=True), 2.0)
    assert f.reason == "VERSION_MISMATCH" and "'host-s'" in f.message
    assert sm.jobs["j"].state is JobState.RUNNING and sm.jobs["j"].gen.conflict is None


def test_once_the_odd_node_gave_up_the_next_joiner_sets_the_version() -> None:
    """The first node sets the generation's version, so a node of another version that
    came first makes the rest of its launch refused; once its own wait ends (its seat
    freed), upgraded nodes set the version anew and form."""
    sm = RendezvousState()
    odd = first(sm, node("a", OLD))
    refused(sm, node("b", NEW))
    later = 61.0
    sm.cancel_wait(odd.waiter, later, timed_out=True)  # node a's join timed out
    assert not sm.jobs["j"].gen.nodes
    first(sm, node("a2", NEW), later, ID2)
    assert isinstance(sm.join(node("b2", NEW), later), JoinResult)
    assert sm.jobs["j"].state is JobState.RUNNING and sm.jobs["j"].generation == 1
    assert sm.jobs["j"].wire_version == NEW


def test_the_version_is_stored_and_a_row_without_it_takes_the_next_joiners(
    tmp_path: Path,
) -> None:
    sm = RendezvousState()
    running(sm, NEW, hi=3)
    saver = Persister(tmp_path, sm)
    saver.restore()
    saver.close()
    back = RendezvousState()
    Persister(tmp_path, back).restore()
    assert back.jobs["j"].wire_version == NEW
    assert refused(back, node("c", OLD, hi=3), 2.0).reason == "VERSION_MISMATCH"
    # A job restored from a row written before the field: its version is unknown, and
    # its re-joining nodes must not be refused for it.
    back.jobs["j"].wire_version = None
    sm2 = back
    assert isinstance(sm2.join(node("c", OLD, hi=3), 2.0), Parked)
    assert sm2.jobs["j"].wire_version == OLD


def test_a_per_rank_join_sends_no_version_and_is_not_refused_for_it() -> None:
    sm = RendezvousState()
    args = [
        JoinArgs.worker("r", 1, 2, 0, local, "h", "", ID if local == 0 else b"", f"w{local}")
        for local in range(2)
    ]
    assert isinstance(sm.join(args[0], 0.0), Parked)
    assert isinstance(sm.join(args[1], 0.0), JoinResult)
    assert sm.jobs["r"].gen.join_mode is JoinMode.RANK and sm.jobs["r"].wire_version == ""


def test_a_wire_version_too_long_to_store_is_refused() -> None:
    f = refused(RendezvousState(), node("a", "x" * 129), 0.0)
    assert f.reason == "INVALID_ARGUMENT" and "wire_version" in f.message
