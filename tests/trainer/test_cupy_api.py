"""Our CuPy seam against the real CuPy package; no device needed, no call reaches CUDA.

The NCCL backend is tested on CPU against a fake ``cupy`` (``fake_cupy/``), so a name,
call shape or constant that drifted from the real package would go unnoticed until a
GPU session. Against the installed CuPy this checks that:

* every CuPy attribute our code reaches (``SEAM``, which must list every chain the
  code spells out from a CuPy module: read from the source) exists and accepts the
  call our code makes;
* every name the fake models (its knobs, ``fake_cupy.NOT_CUPY``, aside) exists as the
  same kind of thing, accepts the calls the fake accepts, and holds the same constant;
* the NCCL codes nccl.py hard-codes are CuPy's, and what nccl.py assumes of CuPy
  (how NcclError is built, which unique-id form it takes) holds.

The ``test`` extra installs ``cupy-cuda12x`` and its NCCL, so every test run (CI
included) runs it; it is skipped only where CuPy does not import (a venv without that
extra). scripts/gpu_check.sh runs it on a GPU host.
"""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from inspect import Parameter
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from rendezvousd.common.validation import UNIQUE_ID_BYTES
from rendezvousd.trainer.comm import nccl
from tests.support import ROOT
from tests.trainer import fake_cupy
from tests.trainer.fake_cupy import nccl as fake_nccl

REAL = nccl._cupy_or_none()  # through the seam: nccl.py stays the only CuPy importer

pytestmark = [
    pytest.mark.skipif(
        REAL is None, reason="needs the real CuPy package (no device): it does not import here"
    ),
    pytest.mark.skipif(
        REAL is not None and not REAL.cuda.nccl.available,
        reason="CuPy cannot load NCCL here: install nvidia-nccl-cu12 or nvidia-nccl-cu13",
    ),
]


@dataclass(frozen=True)
class Call:
    """Called with ``args`` positional arguments and these keywords."""

    args: int = 0
    keywords: tuple[str, ...] = ()


READ = "read"  # an attribute read (a class: used with isinstance)
CAUGHT = "caught"  # an exception class our code catches

