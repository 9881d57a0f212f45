"""The torchrun handler's settings (``rendezvousd.trainer.torchrun.handler``): ``--rdzv-conf``
keys over ``RENDEZVOUSD_*`` variables, on the field-driven settings layer.

Apart from the handler because that module imports torch at its top (its classes
subclass torch's), and these are read without torch: by the docs' settings table and
its test.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rendezvousd.client.connection import TlsConfig
from rendezvousd.common.env_names import closest
from rendezvousd.common.settings import Bool, Schema, Text, setting, validate
from rendezvousd.trainer.agent._fork_server import module_names
from rendezvousd.trainer.config import Count, Seconds
from rendezvousd.trainer.errors import ConfigError

__all__ = ["SCHEMA", "TorchrunSettings", "load_settings", "settings_table"]


#: How a torchrun user gives the CA: torchrun has neither the SDK's ``TlsConfig`` keyword,
#: which the SDK's advice (``TLS_CA_ADVICE``) names, nor our CLI's --tls-* flags.
TORCHRUN_TLS_ADVICE = "pass --rdzv-conf tls_ca=PATH (or set RENDEZVOUSD_TLS_CA)"


def _tls(help: str) -> Any:
    return setting(None, help, Text(optional=True), unprefixed=True, flag=None)


@dataclass(frozen=True, slots=True)
class TorchrunSettings:
    """The handler's settings: ``--rdzv-conf`` keys over ``RENDEZVOUSD_*`` variables
    (torchrun's own flags are the command line: none of ours are flags)."""

    token_file: str | None = setting(
        None, "daemon token file (else $RENDEZVOUSD_TOKEN)", Text(optional=True), flag=None
    )
    tls_ca: str | None = _tls("PEM CA bundle that signed the daemon's certificate (enables TLS)")
    tls_cert: str | None = _tls("PEM client certificate, for a daemon that requires mTLS")
    tls_key: str | None = _tls("PEM private key for tls_cert")
    tls_server_name: str | None = _tls("name to verify in the daemon's certificate")
    join_timeout: float = setting(
        600.0,
        "seconds to wait for the round to form (torch's name and default)",
        Seconds(),
        flag=None,
    )
    last_call_timeout: float = setting(
        0.0,
        "seconds after the last arrival before forming with >= MIN nodes "
        "(0: the daemon's --last-call-s)",
        Seconds(least=0.0),
        flag=None,
    )
    retries: int = setting(1, "retries of a transient daemon error", Count(0), flag=None)
    # Each ends up in an SDK call, which refuses more than 30 days: mid-rendezvous, as
    # torch's RendezvousError, where a --rdzv-conf key's refusal names the key at once.
    connect_timeout: float = setting(
        30.0, "seconds to wait for the daemon to answer at all", Seconds(), flag=None
    )

    node_link_watch: bool = setting(
        True,
        "each agent keeps an idle TCP link to the next node's agent, so that a cut between "
        "two nodes is reported in ~12 s (NCCL's and gloo's own timeouts are minutes)",
        Bool(),
        flag=None,
    )

    preload: str = setting(
        "torch",
        "modules the node's warm fork server imports once, separated by ':' or ',' (only when "
        "torchrun's PYTHON_EXEC is rendezvous-python)",
        Text(),
        flag=None,
    )

    def __post_init__(self) -> None:
        validate(self, ConfigError)
        # The SDK's TlsConfig checks these too, but in our CLI's words (--tls-ca), which
        # torchrun has none of; and a server name without a CA it dropped in silence,
        # the agent speaking plaintext.
        if (self.tls_cert is None) != (self.tls_key is None):
            given, missing = (
                ("tls_cert", "tls_key") if self.tls_key is None else ("tls_key", "tls_cert")
            )
            raise ConfigError(
                f"{given} without {missing}: a client certificate and its key go together "
                f"(mutual TLS needs both): pass --rdzv-conf {missing}=PATH (or set "
                f"{SCHEMA.options[missing].env}), or neither for TLS without a client "
                "certificate"
            )
        for name in ("tls_cert", "tls_server_name"):
            if getattr(self, name) is not None and self.tls_ca is None:
                raise ConfigError(
                    f"{name} needs tls_ca, the CA that signed the daemon's certificate "
                    f"(without it the agent would speak plaintext): {TORCHRUN_TLS_ADVICE}"
                )

    def preload_modules(self) -> list[str]:
        return module_names(self.preload)

    def tls(self) -> TlsConfig | None:
        return TlsConfig.from_paths(self.tls_ca, self.tls_cert, self.tls_key, self.tls_server_name)


SCHEMA = Schema(TorchrunSettings, ConfigError)


# What torch's own backends (c10d, etcd, static) read, ``timeout`` and ``rank`` also
# added by torchrun itself: ignored here, so a command may switch backends as it is.
TORCH_KEYS = frozenset(
    {
        "timeout",
        "rank",
        "is_host",
        "read_timeout",
        "close_timeout",
        "heartbeat_timeout",
        "keep_alive_interval",
        "keep_alive_max_attempt",
        "store_type",
        "use_libuv",
        "protocol",
        "cacert",
        "cert",
        "key",
        "etcd_prefix",
        "ssl_cert",
        "ssl_cert_key",
        "ca_cert",
    }
)


#: What each of torch's own keys a user sets would have done, and what does it here.
_IN_PLACE_OF = {
    "heartbeat_timeout": "the daemon's --heartbeat-timeout-s",
    "keep_alive_interval": "the daemon's --heartbeat-timeout-s",
    "read_timeout": "connect_timeout and the SDK's call_timeout",
}


_TORCHRUNS_OWN = frozenset({"rank", "timeout"})


def ignored_torch_keys(conf: Mapping[str, Any]) -> str | None:
    """What to say of torch's own ``--rdzv-conf`` keys a user gave, which this backend
    does not read, or None. They were dropped without a word: a heartbeat_timeout=2
    read as failures found in 2 s, where the daemon's timeout (10 s) applies (a torchrun
    user's review). ``rank`` and ``timeout`` are torchrun's own, set for every backend
    (``timeout`` from --rdzv-timeout, 900 s unless given): said, they were said of
    every launch (a review)."""
    given = sorted(k for k in conf if k in TORCH_KEYS and k not in _TORCHRUNS_OWN)
    if not given:
        return None
    said = [f"{k} (here: {_IN_PLACE_OF[k]})" if k in _IN_PLACE_OF else k for k in given]
    return (
        f"--rdzv-conf {', '.join(said)}: torch's c10d key{'s' if len(given) > 1 else ''}, "
        "not read by the rendezvousd backend"
    )


def load_settings(conf: Mapping[str, Any], env: Mapping[str, str]) -> TorchrunSettings:
    """``RENDEZVOUSD_*`` variables, then ``--rdzv-conf`` (which wins). torch's keys
    (``TORCH_KEYS``) are ignored; any other key is refused, naming ours: a misspelt
    one (``join_timout``) would otherwise be dropped without a word."""
    if "token" in conf:
        # Said apart from a misspelling: the fix is not a key of that name, and the
        # user should know the token may already have been seen (the value is not said).
        raise ConfigError(
            "--rdzv-conf token: a token on torchrun's command line shows in ps to every "
            "user of the host; pass --rdzv-conf token_file=PATH (a file of mode 0600) or "
            "set RENDEZVOUSD_TOKEN_FILE / RENDEZVOUSD_TOKEN, and replace a token already "
            "passed so"
        )
    if unknown := sorted(k for k in conf if k not in SCHEMA.options and k not in TORCH_KEYS):
        # The rule a misspelt RENDEZVOUSD_* variable is told by (env_names.closest).
        guesses = {k: g for k in unknown if (g := closest(k, SCHEMA.options))}
        hint = "; ".join(
            f"did you mean {g}?" if len(unknown) == 1 else f"{k}: did you mean {g}?"
            for k, g in guesses.items()
        )
        hint = f" ({hint})" if hint else ""
        raise ConfigError(
            f"--rdzv-conf {', '.join(unknown)}: not a key of the rendezvousd backend{hint}; "
            f"its keys are {', '.join(SCHEMA.options)} (torch's own, such as timeout, "
            "are ignored)"
        )
    given = {k: v for k, v in conf.items() if k in SCHEMA.options and v is not None}
    return SCHEMA.build([SCHEMA.from_env(env), SCHEMA.from_mapping(given, "--rdzv-conf")])


def settings_table() -> str:
    """Markdown table of the handler's settings (docs/trainer.md holds it; a test compares)."""
    return SCHEMA.markdown_table()


if __name__ == "__main__":
    sys.stdout.write(settings_table())
