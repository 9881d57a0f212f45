"""A state dir below the root of a volume the kubelet prepared for fsGroup
(deploy/kubernetes/statefulset.yaml): the root is 2770, group-owned by the fsGroup,
which the daemon refuses as its state dir; the subdirectory it creates there is its own."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support import DaemonProcess

FS_GROUP = 10001


def _volume_root(tmp_path: Path) -> Path:
    """What the kubelet leaves at the volume's root: setgid, rwx for the fsGroup."""
    root = tmp_path / "volume"
    root.mkdir()
    if os.geteuid() == 0:
        os.chown(root, 0, FS_GROUP)
    root.chmod(0o2770)
    return root


def test_the_volume_root_itself_is_refused(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    root = _volume_root(tmp_path)
    with pytest.raises(RuntimeError, match=r"writable by group/others \(mode drwxrws---\)"):
        start_daemon("--state-dir", str(root))


def test_a_subdirectory_of_the_volume_root_is_created_private_and_accepted(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    root = _volume_root(tmp_path)
    state = root / "state"
    daemon = start_daemon("--state-dir", str(state))
    info = state.stat()
    # setgid and the group are inherited from the root (what a later mount expects);
    # nobody but the daemon's user may enter or write.
    assert stat.S_IMODE(info.st_mode) & 0o777 == 0o700, oct(info.st_mode)
    assert info.st_gid == root.stat().st_gid
    assert stat.S_IMODE((state / "state.db").stat().st_mode) == 0o600
    # A restart (the pod's next start) finds it as it left it.
    assert daemon.terminate() == 0
    start_daemon("--state-dir", str(state))
    assert stat.S_IMODE(state.stat().st_mode) & 0o777 == 0o700
