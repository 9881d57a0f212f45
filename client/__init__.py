"""Client SDK for rendezvousd: join, barrier, key-value, heartbeat, leave.

Each public name is imported on first use: a process that needs only the
blocking client does not load asyncio's gRPC stack, and the embedded daemon is
loaded only by ``connect``'s file transport.
"""

from typing import TYPE_CHECKING

from rendezvousd._lazy import lazy_exports

if TYPE_CHECKING:
    from rendezvousd.client.aio import AsyncRendezvousClient
    from rendezvousd.client.connection import RetryPolicy, TlsConfig
    from rendezvousd.client.errors import (
        AuthenticationError,
        DaemonUnavailable,
        DaemonUnreachable,
        DuplicateRank,
        FailedMember,
        IdConflict,
        InvalidRequest,
        JobAborted,
        JobEnded,
        KeyNotFound,
        LimitExceeded,
        NotFound,
        PeerFailed,
        ProtocolError,
        RendezvousError,
        RendezvousTimeout,
        StaleGeneration,
        TopologyMismatch,
        VersionMismatch,
    )
    from rendezvousd.client.membership import Member, Membership, NodeMembership
    from rendezvousd.client.sync import RendezvousClient
    from rendezvousd.client.transport import FileRendezvous, Rendezvous, connect

__all__ = [
    "AsyncRendezvousClient",
    "AuthenticationError",
    "DaemonUnavailable",
    "DaemonUnreachable",
    "DuplicateRank",
    "FailedMember",
    "FileRendezvous",
    "IdConflict",
    "InvalidRequest",
    "JobAborted",
    "JobEnded",
    "KeyNotFound",
    "LimitExceeded",
    "Member",
    "Membership",
    "NodeMembership",
    "NotFound",
    "PeerFailed",
    "ProtocolError",
    "Rendezvous",
    "RendezvousClient",
    "RendezvousError",
    "RendezvousTimeout",
    "RetryPolicy",
    "StaleGeneration",
    "TlsConfig",
    "TopologyMismatch",
    "VersionMismatch",
    "connect",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    __all__,
    {
        "rendezvousd.client.aio": ("AsyncRendezvousClient",),
        "rendezvousd.client.connection": ("RetryPolicy", "TlsConfig"),
        "rendezvousd.client.membership": ("Member", "Membership", "NodeMembership"),
        "rendezvousd.client.sync": ("RendezvousClient",),
        "rendezvousd.client.transport": ("FileRendezvous", "Rendezvous", "connect"),
    },
    errors="rendezvousd.client.errors",
)
