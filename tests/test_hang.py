"""Frozen workers (stealer/client/hang.py): ``Executor(hang_timeout=...)``.

A worker stopped by SIGSTOP mid-task stands for every way a process can be alive and
make no progress (a debugger, a call stuck in C).  With ``hang_timeout`` the client
kills it and its task runs again elsewhere (or fails, retries used up, saying why);
without it nothing is killed.  A task that runs long but shorter than the timeout, or
tasks that together run longer, are never taken for a hang.  Every test resumes or
kills what it stopped (``stopped``), so no stopped process outlives it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from types import SimpleNamespace

import pytest
from hang_lib import first_run_stalls, parent_of_stalling_child, sleep_pid

import stealer
from stealer import top
from stealer.client.hang import Stalls, check_hang_timeout

LIMIT = 30.0  # seconds: only turns a hang of the test into a failure


# -- helpers ----------------------------------------------------------------------------
def until(predicate, what, limit=LIMIT):
    end = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > end:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


def runs(dirname):
    """Pids of the runs so far, in order."""
    names = sorted((n for n in os.listdir(dirname) if n.startswith("run.")),
                   key=lambda n: int(n.split(".")[2]))
    return [int(n.split(".")[1]) for n in names]


def proc_state(pid):
    """The state letter of /proc/PID/stat ('T': stopped), None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


@contextlib.contextmanager
def stopped(ex, tmp_path, **kw):
    """Submit first_run_stalls, SIGSTOP the worker running its first run; yields
    (future, pid).  Whatever happens, the process is resumed (if it still lives)."""
    d = tmp_path / "runs"
    d.mkdir()
    fut = ex.submit(first_run_stalls, str(d), "v", **kw)
    until(lambda: runs(d), "the task to start")
    pid = runs(d)[0]
    os.kill(pid, signal.SIGSTOP)
    try:
        until(lambda: proc_state(pid) in ("T", "t"), "the worker to stop", 5.0)
        yield fut, pid, d
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


# -- the argument -------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -1, 0.0, float("nan"), float("inf"), "5", True, [1]])
def test_hang_timeout_must_be_seconds_above_zero(bad):
    with pytest.raises(ValueError, match="hang_timeout must be a number of seconds > 0"):
        stealer.Executor(1, hang_timeout=bad)


def test_hang_timeout_accepts_numbers_and_none():
    assert check_hang_timeout(None) is None
    assert check_hang_timeout(2) == 2.0
    assert check_hang_timeout(0.25) == 0.25


# -- the bookkeeping ------------------------------------------------------------------------
def test_stalls_count_only_while_holding_work_without_progress():
    s = Stalls()
    assert s.see(0, "a", True, 10.0) == 0.0  # first look: from now on
    assert s.see(0, "a", True, 12.5) == 2.5  # same key, still holding
    assert s.frozen(0) == 2.5
    assert s.see(0, "b", True, 13.0) == 0.0  # progress: counted again from here
    assert s.see(0, "b", True, 14.0) == 1.0
    assert s.see(0, "b", False, 20.0) == 0.0  # holds nothing: not frozen, whatever the key
    assert s.see(0, "b", True, 21.0) == 0.0  # holding again: from now on
    assert s.see(1, "b", True, 30.0) == 0.0  # workers apart
    assert s.frozen(0) == 0.0
    assert s.frozen(7) == 0.0  # never looked at


def test_stalls_observe_fills_snapshots():
    def w(current, tasks, inbox=0, state="ready"):
        return SimpleNamespace(index=0, pid=5, current=current, counters={"tasks": tasks},
                               state=state, inbox_depth=inbox, frozen_s=0.0)

    s = Stalls()
    for now, snap, want in [(0.0, w(9, 1), 0.0), (2.0, w(9, 1), 2.0), (3.0, w(9, 2), 0.0),
                            (5.0, w(0, 2), 0.0), (6.0, w(0, 2, inbox=3), 0.0),
                            (8.0, w(0, 2, inbox=3), 2.0),
                            (9.0, w(0, 2, inbox=3, state="starting"), 0.0)]:
        s.observe([snap], now)
        assert snap.frozen_s == want, (now, snap)


# -- frozen workers ------------------------------------------------------------------------
def test_a_stopped_worker_is_killed_and_its_task_runs_elsewhere(tmp_path, capfd):
    with stealer.Executor(2, hang_timeout=2.0) as ex:
        assert ex.wait_ready(LIMIT)
        with stopped(ex, tmp_path) as (fut, pid, d):
            assert fut.result(timeout=LIMIT) == ("v", runs(d)[1])
            again = runs(d)[1]
            assert again != pid  # it ran again in another process
            until(lambda: proc_state(pid) is None, "the stopped worker to be killed")
            until(lambda: None not in ex.worker_pids() and pid not in ex.worker_pids(),
                  "a replacement worker")
            assert ex.stats().client["replacements"] == 1
            assert ex.submit(sleep_pid, 0).result(timeout=LIMIT) in ex.worker_pids()
    err = capfd.readouterr().err
    assert f"(pid {pid}) was killed by stealer" in err and "hang_timeout=2 s" in err


