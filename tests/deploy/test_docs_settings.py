"""The settings tables in docs/ are the fields' own, and every env var or launcher flag
the docs name exists (the field-driven config is the single source)."""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import subprocess
import sys

import pytest

from rendezvousd import config as daemon_config
from rendezvousd.cli import serve as serve_cli
from rendezvousd.common import secret_files, version
from rendezvousd.common.env_names import EVERY_NAME
from rendezvousd.common.settings import Schema
from rendezvousd.trainer import config as trainer_config
from rendezvousd.trainer.agent import _agent_boot, _fork_server, _trace, agent_channel
from rendezvousd.trainer.agent.launcher import build_parser
from rendezvousd.trainer.comm import devices
from rendezvousd.trainer.torchrun import config as torchrun_config
from rendezvousd.trainer.torchrun import warm
from tests.support import REQUIRE_HOSTS, ROOT

DOCS = ROOT / "docs"


def _block(text: str, name: str) -> str:
    match = re.search(rf"<!-- settings:{name} -->\n(.*?)<!-- /settings:{name} -->", text, re.S)
    assert match, f"docs lack the <!-- settings:{name} --> block"
    return match.group(1)


_MODULES = {
    "daemon": "rendezvousd.config",
    "trainer": "rendezvousd.trainer.config",
    "torchrun": "rendezvousd.trainer.torchrun.config",
}


@pytest.mark.parametrize(
    ("doc", "name", "table"),
    [
        ("trainer.md", "trainer", trainer_config.settings_table),
        ("operations.md", "daemon", daemon_config.SCHEMA.markdown_table),
        ("trainer.md", "torchrun", torchrun_config.settings_table),
    ],
)
def test_docs_settings_table_is_generated_from_the_fields(
    doc: str, name: str, table: object
) -> None:
    assert callable(table)
    assert _block((DOCS / doc).read_text(), name) == table(), (
        f"regenerate with: python -m {_MODULES[name]}"
    )


def test_every_documented_env_var_is_read_somewhere() -> None:
    known = {o.env for o in daemon_config.SCHEMA.options.values()}
    known |= {o.env for o in trainer_config.SCHEMA.options.values()}
    known |= {o.env for o in torchrun_config.SCHEMA.options.values()}
    known |= {secret_files.TOKEN_ENV, secret_files.TOKEN_FILE_ENV}
    known |= {trainer_config.CONFIG_ENV, agent_channel.ENV_AGENT_FD, _trace.TRACE_ENV}
    known |= {_fork_server.ENV_FORK_SERVER, warm.ENV_WARM_SOCKET, devices.SHARED_DEVICE_ENV}
    known |= {version.BUILD_ENV}  # a build's, named where the container is built
    known |= {REQUIRE_HOSTS}  # the test suite's, named where the cross-host tests are
    assert known - {None} <= EVERY_NAME
    for doc in ("trainer.md", "operations.md"):
        text = (DOCS / doc).read_text()
        named = set(re.findall(r"\bRENDEZVOUSD_[A-Z0-9_]*[A-Z0-9]\b", text))
        # A typo the docs show being said, as the programs say it: no name to read.
        typos = set(re.findall(r"\$(RENDEZVOUSD_\w+) is set, but no rendezvousd", text))
        assert typos.isdisjoint(EVERY_NAME), doc
        assert named - known - typos == set(), doc


def test_every_variable_the_daemon_and_a_worker_both_read_is_named_as_shared() -> None:
    """RENDEZVOUSD_LAST_CALL_S is the daemon's (> 0) and rendezvous-run's (0: the
    daemon's default), but operations.md named only the TLS pair and the token file
    where it tells operators to set such variables per process."""
    daemon = {o.env for o in daemon_config.SCHEMA.options.values()}
    worker = {o.env for o in trainer_config.SCHEMA.options.values()}
    worker |= {o.env for o in torchrun_config.SCHEMA.options.values()}
    text = (DOCS / "operations.md").read_text()
    paragraph = text[text.index("Some names mean one thing") : text.index("<!-- settings:daemon")]
    shared = {v for v in daemon & worker if v is not None}
    assert shared and {v for v in shared if f"`{v}`" not in paragraph} == set()


#: Variables the launcher sets for the processes it starts, never a user.
_INTERNAL_ENV = {
    _agent_boot.ENV_AGENT_PID,
    _fork_server.ENV_CONTROL_FD,
    _fork_server.ENV_PRELOAD,
}