# Every CuPy attribute our code reaches, from the cupy module, and how: "X()" is an
# instance of X, or what calling X returns (HOLDS). Rows reached through a local name
# (comm, stream, event, array) are listed by hand; the others must match the source.
SEAM: list[tuple[str, Call | str]] = [
    # trainer/comm/nccl.py
    ("__version__", READ),
    ("cuda.nccl", READ),
    ("cuda.nccl.available", READ),
    ("cuda.nccl.get_unique_id", Call()),
    ("cuda.nccl.get_version", Call()),
    ("cuda.nccl.NcclError", CAUGHT),
    ("cuda.nccl.NcclError().status", READ),
    ("cuda.nccl.NcclCommunicator", Call(3)),
    ("cuda.nccl.NcclCommunicator().allReduce", Call(6)),
    ("cuda.nccl.NcclCommunicator().broadcast", Call(6)),
    ("cuda.nccl.NcclCommunicator().check_async_error", Call()),
    ("cuda.nccl.NcclCommunicator().abort", Call()),
    ("cuda.nccl.NcclCommunicator().destroy", Call()),
    ("cuda.runtime.getDeviceCount", Call()),
    ("cuda.runtime.CUDARuntimeError", CAUGHT),
    ("cuda.runtime.CUDARuntimeError", Call(1)),
    ("cuda.runtime", READ),
    ("cuda.runtime.eventQuery", READ),
    ("cuda.runtime.eventQuery", Call(1)),
    ("cuda.driver.CUDADriverError", CAUGHT),
    ("cuda.memory.OutOfMemoryError", CAUGHT),
    ("cuda.Device", Call(1)),
    ("cuda.Device().__enter__", Call()),
    ("cuda.Device().__exit__", Call(3)),
    ("cuda.Stream", Call(0, ("non_blocking",))),
    ("cuda.Stream().ptr", READ),
    ("cuda.Stream().wait_event", Call(1)),
    ("cuda.Stream().__enter__", Call()),
    ("cuda.Stream().__exit__", Call(3)),
    ("cuda.Event", Call(0, ("disable_timing",))),
    ("cuda.Event().record", Call(1)),
    ("cuda.Event().ptr", READ),
    ("cuda.get_current_stream", Call()),
    ("cuda.get_current_stream().wait_event", Call(1)),
    ("ndarray", READ),
    ("ndarray().flags.c_contiguous", READ),
    ("ndarray().flags.f_contiguous", READ),
    ("ndarray().device.id", READ),
    ("ndarray().data.ptr", READ),
    ("ndarray().size", READ),
    ("ndarray().dtype", READ),
    ("ndarray().__ifloordiv__", Call(1)),
    ("ndarray().__isub__", Call(1)),
    ("fmod", Call(2)),
    ("ndarray().__itruediv__", Call(1)),
    ("zeros", Call(1, ("dtype",))),
    ("empty", Call(1, ("dtype",))),
    ("concatenate", Call(1, ("out",))),
    ("RawModule", Call(0, ("code", "name_expressions"))),
    ("RawModule().get_function", Call(1)),
    ("RawKernel.__call__", Call(3)),
    # trainer/comm/devices.py
    ("cuda.Device().use", Call()),
    ("cuda.runtime.getDeviceProperties", Call(1)),
    ("cuda.runtime.deviceSynchronize", Call()),
    ("asarray", Call(1)),
    ("asnumpy", Call(1)),
    # trainer/bucketing.py (pack, unpack)
    ("divide", Call(2, ("out",))),
    ("ndarray().shape", READ),
    ("ndarray().reshape", Call(1)),
    ("ndarray().__getitem__", Call(1)),
    ("ndarray().__setitem__", Call(2)),
    # trainer/bucketing.py (_extent: gradients that share memory)
    ("ndarray().strides", READ),
    ("ndarray().itemsize", READ),
    # trainer/example.py
    ("tanh", Call(1)),
    ("mean", Call(1)),
    ("ones", Call(1, ("dtype",))),
    ("zeros_like", Call(1)),
    ("array", Call(1, ("dtype",))),
    # benchmarks/gpu_check.py
    ("float32", READ),
    ("cuda.get_current_stream().synchronize", READ),
]

# What an attribute or a call returns, where the path cannot show it.
HOLDS = {
    "cuda.get_current_stream()": "cuda.Stream",
    "ndarray().flags": "_core.flags.Flags",
    "ndarray().data": "cuda.MemoryPointer",
    "ndarray().device": "cuda.Device",
}


def _event_without_a_device(cp: Any) -> Any:
    """A ``cupy.cuda.Event`` whose handle is 0: making a real one needs a device. Its
    ``done`` reading ``self.ptr`` before any CUDA call shows that ``ptr`` is the handle
    CuPy keeps (and passes to ``runtime.eventQuery``); __del__ skips a 0 handle."""
    event = cp.cuda.Event.__new__(cp.cuda.Event)
    with pytest.raises(AttributeError, match="ptr"):
        _ = event.done
    event.ptr = 0
    return event


# Instances CuPy makes without a device, for attributes it sets per instance.
DEVICE_FREE: dict[str, Callable[[Any], Any]] = {
    "cuda.Stream": lambda cp: cp.cuda.Stream(null=True),
    "cuda.Event": _event_without_a_device,
    "cuda.Device": lambda cp: cp.cuda.Device(0),
    "cuda.nccl.NcclError": lambda cp: cp.cuda.nccl.NcclError(6),
    "cuda.runtime.CUDARuntimeError": lambda cp: cp.cuda.runtime.CUDARuntimeError(700),
}
# Values that differ between objects or installs, not constants.
PER_OBJECT = {"__version__", "cuda.Stream().ptr", "cuda.Event().ptr"}

# --- looking CuPy up -----------------------------------------------------------------


def _member(cp: Any, owner: Any, owner_path: str, name: str) -> Any:
    try:
        return inspect.getattr_static(owner, name)
    except AttributeError:
        if isinstance(owner, ModuleType) and hasattr(owner, name):
            return getattr(owner, name)  # a submodule CuPy loads on first use
        make = DEVICE_FREE.get(owner_path.removesuffix("()"))
        if not owner_path.endswith("()") or make is None:
            raise
        return inspect.getattr_static(make(cp), name)


