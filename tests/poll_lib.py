"""Tasks for tests/test_result_poll.py (importable by spawned workers)."""

from __future__ import annotations

import time


def sleep_stamp(seconds: float) -> float:
    """Sleep, then return when it ended (time.time(): comparable across processes)."""
    time.sleep(seconds)
    return time.time()
