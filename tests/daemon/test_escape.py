"""Client-provided text is printed escaped: `rendezvousd status` and log lines."""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys

import pytest

from rendezvousd._gen.rendezvous.v1 import rendezvous_pb2 as pb
from rendezvousd.cli.probe import render
from rendezvousd.client import RendezvousClient
from rendezvousd.common.escape import EscapingFormatter, cut_middle, escape, quoted, shortened
from tests.support import DaemonProcess, parallel, wait_for

UNSAFE = ["\x1b[2J", "\x85", "\x9b31m", "\u202e", "\u2066", "\u200f", "\n", "\r", "\x00"]
# Line and paragraph separators (a line break to many viewers and log collectors), and
# the invisible zero-width space, word joiner and byte order mark.
INVISIBLE = ["\u2028", "\u2029", "\u200b", "\u2060", "\ufeff"]


@pytest.mark.parametrize("char", UNSAFE + INVISIBLE)
def test_escape_removes_every_unsafe_character(char: str) -> None:
    shown = escape(f"a{char}b")
    assert shown.isprintable() and shown.isascii()
    assert "\\" in shown


def test_shortened_cuts_only_what_its_marker_is_shorter_than() -> None:
    """A cut of 1 character added a 23-character marker ("... (1 more characters)")."""
    assert shortened("x" * 121) == "x" * 121
    assert shortened("x" * 120 + "\x1b") == "x" * 120 + "\\x1b"
    assert shortened("x" * 149) == "x" * 149  # the marker would be 29: as long


def test_shortened_cuts_only_where_it_saves_at_least_its_markers_length_again() -> None:
    """A root cause lost 30 characters to a 29-character marker ("... (30 characters
    cut) ..."): the line 1 character shorter, 30 of its text gone."""
    assert shortened("x" * 150) == "x" * 150
    marker = len(" ... (58 characters cut) ... ")
    assert shortened("x" * (120 + 2 * marker - 1)) == "x" * (120 + 2 * marker - 1)
    assert shortened("x" * 178) == "x" * 60 + " ... (58 characters cut) ... " + "x" * 60
    assert len(shortened("x" * 5000)) == 120 + len(" ... (4880 characters cut) ... ")


def test_shortened_keeps_both_ends_which_tell_two_texts_apart() -> None:
    """Cut at its end, two tracebacks of one program read alike: the exception that
    differed was past the cut."""
    frames = '  File "/opt/train/loop.py", line 88, in step\n' * 4
    cut = [
        shortened(f"rank 7 on gpu-17 (Traceback (most recent call last):\n{frames}{error})")
        for error in ("RuntimeError: CUDA error: an illegal memory access", "KeyError: 'lr'")
    ]
    assert cut[0].startswith("rank 7 on gpu-17 (Traceback") and cut[1].startswith("rank 7 on")
    assert cut[0].endswith("an illegal memory access)") and cut[1].endswith("KeyError: 'lr')")
    assert " characters cut) ... " in cut[0] and " characters cut) ... " in cut[1]


def test_cut_middle_keeps_both_ends_within_its_bytes_unescaped() -> None:
    """A cause cut for the wire (a PEER_FAILED error's detail): within its bytes, both
    ends kept, its text as it was (its reader escapes it)."""
    assert cut_middle("a\nb", 3) == "a\nb"
    cut = cut_middle("head\n" + "x" * 500 + "ValueError: lr", 60)
    assert len(cut.encode()) <= 60 and cut.startswith("head\nx") and cut.endswith("ValueError: lr")
    assert " bytes cut) ... " in cut
    wide = cut_middle("\u00e9" * 100, 51)  # a character split by the cut is dropped whole
    assert len(wide.encode()) <= 51 and wide.startswith("\u00e9") and wide.endswith("\u00e9")
    head, _, rest = wide.partition(" ... (")
    count, _, tail = rest.partition(" bytes cut) ... ")
    assert int(count) == 200 - len((head + tail).encode())  # what is left out, exactly


def test_quoted_is_shortened_in_quotes_with_its_marker_after_them() -> None:
    """One convention for every client string a message names: the key refusals' own
    ("'...' after 40 ASCII-escaped characters, how much left out unsaid), and the
    daemon's job ids cut at 128 with no marker at all, were two others."""
    assert quoted("k\x1b[2J") == "'k\\x1b[2J'"
    assert quoted("x" * 144) == "'" + "x" * 144 + "'"
    assert quoted("x" * 145) == "'" + "x" * 120 + "'... (25 more characters)"
    assert quoted("k\u00e9" * 50, 40) == "'" + "k\u00e9" * 20 + "'... (60 more characters)"
    # Its own quote is not the closing one.
    assert quoted("it's") == "'it\\'s'"
    # For text whose rule is ASCII (a job id): the look-alike shows as itself.
    assert quoted("p\u0430ris", ascii_only=True) == "'p\\u0430ris'"
    assert quoted("\U0001f600", ascii_only=True) == "'\\U0001f600'"


