"""What the trainer needs from the rendezvous daemon after the join.

``rendezvousd.client.RendezvousClient`` implements this protocol: keys are
scoped to the caller's job and generation by the daemon, values are bytes.
"""

from __future__ import annotations

from typing import Protocol


class JobStore(Protocol):
    def kv_set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key`` (overwrites)."""

    def kv_get(self, key: str, *, wait: bool = True, timeout: float | None = None) -> bytes:
        """Return the value of ``key``; with ``wait`` block until it is set.

        Raises the SDK's ``RendezvousTimeout`` when ``timeout`` passes first and
        ``KeyNotFound`` when ``wait`` is false and the key is absent.
        """

    def kv_add(self, key: str, delta: int = 1) -> int:
        """Add ``delta`` to the decimal counter under ``key`` (0 if unset); the new value."""

    def barrier(self, name: str, *, timeout: float | None = None) -> None:
        """Return once every member of the job has entered barrier ``name``."""
