"""``python -m rendezvousd.cli``: the ``rendezvousd`` command."""

import sys

from rendezvousd.cli.serve import main

if __name__ == "__main__":
    sys.exit(main())
