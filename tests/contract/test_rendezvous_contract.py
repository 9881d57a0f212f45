"""One rendezvous contract, asserted for every transport (``conftest.world``): the
daemon through ``RendezvousClient`` and ``AsyncRendezvousClient``, a node agent's
``join_node`` with its workers ``attach``ed, and ``FileRendezvous``.

After torch's ``RendezvousBackendTestMixin``: the same tests, one fixture per backend.
"""

from __future__ import annotations

import functools
import threading

import pytest

from rendezvousd.client import (
    InvalidRequest,
    KeyNotFound,
    PeerFailed,
    RendezvousTimeout,
    TopologyMismatch,
)
from rendezvousd.common.validation import UNIQUE_ID_BYTES
from tests.support import parallel

from .conftest import World, together


def test_every_rank_once_in_one_world_of_one_id_and_one_table(world: World) -> None:
    ms = world.memberships
    assert sorted(m.rank for m in ms) == list(range(world.size))
    assert {m.world_size for m in ms} == {world.size}
    ids = {m.unique_id for m in ms}
    assert len(ids) == 1 and len(next(iter(ids))) == UNIQUE_ID_BYTES
    assert {m.job_id for m in ms} == {world.job_id}
    assert len({m.generation for m in ms}) == 1
    tables = [[(x.rank, x.local_rank, x.host) for x in m.members] for m in ms]
    assert all(t == tables[0] for t in tables)
    assert [row[0] for row in tables[0]] == list(range(world.size))
    for m in ms:
        assert m.members[m.rank].rank == m.rank


def test_barrier_releases_only_when_every_rank_arrived(world: World) -> None:
    last = world.size - 1
    # Without the last rank, the others' barrier never releases.
    early = parallel(
        [functools.partial(world.api[r].barrier, "partial", timeout=1.0) for r in range(last)]
    )
    assert all(isinstance(e, RendezvousTimeout) for e in early), early

    # The last rank writes before arriving: whoever is released must see that write.
    def arrive(r: int) -> bytes:
        if r == last:
            world.api[r].kv_set("arrived-last", b"yes")
        world.api[r].barrier("full", timeout=15)
        return bytes(world.api[r].kv_get("arrived-last", wait=False))

    assert (
        together([functools.partial(arrive, r) for r in range(world.size)]) == [b"yes"] * world.size
    )


def test_kv_set_get_overwrite_and_missing(world: World) -> None:
    a, b = world.api[0], world.api[-1]
    with pytest.raises(KeyNotFound):
        b.kv_get("k", wait=False)
    a.kv_set("k", b"one")
    assert b.kv_get("k", wait=False) == b"one"
    b.kv_set("k", b"\x00two")
    assert a.kv_get("k", timeout=5) == b"\x00two"
    with pytest.raises(RendezvousTimeout):
        a.kv_get("never", timeout=0.5)


def test_kv_get_waits_for_a_later_set(world: World) -> None:
    got: list[object] = []
    asked = threading.Thread(target=lambda: got.append(world.api[1].kv_get("later", timeout=15)))
    asked.start()
    world.api[0].kv_set("later", b"value")
    asked.join(20)
    assert got == [b"value"]


def test_kv_add_counts_across_ranks(world: World) -> None:
    assert world.api[0].kv_add("n", 5) == 5
    assert world.api[1].kv_add("n", -2) == 3
    totals = together([functools.partial(a.kv_add, "n") for a in world.api])
    assert sorted(totals) == list(range(4, 4 + world.size))
    assert world.api[-1].kv_get("n", wait=False) == str(3 + world.size).encode()


def test_kv_compare_and_set(world: World) -> None:
    a, b = world.api[0], world.api[-1]
    assert a.kv_compare_and_set("c", None, b"first") == (True, b"first")
    assert b.kv_compare_and_set("c", None, b"again") == (False, b"first")
    assert b.kv_compare_and_set("c", b"wrong", b"x") == (False, b"first")
    assert b.kv_compare_and_set("c", b"first", b"second") == (True, b"second")
    assert a.kv_get("c", wait=False) == b"second"


def test_kv_delete(world: World) -> None:
    a, b = world.api[0], world.api[-1]
    a.kv_set("d", b"v")
    assert b.kv_delete("d") is True
    assert a.kv_delete("d") is False
    with pytest.raises(KeyNotFound):
        a.kv_get("d", wait=False)


def test_a_lost_rank_is_peer_failed_for_the_others(world: World) -> None:
    lost = world.size - 1
    world.lose(lost)
    for r in range(lost):
        with pytest.raises(PeerFailed) as caught:
            world.api[r].barrier("after-loss", timeout=15)
        assert lost in caught.value.ranks, caught.value


def test_a_bad_topology_is_invalid_request(world: World) -> None:
    with pytest.raises(InvalidRequest):
        world.refuse_bad_topology()


def test_a_rank_that_left_is_not_waited_for(world: World) -> None:
    # docs/protocol.md: a barrier releases once every non-leaving member arrived.
    left = world.size - 1
    world.api[left].leave()
    together([functools.partial(a.barrier, "after-leave", timeout=15) for a in world.api[:left]])
    world.api[0].kv_set("still", b"here")
    assert world.api[left - 1].kv_get("still", wait=False) == b"here"


def test_a_newcomer_with_another_topology_is_topology_mismatch(world: World) -> None:
    with pytest.raises(TopologyMismatch):
        world.join_conflicting()
