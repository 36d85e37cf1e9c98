"""The task lifecycle around the queues: what happens after the body, on signals, on kills."""

from __future__ import annotations

import os
import signal
import time

import pytest
import tasks
from probes import records_in_use

import stealer
import stealer.shared.queues
from stealer.shared._layout import S_RUNNING
from stealer.shared.recovery import Recovery
from stealer.shared.shm import W_CURRENT


def _running_worker(e: stealer.Executor, f, timeout: float = 10.0) -> int:
    """The worker whose current word names ``f``'s task."""
    pool = e._pool
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for k, p in enumerate(pool.procs):
            cur = pool.region.load64(pool.layout.worker(k) + W_CURRENT)
            if p is not None and cur and cur - 1 == f._st_handle:
                return k
        time.sleep(0.005)
    raise AssertionError("no worker is running a task")


def test_systemexit_while_pickling_the_result_fails_only_that_task():
    with stealer.Executor(1) as e:
        pids = e.worker_pids()
        with pytest.raises(stealer.SerializationError, match="SystemExit"):
            e.submit(tasks.return_exit_on_pickle).result(timeout=30)
        assert e.submit(tasks.square, 9).result(timeout=30) == 81
        assert e.worker_pids() == pids  # the worker survived it
        assert e.stats().client["crashes"] == 0


def test_keyboard_interrupt_in_the_body_is_the_tasks_error():
    with stealer.Executor(1) as e:
        with pytest.raises(KeyboardInterrupt):
            e.submit(tasks.raise_keyboard_interrupt).result(timeout=30)
        assert e.submit(tasks.square, 3).result(timeout=30) == 9


