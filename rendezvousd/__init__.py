"""rendezvousd: authenticated gRPC rendezvous for multi-node data-parallel training.

The daemon runs as ``rendezvousd serve``; workers use the client SDK in
``rendezvousd.client`` and the training side in ``rendezvousd.trainer``. This
package itself exports only the daemon's configuration and its error tree, each
imported on first use, so importing it (which every import of the SDK or trainer
does) loads neither gRPC server machinery nor numpy, nor even the daemon's
settings.
"""

from typing import TYPE_CHECKING

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
