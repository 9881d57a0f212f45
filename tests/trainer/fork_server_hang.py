"""Preloaded by test_fork_server: a module whose import never ends (a stuck
``--preload``), so the fork server never answers a spawn request."""

from __future__ import annotations

import time

time.sleep(3600)
