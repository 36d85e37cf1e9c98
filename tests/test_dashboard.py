"""stealer.dashboard over HTTP: the locks (Host, token, Origin, methods, CSP), the prefix,
the event stream on a real executor, one sampler for every page, and a payload whose size
does not grow with the tasks done.  The page in a real browser: test_dashboard_browser.py."""

from __future__ import annotations

import configparser
import contextlib
import fnmatch
import http.client
import json
import threading
import time
from pathlib import Path
from typing import Any

import agents_lib as L
import pytest
import tasks

import stealer
from stealer.client.stats import AgentStats, Stats, WorkerStats
from stealer.dashboard import cli as dash_cli
from stealer.dashboard import payload, serve_dashboard
from stealer.errors import MailboxFull
from stealer.shared import metrics

ROOT = Path(__file__).resolve().parents[1]
T = 30


@pytest.fixture(scope="module")
def ex():
    with stealer.Executor(2) as ex:
        assert ex.wait_ready(60)
        yield ex


@pytest.fixture(scope="module")
def dash(ex):
    with serve_dashboard(ex) as d:
        yield d


def request(d: Any, path: str, method: str = "GET", headers: dict[str, str] | None = None,
            auth: bool = True, body: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body); ``auth`` sends the token as a Bearer header."""
    c = http.client.HTTPConnection("127.0.0.1", d.port, timeout=T)
    h = {"Host": f"127.0.0.1:{d.port}", **(headers or {})}
    if auth:
        h.setdefault("Authorization", f"Bearer {d.token}")
    c.request(method, path, body=body, headers=h)
    r = c.getresponse()
    data = r.read() if method != "HEAD" else b""
    out = r.status, {k.lower(): v for k, v in r.getheaders()}, data
    c.close()
    return out


class Stream:
    """An open event stream: ``next()`` is the next update (a dict)."""

    def __init__(self, d: Any, path: str = "/events", headers: dict[str, str] | None = None):
        self.c = http.client.HTTPConnection("127.0.0.1", d.port, timeout=T)
        self.c.request("GET", path, headers={"Host": f"127.0.0.1:{d.port}",
                                             "Authorization": f"Bearer {d.token}",
                                             **(headers or {})})
        self.r = self.c.getresponse()
        self.status = self.r.status

    def next(self) -> dict[str, Any]:
        while True:
            line = self.r.fp.readline()
            if not line:
                raise EOFError("the stream ended")
            if line.startswith(b"data: "):
                return json.loads(line[6:])

    def until(self, pred: Any, timeout: float = T) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            u = self.next()
            if pred(u):
                return u
            assert time.monotonic() < deadline, f"no update matched in {timeout} s; last: {u}"

    def close(self) -> None:
        self.c.close()


@contextlib.contextmanager
def stream(d: Any, **kw: Any):
    s = Stream(d, **kw)
    try:
        yield s
    finally:
        s.close()


# -- the locks -------------------------------------------------------------------------------


def test_wrong_host_is_refused(dash):
    for host in ("evil.example", f"evil.example:{dash.port}", "127.0.0.1.nip.io"):
        status, _, body = request(dash, "/", headers={"Host": host})
        assert status == 403, host
        assert b"not allowed" in body
    for host in (f"localhost:{dash.port}", f"127.0.0.1:{dash.port}", "localhost"):
        assert request(dash, "/", headers={"Host": host})[0] == 200, host


def test_missing_or_wrong_token_is_401(dash):
    for path in ("/", "/app.js", "/events", "/api/snapshot", "/api/meta"):
        status, headers, body = request(dash, path, auth=False)
        assert status == 401, path
        assert b"?token=" in body and "default-src 'self'" in headers["content-security-policy"]
    assert request(dash, "/", auth=False, headers={"Authorization": "Bearer nope"})[0] == 401
    assert request(dash, "/?token=" + "x" * 43, auth=False)[0] == 401
    assert request(dash, "/", auth=False, headers={"Cookie": f"{dash._cfg.cookie}=wrong"})[0] == 401


def test_token_in_url_then_cookie(dash):
    status, headers, body = request(dash, f"/?token={dash.token}", auth=False)
    assert status == 200 and b"<canvas" in body
    cookie = headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/" in cookie
    pair = cookie.split(";")[0]
    assert pair == f"{dash._cfg.cookie}={dash.token}"
    status, headers, body = request(dash, "/app.js", auth=False, headers={"Cookie": pair})
    assert status == 200 and headers["content-type"].startswith("text/javascript")
    assert "set-cookie" not in headers  # only a request carrying ?token= sets it
    status, headers, _ = request(dash, "/?token=" + "y" * 43, auth=False, headers={"Cookie": pair})
    assert status == 200 and "set-cookie" not in headers  # a stale URL, a good cookie
    assert dash.url.startswith(f"http://127.0.0.1:{dash.port}/?token=")


def test_foreign_origin_is_refused_on_the_event_stream(dash):
    for origin in ("http://evil.example", f"http://evil.example:{dash.port}", "null"):
        with stream(dash, headers={"Origin": origin}) as s:
            assert s.status == 403, origin
    with stream(dash, headers={"Origin": f"http://127.0.0.1:{dash.port}"}) as s:
        assert s.status == 200
        assert s.r.getheader("Content-Type").startswith("text/event-stream")
        assert s.next()["v"] == 1


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "BREW"])
def test_no_write_method_is_accepted(dash, method):
    for path in ("/", "/events", "/api/snapshot"):
        status, headers, body = request(dash, path, method, body=b'{"submit": "rm -rf /"}')
        assert status == 405, (method, path)
        assert headers["allow"] == "GET, HEAD" and b"read-only" in body


def test_security_headers_and_head(dash):
    status, headers, body = request(dash, "/")
    assert status == 200
    assert headers["content-security-policy"].startswith("default-src 'self'")
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["referrer-policy"] == "no-referrer"
    assert headers["x-frame-options"] == "DENY"
    page = body.decode()
    assert "<script>" not in page and "style=" not in page and "http" not in page.split(
        "<body>")[1], "the page must load nothing inline or from elsewhere (CSP)"
    status, headers, body = request(dash, "/", "HEAD")
    assert status == 200 and body == b"" and int(headers["content-length"]) > 1000
    assert request(dash, "/../setup.cfg")[0] == 404
    assert request(dash, "/static/app.js")[0] == 404


def test_prefix(ex):
    with serve_dashboard(ex, prefix="/stealer/dash/") as d:
        assert d.url.startswith(f"http://127.0.0.1:{d.port}/stealer/dash/?token=")
        assert request(d, "/stealer/dash/")[0] == 200
        assert request(d, "/stealer/dash/app.js")[0] == 200
        assert json.loads(request(d, "/stealer/dash/api/meta")[2])["workers"] == 2
        status, headers, _ = request(d, "/stealer/dash?x=1")
        assert status == 301 and headers["location"] == "dash/?x=1"
        assert request(d, "/")[0] == 404 and request(d, "/app.js")[0] == 404
        _, headers, _ = request(d, f"/stealer/dash/?token={d.token}", auth=False)
        assert "Path=/stealer/dash/;" in headers["set-cookie"]
        with stream(d, path="/stealer/dash/events") as s:
            assert s.next()["id"] == ex.id


def test_bad_arguments_say_what_to_do(ex):
    with pytest.raises(ValueError, match="pass token="):
        serve_dashboard(ex, host="0.0.0.0")
    with pytest.raises(ValueError, match="16-256 characters"):
        serve_dashboard(ex, token="short")
    with pytest.raises(ValueError, match="must be a path"):
        serve_dashboard(ex, prefix="/a b")
    with pytest.raises(FileNotFoundError, match="stealer top"):
        serve_dashboard("stealer-1-" + "ab" * 16)
    with pytest.raises(ValueError, match="not a stealer segment name"):
        serve_dashboard("nonsense")
    with pytest.raises(TypeError):
        serve_dashboard(42)  # type: ignore[arg-type]


def test_non_loopback_bind_with_a_token(ex):
    token = "t" * 24
    with serve_dashboard(ex, host="0.0.0.0", token=token, allowed_hosts=["dash.example"]) as d:
        assert d.token == token
        assert request(d, "/", headers={"Host": "dash.example"})[0] == 200
        assert request(d, "/", headers={"Host": "evil.example"})[0] == 403
        assert request(d, "/", auth=False)[0] == 401


# -- what the stream says -------------------------------------------------------------------


def test_stream_reflects_a_real_workload(ex, dash):
    with stream(dash) as s:
        first = s.next()
        assert first["id"] == ex.id and len(first["w"]["pid"]) == 2
        assert first["w"]["pid"] == ex.worker_pids()
        assert first["client"]["pending"] == 0
        before = first["tot"]["tasks"]
        n = 600
        [f.result(T) for f in [ex.submit(tasks.square, i) for i in range(n)]]
        u = s.until(lambda u: u["tot"]["tasks"] >= before + n
                    and u["lat"].get("interactive", {}).get("run", {}).get("all", {}).get("n", 0)
                    >= before + n)
        run = u["lat"]["interactive"]["run"]
        assert run["n"] >= 1 and sum(run["c"]) == run["n"]  # the window's CDF holds its events
        assert 0 < run["p50"] <= run["p99"] <= run["p999"] <= run["max"]
        assert u["w"]["cpu"] == ex.cpus
        assert all(r is not None and r > 1 << 20 for r in u["w"]["rss"])  # MiBs, from psutil
        u = s.until(lambda u: u["rate"]["tasks"] is not None)
        assert u["rate"]["tasks"] >= 0 and u["smp"]["pages"] >= 1


def test_steals_show_when_one_workers_deque_is_loaded(ex, dash):
    with stream(dash) as s:
        u = s.next()
        steals, attempts = u["tot"]["steals"], u["tot"]["steal_attempts"]
        ex.submit(tasks.slow_tree, 1, 24, 0.01).result(T)  # 24 children on one worker's deque
        u = s.until(lambda u: u["tot"]["steals"] > steals)  # the other worker stole them
        assert u["tot"]["steal_attempts"] > attempts
        # the first update to count them: its rate window (about a second) holds the steals
        assert u["rate"]["steals"] > 0 and max(x or 0 for x in u["w"]["steals_s"]) > 0
        # the matrix: the thief's row names the other worker as its victim, nobody itself
        u = s.until(lambda u: sum(map(sum, u["sm"])) >= u["tot"]["steals"] > steals)
        m = u["sm"]
        assert len(m) == 2 and all(len(r) == 2 for r in m)
        assert m[0][0] == m[1][1] == 0, m
        assert m[0][1] + m[1][0] >= 1
    st = ex.stats()  # the same rows through Executor.stats(), never fewer than it showed
    sm = st.steal_matrix()
    assert len(sm) == 2 and sm[0][1] >= m[0][1] and sm[1][0] >= m[1][0]


def test_a_full_mailbox_shows_its_depth(ex, dash):
    ref = ex.spawn_agent(L.Counter, 0, 0.2, mailbox=8)
    sent = 0
    with contextlib.suppress(MailboxFull):
        for _ in range(8):
            ref.send("add", 1, block=False)
            sent += 1
    try:
        with stream(dash) as s:
            uid = f"{ref.id:#018x}"
            u = s.until(lambda u: any(r["id"] == uid and r["mailbox"] >= 4
                                      for r in u["ag"]["rows"]))
            row = next(r for r in u["ag"]["rows"] if r["id"] == uid)
            assert u["ag"]["live"] >= 1 and sent >= 5 and row["worker"] in (0, 1)
            assert row["oldest_ms"] is not None and row["oldest_ms"] > 0
        t_sent = time.monotonic()
        fullest = ex.stats().fullest_agents  # by mailbox depth, whatever its CPU time
        assert fullest and fullest[0].id == ref.id and fullest[0].mailbox >= 1
        # the oldest waiting message: sent before t_sent, so older than the time since
        age = fullest[0].oldest_ms
        assert age is not None and age >= (time.monotonic() - t_sent) * 1e3
        assert age < 60_000
    finally:
        ref.stop()
        with contextlib.suppress(Exception):
            ref.result(T)


def test_agents_that_move_show_their_migrations(ex, dash):
    """Agents started on one worker while the other runs a task: the idle one takes some,
    and the adopter counts each move in the agent's directory entry (D_OWNER), which the
    agents table lists per agent; the workers' counter draws the migrations timeline."""
    with stream(dash) as s:
        total0 = s.next()["tot"]["migrations"]
        moved: dict[str, Any] = {}
        for _attempt in range(3):  # thieves appear when one worker runs out first
            hog = L.hog_one_worker(ex)
            refs = [ex.spawn_agent(L.Stepper, 300, 0.002, 10) for _ in range(8)]
            hog.result(T)
            deadline = time.monotonic() + 5  # they run about 2.4 s of steps in all
            while not moved and time.monotonic() < deadline:
                u = s.next()
                moved = {r["id"]: r for r in u["ag"]["rows"] if r["migr"] >= 1}
            st = ex.stats()
            per_agent = sum(a.migrations for a in st.busiest_agents)
            assert per_agent <= st.totals()["migrations"] - total0  # take-backs: not moves
            [r.result(T) for r in refs]
            if moved:
                break
        assert moved, "no agent moved in three tries"
        row = next(iter(moved.values()))
        assert row["worker"] in (0, 1) and row["migr"] <= 300
        u = s.until(lambda u: u["tot"]["migrations"] > total0 and u["rate"]["migrations"]
                    is not None)
        assert u["tot"]["migrations"] >= total0 + row["migr"]


