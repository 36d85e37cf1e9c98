"""The user's own workload of ``stealer bench --workload MODULE:FUNCTION`` (and of
``stealer tune --workload``): resolving the function, reading ``--args``/``--kwargs``
(:func:`_json_value`), :class:`UserWorkload`, timing one call in the client
(:func:`calibrate`), the closed-loop ideal and :func:`run_user`.  Called by
:mod:`stealer.bench.cli` and :mod:`stealer.tune`.

- ``user`` (``--workload MODULE:FUNCTION``): the user's function called ``--tasks`` times with
  ``--args`` (a JSON list) through each system, see :func:`run_user`.
"""

from __future__ import annotations

import concurrent.futures as cf
import heapq
import importlib
import json
import math
import os
import queue
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stealer.bench import ideal as _ideal
from stealer.bench.harness import WAIT_TIMEOUT_S, _open, _report, downsample
from stealer.bench.systems import System

__all__ = [
    "USER_TASKS",
    "UserWorkload",
    "resolve_function",
    "calibrate",
    "closed_loop_ideal",
    "run_user",
]

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
