"""The member table's digest and page size, shared by the daemon and the SDK.

A slim Join answer carries only the digest; the SDK assembles the table from
GetMembers pages and checks it against the digest, so a page from another
generation, or a torn assembly, cannot pass for the table.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb

# Members per GetMembers answer at most: with 255-byte host and address fields a
# page stays well under gRPC's default 4 MiB receive limit.
PAGE_MAX = 4096


def digest(members: Iterable[pb.Member]) -> bytes:
    """SHA-256 over each member in rank order: 4-byte big-endian length, encoding."""
    h = hashlib.sha256()
    for m in members:
        body = m.SerializeToString(deterministic=True)
        h.update(len(body).to_bytes(4, "big"))
        h.update(body)
    return h.digest()
