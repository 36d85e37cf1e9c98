"""concurrent.futures parity: cancellation seen by wait/as_completed, lock order, map.

Written in the spirit of CPython's Lib/test/test_concurrent_futures (test_wait,
test_as_completed, test_shutdown, executor.py's map tests), for stealer.Executor.
A task that must stay queued waits behind a *gate*: a task on the only worker
that blocks until the test creates a file.  ``records=2`` keeps one more task
in shared memory and puts the rest in the client-side backlog, so both places
a queued task can be are covered.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import gc
import os
import sys
import threading
import time
import weakref

import pytest
import tasks

import stealer

LIMIT = 30.0  # seconds: only turns a hang into a failure


# -- tasks (module level, so spawned workers can import them) ---------------------
def wait_for_file(path, value=None):
    """Block until ``path`` exists (the test opens the gate), then return ``value``."""
    end = time.monotonic() + 2 * LIMIT
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"the gate {path} was never opened")
        time.sleep(0.002)
    return value


def touch(dirname, i):
    """Leave a trace that task ``i`` ran."""
    with open(os.path.join(dirname, str(i)), "w"):
        pass
    return i


class Payload:
    def __init__(self, i):
        self.i = i


def make_payload(i):
    return Payload(i)


# -- helpers ----------------------------------------------------------------------
def until(predicate, what):
    end = time.monotonic() + LIMIT
    while not predicate():
        if time.monotonic() > end:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.002)


@contextlib.contextmanager
def gated(ex, tmp_path):
    """Occupy ``ex``'s only worker with a gate task until the block ends."""
    gate = tmp_path / "gate"
    blocker = ex.submit(wait_for_file, str(gate), "blocker")
    try:
        until(blocker.running, "the gate task to start")
        yield blocker
    finally:
        gate.touch()
        blocker.result(timeout=LIMIT)


def in_thread(fn, *args, **kwargs):
    """Run fn in a thread; returns a callable that joins it and gives fn's result."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the test thread by join()
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()

    def join():
        t.join(LIMIT)
        if t.is_alive():
            pytest.fail(f"{getattr(fn, '__name__', fn)} did not return in {LIMIT} s")
        if "error" in out:
            raise out["error"]
        return out["value"]

    return join


def collected(ref):
    """True once the object behind ``ref`` is gone (the result thread may hold it briefly).

    Looks before collecting: an object freed by its reference count needs no collection
    (a full gc.collect costs ~0.2 s in a client that has run the suite); one held only by
    a cycle, or held for a while, is looked for again after each collection."""
    end = time.monotonic() + 10
    while True:
        if ref() is None:
            return True
        gc.collect()
        if ref() is None:
            return True
        if time.monotonic() > end:
            return False
        time.sleep(0.005)


@pytest.fixture(scope="module")
def ex1():
    """One worker and two records: a gate, one queued task, the rest in the backlog."""
    with stealer.Executor(1, records=2) as e:
        assert e.wait_ready(LIMIT)
        yield e


@pytest.fixture(scope="module")
def ex2():
    with stealer.Executor(2) as e:
        yield e


# -- 1. a cancelled future counts as done for wait() and as_completed() -----------
@pytest.mark.parametrize("kind", ["ThreadPoolExecutor", "stealer"])
def test_cancelled_futures_are_done_for_a_waiter_like_threadpool(kind, ex1, tmp_path):
    """The same scenario on the stdlib's executor (the oracle) and on ours."""
    own = cf.ThreadPoolExecutor(1) if kind == "ThreadPoolExecutor" else None
    ex = own or ex1
    try:
        with gated(ex, tmp_path) as blocker:
            queued = [ex.submit(tasks.square, i) for i in range(3)]  # a record, then backlog
            join = in_thread(cf.wait, queued, timeout=LIMIT)
            until(lambda: all(f._waiters for f in queued), "wait() to block")
            assert [f.cancel() for f in queued] == [True, True, True]
        done, not_done = join()
        assert done == set(queued) and not not_done
        assert all(f.cancelled() for f in queued)
        assert blocker.result() == "blocker"
    finally:
        if own is not None:
            own.shutdown()


