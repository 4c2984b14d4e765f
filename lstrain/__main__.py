"""``python -m lstrain``: the ``lstrain`` command."""

import sys

from lstrain.cli import main

# the guard keeps spawned workers (lstrain check's pool re-imports this module) from re-running main
if __name__ == "__main__":
    sys.exit(main())
