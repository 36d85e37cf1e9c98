"""How the result thread is scheduled (stealer.shared.idle.ResultPolicy): SCHED_BATCH while a
backlog of tasks or agent calls waits, the normal class otherwise; a worker wakes it at once
from PARKED, and from PARKED_BATCH only before it idles (an owed wake: one per batch, the
thread polls meanwhile), natively and in the Python reference; the hand-off, where a worker
moves the parked thread onto its own CPU before waking it and the thread takes its own CPUs
back once awake (and before it starts a process)."""

from __future__ import annotations

import concurrent.futures as cf
import mmap
import os
import threading
import time

import pytest
import tasks
from rig import _py_hotpath

import stealer
from stealer.client import pool as pool_mod
from stealer.shared import idle as idle_mod
from stealer.shared.idle import NOTIFIED, PARKED, PARKED_BATCH, RUNNING, Idle, ResultPolicy
from stealer.shared.shm import H_CLIENT_MOVED, H_CLIENT_PARK, H_CLIENT_TID
from tests import agents_lib as L

try:
    from stealer import _cqueues
except ImportError:  # pragma: no cover - depends on the build
    _cqueues = None

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling classes")


def _policy(tid: int = 0) -> int:
    """Thread ``tid``'s scheduling policy, without the reset-on-fork flag (which the short
    slice of the normal mode sets: stealer.shared.idle.set_slice)."""
    return os.sched_getscheduler(tid) & ~getattr(os, "SCHED_RESET_ON_FORK", 0)


def _in_thread(fn, setup=None):
    """``fn()`` in a fresh thread (a policy change stays with that thread); its result."""
    out: list = []

    def body():
        if setup is not None:
            setup()
        out.append(fn())

    t = threading.Thread(target=body)
    t.start()
    t.join(30)
    assert out, "the thread failed (see its traceback above)"
    return out[0]


def test_the_policy_enters_at_the_backlog_and_leaves_below_the_gap():
    def run():
        p = ResultPolicy(2)  # enter at 16 outstanding, leave below 8
        seen = []
        for n in (0, 15, 16, 9, 8, 7, 15, 16, 0):
            seen.append((p.update(n), _policy()))
        return seen

    bat, oth = os.SCHED_BATCH, os.SCHED_OTHER
    assert _in_thread(run) == [(False, oth), (False, oth), (True, bat), (True, bat), (True, bat),
                               (False, oth), (False, oth), (True, bat), (False, oth)]


def _slice_ns(tid: int = 0) -> int:
    """Thread ``tid``'s time slice as the kernel reports it (sched_getattr's sched_runtime;
    0 where the kernel keeps none for normal threads)."""
    import ctypes
    import platform
    import struct

    nr = {"x86_64": 315, "aarch64": 275}.get(platform.machine())
    if nr is None:
        pytest.skip("sched_getattr's number is not known for this machine")
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(56)
    assert libc.syscall(nr, tid, buf, 56, 0) == 0, os.strerror(ctypes.get_errno())
    return struct.unpack_from("=IIQiIQ", buf.raw)[5]


def _slices_kept() -> bool:
    """Whether this kernel keeps a normal thread's own slice (EEVDF, Linux 6.6+)."""
    def probe():
        return idle_mod.set_slice(200_000) and _slice_ns() == 200_000

    return _in_thread(probe)


def test_the_result_thread_asks_for_a_short_slice_out_of_throughput_mode():
    if not _slices_kept():
        pytest.skip("this kernel keeps no slice per normal thread (EEVDF, Linux 6.6+)")

    def run():
        default = _slice_ns()
        p = ResultPolicy(1)
        seen = [_slice_ns()]
        p.update(1000)  # throughput mode: SCHED_BATCH, the default slice
        seen.append(_slice_ns())
        p.update(0)  # normal again: the short slice again
        seen.append(_slice_ns())
        seen.append(_in_thread(_slice_ns))  # a thread it starts (a done callback's)
        return default, seen

    default, seen = _in_thread(run)
    short = idle_mod.RESULT_SLICE_NS
    assert default != short
    assert seen == [short, default, short, default]  # the short slice is not inherited


def test_an_executors_result_thread_runs_with_the_short_slice():
    if not _slices_kept():
        pytest.skip("this kernel keeps no slice per normal thread (EEVDF, Linux 6.6+)")
    with stealer.Executor(1) as ex:
        assert ex.submit(tasks.add, 1, 2).result(30) == 3
        t = ex._pool.thread
        assert t is not None and t.native_id is not None
        assert _slice_ns(t.native_id) == idle_mod.RESULT_SLICE_NS
    assert _slice_ns() != idle_mod.RESULT_SLICE_NS  # the caller's own thread is untouched