def test_wait_counts_cancelled_futures_as_done(ex1, tmp_path):
    ok = ex1.submit(tasks.square, 7)
    failed = ex1.submit(tasks.raise_value_error, "task failed")
    assert ok.result(timeout=LIMIT) == 49
    assert isinstance(failed.exception(timeout=LIMIT), ValueError)
    with gated(ex1, tmp_path) as blocker:
        q = [ex1.submit(tasks.square, i) for i in range(4)]  # q[0] in a record, q[1:] in backlog
        assert all(f.cancel() for f in q)
        assert all(f.cancelled() and f.done() for f in q)
        assert all(f._state == cf._base.CANCELLED_AND_NOTIFIED for f in q)

        done, not_done = cf.wait([q[0], blocker], timeout=LIMIT, return_when=cf.FIRST_COMPLETED)
        assert done == {q[0]} and not_done == {blocker}

        done, not_done = cf.wait([ok, q[1], failed, blocker], timeout=LIMIT,
                                 return_when=cf.FIRST_EXCEPTION)
        assert done == {ok, q[1], failed} and not_done == {blocker}

        done, not_done = cf.wait(q, timeout=LIMIT, return_when=cf.FIRST_EXCEPTION)
        assert done == set(q) and not not_done

        done, not_done = cf.wait([ok, failed, *q], timeout=LIMIT)
        assert done == {ok, failed, *q} and not not_done

        assert set(cf.as_completed([ok, failed, *q], timeout=LIMIT)) == {ok, failed, *q}
        assert list(cf.as_completed([q[2]] * 3, timeout=LIMIT)) == [q[2]]
        with pytest.raises(cf.TimeoutError, match=r"1 \(of 3\) futures unfinished"):
            list(cf.as_completed([q[3], ok, blocker], timeout=0))
        for f in q:
            with pytest.raises(cf.CancelledError):
                f.result(timeout=0)


def test_cancel_wakes_threads_already_waiting(ex1, tmp_path):
    with gated(ex1, tmp_path) as blocker:
        q = [ex1.submit(tasks.square, i) for i in range(3)]
        all_done = in_thread(cf.wait, q, timeout=LIMIT)
        first = in_thread(cf.wait, [q[1], blocker], timeout=LIMIT,
                          return_when=cf.FIRST_COMPLETED)
        one_by_one = in_thread(lambda: [f for f in cf.as_completed(q, timeout=LIMIT)])
        until(lambda: len(q[0]._waiters) == 2 and len(q[1]._waiters) == 3, "the waiters")
        for f in q:
            assert f.cancel()
        # all answered while the gate task still holds the only worker
        assert all_done() == (set(q), set())
        assert first() == ({q[1]}, {blocker})
        assert sorted(one_by_one(), key=q.index) == q
        assert not blocker.done()


def test_cancel_runs_done_callbacks_once(ex1, tmp_path):
    seen = []
    with gated(ex1, tmp_path):
        q = [ex1.submit(tasks.square, i) for i in range(2)]
        for f in q:
            f.add_done_callback(seen.append)
        assert all(f.cancel() for f in q)
        assert all(f.cancel() for f in q)  # again: still cancelled, no second callback
    assert seen == q


def test_shutdown_cancel_futures_notifies_waiters(tmp_path):
    """Beyond the stdlib: its executors leave these CANCELLED, and wait() never sees them."""
    e = stealer.Executor(1, records=2)
    gate = tmp_path / "gate"
    try:
        blocker = e.submit(wait_for_file, str(gate), "blocker")
        until(blocker.running, "the gate task to start")
        q = [e.submit(tasks.square, i) for i in range(5)]
        join = in_thread(cf.wait, q, timeout=LIMIT)
        until(lambda: all(f._waiters for f in q), "wait() to block")
        e.shutdown(wait=False, cancel_futures=True)
        assert join() == (set(q), set())
        assert all(f.cancelled() for f in q)
    finally:
        gate.touch()
        e.shutdown(wait=True)
    assert blocker.result(timeout=0) == "blocker"


# -- 2. wait()/as_completed() in several threads keep one lock order --------------
def _interleaved(gate):
    """An Executor(1) blocked by a task waiting for ``gate``, with settled futures and
    pending ones interleaved in id() order: ``(e, settled, pending, by_id, cut)``, where
    ``by_id[cut - 1]`` is settled, ``by_id[cut]`` pending and a settled one follows; or
    ``(e, None, ...)`` when the allocator left no hole for a pending future this time."""
    e = stealer.Executor(1)
    made = [e.submit(tasks.square, i) for i in range(60)]
    until(lambda: all(f.done() for f in made), "60 quick tasks")  # done() takes no lock
    settled = set(made[::2])
    made.clear()  # leave holes in memory, for pending futures to fill
    gc.collect()
    lo, hi = min(map(id, settled)), max(map(id, settled))
    blocker = e.submit(wait_for_file, str(gate), "blocker")
    pending = [blocker]
    # Until a few pending futures sit between settled ones in id() order (they fill the
    # holes just made, usually within tens of submits).  Capped low: every future here is
    # locked 1,500 times by each of 8 threads, and CI once found no hole for 3,000
    # submits, which made the threads' work (not a deadlock) outlast LIMIT; with the cap,
    # CI once found none in 400 (then a fresh executor tries again).
    while sum(lo < id(f) < hi for f in pending) < 5 and len(pending) < 400:
        pending.append(e.submit(tasks.square, len(pending)))
    by_id = sorted([*settled, *pending], key=id)
    kinds = "".join("S" if f in settled else "P" for f in by_id)
    # Overlapping sets that lock a pending future after a settled one, and a settled one
    # after that pending one: a wrong lock order shows up here.
    cut = kinds.find("SP") + 1
    if cut > 0 and "S" in kinds[cut:]:
        return e, settled, pending, by_id, cut
    return e, None, pending, kinds, cut


