"""TLS files checked before gRPC is given them, for the daemon and the SDK alike.

gRPC reports a bad PEM file only by its effect: the daemon's bind fails (which reads
like a taken port), and a client's channel never connects, so its first call waits out
its whole connect deadline (a minute by default) and then blames the network ("nothing
listens there"). OpenSSL, through the standard library's ``ssl``, loads the same files
the same way and says what is wrong with them. Each check returns what is wrong (to be
put in the caller's own error, naming the caller's flag), or None.
"""

from __future__ import annotations

import re
import ssl
from datetime import UTC, datetime
from pathlib import Path

__all__ = ["bundle_problem", "file_validity", "pair_problem", "validity", "window_text"]


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


#: The first certificate of a PEM file.
_PEM_CERT = re.compile(r"-----BEGIN CERTIFICATE-----[A-Za-z0-9+/=\s]*?-----END CERTIFICATE-----")
#: DER tags read below (X.509's TBSCertificate up to its validity).
_SEQUENCE, _VERSION, _UTC_TIME, _GENERALIZED_TIME = 0x30, 0xA0, 0x17, 0x18


def validity(der: bytes) -> tuple[datetime, datetime] | None:
    """A DER certificate's validity (notBefore, notAfter, in UTC), or None where it
    cannot be read. The standard library's ``ssl`` gives a certificate's dates only
    once it is verified, and a certificate refused for its dates is not; the
    ``cryptography`` package reads them, but would be a runtime dependency of every
    worker for one sentence of an error. So the few fields in front of them are walked
    here (RFC 5280 4.1)."""
    try:
        tag, start, _ = _tlv(der, 0)
        tag_tbs, at, _ = _tlv(der, start)
        if tag != _SEQUENCE or tag_tbs != _SEQUENCE:
            return None
        if der[at] == _VERSION:
            at = _tlv(der, at)[2]
        for _ in range(3):  # serialNumber, signature, issuer
            at = _tlv(der, at)[2]
        tag, at, _ = _tlv(der, at)
        if tag != _SEQUENCE:
            return None
        not_before, at = _time(der, at)
        not_after, _ = _time(der, at)
    except (IndexError, ValueError):
        return None
    return not_before, not_after


def file_validity(path: Path) -> tuple[datetime, datetime] | None:
    """The validity of the first certificate in the PEM file ``path``, or None where
    it cannot be read."""
    try:
        found = _PEM_CERT.search(path.read_text(errors="replace"))
    except OSError:
        return None
    if found is None:
        return None
    try:
        return validity(ssl.PEM_cert_to_DER_cert(found.group(0)))
    except ValueError:
        return None


def window_text(window: tuple[datetime, datetime]) -> str:
    """``window`` as the messages say it: "from 2026-12-07T12:00:00Z to ...Z"."""
    return f"from {_stamp(window[0])} to {_stamp(window[1])}"


def _stamp(at: datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


def _tlv(der: bytes, at: int) -> tuple[int, int, int]:
    """The tag at ``at``, and where its contents start and end."""
    tag, length = der[at], der[at + 1]
    at += 2
    if length & 0x80:
        size = length & 0x7F
        if not 0 < size <= 4:
            raise ValueError("length")
        length = int.from_bytes(der[at : at + size], "big")
        at += size
    if at + length > len(der):
        raise ValueError("truncated")
    return tag, at, at + length


def _time(der: bytes, at: int) -> tuple[datetime, int]:
    """The Time at ``at`` (UTCTime or GeneralizedTime, UTC), and what follows it."""
    tag, start, end = _tlv(der, at)
    text = der[start:end].decode("ascii")
    if tag == _UTC_TIME:
        # Two-digit years: 50-99 are 19xx (RFC 5280 4.1.2.5.1).
        text = ("19" if int(text[:2]) >= 50 else "20") + text
    elif tag != _GENERALIZED_TIME:
        raise ValueError("time")
    return datetime.strptime(text, "%Y%m%d%H%M%SZ").replace(tzinfo=UTC), end
