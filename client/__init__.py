"""Client SDK for rendezvousd: join, barrier, key-value, heartbeat, leave."""

from rendezvousd.client.aio import AsyncRendezvousClient
from rendezvousd.client.connection import RetryPolicy, TlsConfig
from rendezvousd.client.errors import (
    AuthenticationError,
    DaemonUnavailable,
    DaemonUnreachable,
    DuplicateRank,
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
    "connect",
]