def test_overlapping_waits_in_two_threads_do_not_deadlock(tmp_path):
    """wait() and as_completed() lock their futures in id() order; every future needs its
    own lock for that order to hold (settled ones too, and the ones nobody looked at)."""
    old_interval = sys.getswitchinterval()
    for attempt in range(3):
        gate = tmp_path / f"gate{attempt}"
        e, settled, pending, by_id, cut = _interleaved(gate)
        if settled is not None:
            break
        gate.touch()
        e.shutdown(wait=True)
    else:
        raise AssertionError(f"no settled/pending interleaving in 3 executors: {by_id}")
    clean = False
    try:
        sets = [by_id[:cut + 1], by_id[cut:], sorted({*by_id[::3], by_id[cut]}, key=id), by_id]
        rounds = max(100, min(1500, 200_000 // len(by_id)))  # bounded work, whatever the count

        def waits(fs):
            expect = settled.intersection(fs)
            for _ in range(rounds):
                done, _not_done = cf.wait(fs, timeout=0)
                assert done == expect

        def as_completed(fs):
            expect = settled.intersection(fs)
            for _ in range(rounds):
                got = set()
                with pytest.raises(cf.TimeoutError):
                    for f in cf.as_completed(fs, timeout=0):
                        got.add(f)
                assert got == expect

        sys.setswitchinterval(1e-5)  # switch threads often, as CPython's own race tests do
        joins = [in_thread(fn, fs) for fs in sets for fn in (waits, as_completed)]
        for join in joins:
            join()  # fails the test if a thread is stuck (deadlocked)
        sys.setswitchinterval(old_interval)
        gate.touch()
        assert [f.result(timeout=LIMIT) for f in pending[1:]] == [
            i * i for i in range(1, len(pending))]
        clean = True
    finally:
        sys.setswitchinterval(old_interval)
        if not clean:
            # Stuck threads may hold these futures' locks forever: detach every future
            # (nothing has completed since, the gate is shut) so the result thread
            # resolves none, and can close the pool instead of blocking on one.
            e._pool.futures.clear()
            e._pool.backlog.clear()
        gate.touch()
        e.shutdown(wait=True)


# -- 3. map() like ProcessPoolExecutor.map ----------------------------------------
def test_map_results_outlive_the_with_block():
    with stealer.Executor(2) as e:
        plain = e.map(tasks.square, range(200))
        chunked = e.map(tasks.square, range(1000), chunksize=7)
        first = next(plain)
    assert [first, *plain] == [i * i for i in range(200)]
    assert list(chunked) == [i * i for i in range(1000)]


def test_map_nobody_iterates_still_runs_every_task(tmp_path):
    plain, chunked = tmp_path / "plain", tmp_path / "chunked"
    plain.mkdir()
    chunked.mkdir()
    with stealer.Executor(2) as e:
        e.map(touch, [str(plain)] * 200, range(200))
        e.map(touch, [str(chunked)] * 1000, range(1000), chunksize=5)
    assert len(os.listdir(plain)) == 200
    assert len(os.listdir(chunked)) == 1000


def test_map_buffersize_is_lazy_and_bounded(ex2):
    ints = iter(range(10))
    it = ex2.map(tasks.square, ints, buffersize=2)
    assert next(ints) == 2  # map took only the first two inputs
    assert list(it) == [0, 1] + [i * i for i in range(3, 10)]
    ints = iter(range(40))
    it = ex2.map(tasks.square, ints, chunksize=4, buffersize=2)
    assert next(ints) == 8  # two chunks of four
    assert list(it) == [i * i for i in range(8)] + [i * i for i in range(9, 40)]
    assert list(ex2.map(tasks.add, range(4), range(4), buffersize=3)) == [0, 2, 4, 6]
    assert list(ex2.map(str, buffersize=2)) == []
    assert list(ex2.map(str, [], buffersize=2)) == []
    for bad in (0, -1):
        with pytest.raises(ValueError, match="buffersize"):
            ex2.map(str, range(4), buffersize=bad)
    for bad in ("2", 2.0):
        with pytest.raises(TypeError, match="buffersize"):
            ex2.map(str, range(4), buffersize=bad)


def test_map_buffersize_across_shutdown_keeps_results_then_raises():
    with stealer.Executor(2) as e:
        plain = e.map(tasks.square, range(10), buffersize=3)
        chunked = e.map(tasks.square, range(40), chunksize=4, buffersize=2)
        assert next(plain) == 0
        assert next(chunked) == 0
    # Every task submitted before shutdown gives its result; then a clear error.
    got = []
    with pytest.raises(stealer.ExecutorShutdownError, match="buffersize=3"):
        for x in plain:
            got.append(x)
    assert got == [1, 4, 9]
    with pytest.raises(StopIteration):
        next(plain)
    got = []
    with pytest.raises(stealer.ExecutorShutdownError, match="buffersize=None"):
        for x in chunked:
            got.append(x)
    assert got == [i * i for i in range(1, 12)]  # the rest of chunk 0, chunks 1 and 2


def test_map_buffersize_does_not_keep_the_executor_alive():
    e = stealer.Executor(1)
    pool = e._pool
    ref = weakref.ref(e)
    it = e.map(tasks.square, range(10), buffersize=2)
    del e
    assert collected(ref)
    try:
        got = []
        with pytest.raises(stealer.ExecutorShutdownError, match="garbage"):
            for x in it:
                got.append(x)
        assert got == [0, 1]
    finally:
        pool.begin_shutdown()
        pool.thread.join(LIMIT)
    assert not pool.thread.is_alive()


@pytest.mark.parametrize(("chunksize", "buffersize", "progress"), [
    (None, None, False), (None, None, True), (1, None, False), (3, None, False),
    (None, 4, False), (1, 4, False), (3, 2, False)])
def test_map_keeps_no_reference_to_yielded_results(ex2, chunksize, buffersize, progress):
    """CPython issue 14406 (its test_free_reference): the iterator holds no result it has
    yielded, for every chunk size (None: the automatic chunks of 1, 2, 4, 8 inputs
    here, with a per-input outcome each) and with buffersize.  ``collected`` collects
    and looks again for a while: only a reference kept by the iterator is permanent."""
    # 16 inputs: the automatic chunks of 1, 2, 4 and 8 each once, and one more (64 took
    # ~15 s per case: a full gc.collect per result in a client that has run the suite)
    n = 0
    for obj in ex2.map(make_payload, range(16), chunksize=chunksize, buffersize=buffersize,
                       progress=progress):
        assert obj.i == n
        ref = weakref.ref(obj)
        del obj
        assert collected(ref), f"map still holds result {n}"
        n += 1
    assert n == 16


@pytest.mark.parametrize(("chunksize", "buffersize"), [(1, None), (4, None), (1, 2), (4, 2)])
def test_map_timeout_cancels_every_pending_task(ex1, tmp_path, chunksize, buffersize):
    ran = tmp_path / "ran"
    ran.mkdir()
    with gated(ex1, tmp_path):
        it = ex1.map(touch, [str(ran)] * 12, range(12), timeout=0.2, chunksize=chunksize,
                     buffersize=buffersize)
        with pytest.raises(cf.TimeoutError):
            next(it)
        with pytest.raises(StopIteration):
            next(it)
        # nothing of the map is left to run, the task that timed out included
        assert ex1.stats().client["pending"] == 1  # the gate task
    assert ex1.submit(tasks.square, 3).result(timeout=LIMIT) == 9
    assert os.listdir(ran) == []


def test_map_error_ends_iteration(ex2):
    for chunksize in (1, 2):
        it = ex2.map(divmod, [5, 5, 5, 5], [2, 3, 0, 5], chunksize=chunksize)
        assert next(it) == (2, 1)
        assert next(it) == (1, 2)
        with pytest.raises(ZeroDivisionError):
            next(it)
        with pytest.raises(StopIteration):
            next(it)


def test_map_close_cancels_what_has_not_started(ex1, tmp_path):
    gates = [tmp_path / str(i) for i in range(6)]
    gates[0].touch()
    it = ex1.map(wait_for_file, [str(g) for g in gates], range(6))
    assert next(it) == 0
    it.close()  # tasks 2..5 wait behind gates never opened: they must be withdrawn
    assert ex1.stats().client["pending"] <= 1  # task 1, if the worker had started it
    gates[1].touch()
    until(lambda: ex1.stats().client["pending"] == 0, "task 1")
    with pytest.raises(StopIteration):
        next(it)


def test_lazy_map_through_an_options_view():
    """ex.options(...) returns a temporary view: a lazy map over it must not lose it."""
    with stealer.Executor(2) as e:
        it = e.options(retries=0).map(tasks.square, range(50), buffersize=4)
        gc.collect()
        assert list(it) == [i * i for i in range(50)]
