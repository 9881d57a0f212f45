"""operations.md: "The daemon raises its open-file limit to the hard limit (one
connection per member)": a daemon started with a soft limit of 256 runs with the hard
one."""

from __future__ import annotations

import re
import resource
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support import DaemonProcess

# Sets the soft limit alone, then becomes the command after it.
_SOFT_256 = (
    "import os, resource, sys; "
    "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]; "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


def _open_files(pid: int) -> tuple[str, str]:
    """(soft, hard) of ``pid``'s open-file limit, as /proc writes them."""
    limits = Path(f"/proc/{pid}/limits").read_text()
    found = re.search(r"^Max open files\s+(\S+)\s+(\S+)", limits, flags=re.M)
    assert found is not None, limits
    return found.group(1), found.group(2)


def test_the_daemon_raises_its_open_file_soft_limit_to_the_hard_limit(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"the hard open-file limit here is {hard}: nothing to raise to")
    d = start_daemon(prefix=[sys.executable, "-c", _SOFT_256])
    wanted = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    assert _open_files(d.proc.pid) == (wanted, wanted)
    # Said, so that a limit found low later is not read as the one the unit set.
    assert f"raised the open-file soft limit from 256 to its hard limit {wanted}" in d.log()
