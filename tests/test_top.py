"""stealer top: rendering frames from snapshots, listing executors, the command line."""

from __future__ import annotations

import os
import re
import sys
import threading
import time

import pytest
import tasks

import stealer
from stealer import top
from stealer.client.stats import Stats, WorkerStats
from stealer.shared import metrics
from stealer.shared.metrics import Histogram

FAKE_ID = "stealer-1-" + "ab" * 16
NUM = r"\d+(?:\.\d+)?"


def wait_for_tasks(ex: stealer.Executor, n: int, timeout: float = 10.0,
                   runs: int | None = None) -> Stats:
    """Counters are flushed every 64 steps and when a worker parks: poll until n tasks
    show up, and ``runs`` (default n) samples in the interactive run-time histogram (its
    count has its own base: compare it with an earlier count, not with the tasks')."""
    deadline = time.monotonic() + timeout
    runs = n if runs is None else runs
    while True:
        s = ex.stats()
        lat = s.latency.get("interactive", {})
        if (s.totals()["tasks"] >= n and lat and lat["run"].count >= runs) \
                or time.monotonic() > deadline:
            return s
        time.sleep(0.05)


@pytest.fixture(scope="module")
def ex():
    with stealer.Executor(2) as ex:
        assert ex.wait_ready(60)
        fs = [ex.submit(tasks.busy, 0.001) for _ in range(150)]
        fs += [ex.submit(tasks.square, i) for i in range(150)]
        assert ex.submit(tasks.fib, 16, 10).result(timeout=60) == tasks.fib_seq(16)
        [f.result(timeout=60) for f in fs]
        s = wait_for_tasks(ex, 301)
        assert s.totals()["tasks"] >= 301
        yield ex


def worker(index: int, pid: int | None, **counters: int) -> WorkerStats:
    return WorkerStats(index=index, pid=pid, cpu=index, state="ready", running=False,
                       deque_depth=0, inbox_depth=0,
                       counters={**dict.fromkeys(metrics.COUNTERS, 0), **counters})


def fake_stats(t: float, workers: list[WorkerStats], latency=None, client=None) -> Stats:
    return Stats(id=FAKE_ID, time=t, uptime_s=t - 1000.0, workers=workers, injector_depth=3,
                 latency=latency or {}, client=client or {})


def tier_row(frame: str, tier: str, kind: str) -> list[str]:
    """The cells of a latency row (the tier name is only on a tier's first row)."""
    lines = frame.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("latency in ms"))
    current = None
    for line in lines[start + 2:]:
        if not line.strip():
            break
        cells = line.split()
        if cells[0] in metrics.TIER_NAMES:
            current, cells = cells[0], cells[1:]
        if current == tier and cells[0] == kind:
            return cells[1:]
    raise AssertionError(f"no {tier}/{kind} row in\n{frame}")


# -- render ---------------------------------------------------------------------


def test_render_cumulative_frame(ex):
    s = ex.stats()
    frame = top.render(None, s)
    assert ex.id in frame and "since start" in frame and "cumulative" in frame
    assert "pending 0" in frame and "backlog 0" in frame  # client fields from Executor.stats()
    for w in s.workers:
        assert re.search(rf"^\s+{w.index}\s+{w.pid}\s+{w.cpu}\s+ready\s", frame, re.M), frame
    assert re.search(r"^\s+all\s", frame, re.M)
    for kind in ("wait", "run"):
        count, p50, p99, p999, mx = tier_row(frame, "interactive", kind)
        assert int(count.replace(",", "")) >= 301
        vals = [float(v) for v in (p50, p99, p999, mx)]
        assert all(v >= 0 for v in vals) and vals == sorted(vals)
    assert "busiest workers" in frame and re.search(rf"worker \d+\s+pid \d+\s+busy\s+{NUM}%", frame)
    assert all(len(line) <= 100 for line in frame.splitlines())


def test_render_interval_frame(ex):
    prev = ex.stats()
    [f.result(timeout=60) for f in [ex.submit(tasks.busy, 0.001) for _ in range(100)]]
    cur = wait_for_tasks(ex, prev.totals()["tasks"] + 100,
                         runs=prev.latency["interactive"]["run"].count + 100)
    frame = top.render(prev, cur)
    assert "last " in frame and "cumulative" not in frame
    run_now, run_then = cur.latency["interactive"]["run"], prev.latency["interactive"]["run"]
    count, p50, *_ = tier_row(frame, "interactive", "run")
    assert int(count.replace(",", "")) == run_now.count - run_then.count >= 100
    assert float(p50) >= 0.9  # only 1 ms busy tasks ran in the interval
    for w in cur.workers:
        assert str(w.pid) in frame
    # a snapshot of another executor, or a later one, is no "previous" frame
    other = Stats(**{**prev.__dict__, "id": FAKE_ID})
    assert "since start" in top.render(other, cur)
    assert "since start" in top.render(cur, prev)


