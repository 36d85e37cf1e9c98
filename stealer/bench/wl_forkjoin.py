"""The ``forkjoin`` workload of ``stealer bench``: fib and UTS on each system, natively on an
executor with fork-join (stealer) and client-driven on a plain pool, against the one-process
baseline (measured once per process) and the Brent bound.  Registered in
:data:`stealer.bench.cli.WORKLOADS`.

- ``forkjoin``: fib with a sequential cutoff and the UTS binomial tree
  (:mod:`stealer.bench.workloads`); speedup over one process.  The one-process time is
  ``stealer.run_inline`` of the same generator task when stealer is importable, else the
  plain sequential function (``fib_seq``/``uts_seq``); both are in the JSON.  A system with
  native fork-join (stealer) submits the root generator task; a plain executor runs the same
  decomposition client-driven: fib's leaf sub-problems through ``map``, and UTS as a loop that
  submits :func:`~stealer.bench.workloads.uts_expand` on each bag and resubmits the frontier
  it returns.  Results are checked against the sequential answer.
"""

from __future__ import annotations

import concurrent.futures as cf
import gc
import queue
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from stealer.bench import ideal as _ideal
from stealer.bench import workloads as _wl
from stealer.bench.harness import WAIT_TIMEOUT_S, _open, _report, _size
from stealer.bench.systems import System

__all__ = [
    "ForkJoinSizes",
    "FORKJOIN_SIZES",
    "forkjoin_baseline",
    "run_forkjoin",
]


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
