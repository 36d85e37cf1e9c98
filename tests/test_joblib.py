"""The joblib backend (stealer/joblib.py), used the way joblib's and scikit-learn's users use it.

One reusable executor serves the whole module (that reuse is under test); the module
fixture shuts it down and checks that no worker process or result thread is left.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import traceback

import pytest

joblib = pytest.importorskip("joblib")

import tasks  # noqa: E402
from joblib import Parallel, delayed, parallel_config  # noqa: E402
from joblib.externals.loky.process_executor import (  # noqa: E402
    TerminatedWorkerError as LokyTerminatedWorkerError,
)

import stealer  # noqa: E402
import stealer.joblib as sj  # noqa: E402
from stealer.errors import RemoteTraceback  # noqa: E402

psutil = pytest.importorskip("psutil")


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def helper(cmd: str) -> bool:
    """multiprocessing's own helpers (resource tracker, forkserver), started once per process."""
    return "resource_tracker" in cmd or "forkserver" in cmd


@pytest.fixture(scope="module", autouse=True)
def backend_executor():
    before_threads = set(threading.enumerate())
    before = {p for p in children() if not helper(cmdline(p))}
    yield
    sj.shutdown()
    assert sj.get_executor() is None
    left = {p for p in children() if not helper(cmdline(p))} - before
    assert not left, f"worker processes left behind: {left}"
    deadline = time.monotonic() + 10
    while set(threading.enumerate()) - before_threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(threading.enumerate()) - before_threads


# -- joblib's own usage patterns ---------------------------------------------------------


def test_functions_lambdas_and_closures():
    offset = 7

    def closure(x):
        return x + offset

    with parallel_config(backend="stealer", n_jobs=2):
        assert Parallel()(delayed(tasks.square)(i) for i in range(50)) == [
            i * i for i in range(50)]
        assert Parallel()(delayed(lambda x: -x)(i) for i in range(20)) == [
            -i for i in range(20)]
        assert Parallel()(delayed(closure)(i) for i in range(20)) == [i + 7 for i in range(20)]
        assert Parallel()(delayed(tasks.add)(i, b=1, c=2) for i in range(5)) == [
            i + 3 for i in range(5)]
        pids = set(Parallel(batch_size=1)(delayed(tasks.pid)(i) for i in range(20)))
    ex = sj.get_executor()
    assert ex is not None and ex.max_workers == 2
    assert pids <= set(ex.worker_pids())  # ran on the stealer workers, not here
    assert Parallel(n_jobs=2, backend="stealer")(delayed(tasks.square)(i) for i in range(3)) == [
        0, 1, 4]


def test_auto_batching_groups_trivial_items():
    with parallel_config(backend="stealer", n_jobs=2):
        p = Parallel()
        out = p(delayed(tasks.identity)(i) for i in range(20_000))
    assert out == list(range(20_000))
    assert p.n_dispatched_tasks == 20_000
    assert p.n_dispatched_batches < 20_000 // 2  # batches grew past one item


