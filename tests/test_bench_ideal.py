"""Unit tests of the benchmark support code: the zero-overhead ideal simulation, the seeded
trace generators, the percentile helper, and the pure parts of the workloads.

No timing assertions: everything here is deterministic arithmetic.  Fork-join generator
tasks are driven by a tiny sequential driver with a stand-in ``stealer.spawn``, so these tests
do not need the executor.
"""

from __future__ import annotations

import inspect
import itertools
import math
import random
import sys
import types
from typing import Any

import pytest

from stealer.bench import ideal
from stealer.bench import workloads as wl
from stealer.bench.report import _median_dicts, format_table

# --------------------------------------------------------------------------- ideal simulation


def test_one_worker_fifo_queueing() -> None:
    arrivals = [0.0, 0.5, 1.0]
    durations = [1.0, 1.0, 1.0]
    assert ideal.fifo_completions(arrivals, durations, 1) == [1.0, 2.0, 3.0]
    assert ideal.fifo_latencies(arrivals, durations, 1) == [1.0, 1.5, 2.0]


def test_one_worker_idle_gap() -> None:
    # The second task arrives after the worker went idle: it starts on arrival.
    assert ideal.fifo_completions([0.0, 5.0], [1.0, 2.0], 1) == [1.0, 7.0]


def test_two_workers_earliest_free_worker() -> None:
    # t=0: A(2) on w1, B(1) on w2; C starts on w2 at 1 -> 2; D (arrives 0.5) waits for the
    # first free worker at 2 -> 3.
    arrivals = [0.0, 0.0, 0.0, 0.5]
    durations = [2.0, 1.0, 1.0, 1.0]
    assert ideal.fifo_completions(arrivals, durations, 2) == [2.0, 1.0, 2.0, 3.0]
    assert ideal.fifo_latencies(arrivals, durations, 2) == [2.0, 1.0, 2.0, 2.5]


def test_unsorted_arrivals_served_in_arrival_order_results_in_input_order() -> None:
    arrivals = [2.0, 0.0, 1.0]
    durations = [1.0, 3.0, 1.0]
    # served: t0 (0->3), t2 (3->4), t1 (4->5) on one worker
    assert ideal.fifo_completions(arrivals, durations, 1) == [5.0, 3.0, 4.0]


def test_ties_keep_input_order() -> None:
    assert ideal.fifo_completions([0.0, 0.0], [5.0, 1.0], 1) == [5.0, 6.0]


def test_more_workers_than_tasks_no_waiting() -> None:
    arrivals = [0.0, 0.1, 0.2]
    durations = [1.0, 2.0, 3.0]
    assert ideal.fifo_latencies(arrivals, durations, 8) == durations


def test_makespan_hand_computed_and_bound() -> None:
    durations = [3.0, 3.0, 2.0, 2.0, 2.0]
    # FIFO on 2: w1 3, w2 3, then 5, 5, then 7.
    assert ideal.fifo_makespan(durations, 2) == 7.0
    assert ideal.makespan_lower_bound(durations, 2) == 6.0
    assert ideal.makespan_lower_bound([10.0, 1.0], 2) == 10.0
    assert ideal.fifo_makespan([], 2) == 0.0
    assert ideal.makespan_lower_bound([], 2) == 0.0


@pytest.mark.parametrize("workers", [1, 2, 3, 7])
def test_makespan_between_lower_bound_and_graham_bound(workers: int) -> None:
    rng = random.Random(workers)
    for _ in range(50):
        durations = [rng.expovariate(1.0) for _ in range(rng.randint(1, 60))]
        span = ideal.fifo_makespan(durations, workers)
        low = ideal.makespan_lower_bound(durations, workers)
        graham = math.fsum(durations) / workers + (1 - 1 / workers) * max(durations)
        assert low - 1e-9 <= span <= graham + 1e-9
    if workers == 1:
        assert ideal.fifo_makespan([1.0, 2.0], 1) == 3.0


