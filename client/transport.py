"""One interface over both rendezvous transports, and a factory that picks one.

``file``: ``FileRendezvous``, single node, a UNIX socket at a shared path.
``daemon``: ``RendezvousClient``, any number of nodes, the authenticated daemon.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Protocol, Self, runtime_checkable

from rendezvousd.client.errors import InvalidRequest, RendezvousError
from rendezvousd.client.file_transport import FileRendezvous
from rendezvousd.client.membership import Membership
from rendezvousd.client.sync import RendezvousClient

TRANSPORT_KINDS = ("file", "daemon")


@runtime_checkable
class Rendezvous(Protocol):
    """What a worker needs from either transport (and what ``JobStore`` needs)."""

    def join(
        self,
        *,
        num_nodes: int,
        gpus_per_node: int,
        local_rank: int,
        node_rank: int | None = None,
        host: str | None = None,
        address: str = "",
        unique_id: bytes | None = None,
        id_factory: Callable[[], bytes] | None = None,
        timeout: float = 600.0,
    ) -> Membership: ...

    def barrier(self, name: str = "default", *, timeout: float | None = None) -> None: ...

    def kv_set(self, key: str, value: bytes) -> None: ...

    def kv_get(self, key: str, *, wait: bool = True, timeout: float | None = None) -> bytes: ...

    def start_heartbeat(
        self, interval: float = 1.0, on_failure: Callable[[RendezvousError], None] | None = None
    ) -> None: ...

    def raise_if_failed(self) -> None: ...

    def leave(self) -> None: ...

    def close(self) -> None: ...

    def __enter__(self) -> Self: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


def connect(
    transport_kind: str,
    *,
    path: str | Path | None = None,
    endpoint: str | None = None,
    job_id: str,
    token_file: str | Path | None = None,
    retry_attempts: int = 1,
) -> Rendezvous:
    """A client for ``transport_kind``; nothing is contacted until ``join``."""
    if transport_kind == "file":
        if path is None or endpoint is not None or token_file is not None:
            raise InvalidRequest(
                "the file transport takes path= (a shared directory or socket path) and no "
                "endpoint/token_file; those are for transport 'daemon'",
                job_id=job_id,
            )
        return FileRendezvous(path, job_id)
    if transport_kind == "daemon":
        if endpoint is None or path is not None:
            raise InvalidRequest(
                "the daemon transport takes endpoint='host:port' (and token_file=), not path=",
                job_id=job_id,
            )
        return RendezvousClient(
            endpoint, job_id, token_file=token_file, retry_attempts=retry_attempts
        )
    raise InvalidRequest(
        f"rendezvous transport {transport_kind!r} is unknown; expected one of {TRANSPORT_KINDS}",
        job_id=job_id,
    )
