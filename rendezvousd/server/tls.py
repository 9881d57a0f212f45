"""The daemon's TLS identity: its certificate, key and client CA, read and checked,
served to gRPC and to the metrics port, and read again on a reload (SIGHUP).

Why a reload: certificates are short-lived and renewed before they expire
(cert-manager renews at two thirds of a certificate's life, ACME clients at 30 days
left). A daemon that read its files only at start-up served the old certificate until
it expired, and every client's handshake then failed; a restart to pick up the new one
drains every job. gRPC asks ``ServerTls.fetch`` at each handshake
(``grpc.dynamic_ssl_server_credentials``), and the metrics port's ``SSLContext`` loads
the new pair in place: connections made from then on get the new files, open ones keep
theirs (TLS checks a certificate only at the handshake).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import ssl
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import grpc

from rendezvousd.common.pem import file_validity, window_text
from rendezvousd.common.secret_files import read_judged
from rendezvousd.config import check_client_ca, check_tls_pair
from rendezvousd.errors import DaemonError
from rendezvousd.server.auth import private_file_mask

log = logging.getLogger(__name__)

__all__ = ["ServerTls", "TlsFiles"]

_FIRST_PEM = re.compile(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.S)


@dataclass(frozen=True)
class TlsFiles:
    """What the three files held when read: the bytes gRPC serves."""

    key: bytes
    cert: bytes
    client_ca: bytes | None

    @property
    def fingerprint(self) -> str:
        """The SHA-256 of the served (first) certificate, as ``openssl x509
        -fingerprint -sha256`` prints it, shortened: an operator can tell which
        certificate is served without the daemon's key. A certificate is public."""
        first = _FIRST_PEM.search(self.cert)
        if first is None:  # checked by OpenSSL before: cannot happen
            return "unknown"
        digest = hashlib.sha256(ssl.PEM_cert_to_DER_cert(first.group().decode("ascii")))
        return ":".join(f"{b:02X}" for b in digest.digest()[:8]) + ":…"


def read_tls_files(cert: Path, key: Path, client_ca: Path | None) -> TlsFiles:
    """The daemon's certificate, key and (mTLS) client CA, each checked as gRPC would
    only show by a failed bind or handshake. Raises DaemonError naming the file."""

    def not_regular(path: Path, what: str) -> Callable[[str], DaemonError]:
        # A FIFO would hang the start-up in its read.
        return lambda mode: DaemonError(
            f"{what} {path} is not a regular file ({mode}); give the PEM file itself"
        )

    def private(info: os.stat_result) -> None:
        if info.st_mode & private_file_mask(key, 0o177, "TLS private key"):
            raise DaemonError(
                f"TLS private key {key} has mode {stat.S_IMODE(info.st_mode):04o}, "
                f"more than 0600: anyone else who can read it can impersonate the "
                f"daemon; run: chmod 600 {key}"
            )

    try:
        key_pem = read_judged(key, not_regular(key, "TLS private key"), private)
        cert_pem = read_judged(cert, not_regular(cert, "TLS certificate"))
        ca_pem = (
            read_judged(client_ca, not_regular(client_ca, "TLS client CA")) if client_ca else None
        )
    except OSError as exc:
        # Which flag gave the path: a missing file is fixed there (or by putting it back).
        flags = {str(cert): "--tls-cert", str(key): "--tls-key"}
        if client_ca is not None:
            flags[str(client_ca)] = "--tls-client-ca"
        flag = flags.get(str(exc.filename))
        fix = (
            "" if flag is None else f"; check the path given to {flag} (or its TOML key / env var)"
        )
        said = f"cannot read TLS file {exc.filename}" + ("" if flag is None else f" ({flag})")
        raise DaemonError(f"{said}: {exc.strerror}{fix}") from exc
    # Else gRPC reports only a failed bind (a ConfigError is a DaemonError).
    check_tls_pair(cert, key)
    if client_ca is not None:
        check_client_ca(client_ca)
    return TlsFiles(key=key_pem, cert=cert_pem, client_ca=ca_pem)