def test_simulation_is_pure_and_validates() -> None:
    arrivals = [0.0, 0.1]
    durations = [1.0, 1.0]
    ideal.fifo_completions(arrivals, durations, 1)
    assert arrivals == [0.0, 0.1] and durations == [1.0, 1.0]
    with pytest.raises(ValueError):
        ideal.fifo_completions([0.0], [1.0], 0)
    with pytest.raises(ValueError):
        ideal.fifo_completions([0.0, 1.0], [1.0], 1)
    with pytest.raises(ValueError):
        ideal.fifo_completions([0.0], [-1.0], 1)


def test_brent_speedup() -> None:
    assert ideal.brent_speedup(100.0, 1.0, 2) == 2.0
    assert ideal.brent_speedup(100.0, 80.0, 2) == 1.25
    assert ideal.brent_speedup(0.0, 0.0, 4) == 1.0


# --------------------------------------------------------------------------- percentiles


def test_percentile_hand_computed() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]
    assert ideal.percentile(xs, 0) == 1.0
    assert ideal.percentile(xs, 100) == 4.0
    assert ideal.percentile(xs, 50) == 2.5
    assert ideal.percentile(xs, 25) == pytest.approx(1.75)
    assert ideal.percentile([7.0], 99.9) == 7.0
    assert xs == [4.0, 1.0, 3.0, 2.0]  # input left alone
    with pytest.raises(ValueError):
        ideal.percentile([], 50)
    with pytest.raises(ValueError):
        ideal.percentile([1.0], 101)


def test_percentile_matches_numpy_linear() -> None:
    np = pytest.importorskip("numpy")
    rng = random.Random(3)
    xs = [rng.random() for _ in range(1001)]
    for q in (0, 1, 12.5, 50, 90, 99, 99.9, 100):
        assert ideal.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), abs=1e-12)


def test_latency_summary_keys_and_scale() -> None:
    values = [i / 1000 for i in range(1, 1001)]  # 1 ms .. 1000 ms
    s = ideal.latency_summary(values)
    assert set(s) == {"p50", "p90", "p99", "p99_9", "max", "mean"}
    assert s["max"] == pytest.approx(1000.0)
    assert s["p50"] == pytest.approx(500.5)
    assert s["mean"] == pytest.approx(500.5)
    assert s["p50"] <= s["p90"] <= s["p99"] <= s["p99_9"] <= s["max"]
    assert ideal.latency_summary(values, scale=1.0)["max"] == pytest.approx(1.0)


# --------------------------------------------------------------------------- traces


def test_poisson_arrivals_seeded_increasing_and_mean() -> None:
    a = ideal.poisson_arrivals(1000, 1400.0, seed=7)
    assert a == ideal.poisson_arrivals(1000, 1400.0, seed=7)
    assert a != ideal.poisson_arrivals(1000, 1400.0, seed=8)
    assert all(y > x for x, y in itertools.pairwise(a)) and a[0] > 0
    shifted = ideal.poisson_arrivals(1000, 1400.0, seed=7, start=5.0)
    assert shifted[0] == pytest.approx(a[0] + 5.0)
    n, rate = 200_000, 1400.0
    big = ideal.poisson_arrivals(n, rate, seed=1)
    assert big[-1] / n == pytest.approx(1 / rate, rel=0.02)  # sd of the mean is 0.22%
    with pytest.raises(ValueError):
        ideal.poisson_arrivals(1, 0.0, seed=1)


def test_pareto_durations_seeded_cap_and_mean() -> None:
    shape, mean, cap = 1.5, 2e-3, 0.2
    d = ideal.pareto_durations(500, shape, mean, cap, seed=11)
    assert d == ideal.pareto_durations(500, shape, mean, cap, seed=11)
    assert d != ideal.pareto_durations(500, shape, mean, cap, seed=12)
    xm = mean * (shape - 1) / shape
    big = ideal.pareto_durations(200_000, shape, mean, cap, seed=5)
    assert max(big) <= cap
    assert min(big) >= xm
    assert any(x == cap for x in big)  # P(X > cap) ~ 2e-4 per sample: the cap is hit
    expected = ideal.pareto_capped_mean(shape, mean, cap)
    assert expected < mean
    assert math.fsum(big) / len(big) == pytest.approx(expected, rel=0.03)
    with pytest.raises(ValueError):
        ideal.pareto_durations(1, 1.0, mean, cap, seed=1)


