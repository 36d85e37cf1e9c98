"""Kill storms (issue 20): no future hangs, and the client never waits on a worker.

Before the ping bit (stealer/shared/recovery.py Pings) every recovery of a worker pinged
again the parent of every child the worker had finished, in case the first ping was
lost.  A worker killed again and again while starting never drains its inbox, so
those duplicates piled up in it until it was full; the client's result thread then
spun on the push, waiting for a worker that it alone could restart: every tree and
every new submit hung (benchmarks/chaos.py --storm 180 showed it after ~1,600 kills).

Here the inboxes are shrunk to 8 entries (STEALER_TEST_INBOX_CAP, a test-only layout
knob) so that the same pile-up takes a dozen kills instead of minutes: the first test
killed the replacement of a worker holding tree frames 12 times as soon as it was
started, and hung on the old code.  Every wait has a deadline, and a stuck executor is
torn down by force, so a regression fails instead of hanging.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import glob
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import probes
import pytest
import tasks

import stealer
from stealer.shared._layout import S_DONE, S_QUEUED, S_RUNNING
from stealer.shared.shm import SHM_DIR, W_STATE
from stealer.worker.loop import STATE_READY

pytestmark = [pytest.mark.kills_workers, pytest.mark.slow]

TREE = (8, 2)  # tree_sum(8, 2): 511 tasks, 255 of them frames (256 leaves)
TREE_VALUE = 2**9 - 1
INBOX_CAP = 8
WAIT = 30.0  # seconds every future gets once the kills stop (a hang fails here)


@contextlib.contextmanager
def _storm_executor(monkeypatch: pytest.MonkeyPatch, **kw: Any) -> Iterator[stealer.Executor]:
    """An executor with 8-entry inboxes, torn down by force if its result thread is stuck
    (the old code spun in a push on a full inbox: room is made until it gets out)."""
    monkeypatch.setenv("STEALER_TEST_INBOX_CAP", str(INBOX_CAP))
    ex = stealer.Executor(2, **kw)
    pool = ex._pool
    assert pool.layout.inbox_cap == INBOX_CAP
    try:
        yield ex
    finally:
        assert probes.force_close(ex), "the result thread did not exit"
        assert not glob.glob(os.path.join(SHM_DIR, pool.name + "*")), "shared memory left"


def _pending_after(futures: list[cf.Future], timeout: float) -> int:
    return len(cf.wait(futures, timeout=timeout)[1])


def _kill_replacements(pool: Any, k: int, rounds: int, timeout: float) -> int:
    """SIGKILL worker ``k``, then each replacement as soon as it is started (before it is
    ready, so it never drains its inbox), ``rounds`` times in all; returns the kills."""
    kills = 0
    last = None
    deadline = time.monotonic() + timeout
    while kills < rounds and time.monotonic() < deadline:
        p = pool.procs[k]
        pid = None if p is None else p.pid
        if pid is None or pid == last:
            time.sleep(0.0005)
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        last = pid
        kills += 1
    return kills


def _waiting_frames(pool: Any, k: int) -> int:
    """Frames worker ``k`` holds with a child it finished and one still queued or running
    elsewhere: each recovery of ``k`` pings them (the child may not have)."""
    n = 0
    for h in pool.rec.held_by(k + 1, (S_RUNNING,)):
        kids = pool.rec.children(h)
        n += (any(s == S_DONE and w == k + 1 for _c, s, w in kids)
              and any(s in (S_QUEUED, S_RUNNING) for _c, s, _w in kids))
    return n


def test_replacements_killed_while_starting_do_not_fill_its_inbox(monkeypatch):
    """Trees run on both workers; worker 0 holds frames whose other children run on
    worker 1.  Worker 0 is killed, then its replacement 11 more times before it is
    ready: every future still resolves, with its value, and a new submit is answered."""
    with _storm_executor(monkeypatch, retries=100) as ex:
        assert ex.wait_ready(60)
        pool = ex._pool
        # leaves of 0.5 ms: frames wait on children long enough for worker 1 to steal some
        # (instant leaves: a loaded full run finished whole trees between two looks)
        trees = [ex.submit(tasks.slow_tree, *TREE, 0.0005) for _ in range(8)]
        deadline = time.monotonic() + 30
        # one such frame is enough: each of the 12 recoveries below pings it, 12 pings for
        # an 8-entry inbox, which the old code's duplicates filled (3 asked for more than
        # a loaded full run gives within 30 s)
        seen = 0
        while time.monotonic() < deadline:
            seen = _waiting_frames(pool, 0)  # (transient: kept, not looked at again)
            if seen >= 1:
                break
            # until worker 0 waits on children stolen by worker 1; trees that all ended
            # before this look saw it (a loaded machine) are followed by more
            if all(f.done() for f in trees[-8:]):
                trees += [ex.submit(tasks.slow_tree, *TREE, 0.0005) for _ in range(8)]
            time.sleep(0.001)
        assert seen >= 1, "worker 0 never held such a frame"
        kills = _kill_replacements(pool, 0, rounds=12, timeout=20)
        assert kills == 12, f"only {kills} kills: no replacement was started after that"
        assert _pending_after(trees, WAIT) == 0, "trees hung after the kills"
        assert [f.result(timeout=0) for f in trees] == [TREE_VALUE] * len(trees)
        assert ex.submit(tasks.square, 7).result(timeout=WAIT) == 49
        assert pool.stray == 0


class _Storm(threading.Thread):
    """SIGKILL a random live worker (any state) every 20-50 ms for ``seconds``."""

    def __init__(self, pool: Any, seconds: float, seed: int) -> None:
        super().__init__(name="storm", daemon=True)
        self.pool = pool
        self.seconds = seconds
        self.rng = random.Random(seed)
        self.kills = 0

    def run(self) -> None:
        dead: set[int] = set()
        end = time.monotonic() + self.seconds
        while time.monotonic() < end:
            time.sleep(self.rng.uniform(0.02, 0.05))
            pids = [p.pid for p in list(self.pool.procs)
                    if p is not None and p.pid is not None and p.pid not in dead]
            if pids:
                pid = self.rng.choice(pids)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                dead.add(pid)
                self.kills += 1


def test_short_storm_with_small_inboxes(monkeypatch):
    """The storm of benchmarks/chaos.py --storm, short: trees and busy tasks, a random
    worker killed every 20-50 ms (starting ones too) for 6 s: nothing is lost, wrong or
    duplicated, a new submit is answered, and the pool recovers its workers."""
    with _storm_executor(monkeypatch, retries=255) as ex:
        assert ex.wait_ready(60)
        pool = ex._pool
        free0 = ex.stats().records_free
        assert free0 == ex.stats().records  # nothing in use yet
        storm = _Storm(pool, 6.0, seed=20)
        storm.start()
        jobs = [(ex.submit(tasks.tree_sum, *TREE), TREE_VALUE) for _ in range(4)]
        jobs += [(ex.submit(tasks.tagged, i, None, 0.0002), (i, i * i)) for i in range(2000)]
        storm.join()
        assert storm.kills >= 50
        assert ex.submit(tasks.square, 5).result(timeout=WAIT) == 25
        assert _pending_after([f for f, _ in jobs], WAIT) == 0, "futures hung after the storm"
        assert [f.result(timeout=0) for f, _ in jobs] == [v for _, v in jobs]
        assert pool.stray == 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(
                pool.region.load32(pool.layout.worker(k) + W_STATE) == STATE_READY
                for k in range(pool.n)):
            time.sleep(0.01)
        deadline = time.monotonic() + 10  # the last frees trail the futures a little
        while ex.stats().records_free != free0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ex.stats().records_free == free0, "records leaked"
