"""The plain-task workloads of ``stealer bench``: ``start``, ``overhead``, ``latency`` and
``skew`` (functions ``run_<name>(system, workers, quick) -> dict``), their sizes and traces,
and the ideal of each.  Registered in :data:`stealer.bench.cli.WORKLOADS`; ``run_latency`` and
``run_overhead`` are also :mod:`stealer.tune`'s default workload.

Workloads (``--quick`` sizes in brackets):

- ``start``: executor ready time (constructor + first no-op result) and shutdown time; the
  median of 5 [3] fresh executors.
- ``overhead``: 20,000 [2,000] no-op tasks through ``submit`` (then wait for all), through
  ``map`` with the default chunksize 1, and through ``map`` with chunksize 64; µs per task
  and tasks/s.
- ``latency``: open-loop Poisson arrivals of 1 ms busy tasks at 70% load of ``workers``
  (10,000 [2,000] tasks, seeded).  The client sleeps until each scheduled arrival
  (``time.sleep`` then a spin for the last 200 µs) and submits; latency is the time the
  future completes (an ``add_done_callback`` reading ``perf_counter``) minus the *scheduled*
  arrival, so a client that falls behind counts against the executor, as in an open system.
  p50/p90/p99/p99.9/max in ms; ``start_p99_ms`` is scheduled arrival to the task starting in
  its worker (one monotonic clock on Linux) and ``client_lag_max_ms`` how late the client
  submitted.  The heap is *not* frozen: the client's collector runs as it does for users.
  It runs twice: with the harness's own heap ("small": the main rows) and with 100,000 more
  live objects ("large": ``large_*``); ``--frozen-latency`` adds a third run after
  ``gc.collect(); gc.freeze()`` ("frozen": collections then scan only what the run makes;
  fair between systems, but a tail users do not see).  ``gcN_per_100k``: the client's
  generation-N collections during the run per 100,000 tasks.  ``samples_ms`` keeps the
  (small-heap) latency distribution for the CDF plot (sorted,
  downsampled to at most :data:`MAX_SAMPLES` quantiles; not shown in the table).
- ``skew``: 2,000 [400] tasks of capped Pareto durations (shape 1.5, mean 2 ms, cap 200 ms,
  seeded), all submitted at once; makespan and efficiency ``(sum of work / W) / makespan``.
  The ideal is the greedy FIFO makespan of the same durations in the same order; the lower
  bound ``max(sum/W, max)`` is in ``ideal.lower_bound_s``.
"""

from __future__ import annotations

import concurrent.futures as cf
import gc
import math
import statistics
import time
from collections.abc import Callable
from functools import cache
from typing import Any

from stealer.bench import ideal as _ideal
from stealer.bench import workloads as _wl
from stealer.bench.harness import (
    WAIT_TIMEOUT_S,
    _open,
    _report,
    _size,
    _wait_all,
    downsample,
    precise_sleep_until,
)
from stealer.bench.systems import System

__all__ = [
    "START_TRIALS",
    "OVERHEAD_TASKS",
    "LATENCY_TASKS",
    "SKEW_TASKS",
    "LATENCY_HEAPS",
    "run_start",
    "run_overhead",
    "run_latency",
    "run_skew",
    "latency_trace",
    "ideal_latency",
    "skew_trace",
]


START_TRIALS = {"full": 5, "quick": 3, "tiny": 1}
OVERHEAD_TASKS = {"full": 20_000, "quick": 2_000, "tiny": 300}
LATENCY_TASKS = {"full": 10_000, "quick": 2_000, "tiny": 300}
SKEW_TASKS = {"full": 2_000, "quick": 400, "tiny": 80}


def run_start(system: System, workers: int, quick: bool | str) -> dict[str, Any]:
    """Ready time (constructor + first no-op result) and shutdown time, median of fresh starts."""
    trials = START_TRIALS[_size(quick)]
    ready, stop = [], []
    for i in range(trials):
        _report(i / trials)
        ex, r = _open(system, workers)
        t0 = time.perf_counter()
        ex.shutdown(wait=True)
        stop.append(time.perf_counter() - t0)
        ready.append(r)
    return {
        "ready_s": statistics.median(ready),
        "ready_max_s": max(ready),
        "shutdown_s": statistics.median(stop),
        "trials": trials,
    }


