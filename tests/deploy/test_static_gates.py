"""Static gates on the product code and its dependency floors.

* No pickle/marshal (or friends) imports, no eval/exec calls, no
  ``allow_pickle=True``: parsed with ``ast`` so strings and comments don't count.
* CuPy is imported only inside functions of trainer/comm/nccl.py (CPU-only installs
  must import everything else).
* grpcio and protobuf, installed and as declared floors in pyproject.toml, are
  at or above the releases that fix the CVEs below; lowering a floor fails here.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.support import ROOT

PRODUCT_DIRS = ("rendezvousd", "client", "trainer")
FORBIDDEN_MODULES = frozenset(
    {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "jsonpickle"}
)
FORBIDDEN_CALLS = frozenset({"eval", "exec"})
TORCH_HOME = "trainer/torchrun/handler.py"
CUPY_HOME = "trainer/comm/nccl.py"


def product_files() -> list[Path]:
    files = [
        p
        for d in PRODUCT_DIRS
        for p in sorted((ROOT / d).rglob("*.py"))
        if "_gen" not in p.relative_to(ROOT).parts and "__pycache__" not in p.parts
    ]
    return files


@dataclass(frozen=True)
class Import:
    module: str
    line: int
    in_function: bool


def _const_str(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


class Scan(ast.NodeVisitor):
    """Imports (with whether they sit inside a function) and forbidden calls."""

    def __init__(self) -> None:
        self.imports: list[Import] = []
        self.calls: list[tuple[str, int]] = []
        self._depth = 0

    def _function(self, node: ast.AST) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.imports.append(Import(alias.name, node.lineno, self._depth > 0))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and node.level == 0:
            self.imports.append(Import(node.module, node.lineno, self._depth > 0))

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = (
            func.id
            if isinstance(func, ast.Name)
            else func.attr
            if isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id in ("builtins", "__builtins__")
            else None
        )
        if name in FORBIDDEN_CALLS:
            self.calls.append((f"{name}()", node.lineno))
        # importlib.import_module("pickle") / __import__("pickle")
        dynamic = (isinstance(func, ast.Name) and func.id == "__import__") or (
            isinstance(func, ast.Attribute) and func.attr == "import_module"
        )
        if dynamic and node.args and (target := _const_str(node.args[0])) is not None:
            self.imports.append(Import(target, node.lineno, self._depth > 0))
        for kw in node.keywords:
            if kw.arg == "allow_pickle" and not (
                isinstance(kw.value, ast.Constant) and kw.value.value is False
            ):
                self.calls.append(("allow_pickle=<not False>", node.lineno))
        self.generic_visit(node)


def scan(source: str, name: str = "<string>") -> Scan:
    scanner = Scan()
    scanner.visit(ast.parse(source, filename=name))
    return scanner


def _top(module: str) -> str:
    return module.split(".", 1)[0]


@pytest.fixture(scope="module")
def scans() -> dict[str, Scan]:
    files = product_files()
    assert len(files) >= 20, f"the scan found only {len(files)} product files"
    return {p.relative_to(ROOT).as_posix(): scan(p.read_text(), str(p)) for p in files}


def test_scanner_ignores_strings_and_comments_but_finds_code() -> None:
    quiet = scan(
        '"""import pickle; eval(x)"""\n# import marshal\ns = "exec(code)"\n'
        "re.compile('x')\nobj.eval()\nnp.load(f, allow_pickle=False)\n"
    )
    assert (quiet.imports, quiet.calls) == ([], [])
    loud = scan(
        "import pickle\nfrom marshal import loads\nimport os.path, shelve\n"
        "def f():\n    import cupy.cuda.nccl\n    return eval('1')\n"
        "exec('x = 1')\nbuiltins.eval('2')\nimportlib.import_module('dill')\n"
        "np.load(f, allow_pickle=True)\n"
    )
    assert {_top(i.module) for i in loud.imports} == {
        "pickle",
        "marshal",
        "os",
        "shelve",
        "cupy",
        "dill",
    }
    assert [i.in_function for i in loud.imports if i.module.startswith("cupy")] == [True]
    assert sorted(c for c, _ in loud.calls) == [
        "allow_pickle=<not False>",
        "eval()",
        "eval()",
        "exec()",
    ]


def test_no_pickle_marshal_eval_exec(scans: dict[str, Scan]) -> None:
    found = [
        f"{name}:{i.line} imports {i.module}"
        for name, s in scans.items()
        for i in s.imports
        if _top(i.module) in FORBIDDEN_MODULES
    ]
    found += [f"{name}:{line} calls {call}" for name, s in scans.items() for call, line in s.calls]
    assert not found, "unsafe deserialization or dynamic code in product code:\n" + "\n".join(found)


def test_cupy_only_inside_functions_of_nccl_module(scans: dict[str, Scan]) -> None:
    cupy = {
        name: [i for i in s.imports if _top(i.module) in ("cupy", "cupyx")]
        for name, s in scans.items()
    }
    elsewhere = sorted(name for name, found in cupy.items() if found and name != CUPY_HOME)
    assert not elsewhere, f"CuPy is imported outside {CUPY_HOME}: {elsewhere}"
    at_module_level = [i.line for i in cupy.get(CUPY_HOME, []) if not i.in_function]
    assert not at_module_level, (
        f"{CUPY_HOME} imports CuPy at module level (lines {at_module_level}); "
        "CPU-only installs could not import it"
    )
    assert cupy.get(CUPY_HOME), f"{CUPY_HOME} no longer imports CuPy: update this gate"


def test_torch_only_in_the_torchrun_handler(scans: dict[str, Scan]) -> None:
    """torch is an optional extra: only the module torch itself loads (through its
    ``torchrun.handlers`` entry point) and the settings it reads may see it."""
    found = sorted(
        name
        for name, s in scans.items()
        if any(_top(i.module) == "torch" for i in s.imports) and name != TORCH_HOME
    )
    assert not found, f"torch is imported outside {TORCH_HOME}: {found}"
    assert any(_top(i.module) == "torch" for i in scans[TORCH_HOME].imports), (
        f"{TORCH_HOME} no longer imports torch: update this gate"
    )


# -- dependency floors --------------------------------------------------------------

# Fixed releases per CVE, one per release branch; a branch newer than every listed
# one is patched. CVE-2024-7246's fix on the 1.66 branch is taken to be 1.66.2
# (conservative), which is also the floor pyproject.toml declares.
GRPC_FIXES: dict[str, tuple[str, ...]] = {
    "CVE-2023-1428": ("1.53.0",),
    "CVE-2023-33953": ("1.53.2", "1.54.3", "1.55.3", "1.56.2"),
    "CVE-2023-44487": ("1.56.3", "1.57.1", "1.58.1", "1.59.2"),
    "CVE-2024-7246": (
        "1.58.3",
        "1.59.5",
        "1.60.2",
        "1.61.3",
        "1.62.3",
        "1.63.2",
        "1.64.3",
        "1.65.4",
        "1.66.2",
    ),
}
PROTOBUF_FIXES: dict[str, tuple[str, ...]] = {
    # Unbounded recursion parsing nested groups (Python: 4.25.5 / 5.28.2), and the
    # pure-Python backend's recursion limit bypass (4.25.8 / 5.29.5 / 6.31.1).
    "CVE-2024-7254": ("4.25.5", "5.28.2"),
    "CVE-2025-4565": ("4.25.8", "5.29.5", "6.31.1"),
}
GRPC_FLOOR = "1.66.2"
PROTOBUF_FLOOR = "4.25.8"
GRPC_PACKAGES = ("grpcio", "grpcio-health-checking", "grpcio-reflection", "grpcio-status")


def patched(installed: str, fixes: tuple[str, ...]) -> bool:
    """A release is patched when its minor branch got a fix it is at or past, or it
    belongs to a branch newer than every fixed one."""
    v = Version(installed)
    fixed = sorted(Version(f) for f in fixes)
    same_branch = [f for f in fixed if f.release[:2] == v.release[:2]]
    if same_branch:
        return v >= same_branch[0]
    return v.release[:2] > fixed[-1].release[:2]


def test_patched_logic() -> None:
    fixes = GRPC_FIXES["CVE-2023-44487"]
    assert patched("1.59.2", fixes) and patched("1.57.1", fixes) and patched("1.60.0", fixes)
    assert not patched("1.59.1", fixes) and not patched("1.55.9", fixes)
    assert not patched("1.66.1", GRPC_FIXES["CVE-2024-7246"])
    assert patched("1.66.2", GRPC_FIXES["CVE-2024-7246"])


def declared_floors() -> dict[str, str]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    floors: dict[str, str] = {}
    for line in data["project"]["dependencies"]:
        requirement = Requirement(line)
        for spec in requirement.specifier:
            if spec.operator in (">=", "==", "~="):
                floors[canonicalize_name(requirement.name)] = spec.version
    return floors


@pytest.mark.parametrize("package", [*GRPC_PACKAGES, "protobuf"])
def test_installed_versions_are_patched(package: str) -> None:
    installed = importlib.metadata.version(package)
    floor, fixes = (
        (PROTOBUF_FLOOR, PROTOBUF_FIXES) if package == "protobuf" else (GRPC_FLOOR, GRPC_FIXES)
    )
    assert Version(installed) >= Version(floor), f"{package} {installed} < {floor}"
    if package == "grpcio":  # the C core (and the CVEs) live in grpcio itself
        unpatched = [cve for cve, f in fixes.items() if not patched(installed, f)]
        assert not unpatched, f"installed grpcio {installed} is vulnerable to {unpatched}"
    if package == "protobuf":
        unpatched = [cve for cve, f in fixes.items() if not patched(installed, f)]
        assert not unpatched, f"installed protobuf {installed} is vulnerable to {unpatched}"


@pytest.mark.parametrize("package", [*GRPC_PACKAGES, "protobuf"])
def test_declared_floors_are_patched(package: str) -> None:
    floors = declared_floors()
    assert package in floors, f"pyproject.toml declares no lower bound for {package}"
    floor = floors[package]
    minimum, fixes = (
        (PROTOBUF_FLOOR, PROTOBUF_FIXES) if package == "protobuf" else (GRPC_FLOOR, GRPC_FIXES)
    )
    assert Version(floor) >= Version(minimum), (
        f"pyproject.toml lets {package} go down to {floor}; the patched minimum is {minimum}"
    )
    if package in ("grpcio", "protobuf"):
        unpatched = [cve for cve, f in fixes.items() if not patched(floor, f)]
        assert not unpatched, f"{package} floor {floor} allows releases vulnerable to {unpatched}"


def test_declared_floors_take_the_generated_codes_runtimes() -> None:
    """The committed gencode refuses, at import, a grpcio or protobuf older than the
    tools that made it; pyproject.toml let grpcio go down to 1.66.2 against gencode of
    1.85.1 (a review of the GPU path, whose lent machines bring their own grpcio)."""
    gen = ROOT / "rendezvousd" / "_gen" / "rendezvous" / "v1"
    grpc_gen = re.search(
        r"GRPC_GENERATED_VERSION = '([0-9.]+)'", (gen / "rendezvous_pb2_grpc.py").read_text()
    )
    pb_gen = re.search(
        r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*"
        r"(\d+),\s*(\d+),",
        (gen / "rendezvous_pb2.py").read_text(),
    )
    assert grpc_gen is not None and pb_gen is not None
    floors = declared_floors()
    for package in GRPC_PACKAGES:
        assert Version(floors[package]) >= Version(grpc_gen.group(1)), (package, floors)
    assert Version(floors["protobuf"]) >= Version(".".join(pb_gen.groups())), floors
