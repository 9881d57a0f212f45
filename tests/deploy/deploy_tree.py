"""What the deploy tests share: the deploy/ paths, what the CLI accepts, and the
drift checker that finds `rendezvousd`/`rendezvous-run` invocations in files."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import re
import shlex
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rendezvousd import config as config_mod
from rendezvousd.cli.serve import build_parser
from rendezvousd.common import secret_files, version

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "systemd" / "rendezvousd.service"
ENV_EXAMPLE = DEPLOY / "systemd" / "rendezvousd.env.example"
DOCKERFILE = DEPLOY / "container" / "Dockerfile"
COMPOSE = DEPLOY / "container" / "compose.yaml"
KUBE = DEPLOY / "kubernetes"
PORT = config_mod.DEFAULT_PORT

# ---------------------------------------------------------------------------
# What the code accepts: subcommand flags and env vars.
# ---------------------------------------------------------------------------

PROGRAMS = ("rendezvousd", "rendezvous-run")
SEPARATORS = frozenset({";", "&&", "||", "|", "&", "`"})
# rendezvous-run's own flags end where the training program and its arguments start.
LAUNCHER_STOP = frozenset({"-m", "--"})


def _option_strings(parser: argparse.ArgumentParser) -> frozenset[str]:
    return frozenset(opt for action in parser._actions for opt in action.option_strings)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("rendezvousd's parser has no subcommands")


def _launcher_module() -> Any:
    try:
        return importlib.import_module("rendezvousd.trainer.agent.launcher")
    except ModuleNotFoundError:
        return None


def launcher_parser() -> argparse.ArgumentParser | None:
    """rendezvous-run's parser, once the launcher exists and exposes build_parser()."""
    build = getattr(_launcher_module(), "build_parser", None)
    return build() if callable(build) else None


def known_flags() -> dict[str, frozenset[str]]:
    """``"rendezvousd serve"`` (etc.) and ``"rendezvous-run"`` -> their long options."""
    known = {
        f"rendezvousd {name}": _option_strings(sub)
        for name, sub in _subparsers(build_parser()).items()
    }
    launcher = launcher_parser()
    if launcher is not None:
        known["rendezvous-run"] = _option_strings(launcher)
    return known


def known_env_vars() -> frozenset[str]:
    """The daemon's settings, the token vars, and what the trainer/launcher read."""
    from rendezvousd.trainer import config as trainer_config

    names = {config_mod.ENV_PREFIX + name.upper() for name in config_mod.FIELDS}
    names |= {o.env for o in trainer_config.SCHEMA.options.values() if o.env is not None}
    names |= {secret_files.TOKEN_ENV, secret_files.TOKEN_FILE_ENV}
    names.add(version.BUILD_ENV)  # the container build's argument (Dockerfile, compose)
    modules = [trainer_config, _launcher_module()]
    with contextlib.suppress(ModuleNotFoundError):
        modules.append(importlib.import_module("rendezvousd.trainer.distributed"))
    for module in modules:
        for attr, value in vars(module).items() if module is not None else ():
            if (attr.startswith("ENV_") or attr.endswith("_ENV")) and isinstance(value, str):
                names.add(value)
    return frozenset(n for n in names if n.startswith(config_mod.ENV_PREFIX))


# ---------------------------------------------------------------------------
# The drift checker: finds `rendezvousd <sub> --flags` / `rendezvous-run --flags`
# in text (shell lines, comments, JSON/YAML flow lists) and in argv lists
# (YAML command/args/entrypoint, Dockerfile ENTRYPOINT+CMD).
# ---------------------------------------------------------------------------

_TOKEN = re.compile(r"[;&|`]+|[^\s\"'`\[\](),;&|]+")
_FLAG = re.compile(r"--[A-Za-z0-9][A-Za-z0-9-]*")
_ENV = re.compile(r"\bRENDEZVOUSD_[A-Z0-9_]+")


@dataclass(frozen=True)
class Invocation:
    command: str  # "rendezvousd serve", "rendezvous-run"
    args: tuple[str, ...]


def text_tokens(text: str) -> list[str]:
    """Shell-ish words of one line; quotes, brackets and commas dropped."""
    return _TOKEN.findall(text)


