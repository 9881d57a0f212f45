"""TLS files checked before gRPC is given them, for the daemon and the SDK alike.

gRPC reports a bad PEM file only by its effect: the daemon's bind fails (which reads
like a taken port), and a client's channel never connects, so its first call waits out
its whole connect deadline (a minute by default) and then blames the network ("nothing
listens there"). OpenSSL, through the standard library's ``ssl``, loads the same files
the same way and says what is wrong with them. Each check returns what is wrong (to be
put in the caller's own error, naming the caller's flag), or None.
"""

from __future__ import annotations

import ssl
from pathlib import Path

__all__ = ["bundle_problem", "pair_problem"]


def pair_problem(cert: Path, key: Path) -> str | None:
    """Why ``cert`` and ``key`` cannot serve as one TLS identity, or None. Unreadable
    files are left to the caller's own read, which names the file."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # A password callback keeps OpenSSL from prompting on a terminal.
        context.load_cert_chain(cert, key, password=lambda: b"")
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            return (
                f"TLS private key {key} does not belong to certificate {cert} "
                "(key values mismatch); give the key the certificate was issued for"
            )
        return (
            f"cannot load TLS certificate {cert} with key {key}: {exc.reason or exc.strerror}; "
            "both must be PEM, the key unencrypted"
        )
    except OSError:
        return None
    return None


def bundle_problem(ca: Path) -> str | None:
    """Why ``ca`` is not a PEM certificate bundle (" (reason)"), or None. Unreadable
    files are left to the caller's own read, which names the file."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_verify_locations(cafile=ca)
    except ssl.SSLError as exc:
        return f" ({exc.reason})" if exc.reason else ""
    except OSError:
        return None
    # OpenSSL also takes a file of CRLs alone, which gRPC refuses.
    if context.cert_store_stats()["x509"] == 0:
        return " (no certificate in it)"
    return None
