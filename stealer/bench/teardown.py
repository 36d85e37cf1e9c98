"""Closing an executor that chaos may have left unable to close by itself (benchmarks/chaos.py
and the kill tests): the harness must end and report, never hang on a lost future."""

from __future__ import annotations

import time
from typing import Any

from stealer.shared.shm import H_SHUTDOWN

__all__ = ["force_close"]


def force_close(ex: Any, wait: float) -> bool:
    """Shut ``ex`` down; if its result thread is still busy after ``wait`` seconds (a
    lost future, a push it spins on), kill the workers and make room in every shared
    queue until it exits.  Returns whether it exited."""
    pool = ex._pool
    t = pool.thread
    assert t is not None
    ex.shutdown(wait=False, cancel_futures=True)
    t.join(wait)
    if t.is_alive():
        pool.region.store32(H_SHUTDOWN, 1)  # seq_cst: no replacements from now on
        for p in list(pool.procs):
            if p is not None:
                p.kill()
        pool.futures.clear()
        pool.wake()
        deadline = time.monotonic() + 30
        while t.is_alive() and time.monotonic() < deadline:
            for q in (pool.injector, *pool.inboxes):
                q.pop()  # room for a push the thread spins on
            t.join(0.05)
    return not t.is_alive()
