"""The SDK's advice in rendezvous-run's words, said alike by the launcher, its node
agent and its workers.

The SDK names its keywords (``tls=TlsConfig(...)``, ``token=``) and tells its reader
to restart the job once the daemon is lost, where this launcher takes flags (and the
settings' variables) and restarts the node itself. A worker's own errors are the
launcher's too: its user passed the launcher's flags, never the SDK's keywords.
"""

from __future__ import annotations

from rendezvousd.client._session import DAEMON_LOST_ADVICE
from rendezvousd.client.connection import (
    TLS_CA_ADVICE,
    TLS_CHECK_ADVICE,
    TLS_DROP_ADVICE,
    TLS_PAIR_ADVICE,
    TLS_SWAP_ADVICE,
)
from rendezvousd.client.errors import TOKEN_ADVICE, RendezvousError
from rendezvousd.client.membership import LOOPBACK_ADVICE

__all__ = ["in_launchers_words", "launchers_text", "reword"]

_LAUNCHER_WORDS = (
    (TLS_CA_ADVICE, "pass --tls-ca PATH (or set $RENDEZVOUSD_TLS_CA)"),
    (TLS_DROP_ADVICE, "drop --tls-ca (and $RENDEZVOUSD_TLS_CA)"),
    (
        TLS_CHECK_ADVICE,
        "Check --tls-ca (it must have signed the daemon's certificate) and --tls-server-name",
    ),
    (TLS_PAIR_ADVICE, "--tls-cert and --tls-key"),
    (
        TLS_SWAP_ADVICE,
        "give the client certificate as --tls-cert (or $RENDEZVOUSD_TLS_CERT) and its "
        "private key as --tls-key (or $RENDEZVOUSD_TLS_KEY)",
    ),
    (
        LOOPBACK_ADVICE,
        "(rendezvous-run: set --ring-host, or $RENDEZVOUSD_RING_HOST, to it; unset, a node "
        "advertises its address on its route to the daemon, which is loopback when "
        "--rdzv-endpoint is, or resolves to, a loopback address)",
    ),
    (TOKEN_ADVICE, "(--token-file, or $RENDEZVOUSD_TOKEN_FILE / $RENDEZVOUSD_TOKEN)"),
    (
        DAEMON_LOST_ADVICE,
        "This node agent stops its workers and, if --max-restarts allows, joins again "
        "(asking for the daemon for up to its join timeout): check that the daemon is "
        "running and that this host can reach it (a daemon restarted with --state-dir "
        "keeps the job)",
    ),
)


def launchers_text(said: str) -> str:
    """The SDK's or the trainer's words in ``said`` as rendezvous-run's."""
    for sdk, launchers in _LAUNCHER_WORDS:
        said = said.replace(sdk, launchers)
    return said


def in_launchers_words(error: BaseException) -> str:
    """``error``'s message as rendezvous-run's user must read it."""
    return launchers_text(str(error)) if isinstance(error, RendezvousError) else str(error)


def reword(error: BaseException) -> None:
    """``error``, an SDK error a worker under rendezvous-run raises, in the launcher's
    words, in place: its class, metadata and chain stay what its handlers match."""
    if isinstance(error, RendezvousError):
        error.message = launchers_text(error.message)
        error.args = (error.message,)