def lookup(cp: Any, path: str) -> Any:
    """The attribute at ``path`` as stored: an instance's methods and properties as their
    class holds them (unbound), its other attributes from a device-free instance."""
    owner, owner_path = cp, ""
    *parents, last = path.split(".")
    for part in parents:
        attr = _member(cp, owner, owner_path, part.removesuffix("()"))
        owner_path = f"{owner_path}.{part}".lstrip(".")
        if owner_path in HOLDS:
            owner, owner_path = lookup(cp, HOLDS[owner_path]), HOLDS[owner_path] + "()"
        elif part.endswith("()") and not isinstance(attr, type):
            raise LookupError(f"what {owner_path} returns is not in HOLDS")
        else:
            owner = attr
    return _member(cp, owner, owner_path, last)


def lookup_or_fail(path: str) -> Any:
    try:
        return lookup(REAL, path)
    except AttributeError:
        pytest.fail(f"CuPy {REAL.__version__} has no {path}")


def kind(attr: Any) -> str:
    """What an attribute is, in the terms the fake and CuPy must agree on."""
    if isinstance(attr, type):
        return "exception" if issubclass(attr, BaseException) else "callable"
    if isinstance(attr, ModuleType | SimpleNamespace | fake_nccl.FakeNccl):
        return "namespace"
    if inspect.isdatadescriptor(attr) or not callable(attr):
        return "data"
    return "callable"


_SIGNATURE = re.compile(r"[\w.]+\((?P<params>.*)\)\s*(->.*)?")


def _split(params: str) -> Iterator[str]:
    """Top-level comma-separated parts (defaults may hold brackets or quoted commas)."""
    depth, quote, start = 0, "", 0
    for i, char in enumerate(params):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == "," and depth == 0:
            yield params[start:i].strip()
            start = i + 1
    yield params[start:].strip()


def _from_doc(line: str) -> inspect.Signature | None:
    """Cython's embedded signature ("f(self, int n, x=None, \\*, y=1)"), which inspect
    cannot read from a compiled function."""
    match = _SIGNATURE.fullmatch(line.strip())
    if match is None:
        return None
    params: list[Parameter] = []
    kind_now = Parameter.POSITIONAL_OR_KEYWORD
    for token in _split(match["params"]):
        token = token.replace("\\*", "*")
        if token in ("", "self"):
            continue
        if token == "/":
            params = [p.replace(kind=Parameter.POSITIONAL_ONLY) for p in params]
        elif token == "*":
            kind_now = Parameter.KEYWORD_ONLY
        elif token.startswith("**"):
            params.append(Parameter(token[2:], Parameter.VAR_KEYWORD))
        elif token.startswith("*"):
            params.append(Parameter(token[1:], Parameter.VAR_POSITIONAL))
            kind_now = Parameter.KEYWORD_ONLY
        else:
            declared, has_default, _ = token.partition("=")
            name = declared.split(":")[0].split()[-1]
            default = None if has_default else Parameter.empty
            params.append(Parameter(name, kind_now, default=default))
    return inspect.Signature(params)


def signature(attr: Any) -> inspect.Signature | None:
    """``attr``'s parameters without ``self``; None where nothing says more than
    (*args, **kwargs)."""
    docs = [getattr(attr.__init__, "__doc__", None), attr.__doc__]
    for doc in docs if isinstance(attr, type) else docs[1:]:
        lines = (doc or "").strip().splitlines()
        parsed = _from_doc(lines[0]) if lines else None
        if parsed is not None:
            return parsed
    try:
        params = list(inspect.signature(attr).parameters.values())
    except (TypeError, ValueError):
        return None
    params = params[1:] if params and params[0].name == "self" else params
    if all(p.kind in (Parameter.VAR_POSITIONAL, Parameter.VAR_KEYWORD) for p in params):
        return None
    return inspect.Signature(params)


def refusal(attr: Any, call: Call) -> str | None:
    """Why CuPy's ``attr`` would refuse ``call``, or None."""
    sig = signature(attr)
    try:
        if sig is not None:
            sig.bind(*range(call.args), **dict.fromkeys(call.keywords))
    except TypeError as exc:
        return f"{sig}: {exc}"
    return None


