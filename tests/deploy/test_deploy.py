"""deploy/: the files parse, use only flags and env vars the code has, hold the
hardening the checklist asks for, and the daemon behaves as the systemd unit, the
container HEALTHCHECK and the Kubernetes probes expect (sd_notify over a real
datagram socket, ``rendezvousd health`` exit codes, token file modes)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import json
import os
import re
import secrets
import select
import shlex
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rendezvousd import auth
from rendezvousd import config as config_mod
from rendezvousd.cli import build_parser
from rendezvousd.cli import main as cli_main
from rendezvousd.errors import ConfigError
from rendezvousd.sdnotify import Notifier

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
        return importlib.import_module("rendezvousd.trainer.launcher")
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
    from rendezvousd.client import connection
    from rendezvousd.trainer import config as trainer_config

    names = {config_mod.ENV_PREFIX + name.upper() for name in config_mod.FIELDS}
    names |= {auth.TOKEN_ENV, connection.TOKEN_ENV, connection.TOKEN_FILE_ENV}
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


# ---------------------------------------------------------------------------
# 1. Every file parses; the required keys and hardening are there.
# ---------------------------------------------------------------------------


def test_the_deploy_tree_has_the_expected_files() -> None:
    for rel in (
        "systemd/rendezvousd.service",
        "systemd/rendezvousd.env.example",
        "container/Dockerfile",
        "container/compose.yaml",
        "kubernetes/secret.example.yaml",
        "kubernetes/statefulset.yaml",
        "kubernetes/service.yaml",
        "kubernetes/worker-job.yaml",
    ):
        assert (DEPLOY / rel).is_file(), rel


@pytest.mark.parametrize(
    "path", sorted(DEPLOY.rglob("*.y*ml")), ids=lambda p: str(p.relative_to(DEPLOY))
)
def test_yaml_file_parses(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs and all(isinstance(d, dict) for d in docs)
    if path.parent == KUBE:
        for doc in docs:
            assert doc["apiVersion"] and doc["kind"], path
            if doc["kind"] != "Kustomization":
                assert doc["metadata"]["name"], path
                assert "namespace" not in doc["metadata"], (
                    f"{path.name}: keep it namespace-agnostic"
                )


def test_systemd_unit_is_type_notify_with_watchdog_and_hardening() -> None:
    unit = parse_unit(UNIT.read_text())
    svc = unit["Service"]

    def one(key: str) -> str:
        assert key in svc, f"[Service] lacks {key}="
        return svc[key][-1]  # the last assignment wins

    assert one("Type") == "notify"
    assert one("NotifyAccess") == "main"
    assert one("Restart") == "on-failure"
    for key in (
        "NoNewPrivileges", "ProtectHome", "PrivateTmp", "PrivateDevices", "LockPersonality",
        "RestrictRealtime", "RestrictNamespaces", "ProtectKernelTunables",
        "ProtectKernelModules", "ProtectKernelLogs", "ProtectControlGroups",
        "MemoryDenyWriteExecute",
    ):  # fmt: skip
        assert one(key) == "yes", key
    assert one("ProtectSystem") == "strict"
    assert one("UMask") == "0077"
    assert one("StateDirectory") == "rendezvousd"
    dynamic = svc.get("DynamicUser", ["no"])[-1] == "yes"
    assert dynamic or svc.get("User", [""])[-1] not in ("", "root", "0"), "run unprivileged"
    # No capabilities at all: both sets end up empty.
    assert one("CapabilityBoundingSet") == ""
    assert one("AmbientCapabilities") == ""
    assert set(one("RestrictAddressFamilies").split()) == {"AF_INET", "AF_INET6", "AF_UNIX"}
    assert "@system-service" in one("SystemCallFilter").split()
    assert "/etc/default/rendezvousd" in one("EnvironmentFile")

    # The daemon pings at half of WATCHDOG_USEC, well inside WatchdogSec.
    watchdog = systemd_seconds(one("WatchdogSec"))
    notifier = Notifier.from_env({"WATCHDOG_USEC": str(int(watchdog * 1_000_000))})
    assert notifier.watchdog_interval is not None and 0 < notifier.watchdog_interval < watchdog

    # The token comes in as a credential, the state dir from StateDirectory=.
    assert any(c.startswith("token:/") for c in svc["LoadCredential"])
    exec_start = shlex.split(one("ExecStart"))
    assert arg_value(exec_start, "--token-file") == "${CREDENTIALS_DIRECTORY}/token"
    assert arg_value(exec_start, "--state-dir") in ("${STATE_DIRECTORY}", "/var/lib/rendezvousd")
    assert arg_value(exec_start, "--listen") is not None

    # What ExecStart runs with is a configuration the daemon accepts, and the
    # stop timeout leaves room for the whole drain.
    env = dict(item.split("=", 1) for line in svc["Environment"] for item in shlex.split(line))
    env |= {
        "CREDENTIALS_DIRECTORY": "/run/credentials/rendezvousd.service",
        "STATE_DIRECTORY": "/var/lib/rendezvousd",
    }
    argv = [re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], a) for a in exec_start]
    assert argv[:3] == ["/usr/bin/env", "rendezvousd", "serve"]
    cfg = serve_config(argv[3:], env={k: v for k, v in env.items() if k.startswith("RENDEZVOUSD_")})
    assert cfg.token_file == Path("/run/credentials/rendezvousd.service/token")
    assert systemd_seconds(one("TimeoutStopSec")) > cfg.drain_grace_s + 5


def test_env_example_values_are_accepted_and_defaults_are_current() -> None:
    assignments = dict(
        re.findall(r"^#?(RENDEZVOUSD_[A-Z0-9_]+)=(\S*)$", ENV_EXAMPLE.read_text(), re.M)
    )
    fields = {config_mod.ENV_PREFIX + n.upper(): f for n, f in config_mod.FIELDS.items()}
    assert set(assignments) <= set(fields), "only daemon settings belong in the env file"
    assert "RENDEZVOUSD_TOKEN" not in assignments
    config_mod.load(None, env=assignments)  # every value has the right type and passes checks
    for var, value in assignments.items():
        default = fields[var].default
        if isinstance(default, bool):
            assert value.lower() == str(default).lower(), f"{var}: default is {default}"
        elif isinstance(default, int | float):
            assert float(value) == default, f"{var}: shown as {value}, default is {default}"


def test_dockerfile_is_non_root_with_a_health_check_and_an_accepted_default_command() -> None:
    ins = dockerfile_instructions(DOCKERFILE.read_text())
    keywords = [i.keyword for i in ins]
    assert ins[keywords.index("FROM")].rest.startswith("python:3.11-slim")
    final_stage = ins[len(keywords) - 1 - keywords[::-1].index("FROM") :]
    assert final_stage[0].rest.startswith("python:3.11-slim")
    assert any("pip install --no-cache-dir" in i.rest and i.rest.endswith(" .") for i in ins)

    users = [i.rest for i in final_stage if i.keyword == "USER"]
    assert users, "the final stage must drop root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "numeric, non-zero: runAsNonRoot can verify it"

    assert str(PORT) in " ".join(i.rest for i in final_stage if i.keyword == "EXPOSE").split()
    health = [i.rest for i in final_stage if i.keyword == "HEALTHCHECK"]
    assert len(health) == 1
    subcommands = frozenset(_subparsers(build_parser()))
    checks = text_invocations(health[0], subcommands)
    assert checks and all(c.command == "rendezvousd health" for c in checks)
    assert all(arg_value(c.args, "--endpoint") == f"127.0.0.1:{PORT}" for c in checks)

    entrypoint = _exec_form(next(i.rest for i in final_stage if i.keyword == "ENTRYPOINT"))
    cmd = _exec_form(next(i.rest for i in final_stage if i.keyword == "CMD"))
    assert entrypoint == ["rendezvousd"]
    assert cmd[0] == "serve"
    cfg = serve_config(cmd[1:])
    assert cfg.listen == f"0.0.0.0:{PORT}"
    assert cfg.tls_cert is not None or cfg.insecure_plaintext, "refused otherwise"
    assert cfg.tls_cert is not None, "the image's default is TLS; plaintext is an explicit opt-in"
    # The only writable places: the state dir (created for uid 10001) and /tmp.
    assert cfg.state_dir == Path("/var/lib/rendezvousd")
    assert any("/var/lib/rendezvousd" in i.rest for i in final_stage if i.keyword == "VOLUME")
    assert any(f"-o {uid}" in i.rest and "/var/lib/rendezvousd" in i.rest for i in final_stage)
    assert cfg.token_file is not None and str(cfg.token_file).startswith("/run/secrets/")


def test_compose_runs_read_only_non_root_and_waits_for_a_healthy_daemon() -> None:
    doc = yaml.safe_load(COMPOSE.read_text())
    services: dict[str, Any] = doc["services"]
    assert {"rendezvousd", "node0", "node1"} <= set(services)
    subcommands = frozenset(_subparsers(build_parser()))
    for name, svc in services.items():
        assert svc["read_only"] is True, name
        assert any(str(t).split(":")[0] == "/tmp" for t in svc["tmpfs"]), name
        assert int(str(svc["user"]).split(":")[0]) != 0, name
        assert svc["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in svc["security_opt"], name

    server = services["rendezvousd"]
    (args,) = serve_args(argv_invocations(_as_argv(server["command"]), subcommands))
    cfg = serve_config(args)
    secret = doc["secrets"]["rendezvousd_token"]
    assert "file" in secret
    assert cfg.token_file == Path("/run/secrets/rendezvousd_token")
    assert "rendezvousd_token" in server["secrets"]
    assert cfg.state_dir is not None
    assert any(str(v).endswith(f":{cfg.state_dir}") for v in server["volumes"])
    if cfg.insecure_plaintext:  # documented: only on an internal network, nothing published
        assert "ports" not in server
        assert all(doc["networks"][n]["internal"] is True for n in server["networks"])
    test = server["healthcheck"]["test"]
    (check,) = argv_invocations([str(t) for t in test[1:]], subcommands)
    assert check.command == "rendezvousd health"
    assert arg_value(check.args, "--endpoint") == f"127.0.0.1:{PORT}"

    for rank, name in enumerate(("node0", "node1")):
        node = services[name]
        assert node["depends_on"]["rendezvousd"]["condition"] == "service_healthy"
        argv = [*_as_argv(node.get("entrypoint")), *_as_argv(node.get("command"))]
        assert argv[0] == "rendezvous-run"
        assert arg_value(argv, "--node-rank") == str(rank)
        assert arg_value(argv, "--nnodes") == "2"
        assert arg_value(argv, "--rdzv-endpoint") == f"rendezvousd:{PORT}"
        assert arg_value(argv, "-m") == "rendezvousd.trainer.example"
        assert node["environment"]["RENDEZVOUSD_TOKEN_FILE"] == str(cfg.token_file)
        parsed = launcher_args(argv, {})
        if parsed is not None:
            assert (parsed.nnodes, parsed.node_rank, parsed.nproc_per_node) == (2, rank, 2)
            assert (parsed.module, parsed.target, parsed.backend) == (
                True,
                "rendezvousd.trainer.example",
                "cpu",
            )
        assert "rendezvousd_token" in node["secrets"]


def _containers(pod: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def _assert_hardened(pod: Mapping[str, Any]) -> None:
    psc = pod["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0
    assert psc["seccompProfile"]["type"] == "RuntimeDefault"
    assert pod["automountServiceAccountToken"] is False
    for c in _containers(pod):
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False, c["name"]
        assert sc["readOnlyRootFilesystem"] is True, c["name"]
        assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
        assert sc.get("runAsNonRoot", psc["runAsNonRoot"]) is True, c["name"]
        assert sc.get("seccompProfile", psc["seccompProfile"])["type"] == "RuntimeDefault"


def _mount_for(container: Mapping[str, Any], path: str) -> dict[str, Any]:
    mounts = [
        m for m in container["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")
    ]
    assert mounts, f"nothing mounted at {path}"
    return max(mounts, key=lambda m: len(m["mountPath"]))


def _env(container: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def test_kubernetes_daemon_is_hardened_probed_over_grpc_and_reads_a_private_token() -> None:
    docs = kube_docs()
    (sts,) = docs["StatefulSet"]
    assert sts["spec"]["replicas"] == 1
    pod = sts["spec"]["template"]["spec"]
    _assert_hardened(pod)
    (container,) = pod["containers"]
    argv = [*_as_argv(container.get("command")), *_as_argv(container.get("args"))]
    (args,) = serve_args(argv_invocations(argv, frozenset(_subparsers(build_parser()))))
    cfg = serve_config(args)
    assert cfg.listen.endswith(f":{PORT}")
    assert pod["terminationGracePeriodSeconds"] > cfg.drain_grace_s
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == PORT, probe

    # The token file the daemon reads must be 0600/0400 and group-unreadable.
    assert cfg.token_file is not None
    volumes = {v["name"]: v for v in pod["volumes"]}
    token_volume = volumes[_mount_for(container, str(cfg.token_file))["name"]]
    secrets = [v for v in pod["volumes"] if "secret" in v]
    assert secrets and all(v["secret"]["defaultMode"] in (0o400, 0o600) for v in secrets)
    if "secret" in token_volume:
        # The kubelet adds group-read to Secret files when fsGroup is set.
        assert "fsGroup" not in pod["securityContext"]
    else:
        # A private copy: an init container installs the Secret's file at 0600.
        assert token_volume["emptyDir"]["medium"] == "Memory"
        installers = [
            c
            for c in pod.get("initContainers", [])
            if any(m["name"] == token_volume["name"] for m in c["volumeMounts"])
        ]
        assert installers, "who writes the token copy?"
        command = [*installers[0]["command"], *installers[0].get("args", [])]
        assert arg_value(command, "-m") in ("0600", "0400", "600", "400")
        assert any(volumes[m["name"]].get("secret") for m in installers[0]["volumeMounts"])

    (svc,) = docs["Service"]
    assert svc["spec"]["type"] == "ClusterIP"
    selector = svc["spec"]["selector"]
    assert selector.items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    grpc_port = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc")
    assert (grpc_port["port"], grpc_port["appProtocol"]) == (PORT, "grpc")

    (policy,) = docs["NetworkPolicy"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= selector.items()

    (secret,) = docs["Secret"]
    with pytest.raises(ConfigError):  # the placeholder fails closed if applied as is
        auth.validate_tokens(secret["stringData"]["token"].splitlines(), "example")

    (kustomization,) = docs["Kustomization"]
    assert all((KUBE / r).is_file() for r in kustomization["resources"])
    assert "secret.example.yaml" not in kustomization["resources"]


def test_kubernetes_worker_job_takes_its_node_rank_from_the_completion_index() -> None:
    docs = kube_docs()
    (job,) = docs["Job"]
    (svc,) = docs["Service"]
    (policy,) = docs["NetworkPolicy"]
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    pod = spec["template"]["spec"]
    _assert_hardened(pod)
    (worker,) = pod["containers"]
    argv = [*_as_argv(worker.get("command")), *_as_argv(worker.get("args"))]
    assert argv[0] == "rendezvous-run"
    env = _env(worker)
    field_path = env["RENDEZVOUSD_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert "batch.kubernetes.io/job-completion-index" in field_path
    # The launcher takes the rank as a flag; the kubelet expands $(VAR) into it.
    assert arg_value(argv, "--node-rank") == "$(RENDEZVOUSD_NODE_RANK)"
    assert int(arg_value(argv, "--nnodes") or 0) == spec["completions"] == spec["parallelism"]
    parsed = launcher_args(argv, {"RENDEZVOUSD_NODE_RANK": "1"})
    if parsed is not None:
        assert (parsed.nnodes, parsed.node_rank) == (spec["completions"], 1)
        assert (parsed.module, parsed.target) == (True, "rendezvousd.trainer.example")
    grpc_port = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc")
    assert env["RENDEZVOUSD_ENDPOINT"]["value"] == f"{svc['metadata']['name']}:{grpc_port['port']}"
    token_mount = _mount_for(worker, env["RENDEZVOUSD_TOKEN_FILE"]["value"])
    volume = next(v for v in pod["volumes"] if v["name"] == token_mount["name"])
    assert volume["secret"]["secretName"] == docs["Secret"][0]["metadata"]["name"]
    allowed = [
        peer["podSelector"]["matchLabels"]
        for rule in policy["spec"]["ingress"]
        if any(p["port"] == PORT for p in rule["ports"])
        for peer in rule["from"]
    ]
    labels = spec["template"]["metadata"]["labels"]
    assert any(sel.items() <= labels.items() for sel in allowed), "the policy would block it"


# ---------------------------------------------------------------------------
# 2. Drift: deploy files use only flags and env vars that exist.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", deploy_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_deploy_file_uses_only_real_flags_and_env_vars(path: Path) -> None:
    assert drift_problems(path, path.read_text(), known_flags(), known_env_vars()) == []


def test_deploy_files_do_call_the_cli() -> None:
    """Guards the drift test against finding nothing to check."""
    known = known_flags()
    subcommands = frozenset(c.split(" ", 1)[1] for c in known if c.startswith("rendezvousd "))
    calls = {
        inv.command
        for path in deploy_files()
        for inv in file_invocations(path, path.read_text(), subcommands)
    }
    assert {
        "rendezvousd serve",
        "rendezvousd health",
        "rendezvousd token",
        "rendezvous-run",
    } <= calls


def test_rendezvous_run_flags_in_deploy_files_exist() -> None:
    known = known_flags()
    if "rendezvous-run" not in known:
        pytest.skip("rendezvousd.trainer.launcher has no build_parser() yet")
    test_deploy_files_do_call_the_cli()
    for path in deploy_files():
        assert drift_problems(path, path.read_text(), known, known_env_vars()) == []


KNOWN = {
    "rendezvousd serve": frozenset({"--listen", "--token-file", "--insecure-plaintext"}),
    "rendezvousd health": frozenset({"--endpoint", "--timeout"}),
    "rendezvousd token": frozenset({"--force"}),
}
ENV_VARS = frozenset({"RENDEZVOUSD_LISTEN", "RENDEZVOUSD_TOKEN_FILE"})


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("a.service", "ExecStart=/usr/bin/env rendezvousd serve --listen x --token-file t", []),
        ("a.service", "ExecStart=rendezvousd serve --listen x \\\n  --bogus-flag 1", ["--bogus-flag"]),
        ("a.service", "ExecStart=/opt/v/bin/rendezvousd serve --listen=x --tokenfile=t", ["--tokenfile"]),
        ("Dockerfile", 'HEALTHCHECK CMD ["rendezvousd", "health", "--endpoint", "x"]', []),
        ("Dockerfile", "HEALTHCHECK CMD rendezvousd health --port 1 || exit 1", ["--port"]),
        ("Dockerfile", 'ENTRYPOINT ["rendezvousd"]\nCMD ["serve", "--listen", "x"]', []),
        ("Dockerfile", 'ENTRYPOINT ["rendezvousd"]\nCMD ["serve", "--no-such"]', ["--no-such"]),
        ("Dockerfile", 'ENTRYPOINT ["rendezvousd"]\nCMD ["serv", "--listen", "x"]', ["rendezvousd serv"]),
        ("c.yaml", "s:\n  command:\n    - serve\n    - --listen\n    - x\n", []),
        ("c.yaml", "s:\n  command:\n    - serve\n    - --bogus\n", ["--bogus"]),
        ("c.yaml", "s:\n  command: [rendezvousd]\n  args: [health, --bogus]\n", ["--bogus"]),
        ("c.yaml", "h:\n  test: [CMD-SHELL, 'rendezvousd health --endpoint x --nope']\n", ["--nope"]),
        ("c.yaml", "s:\n  command: [sh, -c, 'rendezvousd token /t --force && rendezvousd serve --x']\n", ["--x"]),
        ("c.yaml", "# run `rendezvousd token FILE --forse` first\nk: v\n", ["--forse"]),
        ("c.yaml", "# rendezvousd is the daemon; --anything here is prose\nk: v\n", []),
        ("e.env", "RENDEZVOUSD_LISTEN=x\n#RENDEZVOUSD_TOKEN_FILE=y\n", []),
        ("e.env", "RENDEZVOUSD_LISTEN=x\n#RENDEZVOUSD_LISTEN_PORT=1\n", ["RENDEZVOUSD_LISTEN_PORT"]),
        ("c.yaml", "env:\n  - name: RENDEZVOUSD_NODERANK\n    value: '0'\n", ["RENDEZVOUSD_NODERANK"]),
    ],
)  # fmt: skip
def test_drift_checker_flags_what_the_cli_lacks(name: str, text: str, expected: list[str]) -> None:
    problems = drift_problems(Path(name), text, KNOWN, ENV_VARS)
    assert len(problems) == len(expected), problems
    for problem, word in zip(problems, expected, strict=True):
        assert word in problem


@pytest.mark.parametrize(
    ("path", "old", "new", "expected"),
    [
        (UNIT, "--state-dir ", "--state-directory ", "--state-directory"),
        (DOCKERFILE, '"--drain-grace-s"', '"--drain-grace"', "--drain-grace"),
        (DOCKERFILE, "--timeout 3;", "--timeout 3 --insecure;", "--insecure"),
        (COMPOSE, "- --insecure-plaintext", "- --insecure-plain", "--insecure-plain"),
        (KUBE / "statefulset.yaml", "- --metrics-listen", "- --metrics-addr", "--metrics-addr"),
        (
            KUBE / "worker-job.yaml",
            "RENDEZVOUSD_NODE_RANK",
            "RENDEZVOUSD_NODERANK",
            "RENDEZVOUSD_NODERANK",
        ),
        (ENV_EXAMPLE, "#RENDEZVOUSD_MAX_JOBS=", "#RENDEZVOUSD_MAX_JOB=", "RENDEZVOUSD_MAX_JOB"),
    ],
    ids=lambda v: v.name if isinstance(v, Path) else None,
)
def test_drift_checker_catches_a_bogus_flag_in_a_copy_of_a_real_file(
    path: Path, old: str, new: str, expected: str
) -> None:
    text = path.read_text()
    assert old in text
    copy = text.replace(old, new, 1)
    problems = drift_problems(path, copy, known_flags(), known_env_vars())
    assert any(expected in p for p in problems), problems
    assert drift_problems(path, text, known_flags(), known_env_vars()) == []


@pytest.mark.parametrize(
    ("path", "old", "new"),
    [
        (COMPOSE, '"--rdzv-endpoint"', '"--rdzv-addr"'),
        (KUBE / "worker-job.yaml", "- --nproc-per-node", "- --nprocs-per-node"),
    ],
    ids=["compose.yaml", "worker-job.yaml"],
)
def test_drift_checker_catches_a_bogus_launcher_flag(path: Path, old: str, new: str) -> None:
    known = known_flags()
    if "rendezvous-run" not in known:
        pytest.skip("rendezvousd.trainer.launcher has no build_parser() yet")
    text = path.read_text()
    assert old in text
    problems = drift_problems(path, text.replace(old, new), known, known_env_vars())
    flag = new.strip('"').removeprefix("- ")
    assert any(f"`rendezvous-run` has no flag {flag}" in p for p in problems), problems


# ---------------------------------------------------------------------------
# 3. systemd's own checks, where systemd-analyze is installed.
# ---------------------------------------------------------------------------

needs_systemd_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed"
)


@needs_systemd_analyze
def test_systemd_analyze_verify_accepts_the_unit() -> None:
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(UNIT)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = (result.stdout + result.stderr).strip()
    ours = [line for line in output.splitlines() if UNIT.name in line]
    if result.returncode != 0 and not ours:
        pytest.skip(f"systemd-analyze cannot run here: {output[:300]}")
    # Unknown keys and bad values are only warnings (exit 0): fail on any line.
    assert ours == [] and result.returncode == 0, output


@needs_systemd_analyze
def test_systemd_analyze_security_rates_the_unit_ok() -> None:
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--no-pager", str(UNIT)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    match = re.search(r"Overall exposure level for \S+: ([\d.]+)", result.stdout)
    if match is None:
        pytest.skip(f"systemd-analyze security --offline unsupported: {result.stderr[:300]}")
    assert float(match.group(1)) <= 2.0, result.stdout[-2000:]


# ---------------------------------------------------------------------------
# 4. The running daemon: sd_notify, health, token files.
# ---------------------------------------------------------------------------

WATCHDOG_USEC = 200_000
START_TIMEOUT = 20.0


def cli() -> list[str]:
    script = Path(sys.executable).with_name("rendezvousd")
    return [str(script)] if script.exists() else [sys.executable, "-m", "rendezvousd.cli"]


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RENDEZVOUSD_", "NOTIFY_SOCKET", "WATCHDOG_", "LISTEN_"))
    }
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run_cli(*args: str, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*cli(), *args], capture_output=True, text=True, timeout=timeout, env=clean_env()
    )


def new_token(path: Path) -> str:
    result = run_cli("token", str(path))
    assert result.returncode == 0, result.stderr
    return path.read_text().strip()


@contextlib.contextmanager
def daemon(tmp_path: Path, token_file: Path, **env: str) -> Iterator[subprocess.Popen[str]]:
    log = tmp_path / "daemon.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [
                *cli(), "serve", "--listen", "127.0.0.1:0", "--token-file", str(token_file),
                "--drain-grace-s", "1", "--no-reflection",
            ],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=clean_env(**env),
        )  # fmt: skip
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


def daemon_log(tmp_path: Path) -> str:
    path = tmp_path / "daemon.log"
    return path.read_text()[-3000:] if path.exists() else ""


def stdout_port(proc: subprocess.Popen[str], timeout: float = START_TIMEOUT) -> int:
    """The port from the one stable stdout line, ``rendezvousd: serving on HOST:PORT``."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.1)
        if ready:
            line = proc.stdout.readline()
            match = re.search(r"serving on 127\.0\.0\.1:(\d+)", line)
            if match:
                return int(match.group(1))
            if not line:
                break
    raise AssertionError(f"no 'serving on' line (exit code {proc.poll()})")


