"""stealer.prometheus: exposition text from snapshots, and the opt-in HTTP endpoint."""

from __future__ import annotations

import math
import sys
import time
import urllib.error
import urllib.request

import prometheus_client
import pytest
import tasks
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

import stealer
from stealer import prometheus
from stealer.client.stats import Stats, WorkerStats
from stealer.shared import metrics


@pytest.fixture(scope="module")
def ex():
    with stealer.Executor(2) as ex:
        assert ex.wait_ready(60)
        fs = [ex.submit(tasks.busy, 0.001) for _ in range(100)]
        assert ex.submit(tasks.fib, 15, 10).result(timeout=60) == tasks.fib_seq(15)
        [f.result(timeout=60) for f in fs]
        deadline = time.monotonic() + 10
        while ex.stats().totals()["tasks"] < 101 and time.monotonic() < deadline:
            time.sleep(0.05)  # counters are flushed every 64 steps and when a worker parks
        yield ex


def parse(text: str) -> dict[str, list]:
    """Family name -> samples, by prometheus_client's own parser (validates the format)."""
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(samples: list, name: str, **labels: str) -> float:
    (v,) = [s.value for s in samples if s.name == name and s.labels == labels]
    return v


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        return r.read().decode()


def test_text_has_every_family_with_sane_values(ex):
    s = ex.stats()
    fams = parse(prometheus.text(s))
    for c in metrics.COUNTERS:
        samples = fams[f"stealer_worker_{c}"]
        assert {x.name for x in samples} == {f"stealer_worker_{c}_total"}
        assert sorted(x.labels["worker"] for x in samples) == ["0", "1"]
        assert all(x.value >= 0 for x in samples)
    tasks_total = sum(x.value for x in fams["stealer_worker_tasks"])
    assert tasks_total == s.totals()["tasks"] >= 101
    assert value(fams["stealer_workers"], "stealer_workers") == 2
    assert value(fams["stealer_up"], "stealer_up") == 1
    depth = fams["stealer_queue_depth"]
    assert value(depth, "stealer_queue_depth", queue="injector") >= 0
    for k in ("0", "1"):
        assert value(depth, "stealer_queue_depth", queue="deque", worker=k) >= 0
        assert value(depth, "stealer_queue_depth", queue="inbox", worker=k) >= 0
    assert value(fams["stealer_client_pending"], "stealer_client_pending") == 0
    assert value(fams["stealer_client_crashes"], "stealer_client_crashes_total") == 0
    info = fams["stealer_info"][0].labels
    assert info["id"] == ex.id and info["client_pid"] == ex.id.split("-")[1]

    lat = fams["stealer_latency_seconds"]
    for kind in metrics.KINDS:
        labels = {"tier": "interactive", "kind": kind}
        qs = [value(lat, "stealer_latency_seconds", **labels, quantile=str(q))
              for q in prometheus.QUANTILES]
        assert all(q > 0 for q in qs) and qs == sorted(qs)
        count = value(lat, "stealer_latency_seconds_count", **labels)
        assert count == s.latency["interactive"][kind].total >= 101
        assert value(lat, "stealer_latency_seconds_sum", **labels) > 0
    run_sum = value(lat, "stealer_latency_seconds_sum", tier="interactive", kind="run")
    assert 0.09 <= run_sum < 1000  # seconds (100 tasks busy for 1 ms each), not ns or ms
    # tiers without traffic are exported too (stable series), empty
    bulk = {"tier": "bulk", "kind": "run"}
    assert value(lat, "stealer_latency_seconds_count", **bulk) == 0
    assert math.isnan(value(lat, "stealer_latency_seconds", **bulk, quantile="0.99"))


def test_text_is_what_prometheus_client_writes(ex):
    s = ex.stats()
    registry = prometheus_client.CollectorRegistry()
    registry.register(prometheus.StealerCollector(lambda: s))
    assert prometheus_client.generate_latest(registry).decode() == prometheus.text(s)


def test_text_of_an_executor_or_an_id(ex):
    for source in (ex, ex.id):
        fams = parse(prometheus.text(source))
        assert fams["stealer_info"][0].labels["id"] == ex.id


def test_escaping_and_numbers_match_prometheus_client():
    fam = prometheus.Family("x_weird", "gauge", 'back\\slash and\nnewline "quoted"')
    fam.add(1.5, label='a "b" \\ c\nd')
    fam.add(float("inf"), label="inf")
    cnt = prometheus.Family("x_events", "counter", "events")
    cnt.add(12345678, "_total")

    class Fixed:
        def collect(self):
            from prometheus_client.metrics_core import Metric

            for f in (fam, cnt):
                m = Metric(f.name, f.help, f.type)
                for name, labels, v in f.samples:
                    m.add_sample(name, labels, v)
                yield m

    registry = prometheus_client.CollectorRegistry()
    registry.register(Fixed())
    assert prometheus.render_text([fam, cnt]) == prometheus_client.generate_latest(
        registry).decode()
    for v in (0, 1, -2.5, 1e-9, 123456.0, 1234567.0, 2.06e8, 1e22, float("nan"), float("-inf")):
        assert prometheus._go_float(v) == floatToGoString(v)


