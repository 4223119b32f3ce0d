"""`python -m chatd` runs the `chatd` command."""

import sys

from chatd.cli import main

if __name__ == "__main__":  # not when a spawned process (--engine-process) imports this module
    sys.exit(main())