def test_every_variable_the_code_reads_is_documented() -> None:
    """RENDEZVOUSD_NCCL_SHARED_DEVICE was read but named in no doc: a variable a user
    sets must be documented, one the launcher sets for its children listed above."""
    named = set()
    for folder in ("rendezvousd", "client", "trainer"):
        for path in (ROOT / folder).rglob("*.py"):
            named |= set(re.findall(r'"(RENDEZVOUSD_[A-Z0-9_]*[A-Z0-9])"', path.read_text()))
    docs = " ".join(p.read_text() for p in [ROOT / "README.md", *DOCS.glob("*.md")])
    assert named and {v for v in named - _INTERNAL_ENV if v not in docs} == set()
    assert named >= _INTERNAL_ENV  # each still set somewhere


def test_every_documented_launcher_flag_exists() -> None:
    text = (DOCS / "trainer.md").read_text()
    section = text[text.index("## Launcher") : text.index("## From torchrun")]
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", section))
    known = {s for a in build_parser()._actions for s in a.option_strings}
    assert flags and flags - known == set()


@pytest.mark.parametrize(
    "command",
    [
        ("rendezvousd.cli",),
        ("rendezvousd",),  # the name a user tries first: it had no __main__
        ("rendezvousd.cli", "serve"),
        ("rendezvousd.cli", "token"),
        ("rendezvousd.cli", "health"),
        ("rendezvousd.cli", "status"),
    ],
)
def test_every_commands_help_lists_its_settings(command: tuple[str, ...]) -> None:
    """A setting's help is text, not an argparse format: a '%' in it ("~13-15 % less
    CPU", now "~55 % less CPU per heartbeat") made `rendezvousd serve --help` a TypeError traceback."""
    done = subprocess.run(
        [sys.executable, "-m", *command, "--help"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert "usage:" in done.stdout
    said = " ".join(done.stdout.split())
    if command[1:] == ("serve",):
        assert "~55 % less CPU per heartbeat" in said
    if command[1:] in (("health",), ("status",)):
        # Argparse's own defaults, the one source of these two (a review, h140 F3).
        assert "HOST:PORT of the daemon (default: 127.0.0.1:29420)" in said, said
        assert "seconds before giving up (default: 5)" in said, said


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser = action.choices[name]
            return found
    raise AssertionError(f"no {name} subcommand")


def _trainer_flags() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    trainer_config.add_cli_arguments(parser)
    return parser


@pytest.mark.parametrize(
    ("command", "schema", "parser"),
    [
        ("rendezvous-run", trainer_config.SCHEMA, build_parser),
        ("rendezvousd serve", daemon_config.SCHEMA, lambda: _subcommand(serve_cli.build_parser(), "serve")),
        ("the trainer's own flags", trainer_config.SCHEMA, _trainer_flags),
    ],
)  # fmt: skip
def test_every_settings_flags_help_says_its_default(
    command: str, schema: Schema[object], parser: object
) -> None:
    """--help said no default (--max-restarts 0, --heartbeat-timeout-s 10, --max-wait-s
    600 were in the docs alone: h140 F3); each is the field's own, rendered as the docs'
    tables render it."""
    assert callable(parser)
    built: argparse.ArgumentParser = parser()
    by_flag = {s: a for a in built._actions for s in a.option_strings}
    checked = 0
    for option in schema.options.values():
        default = schema.rendered_default(option)
        if option.flag is None or option.flag not in by_flag or default is None:
            continue
        helped = (by_flag[option.flag].help or "") % {}  # as argparse formats it
        assert f"(default: {default})" in helped, f"{command} {option.flag}: {helped}"
        checked += 1
    assert checked >= 10, checked  # the flags are there: the test did look
    if command == "rendezvous-run":
        # As --help prints them, the review's own three.
        said = " ".join(built.format_help().split())
        for flag, default in [
            ("max-restarts", "0"),
            ("rejoin-timeout-s", "60.0"),
            ("last-call-s", "0.0"),
        ]:
            assert re.search(
                rf"--{flag} [A-Z_]+ (?:(?! --).)*?\(default: {re.escape(default)}\)", said
            ), said


@pytest.mark.parametrize(
    ("module", "prog"),
    [("rendezvousd.cli", "rendezvousd"), ("rendezvousd.trainer.agent.launcher", "rendezvous-run")],
)
def test_each_command_says_the_version_installed(module: str, prog: str) -> None:
    """An operator upgrading node by node checks what each node runs (every node of a
    job must run the same version: docs/operations.md, "Upgrading"); nothing said it."""
    done = subprocess.run(
        [sys.executable, "-m", module, "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    from rendezvousd.common.version import build_id

    # With its build (h139 F3: two builds of one release said the same).
    build = build_id()
    assert build
    release = importlib.metadata.version("rendezvousd")
    assert done.stdout == f"{prog} {release}+{build}\n", done.stdout