def test_a_thread_started_in_another_class_is_left_alone():
    def run():
        p = ResultPolicy(1)
        return p.ok, p.update(1000), _policy()

    def idle_class():
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))

    assert _in_thread(run, idle_class) == (False, False, os.SCHED_IDLE)


def test_a_refused_change_turns_the_policy_off(monkeypatch):
    def refuse(*_a):
        raise PermissionError(1, "Operation not permitted")

    def run():
        p = ResultPolicy(1)
        monkeypatch.setattr(idle_mod.os, "sched_setscheduler", refuse)
        return p.update(1000), p.ok, p.update(1000), _policy()

    assert _in_thread(run) == (False, False, False, os.SCHED_OTHER)


def test_wake_client_wakes_a_normal_park_and_owes_a_batch_one(impl, monkeypatch):
    from stealer.shared.shm import Layout

    layout = Layout(1, records=2, block_classes=((64, 1),), fn_entries=1, fn_data=64)
    idle = Idle(impl.Region(mmap.mmap(-1, layout.total)), layout)
    yields = []
    monkeypatch.setattr(idle_mod.os, "sched_yield", lambda: yields.append(1))
    r = idle.r
    for before, after, yielded, owed in ((PARKED, NOTIFIED, 1, False),
                                         (PARKED_BATCH, PARKED_BATCH, 0, True),
                                         (RUNNING, RUNNING, 0, False),
                                         (NOTIFIED, NOTIFIED, 0, False)):
        r.store32(H_CLIENT_PARK, before)
        yields.clear()
        idle.owed = False
        idle.wake_client()
        assert (r.load32(H_CLIENT_PARK), len(yields), idle.owed) == (after, yielded, owed), before
    # the worker pays what it owes before it idles: either park is woken, no yield
    for before, after in ((PARKED_BATCH, NOTIFIED), (PARKED, NOTIFIED), (RUNNING, RUNNING)):
        r.store32(H_CLIENT_PARK, before)
        yields.clear()
        idle.owed = True
        idle.flush_client()
        assert (r.load32(H_CLIENT_PARK), len(yields), idle.owed) == (after, 0, False), before


def _wait_until(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.002)


def _one_worker_polling_never(mode: str, monkeypatch) -> stealer.Executor:
    """A one-worker executor whose result thread never polls: a park ends only by a wake,
    so a worker that did not pay its owed wake before idling would leave results
    unresolved for a minute (and the tests' result(timeout=20) fail)."""
    if mode == "native" and _cqueues is None:
        pytest.skip("native extension not built")
    monkeypatch.setattr(pool_mod, "MONITOR_INTERVAL", 60.0)
    monkeypatch.setattr(pool_mod, "BATCH_POLL", 60.0)
    with _py_hotpath(mode == "python"):
        return stealer.Executor(1)


def _settled_by_the_result_thread(p, futs, expect: list) -> None:
    """``futs`` (with done callbacks, which only the result thread runs) resolve to
    ``expect`` after the thread parked PARKED_BATCH, and it parks normally afterwards."""
    called: list = []
    for f in futs:
        f.add_done_callback(lambda f: called.append(f.result()))
    _wait_until(lambda: p.region.load32(H_CLIENT_PARK) == PARKED_BATCH,
                "the result thread parks in throughput mode")
    assert [f.result(timeout=20) for f in futs] == expect
    _wait_until(lambda: p.region.load32(H_CLIENT_PARK) == PARKED,
                "the result thread parks normally again")
    assert sorted(called) == sorted(expect)


@pytest.mark.parametrize("mode", ["native", "python"])
def test_the_result_thread_runs_batch_under_a_backlog_and_is_woken_there(mode, monkeypatch):
    with _one_worker_polling_never(mode, monkeypatch) as e:
        p = e._pool
        tid = p.thread.native_id
        assert _policy(tid) == os.SCHED_OTHER
        # The result thread decides when it parks: after the gate's completion it parks
        # with 20 tasks outstanding (>= 8 per worker), each of them 50 ms long.
        gate = e.submit(tasks.sleep_then, 0.3, "gate")
        rest = [e.submit(tasks.sleep_then, 0.05, i) for i in range(20)]
        _wait_until(lambda: _policy(tid) == os.SCHED_BATCH, "SCHED_BATCH")
        _settled_by_the_result_thread(p, rest, list(range(20)))
        assert gate.result(timeout=20) == "gate"
        assert _policy(tid) == os.SCHED_OTHER