@dataclass
class ServerTls:
    """The identity the daemon serves, swapped whole by ``reload``."""

    cert: Path
    key: Path
    client_ca: Path | None
    files: TlsFiles = field(init=False)
    # The metrics port's context, once it serves HTTPS: reloaded in place.
    http: ssl.SSLContext | None = field(init=False, default=None)
    # A configuration gRPC has not fetched yet. gRPC's handshakes call ``fetch`` on its
    # own threads, a reload sets it on the event loop's: the lock keeps a reload from
    # being lost between the fetch's read and its reset.
    _pending: grpc.ServerCertificateConfiguration | None = field(init=False, default=None)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.files = read_tls_files(self.cert, self.key, self.client_ca)
        self.check_dates()

    def check_dates(self) -> None:
        """Says at WARNING when the served certificate is not valid by this host's clock.

        A handshake refused for a certificate's dates leaves the daemon no trace of its
        own: gRPC core writes "Handshake failed ... certificate is not yet valid" to
        stderr, naming no peer, and grpcio hands no failed handshake to Python (so a
        client refused for its certificate's dates cannot be named here). Its own
        certificate's dates, against its own clock, it can check: a clock far off, or a
        certificate not renewed in time, fails every client that verifies it."""
        window = file_validity(self.cert)
        if window is None:
            return
        now = datetime.now(UTC)
        if window[0] <= now <= window[1]:
            return
        log.warning(
            "TLS certificate %s is valid %s, and this host's clock reads %s: every client "
            "whose clock is right refuses it (%s); check this host's clock (NTP), or serve "
            "a certificate valid now (replace the file, then SIGHUP)",
            self.cert,
            window_text(window),
            time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "not yet valid" if now < window[0] else "expired",
        )

    def credentials(self) -> grpc.ServerCredentials:
        # gRPC core logs each failed handshake at INFO, one line per connection
        # ("Handshake failed ... WRONG_VERSION_NUMBER" for a plaintext client). The
        # flood an operator saw was the SDK reconnecting for a minute; it now makes one
        # attempt and tells the client (client/connection.py, TlsProbe), so one line is
        # left per misconfigured client. grpcio offers no per-message rate limit, only
        # a process-wide threshold (GRPC_VERBOSITY; GRPC_TRACE only adds), and ERROR
        # would also hide that line, the operator's one sign of such clients: the
        # default is kept, and operations.md says how to drop it.
        return grpc.dynamic_ssl_server_credentials(
            self._configuration(self.files),
            self.fetch,
            require_client_authentication=self.client_ca is not None,
        )

    def http_context(self) -> ssl.SSLContext:
        """The metrics port's TLS context, with the same certificate."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(str(self.cert), str(self.key))
        self.http = context
        return context

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's question at each handshake: a new configuration, or None to keep the
        one it has."""
        with self._lock:
            pending, self._pending = self._pending, None
        return pending

    def reload(self) -> bool:
        """Read the files again, checked as at start-up, and serve them to every
        handshake from now on. A file that fails a check keeps the identity served so
        far (a bad reload must not end TLS service) and says why at ERROR. True when
        the files read are served."""
        try:
            files = read_tls_files(self.cert, self.key, self.client_ca)
            if self.http is not None:
                # Before gRPC's, so that both serve the new pair or neither.
                self.http.load_cert_chain(str(self.cert), str(self.key))
        except (DaemonError, OSError, ssl.SSLError) as exc:
            log.error(
                "SIGHUP: TLS files not reloaded, still serving certificate %s: %s",
                self.files.fingerprint,
                exc,
            )
            return False
        before, self.files = self.files, files
        with self._lock:
            self._pending = self._configuration(files)
        self.check_dates()
        if files == before:
            log.info(
                "SIGHUP: TLS files %s, %s%s read again, unchanged: serving certificate %s",
                self.cert,
                self.key,
                f", {self.client_ca}" if self.client_ca else "",
                files.fingerprint,
            )
        else:
            log.info(
                "SIGHUP: TLS files reloaded: certificate %s (was %s)%s; connections made "
                "from now on are served with them (open ones keep theirs)",
                files.fingerprint,
                before.fingerprint,
                ""
                if files.client_ca == before.client_ca
                else f"; client CA {self.client_ca} changed",
            )
        return True

    def _configuration(self, files: TlsFiles) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration(
            [(files.key, files.cert)], root_certificates=files.client_ca
        )
