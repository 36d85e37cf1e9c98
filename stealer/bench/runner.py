"""Run the yardstick workloads (DESIGN.md section 7) on several executors side by side.

Each workload is a function ``run_<name>(system, workers, quick) -> dict`` that opens a fresh
executor from ``system`` (a :class:`System`: a name and a factory ``workers -> Executor``),
measures, shuts it down, and returns plain JSON-able numbers, with the zero-overhead ideal of
the same trace on the same number of workers under ``"ideal"`` (see
:mod:`stealer.bench.ideal`).  Every result also carries ``ready_s``: constructor plus the first
no-op result.  ``quick`` is ``False`` (full size), ``True`` (the ``--quick`` size) or one of
:data:`SIZES` (``"tiny"``: a few hundred tasks, for tests).

Workloads (``--quick`` sizes in brackets; all but ``agent_scale`` and ``lockstep`` together
finish in seconds on 2 cores; the default run leaves those two out):

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
- ``forkjoin``: fib with a sequential cutoff and the UTS binomial tree
  (:mod:`stealer.bench.workloads`); speedup over one process.  The one-process time is
  ``stealer.run_inline`` of the same generator task when stealer is importable, else the
  plain sequential function (``fib_seq``/``uts_seq``); both are in the JSON.  A system with
  native fork-join (stealer) submits the root generator task; a plain executor runs the same
  decomposition client-driven: fib's leaf sub-problems through ``map``, and UTS as a loop that
  submits :func:`~stealer.bench.workloads.uts_expand` on each bag and resubmits the frontier
  it returns.  Results are checked against the sequential answer.
- ``agents``: 200 [50] self-driven agents x 25 [10] steps of 0.5 ms busy work, each carrying
  a counter and a 1,000-float numpy array from step to step (:class:`~stealer.bench.
  workloads.StepState`; checked at every step and at the end).  stealer runs them as agents
  (``spawn_agent(StepAgent, state)``); a plain executor runs each step as a task that takes
  the state and returns it, the client resubmitting an agent's next step when its result
  arrives.  Makespan (run start to the client holding every final state), efficiency
  ``(sum of work / W) / makespan``, and the per-step latency p50/p99/max: the end of a step
  minus the end of the agent's previous step (the run's start for its first), both read in
  the worker with ``time.monotonic`` (one clock across processes on Linux).  The ideal is
  the zero-overhead round-robin schedule (:func:`stealer.bench.ideal.round_robin_steps`):
  step latency ~ agents x 0.5 ms / W (50 ms for 200 agents on 2 workers), efficiency 1.
  ``step_p99_later_ms`` leaves out every agent's first step (the start-up ramp: agents are
  spawned, adopted and spread over the workers while the first ones already step).
- ``tiers``: 8 bulk agents with 5 ms steps saturate every worker while one interactive agent
  gets a call every 10 ms (0.2 ms of work), 100 [30] calls after a 0.1 s warm-up and one
  unmeasured call; p50/p99/max of the reply time (client send to the future done, read in a
  done callback).  Plain executors run it client-driven: 8 chains of 5 ms tasks, each
  resubmitted by a client thread when the previous completes, and each call a task submitted
  in between (so a FIFO pool queues it behind the bulk tasks).  ``bulk_busy`` is the share of
  the workers' time in bulk steps while the calls ran (about 1 when saturated).  The ideal
  (:func:`stealer.bench.ideal.step_boundary_replies`) waits for the first bulk step of any
  worker to end, then runs the call: never more than ``bound_ms`` = 5.2 ms.
- ``agent_overhead`` (stealer only; n/a on plain pools): (a) 20 agents x 5,000 [500] steps
  that do nothing, on one worker: ``step_us`` = wall time / steps (spawn to the last final
  value, nothing subtracted) and ``turn_us`` the part inside the agents' turns (the worker's
  ``busy_ns`` counter: the step call and its bookkeeping, a checkpoint every 64 steps);
  (b) ping-pong: two agents bounce a counter 20,000 [2,000] times with ``v = yield
  other.call("ping", v)``, timed inside the caller; µs per round trip and round trips/s.
  Placement is not an API: the pair is respawned (up to 8 times) until the two live on
  different workers (``same_worker`` says if that failed; ``info`` has the tries and the
  workers' park/wake-up counts during the run).
- ``lockstep``: a client steps 32 agents x 0.5 ms and 256 x 0.05 ms in rounds, one call each
  per round (the RL vector environment); plain pools ship the state with each call; the
  one-process and process-per-agent pipe peers run in the stealer row (:mod:`stealer.bench.
  lockstep`).
- ``agent_scale`` (stealer only, and only when named in ``--workloads``: heavy):
  1,000,000 [20,000] idle message-only agents, started by one ``spawn_agents`` call, in one
  executor made with ``records=1 << 20`` [``1 << 15``] (the smallest power of two with room
  for every agent's record and the probes' messages).  ``create_s`` runs from the first spawn until nothing is left on the
  injector or any deque and a call to the last agent and to 100 others answered;
  ``bytes_per_agent`` = (growth of the client's and the workers' private resident memory,
  psutil ``rss - shared``, + the shared segment's whole size + what the overflow files that
  appeared hold in /dev/shm) / agents, also split into workers' heap, client (the refs it
  holds) and shared memory (segment and overflow files; ``overflow_files`` counts them: a
  spawn payload that fits neither a record's inline bytes nor a free block lives in one).
  Shared pages count once, by size, not in every process that maps them.  ``shutdown_s`` stops them all.
- ``user`` (``--workload MODULE:FUNCTION``): the user's function called ``--tasks`` times with
  ``--args`` (a JSON list) through each system, see :func:`run_user`.

Systems: ``stealer`` (:class:`stealer.Executor`; skipped with a message while it does not
import), ``process`` (:class:`concurrent.futures.ProcessPoolExecutor`), and the peers of
:mod:`stealer.bench.peers` (loky, mpire, dask, ray) when installed.  The default ``auto`` is
stealer, process and every installed peer.  :func:`register_system` adds more.  A system that
fails during a workload is reported (table cell ``—``, a note, ``meta.errors`` in the JSON)
and the run goes on; a workload that does not apply to a system (:class:`NotApplicable`: the
stealer-only agent workloads on a plain pool) is a ``—`` cell, an "n/a" note and
``meta.not_applicable``.

``main(argv)`` prints an aligned table (workload, metric, one column per system, ideal, ratio
= first system / second system, i.e. stealer / process by default), writes JSON (``--json``,
default ``bench-out/bench.json``) and PNG plots (``--plots DIR``, see
:mod:`stealer.bench.plots`).  With ``--repeat N`` each (workload, system) runs N times,
systems interleaved, and the table shows medians.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import gc
import heapq
import importlib
import itertools
import json
import math
import os
import platform
import queue
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from stealer.bench import ideal as _ideal
from stealer.bench import lockstep as _lockstep
from stealer.bench import peers as _peers
from stealer.bench import workloads as _wl
from stealer.bench.progress import Progress

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
    "run_agents",
    "run_tiers",
    "run_agent_overhead",
    "run_lockstep",
    "run_agent_scale",
    "NotApplicable",
    "run_user",
    "UserWorkload",
    "resolve_function",
    "downsample",
    "SIZES",
    "WORKLOADS",
    "DEFAULT_WORKLOADS",
    "format_table",
    "main",
]

WAIT_TIMEOUT_S = 600.0  # upper bound on any single wait, so a broken executor cannot hang us

#: Problem sizes: ``"full"`` (the default), ``"quick"`` (``--quick``) and ``"tiny"`` (tests).
SIZES = ("full", "quick", "tiny")

#: Latency samples kept per result for the CDF plot (quantiles of the sorted latencies).
MAX_SAMPLES = 2_000


def _size(quick: bool | str) -> str:
    """Normalise a workload's ``quick`` argument (bool or one of :data:`SIZES`) to a size."""
    if isinstance(quick, str):
        if quick not in SIZES:
            raise ValueError(f"unknown size {quick!r}; expected one of {', '.join(SIZES)}")
        return quick
    return "quick" if quick else "full"


