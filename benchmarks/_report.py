"""How every benchmark ends: its JSON report on stdout and, when asked, in a file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(report: Any, json_out: str | Path | None) -> None:
    text = json.dumps(report, indent=2)
    print(text)
    if json_out:
        Path(json_out).write_text(text + "\n")
