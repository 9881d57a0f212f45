"""A client whose host lost the address it joined from (re-addressed under it: a DHCP
renewal, a migrated VM) makes its channel anew before its next call: the connection
bound to the removed address still read READY, and each call on it, its final Leave
too, waited its deadline (tests/multihost/test_advertised_address.py shows it on
namespace hosts). Here on loopback, the noted address stood in for by one this host
does not have (TEST-NET-1)."""

from __future__ import annotations

from rendezvousd.client import AsyncRendezvousClient, RendezvousClient
from rendezvousd.client._local_address import held
from tests.support import DaemonProcess

#: An address no host has (RFC 5737): what the client noted, now gone.
GONE = "192.0.2.77"


def test_the_blocking_client_makes_its_channel_anew_once_its_address_is_gone(
    daemon: DaemonProcess, job_id: str
) -> None:
    assert not held(GONE)
    with RendezvousClient(daemon.endpoint, job_id, token=daemon.token) as c:
        c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=20)
        assert c._c.local.address == "127.0.0.1"
        before = c._channel
        c._c.local.address, c._c.local._looked = GONE, 0.0
        c.kv_set("k", b"v")  # on the channel made anew
        assert c._channel is not before
        assert c._c.local.address == "127.0.0.1"  # noted again
        assert c.kv_get("k", wait=False) == b"v"
        kept = c._channel
        c.kv_set("k", b"w")  # an address this host has: the channel stays
        assert c._channel is kept
        c.leave()
    assert c._c.local.lost == GONE


async def test_the_asyncio_client_makes_its_channel_anew_once_its_address_is_gone(
    daemon: DaemonProcess, job_id: str
) -> None:
    async with AsyncRendezvousClient(daemon.endpoint, job_id, token=daemon.token) as c:
        await c.join(num_nodes=1, gpus_per_node=1, local_rank=0, timeout=20)
        before = c._channel
        c._c.local.address, c._c.local._looked = GONE, 0.0
        await c.kv_set("k", b"v")
        assert c._channel is not before
        assert c._c.local.address == "127.0.0.1"
        assert await c.kv_get("k", wait=False) == b"v"
        await c.leave()
