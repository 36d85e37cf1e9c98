"""Run the yardstick workloads (DESIGN.md section 7) on several executors side by side.

Each workload is a function ``run_<name>(system, workers, quick) -> dict`` that opens a fresh
executor from ``system`` (a :class:`System`: a name and a factory ``workers -> Executor``),
measures, shuts it down, and returns plain JSON-able numbers, with the zero-overhead ideal of
the same trace on the same number of workers under ``"ideal"`` (see
:mod:`stealer.bench.ideal`).  Every result also carries ``ready_s``: constructor plus the first
no-op result.

Workloads (``--quick`` sizes in brackets; all together finish in seconds on 2 cores):

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
  submitted.
- ``skew``: 2,000 [400] tasks of capped Pareto durations (shape 1.5, mean 2 ms, cap 200 ms,
  seeded), all submitted at once; makespan and efficiency ``(sum of work / W) / makespan``.
  The ideal is the greedy FIFO makespan of the same durations in the same order; the lower
  bound ``max(sum/W, max)`` is in ``ideal.lower_bound_s``.
- ``forkjoin``: fib with a sequential cutoff and the UTS binomial tree
  (:mod:`stealer.bench.workloads`); speedup over one process.  The one-process time is
  ``stealer.run_inline`` of the same generator task when stealer is importable, else the
  plain sequential function (``fib_seq``/``uts_seq``); both are in the JSON.  A system with
  native fork-join (stealer) submits the root generator task; a plain executor runs the same
  decomposition client-driven: fib's leaf sub-problems through ``map``, and UTS as a loop that
  submits :func:`~stealer.bench.workloads.uts_expand` on each bag and resubmits the frontier
  it returns.  Results are checked against the sequential answer.

Systems: ``stealer`` (:class:`stealer.Executor`; skipped with a message while it does not
import), ``process`` (:class:`concurrent.futures.ProcessPoolExecutor`), and ``loky`` when
installed.  :func:`register_system` adds more.

``main(argv)`` prints an aligned table (workload, metric, one column per system, ideal, ratio
= first system / second system, i.e. stealer / process by default) and writes JSON with
``--json``.  With ``--repeat N`` each (workload, system) runs N times, systems interleaved,
and the table shows medians.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import gc
import json
import math
import os
import platform
import queue
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from stealer.bench import ideal as _ideal
from stealer.bench import workloads as _wl

__all__ = [
    "System",
    "SystemUnavailable",
    "register_system",
    "load_systems",
    "precise_sleep_until",
    "run_start",
    "run_overhead",
    "run_latency",
    "run_skew",
    "run_forkjoin",
    "WORKLOADS",
    "format_table",
    "main",
]

WAIT_TIMEOUT_S = 600.0  # upper bound on any single wait, so a broken executor cannot hang us

# --------------------------------------------------------------------------- systems


class SystemUnavailable(Exception):
    """A system cannot be used in this environment (not installed, not implemented yet)."""


@dataclass(frozen=True)
class System:
    """An executor kind under test.

    ``make(workers)`` returns a fresh :class:`concurrent.futures.Executor`.  ``forkjoin`` is
    ``"native"`` when the executor runs generator tasks that ``stealer.spawn`` children, else
    ``"flat"`` (the runner decomposes fork-join work on the client side).
    """

    name: str
    make: Callable[[int], cf.Executor]
    forkjoin: str = "flat"
    note: str = ""


def _load_stealer() -> System:
    try:
        import stealer
    except Exception as exc:  # any import-time failure of a package under construction
        raise SystemUnavailable(f"'import stealer' failed: {exc!r}") from exc
    executor_cls = getattr(stealer, "Executor", None)
    if executor_cls is None:
        raise SystemUnavailable("stealer.Executor is not defined yet")

    def make(workers: int) -> cf.Executor:
        return executor_cls(max_workers=workers)

    return System("stealer", make, forkjoin="native")


def _load_process() -> System:
    def make(workers: int) -> cf.Executor:
        return cf.ProcessPoolExecutor(max_workers=workers)

    return System("process", make, forkjoin="flat")


def _load_loky() -> System:
    try:
        from loky import ProcessPoolExecutor as LokyExecutor
    except ImportError as exc:
        raise SystemUnavailable("loky is not installed") from exc

    def make(workers: int) -> cf.Executor:
        return LokyExecutor(max_workers=workers)

    return System("loky", make, forkjoin="flat")


_LOADERS: dict[str, Callable[[], System]] = {
    "stealer": _load_stealer,
    "process": _load_process,
    "loky": _load_loky,
}

DEFAULT_SYSTEMS = ("stealer", "process")


def register_system(name: str, loader: Callable[[], System]) -> None:
    """Make ``--systems NAME`` available; ``loader`` returns a :class:`System` or raises
    :class:`SystemUnavailable`."""
    _LOADERS[name] = loader


def load_systems(names: Sequence[str]) -> tuple[list[System], dict[str, str]]:
    """Load the named systems; returns ``(available, {skipped name: reason})``."""
    systems: list[System] = []
    skipped: dict[str, str] = {}
    for name in names:
        loader = _LOADERS.get(name)
        if loader is None:
            skipped[name] = f"unknown system (known: {', '.join(sorted(_LOADERS))})"
            continue
        try:
            systems.append(loader())
        except SystemUnavailable as exc:
            skipped[name] = str(exc)
    return systems, skipped


# --------------------------------------------------------------------------- helpers


def precise_sleep_until(deadline: float, spin_s: float = 200e-6) -> None:
    """Sleep until ``perf_counter() >= deadline``: ``time.sleep`` for most of it, then spin
    for the last ``spin_s`` (sleep alone overshoots by 50-100 µs or more)."""
    while True:
        remaining = deadline - time.perf_counter()
        if remaining <= 0.0:
            return
        if remaining > spin_s:
            time.sleep(remaining - spin_s)


def _open(system: System, workers: int) -> tuple[cf.Executor, float]:
    """A fresh executor, its ready time (constructor + first no-op result), all workers warm."""
    gc.collect()
    t0 = time.perf_counter()
    ex = system.make(workers)
    try:
        if ex.submit(_wl.noop, 0).result(timeout=WAIT_TIMEOUT_S) != 0:
            raise RuntimeError(f"{system.name}: noop returned a wrong result")
        ready = time.perf_counter() - t0
        wait_ready = getattr(ex, "wait_ready", None)
        if wait_ready is not None:
            wait_ready(timeout=WAIT_TIMEOUT_S)
        # Make sure every worker process exists and has run something (lazy spawning).
        _wait_all([ex.submit(_wl.busy, 0.005) for _ in range(2 * workers)])
    except BaseException:
        ex.shutdown(wait=True, cancel_futures=True)
        raise
    return ex, ready


def _wait_all(futures: Sequence[cf.Future[Any]]) -> None:
    done, not_done = cf.wait(futures, timeout=WAIT_TIMEOUT_S)
    if not_done:
        raise TimeoutError(f"{len(not_done)} of {len(futures)} tasks unfinished after wait")
    for f in done:
        f.result()  # re-raise a task's exception


def _median_dicts(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Key-wise median of numeric leaves across runs (nested dicts too); others from run 0."""
    out: dict[str, Any] = {}
    for key, first in runs[0].items():
        values = [r.get(key) for r in runs]
        if isinstance(first, dict):
            out[key] = _median_dicts([v for v in values if isinstance(v, dict)])
        elif isinstance(first, (int, float)) and not isinstance(first, bool):
            nums = [v for v in values if isinstance(v, (int, float))]
            out[key] = statistics.median(nums)
        else:
            out[key] = first
    return out


