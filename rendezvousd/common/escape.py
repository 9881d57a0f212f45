"""Client-provided text made safe to print (in logs, messages and ``rendezvousd status``)
and bounded where it is kept.

Requests are validated, but text restored from an older state file, or any
future field, could still hold C0/C1 controls (a forged log line, a terminal
escape sequence) or bidi overrides (a line that shows other text than it holds,
"Trojan Source"); and a failure's cause is any text. They are shown as
Python-style escapes instead, and so are the line and paragraph separators
(U+2028/2029: a line break to many viewers and log collectors) and the invisible
zero-width space, word joiner and byte order mark (U+200B, U+2060, U+FEFF: two
hosts or causes that look the same but differ, text that hides a word).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from rendezvousd.common.log_time import UtcFormatter

# How much of a failure's cause a record keeps: enough for a whole traceback, little
# enough that a job's record and the event every survivor gets stay small, and that
# ReportFailure fits the daemon's 64 KiB request cap with room to spare.
MAX_CAUSE_BYTES = 32 * 1024
# How much of one cause a message shows: a message names several failures on one line.
SHOWN_CHARS = 120
# How much of a name a refusal shows (a job id, a key): its head is enough to find it.
SHOWN_NAME_CHARS = 40

_UNSAFE = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200b\u200e\u200f\u2028-\u202e\u2060\u2066-\u2069\ufeff]"
)


# Beyond _UNSAFE, for text whose rule is ASCII (a job id): any other character is the
# one that broke it, and a look-alike (a Cyrillic a, U+0430) must show as itself.
_NOT_ASCII = re.compile("[^\x00-\x7f]")


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def escape(text: str) -> str:
    """``text`` with every control and bidi-override character escaped."""
    return _UNSAFE.sub(_escaped, text)


def shortened(text: str, limit: int = SHOWN_CHARS) -> str:
    """``text`` escaped (one line, nothing a terminal acts on), cut to ``limit``
    characters, its middle left out with a marker saying how much; whole where what it
    leaves out is less than twice the marker's length (a cut must save at least as much
    again as the marker costs).

    The middle, not the tail: what tells two failures apart is at either end, who
    (a failure's text starts with its rank and host) and what (a traceback ends with its
    exception, a message with its value), while the middle of two tracebacks of one
    program is the same frames. Cut at its end, the last failure of two failures read
    alike, cut just before the exception that differed."""
    shown = escape(text)
    left_out = len(shown) - limit
    marker = f" ... ({left_out} characters cut) ... "
    if left_out < 2 * len(marker):
        # A cut of 1 character added a marker of 25; one of 30, a marker of 29: a
        # root cause lost 30 characters of its text to save 1 of the line.
        return shown
    head = (limit + 1) // 2
    return shown[:head] + marker + shown[len(shown) - (limit - head) :]


def quoted(text: str, limit: int = SHOWN_CHARS, *, ascii_only: bool = False) -> str:
    """``text`` as a message names a client's string (a job id, a key): in quotes,
    escaped, cut at its end (a name is told by its start) with the marker after the
    closing quote (what is quoted is the text's own); whole where the marker would be
    as long as what it leaves out, as ``shortened``. ``ascii_only``: every non-ASCII
    character escaped too, for text whose rule is ASCII."""
    shown = escape(text).replace("'", "\\'")  # its own quote, not the closing one
    if ascii_only:
        shown = _NOT_ASCII.sub(_escaped, shown)
    left_out = len(shown) - limit
    marker = f"... ({left_out} more characters)"
    if left_out <= len(marker):
        return f"'{shown}'"
    return f"'{shown[:limit]}'{marker}"


def bounded(text: str, max_bytes: int = MAX_CAUSE_BYTES) -> str:
    """``text`` whole up to ``max_bytes`` of UTF-8; longer, its head and its tail with a
    marker between them saying it was cut, as ``shortened`` cuts for display: a long
    traceback's end is its exception, which a cut keeping only the head dropped. Lone
    surrogates (an exception's text may hold them) are escaped, so the result can
    always go on the wire."""
    raw = text.encode("utf-8", "backslashreplace")
    if len(raw) <= max_bytes:
        return raw.decode()
    marker = f" ... [cut: {len(raw)} bytes in all] ... "
    head, tail = _ends(raw, max_bytes - len(marker.encode()))
    return head + marker + tail


def _ends(raw: bytes, keep: int) -> tuple[str, str]:
    """``raw``'s head and tail, ``keep`` bytes between them (none where ``keep`` is not
    above 0: a bound shorter than the marker keeps the marker alone); a character split
    by a cut is dropped whole."""
    keep = max(0, keep)
    head, tail = (keep + 1) // 2, keep // 2
    kept_tail = raw[len(raw) - tail :].decode("utf-8", "ignore") if tail else ""
    return raw[:head].decode("utf-8", "ignore"), kept_tail


def cut_middle(text: str, max_bytes: int) -> str:
    """``text`` whole up to ``max_bytes`` of UTF-8; longer, its middle left out, with a
    marker saying how many bytes, as ``shortened`` cuts a text for display (both ends
    tell a failure apart: who failed, and the exception or the words that say why) but
    not escaped and in bytes: a cause cut for the wire, shown escaped by its reader.
    Lone surrogates are escaped, as by ``bounded``."""
    raw = text.encode("utf-8", "backslashreplace")
    if len(raw) <= max_bytes:
        return raw.decode()
    # The marker's length with the count's digits at their most (len(raw)): the result
    # never goes over ``max_bytes`` (a bound shorter than the marker: the marker alone).
    kept_head, kept_tail = _ends(raw, max_bytes - len(f" ... ({len(raw)} bytes cut) ... "))
    left_out = len(raw) - len(kept_head.encode()) - len(kept_tail.encode())
    return f"{kept_head} ... ({left_out} bytes cut) ... {kept_tail}"


class EscapingFormatter(UtcFormatter):
    """Escapes the message (arguments included); a traceback keeps its lines, each
    escaped (its last names the exception's text: a client's, where the client's text
    raised it). Its time is UTC, marked (``log_time``)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape(record.message)
        return super().formatMessage(record)

    def formatException(self, ei: Any) -> str:
        return "\n".join(escape(line) for line in super().formatException(ei).split("\n"))

    def formatStack(self, stack_info: str) -> str:
        return "\n".join(escape(line) for line in super().formatStack(stack_info).split("\n"))