def health_status(port: int, service: str = "") -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return int(response.status)


@dataclass(frozen=True)
class Notification:
    fields: dict[str, str]
    sender_pid: int | None
    at: float


def receive(sock: socket.socket, deadline: float, what: str, tmp_path: Path) -> Notification:
    sock.settimeout(max(0.001, deadline - time.monotonic()))
    try:
        data, ancdata, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(struct.calcsize("3i")))
    except TimeoutError:
        raise AssertionError(
            f"no {what} datagram in time; daemon log:\n{daemon_log(tmp_path)}"
        ) from None
    lines = data.decode().splitlines()
    assert lines and all("=" in line for line in lines), f"not KEY=VALUE lines: {data!r}"
    pid = None
    for level, kind, cdata in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            pid = struct.unpack("3i", cdata[: struct.calcsize("3i")])[0]
    return Notification(dict(line.split("=", 1) for line in lines), pid, time.monotonic())


@contextlib.contextmanager
def notify_socket() -> Iterator[tuple[socket.socket, str]]:
    # A short directory: AF_UNIX paths are limited to 107 bytes.
    with tempfile.TemporaryDirectory(prefix="rdzv-", dir="/tmp") as directory:
        path = os.path.join(directory, "notify")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.bind(path)
            # As systemd does: the kernel then tells us which pid sent each datagram.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            yield sock, path


