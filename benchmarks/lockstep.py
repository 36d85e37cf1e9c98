"""Lockstep agents (issue 19): a client steps N stateful agents in
rounds, one call per agent per round, as a reinforcement-learning vector environment does.

Every system runs the same environments (:class:`stealer.bench.lockstep.Env`: 64 particles,
a few KB of numpy state and a dict, ``act(action)`` doing real numpy work calibrated here to
``--work-ms`` of CPU) and the same client loop (:func:`stealer.bench.lockstep.drive`):

- one process: a loop over the environments (also the oracle: every other system's final
  states and observations must equal its own, or the script exits 1);
- pipes: one process per environment and a ``multiprocessing.Pipe`` each, as gymnasium's
  AsyncVectorEnv and Stable-Baselines3's SubprocVecEnv do; a round sends every action, then
  receives every reply;
- ProcessPool: ``concurrent.futures.ProcessPoolExecutor``, the state shipped with each call;
- stealer: one agent per environment, ``ref.call("act", a)`` for each, then every reply
  (``ex.call_all`` once the executor has it).

Both configurations of the yardstick by default: 32 agents x 0.5 ms and 256 agents x 0.05 ms
(overhead-bound); ``--agents``/``--work-ms`` run one configuration of your choice instead.
Reported per system: calls/s, fraction of the ideal (``ceil(N / W)`` handler times per round),
the share of the W cores' time spent in handlers (the same fraction, but with the handler
time measured in that run: the shared VM's load moves a handler's cost between runs), round
time p50/p99, the client's CPU per call (outside handlers), the workers' CPU per call
beyond the handlers, the handlers' CPU per call where they ran, and stealer's agent migrations
per 1,000 calls.  Then stealer and the pipes again, interleaved (``stealer.bench.lockstep.
interleave``: both alive, taking turns in ``--blocks`` blocks of rounds, A B then B A), for a
stealer / pipes ratio that a change of the machine's load during the run does not bias (run
one after the other, a slower minute for one of them moved the ratio by a third on the
shared VM).  Targets (issue 19): stealer >= 0.9 of ideal (32 x 0.5 ms), >= 0.8
(256 x 0.05 ms), >= 1.5x the pipes; <= 10 µs client and <= 10 µs worker overhead per call.

    PYTHONPATH=$PWD python benchmarks/lockstep.py [--quick] [--workers 2] [--rounds 200]
        [--agents N --work-ms MS] [--blocks 8] [--json]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import sys
import time
from typing import Any

import stealer
from stealer.bench import lockstep as L
from stealer.bench import workloads as wl

COLUMNS = [  # (key, header, format)
    ("calls_per_s", "calls/s", ",.0f"),
    ("of_ideal", "of ideal", ".2f"),
    ("handler_share", "in handlers", ".2f"),
    ("round_p50_ms", "round p50 ms", ".2f"),
    ("round_p99_ms", "p99 ms", ".2f"),
    ("client_us", "client µs/call", ".1f"),
    ("worker_us", "worker µs/call", ".1f"),
    ("busy_us", "less spin", ".1f"),
    ("spin_us", "spin", ".1f"),
    ("handler_us", "handler µs", ".0f"),
    ("migrations_per_1k", "migr./1k", ".1f"),
]


def _warm(ex: cf.Executor, workers: int) -> cf.Executor:
    """Every worker started and past its first task."""
    for f in [ex.submit(wl.busy, 0.005) for _ in range(2 * workers)]:
        f.result(L.WAIT_S)
    return ex


def run_config(cfg: L.Config, workers: int, blocks: int = 8) -> dict[str, Any]:
    """Every system on ``cfg``, side by side; each checked against the one-process run.
    Then (``blocks`` > 0) stealer and the pipes interleaved (L.stealer_vs_pipes)."""
    cal = L.calibrate(cfg.work_s)
    runs: dict[str, dict[str, Any]] = {}
    runs["one process"] = oracle = L.run_sequential(cfg, cal, workers)
    runs["pipes (process per agent)"] = L.run_pipes(cfg, cal, workers)  # forks: no executor yet
    with _warm(cf.ProcessPoolExecutor(workers), workers) as ex:
        runs["ProcessPool (state shipped)"] = L.run_shipped(ex, cfg, cal, workers)
    with _warm(stealer.Executor(workers), workers) as ex:
        runs["stealer agents"] = L.run_agents(ex, cfg, cal, workers)
    failed = []
    for name, res in runs.items():
        try:
            L.check(name, res, oracle)
        except RuntimeError as exc:
            failed.append(str(exc))
    for res in runs.values():
        del res["finals"], res["last_obs"]
    stealer_cps = runs["stealer agents"]["calls_per_s"]
    out = {
        "agents": cfg.agents, "work_ms": cfg.work_s * 1e3, "rounds": cfg.rounds,
        "warmup": cfg.warmup, "workers": workers, "iters": cal.iters,
        "handler_ms": cal.handler_s * 1e3, "ideal": L.ideal(cfg, cal, workers),
        "systems": runs, "failed": failed,
        "stealer_vs_pipes": stealer_cps / runs["pipes (process per agent)"]["calls_per_s"],
    }
    if blocks > 0:  # stealer and the pipes again, both alive, taking turns by blocks
        try:
            out["interleaved"] = L.stealer_vs_pipes(
                cfg, cal, lambda: _warm(stealer.Executor(workers), workers), blocks)
        except RuntimeError as exc:
            failed.append(str(exc))
    return out


def _fmt(value: Any, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def print_table(cfg: L.Config, res: dict[str, Any]) -> None:
    print(f"\n{cfg.label}: {res['agents']} agents, handler {res['work_ms']:g} ms "
          f"({res['iters']} iterations, {res['handler_ms']:.3f} ms measured here), "
          f"{res['workers']} workers, {res['rounds']} rounds after {res['warmup']} warm-up")
    rows = [("ideal", res["ideal"]), *res["systems"].items()]
    width = max(len(name) for name, _ in rows)
    heads = [h for _k, h, _s in COLUMNS]
    cells = [[_fmt(r.get(k), s) for k, _h, s in COLUMNS] for _n, r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]
    print("  ".join([" " * width, *(h.rjust(w) for h, w in zip(heads, widths))]))
    for (name, _r), c in zip(rows, cells):
        print("  ".join([name.ljust(width), *(x.rjust(w) for x, w in zip(c, widths))]))
    print(f"stealer / pipes calls/s: {res['stealer_vs_pipes']:.2f}")
    il = res.get("interleaved")
    if il:
        lo, hi = min(il["block_ratios"]), max(il["block_ratios"])
        print(f"stealer / pipes calls/s, interleaved ({il['blocks']} blocks, {il['rounds']} "
              f"rounds in all): {il['stealer_vs_pipes']:.2f} ({il['stealer_calls_per_s']:,.0f} "
              f"vs {il['pipes_calls_per_s']:,.0f}; blocks {lo:.2f}-{hi:.2f})")
    for msg in res["failed"]:
        print(f"WRONG: {msg}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--agents", type=int, help="one configuration: this many agents "
                   "(default: both yardstick configurations)")
    p.add_argument("--work-ms", type=float, help="one configuration: handler CPU time in ms")
    p.add_argument("--rounds", type=int, help="measured rounds (default 200, --quick 30)")
    p.add_argument("--warmup", type=int, help="warm-up rounds (default 20, --quick 5)")
    p.add_argument("--quick", action="store_true", help="fewer rounds")
    p.add_argument("--blocks", type=int, default=8, help="blocks of the interleaved stealer "
                   "vs pipes run (0: none)")
    p.add_argument("--json", action="store_true", help="also print the results as JSON")
    a = p.parse_args(argv)
    rounds, warmup = L.ROUNDS["quick" if a.quick else "full"]
    configs = list(L.CONFIGS)
    if a.agents is not None or a.work_ms is not None:
        base = L.CONFIGS[0]
        configs = [L.Config("custom", a.agents or base.agents,
                            base.work_s if a.work_ms is None else a.work_ms / 1e3, 0, 0)]
    if min(a.workers, a.agents or 1, a.rounds or 1) < 1 or (a.work_ms or 1) <= 0:
        p.error("--workers, --agents, --rounds and --work-ms must be positive")
    if a.blocks < 0:
        p.error("--blocks must be 0 (no interleaved run) or more")
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    for base in configs:
        cfg = L.Config(base.name, base.agents, base.work_s, a.rounds or rounds,
                       warmup if a.warmup is None else a.warmup)
        out[cfg.name] = res = run_config(cfg, a.workers, a.blocks)
        print_table(cfg, res)
    print(f"\n({time.perf_counter() - t0:.1f} s)")
    if a.json:
        json.dump(out, sys.stdout, indent=1)
        print()
    return 1 if any(r["failed"] for r in out.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
