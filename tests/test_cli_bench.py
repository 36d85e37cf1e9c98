"""End-to-end tests of ``stealer bench`` and ``stealer tune`` on tiny sizes, and of their parts
(progress bar, plots, peer adapters, the user-workload ideal).

The commands run in-process through :func:`stealer.cli.main` with the hidden ``--tiny`` size
(a few hundred tasks), so each takes a few seconds.  No timing assertions: the numbers are
checked for presence and sanity only.  None of the optional peers (loky, mpire, dask, ray) is
needed; the mpire adapter is exercised against a stand-in pool.
"""

from __future__ import annotations

import concurrent.futures as cf
import io
import json
import threading
from pathlib import Path
from typing import Any

import pytest

from stealer import affinity
from stealer.bench import cli as bench_cli
from stealer.bench import harness, peers, wl_agents, wl_user
from stealer.bench import systems as bench_systems
from stealer.bench.progress import Progress, render_bar
from stealer.cli import main

matplotlib_image = pytest.importorskip("matplotlib.image")


def _check_png(path: Path) -> None:
    assert path.is_file(), path
    assert path.stat().st_size > 0
    img = matplotlib_image.imread(str(path))
    assert img.ndim == 3 and img.shape[0] > 0 and img.shape[1] > 0


# --------------------------------------------------------------------------- bench