def test_render_rates_and_busy_are_deltas_over_the_interval():
    prev = fake_stats(1010.0, [worker(0, 11, tasks=100, steals=4, parks=2, busy_ns=10**9),
                               worker(1, 12, tasks=50)])
    cur = fake_stats(1012.0, [worker(0, 11, tasks=300, steals=10, parks=6, busy_ns=2 * 10**9),
                              worker(1, 99, tasks=40, busy_ns=10**9)])  # 1 was replaced
    frame = top.render(prev, cur)
    rows = {line.split()[0]: line.split() for line in frame.splitlines()
            if re.match(r"^\s+(\d+|all)\s", line)}
    # index pid cpu state deque inbox steps/s steals/s parks/s busy%
    assert rows["0"][1:] == ["11", "0", "ready", "0", "0", "100", "3.0", "2.0", "50.0"]
    assert rows["1"][1:] == ["99", "1", "ready", "0", "0", "20.0", "0.0", "0.0", "50.0"]
    assert rows["all"][1:] == ["0", "0", "0", "120", "3.0", "2.0", "50.0"]
    assert "last 2.0 s" in frame and "client pid 1" in frame
    assert "known to the client only" in frame  # attached by id: no client fields
    assert "injector 3" in frame and "(no latency recorded" in frame
    busiest = frame.split("busiest workers")[1].splitlines()[1:]
    assert [line.split()[1] for line in busiest] == ["0", "1"]


def test_render_cuts_lines_at_width():
    s = fake_stats(1010.0, [worker(k, 100 + k, tasks=5) for k in range(4)],
                   client={"pending": 1, "backlog": 2})
    frame = top.render(None, s, width=40)
    assert max(len(line) for line in frame.splitlines()) <= 40
    assert "pending 1" in top.render(None, s, width=200)


def test_interval_histogram_estimates_the_interval_max():
    then = Histogram.from_values([1000] * 10)
    now = then.merge(Histogram.from_values([5000, 7000]))
    d = top._hist_delta(then, now)
    assert d.count == 2 and d.max_ns == 7000
    then = Histogram.from_values([10**8])  # the cumulative max happened before the interval
    now = then.merge(Histogram.from_values([2000, 2000, 2100]))
    d = top._hist_delta(then, now)
    assert d.count == 3 and abs(d.max_ns - 2100) / 2100 < 0.016
    assert abs(d.percentile(50) - 2000) / 2000 < 0.016
    assert top._hist_delta(now, then) is then  # not a later snapshot: cumulative
    assert top._hist_delta(now, now).count == 0


def test_format_helpers():
    assert top._fmt_uptime(3725) == "1:02:05" and top._fmt_uptime(90061) == "1d 01:01:01"
    assert top._fmt_rate(None) == "-" and top._fmt_rate(2.5e6) == "2.50M"
    assert top._fmt_rate(12345) == "12.3k" and top._fmt_rate(5) == "5.0"
    assert top._fmt_ms(float("nan")) == "-" and top._fmt_ms(1.5e6) == "1.500"


# -- finding executors ------------------------------------------------------------


def test_list_executors_finds_ours(ex):
    mine = [e for e in top.list_executors() if e["id"] == ex.id]
    assert len(mine) == 1
    assert mine[0]["client_pid"] == os.getpid() and mine[0]["workers"] == 2
    assert mine[0]["uptime_s"] >= 0
    assert top.executor_gone(ex.id) is None
    assert "has exited" in top.executor_gone(FAKE_ID)
    assert ex.id in top.format_list(mine)


def test_client_pid_parsing():
    assert top.client_pid(FAKE_ID) == 1
    assert top.client_pid(FAKE_ID + "-x3") is None  # overflow file
    assert top.client_pid("stealer-1-xyz") is None and top.client_pid("other") is None


# -- command line -----------------------------------------------------------------


def test_main_once_by_id(ex, capsys):
    assert top.main([ex.id, "--once"]) == 0
    out, err = capsys.readouterr()
    assert out.count("stealer top - ") == 1 and ex.id in out and not err
    assert top.CLEAR not in out  # not a terminal: no escape codes
    for pid in ex.worker_pids():
        assert str(pid) in out
    assert "interactive" in out