# --- what our code reaches ------------------------------------------------------------


@pytest.mark.parametrize(("path", "use"), SEAM, ids=[path for path, _ in SEAM])
def test_cupy_has_what_our_code_uses(path: str, use: Call | str) -> None:
    attr = lookup_or_fail(path)
    if use == CAUGHT:
        assert kind(attr) == "exception", f"{path} is {attr!r}, not an exception class"
    elif isinstance(use, Call):
        assert kind(attr) in ("callable", "exception"), f"{path} is {attr!r}, not callable"
        why = refusal(attr, use)
        assert why is None, f"{path} refuses our {use}: {why}"


# Where our code reaches CuPy by a module: cp/xp/cupy, self._cp, self.xp, self._nccl, _import_cupy().
CODE = ["comm/nccl.py", "comm/devices.py", "bucketing.py", "example.py", "checkpoint.py"]
ROOTS = {"cp": "", "xp": "", "cupy": "", "self._cp": "", "self.xp": "", "self._nccl": "cuda.nccl"}


def _chain(node: ast.expr) -> str | None:
    """The CuPy path ``node`` spells, or None if it does not start at a CuPy module."""
    if ast.unparse(node) in ROOTS:
        return ROOTS[ast.unparse(node)]
    if isinstance(node, ast.Attribute):
        base = _chain(node.value)
        return None if base is None else f"{base}.{node.attr}".lstrip(".")
    if isinstance(node, ast.Call):
        func, args = node.func, node.args
        if ast.unparse(func).endswith("_import_cupy"):
            return ""
        if ast.unparse(func) == "getattr" and len(args) > 1 and isinstance(args[1], ast.Constant):
            base = _chain(args[0])
            return None if base is None else f"{base}.{args[1].value}".lstrip(".")
        base = _chain(func)
        return f"{base}()" if base else None
    return None


def code_uses() -> set[tuple[str, str, Call | str]]:
    files = [ROOT / "trainer" / name for name in CODE] + [ROOT / "benchmarks" / "gpu_check.py"]
    uses: set[tuple[str, str, Call | str]] = set()
    for file in files:
        tree = ast.parse(file.read_text())
        inner = set()  # nodes inside a longer chain: only the whole chain counts
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                inner.add(id(node.value))
            elif isinstance(node, ast.Call):
                inner.add(id(node.func))
                if ast.unparse(node.func) == "getattr":
                    inner.add(id(node.args[0]))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func) != "getattr":
                path = _chain(node.func)
                keywords = tuple(sorted(k.arg for k in node.keywords if k.arg))
                use: Call | str = Call(len(node.args), keywords)
            elif isinstance(node, ast.Attribute | ast.Call) and id(node) not in inner:
                path, use = _chain(node), READ
            else:
                continue
            if path:
                uses.add((file.name, path, use))
    return uses


def test_the_table_lists_every_cupy_chain_in_the_code() -> None:
    uses = code_uses()
    assert ("nccl.py", "cuda.nccl.NcclCommunicator", Call(3)) in uses  # the reader works
    listed = set(SEAM) | {(path, READ) for path, use in SEAM if use == CAUGHT}
    missing = sorted(
        f"{file}: {path} {use}" for file, path, use in uses if (path, use) not in listed
    )
    assert not missing, f"add to SEAM: {missing}"


# --- what the fake models -------------------------------------------------------------

# The fake's stand-ins for CuPy's instances, made as our code makes them.
FAKE_INSTANCES: dict[str, Callable[[Any], Any]] = {
    "cuda.Stream": lambda fake: fake.cuda.Stream(non_blocking=True),
    "cuda.Event": lambda fake: fake.cuda.Event(disable_timing=True),
    "cuda.Device": lambda fake: fake.cuda.Device(0),
    "cuda.nccl.NcclCommunicator": lambda fake: fake.cuda.nccl.NcclCommunicator(
        1, bytes(range(1, 129)), 0
    ),
    "cuda.nccl.NcclError": lambda fake: fake.cuda.nccl.NcclError(6),
    "cuda.runtime.CUDARuntimeError": lambda fake: fake.cuda.runtime.CUDARuntimeError(700),
    "ndarray": lambda fake: fake_cupy.device_array(fake, [1.0]),
}
# Python's own class attributes, not the API a class models.
_NOT_API = {
    "__dict__",
    "__module__",
    "__weakref__",
    "__annotations__",
    "__firstlineno__",
    "__static_attributes__",
}