# --------------------------------------------------------------------------- systems


class SystemUnavailable(Exception):
    """A system cannot be used in this environment (not installed, not implemented yet)."""


@dataclass(frozen=True)
class System:
    """An executor kind under test.

    ``make(workers)`` returns a fresh :class:`concurrent.futures.Executor`.  ``forkjoin`` is
    ``"native"`` when the executor runs generator tasks that ``stealer.spawn`` children, else
    ``"flat"`` (the runner decomposes fork-join work on the client side).  ``agents`` is
    ``"native"`` when the executor has ``spawn_agent`` (stealer agents; ``make`` then also takes
    ``records=``), else ``"flat"``: the agent workloads drive the same agents from the client,
    one task per step, and the stealer-only ones (``agent_overhead``, ``agent_scale``) are n/a.
    """

    name: str
    make: Callable[..., cf.Executor]
    forkjoin: str = "flat"
    note: str = ""
    agents: str = "flat"


class NotApplicable(Exception):
    """The workload does not apply to this system (an agent-only workload on a plain pool):
    reported as n/a, not as a failure."""


def _load_stealer() -> System:
    try:
        import stealer
    except Exception as exc:  # any import-time failure of a package under construction
        raise SystemUnavailable(f"'import stealer' failed: {exc!r}") from exc
    executor_cls = getattr(stealer, "Executor", None)
    if executor_cls is None:
        raise SystemUnavailable("stealer.Executor is not defined yet")

    def make(workers: int, **options: Any) -> cf.Executor:
        return executor_cls(max_workers=workers, **options)

    return System("stealer", make, forkjoin="native", agents="native")


def _load_process() -> System:
    def make(workers: int) -> cf.Executor:
        return cf.ProcessPoolExecutor(max_workers=workers)

    return System("process", make, forkjoin="flat")


def _peer_loader(name: str) -> Callable[[], System]:
    def load() -> System:
        try:
            make = _peers.load(name)
        except _peers.PeerUnavailable as exc:
            raise SystemUnavailable(str(exc)) from exc
        return System(name, make, forkjoin="flat")

    return load


_LOADERS: dict[str, Callable[[], System]] = {
    "stealer": _load_stealer,
    "process": _load_process,
    **{name: _peer_loader(name) for name in _peers.PEERS},
}

#: What ``--systems auto`` (the default) means: these plus every installed peer.
DEFAULT_SYSTEMS = ("stealer", "process")


def auto_systems() -> tuple[list[str], list[str]]:
    """``(systems to run, peers not installed)`` for ``--systems auto``."""
    present = _peers.installed()
    missing = [name for name in _peers.PEERS if name not in present]
    return [*DEFAULT_SYSTEMS, *present], missing


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


def _open(system: System, workers: int, **options: Any) -> tuple[cf.Executor, float]:
    """A fresh executor, its ready time (constructor + first no-op result), all workers warm.
    ``options`` go to ``system.make`` (only ``records=`` for a system with native agents)."""
    gc.collect()
    t0 = time.perf_counter()
    ex = system.make(workers, **options)
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


def downsample(values: Sequence[float], k: int = MAX_SAMPLES, digits: int = 4) -> list[float]:
    """The sorted ``values`` reduced to at most ``k`` evenly spaced quantiles (min and max
    kept), each rounded to ``digits`` decimals: a compact stand-in for a CDF."""
    xs = sorted(values)
    n = len(xs)
    if n > k >= 2:
        xs = [xs[round(i * (n - 1) / (k - 1))] for i in range(k)]
    elif n > k:
        xs = xs[-1:]
    return [round(x, digits) for x in xs]


# The runner's progress bar, while one is shown: workloads report how far they are (0..1).
_progress_hook: Callable[[float], None] | None = None


def _report(fraction: float) -> None:
    hook = _progress_hook
    if hook is not None:
        hook(fraction)


@contextmanager
def _progress_to(hook: Callable[[float], None] | None) -> Iterator[None]:
    """Send workload progress to ``hook`` inside the ``with`` block."""
    global _progress_hook
    saved, _progress_hook = _progress_hook, hook
    try:
        yield
    finally:
        _progress_hook = saved


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


@dataclass(frozen=True)
class ForkJoinSizes:
    """Problem sizes of the forkjoin workload."""

    fib_n: int
    fib_cutoff: int
    uts: _wl.UTSParams = field(default_factory=_wl.UTSParams)
    uts_seed: int = _wl.UTS_ROOT_SEED


FORKJOIN_QUICK = ForkJoinSizes(fib_n=32, fib_cutoff=20, uts=_wl.UTS_QUICK)
FORKJOIN_DEFAULT = ForkJoinSizes(fib_n=34, fib_cutoff=21, uts=_wl.UTS_DEFAULT)
FORKJOIN_TINY = ForkJoinSizes(fib_n=25, fib_cutoff=18, uts=_wl.UTSParams(b0=100))
FORKJOIN_SIZES = {"full": FORKJOIN_DEFAULT, "quick": FORKJOIN_QUICK, "tiny": FORKJOIN_TINY}


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


def forkjoin_baseline(quick: bool | str) -> dict[str, Any]:
    """One-process times of the forkjoin problems (measured once per process, then cached).

    ``fib_s``/``uts_s`` are the baseline speedups divide by: ``stealer.run_inline`` of the
    generator task when available (``baseline == "run_inline"``), else the plain sequential
    function (``baseline == "sequential"``).  ``fib_seq_s``/``uts_seq_s`` are always the plain
    sequential functions.
    """
    return _forkjoin_baseline(_size(quick))


@cache
def _forkjoin_baseline(size: str) -> dict[str, Any]:
    sz = FORKJOIN_SIZES[size]
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


def run_forkjoin(system: System, workers: int, quick: bool | str) -> dict[str, Any]:
    """fib and UTS on the executor; speedup over the one-process baseline."""
    sz = FORKJOIN_SIZES[_size(quick)]
    base = forkjoin_baseline(quick)
    ex, ready = _open(system, workers)
    try:
        if system.forkjoin == "native":
            t0 = time.perf_counter()
            fib_value = ex.submit(_wl.fib, sz.fib_n, sz.fib_cutoff).result(WAIT_TIMEOUT_S)
            fib_s = time.perf_counter() - t0
            _report(0.5)
            t0 = time.perf_counter()
            nodes = ex.submit(_wl.uts, sz.uts_seed, 0, sz.uts).result(WAIT_TIMEOUT_S)
            uts_s = time.perf_counter() - t0
            uts_tasks = None  # not observable from the client
        else:
            t0 = time.perf_counter()
            leaves = _wl.fib_leaves(sz.fib_n, sz.fib_cutoff)
            fib_value = sum(ex.map(_wl.fib_seq, leaves, timeout=WAIT_TIMEOUT_S))
            fib_s = time.perf_counter() - t0
            _report(0.5)
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


# --------------------------------------------------------------------------- agents

