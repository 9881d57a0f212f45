"""What the test workers print: one JSON object per line on stdout, which the
tests read back (``tests.support.json_lines``). Workers run as scripts, so they
import this module by its bare name from their own folder."""

from __future__ import annotations

import hashlib
import json
import sys
import time
from typing import Any


def emit(event: str, **fields: Any) -> None:
    """One event line; ``t`` (monotonic seconds) lets a test order events of one host."""
    # One write per line: the workers of a node share the launcher's stdout, and
    # print()'s separate newline write could interleave with a sibling's line.
    sys.stdout.write(json.dumps({"event": event, **fields, "t": time.monotonic()}) + "\n")
    sys.stdout.flush()


def joined(m: Any, **fields: Any) -> None:
    """The "joined" event: the rank's place, and a digest of the id (never the id)."""
    emit(
        "joined",
        rank=m.rank,
        world_size=m.world_size,
        generation=m.generation,
        id_sha256=hashlib.sha256(m.unique_id).hexdigest(),
        id_len=len(m.unique_id),
        **fields,
    )
