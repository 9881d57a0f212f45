"""Every ```python block of docs/sdk.md runs as written against a real daemon.

Each block is a whole script. Its first line names its example: ``# example: NAME``,
with ``, worker I of N`` when it is one of N workers of one job, and ``, exits with
status K`` when it is meant to fail. The workers of an example run at once, each as a
process of its own, given the daemon in ``$RENDEZVOUSD_ENDPOINT`` and
``$RENDEZVOUSD_TOKEN_FILE`` and a fresh ``$RENDEZVOUSD_JOB_ID`` (the guide's "How to
run the examples" says the same). Each ``# prints: TEXT`` comment is one line of the
block's stdout, in order: a block passes when its stdout is exactly those lines and
its exit status the one named (0 when none is), so the guide fails here as soon as
the SDK answers differently from what it shows.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from rendezvousd.client import errors
from rendezvousd.client._session import ClientOptions, JoinRequest, NodeJoinRequest
from rendezvousd.client.connection import IDEMPOTENT, READS
from rendezvousd.common.calls import FIELDS
from tests.support import ROOT, DaemonProcess, Pki, spawn_daemon

DOC = ROOT / "docs" / "sdk.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
_HEADER = re.compile(
    r"# example: (?P<name>[a-z0-9-]+)"
    r"(?:, worker (?P<worker>\d+) of (?P<of>\d+))?"
    r"(?:, exits with status (?P<status>\d+))?"
)
_PRINTS = re.compile(r"#\s*prints: (.*)$", re.M)
# Examples that need a daemon with (mutual) TLS; every other one runs against a
# plaintext daemon with the daemon's default settings, as the guide describes.
TLS_EXAMPLES = frozenset({"tls"})
# Per example (all its workers): generous, for a loaded 2-core machine.
EXAMPLE_TIMEOUT_S = 90.0


@dataclass(frozen=True)
class Block:
    name: str
    worker: int
    of: int
    status: int
    code: str
    line: int  # where the block starts in the guide

    @property
    def expected(self) -> list[str]:
        return [text.rstrip() for text in _PRINTS.findall(self.code)]

    @property
    def where(self) -> str:
        return f"docs/sdk.md:{self.line} (example {self.name!r}, worker {self.worker} of {self.of})"


def doc_blocks(text: str) -> list[Block]:
    """Every python block of ``text``, its header read."""
    blocks = []
    for match in _BLOCK.finditer(text):
        code = match.group(1)
        line = text.count("\n", 0, match.start()) + 1
        header = _HEADER.fullmatch(code.split("\n", 1)[0])
        if header is None:
            raise AssertionError(
                f"docs/sdk.md:{line}: a python block must start with '# example: NAME' "
                f"(', worker I of N', ', exits with status K'), not {code.splitlines()[0]!r}"
            )
        blocks.append(
            Block(
                name=header["name"],
                worker=int(header["worker"] or 1),
                of=int(header["of"] or 1),
                status=int(header["status"] or 0),
                code=code,
                line=line,
            )
        )
    return blocks


def examples(text: str) -> dict[str, list[Block]]:
    """The blocks by example, in worker order; every example's workers 1..N present."""
    grouped: dict[str, list[Block]] = {}
    for block in doc_blocks(text):
        grouped.setdefault(block.name, []).append(block)
    for name, blocks in grouped.items():
        blocks.sort(key=lambda b: b.worker)
        sizes = {b.of for b in blocks}
        assert len(sizes) == 1, f"example {name!r}: its blocks disagree on N ({sorted(sizes)})"
        assert [b.worker for b in blocks] == list(range(1, sizes.pop() + 1)), (
            f"example {name!r} has workers {[b.worker for b in blocks]}, not 1..N"
        )
    return grouped


GUIDE = DOC.read_text()
EXAMPLES = examples(GUIDE)


