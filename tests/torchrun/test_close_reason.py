"""The reason torchrun's handler closes the rendezvous with fits the daemon's bound on
a reason, which counts UTF-8 bytes: cut to 900 characters, a cause in non-ASCII text
(which ``escape`` keeps) went over 1 KiB, the daemon refused the Abort and the
rendezvous stayed open. Run in the torch venv: the handler imports torch."""

from __future__ import annotations

import json
import subprocess

SCRIPT = """
import json
from rendezvousd.common.limits import Limits
from rendezvousd.common.validation import text_field
from rendezvousd.trainer.torchrun.handler import CLOSED, close_reason

out = {}
for name, cause in [
    ("ascii", "x" * 5000),
    ("two-byte", "\\u00e9" * 2000),
    ("three-byte", "\\u6545\\u969c" * 1000),
    ("controls", "\\x1b[31m\\u00e9\\n" * 500),
    ("short", "SIGTERM"),
]:
    reason = close_reason("h\\u00f4te-1", cause, 1, 2, 0)
    text_field("reason", reason, Limits().max_reason_bytes, required=False)  # or raises
    out[name] = [len(reason.encode()), reason.startswith(CLOSED), reason]
print(json.dumps(out))
"""


def test_the_close_reason_fits_the_daemons_bound_in_bytes(torch_python: str) -> None:
    done = subprocess.run(
        [torch_python, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    for name, (size, closed, reason) in out.items():
        assert size <= 1024 and closed, (name, size, reason)
    assert "cut:" in out["three-byte"][2] and out["three-byte"][0] > 900
    short = out["short"][2]
    assert "on h\u00f4te-1 stopped: SIGTERM;" in short and "--nnodes 1:2, 0 node(s)" in short


CLOSES = """
import json
from rendezvousd.client import JobAborted, PeerFailed
from rendezvousd.trainer.torchrun.handler import CLOSED, closes_run

def aborted(reason, **said):
    return JobAborted(f"job 'j' generation 1 was aborted: {reason}", metadata={"reason": reason, **said})

words = f"{CLOSED}: or so it says"
print(json.dumps({
    "new, words, not closed": closes_run(aborted(words, closed="false")),
    "new, closed": closes_run(aborted("any words", closed="true")),
    "older daemon, words": closes_run(aborted(words)),
    "older daemon, other words": closes_run(aborted("stop")),
    "not an abort": closes_run(PeerFailed(words)),
    "nothing": closes_run(None),
}))
"""


def test_a_close_is_read_from_the_daemons_data_and_from_words_only_without_it(
    torch_python: str,
) -> None:
    """``closes_run``: the daemon's ``closed`` decides, whatever the reason says; a
    daemon from before that data (no ``closed`` said) closed by an abort in
    ``CLOSED``'s words, which are read then alone."""
    done = subprocess.run(
        [torch_python, "-c", CLOSES], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {
        "new, words, not closed": False,
        "new, closed": True,
        "older daemon, words": True,
        "older daemon, other words": False,
        "not an abort": False,
        "nothing": False,
    }
