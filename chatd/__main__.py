"""`python -m chatd` runs the `chatd` command."""

import sys

from chatd.cli import main

sys.exit(main())