#: (agents, steps per agent) of the ``agents`` workload.
AGENTS_SIZES = {"full": (200, 25), "quick": (50, 10), "tiny": (6, 3)}
AGENT_STEP_S = 0.5e-3
AGENT_STATE_FLOATS = 1_000


def _needs_native_agents(system: System) -> None:
    if system.agents != "native":
        raise NotApplicable(
            "agents run natively on stealer only (a plain pool has no agents to measure)"
        )


def _agent_totals(ex: cf.Executor) -> dict[str, int] | None:
    """The workers' summed counters (``stats().totals()``) of a native agent system."""
    stats = getattr(ex, "stats", None)
    return None if stats is None else dict(stats().totals())


def _settled_totals(
    ex: cf.Executor, key: str, at_least: int, before: dict[str, int], timeout: float = 2.0
) -> dict[str, int]:
    """Totals once counter ``key`` grew by ``at_least`` since ``before`` (workers publish
    their counters every 64 turns and when they park), or after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while True:
        now = _agent_totals(ex) or {}
        if now.get(key, 0) - before.get(key, 0) >= at_least or time.monotonic() > end:
            return now
        time.sleep(0.005)


def _delta(after: dict[str, int] | None, before: dict[str, int] | None) -> dict[str, int]:
    if not after or not before:
        return {}
    return {k: after[k] - before.get(k, 0) for k in after}


def run_agents(system: System, workers: int, quick: bool | str) -> dict[str, Any]:
    """Self-driven agents carrying a counter and a numpy array through their steps."""
    import numpy as np

    n, steps = AGENTS_SIZES[_size(quick)]
    native = system.agents == "native"
    states = [
        _wl.StepState(i, steps, AGENT_STEP_S, np.zeros(AGENT_STATE_FLOATS), 0.0) for i in range(n)
    ]
    ex, ready = _open(system, workers)
    try:
        _wait_all([ex.submit(_wl.hold_numpy, 0.02) for _ in range(2 * workers)])
        before = _agent_totals(ex) if native else None
        gc.collect()
        t0 = time.monotonic()
        for s in states:
            s.last = t0
        if native:
            last = [t0]

            def record(_f: cf.Future[Any]) -> None:
                t = time.monotonic()
                if t > last[0]:
                    last[0] = t

            spawn = ex.spawn_agent  # type: ignore[attr-defined]
            futures = [spawn(_wl.StepAgent, s).future for s in states]
            for f in futures:
                f.add_done_callback(record)
            _wait_all(futures)
            finals = [f.result() for f in futures]
            end = last[0]
            after = _settled_totals(ex, "agent_steps", n * steps, before or {})
        else:
            finals, end = _agents_client_driven(ex, states, n * steps)
            after = None
    finally:
        ex.shutdown(wait=True)
    finals.sort(key=lambda s: s.index)
    for s in finals:
        if s.count != steps or len(s.lats) != steps or not bool(np.all(s.arr == steps)):
            raise RuntimeError(
                f"{system.name}: agent {s.index} ended with count {s.count}, {len(s.lats)} "
                f"latencies, array at {s.arr[0]} (expected {steps})"
            )
    if [s.index for s in finals] != list(range(n)):
        raise RuntimeError(f"{system.name}: {n - len(finals)} agents did not finish")
    lats = [x for s in finals for x in s.lats]
    later = [x for s in finals for x in s.lats[1:]]  # without each agent's first step
    work = n * steps * AGENT_STEP_S
    makespan = end - t0
    counters = _delta(after, before)
    ideal_lat, ideal_makespan = _ideal.round_robin_steps(n, steps, AGENT_STEP_S, workers)
    ideal_later = ideal_lat[n:]  # in start order: the first n are the first steps
    return {
        "agents": n,
        "steps": steps,
        "step_ms": AGENT_STEP_S * 1e3,
        "work_s": work,
        "makespan_s": makespan,
        "efficiency": work / workers / makespan,
        "step_p50_ms": _ideal.percentile(lats, 50) * 1e3,
        "step_p99_ms": _ideal.percentile(lats, 99) * 1e3,
        "step_max_ms": max(lats) * 1e3,
        "step_p99_later_ms": _ideal.percentile(later, 99) * 1e3 if later else None,
        "ready_s": ready,
        "info": {
            "mode": "native" if native else "client-driven",
            "agent_steps": counters.get("agent_steps"),
            "migrations": counters.get("migrations"),
        },
        "ideal": {
            "makespan_s": ideal_makespan,
            "efficiency": work / workers / ideal_makespan,
            "step_p50_ms": _ideal.percentile(ideal_lat, 50) * 1e3,
            "step_p99_ms": _ideal.percentile(ideal_lat, 99) * 1e3,
            "step_max_ms": max(ideal_lat) * 1e3,
            "step_p99_later_ms": _ideal.percentile(ideal_later, 99) * 1e3 if ideal_later else None,
        },
    }


def _agents_client_driven(
    ex: cf.Executor, states: Sequence[_wl.StepState], total: int
) -> tuple[list[_wl.StepState], float]:
    """The agents on a plain executor: each step is a task taking the agent's state and
    returning it; the client resubmits an agent's next step the moment its previous step's
    result arrives (FIFO: round-robin).  Returns the final states and when the client had the
    last one (``time.monotonic``)."""
    done_q: queue.SimpleQueue[tuple[cf.Future[Any], float]] = queue.SimpleQueue()

    def on_done(f: cf.Future[Any]) -> None:
        done_q.put((f, time.monotonic()))

    def submit(s: _wl.StepState) -> None:
        ex.submit(_wl.state_step, s).add_done_callback(on_done)

    for s in states:
        submit(s)
    finals: list[_wl.StepState] = []
    end = 0.0
    outstanding = len(states)
    finished_steps = 0
    while outstanding:
        try:
            f, t = done_q.get(timeout=WAIT_TIMEOUT_S)
        except queue.Empty:
            raise TimeoutError(f"no agent step finished in {WAIT_TIMEOUT_S:.0f} s") from None
        s = f.result()
        finished_steps += 1
        if not finished_steps & 255:
            _report(finished_steps / total)
        if s.count >= s.steps:
            finals.append(s)
            outstanding -= 1
            end = max(end, t)
        else:
            submit(s)
    return finals, end


TIERS_CALLS = {"full": 100, "quick": 30, "tiny": 5}
TIERS_BULK = 8
TIERS_BULK_STEP_S = 5e-3
TIERS_INTERVAL_S = 10e-3
TIERS_CALL_S = 0.2e-3
TIERS_WARMUP_S = 0.1
TIERS_IDEAL_SAMPLES = 10_000
TIERS_SEED = 13


def run_tiers(system: System, workers: int, quick: bool | str) -> dict[str, Any]:
    """Bulk agents saturate every worker; an interactive agent gets a call every 10 ms."""
    n = TIERS_CALLS[_size(quick)]
    native = system.agents == "native"
    sent = [0.0] * n
    done_at = [math.nan] * n

    def on_done(i: int) -> Callable[[cf.Future[Any]], None]:
        def record(_f: cf.Future[Any]) -> None:
            done_at[i] = time.perf_counter()

        return record

    ex, ready = _open(system, workers)
    gc.collect()
    gc.freeze()  # as in run_latency: client GC pauses scan only what the run makes
    bulk_refs: list[Any] = []
    stop = threading.Event()
    feeder: threading.Thread | None = None
    bulk_ends: list[float] = []
    try:
        if native:
            spawn = ex.spawn_agent  # type: ignore[attr-defined]
            bulk_refs = [
                spawn(_wl.BulkAgent, TIERS_BULK_STEP_S, tier="bulk") for _ in range(TIERS_BULK)
            ]
            inter = spawn(_wl.InteractiveAgent, TIERS_CALL_S, tier="interactive")

            def call(i: int) -> cf.Future[Any]:
                return inter.call("hit", i)

        else:
            feeder = _bulk_feeder(ex, stop, bulk_ends)

            def call(i: int) -> cf.Future[Any]:
                return ex.submit(_wl.tier_call, i, TIERS_CALL_S)

        time.sleep(TIERS_WARMUP_S)  # the bulk work spreads over every worker
        if call(-1).result(WAIT_TIMEOUT_S)[0] != -1:  # warm: the agent is adopted
            raise RuntimeError(f"{system.name}: the warm-up call returned a wrong result")
        if native:
            counts0 = [f.result(WAIT_TIMEOUT_S) for f in [r.call("count") for r in bulk_refs]]
        futures: list[cf.Future[Any]] = []
        t_start = time.perf_counter() + 0.005
        w0 = time.perf_counter()
        for i in range(n):
            if not i & 15:
                _report(i / n)
            precise_sleep_until(t_start + i * TIERS_INTERVAL_S)
            sent[i] = time.perf_counter()
            f = call(i)
            f.add_done_callback(on_done(i))
            futures.append(f)
        _wait_all(futures)
        w1 = time.perf_counter()
        got = [f.result() for f in futures]
        if native:
            counts1 = [f.result(WAIT_TIMEOUT_S) for f in [r.call("count") for r in bulk_refs]]
            for r in bulk_refs:
                r.stop()
            bulk_steps = [r.result(WAIT_TIMEOUT_S) for r in bulk_refs]
            inter.stop()
            calls_seen = inter.result(WAIT_TIMEOUT_S)
            window_steps = sum(counts1) - sum(counts0)
        else:
            stop.set()
            assert feeder is not None
            feeder.join(WAIT_TIMEOUT_S)
            bulk_steps = [len(bulk_ends)]
            calls_seen = n + 1
            window_steps = sum(1 for t in bulk_ends if w0 <= t <= w1)
    finally:
        stop.set()
        gc.unfreeze()
        ex.shutdown(wait=True, cancel_futures=True)
    if [g[0] for g in got] != list(range(n)) or calls_seen != n + 1:
        raise RuntimeError(f"{system.name}: wrong replies ({calls_seen} calls handled)")
    if not all(bulk_steps):
        raise RuntimeError(f"{system.name}: a bulk agent never stepped: {bulk_steps}")
    reply = [d - s for d, s in zip(done_at, sent)]
    start = [g[1] - s for g, s in zip(got, sent)]
    result: dict[str, Any] = {"calls": n, "bulk": TIERS_BULK, "bulk_step_ms": TIERS_BULK_STEP_S * 1e3}
    result.update({f"{k}_ms": v for k, v in _ideal.latency_summary(reply).items()})
    result["start_p99_ms"] = _ideal.percentile(start, 99) * 1e3
    # Share of the workers' time spent in bulk steps while the calls ran (~1: saturated): the
    # bulk agents' step counts asked before and after (native; each answered at the agent's
    # next turn, so the window is fuzzy by a step) or the bulk tasks that completed in it.
    result["bulk_busy"] = window_steps * TIERS_BULK_STEP_S / (workers * (w1 - w0))
    result["samples_ms"] = downsample([x * 1e3 for x in reply])
    result["ready_s"] = ready
    result["info"] = {"mode": "native" if native else "client-driven",
                      "bulk_steps": sum(bulk_steps)}
    result["ideal"] = ideal_tiers(workers)
    return result


def _bulk_feeder(
    ex: cf.Executor, stop: threading.Event, ends: list[float]
) -> threading.Thread:
    """Start the client-driven bulk agents: TIERS_BULK chains of ``busy(5 ms)`` tasks, each
    resubmitted by a client thread as soon as its previous one completes, until ``stop``."""
    done_q: queue.SimpleQueue[cf.Future[Any]] = queue.SimpleQueue()

    def on_done(f: cf.Future[Any]) -> None:
        ends.append(time.perf_counter())
        done_q.put(f)

    def loop() -> None:
        outstanding = TIERS_BULK
        while outstanding:
            try:
                f = done_q.get(timeout=WAIT_TIMEOUT_S)
            except queue.Empty:
                return
            outstanding -= 1
            if f.exception() is None and not stop.is_set():
                try:
                    ex.submit(_wl.busy, TIERS_BULK_STEP_S).add_done_callback(on_done)
                except RuntimeError:  # shut down
                    continue
                outstanding += 1

    for _ in range(TIERS_BULK):
        ex.submit(_wl.busy, TIERS_BULK_STEP_S).add_done_callback(on_done)
    t = threading.Thread(target=loop, name="bench-bulk-feeder", daemon=True)
    t.start()
    return t


def ideal_tiers(workers: int) -> dict[str, Any]:
    """Reply times under preemption at bulk step boundaries (:func:`stealer.bench.ideal.
    step_boundary_replies`, 10,000 seeded calls); ``bound_ms`` = one bulk step + the call."""
    reply = _ideal.step_boundary_replies(
        TIERS_IDEAL_SAMPLES, TIERS_BULK_STEP_S, TIERS_CALL_S, workers, TIERS_SEED
    )
    out: dict[str, Any] = {f"{k}_ms": v for k, v in _ideal.latency_summary(reply).items()}
    out["bound_ms"] = (TIERS_BULK_STEP_S + TIERS_CALL_S) * 1e3
    out["bulk_busy"] = 1.0
    out["samples_ms"] = downsample([x * 1e3 for x in reply])
    return out


#: (agents, steps each) of the no-op step part of ``agent_overhead``.
NOOP_AGENT_SIZES = {"full": (20, 5_000), "quick": (20, 500), "tiny": (4, 50)}
PINGPONG_ROUNDS = {"full": 20_000, "quick": 2_000, "tiny": 50}
PLACEMENT_TRIES = 8


def run_agent_overhead(system: System, workers: int, quick: bool | str) -> dict[str, Any]:
    """Scheduler cost of a no-op step on one worker; ping-pong between two agents."""
    _needs_native_agents(system)
    size = _size(quick)
    n, steps = NOOP_AGENT_SIZES[size]
    total = n * steps
    ex, ready = _open(system, 1)
    try:
        spawn = ex.spawn_agent  # type: ignore[attr-defined]
        before = _agent_totals(ex) or {}
        t0 = time.perf_counter()
        refs = [spawn(_wl.NoopAgent, steps) for _ in range(n)]
        values = [r.result(WAIT_TIMEOUT_S) for r in refs]
        wall = time.perf_counter() - t0
        counters = _delta(_settled_totals(ex, "agent_steps", total, before), before)
    finally:
        ex.shutdown(wait=True)
    if values != [steps] * n:
        raise RuntimeError(f"{system.name}: no-op agents returned {values[:4]}..., not {steps}")
    _report(0.5)
    result: dict[str, Any] = {
        "noop_agents": n,
        "noop_steps": steps,
        "step_us": wall / total * 1e6,
        "steps_per_s": total / wall,
        # Time inside the agents' turns (step call and its bookkeeping, checkpoints every 64
        # steps), from the worker's busy_ns counter: the rest of step_us is the worker loop.
        "turn_us": counters["busy_ns"] / counters["agent_steps"] / 1e3
        if counters.get("agent_steps") else None,
        "ready_s": ready,
    }
    result.update(_ping_pong(system, workers, PINGPONG_ROUNDS[size]))
    result["info"]["noop_counted_steps"] = counters.get("agent_steps")
    result["ideal"] = {}
    return result


def _ping_pong(system: System, workers: int, rounds: int) -> dict[str, Any]:
    """Two agents on different workers (when the executor places them so; respawned up to
    PLACEMENT_TRIES times otherwise) bouncing a counter by ``yield other.call("ping", v)``."""
    ex, _ready = _open(system, workers)
    try:
        spawn = ex.spawn_agent  # type: ignore[attr-defined]
        for attempt in range(1, PLACEMENT_TRIES + 1):
            pong = spawn(_wl.PongAgent)
            ping = spawn(_wl.PingAgent, pong, rounds)
            pids = (ping.call("where").result(WAIT_TIMEOUT_S),
                    pong.call("where").result(WAIT_TIMEOUT_S))
            if pids[0] != pids[1] or workers < 2 or attempt == PLACEMENT_TRIES:
                break
            for r in (ping, pong):
                r.stop()
                r.result(WAIT_TIMEOUT_S)
        before = _agent_totals(ex) or {}
        t0 = time.perf_counter()
        ping.send("start")
        value, seconds = ping.result(WAIT_TIMEOUT_S)
        wall = time.perf_counter() - t0
        pong_pid = pong.call("where").result(WAIT_TIMEOUT_S)
        counters = _delta(_agent_totals(ex), before)
        pong.stop()
        pong.result(WAIT_TIMEOUT_S)
    finally:
        ex.shutdown(wait=True)
    if value != rounds:
        raise RuntimeError(f"{system.name}: ping-pong ended at {value}, expected {rounds}")
    return {
        "round_trips": rounds,
        "round_trip_us": seconds / rounds * 1e6,
        "round_trips_per_s": rounds / seconds,
        "same_worker": pids[0] == pids[1],
        "info": {
            "placement_tries": attempt,
            "pong_moved": pong_pid != pids[1],
            "pingpong_wall_s": wall,
            "pingpong_parks": counters.get("parks"),
            "pingpong_wakeups": counters.get("wakeups"),
        },
    }


def run_lockstep(system: System, workers: int, quick: bool | str) -> dict[str, Any]:
    """Agents stepped in lockstep rounds by the client (:func:`stealer.bench.lockstep.run`)."""
    return _lockstep.run(system, workers, _size(quick), _open, _report)


#: (agents, records) of ``agent_scale``: every idle agent holds one record.
SCALE_SIZES = {"full": (1_000_000, 1 << 20), "quick": (20_000, 1 << 15), "tiny": (300, 1 << 12)}
SCALE_PROBES = 100


def _private_bytes(procs: Sequence[Any]) -> list[int]:
    """Each process's resident memory that is not shared (psutil ``rss - shared``: anonymous
    memory; the shared segment's pages are ``shared`` and are counted by its size instead)."""
    out = []
    for p in procs:
        m = p.memory_info()
        out.append(m.rss - getattr(m, "shared", 0))
    return out