# --------------------------------------------------------------------------- workloads


def run_start(system: System, workers: int, quick: bool) -> dict[str, Any]:
    """Ready time (constructor + first no-op result) and shutdown time, median of fresh starts."""
    trials = 3 if quick else 5
    ready, stop = [], []
    for _ in range(trials):
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


def run_overhead(system: System, workers: int, quick: bool) -> dict[str, Any]:
    """No-op tasks through submit, map (chunksize 1) and map (chunksize 64)."""
    n = 2_000 if quick else 20_000
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

        t2 = time.perf_counter()
        out = list(ex.map(_wl.noop, range(n), timeout=WAIT_TIMEOUT_S))
        t3 = time.perf_counter()
        if out != list(range(n)):
            raise RuntimeError(f"{system.name}: wrong no-op results via map")

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


def latency_trace(workers: int, quick: bool) -> tuple[list[float], float]:
    """``(arrival offsets in s, task duration in s)`` of the latency workload."""
    n = 2_000 if quick else 10_000
    rate = LATENCY_LOAD * workers / LATENCY_TASK_S
    return _ideal.poisson_arrivals(n, rate, seed=LATENCY_SEED), LATENCY_TASK_S


def run_latency(system: System, workers: int, quick: bool) -> dict[str, Any]:
    """Open-loop Poisson arrivals of 1 ms tasks at 70% load; arrival-to-result latency."""
    arrivals, dur = latency_trace(workers, quick)
    n = len(arrivals)
    done_at = [math.nan] * n
    submitted_at = [0.0] * n

    def on_done(i: int) -> Callable[[cf.Future[Any]], None]:
        def record(_f: cf.Future[Any]) -> None:
            done_at[i] = time.perf_counter()

        return record

    ex, ready = _open(system, workers)
    try:
        futures: list[cf.Future[tuple[int, int]]] = []
        t0 = time.perf_counter() + 0.02
        for i, a in enumerate(arrivals):
            precise_sleep_until(t0 + a)
            submitted_at[i] = time.perf_counter()
            f = ex.submit(_wl.timed_busy, dur)
            f.add_done_callback(on_done(i))
            futures.append(f)
        _wait_all(futures)
        starts_ns = [f.result()[0] for f in futures]
    finally:
        ex.shutdown(wait=True)
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
    result["ideal"] = ideal_latency(workers, quick)
    return result


