"""Channels a renewal of the client's TLS files replaced, closed once no call is in
flight on them. Kept open until the client closed, a long job's every renewal left one
behind: its connection, or its reconnect attempts with a certificate the daemon no
longer takes. Closed at once, a call still in flight on it (a parked barrier, the
half-closed call stream's last answers) would be cancelled under its caller."""

from __future__ import annotations

import threading
from typing import Any, Generic, TypeVar

import grpc

C = TypeVar("C")

_READY = grpc.ChannelConnectivity.READY.value[0]


def connected(channel: Any) -> bool:
    """Whether a blocking channel is READY (asked of its core, as ``_ready_within``
    does: grpc.Channel's public ``subscribe`` starts threads that outlive the look).
    False for a closed one."""
    core: Any = getattr(channel, "_channel", None)
    try:
        return core is not None and bool(core.check_connectivity_state(False) == _READY)
    except ValueError:  # "Channel closed!"
        return False


def _in_flight(channel: Any) -> bool:
    """Whether a call is in flight on ``channel``, by gRPC's own count: the blocking
    channel's calls made with ``.future`` and its streams (``_call_state``), the
    asyncio channel's calls (``_active_calls``). A grpcio that keeps neither: always,
    and its channels are closed with the client, as before."""
    state = getattr(channel, "_call_state", None)
    if state is not None:
        return bool(state.managed_calls)
    active = getattr(channel, "_active_calls", None)
    if active is not None:
        return any(not call.done() for call in list(active))
    return True


class Replaced(Generic[C]):
    """The channels one holder (a client, its member table's) replaced. Safe from
    several threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._channels: list[C] = []

    def add(self, channel: C) -> None:
        with self._lock:
            self._channels.append(channel)

    def idle(self) -> list[C]:
        """Those no call is in flight on, taken off the list: the caller closes them.
        None is made on them once replaced (the holder's stubs and call stream moved to
        the new channel), so one idle now stays idle."""
        with self._lock:
            if not self._channels:
                return []
            idle = [c for c in self._channels if not _in_flight(c)]
            self._channels = [c for c in self._channels if c not in idle]
            return idle

    def take(self) -> list[C]:
        """All of them, taken off the list: the holder closes."""
        with self._lock:
            channels, self._channels = self._channels, []
            return channels

    def __len__(self) -> int:
        return len(self._channels)