def run_overhead(system: System, workers: int, quick: bool | str) -> dict[str, Any]:
    """No-op tasks through submit, map (chunksize 1) and map (chunksize 64)."""
    n = OVERHEAD_TASKS[_size(quick)]
    chunk = 64
    ex, ready = _open(system, workers)
    try:
        t0 = time.perf_counter()
        futures = [ex.submit(_wl.noop, i) for i in range(n)]
        t_submitted = time.perf_counter()
        _wait_all(futures)
        t1 = time.perf_counter()
        if any(f.result() != i for i, f in enumerate(futures)):
            raise RuntimeError(f"{system.name}: wrong no-op results via submit")
        del futures
        _report(0.4)

        t2 = time.perf_counter()
        out = list(ex.map(_wl.noop, range(n), timeout=WAIT_TIMEOUT_S))
        t3 = time.perf_counter()
        if out != list(range(n)):
            raise RuntimeError(f"{system.name}: wrong no-op results via map")
        _report(0.8)

        t4 = time.perf_counter()
        out = list(ex.map(_wl.noop, range(n), timeout=WAIT_TIMEOUT_S, chunksize=chunk))
        t5 = time.perf_counter()
        if out != list(range(n)):
            raise RuntimeError(f"{system.name}: wrong no-op results via map(chunksize)")
    finally:
        ex.shutdown(wait=True)
    return {
        "tasks": n,
        "submit_us": (t1 - t0) / n * 1e6,
        "submit_tasks_per_s": n / (t1 - t0),
        "submit_call_us": (t_submitted - t0) / n * 1e6,
        "map_us": (t3 - t2) / n * 1e6,
        "map_tasks_per_s": n / (t3 - t2),
        "map_chunked_us": (t5 - t4) / n * 1e6,
        "map_chunked_tasks_per_s": n / (t5 - t4),
        "chunksize": chunk,
        "ready_s": ready,
        "ideal": {},
    }


LATENCY_TASK_S = 1e-3
LATENCY_LOAD = 0.7
LATENCY_SEED = 7


def latency_trace(workers: int, quick: bool | str) -> tuple[list[float], float]:
    """``(arrival offsets in s, task duration in s)`` of the latency workload."""
    n = LATENCY_TASKS[_size(quick)]
    rate = LATENCY_LOAD * workers / LATENCY_TASK_S
    return _ideal.poisson_arrivals(n, rate, seed=LATENCY_SEED), LATENCY_TASK_S


#: The latency workload's client heaps: "small" (the harness only) and "large" (100,000 more
#: live objects), neither frozen: the tail users get, with the collector running as it does
#: for them.  ``--frozen-latency`` adds "frozen" (gc.collect(); gc.freeze() first: the
#: collections then scan only what the run makes; fair between systems, but no user does it).
LATENCY_HEAPS = ["small", "large"]
LATENCY_BALLAST = 100_000


def _gc_counts() -> list[int]:
    return [g["collections"] for g in gc.get_stats()]


def run_latency(system: System, workers: int, quick: bool | str) -> dict[str, Any]:
    """Open-loop Poisson arrivals of 1 ms tasks at 70% load; arrival-to-result latency, for
    each client heap of LATENCY_HEAPS (the first gives the main keys, the others theirs
    prefixed: ``large_p99_ms``...)."""
    result: dict[str, Any] = {}
    for i, heap in enumerate(LATENCY_HEAPS):
        r = _latency_once(system, workers, quick, heap)
        if i == 0:
            result.update(r)
        else:
            for k in ("p50_ms", "p99_ms", "p99_9_ms", "max_ms", "gc0_per_100k", "gc1_per_100k",
                      "gc2_per_100k"):
                result[f"{heap}_{k}"] = r[k]
    result["heaps"] = list(LATENCY_HEAPS)
    return result