def test_one_sampler_for_every_page_and_none_without(dash):
    sampler = dash.sampler
    time.sleep(3 * sampler.interval)  # earlier tests' streams are closed by now
    assert sampler.subscribers == 0
    n = sampler.samples
    time.sleep(4 * sampler.interval)
    assert sampler.samples == n, "the sampler must not run while no page is open"
    streams = [Stream(dash) for _ in range(4)]
    try:
        for s in streams:
            s.next()
        t0, n0 = time.monotonic(), sampler.samples
        seqs = [s.next()["t"] for s in streams]
        time.sleep(1.0)
        ticks = (time.monotonic() - t0) / sampler.interval
        assert sampler.samples - n0 <= ticks + 2, "each page must not sample on its own"
        u = streams[0].until(lambda u: u["smp"]["pages"] == 4)
        assert u["smp"]["cpu_ms_s"] >= 0 and len(set(seqs)) <= 2  # they all got the same ones
    finally:
        for s in streams:
            s.close()


def test_payload_size_stays_flat_as_tasks_complete(ex, dash):
    def settled(n_done: int) -> bytes:
        deadline = time.monotonic() + T
        while True:
            data = dash.sampler.latest()
            u = json.loads(data)
            if u["tot"]["tasks"] >= n_done or time.monotonic() > deadline:
                return data
            time.sleep(dash.sampler.interval)

    def run(n: int) -> None:
        for _ in range(n // 2000):
            [f.result(T) for f in [ex.submit(tasks.square, i) for i in range(2000)]]

    done = json.loads(dash.sampler.latest())["tot"]["tasks"]
    run(2000)
    small = settled(done + 2000)
    run(30_000)
    big = settled(done + 32_000)
    u = json.loads(big)
    assert u["tot"]["tasks"] >= done + 32_000
    for kinds in u["lat"].values():
        for k in kinds.values():
            assert len(k["g"]) <= metrics.NBUCKETS // payload.CDF_GROUP
    # 15x the tasks: a payload that listed tasks (or grew with them) would grow by ~30 KB+
    assert len(big) < len(small) + 1500, (len(small), len(big))
    assert len(big) < 20_000


def test_attached_by_id_and_the_executor_going_away():
    with stealer.Executor(1) as ex1:
        assert ex1.wait_ready(60)
        d = serve_dashboard(ex1.id, interval=0.1)
        try:
            meta = json.loads(request(d, "/api/meta")[2])
            assert meta["id"] == ex1.id and meta["client"] is False
            s = Stream(d)
            u = s.next()
            assert u["client"] is None and u["w"]["pid"] == ex1.worker_pids()
            ex1.shutdown()
            u = s.until(lambda u: "gone" in u)
            assert "exited" in u["gone"] or "gone" in u["gone"]
            with pytest.raises(EOFError):
                s.next()
            s.close()
        finally:
            d.close()
        assert d.closed
    with pytest.raises(RuntimeError, match="serve a running executor"):
        serve_dashboard(ex1)


def test_cli_serves_until_ctrl_c(ex, capsys, monkeypatch):
    seen: dict[str, Any] = {}

    def fake_sleep(_s: float) -> None:
        out = capsys.readouterr().out
        url = next(line.strip() for line in out.splitlines() if "?token=" in line)
        hostport, _, rest = url.removeprefix("http://").partition("/")
        c = http.client.HTTPConnection(hostport, timeout=T)
        c.request("GET", "/" + rest)
        r = c.getresponse()
        seen["status"], seen["cookie"] = r.status, r.getheader("Set-Cookie")
        c.close()
        raise KeyboardInterrupt

    monkeypatch.setattr(dash_cli, "_sleep", fake_sleep)
    assert dash_cli.main([ex.id, "--prefix", "/s"]) == 0
    assert seen["status"] == 200 and "Path=/s/" in seen["cookie"]
    assert dash_cli.main([ex.id, "--host", "0.0.0.0"]) == 2
    assert "pass token=" in capsys.readouterr().err
    assert dash_cli.main(["stealer-1-" + "ab" * 16]) == 1
    assert "stealer top" in capsys.readouterr().err


# -- payload and packaging, without a server ------------------------------------------------


def _worker(k: int, pid: int, **counters: int) -> WorkerStats:
    return WorkerStats(index=k, pid=pid, cpu=k, state="ready", running=False, deque_depth=k,
                       inbox_depth=0, counters={**dict.fromkeys(metrics.COUNTERS, 0), **counters})


def test_steal_matrix_is_bounded_and_lumps_the_rest():
    """70 workers: 64 x 64 cells, row and column 63 hold workers 63-69 (payload.steal_matrix)."""
    n, V = 70, metrics.VICTIMS
    workers = []
    for k in range(n):
        w = _worker(k, 1000 + k)
        w.steals_from = [0] * V
        w.steals_from[metrics.victim_cell((k + 1) % n)] = k + 1  # k stole k+1 times from k+1
        workers.append(w)
    cur = Stats(id="stealer-1-" + "ab" * 16, time=1.0, uptime_s=1.0, workers=workers,
                injector_depth=0, latency={})
    m = payload.steal_matrix(cur)
    assert len(m) == V and all(len(r) == V for r in m)
    assert m[0][1] == 1 and m[62][63] == 63
    assert m[63][63] == sum(range(64, 70))  # thieves 63..68 from victims 64..69, all lumped
    assert m[63][0] == 70  # worker 69 from worker 0
    assert sum(map(sum, m)) == sum(range(1, n + 1))
    assert metrics.victim_cell(5) == 5 and metrics.victim_cell(10_000) == V - 1
    two = Stats(id=cur.id, time=1.0, uptime_s=1.0, workers=[_worker(0, 1), _worker(1, 2)],
                injector_depth=0, latency={})
    assert payload.steal_matrix(two) == [[], []]  # rows without cells: nothing read yet


def test_payload_rates_windows_and_replaced_workers():
    h1 = metrics.Histogram.from_values([1000] * 10)
    h2 = metrics.Histogram.from_values([1000] * 10 + [5_000_000] * 5)
    agent = AgentStats(id=7, worker=0, generation=0, cpu_ms=10.0, steps=100, messages=0,
                       mailbox=3)
    agent2 = AgentStats(id=7, worker=0, generation=0, cpu_ms=510.0, steps=300, messages=0,
                        mailbox=3, migrations=2)

    def stats(t: float, workers: list[WorkerStats], h: metrics.Histogram,
              agents: list[AgentStats]) -> Stats:
        return Stats(id="stealer-1-" + "ab" * 16, time=t, uptime_s=t, workers=workers,
                     injector_depth=0, latency={"bulk": {"run": h}}, busiest_agents=agents,
                     fullest_agents=agents, agents_live=1)

    prev = stats(10.0, [_worker(0, 100, tasks=100, busy_ns=10**9), _worker(1, 101, tasks=50)],
                 h1, [agent])
    cur = stats(12.0, [_worker(0, 100, tasks=300, busy_ns=2 * 10**9), _worker(1, 999, tasks=8)],
                h2, [agent2])
    ag = payload.agents_block(cur, payload.agents_by_id(prev), 2.0)
    u = payload.build(cur, prev, prev.latency, 2.0, [(50.0, 1 << 20), (None, None)], ag)
    assert u["w"]["tasks_s"] == [100.0, 4.0]  # worker 1 was replaced: its counts start at 0
    assert u["w"]["busy"] == [0.5, 0.0] and u["w"]["proc_cpu"] == [50.0, None]
    assert u["rate"]["tasks"] == 104.0
    run = u["lat"]["bulk"]["run"]
    assert run["n"] == 5 and run["all"]["n"] == 15  # the window holds the new events only
    lo = metrics.bucket_bounds(run["g"][0] * payload.CDF_GROUP)[0]
    assert lo <= 5_000_000 < metrics.bucket_bounds(run["g"][0] * payload.CDF_GROUP + 7)[1]
    assert run["c"] == [5]
    assert u["ag"]["rows"] == [{"id": "0x0000000000000007", "worker": 0, "gen": 0, "mailbox": 3, "oldest_ms": None,
                                "steps": 300, "msgs": 0, "cpu_ms": 510.0, "migr": 2,
                                "steps_s": 100.0,
                                "cpu_pct": 25.0}]
    first = payload.build(cur, None, None, 12.0)
    assert first["rate"]["tasks"] is None and first["lat"]["bulk"]["run"]["n"] == 15
    assert first["ag"]["rows"][0]["steps_s"] is None  # no earlier scan: no rates
    json.dumps(u)  # plain JSON


def test_the_page_ships_as_package_data():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    patterns = [p.strip() for p in cfg["options.package_data"]["stealer.dashboard"].split()]
    static = ROOT / "stealer" / "dashboard" / "static"
    files = sorted(p.relative_to(static.parent).as_posix() for p in static.iterdir())
    assert files, "no static files"
    missing = [f for f in files if not any(fnmatch.fnmatch(f, p) for p in patterns)]
    assert not missing, f"setup.cfg's package_data does not ship {missing}"
    from stealer.dashboard.server import STATIC

    assert {name for name, _ in STATIC.values()} == {p.name for p in static.iterdir()}


def test_threads_end_on_close(ex):
    before = {t.name for t in threading.enumerate()}
    d = serve_dashboard(ex)
    with stream(d) as s:
        s.next()
        d.close()
        with pytest.raises((EOFError, OSError)):
            for _ in range(3):
                s.next()
    d.close()  # idempotent
    time.sleep(0.2)
    left = {t.name for t in threading.enumerate()} - before
    assert not {n for n in left if n.startswith("stealer-dashboard")}, left


def test_the_agents_scan_runs_once_a_second_not_every_tick():
    from stealer.dashboard import sampler as smp

    calls: list[bool] = []

    def snapshot(agents: bool = True) -> Stats:
        calls.append(agents)
        return Stats(id="stealer-1-" + "ab" * 16, time=time.time(), uptime_s=1.0,
                     workers=[_worker(0, 0)], injector_depth=0, latency={})

    s = smp.Sampler(snapshot, lambda: None, interval=0.05, procs=False)
    try:
        s.subscribe()
        t0 = time.monotonic()
        time.sleep(1.3)
        s.unsubscribe()
        elapsed = time.monotonic() - t0
    finally:
        s.close()
    scans = sum(calls)
    assert calls[0] is True and 1 <= scans <= 2 + elapsed / smp.AGENTS_EVERY_S
    assert len(calls) > scans, "every tick scanned the agents"


# -- the journal's lag -------------------------------------------------------------------------


class _Words:
    """A stand-in for a segment's region: the words a shard publishes (Shard.publish_to)."""

    def __init__(self) -> None:
        self.w: dict[int, int] = {}

    def store64(self, off: int, v: int) -> None:
        self.w[off] = v


def test_a_shard_publishes_how_far_its_fsyncs_trail(tmp_path, monkeypatch):
    """Under "batch" the sync thread's fsync covers what was committed: while one is held
    up, the events committed meanwhile trail it and the oldest one's time is published;
    once it ends they are covered.  Under "always" nothing ever trails."""
    from stealer.agents.journal import store
    from stealer.shared.shm import J_OLDEST, J_SYNCED, J_WRITTEN

    gate, entered = threading.Event(), threading.Event()
    real_fsync = store.os.fsync

    def slow_fsync(fd: int) -> None:
        entered.set()
        assert gate.wait(T)
        real_fsync(fd)

    monkeypatch.setattr(store.os, "fsync", slow_fsync)
    words = _Words()
    shard = store.Shard(str(tmp_path / "w0.db"), "batch", 1)
    try:
        shard.publish_to(words, 64)
        assert words.w == {64 + J_WRITTEN: 0, 64 + J_SYNCED: 0, 64 + J_OLDEST: 0}
        t0 = time.monotonic_ns()
        shard.end("a", 0, b"x", 0)
        assert entered.wait(T)  # the sync thread is inside its fsync now, covering event 1
        shard.end("b", 0, b"y", 0)
        shard.end("c", 0, b"z", 0)
        assert words.w[64 + J_WRITTEN] == 3 and words.w[64 + J_SYNCED] == 0
        assert t0 <= words.w[64 + J_OLDEST] <= time.monotonic_ns()  # event 1's time
        gate.set()
        deadline = time.monotonic() + T
        while words.w[64 + J_SYNCED] < 3 or words.w[64 + J_OLDEST]:
            assert time.monotonic() < deadline, words.w
            time.sleep(0.005)
    finally:
        gate.set()
        shard.close()
    always = store.Shard(str(tmp_path / "w1.db"), "always", 1)
    try:
        always.publish_to(words, 128)
        always.end("a", 0, b"x", 0)
        assert (words.w[128 + J_WRITTEN], words.w[128 + J_SYNCED], words.w[128 + J_OLDEST]) \
            == (1, 1, 0)
    finally:
        always.close()


def test_the_journal_panel_off_and_on(ex, dash, tmp_path):
    assert json.loads(dash.sampler.latest())["jr"] is None  # no journal: the page says "off"
    assert ex.stats().journal is None
    with stealer.Executor(2, journal=str(tmp_path / "j")) as jex:
        assert jex.wait_ready(60)
        with serve_dashboard(jex) as d:
            ref = jex.spawn_agent(L.Counter, name="c")
            for _ in range(20):
                ref.send("add", 1)
            assert ref.call("get").result(T) == 20
            deadline = time.monotonic() + T
            while True:
                jr = json.loads(d.sampler.latest())["jr"]
                if jr["events"] >= 21 and jr["unsynced"] == 0:  # a spawn, 20 sends, a call
                    break
                assert time.monotonic() < deadline, jr
                time.sleep(d.sampler.interval)
            assert jr["mode"] == "batch" and jr["lag_ms"] == 0.0
            assert [s["shard"] for s in jr["shards"]] == ["client", "w0", "w1"]
            assert jr["shards"][0]["events"] >= 21  # the client's shard holds the sends
            assert jex.stats().journal["mode"] == "batch"
            ref.stop()


# -- map progress -------------------------------------------------------------------------------


def test_running_maps_show_their_progress(ex, dash):
    """A map(progress=True) is listed (results handed out / inputs) while it runs, and
    leaves the list when read to the end or dropped unread; a map without progress is not."""
    import gc

    plain = ex.map(tasks.square, range(10))
    it = ex.map(tasks.sleep_then, [0.001] * 40, range(40), progress=True)
    try:
        assert [next(it) for _ in range(5)] == list(range(5))
        maps = ex.stats().maps
        assert len(maps) == 1, maps
        m = maps[0]
        assert m["label"] == "map(sleep_then)" and m["done"] == 5
        assert m["total"] == 40 and m["submitted"] == 40 and m["elapsed_s"] >= 0
        with stream(dash) as s:
            u = s.until(lambda u: u["maps"] and u["maps"][0]["done"] == 5)
            assert u["maps"][0]["total"] == 40 and u["maps_more"] == 0
        assert list(it) == list(range(5, 40))
        assert ex.stats().maps == []  # read to the end: gone
        dropped = ex.map(tasks.square, range(4), progress=True)
        assert len(ex.stats().maps) == 1
        del dropped  # never read: its tasks ran, and it leaves the list with its iterator
        gc.collect()
        assert ex.stats().maps == []
        with stream(dash) as s:
            s.until(lambda u: u["maps"] == [])
    finally:
        it.close()
        list(plain)