def _program(token: str) -> str | None:
    name = re.split(r"[/=]", token)[-1]  # /usr/bin/rendezvousd, ExecStart=rendezvousd
    return name if name in PROGRAMS else None


def find_invocations(
    tokens: Sequence[str], subcommands: frozenset[str], *, strict: bool
) -> list[Invocation]:
    """Calls of our programs in ``tokens``.

    Not ``strict`` (prose, comments): ``rendezvousd`` counts only when a known
    subcommand follows. ``strict`` (an argv): any word after it is taken as the
    subcommand, so an unknown one is reported.
    """
    found: list[Invocation] = []
    i = 0
    while i < len(tokens):
        program = _program(tokens[i])
        if program is None:
            i += 1
            continue
        start = i + 1
        if program == "rendezvousd":
            sub = tokens[start] if start < len(tokens) else ""
            known = sub in subcommands
            if not known and not (strict and sub and not sub.startswith("-") and sub[0].isalpha()):
                i += 1
                continue
            command, start = f"rendezvousd {sub}", start + 1
        else:
            command = program
        end = start
        while end < len(tokens) and tokens[end] not in SEPARATORS:
            # Another call starts (a path such as /var/lib/rendezvousd does not).
            if _program(tokens[end]) == "rendezvous-run" or (
                _program(tokens[end]) == "rendezvousd"
                and end + 1 < len(tokens)
                and tokens[end + 1] in subcommands
            ):
                break
            if command == "rendezvous-run" and (
                tokens[end] in LAUNCHER_STOP or tokens[end].endswith(".py")
            ):
                break
            end += 1
        found.append(Invocation(command, tuple(tokens[start:end])))
        i = end
    return found


def flag_problems(
    invocations: Sequence[Invocation], known: Mapping[str, frozenset[str]]
) -> list[str]:
    problems: list[str] = []
    for inv in invocations:
        if inv.command not in known:
            if inv.command.startswith("rendezvousd "):
                problems.append(f"`{inv.command}`: no such subcommand")
            continue  # rendezvous-run while the launcher has no parser to compare with
        for arg in inv.args:
            match = _FLAG.match(arg)
            if match and match.group(0) not in known[inv.command]:
                problems.append(f"`{inv.command}` has no flag {match.group(0)}")
    return problems


def logical_lines(text: str) -> list[str]:
    """Lines with trailing-backslash continuations joined (shell, systemd, Dockerfile)."""
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        lines.append(pending + raw)
        pending = ""
    if pending:
        lines.append(pending)
    return lines


def text_invocations(text: str, subcommands: frozenset[str]) -> list[Invocation]:
    found: list[Invocation] = []
    for line in logical_lines(text):
        found += find_invocations(text_tokens(line), subcommands, strict=False)
    return found


def argv_invocations(argv: Sequence[str], subcommands: frozenset[str]) -> list[Invocation]:
    """An exec-form command line. One that starts with a subcommand runs under the
    image's ENTRYPOINT ["rendezvousd"]; words holding spaces (``sh -c "..."``,
    CMD-SHELL) are split again."""
    words: list[str] = []
    for word in argv:
        words += text_tokens(word) if any(c.isspace() for c in word) else [word]
    if words and words[0] in subcommands:
        words.insert(0, "rendezvousd")
    return find_invocations(words, subcommands, strict=True)


def _as_argv(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return shlex.split(value)
    if isinstance(value, list):
        return [str(v) for v in value]
    return []


def yaml_argvs(node: Any) -> Iterator[list[str]]:
    """Command lines in a compose file or Kubernetes manifest: entrypoint+command
    (compose), command+args (Kubernetes, exec probes), healthcheck tests."""
    if isinstance(node, dict):
        if any(k in node for k in ("entrypoint", "command", "args")) and not any(
            isinstance(node.get(k), dict) for k in ("entrypoint", "command", "args")
        ):
            argv = [
                *_as_argv(node.get("entrypoint")),
                *_as_argv(node.get("command")),
                *_as_argv(node.get("args")),
            ]
            if argv:
                yield argv
        test = node.get("test")
        if isinstance(test, list) and test and test[0] in ("CMD", "CMD-SHELL"):
            yield [str(v) for v in test[1:]]
        for value in node.values():
            yield from yaml_argvs(value)
    elif isinstance(node, list):
        for item in node:
            yield from yaml_argvs(item)


@dataclass(frozen=True)
class DockerInstruction:
    keyword: str
    rest: str


def dockerfile_instructions(text: str) -> list[DockerInstruction]:
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    out: list[DockerInstruction] = []
    for line in logical_lines(body):
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            out.append(DockerInstruction(keyword.upper(), rest.strip()))
    return out


def _exec_form(rest: str) -> list[str]:
    value = json.loads(rest)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), rest
    return [str(v) for v in value]


