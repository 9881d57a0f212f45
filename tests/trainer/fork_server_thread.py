"""Preloaded by test_fork_server: a module that starts a thread at import, as
numpy's OpenBLAS does without ``OMP_NUM_THREADS=1``."""

from __future__ import annotations

import threading
import time

threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