def test_pareto_capped_mean_limits() -> None:
    assert ideal.pareto_capped_mean(1.5, 2.0, 1e30) == pytest.approx(2.0)
    assert ideal.pareto_capped_mean(1.5, 3.0, 0.5) == 0.5  # cap below the scale x_m = 1
    # Numerical integral of the survival function: E[min(X,c)] = int_0^c P(X > t) dt.
    shape, mean, cap = 2.5, 1.0, 4.0
    xm = mean * (shape - 1) / shape
    steps = 200_000
    h = (cap - xm) / steps
    tail = sum((xm / (xm + (i + 0.5) * h)) ** shape for i in range(steps)) * h
    assert ideal.pareto_capped_mean(shape, mean, cap) == pytest.approx(xm + tail, rel=1e-6)


# --------------------------------------------------------------------------- workloads


class _Child:
    def __init__(self, fn: Any, args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args


def _drive(fn: Any, *args: Any) -> Any:
    """Run a fork-join generator task sequentially (children depth-first)."""
    gen = fn(*args)
    if not inspect.isgenerator(gen):
        return gen
    value: Any = None
    try:
        while True:
            req = gen.send(value)
            if isinstance(req, list):
                value = [_drive(c.fn, *c.args) for c in req]
            else:
                value = _drive(req.fn, *req.args)
    except StopIteration as stop:
        return stop.value


@pytest.fixture
def fake_spawn(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make ``import stealer`` inside the workloads see a module whose spawn records calls."""
    calls: list[int] = []
    mod = types.ModuleType("stealer")

    def spawn(fn: Any, *args: Any) -> _Child:
        calls.append(1)
        return _Child(fn, args)

    mod.spawn = spawn  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "stealer", mod)
    return calls


def test_fib_generator_and_flat_decomposition(fake_spawn: list[int]) -> None:
    assert [wl.fib_seq(n) for n in range(10)] == [0, 1, 1, 2, 3, 5, 8, 13, 21, 34]
    for n, cutoff in [(0, 5), (1, 5), (4, 5), (15, 5), (20, 10), (12, 0)]:
        assert _drive(wl.fib, n, cutoff) == wl.fib_seq(n)
        leaves = wl.fib_leaves(n, cutoff)
        assert sum(wl.fib_seq(k) for k in leaves) == wl.fib_seq(n)
        assert all(k < max(cutoff, 2) for k in leaves)
    fake_spawn.clear()
    _drive(wl.fib, 20, 10)
    assert len(fake_spawn) + 1 == wl.fib_task_count(20, 10)


def test_splitmix64_reference_value() -> None:
    # First output of SplitMix64 seeded with 0 (reference implementation by S. Vigna).
    assert wl.splitmix64(0) == 0xE220A8397B1DCDAF
    assert wl.uts_child_seed(0, 0) == wl.splitmix64(0x9E3779B97F4A7C15)


def test_uts_params_validation() -> None:
    with pytest.raises(ValueError):
        wl.UTSParams(m=4, q=0.25)
    with pytest.raises(ValueError):
        wl.UTSParams(budget=0)
    assert wl.UTS_QUICK.expected_nodes == pytest.approx(20_001)


def test_uts_tree_sizes_are_fixed() -> None:
    # The documented sizes of the quick and default trees (20k-200k nodes, finite, deterministic).
    assert wl.uts_stats(wl.UTS_ROOT_SEED, 0, wl.UTS_QUICK) == (21_201, 66)
    assert wl.uts_stats(wl.UTS_ROOT_SEED, 0, wl.UTS_DEFAULT) == (106_333, 104)


def _no_work(params: wl.UTSParams, budget: int) -> wl.UTSParams:
    return wl.UTSParams(b0=params.b0, m=params.m, q=params.q, node_seconds=0.0, budget=budget)


@pytest.mark.parametrize("budget", [1, 7, 64])
def test_uts_fork_join_client_loop_and_sequential_agree(fake_spawn: list[int], budget: int) -> None:
    params = _no_work(wl.UTSParams(b0=300), budget)
    nodes, _ = wl.uts_stats(3, 0, params)
    assert wl.uts_seq(3, 0, params) == nodes
    assert _drive(wl.uts, 3, 0, params) == nodes
    # The client-driven decomposition a plain executor runs.
    bags: list[list[tuple[int, int]]] = [[(3, 0)]]
    total = 0
    while bags:
        count, frontier = wl.uts_expand(bags.pop(), params)
        assert count <= budget
        total += count
        bags.extend(wl.uts_split(frontier))
    assert total == nodes


def test_uts_split_deals_all_nodes() -> None:
    frontier = [(i, 1) for i in range(7)]
    parts = wl.uts_split(frontier, 3)
    assert len(parts) == 3 and all(parts)
    assert sorted(x for p in parts for x in p) == frontier
    assert wl.uts_split([], 2) == []
    assert wl.uts_split([(1, 1)], 2) == [[(1, 1)]]


def test_plain_tasks() -> None:
    assert wl.noop(5) == 5
    assert wl.noop() is None
    wl.busy(0.0)
    start, end = wl.timed_busy(0.0)
    assert end >= start


# --------------------------------------------------------------------------- agents


def test_round_robin_steps_hand_computed() -> None:
    # 3 agents x 2 steps of 1.0 on 2 workers: a0, a1 in [0,1]; a2 [1,2]; a0 [1,2]; a1 [2,3];
    # a2 [2,3].  Latency: end minus the end of the agent's previous step (0 before the first).
    lat, makespan = ideal.round_robin_steps(3, 2, 1.0, 2)
    assert lat == [1.0, 1.0, 2.0, 1.0, 2.0, 1.0]
    assert makespan == 3.0
    assert ideal.round_robin_steps(0, 5, 1.0, 2) == ([], 0.0)
    assert ideal.round_robin_steps(1, 3, 1.0, 4) == ([1.0, 1.0, 1.0], 3.0)
    with pytest.raises(ValueError):
        ideal.round_robin_steps(2, 2, 1.0, 0)


def test_round_robin_steps_design_numbers() -> None:
    # the agents workload: 200 agents x 25 steps of 0.5 ms on 2 workers, per-step latency ~ 50 ms.
    lat, makespan = ideal.round_robin_steps(200, 25, 0.5e-3, 2)
    assert len(lat) == 200 * 25
    assert makespan == pytest.approx(200 * 25 * 0.5e-3 / 2)  # no idle worker: efficiency 1
    assert ideal.percentile(lat, 50) == pytest.approx(0.05)
    assert ideal.percentile(lat, 99) == pytest.approx(0.05)
    assert min(lat) == pytest.approx(0.5e-3) and max(lat) <= 0.05 + 1e-12
    later = lat[200:]  # the first 200 are the agents' first steps (the ramp 0.5 .. 50 ms)
    assert sorted(lat[:200]) == pytest.approx([(i // 2 + 1) * 0.5e-3 for i in range(200)])
    assert min(later) == pytest.approx(0.05) and max(later) == pytest.approx(0.05)


def test_step_boundary_replies_bounded_seeded_and_fall_with_workers() -> None:
    one = ideal.step_boundary_replies(2000, 5e-3, 0.2e-3, 1, seed=3)
    two = ideal.step_boundary_replies(2000, 5e-3, 0.2e-3, 2, seed=3)
    assert one == ideal.step_boundary_replies(2000, 5e-3, 0.2e-3, 1, seed=3)
    for xs in (one, two):
        assert len(xs) == 2000 and all(0.2e-3 <= x < 5.2e-3 for x in xs)
    # Uniform remaining time: mean step/2 on one worker, step/3 for the first of two.
    assert math.fsum(one) / 2000 == pytest.approx(2.5e-3 + 0.2e-3, rel=0.05)
    assert math.fsum(two) / 2000 == pytest.approx(5e-3 / 3 + 0.2e-3, rel=0.05)


class _Ctx:
    """Stand-in for stealer.Ctx: what a step returns."""

    def done(self, value: Any = None) -> tuple[str, Any]:
        return ("done", value)

    def wait(self) -> str:
        return "wait"


def test_state_step_carries_the_state_and_detects_a_lost_one() -> None:
    import numpy as np

    s = wl.StepState(7, steps=3, work=0.0, arr=np.zeros(10), last=0.0)
    for k in range(1, 4):
        assert wl.state_step(s) is s
        assert s.count == k and bool(np.all(s.arr == k)) and len(s.lats) == k
    assert all(x >= 0 for x in s.lats) and s.last > 0
    s.arr[0] = 0.0  # what a lost update would look like
    with pytest.raises(RuntimeError, match="agent 7: state lost"):
        wl.state_step(s)


def test_agent_classes_step_and_answer_without_an_executor() -> None:
    import numpy as np

    ctx = _Ctx()
    agent = wl.StepAgent(wl.StepState(0, steps=2, work=0.0, arr=np.zeros(4), last=0.0))
    assert agent.step(ctx) is None
    kind, final = agent.step(ctx)
    assert kind == "done" and final.count == 2
    noop = wl.NoopAgent(3)
    assert [noop.step(ctx) for _ in range(3)] == [None, None, ("done", 3)]
    bulk = wl.BulkAgent(0.0)
    bulk.step(ctx)
    assert bulk.count() == bulk.on_stop() == 1
    inter = wl.InteractiveAgent(0.0)
    assert inter.hit(4)[0] == 4 and inter.on_stop() == 1
    assert wl.PongAgent().ping(1) == 2 and wl.IdleAgent().ping("x") == "x"

    class Other:  # other.call(...) inside an agent returns what the agent yields
        def call(self, method: str, v: int) -> tuple[str, int]:
            return (method, v)

    ping = wl.PingAgent(Other(), rounds=3)
    gen = ping.step(ctx)
    with pytest.raises(StopIteration) as stop:
        next(gen)
    assert stop.value.value == "wait"  # waits for start()
    ping.start()
    gen = ping.step(ctx)
    request = next(gen)
    for _ in range(3):
        assert request[0] == "ping"
        try:
            request = gen.send(request[1] + 1)
        except StopIteration as stop:
            kind, (value, seconds) = stop.value
            break
    assert kind == "done" and value == 3 and seconds >= 0


# --------------------------------------------------------------------------- report helpers


def test_median_dicts_and_table() -> None:
    runs = [
        {"a": 1.0, "n": 3, "s": "x", "ideal": {"b": 1.0}},
        {"a": 3.0, "n": 1, "s": "y", "ideal": {"b": 5.0}},
        {"a": 2.0, "n": 2, "s": "z", "ideal": {"b": 3.0}},
    ]
    med = _median_dicts(runs)
    assert med == {"a": 2.0, "n": 2, "s": "x", "ideal": {"b": 3.0}}
    results = {
        "skew": {
            "systems": {"stealer": {"efficiency": 0.98}, "process": {"efficiency": 0.49}},
            "ideal": {"efficiency": 1.0},
        }
    }
    text = format_table(results, ["stealer", "process", "loky"])
    lines = text.splitlines()
    assert lines[0].split()[:5] == ["workload", "metric", "stealer", "process", "loky"]
    assert len({len(line) for line in lines[:2]}) == 1  # header and rule aligned
    row = next(line for line in lines if line.startswith("skew") and "efficiency" in line)
    assert row.split()[-5:] == ["0.980", "0.490", "—", "1.000", "2.00"]
