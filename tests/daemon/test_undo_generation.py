"""An undo (a failed commit) that goes back across a generation: the job returns to the
generation its last commit wrote, with what that record keeps (a model-based fuzz of the
state machine through the real Persister and SQLite)."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from rendezvousd.common.model import JobState
from rendezvousd.errors import RendezvousFault
from rendezvousd.storage.persistence import Persister
from tests.daemon.test_kept_seats import generation_2_keeps_a_seat
from tests.daemon.test_node_state import fault, node


def test_an_undo_back_to_a_generation_that_kept_seats_keeps_them_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Generation 2 forms keeping a's and s's seats, committed; then, in one group commit,
    it is aborted and a newcomer r opens generation 3, and that commit fails (a full
    disk). The undo put generation 2 back without its kept seats, so r, retrying, took
    a survivor's seat; now the seats are kept again, as a restart keeps them."""
    tmp_path.chmod(0o700)
    sm = generation_2_keeps_a_seat()
    persister = Persister(tmp_path, sm)
    persister.restore()  # writes generation 2, its seats kept
    try:
        sm.take_effects()
        sm.abort("j", 2, "operator", 2.0)
        persister.touch("j")
        sm.join(node("r"), 2.1)  # generation 3 opens
        persister.touch("j")
        assert sm.jobs["j"].generation == 3

        def full_disk(*_: object, **__: object) -> bool:
            raise sqlite3.OperationalError("database or disk is full")

        assert persister.store is not None
        monkeypatch.setattr(persister.store, "write", full_disk)
        with pytest.raises(RendezvousFault) as info:
            asyncio.run(persister.durable("j"))
        assert info.value.reason == "STORAGE_UNAVAILABLE"
    finally:
        persister.close()
    job = sm.jobs["j"]
    assert job.generation == 2 and job.state is JobState.FORMING
    assert job.gen.owed == {"a": "host-a", "s": "host-s"}
    assert fault(sm.join, node("r"), 2.5).reason == "WORLD_FULL"
