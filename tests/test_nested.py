"""Blocking joins inside plain tasks (stealer.join, Child.result) and an executor used from
inside its own tasks (ex.submit / ex.map there spawn children): results, errors, depth
without deadlock, every worker used, worker deaths, and what is refused with a message."""

from __future__ import annotations

import nested_lib as N
import pytest
from probes import records_in_use

import stealer


@pytest.fixture(scope="module")
def ex():
    with stealer.Executor(2) as e:
        yield e


def test_join_returns_results_and_runs_children_on_every_worker(ex):
    outer, pids = ex.submit(N.fan_out, 40, 3).result(60)
    workers = set(ex.worker_pids())
    assert outer in workers and len(pids) == 40
    assert set(pids) == workers, "the idle worker never stole a child of the blocked task"


def test_blocking_joins_nest_deeper_than_the_workers_without_deadlock(ex):
    assert ex.submit(N.tree, 9).result(120) == 2 ** 9
    fs = [ex.submit(N.tree, 6) for _ in range(8)]  # several blocked roots at once
    assert [f.result(120) for f in fs] == [64] * 8


def test_an_executor_inside_its_own_tasks_spawns_children(ex):
    assert ex.submit(N.fib_ex, ex, 14).result(120) == 377
    assert ex.submit(N.map_inside, ex, 50, 1).result(60) == [i * i for i in range(50)]
    assert ex.submit(N.map_inside, ex, 50, 7).result(60) == [i * i for i in range(50)]
    assert list(ex.map(N.map_inside, [ex] * 3, [5, 6, 7], [1, 2, 3])) == [
        [i * i for i in range(k)] for k in (5, 6, 7)]


def test_a_childs_exception_is_raised_at_the_join(ex):
    with pytest.raises(ZeroDivisionError) as info:
        ex.submit(N.failing_child, 2).result(60)
    assert "divide" in str(info.value.__cause__)  # the worker's traceback, chained


def test_generator_children_resume_inside_a_blocking_join(ex):
    # each child is a generator task whose frame waits for its own children: the
    # blocked parent's worker resumes it when they ping (it is a descendant)
    want = [sum(i * i for i in range(k)) for k in range(1, 13)]
    assert ex.submit(N.joins_gen_children, 12).result(60) == want


def test_join_timeout_raises_and_the_child_still_finishes(ex, tmp_path):
    marker = str(tmp_path / "started")
    assert ex.submit(N.slow_join, marker, 0.05).result(60) == "timed out, then True"


def test_unjoined_children_are_waited_for_and_freed(ex):
    before = records_in_use(ex)
    assert ex.submit(N.spawn_and_return, 30).result(60) == 30
    assert records_in_use(ex) == before


def test_joining_a_child_of_another_task_is_refused(ex):
    with pytest.raises(TypeError, match="only join children it spawned"):
        ex.submit(N.join_others, stealer.Child(12345)).result(60)


def test_join_of_two_children_as_two_arguments_says_to_pass_a_list(ex):
    # (it failed deep in the wait with "unsupported operand ... 'float' and 'Child'")
    with pytest.raises(TypeError, match=r"as a list, stealer.join\(\[a, b\]\)"):
        ex.submit(N.join_two_as_arguments).result(60)


def test_join_outside_a_task_says_where_it_works():
    with pytest.raises(stealer.NotInTaskError, match="inside a task"):
        stealer.join(stealer.Child(1))
    assert stealer.run_inline(N.tree, 4) == 16  # inline: children run at spawn


def test_agents_must_yield_and_cannot_submit(ex):
    assert ex.spawn_agent(N.Blocker).result(60)[1] == 9
    assert "yield" in ex.spawn_agent(N.Blocker).result(60)[0]
    assert "yield" in ex.spawn_agent(N.SubmitsInside, ex).result(60)


def test_an_executor_used_by_another_executors_task_is_refused(ex):
    with stealer.Executor(1) as other, pytest.raises(RuntimeError, match="own workers"):
        other.submit(N.map_inside, ex, 3, 1).result(60)


@pytest.mark.kills_workers
def test_a_worker_killed_under_a_blocking_join(tmp_path):
    """A child SIGKILLs its worker (the blocked parent's, or a thief's): the dead worker's
    tasks are re-run (retries) and the join completes with every child's result."""
    for k in range(3):
        marker = str(tmp_path / f"killed{k}")
        with stealer.Executor(2) as e:
            assert e.submit(N.fan_out_with_a_kill, marker, 24).result(120) == 24
            assert e._pool.crashes == 1


def test_an_options_view_is_still_the_executor(ex):
    view = ex.options(retries=0)  # a copy, not the in-task stand-in an executor pickles to
    assert isinstance(view, stealer.Executor)
    assert view.submit(N.square, 5).result(30) == 25


# -- a property: random trees of blocking, generator and executor joins ----------------
def _trees():
    from hypothesis import strategies as st

    leaf = st.integers(min_value=-1, max_value=9)
    return st.recursive(
        leaf,
        lambda kids: st.tuples(st.sampled_from("bgx"), st.lists(kids, min_size=1, max_size=5)),
        max_leaves=40)


def _oracle(tree):
    """Sequential: the sum, or the first failing leaf in depth-first order."""
    if isinstance(tree, int):
        if tree < 0:
            raise ValueError(f"leaf {tree}")
        return tree
    return sum(_oracle(k) for k in tree[1])


def _outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except ValueError as exc:
        return ("error", str(exc))


def test_random_join_trees_match_a_sequential_oracle(ex):
    """Any mix of blocking joins, yield joins and ex.submit inside tasks, to any depth,
    gives the sequential sum (or a failing leaf's error) and never hangs."""
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=150, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(_trees())
    def check(tree):
        want = _outcome(_oracle, tree)
        got = _outcome(lambda: ex.submit(N.evaluate, tree, ex).result(60))
        if want[0] == "ok":
            assert got == want
        else:
            assert got[0] == "error"  # which failing leaf is raised first may differ

    check()
    assert records_in_use(ex) == 0