def test_notify_ready_after_serving_then_watchdog_then_stopping_on_sigterm(tmp_path: Path) -> None:
    token = tmp_path / "token"
    new_token(token)  # written by `rendezvousd token`, so this also proves serve accepts it
    with (
        notify_socket() as (sock, path),
        daemon(tmp_path, token, NOTIFY_SOCKET=path, WATCHDOG_USEC=str(WATCHDOG_USEC)) as proc,
    ):
        # READY=1 comes first, from the main pid, naming it, once serving.
        ready = receive(sock, time.monotonic() + START_TIMEOUT, "READY=1", tmp_path)
        assert ready.fields.get("READY") == "1", ready.fields
        match = re.search(r"127\.0\.0\.1:(\d+)", ready.fields.get("STATUS", ""))
        assert match, ready.fields
        port = int(match.group(1))
        # Right away: READY=1 must mean health already answers SERVING.
        assert health_status(port) == health_pb2.HealthCheckResponse.SERVING
        assert (
            health_status(port, "rendezvous.v1.Rendezvous")
            == health_pb2.HealthCheckResponse.SERVING
        )
        assert ready.fields.get("MAINPID") == str(proc.pid)
        assert ready.sender_pid == proc.pid, "NotifyAccess=main drops datagrams from other pids"
        assert stdout_port(proc) == port

        # WATCHDOG=1 keeps coming, from the main pid, faster than WATCHDOG_USEC.
        # Drop the pings queued meanwhile so the gaps below are real ones.
        sock.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                assert sock.recv(4096) == b"WATCHDOG=1"
        pings: list[Notification] = []
        deadline = time.monotonic() + 5
        while len(pings) < 5:
            note = receive(sock, deadline, "WATCHDOG=1", tmp_path)
            assert note.fields == {"WATCHDOG": "1"}, note.fields
            assert note.sender_pid == proc.pid
            pings.append(note)
        gaps = [b.at - a.at for a, b in itertools.pairwise(pings)]
        assert sum(gaps) / len(gaps) < WATCHDOG_USEC / 1e6, gaps

        # SIGTERM: STOPPING=1 (only watchdog pings before it), health no longer
        # SERVING, exit 0 within the drain grace plus a margin.
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        while True:
            note = receive(sock, sent + 10, "STOPPING=1", tmp_path)
            if note.fields.get("STOPPING") == "1":
                break
            assert note.fields == {"WATCHDOG": "1"}, note.fields
        assert note.sender_pid == proc.pid
        with contextlib.suppress(grpc.RpcError):
            assert health_status(port) != health_pb2.HealthCheckResponse.SERVING
        assert proc.wait(timeout=10) == 0, daemon_log(tmp_path)
        assert time.monotonic() - sent < 1 + 5
        # Nothing after the exit claims readiness again.
        sock.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                assert b"READY=1" not in sock.recv(4096)


