"""The client's per-task path, native and reference: ``submit`` (stealer._cqueues.ClientSubmit
and stealer.client.executor._submit), the result thread's batch (HotPath.complete_batch and
_Pool.complete_batch), and the waiter list of settled futures (issue 10).

Every case the native fast path hands to the reference is tried under both, with the
results checked; ``python`` runs the executor with STEALER_PY_HOTPATH=1 (the Arena's and
the client's Python methods on the native queues).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time

import numpy as np
import pytest
import tasks
from rig import _py_hotpath, hold_result_thread

import stealer
from stealer.client.futures import _NO_WAITERS, _SETTLED, _Future
from stealer.errors import ExecutorShutdownError, SerializationError

try:
    from stealer import _cqueues
except ImportError:  # pragma: no cover - depends on the build
    _cqueues = None


@pytest.fixture(scope="module", params=["native", "python"])
def ex(request):
    if request.param == "native" and _cqueues is None:
        pytest.skip("native extension not built")
    with _py_hotpath(request.param == "python"):
        e = stealer.Executor(2)
    with e:
        yield e


def _is_native(e) -> bool:
    return e._pool.arena.hot is not None


def test_submit_is_native_exactly_where_the_hot_path_is(ex):
    if _is_native(ex):
        assert type(ex.submit).__name__ == "ClientSubmit"
        assert ex.submit.retries == 3
        assert ex.options(retries=0).submit.retries == 0  # a view binds its own
        assert ex.submit.retries == 3
    else:
        assert "submit" not in vars(ex)  # the method: stealer.client.executor._submit
    assert ex.options(retries=1).submit(tasks.square, 7).result(30) == 49


def test_a_subclass_submit_is_not_bypassed():
    calls = []

    class Counting(stealer.Executor):
        def submit(self, fn, /, *args, **kwargs):
            calls.append(fn)
            return super().submit(fn, *args, **kwargs)

    with Counting(1) as e:
        assert e.submit(tasks.square, 3).result(30) == 9
        assert e.options(retries=0).submit(tasks.square, 4).result(30) == 16
    assert calls == [tasks.square, tasks.square]


def test_every_case_the_fast_path_hands_over_gives_the_right_result(ex):
    fresh = tasks.kwargs_of  # first use: not in the function table yet
    assert ex.submit(fresh, 1, 2).result(30) == ((1, 2), {})
    assert ex.submit(fresh, 1, 2).result(30) == ((1, 2), {})  # now in the table
    # a keyword argument named like submit's own parameter
    assert ex.submit(fresh, fn=1, x=None).result(30) == ((), {"fn": 1, "x": None})
    assert ex.submit(lambda x: x * 3, 5).result(30) == 15  # never in the table
    assert ex.submit(tasks.UnhashableCallable(), 41).result(30) == 42  # not hashable
    big = os.urandom(5000)  # pickled call larger than the record's inline area
    assert ex.submit(tasks.nbytes_of, big).result(30) == 5000
    a = np.arange(10_000, dtype=np.int64)  # an out-of-band buffer
    assert np.array_equal(ex.submit(tasks.numpy_double, a).result(30), 2 * a)
    small = np.arange(3)  # out-of-band, yet tiny
    assert np.array_equal(ex.submit(tasks.identity, small).result(30), small)
    with pytest.raises(SerializationError):
        ex.submit(tasks.identity, threading.Lock()).result(30)
    with pytest.raises(TypeError):
        ex.submit()  # no function at all: the call's own error


def test_results_of_every_shape_come_back(ex):
    """The worker's result path: inline pickles, results too big to sit beside the call,
    out-of-band buffers, results that do not pickle, exceptions."""
    assert ex.submit(tasks.identity, None).result(30) is None
    assert ex.submit(tasks.identity, b"x" * 40).result(30) == b"x" * 40  # beside the call
    assert ex.submit(tasks.make_bytes, 512).result(30) == bytes(range(256)) * 2  # not inline
    assert len(ex.submit(tasks.make_bytes, 256 * 300).result(30)) == 256 * 300
    r = ex.submit(tasks.numpy_double, np.ones(50_000)).result(30)
    assert r.shape == (50_000,) and float(r.sum()) == 100_000.0
    with pytest.raises(SerializationError):
        ex.submit(tasks.return_unpicklable).result(30)
    with pytest.raises(ValueError, match="boom"):
        ex.submit(tasks.raise_value_error, "boom").result(30)


def test_many_futures_each_resolved_once_with_waiters_and_callbacks(ex):
    """The batch resolver's two paths at once: futures nobody waits on (settled in the
    batch) and futures with a condition or callbacks (their own _st_resolve)."""
    seen = []
    fs = [ex.submit(tasks.square, i) for i in range(3000)]
    for f in fs[::7]:
        f.add_done_callback(lambda f: seen.append(f.result()))
    waited = fs[::11]
    assert not cf.wait(waited, timeout=60).not_done
    assert [f.result(60) for f in fs] == [i * i for i in range(3000)]
    # A callback of a future this thread settled while it waited runs in the result thread
    # (waiting.py: never in a waiting thread), maybe after result() returned here, as the
    # stdlib's waiters may return before set_result has run the callbacks: wait for them
    want = sorted(i * i for i in range(0, 3000, 7))
    end = time.monotonic() + 30
    while len(seen) < len(want) and time.monotonic() < end:
        time.sleep(0.01)
    time.sleep(0.05)  # (a callback run twice would show now)
    assert sorted(seen) == want
    assert ex._pool.stray == 0


def test_submit_after_shutdown_and_from_a_closed_view():
    for py in (False, True):
        with _py_hotpath(py):
            e = stealer.Executor(1)
        view = e.options(retries=0)
        e.shutdown()
        with pytest.raises(ExecutorShutdownError):
            e.submit(tasks.square, 1)
        with pytest.raises(ExecutorShutdownError):
            view.submit(tasks.square, 1)


def test_more_tasks_than_records_go_through_the_backlog():
    for py in (False, True):
        with _py_hotpath(py):
            e = stealer.Executor(2, records=4)
        with e:
            fs = [e.submit(tasks.square, i) for i in range(300)]
            assert [f.result(60) for f in fs] == [i * i for i in range(300)]


# -- the waiter list of settled futures -------------------------------------------------
def test_wait_and_as_completed_make_nothing_per_settled_future(ex):
    fs = [ex.submit(tasks.square, i) for i in range(500)]
    deadline = time.monotonic() + 60
    while not all(f.done() for f in fs) and time.monotonic() < deadline:
        time.sleep(0.01)  # (done() makes no condition; result() on a pending future does)
    assert [f.result() for f in fs] == [i * i for i in range(500)]
    done, not_done = cf.wait(fs, timeout=30)
    assert len(done) == 500 and not not_done
    assert len(list(cf.as_completed(fs, timeout=30))) == 500
    pending = ex.submit(tasks.sleep_then, 0.2, "late")
    done, not_done = cf.wait([*fs, pending], timeout=30)  # installs a waiter on all
    assert len(done) == 501 and pending.result() == "late"
    for f in fs:
        assert f._st_w is None and f._st_cond is None  # no list, no condition


def test_a_future_with_a_condition_keeps_a_real_waiter_list():
    """The window the settled shortcut must not take: a waiter made the condition, then a
    resolver published FINISHED and is about to notify under that condition.  The waiter
    installing itself now must land in the list the resolver reads."""
    f = _Future(None, 1, None)  # type: ignore[arg-type]
    cond = f._condition  # a waiter made it (the future was pending)
    assert cond is not _SETTLED
    f._result, f._state = 7, cf._base.FINISHED  # the resolver published, not yet notified
    w = f._waiters
    assert w is not _NO_WAITERS and isinstance(w, list)
    g = _Future(None, 2, None)  # type: ignore[arg-type]
    g._st_resolve(3, None)  # settled with no condition: nobody can be notified
    assert g._waiters is _NO_WAITERS and g._condition is _SETTLED


def test_wait_racing_the_resolver_never_misses_a_future(ex):
    for _ in range(40):
        fs = [ex.submit(tasks.square, i) for i in range(100)]
        assert not cf.wait(fs, timeout=60).not_done
        assert sorted(f.result() for f in cf.as_completed(fs, timeout=60)) == sorted(
            i * i for i in range(100))
        first, _rest = cf.wait([ex.submit(tasks.square, 2)], timeout=60,
                               return_when=cf.FIRST_COMPLETED)
        assert len(first) == 1


def test_values_keep_their_type_and_bits_end_to_end(ex):
    """Arguments and results in the small format, and the ones just outside it (pickle),
    come back as the same type and value: bool is not int, -0.0 and NaN keep their bits."""
    import math
    import struct

    vals = [None, True, False, 0, -1, 2**63 - 1, -(2**63), 2**63, -(2**63) - 1, 2**100,
            0.0, -0.0, 1.5, float("inf"), float("nan"), "", "é€😀", "x" * 255, "x" * 256,
            "\udc80", b"", b"\x00\xff" * 40, b"y" * 300, (1, 2), [3], {"k": 4}]
    fs = [ex.submit(tasks.identity, v) for v in vals]
    multi = ex.submit(tasks.kwargs_of, *vals[:12])
    for v, f in zip(vals, fs, strict=True):
        got = f.result(30)
        assert type(got) is type(v), (v, got)
        if type(v) is float:
            assert struct.pack("<d", got) == struct.pack("<d", v) or (
                math.isnan(got) and math.isnan(v))
        else:
            assert got == v
    args, kw = multi.result(30)
    assert kw == {} and [type(a) for a in args] == [type(v) for v in vals[:12]]


def test_a_corrupt_free_ring_fails_the_submit_and_leaves_no_future_behind(ex):
    """A free-ring cell naming no record (shared memory overwritten) fails that submit with
    an error; the future it had registered must not stay behind for the result thread."""
    assert ex.submit(tasks.square, 2).result(30) == 4  # known: the native path takes it
    a = ex._pool.arena
    idxs = []
    while (i := a.rec_free.pop()) >= 0:
        idxs.append(i)
    before = set(ex._pool.futures)
    try:
        assert a.rec_free.push(a.nrecords + 5)  # (the ring holds one cell per record)
        for i in idxs[:-1]:
            assert a.rec_free.push(i)
        with pytest.raises((IndexError, ValueError)):
            ex.submit(tasks.square, 3)
        assert set(ex._pool.futures) == before
    finally:
        for fid in set(ex._pool.futures) - before:  # (a failure here: or shutdown would hang)
            ex._pool.futures.pop(fid)
        while a.rec_free.pop() >= 0:
            pass
        for i in idxs:
            a.rec_free.push(i)
    assert ex.submit(tasks.square, 4).result(30) == 16


def _ready_completions(e) -> int:
    return sum(len(c) for c in e._pool.completions)


def _until(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


def _one_worker(mode: str) -> stealer.Executor:
    if mode == "native" and _cqueues is None:
        pytest.skip("native extension not built")
    with _py_hotpath(mode == "python"):
        return stealer.Executor(1)  # one worker, one ring: completions in submission order


@pytest.mark.parametrize("mode", ["native", "python"])
def test_a_waiting_thread_settles_the_silent_head_of_the_rings_and_leaves_the_rest(mode):
    """_Pool.help (HotPath.help_complete): with the result thread held inside a done
    callback, a thread that waits settles, itself, the finished tasks at the head of the
    completion ring whose futures nobody else waits on and whose results are small; it
    stops at the first other completion (a callback, an error, a pickled or a large
    result), which the result thread takes in ring order once free, running the callback
    there; nothing is lost, and the wait made no condition for a future it settled."""
    with _one_worker(mode) as e:
        pool = e._pool
        hold, blocker = hold_result_thread(e)
        try:
            silent = [e.submit(tasks.square, i) for i in range(200)]
            _until(lambda: _ready_completions(e) == 200, "the worker did not finish")
            assert not any(f.done() for f in silent)  # the result thread is held
            _done, not_done = cf.wait(silent, timeout=30)  # settled by this thread
            assert not not_done
            assert [f.result(0) for f in silent] == [i * i for i in range(200)]
            assert all(f._st_cond is None for f in silent)
            assert _ready_completions(e) == 0

            cb_threads: list[str] = []
            with_cb = e.submit(tasks.square, 9)
            with_cb.add_done_callback(
                lambda f: cb_threads.append(threading.current_thread().name))
            failing = e.submit(tasks.raise_value_error, "late")
            pickled = e.submit(tasks.identity, (1, "two"))
            large = e.submit(tasks.make_bytes, 5000)
            tail = [e.submit(tasks.square, i) for i in range(20)]
            _until(lambda: _ready_completions(e) == 24, "the worker did not finish")
            pool.help()  # the head needs its callback: nothing is taken
            assert _ready_completions(e) == 24
            assert not any(f.done() for f in [with_cb, failing, pickled, large, *tail])
        finally:
            hold.set()
        assert with_cb.result(30) == 81
        with pytest.raises(ValueError, match="late"):
            failing.result(30)
        assert pickled.result(30) == (1, "two")
        assert len(large.result(30)) == 5000 // 256 * 256
        assert [f.result(30) for f in tail] == [i * i for i in range(20)]
        _until(lambda: cb_threads, "the callback never ran")
        assert cb_threads[0].startswith("stealer-results")  # not the waiting thread
        assert blocker.result(30) == 4
        assert pool.stray == 0


@pytest.mark.parametrize("mode", ["native", "python"])
def test_a_corrupt_handle_at_a_ring_head_is_left_to_the_result_thread(mode, capfd):
    """help() stops at a completion whose handle names no record: the waiting thread gets
    no IndexError from a corrupted ring; the result thread then reports the corruption and
    breaks the executor (its usual answer), so the waiter gets BrokenExecutor, not a hang."""
    with _one_worker(mode) as e:
        pool = e._pool
        hold, _blocker = hold_result_thread(e)
        try:
            assert pool.completions[0].push((1 << 32) | pool.layout.records)  # out of range
            late = e.submit(tasks.square, 3)
            _until(lambda: _ready_completions(e) == 2, "the worker did not finish")
            pool.help()  # no exception here; nothing taken behind the bad head
            assert _ready_completions(e) == 2 and not late.done()
        finally:
            hold.set()
        with pytest.raises(stealer.BrokenExecutor):
            late.result(30)
    assert "internal error" in capfd.readouterr().err