def _env(endpoint: str, token_file: Path, job: str, extra: Mapping[str, str]) -> dict[str, str]:
    """The process environment of an example's workers: the guide's variables only,
    none of the runner's own RENDEZVOUSD_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RENDEZVOUSD_")}
    return env | {
        "RENDEZVOUSD_ENDPOINT": endpoint,
        "RENDEZVOUSD_TOKEN_FILE": str(token_file),
        "RENDEZVOUSD_JOB_ID": job,
        **extra,
    }


def run_example(
    name: str, d: DaemonProcess, folder: Path, extra: Mapping[str, str] | None = None
) -> None:
    """Run every worker of example ``name`` at once and check each one's exit and output."""
    blocks = EXAMPLES[name]
    env = _env(d.endpoint, d.token_file, f"docs-{name}-{secrets.token_hex(4)}", extra or {})
    procs: list[subprocess.Popen[str]] = []
    outcomes: list[tuple[int, str, str]] = []
    try:
        for block in blocks:
            script = folder / f"{name}-{block.worker}.py"
            script.write_text(block.code)
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=env,
                    cwd=folder,
                )
            )
        for proc in procs:
            out, err = proc.communicate(timeout=EXAMPLE_TIMEOUT_S)
            outcomes.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    for block, (status, out, err) in zip(blocks, outcomes, strict=True):
        assert d.token not in out and d.token not in err, f"{block.where} printed the token"
        assert (status, out.splitlines()) == (block.status, block.expected), (
            f"{block.where}: exit status {status} (the guide says {block.status}), "
            f"stdout {out.splitlines()!r}, the guide's '# prints:' lines {block.expected!r}; "
            f"stderr:\n{err[-4000:]}"
        )


@pytest.fixture(scope="module")
def guide_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """A daemon with its default settings (the timeouts the guide names)."""
    d = spawn_daemon(tmp_path_factory.mktemp("guide-daemon"))
    yield d
    d.kill()


def test_the_guide_has_examples_that_check_their_output() -> None:
    assert len(EXAMPLES) >= 8
    assert any(len(blocks) > 1 for blocks in EXAMPLES.values())
    for blocks in EXAMPLES.values():
        for block in blocks:
            assert block.expected, f"{block.where} has no '# prints:' line to check"


@pytest.mark.parametrize("name", sorted(set(EXAMPLES) - TLS_EXAMPLES))
def test_example_runs_as_written(guide_daemon: DaemonProcess, tmp_path: Path, name: str) -> None:
    run_example(name, guide_daemon, tmp_path)


@pytest.mark.parametrize("name", sorted(TLS_EXAMPLES))
def test_tls_example_runs_as_written(
    start_daemon: Callable[..., DaemonProcess], pki: Pki, tmp_path: Path, name: str
) -> None:
    d = start_daemon(*pki.serve_args(mtls=True))
    tls = {
        "RENDEZVOUSD_TLS_CA": str(pki.ca),
        "RENDEZVOUSD_TLS_CERT": str(pki.client),
        "RENDEZVOUSD_TLS_KEY": str(pki.client_key),
    }
    run_example(name, d, tmp_path, tls)


# -- the guide's reference tables name what the SDK has ------------------------------


def test_every_exception_class_is_in_the_errors_table() -> None:
    table = GUIDE.split("\n## Errors\n", 1)[1].split("\n## ", 1)[0]
    classes = [
        name
        for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, errors.RendezvousError)
    ]
    assert len(classes) >= 17
    missing = [name for name in classes if f"| `{name}`" not in table]
    assert not missing, f"docs/sdk.md's errors table lacks {missing}"


@pytest.mark.parametrize(
    ("section", "declared"),
    [
        ("## Making a client", ClientOptions),
        ("## `join()`", JoinRequest),
        ("## Node agents", NodeJoinRequest),
    ],
)
def test_every_keyword_is_named(section: str, declared: type) -> None:
    text = GUIDE.split(section, 1)[1].split("\n## ", 1)[0]
    missing = [k for k in declared.__annotations__ if not re.search(rf"\b{k}\b", text)]
    assert not missing, f"docs/sdk.md, {section!r}, does not name {missing}"


def test_the_retry_table_matches_the_policy() -> None:
    table = GUIDE.split("\n## Retries\n", 1)[1].split("\n## ", 1)[0]

    def named(marker: str) -> set[str]:
        (row,) = [line for line in table.splitlines() if line.startswith("|") and marker in line]
        return set(re.findall(r"`(\w+)`", row.split("|")[1]))

    never = {FIELDS[m] for m in FIELDS if m not in IDEMPOTENT}
    assert named("| **never**") == never
    reads = {FIELDS[m] for m in READS & set(FIELDS)} - {"get_members"}  # "the member table"
    assert named("| yes | yes |") == reads
