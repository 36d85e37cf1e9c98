"""Fork-join from inside tasks: spawn children, join them by yield."""

from __future__ import annotations

import os

import pytest
import tasks
from probes import records_in_use

import stealer
from stealer.bench import workloads


@pytest.fixture(scope="module")
def ex():
    with stealer.Executor(2) as e:
        yield e


@pytest.mark.parametrize(("n", "cutoff"), [(10, 12), (15, 5), (22, 12), (24, 14)])
def test_fib(ex, n, cutoff):
    assert ex.submit(tasks.fib, n, cutoff).result(timeout=60) == tasks.fib_seq(n)


def test_many_concurrent_fork_join_roots(ex):
    fs = [ex.submit(tasks.fib, 16, 8) for _ in range(30)]
    assert all(f.result(timeout=60) == tasks.fib_seq(16) for f in fs)


def test_deep_chain_does_not_deadlock(ex):
    # deeper than Python's recursion limit would allow with blocking joins
    assert ex.submit(tasks.chain, 3000).result(timeout=120) == 3000


def test_wide_fanout(ex):
    assert ex.submit(tasks.wide, 2000).result(timeout=60) == sum(i * i for i in range(2000))


def test_tree(ex):
    assert ex.submit(tasks.tree_sum, 6, 3).result(timeout=60) == sum(3**d for d in range(7))


def test_uts_node_count(ex):
    p = workloads.UTSParams(b0=300, node_seconds=0.0, budget=16)
    expected, _depth = workloads.uts_stats(params=p)
    assert ex.submit(workloads.uts, params=p).result(timeout=120) == expected
    assert stealer.run_inline(workloads.uts, params=p) == expected


def test_child_exception_raised_at_yield(ex):
    assert ex.submit(tasks.child_fails).result(timeout=30) == "caught: child broke"
    with pytest.raises(ValueError, match="child broke"):
        ex.submit(tasks.child_fails_uncaught).result(timeout=30)


def test_unjoined_children_finish_before_parent(ex):
    assert ex.submit(tasks.unjoined_children, 50).result(timeout=30) == "parent done"
    assert ex.submit(tasks.plain_spawner, 20).result(timeout=30) == 20


def test_join_same_child_twice(ex):
    assert ex.submit(tasks.join_twice).result(timeout=30) == 50


def test_yielding_something_else_is_a_type_error(ex):
    with pytest.raises(TypeError, match=r"stealer\.spawn"):
        ex.submit(tasks.yields_garbage).result(timeout=30)


def test_spawn_outside_a_task():
    with pytest.raises(stealer.NotInTaskError, match="inside a task"):
        tasks.spawn_outside()


def test_run_inline_matches():
    assert stealer.run_inline(tasks.fib, 20, 5) == tasks.fib_seq(20)
    assert stealer.run_inline(tasks.child_fails) == "caught: child broke"
    assert stealer.run_inline(tasks.tree_sum, 3, 2) == 15


def test_records_exhausted_children_run_inline():
    with stealer.Executor(2, records=8) as e:
        assert e.submit(tasks.fib, 18, 4).result(timeout=60) == tasks.fib_seq(18)
        assert e.submit(tasks.wide, 100).result(timeout=60) == sum(i * i for i in range(100))


@pytest.mark.parametrize("retries", [0, 3])
def test_worker_killed_inside_fork_join_tree(tmp_path, retries):
    """SIGKILL a worker mid-tree: with retries the tree still gives the right value (the
    lost part re-runs); without, the root fails with WorkerCrashedError. Nothing hangs."""
    marker = str(tmp_path / "killed")
    with stealer.Executor(2, retries=retries) as e:
        f = e.submit(tasks.killer_tree, 6, marker)
        if retries:
            assert f.result(timeout=60) == 2**6
        else:
            with pytest.raises(stealer.WorkerCrashedError):
                f.result(timeout=60)
        assert os.path.exists(marker)
        # no record leaked: every record is back on the free ring once idle
        assert records_in_use(e) == 0
        # the pool still works, including fork-join
        assert e.submit(tasks.fib, 18, 8).result(timeout=60) == tasks.fib_seq(18)
