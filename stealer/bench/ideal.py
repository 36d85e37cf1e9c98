"""Traces and the zero-overhead ideal every benchmark result is reported next to.

The ideal is a *greedy FIFO list schedule* on ``W`` identical workers with zero scheduling,
serialization and wake-up cost: tasks start in arrival order, each on the worker that frees
up first (a heap of worker free times), never before it arrives.  This is the
work-conserving scheduler a perfect executor would be; it is not the optimal (LPT or
clairvoyant) schedule, and for batches we also report the lower bound ``max(sum/W, max)``
that no schedule can beat.

For agents: :func:`round_robin_steps` is the same greedy list schedule for self-driven agents
(each agent's next step is ready the moment its previous step ends, so with more agents than
workers they take turns round-robin), and :func:`step_boundary_replies` the reply times of calls
to an interactive agent on workers saturated by bulk steps, when a call waits only for the
first bulk step to end (preemption at step boundaries).

Also here: seeded trace generators (Poisson arrivals, capped Pareto durations), percentile
helpers, and Brent's bound for fork-join speedup.  Everything is deterministic and pure
(no clocks, no global random state).  Used by the workload modules (wl_tasks, wl_forkjoin,
wl_agents, wl_user, lockstep) and by tests/test_bench_ideal.py.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Sequence

__all__ = [
    "fifo_completions",
    "fifo_latencies",
    "fifo_makespan",
    "makespan_lower_bound",
    "brent_speedup",
    "round_robin_steps",
    "step_boundary_replies",
    "percentile",
    "latency_summary",
    "poisson_arrivals",
    "pareto_durations",
    "pareto_capped_mean",
]


# --------------------------------------------------------------------------- simulation


def fifo_completions(
    arrivals: Sequence[float], durations: Sequence[float], workers: int
) -> list[float]:
    """Completion time of each task under greedy FIFO on ``workers`` zero-overhead workers.

    Tasks are served in order of arrival (ties keep input order); a task starts at
    ``max(arrival, earliest worker free time)``.  Returns completion times in input order.
    """
    if workers < 1:
        raise ValueError("workers must be >= 1")
    if len(arrivals) != len(durations):
        raise ValueError("arrivals and durations differ in length")
    order = sorted(range(len(arrivals)), key=arrivals.__getitem__)
    free = [0.0] * min(workers, max(1, len(arrivals)))
    heapq.heapify(free)
    done = [0.0] * len(arrivals)
    for i in order:
        d = durations[i]
        if d < 0:
            raise ValueError("durations must be >= 0")
        start = max(arrivals[i], heapq.heappop(free))
        finish = start + d
        heapq.heappush(free, finish)
        done[i] = finish
    return done


def fifo_latencies(
    arrivals: Sequence[float], durations: Sequence[float], workers: int
) -> list[float]:
    """Arrival-to-completion time of each task under :func:`fifo_completions`."""
    done = fifo_completions(arrivals, durations, workers)
    return [c - a for c, a in zip(done, arrivals)]


def fifo_makespan(durations: Sequence[float], workers: int) -> float:
    """Makespan of a batch (all tasks arrive at 0, served in the given order) under greedy FIFO."""
    if not durations:
        return 0.0
    return max(fifo_completions([0.0] * len(durations), durations, workers))


def makespan_lower_bound(durations: Sequence[float], workers: int) -> float:
    """``max(sum/W, max)``: no schedule on ``workers`` workers finishes the batch sooner."""
    if workers < 1:
        raise ValueError("workers must be >= 1")
    if not durations:
        return 0.0
    return max(math.fsum(durations) / workers, max(durations))


def brent_speedup(work: float, span: float, workers: int) -> float:
    """Speedup bound ``work / max(work/W, span)`` of a fork-join computation on ``workers``."""
    if work <= 0:
        return 1.0
    return work / max(work / workers, span)


def round_robin_steps(
    agents: int, steps: int, step_s: float, workers: int
) -> tuple[list[float], float]:
    """``(per-step latencies, makespan)`` of ``agents`` self-driven agents of ``steps`` steps of
    ``step_s`` each on ``workers`` zero-overhead workers.

    Every agent is ready at 0; a step starts on the worker that frees up first, taking the agent
    that has been ready longest (ties: lower index), and the agent's next step is ready when
    this one ends: round-robin.  A step's latency is the time from the end of the agent's
    previous step (0 for its first) to the end of this one, so with ``agents >> workers`` it is
    about ``agents * step_s / workers``.  Latencies are in the order the steps start, so
    with ``step_s > 0`` the first ``agents`` of them are the agents' first steps.
    """
    if workers < 1:
        raise ValueError("workers must be >= 1")
    if agents < 0 or steps < 0 or step_s < 0:
        raise ValueError("agents, steps and step_s must be >= 0")
    if agents == 0 or steps == 0:
        return [], 0.0
    ready = [(0.0, i) for i in range(agents)]  # (ready time, agent): a heap
    free = [0.0] * min(workers, agents)
    last = [0.0] * agents
    left = [steps] * agents
    lat: list[float] = []
    makespan = 0.0
    while ready:
        t_ready, i = heapq.heappop(ready)
        start = max(t_ready, heapq.heappop(free))
        end = start + step_s
        heapq.heappush(free, end)
        lat.append(end - last[i])
        last[i] = end
        makespan = max(makespan, end)
        left[i] -= 1
        if left[i]:
            heapq.heappush(ready, (end, i))
    return lat, makespan


def step_boundary_replies(
    calls: int, bulk_step_s: float, call_s: float, workers: int, seed: int
) -> list[float]:
    """Reply times of ``calls`` calls to an interactive agent while bulk agents with steps of
    ``bulk_step_s`` keep all ``workers`` busy, under preemption at step boundaries.

    A call arrives at a random moment of every worker's current bulk step (each worker's
    remaining time uniform in ``[0, bulk_step_s)``, independently, seeded), waits for the first
    of them to end, then runs ``call_s``: ``min(remaining) + call_s``, never more than
    ``bulk_step_s + call_s``.
    """
    if workers < 1:
        raise ValueError("workers must be >= 1")
    rng = random.Random(seed)
    return [
        min(rng.random() * bulk_step_s for _ in range(workers)) + call_s for _ in range(calls)
    ]


# --------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks.

    Matches ``numpy.percentile(values, q)`` (method ``"linear"``).  Raises on empty input.
    """
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= q <= 100.0:
        raise ValueError("q must be in [0, 100]")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    frac = pos - lo
    return xs[lo] + (xs[hi] - xs[lo]) * frac


