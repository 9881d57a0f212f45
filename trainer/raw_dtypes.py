"""Dtypes numpy keeps only as raw bytes: ml_dtypes' (bfloat16, float8_*, int4...).

numpy calls their kind 'V' (void) with no fields, and both the ``.npy`` format
and ``dtype.str`` write them as ``|V2``: read back, the bytes are untyped, and
assigning them to a bfloat16 parameter says only "No cast function available".
A writer records ``dtype.name`` beside them (a checkpoint, the node agent's state
copy), and a reader views the bytes as that type again (``typed``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt


def is_raw(dtype: np.dtype[Any]) -> bool:
    """Whether only this dtype's bytes survive ``.npy`` or ``dtype.str`` (an
    extension type: kind 'V' without fields, and not a plain ``void``)."""
    return dtype.kind == "V" and dtype.fields is None and dtype.name != f"void{dtype.itemsize * 8}"


def by_name(name: str) -> np.dtype[Any] | None:
    """ml_dtypes' type of this name, or None if there is none (or ml_dtypes is not
    installed)."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    found = getattr(ml_dtypes, name, None)
    try:
        return np.dtype(found) if isinstance(found, type) else None
    except TypeError:
        return None


def known(dtype: np.dtype[Any]) -> bool:
    """Whether a reader can give ``dtype`` back by its name (a plain dtype needs none)."""
    return not is_raw(dtype) or by_name(dtype.name) == dtype


def typed(array: npt.NDArray[Any], name: str) -> npt.NDArray[Any] | None:
    """``array``'s raw bytes viewed as the dtype named ``name``; ``array`` itself when
    it already has it (or is not raw bytes); None when no such type of its width is
    known here."""
    if name == array.dtype.name or array.dtype.kind != "V":
        return array
    wanted = by_name(name)
    if wanted is None or wanted.itemsize != array.dtype.itemsize:
        return None
    return array.view(wanted)
