"""Arguments no request field can carry are InvalidRequest, naming the call and the
argument, before anything is sent: each raised a bare TypeError, ValueError or
AttributeError from inside protobuf or the SDK (a careless caller's probe, session 35)."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.client import AsyncRendezvousClient, InvalidRequest, RendezvousClient
from tests.support import DaemonProcess

# What os.fsdecode() makes of a file name's undecodable byte: protobuf raised a bare
# UnicodeEncodeError naming no argument (an SDK misuse review).
UNENCODABLE = b"ckpt-\xff".decode("utf-8", "surrogateescape")

CASES: list[tuple[str, Callable[[RendezvousClient], Any], str]] = [
    ("kv_set surrogate", lambda c: c.kv_set(UNENCODABLE, b"v"), "kv_set() key='ckpt-\\udcff'"),
    ("barrier surrogate", lambda c: c.barrier(UNENCODABLE), "barrier() name='ckpt-\\udcff'"),
    ("abort surrogate", lambda c: c.abort(UNENCODABLE), "abort() reason='ckpt-\\udcff'"),
    # Refused "not a wait ... from 0 to 2592000", though 0.5 is in range (a review).
    (
        "numpy float wait",
        lambda c: c.barrier("b", timeout=np.float32(0.5)),
        "barrier() timeout=np.float32(0.5) is a float32: give seconds as a Python float",
    ),
    # A float64 is a float: out of range, its range is what is wrong (a review).
    (
        "numpy float64 out of range",
        lambda c: c.barrier("b", timeout=np.float64(-1.0)),
        "barrier() timeout=np.float64(-1.0) is not a wait the SDK can send",
    ),
    ("get_job", lambda c: c.get_job(5), "get_job() job_id=5"),
    ("kv_get wait", lambda c: c.kv_get("k", wait="no"), "kv_get() wait='no'"),  # type: ignore[arg-type]
    ("report_failure cause", lambda c: c.report_failure(0, b"x"), "report_failure() cause=b'x'"),  # type: ignore[arg-type]
    ("report_failure rank", lambda c: c.report_failure(-1, "x"), "report_failure() local_rank=-1"),
    ("report_progress steps", lambda c: c.report_progress(-1), "report_progress() steps=-1"),  # type: ignore[arg-type]
    ("report_progress str", lambda c: c.report_progress("x"), "report_progress() steps='x'"),
    ("report_progress range", lambda c: c.report_progress([2**63]), "steps=[9223372036854775808]"),
    (
        "report_progress restarts",
        lambda c: c.report_progress([1, None], restarts_used=-1),
        "report_progress() restarts_used=-1",
    ),
    ("attach", lambda c: c.attach("x", "y"), "attach() membership='x'"),  # type: ignore[arg-type]
    # A count's range starts at 1: "from 0" named a value the daemon refuses.
    (
        "join num_nodes",
        lambda c: c.join(num_nodes=-1, gpus_per_node=1, local_rank=0, timeout=5),
        "join() num_nodes=-1 is not an int from 1 to 4294967295",
    ),
    (
        "join gpus_per_node 0",
        lambda c: c.join(num_nodes=1, gpus_per_node=0, local_rank=0, timeout=5),
        "join() gpus_per_node=0 is not an int from 1 to 4294967295",
    ),
    (
        "join local_rank",
        lambda c: c.join(num_nodes=1, gpus_per_node=1, local_rank=-1, timeout=5),
        "join() local_rank=-1 is not an int from 0 to 4294967295",
    ),
    (
        "join_node min_nodes",
        lambda c: c.join_node(min_nodes=0, max_nodes=2, gpus_per_node=1, timeout=5),
        "join_node() min_nodes=0 is not an int from 1 to 4294967295",
    ),
    (
        "join_node max_nodes",
        lambda c: c.join_node(min_nodes=1, max_nodes=2**32, gpus_per_node=1, timeout=5),
        "join_node() max_nodes=4294967296 is not an int from 1 to 4294967295",
    ),
    (
        "join_node launched nan",
        lambda c: c.join_node(min_nodes=1, max_nodes=1, gpus_per_node=1, launched=float("nan")),
        "join_node() launched=nan is not float or None",
    ),
]


def test_a_float_argument_takes_an_int_and_a_launch_long_ago(daemon: DaemonProcess) -> None:
    """``launched=0`` (a float argument given an int, as Python's own take one) was
    refused as "not float or None"; a launch further back than the field can say is
    said as its largest value, not a protobuf ValueError (review)."""
    for i, launched in enumerate((0, -1e300)):
        # A job each: the second join of one job, launched before its first run ended,
        # is refused JobEnded (a node launched for the run that ended).
        with RendezvousClient(daemon.endpoint, f"args-launched-{i}", token=daemon.token) as c:
            m = c.join_node(min_nodes=1, max_nodes=1, gpus_per_node=1, launched=launched)
            assert m.world_size == 1
            c.leave()


@pytest.mark.parametrize(("name", "call", "said"), CASES, ids=[c[0] for c in CASES])
def test_an_argument_no_request_can_carry_is_refused_naming_it(
    name: str, call: Callable[[RendezvousClient], Any], said: str, daemon: DaemonProcess
) -> None:
    with (
        RendezvousClient(daemon.endpoint, "args", token=daemon.token) as c,
        pytest.raises(InvalidRequest) as refused,
    ):
        call(c)
    assert said in str(refused.value), refused.value


@pytest.mark.parametrize("count", [1, 3])
def test_join_node_refuses_addresses_that_are_not_one_per_local_rank_in_both_clients(
    daemon: DaemonProcess, job_id: str, count: int
) -> None:
    """Fewer were taken (the other ranks had no address: their peers could not reach
    them); more were refused only by the daemon, after the round trip."""
    noun = "address" if count == 1 else "addresses"
    said = f"addresses= gives {count} {noun} for gpus_per_node=2: give one per local rank (2)"
    keywords: dict[str, Any] = {
        "min_nodes": 1,
        "max_nodes": 1,
        "gpus_per_node": 2,
        "addresses": ["127.0.0.1"] * count,
        "timeout": 10,
    }
    with (
        RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as c,
        pytest.raises(InvalidRequest) as refused,
    ):
        c.join_node(**keywords)
    assert said in str(refused.value), refused.value

    async def aio() -> None:
        async with AsyncRendezvousClient(daemon.endpoint, job_id, token=daemon.token) as c:
            with pytest.raises(InvalidRequest) as refused:
                await c.join_node(**keywords)
            assert said in str(refused.value), refused.value

    asyncio.run(aio())


def test_leave_refuses_a_final_that_is_not_a_bool_and_keeps_the_member_in_both_clients(
    daemon: DaemonProcess, job_id: str
) -> None:
    """``final="yes"`` was taken as truthy text; a refusal after the goodbye's start
    would have forgotten the member without a word to the daemon."""
    with RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as c:
        c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        with pytest.raises(InvalidRequest, match=re.escape("leave() final='yes' is not bool")):
            c.leave(final="yes")  # type: ignore[arg-type]
        assert c.membership is not None and c.failure is None
        c.leave()

    async def aio() -> None:
        async with AsyncRendezvousClient(daemon.endpoint, job_id, token=daemon.token) as c:
            await c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
            with pytest.raises(InvalidRequest, match=re.escape("leave() final=1 is not bool")):
                await c.leave(final=1)  # type: ignore[arg-type]
            assert c.membership is not None and c.failure is None
            await c.leave(final=True)

    asyncio.run(aio())


def test_a_job_id_that_is_not_text_is_refused_when_the_client_is_made(
    daemon: DaemonProcess,
) -> None:
    with pytest.raises(InvalidRequest, match=r"RendezvousClient\(\) job_id=5 is not str"):
        RendezvousClient(daemon.endpoint, 5, token=daemon.token)  # type: ignore[arg-type]


def test_a_node_membership_refuses_a_local_rank_it_does_not_have() -> None:
    from rendezvousd.client.membership import NodeMembership

    node = NodeMembership.__new__(NodeMembership)
    object.__setattr__(node, "gpus_per_node", 2)
    for bad in (5, -1, "0", True):
        with pytest.raises(InvalidRequest, match="local_rank"):
            node.membership_for(bad)  # type: ignore[arg-type]


SECRET = "QPr6JqgGbYUjxjkpgYYuCasGEssuTBo3bYRPrBMZ9Fo"


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (
            lambda: RendezvousClient("127.0.0.1:1", "j", token=SECRET.encode()),
            "token=<a bytes of 43",
        ),
        (
            lambda: RendezvousClient("127.0.0.1:1", "j", token=SECRET).join(
                num_nodes=1, gpus_per_node=1, local_rank=0, unique_id=bytearray(SECRET.encode())
            ),
            "unique_id=<a bytearray of 43",
        ),
        (
            lambda: RendezvousClient("127.0.0.1:1", "j", token=SECRET).join(
                num_nodes=1, gpus_per_node=1, local_rank=0, unique_id=list(SECRET.encode())
            ),
            "unique_id=<a list of 43",
        ),
    ],
    ids=["token bytes", "id bytearray", "id list"],
)
def test_a_secret_of_the_wrong_type_is_refused_without_showing_it(
    make: Callable[[], Any], said: str
) -> None:
    """A token read from its file in binary mode was echoed whole in the error, and
    rank 0's id in its first 60 characters (an SDK misuse review)."""
    with pytest.raises(InvalidRequest) as info:
        make()
    assert said in str(info.value), info.value
    assert SECRET[:8] not in str(info.value) and "81, 80" not in str(info.value), info.value


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ({"id_factory": lambda: tuple(range(128))}, "id_factory() returned <a tuple of 128, not"),
        ({"id_factory": lambda: "x" * 128}, "id_factory() returned <a str of 128, not shown>"),
        ({"unique_id": b""}, "unique id must be exactly 128 bytes, got 0"),
    ],
    ids=["factory tuple", "factory str", "empty id"],
)
def test_rank_0s_id_of_the_wrong_kind_is_refused_naming_it(
    daemon: DaemonProcess, job_id: str, given: dict[str, Any], said: str
) -> None:
    """A factory's tuple (NCCL's get_unique_id() before bytes()) raised protobuf's bare
    TypeError; unique_id=b"" was taken for "none given" and replaced by random bytes
    (an SDK misuse review)."""
    with (
        RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as c,
        pytest.raises(InvalidRequest) as info,
    ):
        c.join(num_nodes=1, gpus_per_node=1, local_rank=0, node_rank=0, timeout=5, **given)
    assert said in str(info.value), info.value


