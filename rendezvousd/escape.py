"""Client-provided text made safe to print: in logs and ``rendezvousd status``.

Requests are validated, but text restored from an older state file, or any
future field, could still hold C0/C1 controls (a forged log line, a terminal
escape sequence) or bidi overrides (a line that shows other text than it holds,
"Trojan Source"). They are shown as Python-style escapes instead.
"""

from __future__ import annotations

import logging
import re

_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def escape(text: str) -> str:
    """``text`` with every control and bidi-override character escaped."""
    return _UNSAFE.sub(_escaped, text)


class EscapingFormatter(logging.Formatter):
    """Escapes the message (arguments included); a traceback keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape(record.message)
        return super().formatMessage(record)
