"""Linux futex wait/wake on a 32-bit word in shared memory, through ctypes.

Why hand-written: Python has no cross-process primitive that blocks on a word in
shared memory. Measured at world 4 on the 2-core development machine, a futex hand-off
costs a third of the same hand-off as UNIX-socket messages (233 us vs 714 us per
two-phase all-reduce of 4 KiB), because a waiter sleeps on one word instead of
draining a message from every peer.

Only x86-64's syscall number is listed: the one user, shm_group, runs only on x86-64
because its unfenced hand-off needs total store order (see shm_group's docstring and
``shm_group.unsupported_reason``, which decides). A futex does not order the data
itself: it only puts a waiter to sleep until a word changes.
"""

from __future__ import annotations

import ctypes
import errno
import platform
import sys
from typing import Any

__all__ = ["available", "wait", "wake"]

_SYS_FUTEX = {"x86_64": 202, "amd64": 202}
_FUTEX_WAIT = 0  # shared (not FUTEX_PRIVATE_FLAG): waiters live in other processes
_FUTEX_WAKE = 1
_WAKE_ALL = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load() -> tuple[Any, int] | None:
    number = _SYS_FUTEX.get(platform.machine().lower())
    if not sys.platform.startswith("linux") or number is None:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        syscall = libc.syscall
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long
    return syscall, number


_SYSCALL = _load()


def available() -> bool:
    return _SYSCALL is not None


def wait(address: int, expected: int, timeout_s: float) -> bool:
    """Sleep while the word at ``address`` equals ``expected``, at most ``timeout_s``.

    True when woken or the word had already changed (re-check it); False on timeout.
    """
    assert _SYSCALL is not None, "futex.wait without futex.available()"
    syscall, number = _SYSCALL
    seconds = max(0.0, timeout_s)
    ts = _Timespec(int(seconds), int((seconds - int(seconds)) * 1e9))
    result = syscall(
        ctypes.c_long(number),
        ctypes.c_void_p(address),
        ctypes.c_int(_FUTEX_WAIT),
        ctypes.c_uint32(expected & 0xFFFFFFFF),
        ctypes.byref(ts),
        None,
        ctypes.c_int(0),
    )
    if result == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EAGAIN, errno.EINTR):
        return True
    if err == errno.ETIMEDOUT:
        return False
    raise OSError(err, f"futex wait failed: {errno.errorcode.get(err, err)}")


def wake(address: int) -> None:
    """Wake every process sleeping on the word at ``address``."""
    assert _SYSCALL is not None, "futex.wake without futex.available()"
    syscall, number = _SYSCALL
    syscall(
        ctypes.c_long(number),
        ctypes.c_void_p(address),
        ctypes.c_int(_FUTEX_WAKE),
        ctypes.c_int(_WAKE_ALL),
        None,
        None,
        ctypes.c_int(0),
    )