def _shm_files(ex: cf.Executor) -> tuple[int | None, int, int]:
    """``(segment size, overflow files, their bytes)`` of the executor in /dev/shm.

    Payloads too big for a record's inline bytes and for the free size-class blocks go to
    overflow files ``<segment>-x<id>`` beside the segment (stealer/arena.py); an agent's spawn
    payload stays while it lives, so they count.  Their bytes are what tmpfs allocated
    (``st_blocks * 512``: a page each at least), not their length."""
    name = getattr(ex, "segment_name", None)
    if not name:
        return None, 0, 0
    try:
        size = os.stat(os.path.join("/dev/shm", name)).st_size
    except OSError:
        return None, 0, 0
    files = used = 0
    prefix = name + "-x"
    with os.scandir("/dev/shm") as it:
        for entry in it:
            if entry.name.startswith(prefix):
                try:
                    used += entry.stat(follow_symlinks=False).st_blocks * 512
                except OSError:  # freed meanwhile
                    continue
                files += 1
    return size, files, used


def run_agent_scale(system: System, workers: int, quick: bool | str) -> dict[str, Any]:
    """Many idle agents in one executor: creation time and memory per agent."""
    _needs_native_agents(system)
    import psutil

    n, records = SCALE_SIZES[_size(quick)]
    ex, ready = _open(system, workers, records=records)
    try:
        pids = [p for p in ex.worker_pids() if p is not None]  # type: ignore[attr-defined]
        procs = [psutil.Process(), *(psutil.Process(p) for p in pids)]
        segment, ov_files0, ov_bytes0 = _shm_files(ex)
        gc.collect()
        mem0 = _private_bytes(procs)
        spawn = ex.spawn_agents  # type: ignore[attr-defined]
        t0 = time.perf_counter()
        refs: Any = spawn(_wl.IdleAgent, itertools.repeat((), n))
        t_spawned = time.perf_counter()
        _report(0.8)
        # Every agent adopted: nothing left on the injector or any deque, then a call to the
        # last one spawned and to SCALE_PROBES others answers.
        end = time.monotonic() + WAIT_TIMEOUT_S
        while True:
            st = ex.stats()  # type: ignore[attr-defined]
            if st.injector_depth == 0 and not any(w.deque_depth for w in st.workers):
                break
            if time.monotonic() > end:
                raise TimeoutError("agents still waiting to be adopted")
            time.sleep(0.005)
        probes = [*refs[:: max(1, n // SCALE_PROBES)], refs[-1]]
        answers = [r.call("ping", k) for k, r in enumerate(probes)]
        ok = [f.result(WAIT_TIMEOUT_S) for f in answers] == list(range(len(probes)))
        t1 = time.perf_counter()
        gc.collect()
        mem1 = _private_bytes(procs)
        _seg, ov_files1, ov_bytes1 = _shm_files(ex)
        live_pids = [p for p in ex.worker_pids() if p is not None]  # type: ignore[attr-defined]
        _report(0.9)
        del refs, probes, answers
    finally:
        t2 = time.perf_counter()
        ex.shutdown(wait=True)  # stops every agent: their final values reach the client
        shutdown_s = time.perf_counter() - t2
    if not ok:
        raise RuntimeError(f"{system.name}: an idle agent did not answer its call")
    if live_pids != pids:
        raise RuntimeError(f"{system.name}: a worker was replaced during the run ({pids} -> "
                           f"{live_pids}); the memory numbers would be wrong")
    client = mem1[0] - mem0[0]
    worker = sum(mem1[1:]) - sum(mem0[1:])
    overflow = ov_bytes1 - ov_bytes0
    seg = (segment or 0) + overflow
    return {
        "agents": n,
        "records": records,
        "create_s": t1 - t0,
        "create_us": (t1 - t0) / n * 1e6,
        "spawn_us": (t_spawned - t0) / n * 1e6,
        "bytes_per_agent": (client + worker + seg) / n,
        "client_bytes_per_agent": client / n,
        "worker_bytes_per_agent": worker / n,
        "segment_bytes_per_agent": seg / n,
        "segment_bytes": segment,
        "overflow_files": ov_files1 - ov_files0,
        "overflow_bytes": overflow,
        "shutdown_s": shutdown_s,
        "ready_s": ready,
        "ideal": {},
    }


# --------------------------------------------------------------------------- user workload

USER_TASKS = {"full": 2_000, "quick": 500, "tiny": 50}


def resolve_function(target: str) -> Callable[..., Any]:
    """The callable named ``"package.module:function"`` (``function`` may be dotted, e.g.
    ``Class.method``).  The current directory is tried as an import root if the module is not
    found otherwise, like ``python -m``.  Raises :class:`ValueError` with the reason."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"{target!r} is not MODULE:FUNCTION (e.g. stealer.bench.workloads:busy)"
        )
    try:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError:
            cwd = os.getcwd()
            if cwd in sys.path:
                raise
            sys.path.insert(0, cwd)
            module = importlib.import_module(module_name)
    except Exception as exc:
        raise ValueError(f"cannot import {module_name!r}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{module_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ValueError(f"{target!r} is not callable")
    return obj


@dataclass(frozen=True)
class UserWorkload:
    """The user's task for ``--workload``: ``fn(*args, **kwargs)`` called ``tasks`` times,
    with at most ``inflight`` tasks outstanding (0: all submitted at once).  ``task_s`` is the
    function's duration when called in the client (measured by :func:`calibrate` when None);
    the ideal assumes every task takes that long."""

    target: str
    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    tasks: int = USER_TASKS["quick"]
    inflight: int = 0
    task_s: float | None = None

    def describe(self, limit: int = 120) -> str:
        """``module:function(args)``, shortened to ``limit`` characters."""
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        text = f"{self.target}({', '.join(parts)})"
        return text if len(text) <= limit else text[: limit - 1] + "…"


def calibrate(spec: UserWorkload, budget_s: float = 0.2, max_calls: int = 20) -> float:
    """Median duration (s) of ``spec.fn(*args, **kwargs)`` called in this process: up to
    ``max_calls`` calls within ``budget_s`` (at least one)."""
    times: list[float] = []
    end = time.perf_counter() + budget_s
    while len(times) < max_calls and (not times or time.perf_counter() < end):
        t0 = time.perf_counter()
        spec.fn(*spec.args, **spec.kwargs)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def closed_loop_ideal(
    tasks: int, inflight: int, duration: float, workers: int
) -> tuple[list[float], float]:
    """``(latencies, makespan)`` of ``tasks`` equal tasks on ``workers`` zero-overhead workers
    when the client keeps ``inflight`` submitted (0 or >= tasks: all submitted at time 0) and
    submits the next the moment one completes; greedy FIFO as in :mod:`stealer.bench.ideal`."""
    if tasks <= 0:
        return [], 0.0
    k = tasks if inflight <= 0 else min(inflight, tasks)
    free = [0.0] * min(workers, tasks)
    done: list[float] = []
    lat: list[float] = []
    for i in range(tasks):
        # Equal durations and FIFO: completions come in submission order.
        arrive = 0.0 if i < k else done[i - k]
        start = max(arrive, heapq.heappop(free))
        finish = start + duration
        heapq.heappush(free, finish)
        done.append(finish)
        lat.append(finish - arrive)
    return lat, max(done)


def run_user(system: System, workers: int, spec: UserWorkload) -> dict[str, Any]:
    """The user's function through ``system``: per-task latency (submit to done, read in a
    done callback) percentiles, and throughput ``tasks / (last done - first submit)``."""
    n = spec.tasks
    if n < 1:
        raise ValueError("tasks must be >= 1")
    k = n if spec.inflight <= 0 else min(spec.inflight, n)
    task_s = spec.task_s if spec.task_s is not None else calibrate(spec)
    submitted = [0.0] * n
    done_at = [math.nan] * n
    done_q: queue.SimpleQueue[int] = queue.SimpleQueue()
    futures: list[cf.Future[Any] | None] = [None] * n

    def on_done(i: int) -> Callable[[cf.Future[Any]], None]:
        def record(_f: cf.Future[Any]) -> None:
            done_at[i] = time.perf_counter()
            done_q.put(i)

        return record

    ex, ready = _open(system, workers)
    try:

        def submit(i: int) -> None:
            submitted[i] = time.perf_counter()
            f = ex.submit(spec.fn, *spec.args, **spec.kwargs)
            futures[i] = f
            f.add_done_callback(on_done(i))

        t0 = time.perf_counter()
        for i in range(k):
            submit(i)
        next_i = k
        for finished in range(1, n + 1):
            try:
                i = done_q.get(timeout=WAIT_TIMEOUT_S)
            except queue.Empty:
                raise TimeoutError(f"no task finished in {WAIT_TIMEOUT_S:.0f} s") from None
            f = futures[i]
            if f is not None and f.exception() is not None:
                raise RuntimeError(f"task {i} raised {f.exception()!r}") from f.exception()
            if next_i < n:
                submit(next_i)
                next_i += 1
            if not finished & 63:
                _report(finished / n)
        wall = max(done_at) - t0
    finally:
        ex.shutdown(wait=True, cancel_futures=True)
    lat = [d - s for d, s in zip(done_at, submitted)]
    ideal_lat, ideal_makespan = closed_loop_ideal(n, k, task_s, workers)
    result: dict[str, Any] = {"tasks": n, "inflight": k, "task_ms": task_s * 1e3}
    result["tasks_per_s"] = n / wall if wall > 0 else math.inf
    result["wall_s"] = wall
    result.update({f"{key}_ms": v for key, v in _ideal.latency_summary(lat).items()})
    result["samples_ms"] = downsample([x * 1e3 for x in lat])
    result["ready_s"] = ready
    result["info"] = {"call": spec.describe()}
    ideal: dict[str, Any] = {
        "tasks_per_s": n / ideal_makespan if ideal_makespan > 0 else math.inf,
        "wall_s": ideal_makespan,
        "task_ms": task_s * 1e3,
    }
    ideal.update({f"{key}_ms": v for key, v in _ideal.latency_summary(ideal_lat).items()})
    ideal["samples_ms"] = downsample([x * 1e3 for x in ideal_lat])
    result["ideal"] = ideal
    return result


WORKLOADS: dict[str, Callable[[System, int, bool | str], dict[str, Any]]] = {
    "start": run_start,
    "overhead": run_overhead,
    "latency": run_latency,
    "skew": run_skew,
    "forkjoin": run_forkjoin,
    "agents": run_agents,
    "tiers": run_tiers,
    "agent_overhead": run_agent_overhead,
    "lockstep": run_lockstep,
    "agent_scale": run_agent_scale,
}

#: What runs when ``--workloads`` is not given: all but ``agent_scale`` (a million agents:
#: a minute and several GiB) and ``lockstep`` (10-20 s even at --quick: 256 agents and 256
#: pipe processes); run them by name.
DEFAULT_WORKLOADS = tuple(w for w in WORKLOADS if w not in ("agent_scale", "lockstep"))

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
        ("gc0_per_100k", "client GC gen0 /100k tasks", ",.0f"),
        ("gc1_per_100k", "client GC gen1 /100k tasks", ",.0f"),
        ("gc2_per_100k", "client GC gen2 /100k tasks", ",.0f"),
        ("large_p99_ms", "large heap: p99 ms", ".2f"),
        ("large_p99_9_ms", "large heap: p99.9 ms", ".2f"),
        ("large_gc2_per_100k", "large heap: GC gen2 /100k", ",.0f"),
        ("frozen_p99_ms", "frozen heap: p99 ms", ".2f"),
        ("frozen_p99_9_ms", "frozen heap: p99.9 ms", ".2f"),
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
    "agents": [
        ("makespan_s", "makespan s", ".3f"),
        ("efficiency", "efficiency", ".3f"),
        ("step_p50_ms", "step p50 ms", ".1f"),
        ("step_p99_ms", "step p99 ms", ".1f"),
        ("step_p99_later_ms", "p99 without 1st steps", ".1f"),
    ],
    "tiers": [
        ("p50_ms", "reply p50 ms", ".2f"),
        ("p99_ms", "reply p99 ms", ".2f"),
        ("max_ms", "reply max ms", ".2f"),
        ("bulk_busy", "bulk busy share", ".2f"),
    ],
    "agent_overhead": [
        ("step_us", "no-op step µs (1 worker)", ".2f"),
        ("turn_us", "of which in the turn µs", ".2f"),
        ("round_trip_us", "ping-pong µs/round trip", ".1f"),
        ("round_trips_per_s", "round trips/s", ",.0f"),
    ],
    "lockstep": _lockstep.table_rows(),
    "agent_scale": [
        ("agents", "idle agents", ",.0f"),
        ("create_s", "create s", ".2f"),
        ("create_us", "create µs/agent", ".1f"),
        ("spawn_us", "  spawn µs/agent", ".2f"),
        ("bytes_per_agent", "bytes/agent", ",.0f"),
        ("worker_bytes_per_agent", "  workers' heap", ",.0f"),
        ("client_bytes_per_agent", "  client (refs)", ",.0f"),
        ("segment_bytes_per_agent", "  shared memory", ",.0f"),
        ("overflow_files", "  overflow files", ",.0f"),
        ("shutdown_s", "shutdown s", ".2f"),
    ],
    "user": [
        ("tasks_per_s", "tasks/s", ",.0f"),
        ("p50_ms", "p50 ms", ".2f"),
        ("p90_ms", "p90 ms", ".2f"),
        ("p99_ms", "p99 ms", ".2f"),
        ("p99_9_ms", "p99.9 ms", ".2f"),
        ("max_ms", "max ms", ".2f"),
        ("wall_s", "wall s", ".3f"),
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
            if key.startswith("frozen_") and all(v is None for v in vals):
                continue  # the frozen-heap latency runs only with --frozen-latency
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


def _strip_samples(value: Any) -> Any:
    """``value`` without its ``samples_ms`` entries (for the per-run copies in the JSON)."""
    if isinstance(value, dict):
        return {k: _strip_samples(v) for k, v in value.items() if k != "samples_ms"}
    if isinstance(value, list):
        return [_strip_samples(v) for v in value]
    return value


def _for_json(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Results as written to JSON: samples only in the medians and the ideal, not per run."""
    out: dict[str, dict[str, Any]] = {}
    for workload, res in results.items():
        entry = dict(res)
        entry["runs"] = _strip_samples(res.get("runs", {}))
        out[workload] = entry
    return out


_NUMBER_LIST = re.compile(r"\[\s*([-+0-9.eE,\s]*?)\s*\]")


def dumps_compact(doc: Any) -> str:
    """``json.dumps(doc, indent=1)`` with every list of plain numbers on one line."""
    text = json.dumps(doc, indent=1)
    return _NUMBER_LIST.sub(lambda m: "[" + "".join(m.group(1).split()) + "]", text)


def _meta(
    args: argparse.Namespace,
    skipped: dict[str, str],
    errors: dict[str, dict[str, str]],
    not_installed: Sequence[str],
    not_applicable: dict[str, dict[str, str]] | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "workers": args.workers,
        "size": args.size,
        "quick": args.size == "quick",
        "repeat": args.repeat,
        "workloads": args.workloads,
        "systems": args.systems,
        "skipped": skipped,
        "errors": errors,
        "not_applicable": not_applicable or {},
        "not_installed": list(not_installed),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if args.user is not None:
        meta["user_workload"] = {
            "call": args.user.describe(limit=1000),
            "tasks": args.user.tasks,
            "inflight": args.user.inflight,
        }
    return meta


_EPILOG = """\
your own workload:
  --workload MODULE:FUNCTION runs FUNCTION(*ARGS, **KWARGS) --tasks times through every
  system (the built-in workloads are then left out unless --workloads names them), e.g.

      stealer bench --workload stealer.bench.workloads:busy --args '[0.001]' --tasks 2000

  The function must be importable by the worker processes (a module on sys.path; the current
  directory is tried too).  --args is a JSON list, --kwargs a JSON object.  All tasks are
  submitted at once, or at most --inflight at a time (the next submitted as one completes).
  Reported: throughput (tasks / (last done - first submit)) and the latency percentiles of
  each task from submit to done.  The ideal assumes every task takes as long as one call of
  the function in this process (timed a few times before the runs).

output:
  The table goes to stdout; --json PATH (default bench-out/bench.json) gets every number and
  run, with latency distributions downsampled to <= 2,000 points; PNG plots (latency
  percentiles and CDF per system, efficiency and speedup bars, overhead) go to --plots DIR
  (default: the directory of --json, or bench-out/).  A progress bar is drawn on stderr when
  it is a terminal (--progress forces it).

peers:
  --systems auto (default) runs stealer, ProcessPoolExecutor ('process') and each installed
  peer of loky, mpire, dask (distributed.LocalCluster, 1 thread per worker process) and ray.
  A system that fails is reported and the run goes on.
"""


def _json_value(text: str, what: str, kind: type) -> Any:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} is not valid JSON: {exc}") from exc
    if kind is list and not isinstance(value, list):
        value = [value]  # a single argument
    if not isinstance(value, kind):
        raise ValueError(f"{what} must be a JSON {kind.__name__}, got {text!r}")
    return value


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="stealer bench",
        description="Yardstick workloads (DESIGN.md §7) side by side with peers and the ideal.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--workloads",
        default=None,
        help=f"comma-separated subset of {','.join(WORKLOADS)} (default: all but agent_scale "
        "and lockstep, "
        "or none when --workload is given)",
    )
    p.add_argument(
        "--systems",
        default="auto",
        help=f"comma-separated executors to compare, of {','.join(_LOADERS)}, or 'auto' "
        "(stealer, process and the installed peers); the ratio column is first/second "
        "(default: auto)",
    )
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--quick", action="store_true", help="small sizes (seconds per system)")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # tests
    p.add_argument("--repeat", type=int, default=1, help="runs per workload; medians shown")
    p.add_argument("--json", metavar="PATH", help="write all results and runs as JSON here")
    p.add_argument("--plots", metavar="DIR", help="write PNG plots here")
    p.add_argument("--no-plots", action="store_true", help="do not draw plots")
    p.add_argument("--frozen-latency", action="store_true",
                   help="latency also with the client heap frozen (gc.freeze) first")
    p.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )
    g = p.add_argument_group("your own workload (see below)")
    g.add_argument("--workload", metavar="MODULE:FUNCTION", help="a function to benchmark")
    g.add_argument("--args", default="[]", metavar="JSON", help="its arguments (a JSON list)")
    g.add_argument("--kwargs", default="{}", metavar="JSON", help="its keyword arguments")
    g.add_argument(
        "--tasks", type=int, default=None,
        help=f"calls per system (default {USER_TASKS['full']}, --quick {USER_TASKS['quick']})",
    )
    g.add_argument(
        "--inflight", type=int, default=0, metavar="K",
        help="keep at most K tasks outstanding (default 0: submit all at once)",
    )
    args = p.parse_args(argv)
    args.size = "tiny" if args.tiny else "quick" if args.quick else "full"
    if args.workloads is None:
        args.workloads = [] if args.workload else list(DEFAULT_WORKLOADS)
    else:
        args.workloads = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown:
        p.error(f"unknown workload(s): {', '.join(unknown)}")
    args.systems = [s for s in args.systems.split(",") if s]
    args.not_installed = []
    if args.systems == ["auto"]:
        args.systems, args.not_installed = auto_systems()
    if args.workers < 1 or args.repeat < 1:
        p.error("--workers and --repeat must be >= 1")
    args.user = None
    if args.workload:
        tasks = USER_TASKS[args.size] if args.tasks is None else args.tasks
        if tasks < 1 or args.inflight < 0:
            p.error("--tasks must be >= 1 and --inflight >= 0")
        try:
            fn = resolve_function(args.workload)
            fargs = _json_value(args.args, "--args", list)
            fkwargs = _json_value(args.kwargs, "--kwargs", dict)
        except ValueError as exc:
            p.error(str(exc))
        args.user = UserWorkload(
            args.workload, fn, tuple(fargs), fkwargs, tasks=tasks, inflight=args.inflight
        )
        args.workloads.append("user")
    if not args.workloads:
        p.error("nothing to run")
    return args


