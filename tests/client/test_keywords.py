"""A misspelt or missing keyword is Python's own TypeError, naming it, in every
client and transport: ``**kwargs: Unpack[...]`` is checked by mypy but not by the
interpreter, so without the SDK's check a misspelt option was dropped silently and
``join(world_size=4)`` failed with ``KeyError: 'num_nodes'`` from inside the SDK."""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rendezvousd.client import (
    AsyncRendezvousClient,
    FileRendezvous,
    InvalidRequest,
    RendezvousClient,
)

# Nothing listens there: each check must refuse before any call is made.
ENDPOINT = "127.0.0.1:9"


def test_a_misspelt_option_is_refused_by_both_clients() -> None:
    for make in (RendezvousClient, AsyncRendezvousClient):
        message = rf"^{make.__name__}\(\) got .*'reconect_window'.*reconnect_window"
        with pytest.raises(TypeError, match=message):
            make(ENDPOINT, "j", token="t", reconect_window=5.0)  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("keywords", "message"),
    [
        ({"world_size": 4}, r"join\(\) got unexpected keyword argument\(s\) 'world_size'"),
        ({"num_nodes": 1}, r"join\(\) missing .* 'gpus_per_node', 'local_rank'$"),
    ],
)
def test_join_names_the_bad_keyword_in_every_transport(
    keywords: dict[str, Any], message: str, tmp_path: Path
) -> None:
    with (
        RendezvousClient(ENDPOINT, "j", token="t") as client,
        pytest.raises(TypeError, match=message),
    ):
        client.join(**keywords)

    async def aio() -> None:
        async with AsyncRendezvousClient(ENDPOINT, "j", token="t") as client:
            with pytest.raises(TypeError, match=message):
                await client.join(**keywords)

    asyncio.run(aio())
    with pytest.raises(TypeError, match=message):
        FileRendezvous(tmp_path / "rdzv", "j").join(**keywords)


def test_join_node_names_the_missing_keywords() -> None:
    missing = pytest.raises(TypeError, match=r"'gpus_per_node', 'max_nodes'$")
    with RendezvousClient(ENDPOINT, "j", token="t") as client, missing:
        client.join_node(min_nodes=1)  # type: ignore[call-arg]


def test_a_join_timeout_of_none_is_the_default_as_for_join_node() -> None:
    """None was refused as "not a wait the SDK can send", where join_node() and
    protocol.md take it as the default."""
    client = RendezvousClient(ENDPOINT, "j", token="t", connect_timeout=0.2)
    with client, pytest.raises(Exception) as raised:
        client.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=None)
    assert not isinstance(raised.value, InvalidRequest), raised.value


def test_the_optional_keywords_are_not_required() -> None:
    # Only the required ones given: the check lets the call go on (here to a
    # daemon that is not there, which is a different error).
    client = RendezvousClient(ENDPOINT, "j", token="t", connect_timeout=0.2)
    with client, pytest.raises(Exception) as raised:
        client.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=0.5)
    assert not isinstance(raised.value, TypeError), raised.value


@pytest.mark.parametrize(
    ("call", "keyword"),
    [
        (lambda: RendezvousClient(ENDPOINT, "j", token="t", call_timeout=None), "call_timeout"),
        # Every call then failed "is the daemon running and reachable?".
        (lambda: RendezvousClient(ENDPOINT, "j", token="t", call_timeout=0), "call_timeout"),
        (lambda: RendezvousClient(ENDPOINT, "j", token="t", connect_timeout=-1), "connect_timeout"),
        (
            lambda: AsyncRendezvousClient(ENDPOINT, "j", token="t", leave_timeout=math.inf),
            "leave_timeout",
        ),
        (
            lambda: _client().join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=1e9),
            "timeout",
        ),
        (
            lambda: _client().join_node(
                min_nodes=1, max_nodes=1, gpus_per_node=1, last_call=math.nan
            ),
            "last_call",
        ),
        (lambda: _client().barrier("b", timeout=math.inf), "timeout"),
        (lambda: _client().kv_get("k", timeout=-1), "timeout"),
        # Deadlines of calls that wait for no peer: 0 meant call_timeout (a stopped
        # daemon held them 2 x 30 s), and taken as asked it fails at a daemon that is
        # fine, said as a daemon that does not answer.
        (lambda: _client().kv_get("k", wait=False, timeout=0), "timeout"),
        (lambda: _client().report_failure(0, "boom", timeout=0), "timeout"),
        # A window of 0 was read as the default window.
        (
            lambda: RendezvousClient(ENDPOINT, "j", token="t", reconnect_window=0),
            "reconnect_window",
        ),
    ],
)
def test_a_wait_no_call_can_carry_is_refused_naming_it(call: Any, keyword: str) -> None:
    """None as call_timeout made calls without a deadline (a hang on a silent daemon);
    an infinite, huge or negative wait failed with a bare OverflowError/ValueError from
    deep inside, naming nothing."""
    with pytest.raises(InvalidRequest, match=rf"\(\) {keyword}=.* is not a wait"):
        call()


_made: list[RendezvousClient] = []


@pytest.fixture(autouse=True)
def _close_made() -> Iterator[None]:
    yield
    while _made:
        _made.pop().close()


def _client() -> RendezvousClient:
    _made.append(RendezvousClient(ENDPOINT, "j", token="t", connect_timeout=0.1))
    return _made[-1]


@pytest.mark.parametrize(
    ("endpoint", "said"),
    [
        ("localhost", "is malformed: expected 'host:port'"),  # gRPC dialed port 443
        ("garbage::x", "wrap IPv6 hosts as '[addr]:port'"),
        ("host:0", "has port '0'"),
        # Each waited out connect_timeout, then named no reason (or "no socket at //sock").
        ("https://127.0.0.1:9", "is a URL, not a daemon's address"),
        ("grpc://daemon:9", "is a URL, not a daemon's address"),
        ("unix://sock", "is a URL, not a daemon's address"),
        # int() took these digits; the client dialled the port they make.
        ("127.0.0.1:\u0663\u0664", "has port"),
    ],
)
def test_an_endpoint_no_daemon_can_be_at_is_refused_at_once(endpoint: str, said: str) -> None:
    """gRPC took these as targets, and every call waited its whole connect timeout
    before "could not be connected", as for a daemon that is down."""
    for make in (RendezvousClient, AsyncRendezvousClient):
        with pytest.raises(InvalidRequest, match=re.escape(said)):
            make(endpoint, "j", token="t")
    for fine in (
        "127.0.0.1:9",
        "[::1]:9",
        "unix:/run/rendezvousd.sock",
        "unix:///run/rendezvousd.sock",
        "dns:///daemon:9",
    ):
        RendezvousClient(fine, "j", token="t").close()