def test_an_asyncio_client_made_in_a_thread_without_a_loop_is_refused_saying_where() -> None:
    """asyncio's bare RuntimeError "There is no current event loop in thread ..." came
    from inside grpc.aio (an SDK misuse review)."""
    raised: list[BaseException] = []

    def make() -> None:
        try:
            AsyncRendezvousClient("127.0.0.1:1", "j", token="t" * 32)
        except BaseException as exc:
            raised.append(exc)

    maker = threading.Thread(target=make)
    maker.start()
    maker.join(30)
    assert len(raised) == 1 and isinstance(raised[0], InvalidRequest), raised
    assert "made in a thread with no event loop" in str(raised[0]), raised


def test_an_asyncio_leave_on_another_loop_is_refused_and_loses_nothing(
    daemon: DaemonProcess, job_id: str
) -> None:
    """Refused, it had still stopped the heartbeat and forgotten the membership without
    a goodbye: the job failed "heartbeat stream closed" (an SDK misuse review)."""
    from tests.client.test_twins import Twin

    c = Twin("aio", daemon.endpoint, job_id, token=daemon.token)
    try:
        c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=10)
        c.start_heartbeat(0.2)
        with pytest.raises(InvalidRequest, match="outside the event loop"):
            asyncio.run(c.client.leave())
        assert c.membership is not None and c.failure is None
        c.kv_set("k", b"v")
        c.leave()
        with RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as look:
            assert look.get_job(job_id).summary.state == pb.JobState.JOB_STATE_ENDED
    finally:
        c.close()