@cache
def ideal_latency(workers: int, quick: bool) -> dict[str, float]:
    """The ideal (zero-overhead greedy FIFO) latency summary of the latency trace."""
    arrivals, dur = latency_trace(workers, quick)
    lat = _ideal.fifo_latencies(arrivals, [dur] * len(arrivals), workers)
    out = {f"{k}_ms": v for k, v in _ideal.latency_summary(lat).items()}
    waits = [x - dur for x in lat]
    out["start_p50_ms"] = _ideal.percentile(waits, 50) * 1e3
    out["start_p99_ms"] = _ideal.percentile(waits, 99) * 1e3
    return out


SKEW_SHAPE = 1.5
SKEW_MEAN_S = 2e-3
SKEW_CAP_S = 0.2
SKEW_SEED = 11


def skew_trace(quick: bool) -> list[float]:
    """Durations (s) of the skew workload."""
    n = 400 if quick else 2_000
    return _ideal.pareto_durations(n, SKEW_SHAPE, SKEW_MEAN_S, SKEW_CAP_S, seed=SKEW_SEED)


def run_skew(system: System, workers: int, quick: bool) -> dict[str, Any]:
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


@dataclass(frozen=True)
class ForkJoinSizes:
    """Problem sizes of the forkjoin workload."""

    fib_n: int
    fib_cutoff: int
    uts: _wl.UTSParams = field(default_factory=_wl.UTSParams)
    uts_seed: int = _wl.UTS_ROOT_SEED


FORKJOIN_QUICK = ForkJoinSizes(fib_n=32, fib_cutoff=20, uts=_wl.UTS_QUICK)
FORKJOIN_DEFAULT = ForkJoinSizes(fib_n=34, fib_cutoff=21, uts=_wl.UTS_DEFAULT)


