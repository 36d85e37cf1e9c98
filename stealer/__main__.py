"""``python -m stealer``: the ``stealer`` command (stealer/cli.py's ``main``)."""

import sys

from stealer.cli import main

if __name__ == "__main__":
    sys.exit(main())
