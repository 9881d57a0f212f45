"""``python -m rendezvousd.trainer.demo``: the 2 x 2 demo with its scorecard."""

import sys

from rendezvousd.trainer.demo.run import main

if __name__ == "__main__":
    sys.exit(main())
