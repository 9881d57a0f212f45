"""``python -m rendezvousd``: the ``rendezvousd`` command, as ``python -m rendezvousd.cli``
(the name a user tries first; it said "No module named rendezvousd.__main__")."""

import sys

from rendezvousd.cli.serve import main

if __name__ == "__main__":
    sys.exit(main())