def test_escape_keeps_ordinary_text() -> None:
    assert escape("node-1.example ünïcode 東京") == "node-1.example ünïcode 東京"


def test_status_table_escapes_client_text() -> None:
    job = pb.GetJobResponse(
        summary=pb.JobSummary(job_id="j\u202eevil", state=pb.JOB_STATE_FAILED),
        members=[pb.MemberStatus(member=pb.Member(rank=0, host="h\x9b2J"))],
        failed=[pb.FailedMember(rank=0, host="h\x1b[31m", cause="c\u2066x\nfake line")],
        abort_reason="r\x85",
    )
    out = render([job])
    for line in out.splitlines():
        assert line.isprintable(), repr(line)
    assert "j\\u202eevil" in out and "h\\x9b2J" in out and "c\\u2066x\\x0afake line" in out
    assert len(out.splitlines()) == 5  # header, job, member, lost rank, aborted


def test_separators_and_invisible_characters_are_escaped_in_status_and_the_log(
    daemon: DaemonProcess, job_id: str
) -> None:
    """A failure's cause is any text: through a real daemon, its `status` table and log."""
    cause = "boom\u2028INFO forged line\u2029x\u200by\u2060z\ufeffend"
    agents = [RendezvousClient(daemon.endpoint, job_id, token=daemon.token) for _ in range(2)]
    try:
        ms = parallel(
            [
                lambda c=c, i=i: c.join_node(  # type: ignore[misc]
                    min_nodes=2, max_nodes=2, gpus_per_node=1, host=f"h{i}", timeout=20
                )
                for i, c in enumerate(agents)
            ]
        )
        for c in agents:
            c.start_heartbeat(0.2)
        reporter = next(i for i, m in enumerate(ms) if m.node_rank == 1)
        agents[reporter].report_failure(0, cause)
        assert agents[0].get_job().failed[0].cause == cause  # kept whole, as sent
    finally:
        for c in agents:
            c.close()
    status = subprocess.run(
        [
            *(sys.executable, "-m", "rendezvousd.cli", "status"),
            *("--endpoint", daemon.endpoint, "--token-file", str(daemon.token_file), job_id),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert status.returncode == 0, status.stderr
    shown = "boom\\u2028INFO forged line\\u2029x\\u200by\\u2060z\\ufeffend"
    assert shown in status.stdout, status.stdout
    wait_for("the failure in the daemon's log", lambda: shown in daemon.log())
    for char in INVISIBLE:
        assert char not in status.stdout and char not in daemon.log()


def test_log_lines_escape_their_arguments() -> None:
    record = logging.LogRecord(
        "rendezvousd",
        logging.WARNING,
        __file__,
        1,
        "job %s: %s",
        ("j", "x\u202e\nINFO forged"),
        None,
    )
    line = EscapingFormatter("%(levelname)s %(message)s").format(record)
    assert line == "WARNING job j: x\\u202e\\x0aINFO forged"


def test_a_tracebacks_lines_are_escaped_each() -> None:
    """A traceback's last line is its exception's text, a client's where the client's
    text raised it (h121 F2: urlsplit's ValueError named the request's host): it was
    written as is, a terminal escape or a forged line in it. Its line breaks stay."""
    try:
        raise ValueError("'::1\x1b[31mEVIL\u2028INFO forged' does not appear to be an address")
    except ValueError:
        record = logging.LogRecord(
            "rendezvousd", logging.ERROR, __file__, 1, "failed", (), sys.exc_info()
        )
    text = EscapingFormatter("%(levelname)s %(message)s").format(record)
    lines = text.split("\n")
    assert lines[0] == "ERROR failed" and lines[1] == "Traceback (most recent call last):"
    assert lines[-1] == (
        "ValueError: '::1\\x1b[31mEVIL\\u2028INFO forged' does not appear to be an address"
    )
    assert "\x1b" not in text and "\u2028" not in text


def test_daemon_log_lines_are_escaped() -> None:
    """`serve`'s own log handler escapes (a log line of a real process)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RENDEZVOUSD_")}
    env["RENDEZVOUSD_TOKEN"] = secrets.token_urlsafe(32)
    done = subprocess.run(
        [sys.executable, "-c", _PROBE],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert "x\\u202ey" in done.stderr and "\u202e" not in done.stderr


# `serve`'s logging set-up, then one log line with client text; the daemon is not started.
_PROBE = """
import sys
from rendezvousd.cli import serve as cli
async def run(*a, **k):
    import logging
    logging.getLogger("rendezvousd").warning("job %s", "x\\u202ey")
    return 0
cli._run = run
sys.exit(cli.main(["serve", "--listen", "127.0.0.1:0"]))
"""
