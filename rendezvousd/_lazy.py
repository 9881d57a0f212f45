"""Lazy public names for a package ``__init__`` (PEP 562).

A package exports its public names without importing the modules that define
them: each is imported on first access. A process that imports one submodule of
``rendezvousd.trainer`` (a worker, the node agent) then pays for that submodule
and what it imports, not for every module the package exports from; this is
what lets a replacement node's agent start its spares before its own heavier
imports (docs/benchmarks.md, "Recovery").
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence


def lazy_exports(
    package: str, exported: Sequence[str], homes: Mapping[str, tuple[str, ...]], *, errors: str
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, which exports ``exported`` (its
    ``__all__``); ``homes``: module -> the names it defines. Every other exported name
    is from ``errors``, the module holding the package's exception tree (and what
    its exceptions carry, such as the SDK's ``FailedMember``).
    A name is looked up once, then kept in the package's namespace."""
    where = {name: errors for name in exported}
    where.update({name: module for module, names in homes.items() for name in names})

    def __getattr__(name: str) -> object:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return __getattr__, __dir__