def file_invocations(path: Path, text: str, subcommands: frozenset[str]) -> list[Invocation]:
    """Every call of our programs in one deploy file, comments included."""
    found = text_invocations(text, subcommands)
    if path.suffix in (".yaml", ".yml"):
        for doc in yaml.safe_load_all(text):
            for argv in yaml_argvs(doc):
                found += argv_invocations(argv, subcommands)
    if path.name == "Dockerfile" or path.suffix == ".Dockerfile":
        entrypoint: list[str] = []
        cmd: list[str] = []
        for ins in dockerfile_instructions(text):
            if ins.keyword == "ENTRYPOINT":
                entrypoint = _exec_form(ins.rest)
            elif ins.keyword == "CMD":
                cmd = _exec_form(ins.rest)
        found += argv_invocations([*entrypoint, *cmd], subcommands)
    return found


def drift_problems(
    path: Path, text: str, known: Mapping[str, frozenset[str]], env_vars: frozenset[str]
) -> list[str]:
    subcommands = frozenset(c.split(" ", 1)[1] for c in known if c.startswith("rendezvousd "))
    problems = flag_problems(file_invocations(path, text, subcommands), known)
    problems += [f"unknown env var {name}" for name in _ENV.findall(text) if name not in env_vars]
    return list(dict.fromkeys(f"{path.name}: {p}" for p in problems))


def deploy_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.is_file())


# ---------------------------------------------------------------------------
# Parsing helpers for the file-content tests.
# ---------------------------------------------------------------------------


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """systemd's INI dialect: repeated keys accumulate, an empty value is kept."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for line in logical_lines(text):
        stripped = line.strip()
        if not stripped or stripped[0] in "#;":
            continue
        if stripped.startswith("[") and stripped.endswith("]"):
            current = sections.setdefault(stripped[1:-1], {})
            continue
        key, sep, value = stripped.partition("=")
        assert sep and current is not None, f"not KEY=VALUE inside a section: {line!r}"
        current.setdefault(key.strip(), []).append(" ".join(value.split()))
    return sections


def systemd_seconds(value: str) -> float:
    units = {"ms": 0.001, "s": 1.0, "sec": 1.0, "min": 60.0, "m": 60.0, "h": 3600.0}
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value)
    assert parts, value
    return sum(float(n) * units[u or "s"] for n, u in parts)


def serve_config(
    args: Sequence[str], env: Mapping[str, str] | None = None
) -> config_mod.DaemonConfig:
    """What the daemon would run with: the real parser and the real validation."""
    ns = build_parser().parse_args(["serve", *args])
    overrides = {name: getattr(ns, name) for name in config_mod.FIELDS}
    return config_mod.load(ns.config, env=env or {}, overrides=overrides)


def launcher_args(argv: Sequence[str], env: Mapping[str, str]) -> argparse.Namespace | None:
    """rendezvous-run's view of ``argv`` (after the kubelet's $(VAR) expansion)."""
    parser = launcher_parser()
    if parser is None:
        return None
    assert argv[0] == "rendezvous-run", argv
    expanded = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in argv[1:]]
    return parser.parse_args(expanded)


def serve_args(invocations: Sequence[Invocation]) -> list[tuple[str, ...]]:
    return [inv.args for inv in invocations if inv.command == "rendezvousd serve"]


def arg_value(args: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def kube_docs() -> dict[str, list[dict[str, Any]]]:
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(KUBE.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            by_kind.setdefault(doc["kind"], []).append(doc)
    return by_kind