PLOTS_HINT = "pip install 'stealer[plots]'"


def _load_plots() -> Any:
    """:mod:`stealer.bench.plots`; ImportError when matplotlib does not import."""
    return importlib.import_module("stealer.bench.plots")


def _output_paths(args: argparse.Namespace) -> tuple[str, str]:
    """``(json path, plots directory)`` from ``--json`` and ``--plots``."""
    if args.json:
        return args.json, args.plots or os.path.dirname(os.path.abspath(args.json))
    plots_dir = args.plots or "bench-out"
    return os.path.join(plots_dir, "bench.json"), plots_dir


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry: run, print the table, write JSON and plots. Returns an exit code:
    0, or 1 when the first system failed a workload (or nothing ran), 2 for bad usage (and
    for ``--plots DIR`` without matplotlib, checked before anything runs)."""
    args = _parse(argv)
    LATENCY_HEAPS[:] = ["small", "large"] + (["frozen"] if args.frozen_latency else [])
    if args.plots and not args.no_plots:
        try:  # asked for plots: say how to get them before spending minutes on the run
            _load_plots()
        except ImportError as exc:
            print(f"error: --plots needs matplotlib, which does not import here ({exc}). "
                  f"Install it with: {PLOTS_HINT} (or run without --plots)", file=sys.stderr)
            return 2
    systems, skipped = load_systems(args.systems)
    for name, reason in skipped.items():
        print(f"note: system {name!r} skipped: {reason}", file=sys.stderr)
    if not systems:
        print("error: no system to run", file=sys.stderr)
        return 2
    user: UserWorkload | None = args.user
    if user is not None:
        try:
            user = args.user = UserWorkload(
                user.target, user.fn, user.args, user.kwargs, user.tasks, user.inflight,
                task_s=calibrate(user),
            )
        except Exception as exc:
            print(f"error: {user.describe()} raised {exc!r} when called here", file=sys.stderr)
            return 2

    def workload_fn(name: str) -> Callable[[System, int, bool | str], dict[str, Any]]:
        if name == "user":
            assert user is not None
            return lambda system, workers, _size: run_user(system, workers, user)
        return WORKLOADS[name]

    results: dict[str, dict[str, Any]] = {}
    errors: dict[str, dict[str, str]] = {}
    not_applicable: dict[str, dict[str, str]] = {}
    steps = len(args.workloads) * len(systems) * args.repeat
    bar = Progress(steps, label="bench", enabled=args.progress)
    with bar:
        for workload in args.workloads:
            fn = workload_fn(workload)
            runs: dict[str, list[dict[str, Any]]] = {s.name: [] for s in systems}
            for r in range(args.repeat):
                order = systems[r % len(systems) :] + systems[: r % len(systems)]
                for system in order:
                    step = f"{workload}/{system.name}"
                    if args.repeat > 1:
                        step += f" run {r + 1}/{args.repeat}"
                    if workload in errors.get(system.name, {}) or workload in (
                        not_applicable.get(system.name, {})
                    ):
                        bar.update()
                        continue
                    bar.set_detail(step)

                    def hook(frac: float, step: str = step) -> None:
                        bar.set_detail(f"{step} {frac:.0%}")

                    t0 = time.perf_counter()
                    try:
                        with _progress_to(hook):
                            res = fn(system, args.workers, args.size)
                    except NotApplicable as exc:
                        not_applicable.setdefault(system.name, {})[workload] = str(exc)
                        bar.set_detail(step)
                        bar.update()
                        continue
                    except Exception as exc:
                        msg = f"{type(exc).__name__}: {exc}"
                        errors.setdefault(system.name, {})[workload] = msg
                        bar.set_detail(step)
                        bar.update()
                        bar.write(f"  {workload:<9} {system.name:<8} FAILED: {msg}")
                        continue
                    bar.set_detail(step)
                    bar.update()
                    bar.write(
                        f"  {workload:<9} {system.name:<8} run {r + 1}/{args.repeat}"
                        f" {time.perf_counter() - t0:6.2f} s"
                    )
                    runs[system.name].append(res)
            medians = {name: _median_dicts(rs) for name, rs in runs.items() if rs}
            ideal = next(iter(medians.values()), {}).get("ideal", {})
            results[workload] = {"systems": medians, "ideal": ideal, "runs": runs}
        bar.set_detail("done")
    names = [s.name for s in systems] + list(skipped)  # skipped systems: columns of "—"
    print(
        f"workers={args.workers} size={args.size} repeat={args.repeat} "
        f"python={sys.version.split()[0]} cpus={os.cpu_count()}"
    )
    if user is not None:
        print(f"user workload: {user.describe()} x {user.tasks:,}, inflight="
              f"{user.inflight or 'all'}, {user.task_s * 1e3:.3f} ms per call here")
    print(format_table(results, names))
    for name, reason in skipped.items():
        print(f"({name}: skipped — {reason})")
    for name, na in not_applicable.items():
        by_msg = {}
        for workload, msg in na.items():
            by_msg.setdefault(msg, []).append(workload)
        for msg, workloads in by_msg.items():
            print(f"({name}: {', '.join(workloads)} n/a — {msg})")
    for name, failed in errors.items():
        by_msg: dict[str, list[str]] = {}
        for workload, msg in failed.items():
            by_msg.setdefault(msg, []).append(workload)
        for msg, workloads in by_msg.items():
            print(f"({name}: {', '.join(workloads)} skipped — failed: {msg})")
    if args.not_installed:
        print(f"(not installed: {', '.join(args.not_installed)})")

    json_path, plots_dir = _output_paths(args)
    written: list[str] = []
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    doc = {
        "meta": _meta(args, skipped, errors, args.not_installed, not_applicable),
        "results": _for_json(results),
    }
    with open(json_path, "w", encoding="utf-8") as fh:
        fh.write(dumps_compact(doc))
        fh.write("\n")
    written.append(json_path)
    if not args.no_plots:
        try:
            _plots = _load_plots()
            written += _plots.write_plots(results, names, plots_dir, workers=args.workers)
        except ImportError as exc:  # plots were not asked for (no --plots): a note is enough
            print(f"(no plots: {exc}; for plots: {PLOTS_HINT})", file=sys.stderr)
        except Exception as exc:  # a plot must not lose the run's numbers
            print(f"(plots failed: {type(exc).__name__}: {exc})", file=sys.stderr)
    print("wrote " + ", ".join(written))
    first = systems[0].name
    if errors.get(first) or not any(r["systems"] for r in results.values()):
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
