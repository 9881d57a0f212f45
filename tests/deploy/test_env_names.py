"""One list of every ``RENDEZVOUSD_*`` name our programs read: a name none reads (a
typo) is said by the daemon, the launcher and the torchrun backend, which ignored it
without a word; the list cannot drift from what the programs read."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from rendezvousd.common import env_names
from rendezvousd.common.env_names import EVERY_NAME, PREFIX, unknown_names
from rendezvousd.trainer.torchrun import config as torchrun_config
from tests.deploy.deploy_tree import known_env_vars
from tests.support import unstamped, write_token

ROOT = Path(__file__).resolve().parents[2]
_NAME = re.compile(r"\bRENDEZVOUSD_[A-Z0-9_]*[A-Z0-9]\b")
#: Named in docstrings as a pattern, not read: ``RENDEZVOUSD_NAME`` (a setting's form).
_NOT_READ = {"RENDEZVOUSD_NAME"}


def _named_in(*folders: str) -> set[str]:
    return {
        name
        for folder in folders
        for path in (ROOT / folder).rglob("*")
        if path.suffix in {".py", ".sh", ""}
        and path.is_file()
        and ".venv" not in path.parts
        and path.name != "env_names.py"  # the list itself, and its example of a typo
        for name in _NAME.findall(path.read_text(errors="replace"))
    } - _NOT_READ


def test_the_list_holds_every_name_a_program_reads_and_no_other() -> None:
    schemas = set(known_env_vars())
    schemas |= {o.env for o in torchrun_config.SCHEMA.options.values() if o.env is not None}
    product = _named_in("rendezvousd", "client", "trainer")
    tools = {PREFIX + n for n in env_names._TOOLS}
    assert schemas | product <= EVERY_NAME, sorted((schemas | product) - EVERY_NAME)
    assert EVERY_NAME - tools <= schemas | product, sorted(EVERY_NAME - tools - schemas - product)
    # The tools' names are read where they say, so none is kept here for nothing.
    assert tools <= _named_in("scripts", "tests"), sorted(tools - _named_in("scripts", "tests"))
    # scripts/ set names for the programs and the suite: a name set there that the list
    # lacks would be said as a typo by every program it starts (tests/ name typos on purpose).
    assert _named_in("scripts") <= EVERY_NAME, sorted(_named_in("scripts") - EVERY_NAME)


def test_a_misspelt_name_is_said_with_the_closest_one_and_never_its_value() -> None:
    said = unknown_names(
        {
            "RENDEZVOUSD_HEARTBEAT_TIMEOUTS": "5",
            "RENDEZVOUSD_NODERANK": "1",
            "RENDEZVOUSD_TOKN": "s3cret-value",
            "RENDEZVOUSD_WHATEVER": "x",
            "RENDEZVOUSD_LISTEN": "127.0.0.1:0",  # read: not said
            "OTHER_HEARTBEAT_TIMEOUTS": "5",  # not ours: not said
        }
    )
    assert said == [
        "$RENDEZVOUSD_HEARTBEAT_TIMEOUTS is set, but no rendezvousd program reads it: "
        "did you mean RENDEZVOUSD_HEARTBEAT_TIMEOUT_S? (ignored)",
        "$RENDEZVOUSD_NODERANK is set, but no rendezvousd program reads it: did you mean "
        "RENDEZVOUSD_NODE_RANK? (ignored)",
        "$RENDEZVOUSD_TOKN is set, but no rendezvousd program reads it: did you mean "
        "RENDEZVOUSD_TOKEN? (ignored)",
        "$RENDEZVOUSD_WHATEVER is set, but no rendezvousd program reads it (ignored)",
    ]
    assert not any("s3cret" in line for line in said)


def _env(**names: str) -> dict[str, str]:
    return {**os.environ, **names}


def test_serve_says_a_misspelt_name_at_start(tmp_path: Path) -> None:
    token = tmp_path / "token"
    write_token(token)
    daemon = subprocess.Popen(
        [sys.executable, "-m", "rendezvousd.cli", "serve", "--token-file", str(token),
         "--listen", "127.0.0.1:0"],
        env=_env(RENDEZVOUSD_HEARTBEAT_TIMEOUTS="5"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert daemon.stdout is not None
        assert "serving on" in daemon.stdout.readline()
    finally:
        daemon.terminate()
        _, err = daemon.communicate(timeout=30)
    assert (
        "WARNING rendezvousd: $RENDEZVOUSD_HEARTBEAT_TIMEOUTS is set, but no rendezvousd "
        "program reads it: did you mean RENDEZVOUSD_HEARTBEAT_TIMEOUT_S? (ignored)"
    ) in err, err


def test_rendezvous_run_says_a_misspelt_name_before_anything_else(tmp_path: Path) -> None:
    # Before it reads its settings: a name meant for one of them is said before the
    # error it may cause (here a refused --nnodes, which ends the run at once).
    run = subprocess.run(
        [sys.executable, "-m", "rendezvousd.trainer.agent.launcher", "--nnodes", "0",
         "train.py"],
        env=_env(RENDEZVOUSD_MAX_RESTART="1", RENDEZVOUSD_NUM_NODES="1"),
        capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False,
    )  # fmt: skip
    first = unstamped(run.stderr).splitlines()[0] if run.stderr else ""
    assert first == (
        "rendezvous-run: warning: $RENDEZVOUSD_MAX_RESTART is set, but no rendezvousd "
        "program reads it: did you mean RENDEZVOUSD_MAX_RESTARTS? (ignored)"
    ), run.stderr
    assert run.returncode == 2 and "rendezvous-run: error:" in run.stderr, run.stderr
