"""What every workload of ``stealer bench`` shares: problem sizes, the wait timeout, opening
a warm executor (:func:`_open`) and waiting on its futures, the arrival-clock sleep, the
downsampling of latency samples, and the progress hook workloads report through.  Imported by
the workload modules (:mod:`stealer.bench.wl_tasks`, :mod:`~stealer.bench.wl_forkjoin`,
:mod:`~stealer.bench.wl_agents`, :mod:`~stealer.bench.wl_user`), by :mod:`stealer.bench.cli`
(which installs the progress hook) and by :mod:`stealer.tune`.

Each workload is a function ``run_<name>(system, workers, quick) -> dict`` that opens a fresh
executor from ``system`` (a :class:`System`: a name and a factory ``workers -> Executor``),
measures, shuts it down, and returns plain JSON-able numbers, with the zero-overhead ideal of
the same trace on the same number of workers under ``"ideal"`` (see
:mod:`stealer.bench.ideal`).  Every result also carries ``ready_s``: constructor plus the first
no-op result.  ``quick`` is ``False`` (full size), ``True`` (the ``--quick`` size) or one of
:data:`SIZES` (``"tiny"``: a few hundred tasks, for tests).
"""

from __future__ import annotations

import concurrent.futures as cf
import gc
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from stealer.bench import workloads as _wl
from stealer.bench.systems import System

__all__ = [
    "WAIT_TIMEOUT_S",
    "SIZES",
    "MAX_SAMPLES",
    "precise_sleep_until",
    "downsample",
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


# ``stealer bench``'s progress bar, while one is shown: workloads report how far they are (0..1).
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
