"""The agent -> worker hand-off and what the worker builds from it: one definition
of the id size, one typed assignment, the reducer and the rank-0 log line."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support import ROOT

PACKAGES = ("rendezvousd", "client", "trainer")


def _module_constants(path: Path) -> dict[str, object]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = node.value.value
    return out


def test_the_unique_id_size_is_defined_in_one_module() -> None:
    defining = [
        f"{path.relative_to(ROOT)}:{name}"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if "_gen" not in path.parts
        for name, value in _module_constants(path).items()
        if name.endswith("ID_BYTES") and value == 128
    ]
    assert defining == ["rendezvousd/validation.py:UNIQUE_ID_BYTES"]