def test_exception_is_raised_as_itself_with_the_worker_traceback():
    with parallel_config(backend="stealer", n_jobs=2):
        with pytest.raises(ValueError, match="bad item 3") as info:
            Parallel(batch_size=1)(
                delayed(tasks.raise_value_error if i == 3 else tasks.square)(
                    "bad item 3" if i == 3 else i)
                for i in range(10))
        cause = info.value.__cause__
        assert isinstance(cause, RemoteTraceback)
        assert "in raise_value_error" in str(cause) and "raise ValueError(msg)" in str(cause)
        with pytest.raises(ZeroDivisionError):
            Parallel()(delayed(lambda x: 1 // x)(i) for i in range(-2, 3))
        # the executor is still fine
        assert Parallel()(delayed(tasks.square)(i) for i in range(4)) == [0, 1, 4, 9]


def test_return_as_generator():
    with parallel_config(backend="stealer", n_jobs=2):
        g = Parallel(return_as="generator")(delayed(tasks.square)(i) for i in range(30))
        assert not isinstance(g, list)
        assert next(g) == 0
        assert list(g) == [i * i for i in range(1, 30)]
        g = Parallel(return_as="generator_unordered", batch_size=1)(
            delayed(tasks.sleep_then)(0.001 * (i % 3), i) for i in range(12))
        assert sorted(g) == list(range(12))


def test_generator_interleaved_with_another_call_of_the_same_config():
    """One backend instance serves every call of a parallel_config block: a generator still
    dispatching when another call ends goes on (loky's backend fails here)."""
    with parallel_config(backend="stealer", n_jobs=2):
        g = Parallel(return_as="generator", batch_size=1)(
            delayed(tasks.sleep_then)(0.01, i) for i in range(30))
        assert next(g) == 0
        assert Parallel()(delayed(tasks.square)(i) for i in range(5)) == [0, 1, 4, 9, 16]
        assert list(g) == list(range(1, 30))
        # dropping one generator withdraws its own batches, not the other call's
        g1, g2 = (Parallel(return_as="generator", batch_size=1)(
            delayed(tasks.sleep_then)(0.01, i) for i in range(30)) for _ in range(2))
        assert next(g1) == 0 and next(g2) == 0
        with pytest.warns(UserWarning, match="cancelled"):
            g1.close()
        assert list(g2) == list(range(1, 30))


def test_dropping_a_generator_withdraws_the_rest(tmp_path):
    def item(i):
        open(tmp_path / f"ran-{i}", "w").close()
        time.sleep(0.05)
        return i

    with parallel_config(backend="stealer", n_jobs=2):
        g = Parallel(return_as="generator", batch_size=1, pre_dispatch="all")(
            delayed(item)(i) for i in range(40))
        assert next(g) == 0
        with pytest.warns(UserWarning, match="cancelled"):
            g.close()
        ex = sj.get_executor()
        deadline = time.monotonic() + 30
        while ex._pool.futures and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not ex._pool.futures
        ran = len(os.listdir(tmp_path))
        assert 1 <= ran < 40  # the batches not started were withdrawn, never run
        assert Parallel()(delayed(tasks.square)(i) for i in range(3)) == [0, 1, 4]


def test_parallel_config_nesting_and_executor_reuse():
    with parallel_config(backend="stealer", n_jobs=2):
        Parallel()(delayed(tasks.square)(i) for i in range(4))
        first = sj.get_executor()
        workers = set(first.worker_pids())
        assert set(Parallel(batch_size=1)(delayed(tasks.pid)(i) for i in range(8))) <= workers
        with parallel_config(backend="threading"):  # an inner config wins...
            assert set(Parallel()(delayed(tasks.pid)(i) for i in range(8))) == {os.getpid()}
        # ... until it ends; the same executor and the same processes serve the next call
        assert set(Parallel(batch_size=1)(delayed(tasks.pid)(i) for i in range(8))) <= workers
        assert sj.get_executor() is first and set(first.worker_pids()) == workers
        with parallel_config(n_jobs=1):  # n_jobs=1: sequential in the caller
            assert set(Parallel()(delayed(tasks.pid)(i) for i in range(3))) == {os.getpid()}
        with parallel_config(n_jobs=3):  # another size: a new executor, the old one stops
            assert len(set(Parallel(batch_size=1)(
                delayed(tasks.sleep_then)(0.02, i) for i in range(12)))) == 12
            third = sj.get_executor()
            assert third is not first and third.max_workers == 3
        assert not os.path.exists(f"/dev/shm/{first.segment_name}")
        assert not workers & children()
        Parallel()(delayed(tasks.square)(i) for i in range(4))
        assert sj.get_executor().max_workers == 2


def test_n_jobs_and_options():
    b = sj.StealerBackend()
    n = sj.usable_cpus()
    assert b.effective_n_jobs(-1) == n
    assert b.effective_n_jobs(-2) == max(n - 1, 1)
    assert b.effective_n_jobs(None) == n  # under this backend, unset means every CPU
    assert b.effective_n_jobs(3) == 3
    with pytest.raises(ValueError):
        b.effective_n_jobs(0)
    with pytest.raises(ValueError, match="retries"), parallel_config(backend="stealer",
                                                                      retries=-1):
        pass


def test_import_stealer_does_not_import_joblib():
    code = ("import sys, stealer, stealer.client.executor, stealer.bench.cli\n"
            "assert 'joblib' not in sys.modules and 'stealer.joblib' not in sys.modules\n"
            "import joblib\n"
            "assert 'stealer' not in joblib.parallel.BACKENDS\n"
            "import stealer.joblib\n"
            "assert 'stealer' in joblib.parallel.BACKENDS\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


# -- crashes -------------------------------------------------------------------------------


def _killing_items(marker: str, n: int):
    """Item 0 writes its pid to ``marker`` and sleeps (once: when re-run it returns at once)."""

    def item(i):
        if i == 0 and not os.path.exists(marker):
            with open(marker + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.rename(marker + ".tmp", marker)
            time.sleep(30)
        return i

    return [delayed(item)(i) for i in range(n)]


def _kill_when_marked(marker: str) -> threading.Thread:
    def run():
        deadline = time.monotonic() + 30
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.01)
        with open(marker) as f:
            os.kill(int(f.read()), 9)

    t = threading.Thread(target=run)
    t.start()
    return t


@pytest.mark.kills_workers
def test_worker_killed_mid_parallel(tmp_path):
    marker = str(tmp_path / "pid")
    with parallel_config(backend="stealer", n_jobs=2):
        Parallel()(delayed(tasks.square)(i) for i in range(2))
        killer = _kill_when_marked(marker)
        try:
            with pytest.raises(sj.TerminatedWorkerError, match="SIGKILL") as info:
                Parallel(batch_size=1)(_killing_items(marker, 8))
        finally:
            killer.join(30)
        assert isinstance(info.value, LokyTerminatedWorkerError)  # loky users' except clause
        assert isinstance(info.value, stealer.WorkerCrashedError)
        assert "retries=3" in str(info.value)
        with open(marker) as f:
            victim = int(f.read())
        # the executor replaced the worker and goes on
        assert Parallel()(delayed(tasks.square)(i) for i in range(4)) == [0, 1, 4, 9]
        assert victim not in sj.get_executor().worker_pids()


@pytest.mark.kills_workers
def test_worker_killed_mid_parallel_with_retries_reruns_the_batch(tmp_path):
    marker = str(tmp_path / "pid")
    with parallel_config(backend="stealer", n_jobs=2, retries=1):
        killer = _kill_when_marked(marker)
        try:
            assert Parallel(batch_size=1)(_killing_items(marker, 8)) == list(range(8))
        finally:
            killer.join(30)


# -- scikit-learn and nesting --------------------------------------------------------------


def test_sklearn_cross_val_score_equals_sequential():
    pytest.importorskip("sklearn")
    from sklearn.datasets import load_iris
    from sklearn.model_selection import cross_val_score
    from sklearn.tree import DecisionTreeClassifier

    X, y = load_iris(return_X_y=True)
    model = DecisionTreeClassifier(random_state=0)
    expected = cross_val_score(model, X, y, cv=5, n_jobs=1)
    with parallel_config(backend="stealer", n_jobs=2):
        got = cross_val_score(model, X, y, cv=5, n_jobs=-1)
    assert list(got) == list(expected)


def _inner_pids(i):
    """An item that itself runs a Parallel call (the nested case), naming where each ran."""
    inner = Parallel(n_jobs=-1)(delayed(os.getpid)() for _ in range(6))
    explicit = Parallel(n_jobs=2, backend="stealer")(delayed(os.getpid)() for _ in range(3))
    return os.getpid(), set(inner) | set(explicit)


class _ProcessWatch(threading.Thread):
    """Every child process seen while it runs, and the most seen at once."""

    def __init__(self) -> None:
        super().__init__()
        self.stop = threading.Event()
        self.seen: dict[int, str] = {}  # pid -> command line
        self.most = 0

    def run(self) -> None:
        while not self.stop.is_set():
            kids = children()
            for p in kids - self.seen.keys():
                self.seen[p] = cmdline(p)
            self.most = max(self.most, len(kids))
            time.sleep(0.005)


def _busy_pid(ms):
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass
    return os.getpid()


def _one_outer(n):
    """One outer item whose inner Parallel (n items of 3 ms) should use every worker."""
    return os.getpid(), Parallel(batch_size=1)(delayed(_busy_pid)(3) for _ in range(n))


def _deep(depth):
    """Parallel inside Parallel inside Parallel...: the sum of 2**depth ones."""
    if depth == 0:
        return 1
    return sum(Parallel(n_jobs=-1)(delayed(_deep)(depth - 1) for _ in range(2)))


def test_nested_parallel_runs_on_the_same_workers():
    with parallel_config(backend="stealer", n_jobs=2):
        out = Parallel(batch_size=1)(delayed(_inner_pids)(i) for i in range(6))
    workers = set(sj.get_executor().worker_pids())
    for outer, inner in out:
        assert outer in workers and inner <= workers


def test_a_nested_parallel_keeps_every_worker_busy():
    """One outer item: its inner items are children that the idle worker steals (not run
    sequentially by the one busy worker)."""
    with parallel_config(backend="stealer", n_jobs=2):
        [(outer, inner)] = Parallel()(delayed(_one_outer)(40) for _ in range(1))
    workers = set(sj.get_executor().worker_pids())
    assert outer in workers
    assert set(inner) == workers, "the idle worker never ran an inner item"


def test_nesting_to_any_depth_neither_deadlocks_nor_adds_processes():
    with parallel_config(backend="stealer", n_jobs=2):
        Parallel()(delayed(tasks.square)(i) for i in range(2))  # the executor is up
        workers = set(sj.get_executor().worker_pids())
        assert Parallel()(delayed(_deep)(d) for d in range(7)) == [2 ** d for d in range(7)]
        assert set(sj.get_executor().worker_pids()) == workers


def test_a_nested_error_comes_through_with_its_traceback():
    with parallel_config(backend="stealer", n_jobs=2), pytest.raises(ZeroDivisionError) as info:
        Parallel()(delayed(_nested_fail)(i) for i in range(4))
    assert "_divide" in "".join(traceback.format_exception(info.value))


def _divide(x):
    return 1 / x


def _nested_fail(i):
    return Parallel(batch_size=1)(delayed(_divide)(j - i) for j in range(8))


def test_nested_gridsearch_uses_only_the_workers():
    pytest.importorskip("sklearn")
    from sklearn.datasets import load_iris
    from sklearn.ensemble import RandomForestClassifier
    from sklearn.model_selection import GridSearchCV

    X, y = load_iris(return_X_y=True)

    def search(n_jobs):
        return GridSearchCV(RandomForestClassifier(n_estimators=8, random_state=0, n_jobs=n_jobs),
                            {"max_depth": [2, 4], "min_samples_leaf": [1, 3]},
                            cv=3, n_jobs=n_jobs).fit(X, y)

    expected = search(None)
    with parallel_config(backend="stealer", n_jobs=2):
        Parallel()(delayed(tasks.square)(i) for i in range(2))  # the executor is up
        workers = set(sj.get_executor().worker_pids())
        watch = _ProcessWatch()
        watch.start()
        try:
            got = search(-1)
        finally:
            watch.stop.set()
            watch.join()
    assert got.best_params_ == expected.best_params_
    assert list(got.cv_results_["mean_test_score"]) == list(
        expected.cv_results_["mean_test_score"])
    extra = {p: c for p, c in watch.seen.items() if p not in workers and not helper(c)}
    assert not extra, f"processes other than the {len(workers)} workers: {extra}"
    helpers = {p for p, c in watch.seen.items() if helper(c)}
    assert watch.most <= len(workers) + len(helpers)


def _inner_killer(marker, n):
    """An outer item whose inner Parallel has one item that SIGKILLs its worker (once)."""
    return Parallel(batch_size=1)(delayed(_maybe_die)(marker, i == n // 2) for i in range(n))


def _maybe_die(marker, die):
    if die and not os.path.exists(marker):
        with open(marker, "w"):
            pass
        os.kill(os.getpid(), 9)
    time.sleep(0.002)
    return die


@pytest.mark.kills_workers
def test_worker_killed_under_a_nested_parallel(tmp_path):
    """The inner item (or the worker blocked in the inner join) dies: the whole call
    fails with TerminatedWorkerError by default, and re-runs to the end with retries."""
    with parallel_config(backend="stealer", n_jobs=2):
        with pytest.raises(sj.TerminatedWorkerError):
            Parallel()(delayed(_inner_killer)(str(tmp_path / "a"), 16) for _ in range(2))
        assert Parallel()(delayed(tasks.square)(i) for i in range(4)) == [0, 1, 4, 9]
    with parallel_config(backend="stealer", n_jobs=2, retries=2):
        out = Parallel()(delayed(_inner_killer)(str(tmp_path / "b"), 16) for _ in range(2))
    assert [sum(o) for o in out] == [1, 1]
