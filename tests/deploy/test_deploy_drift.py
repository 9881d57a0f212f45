"""deploy/: the files use only flags and env vars the code has (and the drift
checker itself catches what it should)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deploy.deploy_tree import (
    COMPOSE,
    DEPLOY,
    DOCKERFILE,
    ENV_EXAMPLE,
    KUBE,
    UNIT,
    deploy_files,
    drift_problems,
    file_invocations,
    known_env_vars,
    known_flags,
)

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
        pytest.skip("rendezvousd.trainer.agent.launcher has no build_parser() yet")
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
        pytest.skip("rendezvousd.trainer.agent.launcher has no build_parser() yet")
    text = path.read_text()
    assert old in text
    problems = drift_problems(path, text.replace(old, new), known, known_env_vars())
    flag = new.strip('"').removeprefix("- ")
    assert any(f"`rendezvous-run` has no flag {flag}" in p for p in problems), problems