def test_main_attaches_to_the_only_executor(ex, capsys, monkeypatch):
    real = top.list_executors
    monkeypatch.setattr(top, "list_executors",
                        lambda: [e for e in real() if e["client_pid"] == os.getpid()])
    assert [e["id"] for e in top.list_executors()] == [ex.id]
    assert top.main(["--once"]) == 0
    assert ex.id in capsys.readouterr().out
    monkeypatch.undo()
    assert top.main([str(os.getpid()), "--once"]) == 0  # a client pid picks its executor
    assert ex.id in capsys.readouterr().out


def test_main_without_id_lists_several_or_none(capsys, monkeypatch):
    entries = [{"id": FAKE_ID, "client_pid": 1, "workers": 2, "uptime_s": 5.0},
               {"id": "stealer-2-" + "cd" * 16, "client_pid": 2, "workers": 4, "uptime_s": 90.0}]
    monkeypatch.setattr(top, "list_executors", lambda: entries)
    assert top.main(["--once"]) == 2
    err = capsys.readouterr().err
    assert FAKE_ID in err and entries[1]["id"] in err and "pass the id" in err
    monkeypatch.setattr(top, "list_executors", lambda: [])
    assert top.main(["--once"]) == 2
    assert "no running stealer executor" in capsys.readouterr().err


def test_main_bad_ids(capsys):
    assert top.main(["not-a-segment", "--once"]) == 2
    assert "not a stealer segment name" in capsys.readouterr().err
    assert top.main(["stealer-999999-" + "0" * 32, "--once"]) != 0
    assert "no executor with id" in capsys.readouterr().err
    assert top.main(["999999999", "--once"]) == 2
    assert "no running stealer executor with client pid" in capsys.readouterr().err
    assert top.main(["--interval", "0"]) == 2