@pytest.mark.parametrize("mode", ["native", "python"])
def test_agent_calls_use_throughput_mode_and_every_reply_arrives(mode, monkeypatch):
    """Replies to a backlog of calls are announced in batches too (issue 19: a context
    switch per reply made a client stepping agents in lockstep barely faster than one
    process): the thread parks PARKED_BATCH with the calls outstanding, and with its poll
    disabled every reply still arrives, through the worker's wake before it idles."""
    with _one_worker_polling_never(mode, monkeypatch) as e:
        p = e._pool
        ref = e.spawn_agent(L.Counter, 0, 0.02)  # each call 20 ms of work
        assert ref.call("add", 0).result(timeout=20) == 0
        futs = e.call_all([ref] * 20, "add", [(1,)] * 20)
        _settled_by_the_result_thread(p, futs, list(range(1, 21)))
        ref.stop()


# -- hand-off: a waking worker moves the result thread onto its own CPU --------------


def _two_cpus() -> list[int]:
    mask = sorted(os.sched_getaffinity(0))
    if len(mask) < 2:
        pytest.skip("needs two CPUs")
    return mask


@pytest.mark.skipif(_cqueues is None, reason="native extension not built")
def test_a_waking_worker_hands_its_cpu_to_the_result_thread(monkeypatch):
    cpu = _two_cpus()[-1]
    seen: list[set[int]] = []
    restore = ResultPolicy.restore

    def spy(self):  # runs in the result thread, before it takes its CPUs back
        seen.append(os.sched_getaffinity(0))
        restore(self)

    monkeypatch.setattr(ResultPolicy, "restore", spy)
    with stealer.Executor(1, cpus=[cpu]) as e:
        p = e._pool
        tid = p.thread.native_id
        own = os.sched_getaffinity(tid)
        # published by the result thread once it runs (ResultPolicy): the executor does
        # not wait for that, so a look right after it starts may still read 0
        _wait_until(lambda: p.region.load32(H_CLIENT_TID) == tid, "it publishes its id")
        for _ in range(3):  # each: the result thread parked (normal), the worker wakes it
            _wait_until(lambda: p.region.load32(H_CLIENT_PARK) == PARKED, "it parks")
            # (cf.wait, not result(): a thread in result() settles it itself, woken on its
            # own park word, and the result thread sleeps on)
            f = e.submit(tasks.sleep_then, 0.05, 7)
            assert not cf.wait([f], timeout=20).not_done and f.result(0) == 7
        assert {cpu} in seen  # it ran on the worker's CPU when it woke
        _wait_until(lambda: p.region.load32(H_CLIENT_MOVED) == 0, "it took its CPUs back")
        assert os.sched_getaffinity(tid) == own


def test_the_thread_id_is_withdrawn_when_the_result_thread_ends():
    e = stealer.Executor(1)
    p = e._pool
    region = p.region
    _wait_until(lambda: region.load32(H_CLIENT_TID) == p.thread.native_id, "it publishes")
    e.shutdown(wait=True)
    p.thread.join(30)
    assert region.load32(H_CLIENT_TID) == 0


def test_a_thread_whose_cpus_miss_a_workers_is_never_moved(impl):
    """A result thread confined (by its user) to CPUs without a worker's: its thread id
    is not published, so no worker moves it; with the worker's CPU allowed, it is."""
    from stealer.shared.shm import Layout

    cpu = _two_cpus()[-1]
    layout = Layout(1, records=2, block_classes=((64, 1),), fn_entries=1, fn_data=64)
    r = impl.Region(mmap.mmap(-1, layout.total))

    def confined():
        os.sched_setaffinity(0, {0})
        return ResultPolicy(1, r, [cpu]).mask, r.load32(H_CLIENT_TID)

    def free():
        p = ResultPolicy(1, r, [cpu, None])
        published = p.mask is not None and r.load32(H_CLIENT_TID) == threading.get_native_id()
        p.close()
        return published, r.load32(H_CLIENT_TID)

    assert _in_thread(confined) == (None, 0)
    assert _in_thread(free) == (True, 0)


@pytest.mark.skipif(_cqueues is None, reason="native extension not built")
def test_a_replacement_worker_gets_the_result_threads_own_cpus():
    """Processes inherit the CPUs of the thread that starts them: a replacement started by
    a result thread still on a worker's CPU would be stuck there. Narrowed by hand here
    (as a worker does), with the flag already cleared: start_worker restores it."""
    mask = _two_cpus()
    with stealer.Executor(1, cpus=None) as e:
        p = e._pool
        tid = p.thread.native_id
        old = p.procs[0].pid
        os.sched_setaffinity(tid, {mask[0]})
        os.kill(old, 9)
        _wait_until(lambda: p.procs[0] is not None and p.procs[0].pid != old,
                    "the worker is replaced")
        assert e.submit(tasks.square, 3).result(timeout=30) == 9
        assert os.sched_getaffinity(p.procs[0].pid) == set(mask)
        assert os.sched_getaffinity(tid) == set(mask)
