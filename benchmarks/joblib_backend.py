"""joblib through stealer's backend beside loky's (issue 9's two benchmarks), one run.

* overhead: ``Parallel(n_jobs=2)(delayed(f)(i) for i in range(20_000))`` with a trivial
  ``f``, on an executor already started (each backend reuses its executor), and the
  first call of a fresh process (start included): seconds and µs per item.
* nested: an outer ``Parallel`` of 8 items (``--outer``; also 1: fewer outer items
  than workers), each an inner ``Parallel(n_jobs=-1)`` of 64 busy-wait items of 2 ms
  (1.02 s of work for 8): wall time, and the most child processes
  alive at once (the workers and multiprocessing's resource tracker); sequential is
  joblib's "sequential" backend.  The ideal is the work divided by the workers.  Each
  system runs in a fresh Python process of its own (so only its processes are counted),
  warmed up by one call first.

Medians of ``--repeat`` runs (default 3); the overhead runs interleave the backends.

    python benchmarks/joblib_backend.py [--workers 2] [--repeat 3] [--items 20000]
                                        [--outer 8,1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import joblib  # noqa: E402
import psutil  # noqa: E402
from joblib import Parallel, delayed, parallel_config  # noqa: E402

import stealer.joblib  # noqa: E402  (registers "stealer")

OUTER, INNER, ITEM_S = 8, 64, 0.002


def noop(i: int) -> int:
    return i


def busy(seconds: float) -> float:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
    return seconds


def inner(i: int) -> float:
    return sum(Parallel(n_jobs=-1)(delayed(busy)(ITEM_S) for _ in range(INNER)))


class Watch(threading.Thread):
    """The most child processes (recursive) alive at once while it runs."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop = threading.Event()
        self.most = 0

    def run(self) -> None:
        me = psutil.Process()
        while not self.stop.is_set():
            self.most = max(self.most, len(me.children(recursive=True)))
            time.sleep(0.02)


def overhead(backend: str, workers: int, items: int) -> float:
    with parallel_config(backend=backend, n_jobs=workers):
        t0 = time.perf_counter()
        out = Parallel()(delayed(noop)(i) for i in range(items))
        dt = time.perf_counter() - t0
    assert out == list(range(items))
    return dt


def nested(backend: str, workers: int, outer: int) -> tuple[float, int]:
    with parallel_config(backend=backend, n_jobs=workers):
        w = Watch()
        w.start()
        t0 = time.perf_counter()
        out = Parallel()(delayed(inner)(i) for i in range(outer))
        dt = time.perf_counter() - t0
        w.stop.set()
        w.join()
    assert abs(sum(out) - outer * INNER * ITEM_S) < 1e-9
    return dt, w.most


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--items", type=int, default=20_000)
    p.add_argument("--outer", default=f"{OUTER},1", help="outer item counts (comma-separated)")
    p.add_argument("--nested-only", metavar="BACKEND", help=argparse.SUPPRESS)  # one system
    args = p.parse_args(argv)
    w = args.workers
    outers = [int(x) for x in args.outer.split(",")]
    if args.nested_only:
        with parallel_config(backend=args.nested_only, n_jobs=w):
            Parallel()(delayed(noop)(i) for i in range(w))  # start the workers
        runs = {o: [nested(args.nested_only, w, o) for _ in range(args.repeat)] for o in outers}
        stealer.joblib.shutdown()
        print(json.dumps(runs))
        return 0
    print(f"joblib {joblib.__version__}, python {sys.version.split()[0]}, cpus {os.cpu_count()}, "
          f"workers {w}, load {os.getloadavg()[0]:.2f}")
    backends = ("stealer", "loky")
    cold = {b: overhead(b, w, args.items) for b in backends}  # starts each executor
    warm: dict[str, list[float]] = {b: [] for b in backends}
    for _ in range(args.repeat):
        for b in backends:
            warm[b].append(overhead(b, w, args.items))
    print(f"\noverhead: Parallel(n_jobs={w}) of {args.items:,} trivial items")
    print(f"{'backend':<10} {'warm s':>8} {'us/item':>8} {'first call s':>13}")
    for b in backends:
        m = statistics.median(warm[b])
        print(f"{b:<10} {m:8.3f} {m / args.items * 1e6:8.2f} {cold[b]:13.3f}")
    stealer.joblib.shutdown()

    systems = ("stealer", "loky", "sequential")
    runs: dict[str, dict[str, list[tuple[float, int]]]] = {}
    for s in systems:
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--nested-only", s,
                            "--workers", str(w), "--repeat", str(args.repeat),
                            "--outer", args.outer],
                           capture_output=True, text=True, timeout=300, check=True)
        runs[s] = json.loads(r.stdout.strip().splitlines()[-1])
    for o in outers:
        work = o * INNER * ITEM_S
        print(f"\nnested: outer Parallel of {o} x inner Parallel(n_jobs=-1) of {INNER} x "
              f"{ITEM_S * 1e3:.0f} ms busy items ({work:.2f} s of work; ideal "
              f"{work / w:.2f} s)")
        print(f"{'system':<11} {'wall s':>7} {'max child processes':>20}")
        for s in systems:
            wall = statistics.median(r[0] for r in runs[s][str(o)])
            most = max(r[1] for r in runs[s][str(o)])
            print(f"{s:<11} {wall:7.3f} {most:>20}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