def _fib_exact(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def _inline_runner() -> Callable[..., Any] | None:
    try:
        import stealer
    except Exception:
        return None
    return getattr(stealer, "run_inline", None)


@cache
def forkjoin_baseline(quick: bool) -> dict[str, Any]:
    """One-process times of the forkjoin problems (measured once per process, then cached).

    ``fib_s``/``uts_s`` are the baseline speedups divide by: ``stealer.run_inline`` of the
    generator task when available (``baseline == "run_inline"``), else the plain sequential
    function (``baseline == "sequential"``).  ``fib_seq_s``/``uts_seq_s`` are always the plain
    sequential functions.
    """
    sz = FORKJOIN_QUICK if quick else FORKJOIN_DEFAULT
    out: dict[str, Any] = {}
    gc.collect()
    t0 = time.perf_counter()
    fib_value = _wl.fib_seq(sz.fib_n)
    out["fib_seq_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    uts_value = _wl.uts_seq(sz.uts_seed, 0, sz.uts)
    out["uts_seq_s"] = time.perf_counter() - t0
    if fib_value != _fib_exact(sz.fib_n):
        raise RuntimeError("fib_seq is wrong")
    nodes, depth = _wl.uts_stats(sz.uts_seed, 0, sz.uts)
    if uts_value != nodes:
        raise RuntimeError("uts_seq disagrees with uts_stats")
    out.update(fib_value=fib_value, uts_nodes=nodes, uts_depth=depth)
    inline = _inline_runner()
    if inline is not None:
        t0 = time.perf_counter()
        got = inline(_wl.fib, sz.fib_n, sz.fib_cutoff)
        out["fib_s"] = time.perf_counter() - t0
        if got != fib_value:
            raise RuntimeError(f"run_inline(fib) returned {got}, expected {fib_value}")
        t0 = time.perf_counter()
        got = inline(_wl.uts, sz.uts_seed, 0, sz.uts)
        out["uts_s"] = time.perf_counter() - t0
        if got != nodes:
            raise RuntimeError(f"run_inline(uts) returned {got}, expected {nodes}")
        out["baseline"] = "run_inline"
    else:
        out["fib_s"] = out["fib_seq_s"]
        out["uts_s"] = out["uts_seq_s"]
        out["baseline"] = "sequential"
    return out


def _uts_client_driven(ex: cf.Executor, seed: int, params: _wl.UTSParams) -> tuple[int, int]:
    """UTS on a plain executor: submit ``uts_expand`` per bag, resubmit the returned frontier
    split in two, until no bag is left.  Returns ``(node count, tasks run)``.

    Completed futures arrive through a queue fed by done callbacks (O(1) per completion;
    ``concurrent.futures.wait`` over the whole pending set would cost the client O(pending)).
    """
    done_q: queue.SimpleQueue[cf.Future[Any]] = queue.SimpleQueue()

    def submit(bag: Sequence[tuple[int, int]]) -> None:
        ex.submit(_wl.uts_expand, bag, params).add_done_callback(done_q.put)

    submit(((seed, 0),))
    outstanding = 1
    total = tasks = 0
    while outstanding:
        f = done_q.get(timeout=WAIT_TIMEOUT_S)
        outstanding -= 1
        count, frontier = f.result()
        total += count
        tasks += 1
        for part in _wl.uts_split(frontier):
            submit(part)
            outstanding += 1
    return total, tasks


def run_forkjoin(system: System, workers: int, quick: bool) -> dict[str, Any]:
    """fib and UTS on the executor; speedup over the one-process baseline."""
    sz = FORKJOIN_QUICK if quick else FORKJOIN_DEFAULT
    base = forkjoin_baseline(quick)
    ex, ready = _open(system, workers)
    try:
        if system.forkjoin == "native":
            t0 = time.perf_counter()
            fib_value = ex.submit(_wl.fib, sz.fib_n, sz.fib_cutoff).result(WAIT_TIMEOUT_S)
            fib_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            nodes = ex.submit(_wl.uts, sz.uts_seed, 0, sz.uts).result(WAIT_TIMEOUT_S)
            uts_s = time.perf_counter() - t0
            uts_tasks = None  # not observable from the client
        else:
            t0 = time.perf_counter()
            leaves = _wl.fib_leaves(sz.fib_n, sz.fib_cutoff)
            fib_value = sum(ex.map(_wl.fib_seq, leaves, timeout=WAIT_TIMEOUT_S))
            fib_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            nodes, uts_tasks = _uts_client_driven(ex, sz.uts_seed, sz.uts)
            uts_s = time.perf_counter() - t0
    finally:
        ex.shutdown(wait=True)
    if fib_value != base["fib_value"]:
        raise RuntimeError(f"{system.name}: fib returned {fib_value}, expected {base['fib_value']}")
    if nodes != base["uts_nodes"]:
        raise RuntimeError(f"{system.name}: uts counted {nodes}, expected {base['uts_nodes']}")
    node_s = sz.uts.node_seconds
    return {
        "fib_n": sz.fib_n,
        "fib_cutoff": sz.fib_cutoff,
        "fib_tasks": _wl.fib_task_count(sz.fib_n, sz.fib_cutoff),
        "fib_s": fib_s,
        "fib_speedup": base["fib_s"] / fib_s,
        "uts_nodes": nodes,
        "uts_tasks": uts_tasks,
        "uts_s": uts_s,
        "uts_speedup": base["uts_s"] / uts_s,
        "baseline_fib_s": base["fib_s"],
        "baseline_uts_s": base["uts_s"],
        "fib_seq_s": base["fib_seq_s"],
        "uts_seq_s": base["uts_seq_s"],
        "fib_speedup_vs_seq": base["fib_seq_s"] / fib_s,
        "uts_speedup_vs_seq": base["uts_seq_s"] / uts_s,
        "ready_s": ready,
        "info": {"mode": system.forkjoin, "baseline": base["baseline"]},
        "ideal": {
            # fib's span (one leaf) is negligible next to its work: the bound is W.
            "fib_speedup": float(workers),
            "uts_speedup": _ideal.brent_speedup(
                base["uts_nodes"] * node_s, (base["uts_depth"] + 1) * node_s, workers
            ),
        },
    }


WORKLOADS: dict[str, Callable[[System, int, bool], dict[str, Any]]] = {
    "start": run_start,
    "overhead": run_overhead,
    "latency": run_latency,
    "skew": run_skew,
    "forkjoin": run_forkjoin,
}

# What the table shows per workload: (key, label, format).
_ROWS: dict[str, list[tuple[str, str, str]]] = {
    "start": [("ready_s", "ready (s)", ".3f"), ("shutdown_s", "shutdown (s)", ".3f")],
    "overhead": [
        ("submit_us", "submit µs/task", ".1f"),
        ("submit_tasks_per_s", "submit tasks/s", ",.0f"),
        ("submit_call_us", "submit() call µs", ".1f"),
        ("map_us", "map µs/task", ".1f"),
        ("map_chunked_us", "map(chunk=64) µs/task", ".2f"),
    ],
    "latency": [
        ("p50_ms", "p50 ms", ".2f"),
        ("p90_ms", "p90 ms", ".2f"),
        ("p99_ms", "p99 ms", ".2f"),
        ("p99_9_ms", "p99.9 ms", ".2f"),
        ("max_ms", "max ms", ".2f"),
        ("start_p99_ms", "arrival→start p99 ms", ".2f"),
        ("client_lag_max_ms", "client lag max ms", ".2f"),
    ],
    "skew": [
        ("makespan_s", "makespan s", ".3f"),
        ("efficiency", "efficiency", ".3f"),
    ],
    "forkjoin": [
        ("fib_speedup", "fib speedup", ".2f"),
        ("fib_s", "fib s", ".3f"),
        ("uts_speedup", "uts speedup", ".2f"),
        ("uts_s", "uts s", ".3f"),
    ],
}


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return format(value, spec)


def format_table(results: dict[str, dict[str, Any]], system_names: Sequence[str]) -> str:
    """Aligned plain-text table of median results.

    ``results[workload]["systems"][name]`` holds each system's median dict and
    ``results[workload]["ideal"]`` the ideal.  ``ratio`` is first system / second system.
    """
    header = ["workload", "metric", *system_names, "ideal"]
    ratio_label = (
        f"ratio {system_names[0]}/{system_names[1]}" if len(system_names) >= 2 else "ratio"
    )
    header.append(ratio_label)
    rows: list[list[str]] = []
    for workload, res in results.items():
        per_system = res.get("systems", {})
        ideal = res.get("ideal", {})
        for key, label, spec in _ROWS.get(workload, []):
            vals = [per_system.get(name, {}).get(key) for name in system_names]
            row = [workload, label, *(_fmt(v, spec) for v in vals), _fmt(ideal.get(key), spec)]
            ratio = None
            if len(vals) >= 2 and isinstance(vals[0], (int, float)) and vals[1]:
                ratio = vals[0] / vals[1]
            row.append(_fmt(ratio, ".2f"))
            rows.append(row)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        first = [c.ljust(w) for c, w in zip(cells[:2], widths[:2])]
        rest = [c.rjust(w) for c, w in zip(cells[2:], widths[2:])]
        return "  ".join(first + rest).rstrip()

    out = [line(header), line(["-" * w for w in widths])]
    out.extend(line(r) for r in rows)
    return "\n".join(out)


def _meta(args: argparse.Namespace, skipped: dict[str, str]) -> dict[str, Any]:
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "workers": args.workers,
        "quick": args.quick,
        "repeat": args.repeat,
        "systems": args.systems,
        "skipped": skipped,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="stealer-bench",
        description="Yardstick workloads (DESIGN.md §7) side by side with peers and the ideal.",
    )
    p.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated subset of {','.join(WORKLOADS)} (default: all)",
    )
    p.add_argument(
        "--systems",
        default=",".join(DEFAULT_SYSTEMS),
        help=f"comma-separated executors to compare, of {','.join(_LOADERS)}; "
        "the ratio column is first/second (default: stealer,process)",
    )
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--quick", action="store_true", help="small sizes (seconds in all)")
    p.add_argument("--repeat", type=int, default=1, help="runs per workload; medians shown")
    p.add_argument("--json", metavar="PATH", help="write all results and runs as JSON here")
    args = p.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.systems = [s for s in args.systems.split(",") if s]
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown:
        p.error(f"unknown workload(s): {', '.join(unknown)}")
    if args.workers < 1 or args.repeat < 1:
        p.error("--workers and --repeat must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry: run, print the table, optionally write JSON. Returns an exit code."""
    args = _parse(argv)
    systems, skipped = load_systems(args.systems)
    for name, reason in skipped.items():
        print(f"note: system {name!r} skipped: {reason}", file=sys.stderr)
    if not systems:
        print("error: no system to run", file=sys.stderr)
        return 2
    results: dict[str, dict[str, Any]] = {}
    for workload in args.workloads:
        fn = WORKLOADS[workload]
        runs: dict[str, list[dict[str, Any]]] = {s.name: [] for s in systems}
        for r in range(args.repeat):
            order = systems[r % len(systems) :] + systems[: r % len(systems)]
            for system in order:
                t0 = time.perf_counter()
                res = fn(system, args.workers, args.quick)
                print(
                    f"  {workload:<9} {system.name:<8} run {r + 1}/{args.repeat}"
                    f" {time.perf_counter() - t0:6.2f} s",
                    file=sys.stderr,
                )
                runs[system.name].append(res)
        medians = {name: _median_dicts(rs) for name, rs in runs.items()}
        ideal = next(iter(medians.values())).get("ideal", {})
        results[workload] = {"systems": medians, "ideal": ideal, "runs": runs}
    names = list(args.systems)  # keep skipped systems as columns of "—"
    print(
        f"workers={args.workers} quick={args.quick} repeat={args.repeat} "
        f"python={sys.version.split()[0]} cpus={os.cpu_count()}"
    )
    print(format_table(results, names))
    for name, reason in skipped.items():
        print(f"({name}: skipped — {reason})")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"meta": _meta(args, skipped), "results": results}, fh, indent=2)
            fh.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
