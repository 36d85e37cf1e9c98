"""What the dashboard costs: update bytes and sampler CPU as tasks and agents pile up, and
the executor's throughput with a page open vs none (a benchmark, not a test).

    python benchmarks/dashboard_cost.py [--tasks 1000000] [--agents 100000] [--rounds 5]

1. *flat*: one executor (2 workers); after 0, 10k, 100k... ``--tasks`` no-op tasks done,
   one page listens for ``--listen`` seconds: mean bytes per update and the sampler's CPU
   ms per second.  Then ``--agents`` idle agents are spawned (dormant; ``records`` sized
   for them) and the same is measured.
2. *cost*: rounds of the overhead workload (µs per no-op task through submit) and of the
   skew workload (capped-Pareto busy tasks, efficiency = work / workers / makespan), each
   with no page and with one page open (another process reading the event stream and
   parsing every update, as the page's script does), interleaved (ABBA) in one process;
   medians and quartiles side by side.

A page in a browser on the same machine adds its own rendering CPU, which this leaves out.
On a small shared machine the rounds vary by 2x or more: read the quartiles, and run
many rounds.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

from metrics_cost import one as submit_us  # µs per no-op task through submit (beside us)

import stealer
from stealer.bench import ideal
from stealer.bench import workloads as wl
from stealer.bench.wl_tasks import skew_trace
from stealer.dashboard import DashboardServer, serve_dashboard


class Page:
    """An event-stream reader in a thread: what an open page asks of the server."""

    def __init__(self, d: DashboardServer) -> None:
        self.c = http.client.HTTPConnection("127.0.0.1", d.port, timeout=30)
        self.c.request("GET", "/events", headers={"Authorization": f"Bearer {d.token}"})
        self.r = self.c.getresponse()
        self.sizes: list[int] = []
        self.last: dict[str, Any] = {}
        self._stop = False
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self) -> None:
        while not self._stop:
            line = self.r.fp.readline()
            if not line:
                return
            if line.startswith(b"data: "):
                self.sizes.append(len(line) - 7)
                self.last = json.loads(line[6:])

    def close(self) -> None:
        self._stop = True
        self.c.close()


_READER = """
import http.client, json, sys
c = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=30)
c.request("GET", "/events", headers={"Authorization": "Bearer " + sys.argv[2]})
r = c.getresponse()
print("open", flush=True)
for line in r.fp:
    if line.startswith(b"data: "):
        json.loads(line[6:])
"""


class PageProcess:
    """An event-stream reader in its own process, as a browser's page is."""

    def __init__(self, d: DashboardServer) -> None:
        self.p = subprocess.Popen([sys.executable, "-c", _READER, str(d.port), d.token],
                                  stdout=subprocess.PIPE, text=True)
        assert self.p.stdout is not None and self.p.stdout.readline().strip() == "open"

    def close(self) -> None:
        self.p.kill()
        self.p.wait()


def skew_eff(ex: stealer.Executor, durations: list[float], workers: int) -> float:
    last = [0.0]

    def record(_f: Any) -> None:
        last[0] = max(last[0], time.perf_counter())

    t0 = time.perf_counter()
    fs = [ex.submit(wl.busy, d) for d in durations]
    for f in fs:
        f.add_done_callback(record)
    for f in fs:
        f.result()
    return math.fsum(durations) / workers / (last[0] - t0)


def listen(d: DashboardServer, seconds: float) -> tuple[float, float, int]:
    """(mean bytes per update, sampler CPU ms per s, updates) with one page open."""
    page = Page(d)
    try:
        time.sleep(1.0)  # the sampler's rate window fills
        n0, c0, t0 = len(page.sizes), d.sampler.cpu_s, time.monotonic()
        time.sleep(seconds)
        sizes = page.sizes[n0:]
        cpu = (d.sampler.cpu_s - c0) / (time.monotonic() - t0) * 1e3
    finally:
        page.close()
    return statistics.fmean(sizes), cpu, len(sizes)