def _latency_once(system: System, workers: int, quick: bool | str,
                  heap: str) -> dict[str, Any]:
    arrivals, dur = latency_trace(workers, quick)
    n = len(arrivals)
    done_at = [math.nan] * n
    submitted_at = [0.0] * n

    def on_done(i: int) -> Callable[[cf.Future[Any]], None]:
        def record(_f: cf.Future[Any]) -> None:
            done_at[i] = time.perf_counter()

        return record

    ex, ready = _open(system, workers)
    ballast = [[i] for i in range(LATENCY_BALLAST)] if heap == "large" else None
    gc.collect()
    if heap == "frozen":  # the collections then scan only what the run makes
        gc.freeze()
    gc0 = _gc_counts()
    try:
        futures: list[cf.Future[tuple[int, int]]] = []
        t0 = time.perf_counter() + 0.02
        for i, a in enumerate(arrivals):
            if not i & 127:
                _report(i / n)
            precise_sleep_until(t0 + a)
            submitted_at[i] = time.perf_counter()
            f = ex.submit(_wl.timed_busy, dur)
            f.add_done_callback(on_done(i))
            futures.append(f)
        _wait_all(futures)
        gc1 = _gc_counts()
        starts_ns = [f.result()[0] for f in futures]
    finally:
        if heap == "frozen":
            gc.unfreeze()
        ex.shutdown(wait=True)
        del ballast
    if any(math.isnan(d) for d in done_at):  # callbacks run before wait() returns
        raise RuntimeError(f"{system.name}: a done callback did not run")
    lat = [d - (t0 + a) for d, a in zip(done_at, arrivals)]
    start_delay = [s * 1e-9 - (t0 + a) for s, a in zip(starts_ns, arrivals)]
    lag = [s - (t0 + a) for s, a in zip(submitted_at, arrivals)]
    result: dict[str, Any] = {"tasks": n, "load": LATENCY_LOAD, "task_ms": dur * 1e3}
    result.update({f"{k}_ms": v for k, v in _ideal.latency_summary(lat).items()})
    result["start_p50_ms"] = _ideal.percentile(start_delay, 50) * 1e3
    result["start_p99_ms"] = _ideal.percentile(start_delay, 99) * 1e3
    result["client_lag_p99_ms"] = _ideal.percentile(lag, 99) * 1e3
    result["client_lag_max_ms"] = max(lag) * 1e3
    result["duration_s"] = max(done_at) - t0
    result["ready_s"] = ready
    result["samples_ms"] = downsample([x * 1e3 for x in lat])
    result["ideal"] = ideal_latency(workers, quick)
    result["heap"] = heap
    # the client's collections during the run, per 100,000 tasks (gen0, gen1, gen2)
    for g, (a, b) in enumerate(zip(gc0, gc1)):
        result[f"gc{g}_per_100k"] = (b - a) * 100_000 / n
    return result


def ideal_latency(workers: int, quick: bool | str) -> dict[str, Any]:
    """The ideal (zero-overhead greedy FIFO) latency summary of the latency trace, with its
    ``samples_ms`` (a fresh dict each call; the simulation is cached)."""
    out = dict(_ideal_latency(workers, _size(quick)))
    out["samples_ms"] = list(out["samples_ms"])
    return out


@cache
def _ideal_latency(workers: int, size: str) -> dict[str, Any]:
    arrivals, dur = latency_trace(workers, size)
    lat = _ideal.fifo_latencies(arrivals, [dur] * len(arrivals), workers)
    out: dict[str, Any] = {f"{k}_ms": v for k, v in _ideal.latency_summary(lat).items()}
    waits = [x - dur for x in lat]
    out["start_p50_ms"] = _ideal.percentile(waits, 50) * 1e3
    out["start_p99_ms"] = _ideal.percentile(waits, 99) * 1e3
    out["samples_ms"] = tuple(downsample([x * 1e3 for x in lat]))
    return out


SKEW_SHAPE = 1.5
SKEW_MEAN_S = 2e-3
SKEW_CAP_S = 0.2
SKEW_SEED = 11


def skew_trace(quick: bool | str) -> list[float]:
    """Durations (s) of the skew workload."""
    n = SKEW_TASKS[_size(quick)]
    return _ideal.pareto_durations(n, SKEW_SHAPE, SKEW_MEAN_S, SKEW_CAP_S, seed=SKEW_SEED)


def run_skew(system: System, workers: int, quick: bool | str) -> dict[str, Any]:
    """A batch of capped-Pareto busy tasks submitted at once; makespan and efficiency."""
    durations = skew_trace(quick)
    work = math.fsum(durations)
    last = [0.0]

    def record(_f: cf.Future[Any]) -> None:
        t = time.perf_counter()
        if t > last[0]:
            last[0] = t

    ex, ready = _open(system, workers)
    try:
        t0 = time.perf_counter()
        futures = []
        for d in durations:
            f = ex.submit(_wl.busy, d)
            f.add_done_callback(record)
            futures.append(f)
        _wait_all(futures)
    finally:
        ex.shutdown(wait=True)
    makespan = last[0] - t0
    ideal_ms = _ideal.fifo_makespan(durations, workers)
    bound = _ideal.makespan_lower_bound(durations, workers)
    return {
        "tasks": len(durations),
        "work_s": work,
        "makespan_s": makespan,
        "efficiency": work / workers / makespan,
        "ready_s": ready,
        "ideal": {
            "makespan_s": ideal_ms,
            "efficiency": work / workers / ideal_ms,
            "lower_bound_s": bound,
        },
    }
