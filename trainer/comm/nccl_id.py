"""The NCCL unique id in the forms CuPy's releases use; its size is the one the
daemon accepts (``rendezvousd.common.validation.UNIQUE_ID_BYTES``, defined once).

The id is a bearer credential (whoever holds it while the group forms can claim
a rank): nothing here logs it or puts it into an error message.
"""

from __future__ import annotations

from rendezvousd.common.validation import UNIQUE_ID_BYTES
from rendezvousd.trainer.errors import CollectiveArgumentError


def unique_id_to_bytes(raw: object) -> bytes:
    """Normalise ``get_unique_id()``'s result to exactly ``UNIQUE_ID_BYTES``.

    CuPy >= 14 returns ``bytes``; older releases return a tuple of C ``char``
    values (signed, -128..127 on x86). All-zero ids are rejected: NCCL never
    produces one, and accepting it would hide an uninitialised buffer.
    """
    if isinstance(raw, bytes | bytearray):
        out = bytes(raw)
    elif isinstance(raw, tuple | list):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in raw):
            raise CollectiveArgumentError("NCCL unique id tuple must hold integers")
        if not all(-128 <= v <= 255 for v in raw):
            raise CollectiveArgumentError("NCCL unique id tuple values must fit in one byte")
        out = bytes(v & 0xFF for v in raw)
    else:
        raise CollectiveArgumentError(
            f"NCCL unique id must be bytes or a tuple of ints, not {type(raw).__name__}"
        )
    if len(out) != UNIQUE_ID_BYTES:
        raise CollectiveArgumentError(
            f"NCCL unique id must be {UNIQUE_ID_BYTES} bytes, got {len(out)}"
        )
    if not any(out):
        raise CollectiveArgumentError("NCCL unique id is all zero")
    return out


def unique_id_to_tuple(uid: bytes) -> tuple[int, ...]:
    """The pre-14 CuPy form: signed chars, so bytes >= 128 become negative."""
    checked = unique_id_to_bytes(uid)
    return tuple(b - 256 if b > 127 else b for b in checked)
