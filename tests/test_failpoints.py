"""Every failpoint armed in turn: whatever breaks where, every future resolves exactly once.

A failpoint (stealer/shared/failpoints.py) is armed through the environment the
workers inherit, to fire once in the whole run (``!once``: the first process
to create its marker file in STEALER_FAILPOINTS_DIR) on its N-th hit.  Each
case runs a mixed load (plain tasks, a result too large to be inline, and
fork-join trees) and checks every value, that the failpoint really fired,
and that the executor is still usable afterwards.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import tasks

import stealer
from stealer.shared import failpoints

WORKER_POINTS = [p for p in failpoints.POINTS if p.startswith("worker.")]
# Points that only fork-join work reaches, and how often they are hit there.
FORKJOIN_POINTS = {"worker.after_spawn", "worker.in_join", "worker.after_resume",
                   "worker.in_collect", "worker.join_after_pop", "worker.join_after_nested",
                   "worker.ping_after_set", "worker.ping_before_clear",
                   "worker.ping_after_clear"}
AFTER_BODY = ["worker.after_body", "worker.after_store", "worker.after_finish",
              "worker.after_publish"]


def _run_mixed_load(e: stealer.Executor) -> None:
    plain = [e.submit(tasks.square, i) for i in range(300)]
    big = [e.submit(tasks.make_bytes, 5000 + i) for i in range(5)]  # results in blocks
    trees = [e.submit(tasks.fib, 16, 10) for _ in range(3)]
    blocking = [e.submit(tasks.fib_blocking, 15, 10) for _ in range(2)]  # stealer.join
    assert [f.result(timeout=60) for f in plain] == [i * i for i in range(300)]
    assert [f.result(timeout=60) for f in big] == [tasks.make_bytes(5000 + i) for i in range(5)]
    assert [f.result(timeout=60) for f in trees] == [tasks.fib_seq(16)] * 3
    assert [f.result(timeout=60) for f in blocking] == [tasks.fib_seq(15)] * 2


def _crashes_seen(e: stealer.Executor, want: int = 1, timeout: float = 10.0) -> int:
    """The client's crash count once it has noticed the death (it may lag the results)."""
    deadline = time.monotonic() + timeout
    while e.stats().client["crashes"] < want and time.monotonic() < deadline:
        time.sleep(0.01)
    return e.stats().client["crashes"]


def _arm(monkeypatch, tmp_path, spec: str) -> None:
    monkeypatch.setenv("STEALER_FAILPOINTS", spec)
    monkeypatch.setenv("STEALER_FAILPOINTS_DIR", str(tmp_path))


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
@pytest.mark.parametrize("point", WORKER_POINTS)
def test_worker_killed_at_failpoint(monkeypatch, tmp_path, method, point):
    nth = 1 if point in FORKJOIN_POINTS else 7
    _arm(monkeypatch, tmp_path, f"{point}=kill@{nth}!once")
    with stealer.Executor(2, mp_context=mp.get_context(method)) as e:
        _run_mixed_load(e)
        assert os.path.exists(tmp_path / point), f"{point} was never reached"
        assert _crashes_seen(e) == 1
        assert e.stats().client["stray_completions"] == 0
        _run_mixed_load(e)  # still usable


@pytest.mark.parametrize("point", ["worker.ping_after_set", "worker.ping_before_clear",
                                   "worker.ping_after_clear"])
def test_ping_window_across_workers(monkeypatch, tmp_path, point):
    """The first ping comes from the worker that stole the short child, for a frame on
    the other worker.  Killed after setting the frame's ping bit (before the push), the
    recoverer pings again (else the long child finds the bit set, sends nothing, and the
    frame waits for ever); the owner killed around its clear: the frame is re-run."""
    _arm(monkeypatch, tmp_path, f"{point}=kill@1!once")
    with stealer.Executor(2, retries=5) as e:
        assert e.wait_ready(30)
        pids = e.submit(tasks.uneven_kids, 0.3, 1.0).result(timeout=60)
        assert os.path.exists(tmp_path / point), f"{point} was never reached"
        assert len(pids) == 2
        if point == "worker.ping_after_set":
            assert pids[0] != pids[1], "both children ran on one worker: not the case tested"
        assert _crashes_seen(e) == 1
        assert e.submit(tasks.uneven_kids, 0.01, 0.02).result(timeout=60)


@pytest.mark.parametrize("action", ["raise", "interrupt", "exit"])
@pytest.mark.parametrize("point", AFTER_BODY)
def test_exception_after_the_task_body(monkeypatch, tmp_path, action, point):
    """An exception (or exit) in the worker between the body and the publication:
    the worker dies, its records are recovered, nothing hangs or is lost."""
    _arm(monkeypatch, tmp_path, f"{point}={action}@5!once")
    with stealer.Executor(2) as e:
        _run_mixed_load(e)
        assert os.path.exists(tmp_path / point)
        assert e.stats().client["stray_completions"] == 0


def test_retries_zero_fails_instead_of_rerunning(monkeypatch, tmp_path):
    _arm(monkeypatch, tmp_path, "worker.after_start=kill@1!once")
    with stealer.Executor(1, retries=0) as e:
        f = e.submit(tasks.square, 3)
        with pytest.raises(stealer.WorkerCrashedError, match=r"SIGKILL.*ran 1 time"):
            f.result(timeout=60)
        assert e.submit(tasks.square, 4).result(timeout=60) == 16


def test_per_call_retries_option(monkeypatch, tmp_path):
    _arm(monkeypatch, tmp_path, "worker.after_start=kill@1!once")
    with stealer.Executor(1, retries=5) as e:
        with pytest.raises(stealer.WorkerCrashedError):
            e.options(retries=0).submit(tasks.square, 3).result(timeout=60)
        assert e.submit(tasks.square, 4).result(timeout=60) == 16
    with pytest.raises(ValueError, match="retries"):
        stealer.Executor(1, retries=-1)


@pytest.fixture
def client_failpoint():
    yield failpoints.configure
    failpoints.configure(None)


@pytest.mark.parametrize("point", ["client.after_drain", "client.recovery"])
def test_client_error_during_recovery_breaks_cleanly(client_failpoint, point):
    with stealer.Executor(2) as e:
        assert e.wait_ready(30)
        waiting = [e.submit(tasks.sleep_then, 0.3, i) for i in range(4)]
        client_failpoint(f"{point}=raise")
        crash = e.submit(tasks.kill_self, 9)
        for f in [crash, *waiting]:
            try:
                f.result(timeout=30)
            except stealer.BrokenExecutor as exc:
                assert "internal error" in str(exc) or isinstance(exc, stealer.WorkerCrashedError)
        with pytest.raises(stealer.BrokenExecutor, match="internal error"):
            e.submit(tasks.square, 2)


def test_result_thread_error_fails_backlog_too(client_failpoint):
    """records=2: a third task waits in the client's backlog; a bug in the result thread
    must fail all three with a clear error, never leave them pending."""
    with stealer.Executor(1, records=2) as e:
        assert e.wait_ready(30)
        fs = [e.submit(tasks.sleep_then, 0.2, i) for i in range(3)]
        client_failpoint("client.result_thread=raise")
        e._pool.wake()
        for f in fs:
            with pytest.raises(stealer.BrokenExecutor, match="internal error"):
                f.result(timeout=30)
        with pytest.raises(stealer.BrokenExecutor):
            e.submit(tasks.square, 1)


def test_unknown_failpoint_is_an_error():
    with pytest.raises(ValueError, match="unknown failpoint"):
        failpoints.configure("worker.nowhere=kill")
    failpoints.configure(None)
    assert not failpoints.ON
