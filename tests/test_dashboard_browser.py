"""The dashboard in a real browser: headless Chromium (the distribution's package, driven
through the DevTools protocol by tests/browser.py) loads the page from a real executor.

Checked: the page is ready (first update drawn) quickly and logs no console error, no
uncaught exception and no CSP violation; the token leaves the address bar; the charts'
data follow a known workload (steals appear when one worker's deque is loaded; an agent
with a full mailbox shows that depth in the agents table; the latency panel draws the
tier that ran); a screenshot is saved (``$STEALER_TEST_ARTIFACTS``, else the test's tmp
folder).  Skipped, saying so, where no Chromium is installed (``.ci/run`` installs it).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import agents_lib as L
import pytest
import tasks
from browser import Chromium, find_chromium

import stealer
from stealer.dashboard import serve_dashboard
from stealer.errors import MailboxFull

T = 30
CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium on PATH (apt-get install chromium; .ci/run does): "
                             "the real-browser dashboard test needs one")


@pytest.fixture(scope="module")
def ex():
    with stealer.Executor(2) as ex:
        assert ex.wait_ready(60)
        yield ex


def artifacts(tmp_path: Path) -> Path:
    out = Path(os.environ.get("STEALER_TEST_ARTIFACTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    return out


def test_the_page_in_chromium(ex, tmp_path):
    with serve_dashboard(ex) as d, Chromium(tmp_path / "profile", CHROMIUM) as b:
        page = b.new_page(1400, 1000)
        t0 = time.monotonic()
        b.call("Page.navigate", {"url": d.url}, page)
        b.wait_for("window.stealerDashboard && window.stealerDashboard.updates >= 1", page)
        ready_s = time.monotonic() - t0
        assert ready_s < 5.0, f"first update drawn after {ready_s:.2f} s"
        # measured by the page itself: navigation start -> the first update drawn
        ready_ms = b.evaluate("window.stealerDashboard.readyMs", page)
        assert isinstance(ready_ms, (int, float)) and ready_ms > 0
        assert b.evaluate("location.search", page) == "", "the token stays in the address bar"
        assert b.evaluate("document.getElementById('status').textContent", page) == "live"
        assert b.evaluate("document.getElementById('exec-id').textContent", page) == ex.id

        # steals: 24 children land on one worker's deque, the other steals some
        ex.submit(tasks.slow_tree, 1, 24, 0.01).result(T)
        b.wait_for("Math.max(0, ...window.stealerDashboard.hist.steals) > 0", page)
        b.wait_for("window.stealerDashboard.last.tot.steals > 0", page)
        # ... and the steal matrix holds them, off its diagonal (a worker never steals from
        # itself), in a panel that is drawn
        b.wait_for("(() => { const m = window.stealerDashboard.last.sm; "
                   "return m[0][1] + m[1][0] > 0; })()", page)
        assert b.evaluate("window.stealerDashboard.last.sm.map((r, i) => r[i])", page) == [0, 0]
        assert b.evaluate("document.getElementById('p-matrix').hidden", page) is False

        # a map that asked for progress: its bar and counts, 3 of 20 results read
        it = ex.map(tasks.sleep_then, [0.001] * 20, range(20), progress=True)
        assert [next(it) for _ in range(3)] == [0, 1, 2]
        b.wait_for("(document.querySelector('#maps .map p') || {}).textContent"
                   "?.startsWith('map(sleep_then) 3 / 20 (15.0%)')", page)
        # no journal here: the journal panel says so
        assert b.evaluate("document.querySelector('#journal dd').textContent", page) == "off"

        # an agent with a full mailbox: its row shows the depth
        ref = ex.spawn_agent(L.Counter, 0, 0.2, mailbox=8)
        with contextlib.suppress(MailboxFull):
            for _ in range(8):
                ref.send("add", 1, block=False)
        try:
            uid = f"{ref.id:#018x}"
            cell = (f"(() => {{ const r = document.querySelector('tr[data-agent=\"{uid}\"]'); "
                    "return r ? Number(r.children[3].textContent) : 0; })()")
            b.wait_for(f"{cell} >= 4", page)
            assert 4 <= b.evaluate(cell, page) <= 8
            shown = b.evaluate("document.getElementById('p-agents').hidden", page)
            assert shown is False
            b.wait_for("document.querySelector('#latency [data-tier=interactive] canvas') "
                       "!== null", page)
            rows = b.evaluate("document.querySelectorAll('#t-workers tbody tr').length", page)
            assert rows == 2
            time.sleep(0.5)  # a few more updates drawn, then the picture
            shot = b.screenshot(page, artifacts(tmp_path) / "dashboard.png")
        finally:
            ref.stop()
            with contextlib.suppress(Exception):
                ref.result(T)
        assert list(it) == list(range(3, 20))
        data = shot.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
        errors = b.errors(page)
        assert not errors, "the page logged errors:\n" + "\n".join(errors)


def test_a_page_without_the_token_stays_empty(ex, tmp_path):
    with serve_dashboard(ex) as d, Chromium(tmp_path / "profile", CHROMIUM) as b:
        page = b.new_page(800, 600)
        b.call("Page.navigate", {"url": d.base_url}, page)
        b.wait_for("document.readyState === 'complete'", page)
        text = b.evaluate("document.body.innerText", page)
        assert "needs its token" in text
        assert b.evaluate("typeof window.stealerDashboard", page) == "undefined"