_SUMMARY_POINTS = (("p50", 50.0), ("p90", 90.0), ("p99", 99.0), ("p99_9", 99.9))


def latency_summary(values: Sequence[float], scale: float = 1e3) -> dict[str, float]:
    """p50/p90/p99/p99.9/max/mean of ``values`` (seconds) times ``scale`` (default: ms).

    Keys: ``p50``, ``p90``, ``p99``, ``p99_9``, ``max``, ``mean``.
    """
    out = {name: percentile(values, q) * scale for name, q in _SUMMARY_POINTS}
    out["max"] = max(values) * scale
    out["mean"] = math.fsum(values) / len(values) * scale
    return out


# --------------------------------------------------------------------------- traces


def poisson_arrivals(n: int, rate: float, seed: int, start: float = 0.0) -> list[float]:
    """``n`` arrival times (seconds, increasing) of a Poisson process of ``rate`` per second."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    rng = random.Random(seed)
    t = start
    out = []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def pareto_durations(n: int, shape: float, mean: float, cap: float, seed: int) -> list[float]:
    """``n`` Pareto durations of ``shape`` and (uncapped) ``mean``, each clipped to ``cap``.

    The scale is ``x_m = mean * (shape - 1) / shape``; samples are drawn by inverse CDF,
    ``x_m / U**(1/shape)``.  The cap lowers the mean a little; see :func:`pareto_capped_mean`.
    """
    if shape <= 1.0:
        raise ValueError("shape must be > 1 for a finite mean")
    xm = mean * (shape - 1.0) / shape
    rng = random.Random(seed)
    inv = 1.0 / shape
    # 1 - random() is in (0, 1], so the power is finite.
    return [min(cap, xm / (1.0 - rng.random()) ** inv) for _ in range(n)]


def pareto_capped_mean(shape: float, mean: float, cap: float) -> float:
    """Expected value of :func:`pareto_durations` samples: ``E[min(X, cap)]``."""
    xm = mean * (shape - 1.0) / shape
    if cap <= xm:
        return cap
    # E[min(X,c)] = E[X] - E[(X-c)+] and E[(X-c)+] = xm^a c^(1-a) / (a-1)
    return mean - xm**shape * cap ** (1.0 - shape) / (shape - 1.0)