def test_sigint_reaches_only_task_bodies(tmp_path):
    """Ctrl-C hits every process of the terminal's group: an idle worker ignores it, a
    running task fails with KeyboardInterrupt (as in ProcessPoolExecutor), no worker dies."""
    with stealer.Executor(2) as e:
        assert e.wait_ready(30)
        pids = e.worker_pids()
        for pid in pids:  # idle workers
            os.kill(pid, signal.SIGINT)
        time.sleep(0.2)
        assert [f.result(timeout=30) for f in [e.submit(tasks.square, i) for i in range(50)]] \
            == [i * i for i in range(50)]
        marker = tmp_path / "in-body"
        f = e.submit(tasks.sleep_in_body, 20.0, str(marker))
        k = _running_worker(e, f)
        deadline = time.monotonic() + 10
        while not marker.exists() and time.monotonic() < deadline:  # in the body, not before
            time.sleep(0.005)
        os.kill(pids[k], signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            f.result(timeout=30)
        assert e.worker_pids() == pids
        assert e.stats().client["crashes"] == 0


@pytest.mark.kills_workers
def test_kill_mid_task_reruns_it_with_the_right_value():
    with stealer.Executor(2) as e:  # default retries=3
        assert e.wait_ready(30)
        f = e.submit(tasks.sleep_then, 1.0, "done")
        k = _running_worker(e, f)
        os.kill(e.worker_pids()[k], signal.SIGKILL)
        assert f.result(timeout=30) == "done"
        assert records_in_use(e) == 0


def test_poison_pill_fails_after_retries_and_names_the_cause():
    with stealer.Executor(2, retries=2) as e:
        with pytest.raises(stealer.WorkerCrashedError, match=r"SIGKILL.*ran 3 times.*retries=2"):
            e.submit(tasks.kill_self, signal.SIGKILL).result(timeout=60)
        assert e.submit(tasks.square, 2).result(timeout=30) == 4
        assert records_in_use(e) == 0


@pytest.mark.kills_workers
def test_owner_of_a_suspended_frame_killed_reruns_the_task():
    """The frame (a suspended generator) lives only in its worker: killing that worker
    while the children run must re-run the parent (retries) and free every child record."""
    with stealer.Executor(2) as e:
        assert e.wait_ready(30)
        f = e.submit(tasks.spawn_and_wait, 4, 0.3)
        pool = e._pool
        rec = Recovery(pool.arena, [], None, 0)
        deadline = time.monotonic() + 10
        owner = None
        while owner is None and time.monotonic() < deadline:
            for k in range(2):  # the parent is RUNNING|k (suspended) while its children run
                for h in rec.held_by(k + 1, (S_RUNNING,)):
                    if rec.children(h):
                        owner = k
            time.sleep(0.005)
        assert owner is not None
        os.kill(e.worker_pids()[owner], signal.SIGKILL)
        assert f.result(timeout=60) == sum(range(4))
        assert records_in_use(e) == 0


@pytest.mark.kills_workers
def test_owner_killed_without_retries_fails_with_a_clear_message():
    with stealer.Executor(2, retries=0) as e:
        assert e.wait_ready(30)
        f = e.submit(tasks.spawn_and_wait, 2, 0.5)
        time.sleep(0.2)
        pool = e._pool
        rec = Recovery(pool.arena, [], None, 0)
        owners = [k for k in range(2) if any(rec.children(h) for h in
                                              rec.held_by(k + 1, (S_RUNNING,)))]
        assert owners
        os.kill(e.worker_pids()[owners[0]], signal.SIGKILL)
        with pytest.raises(stealer.WorkerCrashedError, match=f"worker {owners[0]}"):
            f.result(timeout=60)
        assert records_in_use(e) == 0


def test_many_crashes_in_fork_join_leak_no_records():
    """Defect 9: a crashed fork-join task used to leak its children's records; with a
    small table the executor then hung.  Here: many crashing trees on 16 records."""
    with stealer.Executor(2, records=16, retries=0) as e:
        for _ in range(6):
            f = e.submit(tasks.crash_tree, 2)  # its left-most leaf kills its worker
            with pytest.raises(stealer.WorkerCrashedError):
                f.result(timeout=60)
        assert e.submit(tasks.fib, 14, 8).result(timeout=60) == tasks.fib_seq(14)
        assert records_in_use(e) == 0


def test_fork_start_method_replaces_from_a_forkserver():
    """Forking from the (multi-threaded) result thread could copy a held lock into the
    child: with mp_context 'fork', replacements come from a forkserver."""
    import multiprocessing as mp

    with stealer.Executor(1, mp_context=mp.get_context("fork"), retries=0) as e:
        assert e.wait_ready(30)
        first = e.worker_pids()[0]
        assert tasks_ppid(e) == os.getpid()  # forked by us
        with pytest.raises(stealer.WorkerCrashedError):
            e.submit(tasks.kill_self, signal.SIGKILL).result(timeout=30)
        assert e.submit(tasks.square, 5).result(timeout=30) == 25
        assert e.worker_pids()[0] != first
        if stealer.shared.queues.NATIVE:  # (the fallback's fork-context lock cannot travel)
            assert tasks_ppid(e) != os.getpid()  # a forkserver's child


def tasks_ppid(e: stealer.Executor) -> int:
    return e.submit(os.getppid).result(timeout=30)


def _die_holding(region) -> None:
    with region.lock:
        os.kill(os.getpid(), signal.SIGKILL)


def test_reference_queues_lock_names_a_dead_holder():
    """The pure-Python fallback is not kill-safe (one lock); it must at least know that a
    dead process holds its lock, so the executor fails clearly instead of hanging."""
    import mmap
    import multiprocessing as mp

    from stealer.shared import pyqueues as _pyqueues

    ctx = mp.get_context("fork")
    mm = mmap.mmap(-1, 4096)
    region = _pyqueues.Region(mm, ctx.Lock(), 64)
    p = ctx.Process(target=_die_holding, args=(region,))
    p.start()
    p.join(30)
    assert p.exitcode == -signal.SIGKILL
    assert region.lock.holder() == p.pid


def test_a_completion_for_no_pending_future_is_counted_as_stray():
    """What the chaos tests' "0 duplicated" rests on: the pool counts completions that
    find no pending future (a task completed twice, or delivered to the wrong id)."""
    import pickle

    with stealer.Executor(1) as e:
        assert e.submit(tasks.square, 2).result(timeout=30) == 4
        pool = e._pool
        a = pool.arena
        h = a.alloc()
        off = a.setup(h, stealer.client.executor.K_ROOT, 10**9, 0)  # a future id nobody holds
        a.put(off, pickle.dumps((None, (), None)), [])
        a.put_result(off, pickle.dumps("x"), [])
        assert pool.stray == 0
        pool.complete_one(h)
        assert pool.stray == 1
        assert e.stats().client["stray_completions"] == 1


@pytest.mark.kills_workers
def test_recoverer_killed_mid_recovery(monkeypatch, tmp_path):
    """A replacement worker takes over the frame its dead predecessor held (RECOVERING)
    and is killed before it re-runs it: the client must recover it again, not free it."""
    monkeypatch.setenv("STEALER_FAILPOINTS", "recovery.after_take_over=kill!once")
    monkeypatch.setenv("STEALER_FAILPOINTS_DIR", str(tmp_path))
    with stealer.Executor(2) as e:
        assert e.wait_ready(30)
        f = e.submit(tasks.spawn_and_wait, 4, 0.4)
        rec = Recovery(e._pool.arena, [], None, 0)
        deadline = time.monotonic() + 10
        owner = None
        while owner is None and time.monotonic() < deadline:
            for k in range(2):
                if any(rec.children(h) for h in rec.held_by(k + 1, (S_RUNNING,))):
                    owner = k
            time.sleep(0.005)
        assert owner is not None
        os.kill(e.worker_pids()[owner], signal.SIGKILL)
        assert f.result(timeout=60) == sum(range(4))
        assert (tmp_path / "recovery.after_take_over").exists()
        assert records_in_use(e) == 0
