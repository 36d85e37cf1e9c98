"""Run the yardstick benchmarks: ``python benchmarks/run.py --quick`` (see --help).

A thin wrapper over :func:`stealer.bench.cli.main`; works from a source checkout without
installing (the repository root is put on ``sys.path``).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)
    from stealer.bench.cli import main

    raise SystemExit(main(sys.argv[1:]))
