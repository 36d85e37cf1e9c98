"""Executor(result_poll=...): how often the result thread looks in throughput mode."""

from __future__ import annotations

import threading
import time

import pytest
from poll_lib import sleep_stamp

import stealer


@pytest.mark.parametrize("bad", [0.001, 0, -1, 1.5, True, "0.01", None])
def test_result_poll_out_of_range_is_refused_with_the_range(bad):
    with pytest.raises(ValueError, match=r"result_poll must be seconds from 0\.002 to 1\.0"):
        stealer.Executor(1, result_poll=bad)


def test_in_throughput_mode_results_are_collected_at_the_poll_not_one_by_one():
    """24 tasks of 40 ms on one worker: the result thread, woken by the first completion,
    parks in throughput mode (23 outstanding >= 8 per worker) and then looks only every
    result_poll (0.4 s) or when the worker is about to idle, and nobody waits on a future.  So some task's callback runs
    long after the task ended; with the default 2 ms poll every lag stays a few ms (a
    result_poll that were ignored fails here)."""
    lags: list[float] = []
    lock = threading.Lock()
    all_in = threading.Event()

    def seen(f):
        with lock:
            lags.append(time.time() - f.result())
            if len(lags) == 24:
                all_in.set()

    with stealer.Executor(1, result_poll=0.4) as ex:
        ex.submit(sleep_stamp, 0).result()
        fs = [ex.submit(sleep_stamp, 0.04) for _ in range(24)]
        for f in fs:
            f.add_done_callback(seen)
        # (no thread waits on a future here: one that does settles completions itself,
        # woken for the one it waits for; the node agent of a cluster waits on none)
        assert all_in.wait(60)
        stamps = [f.result() for f in fs]
    assert stamps == sorted(stamps)  # one worker: in order
    assert len(lags) == 24
    assert max(lags) > 0.15, lags  # a completion waited for the poll (or the idle flush)