def test_main_frames_count_and_ctrl_c(ex, capsys, monkeypatch):
    assert top.main([ex.id, "--count", "3", "--interval", "0.01"]) == 0
    out = capsys.readouterr().out
    frames = out.split("\n\nstealer top - ")
    assert len(frames) == 3 and "since start" in frames[0] and "last " in frames[2]

    def interrupt(_s: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(top, "_sleep", interrupt)
    assert top.main([ex.id]) == 0
    assert capsys.readouterr().out.count("stealer top - ") == 1


def test_main_clears_the_screen_on_a_terminal(ex, capsys, monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert top.main([ex.id, "--count", "2", "--interval", "0.01"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(top.CLEAR) and out.count(top.CLEAR) == 2


def test_main_prometheus_dump(ex, capsys):
    assert top.main([ex.id, "--once", "--prometheus"]) == 0
    out = capsys.readouterr().out
    assert "# TYPE stealer_worker_tasks_total counter" in out and f'id="{ex.id}"' in out


def test_main_ends_when_the_executor_goes_away(capsys):
    ex = stealer.Executor(1)
    try:
        ex.submit(tasks.square, 2).result(timeout=60)
        timer = threading.Timer(0.3, ex.shutdown)
        timer.start()
        assert top.main([ex.id, "--interval", "0.02", "--count", "100000"]) == 1
        timer.join()
    finally:
        ex.shutdown()
    out, err = capsys.readouterr()
    assert "stealer top - " in out and f"executor {ex.id} has exited" in err
    assert top.main([ex.id, "--once"]) == 1
    assert "no executor with id" in capsys.readouterr().err


# -- cluster executors (their published snapshot; no Ray needed here) ------------------


def cluster_snapshot(t: float, done: tuple[int, int], msgs: tuple[int, int] = (0, 0),
                     **over) -> dict:
    """What a cluster client publishes (ClusterExecutor._snapshot): its stats() as a dict."""
    import dataclasses

    from stealer.cluster.ledger import ClusterStats

    def node(alive: bool, n_done: int, n_msgs: int, **kw) -> dict:
        return {"alive": alive, "workers": 2, "queued": 3, "running": 2, "task_s": 0.002,
                "busy": 0.5, "agents": 4, "active": 1, "done": n_done, "msgs": n_msgs,
                "steals": None,
                "got": 7, "given": 0, "latency_ms": {"n": 10, "p50": 1.5, "p99": 12.0},
                "pid": None, **kw}

    st = ClusterStats({"a" * 32: node(True, done[0], msgs[0]),
                       "b" * 32: node(True, done[1], msgs[1], busy=1.0, active=4, got=0,
                                      given=7)},
                      submitted=500, done=480, outstanding=20, moved=7, agent_moves=2,
                      move_s=0.018)
    data = dataclasses.asdict(st)
    data.update(id="stealer-1-cluster-" + "0" * 16, pid=1, created=t - 10, time=t,
                uptime_s=10.0, kind="cluster")
    data.update(over)
    return data


def node_rows(frame: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split() for line in frame.splitlines()
            if re.match(r"^(a{12}|b{12}|all)\s", line)}


def test_render_cluster_rows_per_node():
    prev = cluster_snapshot(1000.0, (100, 40), (0, 1000))
    cur = cluster_snapshot(1002.0, (300, 50), (0, 3000))
    frame = top.render_cluster(prev, cur)
    assert frame.startswith("stealer top - stealer-1-cluster-") and "(cluster)" in frame
    assert "nodes 2 alive of 2" in frame and "workers 4" in frame and "last 2.0 s" in frame
    assert "500 submitted" in frame and "7 stolen between nodes" in frame
    assert "2 moved between live nodes (18 ms each)" in frame
    rows = node_rows(frame)
    # node wrk busy queued run done tasks/s msgs/s agents active got given p50 p99
    assert rows["a" * 12][1:] == ["2", "50", "3", "2", "300", "100", "0.0", "4", "1", "7",
                                  "0", "1.500", "12.0"]
    assert rows["b" * 12][1:] == ["2", "100", "3", "2", "50", "5.0", "1000", "4", "4", "0",
                                  "7", "1.500", "12.0"]
    assert rows["all"][1:] == ["4", "6", "4", "350", "105", "1000", "8", "5", "7", "7"]
    # without a previous frame (or one of another executor): averages since the start
    assert "since start" in top.render_cluster(None, cur)
    assert "since start" in top.render_cluster({**prev, "id": "other"}, cur)
    assert node_rows(top.render_cluster(None, cur))["a" * 12][6] == "30.0"  # 300 in 10 s
    assert max(len(x) for x in top.render_cluster(prev, cur, width=50).splitlines()) <= 50


def test_render_cluster_shows_lost_nodes():
    cur = cluster_snapshot(1002.0, (300, 50), losses=[
        {"node": "b" * 32, "why": "ActorDiedError", "tasks": 64, "replaced": 64,
         "at": 0.0, "replace_s": 0.012}])
    cur["nodes"]["b" * 32]["alive"] = False
    frame = top.render_cluster(None, cur)
    assert "nodes 1 alive of 2" in frame and "workers 2" in frame
    assert node_rows(frame)["b" * 12][2] == "lost"
    assert "ActorDiedError: 64 tasks, 64 placed again in 12 ms" in frame


def test_a_cluster_snapshot_is_listed_read_and_removed(capsys):
    from stealer.cluster import snapshot

    name = snapshot.new_id()
    frames = iter(range(10**6))

    def snap() -> dict:
        n = next(frames)
        return cluster_snapshot(1000.0 + n, (10 * n, n), id=name, pid=os.getpid(),
                                created=time.time() - 5)

    pub = snapshot.Publisher(name, snap, interval_s=0.01)
    try:
        path = snapshot.path_of(name)
        st = os.stat(path)
        assert st.st_mode & 0o777 == 0o600 and st.st_uid == os.getuid()
        (mine,) = [e for e in top.list_executors() if e["id"] == name]
        assert mine["client_pid"] == os.getpid() and mine["workers"] == 4
        assert mine["kind"] == "cluster" and 4 < mine["uptime_s"] < 60
        assert top.main([name, "--count", "2", "--interval", "0.05"]) == 0
        out = capsys.readouterr().out
        assert out.count(f"stealer top - {name} (cluster)") == 2
        assert "since start" in out and "last " in out and "a" * 12 in out
        assert top.main([name, "--once", "--prometheus"]) == 2
        assert "cluster" in capsys.readouterr().err
        # the dashboard attaches to local executors only: never picks a cluster's id
        import io

        assert top._resolve(None, io.StringIO(), "stealer dashboard")[0] != name
        assert top._resolve(str(os.getpid()), io.StringIO(), "stealer dashboard")[0] != name
    finally:
        pub.stop()
    assert not os.path.exists(snapshot.path_of(name))
    assert all(e["id"] != name for e in top.list_executors())
    capsys.readouterr()
    assert top.main([name, "--once"]) == 1
    assert "no executor with id" in capsys.readouterr().err


def test_a_dead_clients_snapshot_is_not_listed_and_is_cleaned_up():
    from stealer.cluster import snapshot

    dead = f"stealer-{2**22 + 12345}-cluster-{'1' * 16}"  # past pid_max: no such process
    snapshot.write(dead, cluster_snapshot(1000.0, (1, 1), id=dead))
    try:
        assert os.path.exists(snapshot.path_of(dead))
        assert all(e["id"] != dead for e in top.list_executors())
        assert snapshot.cleanup_dead() >= 1
        assert not os.path.exists(snapshot.path_of(dead))
    finally:
        snapshot.remove(dead)
