"""The dashboard in headless Chromium on a real executor: how soon the page is ready, and the
README's pictures (a benchmark and a picture maker, not a test).

    python benchmarks/dashboard_page.py [--rounds 10] [--out docs]

One executor (2 workers, a journal) serves the page while it runs a known load: batches of
no-op tasks, a fork-join tree now and then (steals), agents that move between the workers
(one worker held by a task while they start), an agent with a deep mailbox, and a
``map(progress=True)`` read part way.  Chromium (the distribution's, driven over the
DevTools pipe by tests/browser.py) loads the page ``--rounds`` times: *page ready* is the
page's own ``performance.now()`` when it has drawn its first update, i.e. navigation start
-> first update drawn (the first round loads a fresh browser's page; every response is
``no-store``, so each round fetches the page and its assets again).  Then, after
``--settle`` seconds of history on the page, a screenshot of the whole page and of each
group of panels goes to ``--out``.  Also printed: the update's
size (bytes) during the run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = str(ROOT / "tests")
sys.path.insert(0, TESTS)  # tests/browser.py, and the agents and tasks the load runs
os.environ["PYTHONPATH"] = os.pathsep.join(
    [TESTS, *filter(None, [os.environ.get("PYTHONPATH")])])  # the workers import them too

import agents_lib as L  # noqa: E402
import tasks  # noqa: E402
from browser import Chromium, find_chromium  # noqa: E402

import stealer  # noqa: E402
from stealer.dashboard import serve_dashboard  # noqa: E402
from stealer.errors import MailboxFull  # noqa: E402

GROUPS = {  # picture -> the panels it shows
    "dashboard-overview.png": ["header", "#p-throughput", "#p-steals", "#p-matrix", "#p-heat",
                               "#p-pinning"],
    "dashboard-latency.png": ["#p-latency"],
    "dashboard-workers.png": ["#p-workers", "#p-cpu", "#p-faults"],
    "dashboard-agents.png": ["#p-maps", "#p-journal", "#p-agents"],
}


def load(ex: stealer.Executor, stop: threading.Event) -> None:
    """Tasks in batches, and a fork-join tree every second (one worker's deque loaded)."""
    last_tree = 0.0
    while not stop.is_set():
        [f.result(60) for f in [ex.submit(tasks.square, i) for i in range(200)]]
        if time.monotonic() - last_tree > 1.0:
            ex.submit(tasks.slow_tree, 1, 24, 0.005).result(60)
            last_tree = time.monotonic()
        time.sleep(0.02)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--settle", type=float, default=20.0,
                    help="seconds of history on the page before the pictures")
    ap.add_argument("--out", default=str(ROOT / "docs"))
    args = ap.parse_args()
    chromium = find_chromium()
    if chromium is None:
        sys.exit("no Chromium on PATH (apt-get install chromium)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, \
            stealer.Executor(2, journal=os.path.join(tmp, "j")) as ex, \
            serve_dashboard(ex) as dash, Chromium(Path(tmp) / "profile", chromium) as b:
        assert ex.wait_ready(60)
        stop = threading.Event()
        loader = threading.Thread(target=load, args=(ex, stop), daemon=True)
        loader.start()
        page = b.new_page(1400, 1000)
        ready = []
        for _ in range(args.rounds):
            b.call("Page.navigate", {"url": dash.url}, page)
            b.wait_for("window.stealerDashboard && window.stealerDashboard.readyMs !== null",
                       page, timeout=30)
            ready.append(b.evaluate("window.stealerDashboard.readyMs", page))
        errors = b.errors(page)
        print(f"page ready (navigation start -> first update drawn), {len(ready)} loads: "
              f"first {ready[0]:.0f} ms, median {statistics.median(ready):.0f} ms, "
              f"min {min(ready):.0f}, max {max(ready):.0f}")

        # agents that move (one worker held while they start), one with a deep mailbox
        hog = L.hog_one_worker(ex, 0.5)
        movers = [ex.spawn_agent(L.Stepper, 1500, 0.002, 10) for _ in range(6)]
        hog.result(60)
        deep = ex.spawn_agent(L.Counter, 0, 3.0, mailbox=16)
        with contextlib.suppress(MailboxFull):
            for _ in range(16):
                deep.send("add", 1, block=False)
        it = ex.map(tasks.sleep_then, [0.001] * 500, range(500), progress=True)
        for _ in range(120):
            next(it)
        sizes = []
        t_end = time.monotonic() + args.settle
        while time.monotonic() < t_end:
            time.sleep(dash.sampler.interval)
            sizes.append(len(dash.sampler.data))
        print(f"update: {statistics.mean(sizes):.0f} bytes on average, {max(sizes)} at most "
              f"({len(sizes)} samples; 2 workers, {len(movers) + 1} agents, a journal, a map)")
        for name, sel in GROUPS.items():
            b.screenshot(page, out / name, sel)
        b.screenshot(page, out / "dashboard.png")
        print("pictures:", ", ".join(str(out / n) for n in [*GROUPS, "dashboard.png"]))
        errors += b.errors(page)
        if errors:
            print("the page logged errors:\n" + "\n".join(errors))
        stop.set()
        loader.join(60)
        it.close()
        for r in [*movers, deep]:
            r.stop()
            with contextlib.suppress(Exception):
                r.result(60)


if __name__ == "__main__":
    main()