def _fake_members(obj: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, SimpleNamespace):
        yield from vars(obj).items()
        return
    inherited = set(dir(BaseException if isinstance(obj, BaseException) else object))
    for name in dir(obj):
        private = name.startswith("_") and not (name.startswith("__") and name.endswith("__"))
        if not (private or name in inherited or name in _NOT_API):
            yield name, inspect.getattr_static(obj, name)


def fake_surface() -> list[tuple[str, Any]]:
    """Every name the fake models, as (path, attribute as stored), knobs left out."""
    fake = fake_cupy.make_cupy()
    found: list[tuple[str, Any]] = []

    def walk(obj: Any, prefix: str) -> None:
        for name, attr in _fake_members(obj):
            path = prefix + name
            if path in fake_cupy.NOT_CUPY:
                continue
            found.append((path, attr))
            if kind(attr) == "namespace":
                walk(getattr(obj, name), path + ".")
            if path in FAKE_INSTANCES:
                walk(FAKE_INSTANCES[path](fake), path + "().")

    walk(fake, "")
    return found


def fake_call(path: str, attr: Any) -> Call | None:
    """The call the fake expects: its required parameters by position, the rest by name
    (but for keywords only the fake has); None where it takes anything."""
    try:
        params = list(inspect.signature(attr).parameters.values())
    except ValueError:  # an exception class with BaseException's (*args)
        return None
    params = params[1:] if params and params[0].name == "self" else params
    if any(p.kind in (Parameter.VAR_POSITIONAL, Parameter.VAR_KEYWORD) for p in params):
        return None
    positional = (Parameter.POSITIONAL_ONLY, Parameter.POSITIONAL_OR_KEYWORD)
    required = sum(p.kind in positional and p.default is p.empty for p in params)
    keywords = tuple(
        p.name
        for p in params
        if p.default is not p.empty and p.kind is not Parameter.POSITIONAL_ONLY
        if f"{path}({p.name}=)" not in fake_cupy.NOT_CUPY
    )
    return Call(required, keywords)


FAKE_SURFACE = fake_surface()


@pytest.mark.parametrize(("path", "attr"), FAKE_SURFACE, ids=[p for p, _ in FAKE_SURFACE])
def test_cupy_has_what_the_fake_models(path: str, attr: Any) -> None:
    real = lookup_or_fail(path)
    assert kind(real) == kind(attr), f"{path}: the fake's is {kind(attr)}, CuPy's {kind(real)}"
    if kind(attr) in ("callable", "exception"):
        call = fake_call(path, attr)
        if call is not None:
            why = refusal(real, call)
            assert why is None, f"{path}: CuPy refuses the fake's {call}: {why}"
    constants = (bool, int, str)
    if isinstance(attr, constants) and isinstance(real, constants) and path not in PER_OBJECT:
        assert attr == real, f"{path}: the fake holds {attr!r}, CuPy {real!r}"


def test_the_fake_models_the_seam() -> None:
    # The walk reaches the fake's instances; the seam's names are among what it found.
    modelled = {path for path, _ in FAKE_SURFACE}
    assert {"cuda.nccl.NcclCommunicator().allReduce", "cuda.Event().done"} <= modelled


# --- constants and what nccl.py assumes -----------------------------------------------

NCCL_CODES = [
    *((f"NCCL_{name.upper()}", code) for name, code in nccl._DTYPE_CODES.items()),
    *((f"NCCL_{op.name}", code) for op, code in nccl._OP_CODES.items()),
    ("NCCL_AVG", nccl._NCCL_AVG),
]


@pytest.mark.parametrize(("name", "code"), NCCL_CODES, ids=[name for name, _ in NCCL_CODES])
def test_nccl_py_codes_are_cupys(name: str, code: int) -> None:
    assert getattr(REAL.cuda.nccl, name, None) == code