def test_bench_tiny_writes_table_json_and_plots(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "out"
    rc = main(["bench", "--tiny", "--systems", "stealer,process", "--json",
               str(out / "bench.json")])
    text = capsys.readouterr().out
    assert rc == 0, text
    header = text.splitlines()[1].split()
    assert header[:5] == ["workload", "metric", "stealer", "process", "ideal"]
    for workload in bench_cli.DEFAULT_WORKLOADS:
        assert any(line.startswith(workload) for line in text.splitlines()), workload
    assert "samples" not in text
    assert "process: agent_overhead n/a" in text

    doc = json.loads((out / "bench.json").read_text())
    assert doc["meta"]["size"] == "tiny"
    assert doc["meta"]["errors"] == {}
    assert set(doc["meta"]["not_applicable"]["process"]) == {"agent_overhead"}
    results = doc["results"]
    assert set(results) == set(bench_cli.DEFAULT_WORKLOADS)  # agent_scale only when named
    assert "agent_scale" not in results
    for workload, res in results.items():
        expected = {"stealer"} if workload == "agent_overhead" else {"stealer", "process"}
        assert set(res["systems"]) == expected, workload
        assert "ideal" in res
    lat = results["latency"]
    for name in ("stealer", "process"):
        r = lat["systems"][name]
        assert 0 < r["p50_ms"] <= r["p99_ms"] <= r["max_ms"]
        samples = r["samples_ms"]
        assert 0 < len(samples) <= harness.MAX_SAMPLES
        assert samples == sorted(samples)
        assert "samples_ms" not in lat["runs"][name][0]  # per-run copies are stripped
    assert lat["ideal"]["p99_ms"] > 0 and lat["ideal"]["samples_ms"]
    assert results["skew"]["ideal"]["efficiency"] > 0.9
    assert results["forkjoin"]["systems"]["stealer"]["fib_speedup"] > 0
    _check_agent_results(results)

    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["efficiency.png", "latency_cdf.png", "latency_percentiles.png",
                    "overhead.png", "tiers_cdf.png", "tiers_percentiles.png"]
    for name in pngs:
        _check_png(out / name)


def _check_agent_results(results: dict[str, Any]) -> None:
    """The agent workloads of a tiny run: every agent did its steps, every call came back."""
    n, steps = wl_agents.AGENTS_SIZES["tiny"]
    agents = results["agents"]
    for name in ("stealer", "process"):
        r = agents["systems"][name]
        assert (r["agents"], r["steps"]) == (n, steps)
        assert r["work_s"] == pytest.approx(n * steps * wl_agents.AGENT_STEP_S)
        assert r["efficiency"] > 0 and r["makespan_s"] > 0
        assert 0 < r["step_p50_ms"] <= r["step_p99_ms"] <= r["step_max_ms"]
        assert 0 < r["step_p99_later_ms"] <= r["step_max_ms"]
    stealer_info = agents["systems"]["stealer"]["info"]
    assert stealer_info["mode"] == "native" and stealer_info["agent_steps"] == n * steps
    assert agents["systems"]["process"]["info"]["mode"] == "client-driven"
    assert agents["ideal"]["efficiency"] == pytest.approx(1.0)

    tiers = results["tiers"]
    for name in ("stealer", "process"):
        r = tiers["systems"][name]
        assert r["calls"] == wl_agents.TIERS_CALLS["tiny"] == len(r["samples_ms"])
        assert 0 < r["p50_ms"] <= r["p99_ms"] <= r["max_ms"]
        assert r["bulk_busy"] > 0 and r["info"]["bulk_steps"] > 0
    c = tiers["systems"]["stealer"]  # the control tier: stealer's agents only
    assert 0 < c["control_p50_ms"] <= c["control_p99_ms"] <= c["control_max_ms"]
    assert "control_p99_ms" not in tiers["systems"]["process"]
    assert tiers["ideal"]["max_ms"] <= tiers["ideal"]["bound_ms"]

    over = results["agent_overhead"]["systems"]["stealer"]
    n_noop, noop_steps = wl_agents.NOOP_AGENT_SIZES["tiny"]
    assert over["info"]["noop_counted_steps"] == n_noop * noop_steps
    assert over["round_trips"] == wl_agents.PINGPONG_ROUNDS["tiny"]
    assert over["step_us"] > 0 and over["round_trip_us"] > 0
    assert isinstance(over["same_worker"], bool)


def test_bench_agent_scale_only_when_named(tmp_path: Path, capsys: Any) -> None:
    rc = main(["bench", "--tiny", "--systems", "stealer,process", "--workloads", "agent_scale",
               "--no-plots", "--json", str(tmp_path / "s.json")])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert any(line.startswith("agent_scale") and "bytes/agent" in line
               for line in text.splitlines())
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["meta"]["errors"] == {}
    assert "agent_scale" in doc["meta"]["not_applicable"]["process"]
    res = doc["results"]["agent_scale"]
    assert set(res["systems"]) == {"stealer"}
    r = res["systems"]["stealer"]
    n, records = wl_agents.SCALE_SIZES["tiny"]
    assert (r["agents"], r["records"]) == (n, records)
    assert r["create_s"] > 0 and r["segment_bytes"] > 0
    assert r["overflow_files"] >= 0 and r["overflow_bytes"] >= 0
    parts = ("client_bytes_per_agent", "worker_bytes_per_agent", "segment_bytes_per_agent")
    assert r["bytes_per_agent"] == pytest.approx(sum(r[k] for k in parts))


def test_bench_user_workload(tmp_path: Path, capsys: Any) -> None:
    plots = tmp_path / "plots"
    rc = main(["bench", "--systems", "stealer,process", "--workload",
               "stealer.bench.workloads:busy", "--args", "[0.001]", "--tasks", "40",
               "--inflight", "4", "--json", str(tmp_path / "u.json"), "--plots", str(plots)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "stealer.bench.workloads:busy(0.001)" in text
    assert any(line.startswith("user") and "tasks/s" in line for line in text.splitlines())
    doc = json.loads((tmp_path / "u.json").read_text())
    assert list(doc["results"]) == ["user"]  # the built-in workloads are left out
    user = doc["results"]["user"]
    for name in ("stealer", "process"):
        r = user["systems"][name]
        assert r["tasks"] == 40 and r["inflight"] == 4
        assert r["tasks_per_s"] > 0 and 0 < r["p50_ms"] <= r["max_ms"]
        assert len(r["samples_ms"]) == 40
    assert user["ideal"]["tasks_per_s"] > 0
    assert doc["meta"]["user_workload"]["tasks"] == 40
    for name in ("user_percentiles.png", "user_cdf.png"):
        _check_png(plots / name)


@pytest.mark.parametrize(
    "extra",
    [
        ["--workload", "no_such_module_xyz:fn"],
        ["--workload", "stealer.bench.workloads:no_such_function"],
        ["--workload", "stealer.bench.workloads"],
        ["--workload", "stealer.bench.workloads:busy", "--args", "[0.001"],
        ["--workloads", "nope"],
    ],
)
def test_bench_usage_errors(extra: list[str], capsys: Any) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--tiny", *extra])
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_bench_help_documents_user_workload(capsys: Any) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "MODULE:FUNCTION" in out and "--args" in out and "--tasks" in out


class _FlakyExecutor(cf.ThreadPoolExecutor):
    """Works for the first few submits, then fails: a peer breaking mid-run."""

    def __init__(self, workers: int, good: int) -> None:
        super().__init__(max_workers=workers)
        self._good = good
        self._n = 0

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> cf.Future[Any]:
        self._n += 1
        if self._n > self._good:
            raise RuntimeError("peer broke")
        return super().submit(fn, *args, **kwargs)


def test_bench_failing_peer_is_reported_not_fatal(
    tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def load_flaky() -> bench_systems.System:
        return bench_systems.System("flaky", lambda w: _FlakyExecutor(w, good=20))

    monkeypatch.setitem(bench_systems._LOADERS, "flaky", load_flaky)
    monkeypatch.chdir(tmp_path)
    rc = main(["bench", "--tiny", "--systems", "process,flaky,absent_xyz",
               "--workloads", "overhead", "--no-plots"])
    captured = capsys.readouterr()
    assert rc == 0, captured.out
    assert "flaky: overhead skipped" in captured.out and "peer broke" in captured.out
    assert "absent_xyz: skipped" in captured.out
    doc = json.loads((tmp_path / "bench-out" / "bench.json").read_text())  # default path
    assert "peer broke" in doc["meta"]["errors"]["flaky"]["overhead"]
    assert "absent_xyz" in doc["meta"]["skipped"]
    assert set(doc["results"]["overhead"]["systems"]) == {"process"}
    assert not list((tmp_path / "bench-out").glob("*.png"))


# --------------------------------------------------------------------------- tune


def test_tune_prints_table_and_best(tmp_path: Path, capsys: Any) -> None:
    rc = main(["tune", "--tiny", "--policies", "compact,none", "--workers", "1",
               "--json", str(tmp_path / "t.json")])
    text = capsys.readouterr().out
    assert rc == 0, text
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("policy"))
    assert header.split()[:3] == ["policy", "workers", "cpus"] and "p99" in header
    assert any(line.startswith("compact") for line in lines)
    assert any(line.startswith("none") for line in lines)
    assert any(line.startswith("best p99:") for line in lines)
    assert any(line.startswith("best throughput:") for line in lines)
    doc = json.loads((tmp_path / "t.json").read_text())
    assert [(r["policy"], r["workers"], r["status"]) for r in doc["rows"]] == [
        ("compact", 1, "ok"), ("none", 1, "ok")]
    for r in doc["rows"]:
        assert r["p50_ms"] > 0 and r["p99_ms"] >= r["p50_ms"] and r["tasks_per_s"] > 0
    best = doc["best"]["p99"]
    assert best is not None and best["policy"] in ("compact", "none")
    assert doc["best"]["throughput"] is not None


def test_tune_user_workload(capsys: Any) -> None:
    rc = main(["tune", "--policies", "none", "--workers", "1", "--workload",
               "stealer.bench.workloads:busy", "--args", "[0.0005]", "--tasks", "30"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "busy(0.0005)" in text and "best p99:" in text


def test_tune_records_why_a_policy_is_skipped(capsys: Any) -> None:
    too_many = affinity.read_topology().usable_count + 1  # more than the physical cores
    rc = main(["tune", "--tiny", "--policies", "physical", "--workers", str(too_many)])
    text = capsys.readouterr().out
    assert rc == 1  # nothing could run
    row = next(line for line in text.splitlines() if line.startswith("physical"))
    assert "skipped" in row
    assert "physical core" in text  # the AffinityError's reason, as a footnote
    assert "no configuration ran" in text


# --------------------------------------------------------------------------- parts


def test_progress_bar_renders_to_stringio() -> None:
    buf = io.StringIO()
    with Progress(3, label="bench", stream=buf, enabled=True, min_interval=0.0) as bar:
        bar.set_detail("latency/stealer 50%")
        bar.update()
        bar.write("a line above the bar")
        bar.update(2)
    text = buf.getvalue()
    assert "\r" in text and "bench [" in text
    assert "3/3" in text and "latency/stealer 50%" in text
    assert "a line above the bar\n" in text
    assert text.endswith("\n")
    assert render_bar(1, 4, width=8) == "[##------] 1/4"


def test_progress_bar_silent_when_not_a_tty() -> None:
    buf = io.StringIO()  # isatty() is False
    with Progress(2, stream=buf) as bar:
        bar.update(2)
        assert bar.done == 2
    assert buf.getvalue() == ""
    bar = Progress(1, stream=buf)
    bar.write("still printed")
    assert buf.getvalue() == "still printed\n"


def test_downsample_and_closed_loop_ideal() -> None:
    xs = harness.downsample([float(x) for x in range(10_000, 0, -1)], k=2_000)
    assert len(xs) == 2_000 and xs[0] == 1.0 and xs[-1] == 10_000.0 and xs == sorted(xs)
    assert harness.downsample([3.0, 1.0, 2.0]) == [1.0, 2.0, 3.0]
    lat, makespan = wl_user.closed_loop_ideal(4, 0, 1.0, 2)  # all at once on 2 workers
    assert lat == [1.0, 1.0, 2.0, 2.0] and makespan == 2.0
    lat, makespan = wl_user.closed_loop_ideal(4, 1, 1.0, 2)  # one at a time
    assert lat == [1.0] * 4 and makespan == 4.0


def test_plots_from_synthetic_results(tmp_path: Path) -> None:
    from stealer.bench import plots

    samples = [0.5 + i / 100 for i in range(200)]
    lat = {"p50_ms": 1.0, "p90_ms": 2.0, "p99_ms": 3.0, "p99_9_ms": 4.0, "max_ms": 5.0,
           "samples_ms": samples}
    results = {
        "latency": {"systems": {"stealer": lat, "process": {**lat, "p99_ms": 30.0}},
                    "ideal": lat},
        "skew": {"systems": {"stealer": {"efficiency": 0.97}}, "ideal": {"efficiency": 1.0}},
        "forkjoin": {"systems": {"stealer": {"fib_speedup": 1.9, "uts_speedup": 1.8}},
                     "ideal": {"fib_speedup": 2.0, "uts_speedup": 2.0}},
        "overhead": {"systems": {"stealer": {"submit_us": 5.0, "map_us": 4.0,
                                             "map_chunked_us": 0.5}}, "ideal": {}},
    }
    written = plots.write_plots(results, ["stealer", "process", "loky"], str(tmp_path), 2)
    assert sorted(Path(p).name for p in written) == [
        "efficiency.png", "latency_cdf.png", "latency_percentiles.png", "overhead.png"]
    for p in written:
        _check_png(Path(p))
    assert plots.write_plots({}, ["stealer"], str(tmp_path / "empty")) == []


class _FakeWorkerPool:
    """Stand-in for ``mpire.WorkerPool``: runs each apply_async task on a thread and calls
    the callbacks from it, as mpire's result handler thread does."""

    def __init__(self, n_jobs: int) -> None:
        self.n_jobs = n_jobs
        self.stopped = False
        self._threads: list[threading.Thread] = []

    def apply_async(self, fn: Any, args: Any = (), kwargs: Any = None, callback: Any = None,
                    error_callback: Any = None) -> None:
        def run() -> None:
            try:
                value = fn(*args, **(kwargs or {}))
            except Exception as exc:
                error_callback(exc)
            else:
                callback(value)

        t = threading.Thread(target=run)
        self._threads.append(t)
        t.start()

    def stop_and_join(self) -> None:
        for t in self._threads:
            t.join()
        self.stopped = True

    def terminate(self) -> None:
        self.stop_and_join()


def _fail(x: int) -> int:
    raise ValueError(f"bad {x}")


def test_mpire_adapter_is_an_executor() -> None:
    ex = peers.MpireExecutor(2, pool_cls=_FakeWorkerPool)
    assert ex.submit(pow, 2, 10).result(timeout=10) == 1024
    assert list(ex.map(abs, [-1, -2, 3], timeout=10)) == [1, 2, 3]
    with pytest.raises(ValueError, match="bad 7"):
        ex.submit(_fail, 7).result(timeout=10)
    ex.shutdown(wait=True)
    assert ex._pool.stopped
    with pytest.raises(RuntimeError):
        ex.submit(abs, 1)


def test_peer_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    assert set(peers.PEERS) == {"loky", "mpire", "dask", "ray"}
    assert set(peers.installed()) <= set(peers.PEERS)
    with pytest.raises(peers.PeerUnavailable):
        peers.load("no-such-peer")
    monkeypatch.setitem(peers.PEERS, "ghost", lambda: peers._import("ghost_lib_xyz", "ghost"))
    with pytest.raises(peers.PeerUnavailable, match="ghost is not installed"):
        peers.load("ghost")
    monkeypatch.setitem(bench_systems._LOADERS, "ghost", bench_systems._peer_loader("ghost"))
    systems, skipped = bench_systems.load_systems(["process", "ghost"])
    assert [s.name for s in systems] == ["process"]
    assert "not installed" in skipped["ghost"]


def test_latency_reports_unfrozen_small_and_large_heaps_and_frozen_on_request(
        tmp_path: Path, capsys: Any) -> None:
    """Issue 10: the latency users get (the collector running, small and large client heap);
    the frozen variant only with --frozen-latency, beside them; the heap is never left
    frozen; the client's collections per 100k tasks are counted."""
    import gc

    out = tmp_path / "b.json"
    rc = main(["bench", "--tiny", "--systems", "stealer", "--workloads", "latency",
               "--no-plots", "--json", str(out), "--frozen-latency"])
    assert rc == 0
    table = capsys.readouterr().out
    r = json.loads(out.read_text())["results"]["latency"]["systems"]["stealer"]
    assert r["heaps"] == ["small", "large", "frozen"]
    for k in ("p99_ms", "large_p99_ms", "large_p99_9_ms", "frozen_p99_ms", "gc0_per_100k",
              "gc2_per_100k", "large_gc0_per_100k"):
        assert isinstance(r[k], (int, float)), k
    assert r["gc0_per_100k"] > 0  # the client collects while it runs: counted, not frozen
    assert "large heap: p99 ms" in table and "frozen heap: p99 ms" in table
    assert gc.get_freeze_count() == 0
    rc = main(["bench", "--tiny", "--systems", "stealer", "--workloads", "latency",
               "--no-plots", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())["results"]["latency"]["systems"]["stealer"]
    assert r["heaps"] == ["small", "large"] and "frozen_p99_ms" not in r
    assert "frozen heap" not in capsys.readouterr().out