def flat(args: argparse.Namespace) -> None:
    print(f"flat: {args.workers} workers, one page, {args.listen:.0f} s per row")
    print(f"{'tasks done':>12} {'agents':>8} {'bytes/update':>13} {'sampler ms/s':>13} "
          f"{'updates':>8}")
    records = 1 << max(14, (args.agents + 4096).bit_length())
    with stealer.Executor(args.workers, records=records) as ex:
        ex.wait_ready(60)
        with serve_dashboard(ex) as d:
            done = 0
            marks = [0] + [m for m in (10_000, 100_000, 1_000_000, 10_000_000)
                           if m <= args.tasks]
            for mark in marks:
                while done < mark:
                    step = min(20_000, mark - done)
                    fs = [ex.submit(wl.noop, i) for i in range(step)]
                    for f in fs:
                        f.result()
                    done += step
                b, cpu, n = listen(d, args.listen)
                print(f"{done:>12,} {0:>8,} {b:>13,.0f} {cpu:>13.2f} {n:>8}", flush=True)
            if args.agents:
                refs = ex.spawn_agents(wl.IdleAgent, [()] * args.agents)
                time.sleep(1.0)
                b, cpu, n = listen(d, args.listen)
                print(f"{done:>12,} {len(refs):>8,} {b:>13,.0f} {cpu:>13.2f} {n:>8}",
                      flush=True)
                del refs


def cost(args: argparse.Namespace) -> None:
    durations = skew_trace(True)
    bound = ideal.makespan_lower_bound(durations, args.workers)
    print(f"\ncost: {args.rounds} rounds, {args.workers} workers; overhead {args.submit:,} "
          f"no-op tasks, skew {len(durations)} tasks ({math.fsum(durations):.2f} s of work, "
          f"lower bound {bound:.2f} s)")
    res: dict[str, dict[str, list[float]]] = {k: {"none": [], "open": []}
                                             for k in ("submit_us", "skew_eff")}
    with stealer.Executor(args.workers) as ex:
        ex.wait_ready(60)
        submit_us(ex, 2000)
        with serve_dashboard(ex) as d:
            for r in range(args.rounds):
                for mode in (("none", "open") if r % 2 == 0 else ("open", "none")):  # ABBA
                    page = PageProcess(d) if mode == "open" else None
                    try:
                        if page is not None:
                            time.sleep(0.5)
                        res["submit_us"][mode].append(submit_us(ex, args.submit))
                        res["skew_eff"][mode].append(skew_eff(ex, durations, args.workers))
                    finally:
                        if page is not None:
                            page.close()
        cpu = d.sampler.cpu_s
    print(f"{'':<18} {'no page: median [quartiles]':>30} {'page open: median [quartiles]':>30} "
          f"{'change':>8}")
    for key, label, fmt in (("submit_us", "submit µs/task", "{:.2f}"),
                            ("skew_eff", "skew efficiency", "{:.3f}")):
        cells = []
        for mode in ("none", "open"):
            q = statistics.quantiles(res[key][mode], n=4)
            cells.append(f"{fmt.format(statistics.median(res[key][mode]))} "
                         f"[{fmt.format(q[0])}, {fmt.format(q[2])}]")
        a, b = (statistics.median(res[key][m]) for m in ("none", "open"))
        print(f"{label:<18} {cells[0]:>30} {cells[1]:>30} {(b - a) / a * 100:>+7.1f}%")
    print(f"(medians of {args.rounds} rounds; sampler CPU while pages were open: {cpu:.2f} s)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--tasks", type=int, default=1_000_000, help="tasks done by the last row")
    p.add_argument("--agents", type=int, default=100_000)
    p.add_argument("--listen", type=float, default=3.0, help="seconds each row listens")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--submit", type=int, default=20_000, help="tasks per overhead round")
    p.add_argument("--only", choices=("flat", "cost"), default=None)
    args = p.parse_args()
    if args.only != "cost":
        flat(args)
    if args.only != "flat":
        cost(args)


if __name__ == "__main__":
    main()
