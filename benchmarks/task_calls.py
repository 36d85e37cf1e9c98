"""Tasks that call agents and wait for each reply (Ray's ``ray.get(actor.f.remote())``
inside a task), beside the client making the same calls.

Four agents hold a counter; each call adds to it (a no-op handler: what is measured is
the call).  Rows, in one run on the same executor:

- client, one at a time: ``ref.call("add", 1).result()`` in a loop in the client;
- plain tasks: ``--tasks`` tasks, each ``--calls`` calls ``ref.call("add", 1).result()``
  one after the other (its worker runs its agents while it waits);
- generator tasks: the same with ``yield ref.call("add", 1)``;
- generator tasks, batched: each task yields ``stealer.call_all`` of the four agents,
  ``--calls / 4`` times.

With ``--ray`` (Ray installed: ``pip install 'stealer[ray]'``), the same plain-task row on
Ray, in the same run: four actors, ``--tasks`` Ray tasks each making ``--calls`` calls
``ray.get(actor.add.remote(1))`` (``ray.init(num_cpus=--workers)`` on this machine).

Reported: calls/s and wall µs per call; the counters' sum is checked (every call applied
exactly once, or the script exits 1).

    python benchmarks/task_calls.py [--workers 2] [--tasks 8] [--calls 500] [--ray] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import stealer


class Tally(stealer.Agent):
    def __init__(self) -> None:
        self.n = 0

    def add(self, k: int) -> int:
        self.n += k
        return self.n

    def get(self) -> int:
        return self.n


def plain(refs: list, calls: int) -> int:
    m = len(refs)
    for i in range(calls):
        refs[i % m].call("add", 1).result()
    return calls


def generator(refs: list, calls: int):
    m = len(refs)
    for i in range(calls):
        yield refs[i % m].call("add", 1)
    return calls


def batched(refs: list, calls: int):
    for _ in range(calls // len(refs)):
        yield stealer.call_all(refs, "add", [(1,)] * len(refs))
    return calls // len(refs) * len(refs)


def ray_row(workers: int, tasks: int, calls: int) -> tuple[str, int, float]:
    """Ray's plain-task row: tasks calling actors, each call waited for."""
    import ray

    @ray.remote(num_cpus=0)
    class RayTally:
        def __init__(self) -> None:
            self.n = 0

        def add(self, k: int) -> int:
            self.n += k
            return self.n

    @ray.remote
    def ray_plain(actors: list, calls: int) -> int:
        m = len(actors)
        for i in range(calls):
            ray.get(actors[i % m].add.remote(1))
        return calls

    ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
    try:
        actors = [RayTally.remote() for _ in range(4)]
        ray.get(ray_plain.remote(actors, 40))  # warm: a worker started, the actors up
        t = time.perf_counter()
        done = sum(ray.get([ray_plain.remote(actors, calls) for _ in range(tasks)]))
        dt = time.perf_counter() - t
        total = sum(ray.get([a.add.remote(0) for a in actors]))
    finally:
        ray.shutdown()
    if total != done + 40:
        raise SystemExit(f"error: Ray's actors counted {total} calls, {done + 40} were made")
    return "Ray: plain tasks, ray.get(actor call)", done, dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--ray", action="store_true", help="Ray tasks calling actors, beside")
    a = ap.parse_args()
    out: dict = {"workers": a.workers, "tasks": a.tasks, "calls_per_task": a.calls}
    with stealer.Executor(a.workers) as ex:
        refs = [ex.spawn_agent(Tally) for _ in range(4)]
        ex.submit(plain, refs, 40).result()  # warm: every worker imported the task
        expected = 40
        rows = []

        t = time.perf_counter()
        n = a.tasks * a.calls
        for i in range(n):
            refs[i % 4].call("add", 1).result()
        rows.append(("client, one at a time", n, time.perf_counter() - t))
        expected += n

        for name, fn in (("plain tasks, result()", plain), ("generator tasks, yield", generator),
                         ("generator tasks, call_all of 4", batched)):
            t = time.perf_counter()
            done = sum(f.result() for f in [ex.submit(fn, refs, a.calls)
                                            for _ in range(a.tasks)])
            rows.append((name, done, time.perf_counter() - t))
            expected += done
        total = sum(r.call("get").result() for r in refs)
    if total != expected:
        print(f"error: the agents counted {total} calls, {expected} were made", file=sys.stderr)
        return 1
    if a.ray:
        rows.append(ray_row(a.workers, a.tasks, a.calls))
        out["plain_tasks_vs_ray"] = round(rows[1][1] / rows[1][2] / (rows[-1][1] / rows[-1][2]),
                                          1)
    out["rows"] = {name: {"calls": n, "calls_per_s": round(n / s), "us_per_call": round(
        1e6 * s / n, 1)} for name, n, s in rows}
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"{a.tasks} tasks x {a.calls} calls, 4 agents, {a.workers} workers "
          f"(every call counted once: {total})")
    print(f"{'':40}{'calls/s':>10}{'µs/call':>10}")
    for name, row in out["rows"].items():
        print(f"{name:40}{row['calls_per_s']:>10,}{row['us_per_call']:>10}")
    if "plain_tasks_vs_ray" in out:
        print(f"plain tasks' calls/s, stealer / Ray: {out['plain_tasks_vs_ray']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