def test_no_watchdog_pings_when_they_are_meant_for_another_process() -> None:
    other = Notifier.from_env({"WATCHDOG_USEC": "200000", "WATCHDOG_PID": str(os.getppid())})
    assert other.watchdog_interval is None
    own = Notifier.from_env({"WATCHDOG_USEC": "200000", "WATCHDOG_PID": str(os.getpid())})
    assert own.watchdog_interval == pytest.approx(0.1)
    assert Notifier.from_env({}).watchdog_interval is None


def write_token(path: Path) -> str:
    token = secrets.token_urlsafe(32)
    path.touch(mode=0o600)
    path.write_text(token + "\n")
    return token


def test_health_exits_0_when_serving_and_2_when_nothing_listens(tmp_path: Path) -> None:
    token = tmp_path / "token"
    write_token(token)
    with daemon(tmp_path, token) as proc:
        port = stdout_port(proc)
        result = run_cli("health", "--endpoint", f"127.0.0.1:{port}", "--timeout", "5")
        assert result.returncode == 0, result.stderr
        assert "SERVING" in result.stdout
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0, daemon_log(tmp_path)

    with socket.socket() as s:  # a port that was free a moment ago and now nothing holds
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    result = run_cli("health", "--endpoint", f"127.0.0.1:{closed}", "--timeout", "2")
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "cannot reach" in result.stderr


def test_token_command_writes_a_0600_file_and_never_overwrites_silently(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "token"
    first = new_token(path)  # the installed console script
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert auth.read_token_file(path) == [first]  # what serve's loader accepts
    # The rest in-process (same code, no interpreter start-up).
    assert cli_main(["token", str(path)]) == 1
    assert "--force" in capsys.readouterr().err
    assert path.read_text().strip() == first
    path.chmod(0o644)  # --force must not keep a loose mode on the file it replaces
    assert cli_main(["token", "--force", str(path)]) == 0
    output = capsys.readouterr()
    token = path.read_text().strip()
    assert token not in ("", first)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert token not in output.out + output.err  # never echoed


@pytest.mark.parametrize("mode", [0o644, 0o640])
def test_serve_refuses_a_token_file_others_can_read(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "token"
    token = write_token(path)
    path.chmod(mode)
    result = run_cli("serve", "--listen", "127.0.0.1:0", "--token-file", str(path))
    assert result.returncode == 2
    assert "chmod 600" in result.stderr, result.stderr
    assert "serving on" not in result.stdout
    assert token not in result.stdout + result.stderr
