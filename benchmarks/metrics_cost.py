"""Cost of metrics on the overhead workload: no-op tasks through submit, metrics on vs off.

Runs both configurations interleaved in one process (same machine state) and
reports the median µs per task of each and their ratio.

    python benchmarks/metrics_cost.py [--tasks 20000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import stealer
from stealer.bench import workloads as wl


def one(ex: stealer.Executor, n: int) -> float:
    t = time.perf_counter()
    fs = [ex.submit(wl.noop, i) for i in range(n)]
    for f in fs:
        f.result()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tasks", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--workers", type=int, default=2)
    a = p.parse_args()
    on = stealer.Executor(a.workers, metrics=True)
    off = stealer.Executor(a.workers, metrics=False)
    try:
        for ex in (on, off):
            ex.wait_ready(60)
            one(ex, 2000)
        res: dict[str, list[float]] = {"on": [], "off": []}
        for _ in range(a.rounds):
            res["on"].append(one(on, a.tasks))
            res["off"].append(one(off, a.tasks))
    finally:
        on.shutdown()
        off.shutdown()
    m_on, m_off = statistics.median(res["on"]), statistics.median(res["off"])
    print(f"metrics on : {m_on:.2f} µs/task (median of {a.rounds})")
    print(f"metrics off: {m_off:.2f} µs/task")
    print(f"cost: {(m_on / m_off - 1) * 100:+.1f}%")


if __name__ == "__main__":
    main()