def test_families_without_latency_or_client():
    s = Stats(id="stealer-7-" + "0" * 32, time=0.0, uptime_s=1.0, injector_depth=0,
              workers=[WorkerStats(0, None, None, "starting", False, 0, 0,
                                   dict.fromkeys(metrics.COUNTERS, 0))],
              latency={})
    fams = parse(prometheus.text(s))
    assert "stealer_client_pending" not in fams
    assert value(fams["stealer_latency_seconds"], "stealer_latency_seconds_count",
                 tier="control", kind="wait") == 0


def test_serve_an_executor(ex):
    server, port = prometheus.serve(ex, 0)
    try:
        assert port > 0 and server.port == port
        assert server.httpd.server_address[0] == "127.0.0.1"  # loopback unless asked
        assert server.url == f"http://127.0.0.1:{port}/metrics"
        deadline = time.monotonic() + 10
        while True:
            fams = parse(fetch(f"http://127.0.0.1:{port}/metrics"))
            total = sum(x.value for x in fams["stealer_worker_tasks"])
            if total > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert total > 0
        assert "stealer_worker_tasks_total" in {x.name for x in fams["stealer_worker_tasks"]}
        assert value(fams["stealer_up"], "stealer_up") == 1
        # every scrape is a fresh snapshot
        ex.submit(tasks.square, 3).result(timeout=60)
        uptime = value(fams["stealer_uptime_seconds"], "stealer_uptime_seconds")
        time.sleep(0.05)
        again = parse(fetch(server.url))
        assert value(again["stealer_uptime_seconds"], "stealer_uptime_seconds") > uptime
    finally:
        server.shutdown()
    server.shutdown()  # idempotent
    with pytest.raises(urllib.error.URLError):
        fetch(f"http://127.0.0.1:{port}/metrics")


def test_serve_by_id_reports_down_once_the_executor_is_gone():
    ex = stealer.Executor(1)
    try:
        ex.submit(tasks.square, 2).result(timeout=60)
        with prometheus.serve(ex.id)[0] as server:
            fams = parse(fetch(server.url))
            assert value(fams["stealer_up"], "stealer_up") == 1
            assert value(fams["stealer_workers"], "stealer_workers") == 1
            assert "stealer_client_pending" not in fams  # known to the client only
            ex.shutdown()
            fams = parse(fetch(server.url))
            assert list(fams) == ["stealer_up"]
            assert value(fams["stealer_up"], "stealer_up") == 0
    finally:
        ex.shutdown()


def test_serve_an_executor_after_shutdown_reports_down():
    ex = stealer.Executor(1)
    with ex, prometheus.serve(ex)[0] as server:
        ex.submit(tasks.square, 2).result(timeout=60)
        ex.shutdown()
        assert value(parse(fetch(server.url))["stealer_up"], "stealer_up") == 0


def test_serve_with_a_prometheus_client_older_than_0_17(ex, monkeypatch):
    monkeypatch.setattr(prometheus, "_version", lambda pc: (0, 16, 0))
    monkeypatch.setattr(prometheus_client, "start_http_server", None)  # must not be used
    server, port = prometheus.serve(ex)
    try:
        assert port > 0 and server.thread is not None
        fams = parse(fetch(server.url))
        assert sum(x.value for x in fams["stealer_worker_tasks"]) > 0
    finally:
        server.shutdown()
    assert not server.thread.is_alive()


def test_serve_rejects_bad_sources():
    with pytest.raises(TypeError, match="Executor or an executor id"):
        prometheus.serve(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        prometheus.serve("not-a-segment")
    with pytest.raises(FileNotFoundError):
        prometheus.serve("stealer-999999-" + "0" * 32)


def test_missing_prometheus_client_says_how_to_install(ex, monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ImportError, match="pip install prometheus-client"):
        prometheus.serve(ex)
    assert "stealer_worker_tasks_total" in prometheus.text(ex.stats())  # text() needs none


def test_serve_metrics_returns_the_server(ex):
    with prometheus.serve_metrics(ex) as server:
        assert isinstance(server, prometheus.MetricsServer) and server.port > 0
        assert server.url == f"http://127.0.0.1:{server.port}/metrics"
        fams = parse(fetch(server.url))
        assert value(fams["stealer_workers"], "stealer_workers") == 2
        assert fams["stealer_info"][0].labels["id"] == ex.id
    with pytest.raises(urllib.error.URLError):
        fetch(server.url)  # the context manager shut it down