def status_name(status: int) -> str | None:
    """CuPy's name for an NCCL status; None where building its NcclError raises KeyError."""
    try:
        return str(REAL.cuda.nccl.NcclError(status)).split(":", 1)[0]
    except KeyError:
        return None


def test_the_fakes_status_names_are_cupys() -> None:
    named = {status: status_name(status) for status in range(16)}
    assert {s: n for s, n in named.items() if n is not None} == fake_nccl.STATUS_NAMES
    assert {named[s] for s in nccl._PEER_STATUSES} == {"NCCL_ERROR_REMOTE_ERROR"}  # a peer
    assert named[nccl._NCCL_SYSTEM_ERROR] == "NCCL_ERROR_SYSTEM_ERROR"  # a system call here
    assert named[nccl._NCCL_INVALID_USAGE] == "NCCL_ERROR_INVALID_USAGE"


def test_cuda_statuses_nccl_py_names_are_cudas() -> None:
    runtime = REAL.cuda.runtime
    assert str(runtime.CUDARuntimeError(nccl._CUDA_OUT_OF_MEMORY)).startswith(
        "cudaErrorMemoryAllocation"
    )
    assert str(runtime.CUDARuntimeError(nccl._CUDA_INVALID_DEVICE)).startswith(
        "cudaErrorInvalidDevice"
    )
    assert str(runtime.CUDARuntimeError(nccl._CUDA_NOT_READY)).startswith("cudaErrorNotReady")
    assert issubclass(REAL.cuda.memory.OutOfMemoryError, MemoryError)
    assert not issubclass(REAL.cuda.memory.OutOfMemoryError, runtime.CUDARuntimeError)


def test_a_status_cupy_cannot_name_raises_key_error_which_the_seam_maps() -> None:
    unnamed = min(s for s in range(16) if status_name(s) is None)
    with pytest.raises(KeyError) as info:
        REAL.cuda.nccl.NcclError(unnamed)
    assert nccl._status_of(info.value) == unnamed


def test_cupy_passes_the_backends_own_checks() -> None:
    assert nccl._require_cupy() is REAL  # NCCL loads, the version parses and is >= 13.4
    assert nccl.is_cupy_array(type("Probe", (), {"__module__": REAL.ndarray.__module__})())


def test_nccl_version_is_encoded_as_nccl_py_expects() -> None:
    version = REAL.cuda.nccl.get_version()
    assert version // 10000 == 2, version  # major*10000 + minor*100 + patch (>= 2.9)
    cuda_major = REAL.cuda.runtime.runtimeGetVersion() // 1000
    try:
        wheel = importlib.metadata.version(f"nvidia-nccl-cu{cuda_major}")
    except importlib.metadata.PackageNotFoundError:
        return  # a system NCCL: nothing to compare with
    major, minor, patch = (int(x) for x in wheel.split(".")[:3])
    assert version == major * 10000 + minor * 100 + patch, (version, wheel)


def test_the_unique_id_comes_and_goes_in_the_form_nccl_py_picks() -> None:
    cupy_major = (nccl._cupy_version(REAL) or (0, 0))[0]
    raw = REAL.cuda.nccl.get_unique_id()  # NCCL's bootstrap only: no device
    assert isinstance(raw, bytes) == (cupy_major >= 14)
    assert len(nccl.unique_id_to_bytes(raw)) == UNIQUE_ID_BYTES
    # The fake (CuPy 14 by default) gives bytes like the real 14.
    assert isinstance(fake_cupy.make_cupy().cuda.nccl.get_unique_id(), bytes)
    # _init_comm retries with the other form on TypeError: Cython checks the declared
    # type before NCCL runs, so the refused form never reaches ncclCommInitRank.
    declared = "bytes" if cupy_major >= 14 else "tuple"
    assert f"{declared} commId" in REAL.cuda.nccl.NcclCommunicator.__doc__.splitlines()[0]
    uid = bytes(range(1, 129))
    other = nccl.unique_id_to_tuple(uid) if cupy_major >= 14 else uid
    with pytest.raises(TypeError, match="commId"):
        REAL.cuda.nccl.NcclCommunicator(1, other, 0)
