"""The one timestamp every log line of ours starts with (the daemon's log,
``rendezvous-run``'s lines, the training example's): UTC in ISO 8601, to the
millisecond, with its ``Z``, e.g. ``2026-12-07T05:43:10.123Z``.

Logging's default (``2026-12-07 05:43:10,123``) is the host's local time with no zone:
the lines of a daemon and of nodes on hosts set to other zones (or a host's own lines
across a DST change) could not be put in one order. Each host stamps by its own wall
clock: lines of hosts whose clocks differ merge out of order by that much. The status
page's timeline shows the same form (``app.js``)."""

from __future__ import annotations

import logging
import re
import time

# What a line's stamp looks like, for a reader that parses it (the tests' log readers).
STAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")
STAMP_FORMAT = "%Y-%m-%dT%H:%M:%S.%f%z"  # datetime.strptime of a stamp (Z is +00:00)


def utc_stamp(at: float | None = None) -> str:
    """``at`` (Unix time; now when None) as a line's stamp."""
    at = time.time() if at is None else at
    whole = int(at)
    return (
        time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{int((at - whole) * 1000):03d}Z"
    )


class UtcFormatter(logging.Formatter):
    """A log formatter whose ``%(asctime)s`` is ``utc_stamp``'s."""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return utc_stamp(record.created)
