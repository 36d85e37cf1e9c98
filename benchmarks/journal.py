"""The journal's costs (issue 8): throughput with and without it, and recovery time.

1. Overhead: the ``agents`` yardstick (``stealer bench``: 200 self-driven agents x 25
   steps of 0.5 ms, each carrying a 1,000-float array) without a journal and with
   ``durability="batch"`` (the default), ``"always"`` and ``"none"``, interleaved, median
   of ``--repeat`` runs each.  The cost is the makespan ratio minus one (target: batch
   <= 15%).
2. Recovery: ``--agents`` (10,000) message-only agents, each with a snapshot (taken when
   the executor that spawned them shut down) and ``--events`` (100) messages logged after
   it; then ``Executor(journal=..., recover=True)``: the time to read the journal (plan),
   to restart every agent (the constructor), and until every agent has applied its
   messages (a call to each, queued behind them, answers with the count).

    python benchmarks/journal.py [--repeat 3] [--agents 10000] [--events 100] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import stealer
from stealer.agents import journal as J
from stealer.bench.systems import System
from stealer.bench.wl_agents import run_agents
from stealer.client.agents import encode_message


class Counter(stealer.Agent):
    """Message-only: counts what it was sent."""

    def __init__(self) -> None:
        self.n = 0
        self.total = 0

    def bump(self, k: int) -> None:
        self.n += 1
        self.total += k

    def count(self) -> int:
        return self.n


def overhead(repeat: int, workers: int) -> dict[str, Any]:
    modes = [None, "batch", "always", "none"]
    runs: dict[str, list[dict[str, Any]]] = {str(m): [] for m in modes}
    for _ in range(repeat):
        for mode in modes:
            d = tempfile.mkdtemp(prefix="stealer-jbench-")
            try:
                def make(w: int, _d: str = d, _m: Any = mode, **options: Any) -> Any:
                    if _m is None:
                        return stealer.Executor(w, **options)
                    return stealer.Executor(w, journal=_d, durability=_m, **options)

                system = System("stealer", make, forkjoin="native", agents="native")
                runs[str(mode)].append(run_agents(system, workers, False))
            finally:
                shutil.rmtree(d, ignore_errors=True)
    out = {}
    base = statistics.median(r["makespan_s"] for r in runs["None"])
    for mode, rs in runs.items():
        ms = statistics.median(r["makespan_s"] for r in rs)
        out[mode] = {
            "makespan_s": ms,
            "efficiency": statistics.median(r["efficiency"] for r in rs),
            "step_p99_ms": statistics.median(r["step_p99_ms"] for r in rs),
            "cost": ms / base - 1.0,
        }
    return out


def recovery(agents: int, events: int, workers: int) -> dict[str, Any]:
    d = tempfile.mkdtemp(prefix="stealer-jrec-")
    records = 1 << max(16, (agents * (events + 3) * 2).bit_length())
    try:
        t = time.perf_counter()
        with stealer.Executor(workers, journal=d, records=records) as ex:
            refs = [ex.spawn_agent(Counter, checkpoint_every=1 << 30, checkpoint_seconds=1e9)
                    for _ in range(agents)]
            for r in refs[-10:]:
                r.call("count").result(60)
            uids = [r.uid for r in refs]
        t_build = time.perf_counter() - t
        # events logged after each agent's snapshot, written straight into the client's
        # shard (what a client killed after sending them leaves behind)
        t = time.perf_counter()
        shard = J.Shard(os.path.join(d, "client.db"), "none", 1)
        shard.c.execute("BEGIN")  # one transaction around the shard's own writes
        seq = 0
        for k in range(events):
            for uid in uids:
                seq += 1
                data, bufs = encode_message(-1, "bump", (k,), None, -1, None, "cbench", seq)
                body, oob = J.pack((data, bufs))
                shard.msg(uid, "cbench", seq, False, body, oob)
        shard.c.execute("COMMIT")
        shard.close()
        t_write = time.perf_counter() - t
        t = time.perf_counter()
        pl = J.plan(d)
        t_plan = time.perf_counter() - t
        got = sum(len(a.msgs) for a in pl.agents.values())
        if got != agents * events:
            ended = [a for a in pl.agents.values() if a.end is not None]
            why = J.loads(*ended[0].end[1:]) if ended else None
            raise RuntimeError(f"the plan replays {got} events, not {agents * events}: "
                               f"{pl.warnings[:3]}; {len(ended)} agents ended ({why!r})")
        t0 = time.perf_counter()
        with stealer.Executor(workers, journal=d, recover=True, records=records) as ex:
            t_open = time.perf_counter() - t0
            assert ex.recovered == agents, ex.recovered
            c = ex._pool.agents
            refs = [stealer.AgentRef(c.by_uid[u], c.name, c, u) for u in uids]
            fs = [r.call("count") for r in refs]
            counts = [f.result(600) for f in fs]
            t_all = time.perf_counter() - t0
        bad = sum(1 for n in counts if n != events)
        if bad:
            raise RuntimeError(f"{bad} agents did not apply their {events} messages")
        return {"agents": agents, "events_per_agent": events, "build_s": t_build,
                "write_events_s": t_write, "plan_s": t_plan, "recover_open_s": t_open,
                "all_applied_s": t_all,
                "events_per_s": agents * events / t_all}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--agents", type=int, default=10_000)
    p.add_argument("--events", type=int, default=100)
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument("--skip-recovery", action="store_true")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    res: dict[str, Any] = {}
    if not a.skip_overhead:
        res["overhead"] = o = overhead(a.repeat, a.workers)
        print(f"agents workload (200 agents x 25 steps of 0.5 ms, {a.workers} workers, "
              f"median of {a.repeat}):")
        print(f"  {'journal':<10} {'makespan s':>11} {'efficiency':>11} {'step p99 ms':>12} "
              f"{'cost':>8}")
        for mode, r in o.items():
            name = "off" if mode == "None" else mode
            print(f"  {name:<10} {r['makespan_s']:>11.3f} {r['efficiency']:>11.3f} "
                  f"{r['step_p99_ms']:>12.1f} {r['cost'] * 100:>7.1f}%")
    if not a.skip_recovery:
        res["recovery"] = r = recovery(a.agents, a.events, a.workers)
        print(f"recovery of {r['agents']:,} agents x {r['events_per_agent']} events since "
              f"their snapshot ({a.workers} workers):")
        print(f"  read the journal (plan)           {r['plan_s']:.2f} s")
        print(f"  Executor(recover=True) returned   {r['recover_open_s']:.2f} s")
        print(f"  every event applied               {r['all_applied_s']:.2f} s "
              f"({r['events_per_s']:,.0f} events/s)")
    if a.json:
        json.dump(res, sys.stdout, indent=2)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
