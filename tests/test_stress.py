"""Executor stress: many workers, many tasks, each result exactly once; kill -9 under load."""

from __future__ import annotations

import concurrent.futures as cf
import os
import random
import signal
import time

import pytest
import tasks

import stealer

pytestmark = pytest.mark.stress


def test_oversubscribed_mixed_load_each_result_exactly_once():
    """4 workers on 2 cores, plain and fork-join tasks, random cancels: nothing lost or doubled."""
    rng = random.Random(3)
    with stealer.Executor(4, cpus="none") as ex:
        fs: list[tuple[cf.Future, object]] = []
        for i in range(20_000):
            if i % 500 == 0:
                fs.append((ex.submit(tasks.fib, 16, 9), tasks.fib_seq(16)))
            elif i % 97 == 0:
                fs.append((ex.submit(tasks.wide, 20), sum(j * j for j in range(20))))
            else:
                fs.append((ex.submit(tasks.square, i), i * i))
        cancelled = {i for i in rng.sample(range(len(fs)), 300) if fs[i][0].cancel()}
        for i, (f, expected) in enumerate(fs):
            if i in cancelled:
                assert f.cancelled()
                continue
            assert f.result(timeout=120) == expected
        s = ex.stats()
        # every submitted task ran once, except the cancelled ones (records were reclaimed)
        assert len(ex._pool.futures) == 0
        assert s.injector_depth == 0


def test_map_large_chunked_input():
    with stealer.Executor(2) as ex:
        n = 100_000
        assert sum(ex.map(tasks.square, range(n), chunksize=500)) == sum(i * i for i in range(n))


@pytest.mark.kills_workers
def test_random_kill_9_under_load_never_hangs():
    """Kill workers with SIGKILL at random while plain and fork-join tasks run.

    Every future must end: with the right result, or with WorkerCrashedError.
    """
    rng = random.Random(11)
    with stealer.Executor(2) as ex:
        assert ex.wait_ready(30)
        fs = []
        for i in range(400):
            if i % 10 == 0:
                fs.append((ex.submit(tasks.fib, 17, 10), tasks.fib_seq(17)))
            else:
                fs.append((ex.submit(tasks.sleep_then, 0.002, i), i))
        kills = 0
        deadline = time.monotonic() + 10
        while kills < 5 and time.monotonic() < deadline:
            time.sleep(rng.uniform(0.02, 0.1))
            pids = [p for p in ex.worker_pids() if p]
            if pids:
                os.kill(rng.choice(pids), signal.SIGKILL)
                kills += 1
        ok = crashed = 0
        for f, expected in fs:
            try:
                assert f.result(timeout=60) == expected
                ok += 1
            except stealer.WorkerCrashedError:
                crashed += 1
        assert ok + crashed == len(fs)
        assert crashed <= 5 * 3  # at most a few tasks per killed worker (running + orphaned)
        assert ex._pool.crashes == kills
        # and the executor still works afterwards
        assert ex.submit(tasks.fib, 18, 10).result(timeout=60) == tasks.fib_seq(18)
