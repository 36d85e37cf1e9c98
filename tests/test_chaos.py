"""Chaos: the kill-safe task lifecycle under random faults (README "How it works": Faults).

A killer thread SIGKILLs random workers (ready ones, and ones still starting) while
20,000 short tasks and fork-join trees run; SIGINT hits task bodies; workers are killed
as soon as they are spawned; a task kills its own worker every time it runs.  What must
hold:

* every future resolves exactly once: with its right value (every result names its
  argument, so one delivered to another future is caught), or with WorkerCrashedError
  when its retries are used up (retries=0), or with KeyboardInterrupt raised in its body
  (SIGINT); none is lost (every wait has a deadline) and no completion arrives for a
  future that is not pending (the pool's ``stray`` count);
* no worker dies from SIGINT, a kill from outside during start-up never breaks the pool,
  and the executor runs tasks afterwards;
* after shutdown no worker process and no /dev/shm file of the executor remains.

Four tests at the end reproduce, deterministically, windows this chaos found (a full
injector after a recovery; a kill or a Ctrl-C inside spawn()); they failed before those
were closed.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import glob
import multiprocessing as mp
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
from stealer.shared import queues as _queues
from stealer.shared._layout import R_TRIES, S_QUEUED, S_RUNNING
from stealer.shared.shm import SHM_DIR, W_CURRENT, W_LEASE, W_STATE
from stealer.worker.loop import STATE_READY, STATE_STARTING

# Every test here SIGKILLs (or SIGINTs) workers from outside: not on the pure-Python
# queues, whose one lock a killed worker may hold (tests/test_fallback.py).
pytestmark = pytest.mark.kills_workers

FIB = (15, 8)  # fib(15) with a sequential cutoff of 8: a few dozen frames
TREE = (3, 4)  # tree_sum(3, 4): 85 tasks, 21 of them frames
BLOB_EVERY = 50  # every 50th task sends and gets back a 2 KB blob (not inline)
STALL = 10  # seconds without kills and without any future done: the rest is lost


# -- instruments ------------------------------------------------------------------------
class LostFutures(AssertionError):
    """Futures that never resolved."""


class _Killer(threading.Thread):
    """Send ``sig`` to a random worker every ``interval`` seconds (uniform) until stopped.

    SIGKILL: each process once; with probability ``p_starting`` the victim is a worker
    still starting (if one is), else a ready one (if one is); and after a ready one, with
    the same probability, its replacement while it starts (:meth:`aim`).  Killing starting workers
    whenever no ready one exists would keep both slots starting for ever (a start takes
    ~150 ms here, longer than the interval), so such ticks pass.  SIGINT: ready workers
    only (``p_starting`` 0).
    """

    def __init__(self, ex: stealer.Executor, sig: int, interval: tuple[float, float],
                 seed: int, p_starting: float = 0.0) -> None:
        super().__init__(name="chaos-killer", daemon=True)
        self.ex = ex
        self.sig = sig
        self.interval = interval
        self.rng = random.Random(seed)
        self.p_starting = p_starting
        self.hits: list[tuple[int, int, int]] = []  # (slot, pid, its W_STATE when hit)
        self.seen: set[int] = getattr(ex, "_chaos_pids", set())  # every worker pid observed
        self.cond = threading.Condition()
        self.halt = threading.Event()
        self.error: BaseException | None = None

    def candidates(self) -> list[tuple[int, int, int]]:
        pool = self.ex._pool
        killed = {pid for _k, pid, _s in self.hits} if self.sig == signal.SIGKILL else set()
        out = []
        for k, p in enumerate(list(pool.procs)):
            pid = None if p is None else p.pid
            if pid is None:
                continue
            self.seen.add(pid)
            # (no p.exitcode here: polling would reap the process behind the result thread)
            if pid not in killed:
                out.append((k, pid, pool.region.load32(pool.layout.worker(k) + W_STATE)))
        return out

    def run(self) -> None:
        try:
            while not self.halt.wait(self.rng.uniform(*self.interval)):
                cands = self.candidates()
                want = STATE_STARTING if self.rng.random() < self.p_starting else STATE_READY
                pick = [c for c in cands if c[2] == want]
                if not pick:
                    continue
                k, pid, state = self.rng.choice(pick)
                try:
                    os.kill(pid, self.sig)
                except ProcessLookupError:
                    continue
                with self.cond:
                    self.hits.append((k, pid, state))
                    self.cond.notify_all()
                if self.sig == signal.SIGKILL and state == STATE_READY and self.p_starting:
                    self.aim(k, pid)
        except BaseException as exc:  # re-raised by stop()
            self.error = exc

    def aim(self, k: int, dead: int) -> None:
        """With probability ``p_starting``, kill slot ``k``'s replacement while it starts: it
        is STARTING for ~15 ms (forkserver), so random ticks rarely find one."""
        if self.rng.random() >= self.p_starting:
            return
        end = time.monotonic() + 2.0
        while time.monotonic() < end and not self.halt.wait(0.0003):
            p = self.ex._pool.procs[k]
            pid = None if p is None else p.pid
            if pid is None or pid == dead:
                continue
            state = self.ex._pool.region.load32(self.ex._pool.layout.worker(k) + W_STATE)
            if state != STATE_STARTING:
                return  # missed it: ready already
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                return
            with self.cond:
                self.hits.append((k, pid, state))
                self.cond.notify_all()
            return

    def wait_hits(self, n: int, timeout: float) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: len(self.hits) >= n, timeout):
                raise AssertionError(f"only {len(self.hits)} of {n} kills within {timeout} s")

    def stop(self) -> None:
        self.halt.set()
        self.join(10)
        assert not self.is_alive()
        if self.error is not None:
            raise self.error


def _wait_all(futures: list[cf.Future], deadline: float, stall: float) -> int:
    """Wait until every future is done, or ``deadline`` (monotonic), or no future got done
    for ``stall`` seconds; the number still pending (lost)."""
    pending = set(futures)
    last = time.monotonic()
    while pending:
        now = time.monotonic()
        if now >= deadline or now - last >= stall:
            break
        done, pending = cf.wait(pending, timeout=min(0.5, deadline - now))
        if done:
            last = time.monotonic()
    return len(pending)


def _outcome(f: cf.Future, expected: Any) -> str:
    """'ok', 'wrong', 'crashed' (WorkerCrashedError), 'interrupted' (KeyboardInterrupt),
    'lost' (still pending) or the name of another exception."""
    if not f.done():
        return "lost"
    try:
        value = f.result(timeout=0)
    except stealer.WorkerCrashedError:
        return "crashed"
    except KeyboardInterrupt:
        return "interrupted"
    except BaseException as exc:
        return type(exc).__name__
    return "ok" if value == expected else "wrong"


def _tally(jobs: list[tuple[cf.Future, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for f, expected in jobs:
        o = _outcome(f, expected)
        out[o] = out.get(o, 0) + 1
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextlib.contextmanager
def _executor(*args: Any, **kw: Any) -> Iterator[stealer.Executor]:
    """An Executor shut down without hanging even if a future was lost; afterwards no worker process and no /dev/shm file of it remains."""
    ex = stealer.Executor(*args, **kw)
    pool = ex._pool
    seen: set[int] = set()
    ex._chaos_pids = seen  # type: ignore[attr-defined]  # the killers add theirs
    try:
        yield ex
    finally:
        seen.update(p.pid for p in list(pool.procs) if p is not None)
        # every test waits for its futures: pending ones are lost. A future that can never
        # resolve (a lost task, a frame waiting for a child in no queue) keeps the result
        # thread waiting: force_close gives up on it and kills the workers.
        probes.force_close(ex)
        t = pool.thread
        assert t is not None
        assert not t.is_alive(), "the result thread did not exit"
        left = glob.glob(os.path.join(SHM_DIR, pool.name + "*"))
        assert not left, f"shared-memory files left: {left}"
        assert not [p for p in mp.active_children() if p.name.startswith("stealer-worker")]
        assert not [pid for pid in seen if _alive(pid)], "worker processes left"


def _assert_usable(ex: stealer.Executor) -> None:
    fs = [ex.submit(tasks.tagged, i) for i in range(200)]
    assert [f.result(timeout=60) for f in fs] == [(i, i * i) for i in range(200)]
    assert ex.submit(tasks.fib, 18, 8).result(timeout=60) == tasks.fib_seq(18)


def _lost_in_spawn_window(ex: stealer.Executor, lost: list[cf.Future]) -> bool:
    """True if every lost future is a fork-join root whose tree holds a child that is
    QUEUED and never started under a frame of a dead worker incarnation: the signature of
    the spawn() bug (test_worker_killed_inside_spawn_keeps_the_tree, since fixed)."""
    pool = ex._pool
    mm = pool.arena.mm

    def stuck(h: int) -> bool:
        owner, inc = pool.rec.frame_owner(h)
        dead = inc != 0 and owner < pool.n and inc != pool.incarnations[owner]
        for k, state, _who in pool.rec.children(h):
            tries = int.from_bytes(mm[pool.arena.off(k) + R_TRIES:][:4], "little")
            if state == S_QUEUED and dead and tries == 0:
                return True
            if state == S_RUNNING and stuck(k):
                return True
        return False

    return bool(lost) and all(f._st_handle is not None and stuck(f._st_handle) for f in lost)


def _check_not_lost(ex: stealer.Executor, jobs: list[tuple[cf.Future, Any]]) -> None:
    lost = [f for f, _ in jobs if not f.done()]
    where = " (stuck in the spawn() window)" if lost and _lost_in_spawn_window(ex, lost) else ""
    assert not lost, f"{len(lost)} futures never resolved{where}"


# -- SIGKILL chaos --------------------------------------------------------------------------
def _sigkill_chaos(ex: stealer.Executor, n: int, min_kills: int, seed: int, chunks: int = 20
                   ) -> tuple[dict[str, int], _Killer, list[tuple[cf.Future, Any]]]:
    """``n`` tagged tasks and ``chunks`` fork-join trees, submitted in ``chunks`` rounds
    paced by the killer (round j once j * min_kills / (chunks - 1) kills were made, so at
    least ``min_kills`` land while tasks are in flight).  The killer goes on until every
    future is done (or 2 * min_kills kills, or 60 s: each kill costs a ~150 ms restart,
    which bounds the test's time); then the rest get STALL seconds without kills before
    they count as lost.  Returns (outcomes, killer, jobs)."""
    killer = _Killer(ex, signal.SIGKILL, (0.02, 0.05), seed, p_starting=0.15)
    killer.start()
    jobs: list[tuple[cf.Future, Any]] = []
    try:
        per = n // chunks
        for c in range(chunks):
            killer.wait_hits(c * min_kills // (chunks - 1), timeout=60)
            if c % 2:
                jobs.append((ex.submit(tasks.tree_sum, *TREE),
                             sum(TREE[1] ** d for d in range(TREE[0] + 1))))
            else:
                jobs.append((ex.submit(tasks.fib, *FIB), tasks.fib_seq(FIB[0])))
            for i in range(c * per, n if c == chunks - 1 else (c + 1) * per):
                if i % BLOB_EVERY == 0:
                    blob = bytes([i % 251]) * 2048
                    jobs.append((ex.submit(tasks.tagged, i, blob), (i, i * i, blob)))
                else:
                    jobs.append((ex.submit(tasks.tagged, i), (i, i * i)))
        pending = {f for f, _ in jobs}
        end = time.monotonic() + 60
        while pending and len(killer.hits) < 2 * min_kills and time.monotonic() < end:
            pending = cf.wait(pending, timeout=0.2)[1]
    finally:
        killer.stop()
    _wait_all(list(pending), time.monotonic() + 60, stall=STALL)
    return _tally(jobs), killer, jobs


def _settled(ex: stealer.Executor, kills: int, timeout: float = 30) -> dict[str, Any]:
    """Once every kill was handled (crashes == kills) and every slot is ready: the stats."""
    pool = ex._pool
    deadline = time.monotonic() + timeout
    while True:
        client = ex.stats().client
        states = [pool.region.load32(pool.layout.worker(k) + W_STATE) for k in range(pool.n)]
        if client["crashes"] >= kills and all(s == STATE_READY for s in states):
            return client
        assert time.monotonic() < deadline, (client, states)
        time.sleep(0.01)


@pytest.mark.slow
def test_sigkill_chaos_loses_nothing_duplicates_nothing(record_property):
    """20,000 tasks + 20 fork-join trees while a random worker is SIGKILLed every 20-50 ms
    (ready ones and ones still starting); retries=50 is more than any task can use here,
    so every future must get its own right value, exactly once."""
    # records > tasks: the client-side backlog stays unused; with it, kills lose tasks
    # (test_backlog_task_survives_recovery_refilling_the_injector)
    with _executor(2, retries=50, records=32768) as ex:
        out, killer, jobs = _sigkill_chaos(ex, 20_000, min_kills=20, seed=1)
        kills = len(killer.hits)
        starting = sum(s == STATE_STARTING for _k, _p, s in killer.hits)
        strays = ex._pool.stray
        record_property("kills", kills)
        print(f"chaos: {out} kills={kills} (starting {starting}) strays={strays}")
        _check_not_lost(ex, jobs)
        assert out == {"ok": 20_020}, out
        assert strays == 0
        assert kills >= 20 and starting >= 1
        client = _settled(ex, kills)
        assert client["crashes"] == kills  # each kill seen once, no other death
        assert client["pending"] == 0 and client["backlog"] == 0
        _assert_usable(ex)


@pytest.mark.slow
def test_sigkill_chaos_without_retries_fails_only_with_worker_crashed():
    """retries=0: a task whose worker dies fails at once with WorkerCrashedError (a tree
    too, when part of it died); everything else gets its right value, exactly once."""
    chunks = 10
    with _executor(2, retries=0, records=32768) as ex:
        out, killer, jobs = _sigkill_chaos(ex, 5_000, min_kills=15, seed=2, chunks=chunks)
        kills = len(killer.hits)
        print(f"chaos retries=0: {out} kills={kills} strays={ex._pool.stray}")
        _check_not_lost(ex, jobs)
        assert set(out) <= {"ok", "crashed"}, out
        assert ex._pool.stray == 0
        assert kills >= 15
        # a kill fails the one plain task its worker was running (and trees it held part of)
        plain = [(f, e) for f, e in jobs if not isinstance(e, int)]
        assert _tally(plain).get("crashed", 0) <= kills
        _settled(ex, kills)
        _assert_usable(ex)


# -- SIGINT chaos -----------------------------------------------------------------------------
@pytest.mark.slow
def test_sigint_chaos_interrupts_only_task_bodies():
    """SIGINT to a random ready worker every 10-30 ms: a task fails with KeyboardInterrupt
    if its body was hit (as in ProcessPoolExecutor), any other moment ignores it; no worker
    dies, every future resolves exactly once, the executor stays usable.  (Plain tasks
    only: an interrupt inside spawn() loses the tree, see
    test_interrupt_inside_spawn_keeps_the_tree.)"""
    with _executor(2) as ex:
        assert ex.wait_ready(60)
        pids = ex.worker_pids()
        killer = _Killer(ex, signal.SIGINT, (0.01, 0.03), seed=3)
        killer.start()
        try:
            jobs = [(ex.submit(tasks.tagged, i, None, 0.0002), (i, i * i)) for i in range(8000)]
            _wait_all([f for f, _ in jobs], time.monotonic() + 60, stall=STALL)
            killer.wait_hits(20, timeout=30)
        finally:
            killer.stop()
        out = _tally(jobs)
        print(f"sigint chaos: {out} signals={len(killer.hits)}")
        assert set(out) <= {"ok", "interrupted"}, out
        assert out.get("interrupted", 0) >= 1  # the bodies were hit
        assert ex._pool.stray == 0
        assert ex.stats().client["crashes"] == 0
        assert ex.worker_pids() == pids
        _assert_usable(ex)


# -- kills during start-up --------------------------------------------------------------------
def test_workers_killed_while_starting_do_not_break_the_pool():
    """Kill every worker right after it is spawned, 10 times per slot: a kill from outside
    is not a failure to start (only a worker that exits by itself before it is ready
    counts toward 'cannot start workers'), so the pool is not broken and runs tasks."""
    rounds = 10
    with _executor(2) as ex:
        pool = ex._pool
        killed: dict[int, list[int]] = {0: [], 1: []}
        deadline = time.monotonic() + 60
        while any(len(v) < rounds for v in killed.values()):
            assert time.monotonic() < deadline, killed
            assert pool.broken is None, pool.broken
            for k, p in enumerate(list(pool.procs)):
                if p is None or len(killed[k]) >= rounds or p.pid in killed[k]:
                    continue
                # still starting: its state word is STARTING until it is ready
                assert pool.region.load32(pool.layout.worker(k) + W_STATE) == STATE_STARTING
                p.kill()
                killed[k].append(p.pid)
            time.sleep(0.001)
        assert ex.wait_ready(60)
        client = _settled(ex, 2 * rounds)
        assert pool.broken is None
        assert client["crashes"] == 2 * rounds
        assert client["replacements"] == 2 * rounds
        _assert_usable(ex)


# -- a poison pill ----------------------------------------------------------------------------
@pytest.mark.parametrize(("retries", "per_call"), [(0, None), (2, None), (3, 1)])
def test_poison_pill_fails_after_retries_plus_one_runs(tmp_path, retries, per_call):
    """A task that kills its worker every time runs exactly retries + 1 times (the
    executor's retries, or the per-call options(retries=)), then fails with
    WorkerCrashedError; the tasks around it complete."""
    with _executor(2, retries=retries) as ex:
        view = ex if per_call is None else ex.options(retries=per_call)
        before = [ex.submit(tasks.tagged, i, None, 0.0005) for i in range(100)]
        pill = view.submit(tasks.poison, str(tmp_path))
        after = [ex.submit(tasks.tagged, i, None, 0.0005) for i in range(100, 200)]
        with pytest.raises(stealer.WorkerCrashedError, match="SIGKILL"):
            pill.result(timeout=60)
        runs = len(os.listdir(tmp_path))
        assert runs == (retries if per_call is None else per_call) + 1
        assert [f.result(timeout=60) for f in before + after] == [(i, i * i) for i in range(200)]
        assert ex._pool.stray == 0
        _assert_usable(ex)


# -- bugs found by the chaos above, reproduced deterministically ----------------------------
def _proc_gone_or_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_backlog_task_survives_recovery_refilling_the_injector():
    """records=32, one worker.  The worker takes a batch of 16 off the full injector (the
    1st runs, 15 wait in its deque, all 16 leased) and is killed: recovery pushes the 15
    leased copies back and re-queues the 1st, so the injector holds 32 handles for the
    32 records again.  Each task the replacement then finishes frees a record; the
    client moves a backlog task into it and pushes its handle on the full injector: the
    push fails, is ignored, and that task is in no queue for ever."""
    records = 32
    with _executor(1, records=records, retries=3) as ex:
        first = ex.submit(tasks.sleep_then, 0.3, -1)
        jobs = [(first, -1)]
        jobs += [(ex.submit(tasks.sleep_then, 0.03, i), i) for i in range(15)]
        jobs += [(ex.submit(tasks.tagged, i), (i, i * i)) for i in range(records)]
        assert len(ex._pool.backlog) == 16
        assert ex.wait_ready(60)
        deadline = time.monotonic() + 30
        while not first.running():
            assert time.monotonic() < deadline
            time.sleep(0.001)
        os.kill(ex.worker_pids()[0], signal.SIGKILL)
        lost = _wait_all([f for f, _ in jobs], time.monotonic() + 60, stall=2)
        if lost:
            raise LostFutures(f"{lost} futures never resolved")
        assert _tally(jobs) == {"ok": len(jobs)}


def test_recovery_on_a_full_injector_does_not_spin():
    """records=32, one worker, 32 slow tasks.  The first kill leaves the injector full
    (as in the test above: 16 never taken + 15 leased copies + the re-queued task).  The
    replacement runs a task from its inherited deque and is killed too: recovery
    re-queues that task, its push finds the injector full, and the result thread waits
    for room that only a worker could make; but the replacement is started only after
    the recovery.  No future resolves again (and the interpreter would hang at exit
    joining that thread)."""
    records = 32
    with _executor(1, records=records, retries=3) as ex:
        # the two that are killed run long enough to be killed running; the rest are short
        # (they run on one worker, one after the other, in the same order whatever they take)
        jobs = [(ex.submit(tasks.sleep_then, 0.3 if i < 2 else 0.03, i), i)
                for i in range(records)]
        assert ex.wait_ready(60)
        for f in (jobs[0][0], jobs[1][0]):  # kill the worker running the 1st, then the 2nd
            deadline = time.monotonic() + 30
            while not f.running():
                assert time.monotonic() < deadline and not f.done()
                time.sleep(0.001)
            os.kill(ex.worker_pids()[0], signal.SIGKILL)
        if _wait_all([f for f, _ in jobs], time.monotonic() + 60, stall=3):
            raise LostFutures("futures never resolved")
        assert _tally(jobs) == {"ok": len(jobs)}


def test_worker_killed_inside_spawn_keeps_the_tree():
    """A task spawns a child with a 64 MB argument: the record is set up (QUEUED), then
    its payload is written to an overflow file, and only then leased and pushed.  Kill
    the worker while that file is being written: the tree must still complete (the root
    re-run, or the child run from its record), not hang."""
    nbytes = 64 << 20
    with _executor(1, retries=3) as ex:
        assert ex.wait_ready(60)
        pool = ex._pool
        base = pool.layout.worker(0)
        f = ex.submit(tasks.spawn_big, nbytes)
        root = f._st_handle
        deadline = time.monotonic() + 30
        while not glob.glob(os.path.join(SHM_DIR, pool.name + "-x*")):
            assert time.monotonic() < deadline and not f.done()
            time.sleep(0.0002)
        pid = ex.worker_pids()[0]
        os.kill(pid, signal.SIGKILL)
        while not _proc_gone_or_zombie(pid):
            time.sleep(0.0002)
        # killed inside the window: the parent runs, its child is QUEUED but in no queue yet
        # -- unless the result thread already began the recovery, which clears the
        # worker's current word and pushes the child (on_death clears the worker's slot
        # first, so a recovery that changed them shows there after they are read)
        current = pool.region.load64(base + W_CURRENT)
        kids = pool.rec.children(root)
        in_no_queue = (len(_queues.impl.Deque(pool.region, pool.layout.deque(0),
                                              pool.layout.records)) == 0
                       and len(pool.injector) == 0)
        recovering = pool.procs[0] is None or pool.procs[0].pid != pid
        if not recovering:
            assert current == root + 1
            assert len(kids) == 1 and kids[0][1] == S_QUEUED
            assert in_no_queue
        if _wait_all([f], time.monotonic() + 60, stall=3):
            raise LostFutures("the tree never resolved")
        assert f.result(timeout=0) == nbytes


def test_interrupt_inside_spawn_keeps_the_tree(monkeypatch):
    """Ctrl-C reaches a task body while it is inside stealer.spawn(), after the child's
    lease is stored and before its push (the failpoint worker.after_spawn holds the
    worker there for 300 ms; the SIGINT comes meanwhile).  The task may fail with
    KeyboardInterrupt, but its future must resolve."""
    monkeypatch.setenv("STEALER_FAILPOINTS", "worker.after_spawn=sleep300")
    with _executor(1) as ex:
        assert ex.wait_ready(60)
        pool = ex._pool
        lease = pool.layout.worker(0) + W_LEASE
        f = ex.submit(tasks.wide, 3)
        deadline = time.monotonic() + 30
        while True:  # the first child is set up and leased: the worker sleeps before its push
            kids = pool.rec.children(f._st_handle)
            if kids and pool.region.load64(lease) == kids[0][0] + 1:
                break
            assert time.monotonic() < deadline and not f.done()
            time.sleep(0.0002)
        os.kill(ex.worker_pids()[0], signal.SIGINT)
        if _wait_all([f], time.monotonic() + 60, stall=2):
            raise LostFutures("the tree never resolved")
        assert _outcome(f, 5) in ("ok", "interrupted")
        assert ex.stats().client["crashes"] == 0
