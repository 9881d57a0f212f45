"""A worker whose CPU ring setup fails transiently the first time any worker of the
test tries it (whoever creates the marker file argv[1] first), then works; it prints
its rank, generation and restart count and leaves."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from rendezvousd.trainer.comm import cpu_ring
from rendezvousd.trainer.distributed import init_distributed
from rendezvousd.trainer.errors import PeerConnectionError

MARKER = Path(sys.argv[1])
real = cpu_ring.connect_cpu_ring


def connect(*args: Any, **kwargs: Any) -> Any:
    try:
        os.close(os.open(MARKER, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return real(*args, **kwargs)
    raise PeerConnectionError("injected: the ring's peer could not be reached")


cpu_ring.connect_cpu_ring = connect
with init_distributed() as ctx:
    print(json.dumps([ctx.rank, ctx.generation, ctx.restart_count]), flush=True)
