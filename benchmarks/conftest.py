"""pytest setup for the benchmark entries: import ``stealer`` from this source tree.

Run with ``pytest benchmarks/ --benchmark-enable`` (the project's pytest config disables
pytest-benchmark by default).
"""

from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
