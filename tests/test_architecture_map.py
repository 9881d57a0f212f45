"""docs/architecture.md draws the tree: one table per folder, every module in it.

And `rendezvousd/common/`, the one home of what the three packages share, stays
importable without the daemon's other parts.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rendezvousd", "client", "trainer")
# Generated (scripts/gen_protos.py), listed as one folder in the map.
SKIP = {ROOT / "rendezvousd" / "_gen"}


def _sections() -> dict[str, str]:
    """Folder (as its heading names it, e.g. ``trainer/comm/``) -> its section's text."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    parts = re.split(r"^### ", text, flags=re.M)[1:]
    sections: dict[str, str] = {}
    for part in parts:
        folder = re.match(r"`([\w/]+/)`", part)
        if folder:
            sections[folder.group(1)] = part
    return sections


def _folders() -> list[Path]:
    found = []
    for package in PACKAGES:
        for init in sorted((ROOT / package).rglob("__init__.py")):
            folder = init.parent
            if not any(folder.is_relative_to(skip) for skip in SKIP):
                found.append(folder)
    return found


def test_every_module_is_in_its_folders_table() -> None:
    sections = _sections()
    missing = []
    for folder in _folders():
        name = folder.relative_to(ROOT).as_posix() + "/"
        section = sections.get(name)
        if section is None:
            missing.append(f"a section for {name}")
            continue
        for module in sorted(folder.glob("*.py")):
            if module.name in ("__init__.py", "__main__.py"):
                continue
            if f"`{module.name}`" not in section:
                missing.append(f"{name}{module.name}")
    assert not missing, f"docs/architecture.md lacks: {', '.join(missing)}"


def test_the_map_names_no_folder_that_is_gone() -> None:
    for folder in _sections():
        assert (ROOT / folder).is_dir(), f"docs/architecture.md maps {folder}, which is gone"


# Where each top folder installs (pyproject.toml): client/ is rendezvousd.client.
_INSTALLED = {"rendezvousd": "rendezvousd", "client": "rendezvousd.client",
              "trainer": "rendezvousd.trainer"}  # fmt: skip


def _package(module: Path) -> list[str]:
    """The dotted parts of the package ``module`` (a file under ROOT) belongs to: the
    one its relative imports count up from."""
    folder = module.parent.relative_to(ROOT).parts
    return [*_INSTALLED[folder[0]].split("."), *folder[1:]]


def _imports(module: Path, text: str | None = None) -> list[str]:
    """Every module name ``module`` imports (``from X import`` and ``import X``), a
    relative one resolved from its package (``from ..server import auth`` in
    rendezvousd/common/ is rendezvousd.server, and ``from .. import server`` names
    rendezvousd.server too): read as written, they escaped every check of the
    layers. ``text``: the source to read instead of the file's."""
    names: list[str] = []
    for node in ast.walk(ast.parse(module.read_text() if text is None else text)):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if node.module:
                    names.append(node.module)
                continue
            package = _package(module)
            base = package[: len(package) - (node.level - 1)]
            assert base, f"{module}: a relative import above the top package"
            if node.module:
                names.append(".".join([*base, node.module]))
            else:  # each name may be a module of the package
                names.extend(".".join([*base, alias.name]) for alias in node.names)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
    return names


def test_relative_imports_are_read_as_the_modules_they_name() -> None:
    grid = ROOT / "rendezvousd" / "common" / "grid.py"
    source = (
        "from ..server import auth\n"
        "from .. import daemon\n"
        "from . import escape\n"
        "from .members import Seat\n"
        "import rendezvousd.errors\n"
        "from rendezvousd.common import limits\n"
    )
    assert _imports(grid, source) == [
        "rendezvousd.server",
        "rendezvousd.daemon",
        "rendezvousd.common.escape",
        "rendezvousd.common.members",
        "rendezvousd.errors",
        "rendezvousd.common",
    ]
    # Each check reads such an import as the upward one it is.
    assert _layer("rendezvousd.server") > _layer("rendezvousd.common")  # type: ignore[operator]
    # The SDK installs as rendezvousd.client: its relative imports resolve there.
    assert _imports(ROOT / "client" / "sync.py", "from ._calls import Run\n") == [
        "rendezvousd.client._calls"
    ]


def test_common_imports_nothing_of_the_daemons_other_parts() -> None:
    allowed = ("rendezvousd.common", "rendezvousd.errors", "rendezvousd._gen")
    for module in sorted((ROOT / "rendezvousd" / "common").glob("*.py")):
        for name in _imports(module):
            if name == "rendezvousd" or name.startswith("rendezvousd."):
                assert name.startswith(allowed), f"{module.name} imports {name}"


# The daemon's parts, lowest first: each imports only the parts below it (and the
# package's own errors.py, config.py and _gen/), so the folders draw its layers.
LAYERS = ("common", "state", "storage", "server", "web", "daemon", "cli")


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "rendezvousd" or len(parts) < 2 or parts[1] not in LAYERS:
        return None
    return LAYERS.index(parts[1])


def test_the_daemons_parts_import_downwards_only() -> None:
    upward = []
    for path in sorted((ROOT / "rendezvousd").rglob("*.py")):
        if (ROOT / "rendezvousd" / "_gen") in path.parents:
            continue
        here = _layer(".".join(path.relative_to(ROOT).with_suffix("").parts))
        if here is None:
            continue
        for name in _imports(path):
            there = _layer(name)
            if there is not None and there > here:
                upward.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not upward, upward


def _named_modules(text: str) -> set[str]:
    return set(re.findall(r"`(\w+\.py)`", text))


def test_the_map_and_the_readme_name_no_module_that_is_gone() -> None:
    gone = [
        f"docs/architecture.md, {folder}: {name}"
        for folder, section in _sections().items()
        for name in _named_modules(section)
        if not (ROOT / folder / name).exists()
    ]
    readme = (ROOT / "README.md").read_text()
    layout = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    for row in re.findall(r"^\| `([\w/]+/)` \|(.*)$", layout, flags=re.M):
        folder, text = row
        gone += [
            f"README.md, {folder}: {name}"
            for name in _named_modules(text)
            if not (ROOT / folder / name).exists()
        ]
    assert not gone, f"named but not there: {gone}"
