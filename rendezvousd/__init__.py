"""rendezvousd: authenticated gRPC rendezvous for multi-node data-parallel training.

The daemon runs as ``rendezvousd serve``; workers use the client SDK in
``rendezvousd.client`` and the training side in ``rendezvousd.trainer``. This
package itself exports only the daemon's configuration and its error tree, each
imported on first use, so importing it (which every import of the SDK or trainer
does) loads neither gRPC server machinery nor numpy, nor even the daemon's
settings.
"""

import os
from typing import TYPE_CHECKING

# gRPC's resolver is chosen once, when its core starts (an import of grpc is already too
# late): before any of ours imports it, every program of ours (and every program that
# imports the SDK or the trainer before grpc) resolves the daemon's name as the C
# library does, as the address a node advertises (``common/address.py``,
# ``daemon_route``) and the SDK's plain-connect probes do. gRPC's default, c-ares, read
# /etc/hosts in its own order (the probe then blamed a stuck daemon for a dead first
# address) and, with an unreachable nameserver, took 11-15 s per dial of a name found in
# /etc/hosts (1 s native). A value the user set stands.
os.environ.setdefault("GRPC_DNS_RESOLVER", "native")

from rendezvousd._lazy import lazy_exports

if TYPE_CHECKING:
    from rendezvousd.common.limits import Limits, Timing
    from rendezvousd.config import DaemonConfig
    from rendezvousd.errors import ConfigError, DaemonError

__all__ = ["ConfigError", "DaemonConfig", "DaemonError", "Limits", "Timing"]

__getattr__, __dir__ = lazy_exports(
    __name__,
    __all__,
    {
        "rendezvousd.config": ("DaemonConfig",),
        "rendezvousd.common.limits": ("Limits", "Timing"),
    },
    errors="rendezvousd.errors",
)