def test_a_stopped_child_task_runs_again_and_its_parent_completes(tmp_path):
    """The frozen worker holds a fork-join child (and maybe its parent's frame): the
    death path re-runs what it held, and the tree completes."""
    d = tmp_path / "runs"
    d.mkdir()
    with stealer.Executor(2, hang_timeout=2.0) as ex:
        assert ex.wait_ready(LIMIT)
        fut = ex.submit(parent_of_stalling_child, str(d))
        until(lambda: runs(d), "the child to start")
        pid = runs(d)[0]
        os.kill(pid, signal.SIGSTOP)
        try:
            value, again = fut.result(timeout=LIMIT)
            assert value == "child" and again != pid and again in runs(d)
            until(lambda: proc_state(pid) is None, "the stopped worker to be killed")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def test_retries_used_up_fail_the_future_saying_it_hung(tmp_path):
    with stealer.Executor(2, hang_timeout=2.0, retries=0) as ex:
        assert ex.wait_ready(LIMIT)
        with stopped(ex, tmp_path) as (fut, pid, d):
            exc = fut.exception(timeout=LIMIT)
            assert isinstance(exc, stealer.WorkerCrashedError)
            msg = str(exc)
            assert "hang_timeout=2 s" in msg and f"(pid {pid})" in msg
            assert "no progress" in msg and "retries=0" in msg
            assert runs(d) == [pid]  # not run again
            until(lambda: proc_state(pid) is None, "the stopped worker to be killed")
        assert ex.submit(sleep_pid, 0).result(timeout=LIMIT) in ex.worker_pids()


def test_without_hang_timeout_a_stopped_worker_is_left_alone(tmp_path, capsys):
    with stealer.Executor(2) as ex:
        assert ex.wait_ready(LIMIT)
        with stopped(ex, tmp_path, first_secs=0.5) as (fut, pid, d):
            k = ex.worker_pids().index(pid)
            # seen frozen (Executor.stats and stealer top), never killed
            until(lambda: ex.stats().workers[k].frozen_s > 2.0, "stats to see it frozen")
            frame = top.render(None, ex.stats())
            assert "frozen " in frame
            assert proc_state(pid) in ("T", "t") and not fut.done()
            assert pid in ex.worker_pids() and ex.stats().client["replacements"] == 0
            os.kill(pid, signal.SIGCONT)
            assert fut.result(timeout=LIMIT) == ("v", pid)  # it just goes on
        assert runs(d) == [pid]
        until(lambda: ex.stats().workers[k].frozen_s == 0.0, "it to be seen going again")


def test_stealer_top_attached_by_id_shows_a_frozen_worker(tmp_path, capsys):
    with stealer.Executor(2) as ex:
        assert ex.wait_ready(LIMIT)
        with stopped(ex, tmp_path, first_secs=0.2) as (fut, pid, _d):
            capsys.readouterr()
            assert top.main([ex.id, "--count", "3", "--interval", "0.7"]) == 0
            frames = capsys.readouterr().out.split("stealer top - ")[1:]
            assert len(frames) == 3
            row = [line for line in frames[2].splitlines() if f" {pid} " in line]
            assert row and re.search(r"frozen \d+s", row[0]), frames[2]
            assert "frozen" not in frames[0]  # one frame sees no history
        assert fut.result(timeout=LIMIT)[1] == pid


def test_tasks_shorter_than_hang_timeout_are_never_killed():
    """One worker runs 1 s tasks back to back under hang_timeout=2: each is shorter, all
    together are longer; the worker is never killed."""
    with stealer.Executor(1, hang_timeout=2.0, retries=0) as ex:
        assert ex.wait_ready(LIMIT)
        pid = ex.worker_pids()[0]
        fs = [ex.submit(sleep_pid, 1.0) for _ in range(3)]
        assert [f.result(timeout=LIMIT) for f in fs] == [pid] * 3
        assert ex.worker_pids() == [pid]
        assert ex.stats().client["crashes"] == 0


def test_a_stopped_idle_worker_is_frozen_only_once_work_waits_for_it():
    """Idle and stopped, a worker holds nothing: never killed.  A ping waiting in its
    inbox is work it holds: killed once that waits hang_timeout.  (The ping names no
    record, so whoever takes it drops it: on_ping ignores an index past the records.)"""
    with stealer.Executor(2, hang_timeout=1.0) as ex:
        assert ex.wait_ready(LIMIT)
        pool = ex._pool
        bogus = pool.arena.nrecords + 5
        live = ex.worker_pids()[1]
        assert pool.inboxes[1].push(bogus)  # a worker that goes on takes it
        pool.idle.notify_worker(1)
        until(lambda: len(pool.inboxes[1]) == 0, "the live worker to take its ping")
        pid = ex.worker_pids()[0]
        os.kill(pid, signal.SIGSTOP)
        try:
            until(lambda: proc_state(pid) in ("T", "t"), "the worker to stop", 5.0)
            time.sleep(2.5)  # idle: held nothing for longer than hang_timeout
            assert proc_state(pid) in ("T", "t") and ex.worker_pids()[0] == pid
            assert pool.inboxes[0].push(bogus)
            pool.idle.notify_worker(0)
            until(lambda: proc_state(pid) is None, "the frozen worker to be killed")
            until(lambda: None not in ex.worker_pids(), "a replacement worker")
            until(lambda: len(pool.inboxes[0]) == 0, "the replacement to take the ping")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        assert ex.worker_pids()[1] == live
        assert ex.stats().client["replacements"] == 1
