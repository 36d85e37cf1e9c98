"""The ``stealer`` command (also ``python -m stealer``).

Subcommands:
  demo    a short fork-join and submit demo on all cores, with timings
  topo    the machine's CPU topology and where each pinning policy puts workers
  bench   the yardstick workloads beside ProcessPoolExecutor, the installed peers and the
          ideal; a table, JSON and PNG plots (``stealer bench --quick``; your own function
          with ``--workload MODULE:FUNCTION``; see ``stealer bench --help``)
  tune    sweep pinning policies x worker counts on a workload and report the best p99 and
          throughput (``stealer tune --quick``; see ``stealer tune --help``)
  top     live view of a running executor attached by its id (``Executor.id``): queue
          depths, steps/steals/parks per second, per-tier latency, busiest workers
  dashboard  the same executor in a web browser (read-only, 127.0.0.1 and a token by
          default): throughput, queue heat strip, steals, latency CDFs, agents, CPU/RSS
  journal what an agents' journal (``Executor(journal=PATH)``) holds: its agents, their
          generations, last snapshots and event counts, and what ``recover=True`` would
          do; ``--agent NAME`` shows the tail of one agent's log
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence


def _demo(args: argparse.Namespace) -> int:
    import stealer
    from stealer.bench import workloads as wl

    t0 = time.perf_counter()
    with stealer.Executor(args.workers) as ex:
        ex.wait_ready(60)
        ready = time.perf_counter() - t0
        print(f"stealer {stealer.__version__}: {ex.max_workers} workers pinned to {ex.cpus}, "
              f"ready in {ready * 1e3:.0f} ms")
        n = 20_000
        t = time.perf_counter()
        fs = [ex.submit(wl.noop, i) for i in range(n)]
        total = sum(f.result() for f in fs)
        dt = time.perf_counter() - t
        assert total == n * (n - 1) // 2
        print(f"submit: {n:,} no-op tasks in {dt:.3f} s = {dt / n * 1e6:.1f} µs per task")
        t = time.perf_counter()
        seq = stealer.run_inline(wl.fib, 31, 18)
        t_seq = time.perf_counter() - t
        t = time.perf_counter()
        par = ex.submit(wl.fib, 31, 18).result()
        t_par = time.perf_counter() - t
        assert par == seq
        print(f"fork-join fib(31): {t_par:.3f} s on {ex.max_workers} workers vs {t_seq:.3f} s "
              f"in one process = {t_seq / t_par:.2f}x speedup")
    return 0


def _topo(args: argparse.Namespace) -> int:
    from stealer import affinity

    print(affinity.describe(affinity.read_topology(), args.workers))
    return 0


def _bench(argv: Sequence[str]) -> int:
    """``stealer bench ARGS``: :func:`stealer.bench.cli.main` (it parses its own options)."""
    from stealer.bench.cli import main as bench_main

    return bench_main(argv)


def _tune(argv: Sequence[str]) -> int:
    """``stealer tune ARGS``: :func:`stealer.tune.main` (it parses its own options)."""
    from stealer.tune import main as tune_main

    return tune_main(argv)


def _journal(args: argparse.Namespace) -> int:
    from stealer.agents.journal.inspection import describe
    from stealer.errors import JournalError

    try:
        print(describe(args.path, args.agent, args.tail))
    except JournalError as exc:
        print(f"stealer journal: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return _bench(argv[1:])
    if argv and argv[0] == "tune":
        return _tune(argv[1:])
    if argv and argv[0] == "top":
        from stealer.top import main as top_main

        return top_main(argv[1:])
    if argv and argv[0] == "dashboard":
        from stealer.dashboard.cli import main as dashboard_main

        return dashboard_main(argv[1:])
    p = argparse.ArgumentParser(prog="stealer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="a short demo on all cores")
    d.add_argument("--workers", type=int, default=None)
    t = sub.add_parser("topo", help="CPU topology and pinning policies")
    t.add_argument("--workers", type=int, default=None)
    sub.add_parser("bench", help="yardstick benchmarks (see stealer bench --help)")
    sub.add_parser("tune", help="best pinning policy and worker count (see stealer tune --help)")
    sub.add_parser("top", help="live view of a running executor (see stealer top --help)")
    sub.add_parser("dashboard", help="the live view in a web browser (see stealer dashboard "
                                     "--help)")
    j = sub.add_parser("journal", help="what an agents' journal holds, and what recovery "
                                       "would do")
    j.add_argument("path", help="the journal directory (Executor(journal=PATH))")
    j.add_argument("--agent", default=None, help="an agent's name or uid: the tail of its log")
    j.add_argument("--tail", type=int, default=20, help="events shown with --agent")
    args = p.parse_args(argv)
    return {"demo": _demo, "topo": _topo, "journal": _journal}[args.cmd](args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
