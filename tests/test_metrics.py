"""Latency histograms and executor.stats()."""

from __future__ import annotations

import mmap
import os
import struct
import time

import numpy as np
import pytest
import tasks

import stealer
from stealer import _cqueues
from stealer.shared import metrics
from stealer.shared import pyqueues as _pyqueues
from stealer.shared.metrics import NBUCKETS, Histogram, bucket_bounds, bucket_of


def test_buckets_partition_the_range():
    prev_hi = 0
    for i in range(NBUCKETS):
        lo, hi = bucket_bounds(i)
        assert lo == prev_hi and hi > lo
        assert bucket_of(lo) == i and bucket_of(hi - 1) == i
        if lo >= 128:
            assert (hi - lo) / lo <= 1 / 64 + 1e-12  # every bucket at most 1.6% wide
        prev_hi = hi
    assert bucket_of(2**45) == NBUCKETS - 1


@pytest.mark.parametrize("impl", [_cqueues, _pyqueues], ids=["native", "python"])
def test_native_and_python_recorders_agree_with_the_reference(impl):
    rng = np.random.default_rng(1)
    values = np.concatenate([rng.integers(0, 200, 300), rng.lognormal(13, 2, 3000).astype(np.int64)])
    mm = mmap.mmap(-1, 64 + 8 * NBUCKETS)
    region = impl.Region(mm)
    for v in values:
        region.hist_record(0, int(v))
    got = Histogram.read(mm, 0)
    ref = Histogram.from_values(values)
    assert np.array_equal(got.counts, ref.counts)
    assert (got.total, got.sum_ns, got.max_ns) == (ref.total, ref.sum_ns, ref.max_ns)


@pytest.mark.parametrize("dist", ["lognormal", "exponential", "uniform", "bimodal"])
def test_percentiles_within_one_percent_of_numpy(dist):
    rng = np.random.default_rng(7)
    n = 50_000
    if dist == "lognormal":
        v = rng.lognormal(14, 1.5, n)
    elif dist == "exponential":
        v = rng.exponential(2e6, n) + 1000
    elif dist == "uniform":
        v = rng.uniform(1e4, 1e8, n)
    else:
        v = np.concatenate([rng.normal(5e5, 1e4, n // 2), rng.normal(5e7, 1e6, n // 2)])
    v = np.maximum(v, 1).astype(np.int64)
    h = Histogram.from_values(v)
    for q in (50, 90, 99, 99.9):
        exact = float(np.percentile(v, q, method="inverted_cdf"))
        got = h.percentile(q)
        assert abs(got - exact) / exact <= 0.01, (q, got, exact)
    assert h.percentile(100) == float(v.max())
    assert h.mean() == pytest.approx(float(v.mean()), rel=1e-9)


def test_empty_histogram_and_merge():
    h = Histogram()
    assert np.isnan(h.percentile(50))
    a = Histogram.from_values([1000, 2000])
    b = Histogram.from_values([3_000_000])
    m = a.merge(b)
    assert m.count == 3 and m.max_ns == 3_000_000
    assert (m - a).count == 1


def test_stats_counts_tasks_and_latency():
    t_start = time.monotonic()
    with stealer.Executor(2) as ex:
        # every worker started: under load one may still be importing while the other
        # runs all the tasks below, and its CPU is published only once it starts
        assert ex.wait_ready(60)
        assert [f.result(timeout=30) for f in [ex.submit(tasks.busy, 0.002) for _ in range(100)]]
        assert ex.submit(tasks.fib, 18, 12).result(timeout=30) == tasks.fib_seq(18)
        deadline = time.monotonic() + 10
        while True:  # counters are flushed every 64 steps and when a worker parks
            s = ex.stats()
            if s.totals()["tasks"] >= 100 + 1 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        totals = s.totals()
        assert totals["tasks"] >= 101
        assert totals["spawns"] > 0 and totals["resumes"] > 0
        assert totals["busy_ns"] >= 100 * 2_000_000 * 0.9
        run = s.latency["interactive"]["run"]
        assert run.count >= 100
        assert 1.8e6 <= run.percentile(50) <= 50e6  # the 2 ms busy tasks dominate
        assert s.latency["interactive"]["wait"].count >= 100
        assert {w.cpu for w in s.workers} == set(ex.cpus)
        assert all(w.state == "ready" for w in s.workers)
        d = s.as_dict()
        assert d["id"] == ex.id and d["client"]["pending"] == 0
        assert d["latency"]["interactive"]["run"]["p99_ms"] >= 1.8
        # idle now: each worker's yields before it parks are counted (CPU time, at most
        # the wall time each worker has been up)
        while ex.stats().totals()["spin_ns"] == 0:
            assert time.monotonic() < deadline, "no idle spin was ever counted"
            time.sleep(0.05)
        assert ex.stats().totals()["spin_ns"] <= 2 * (time.monotonic() - t_start) * 1e9


def test_stats_from_another_process_by_id():
    from stealer.client.stats import collect
    from stealer.shared.shm import Segment

    with stealer.Executor(1) as ex:
        ex.submit(tasks.square, 3).result(timeout=30)
        seg = Segment.attach_any(ex.id)
        s = collect(seg)
        assert s.id == ex.id and len(s.workers) == 1
        with pytest.raises(ValueError):
            Segment.attach_any("not-a-segment")


def test_metrics_off_records_nothing():
    with stealer.Executor(1, metrics=False) as ex:
        [f.result(timeout=30) for f in [ex.submit(tasks.square, i) for i in range(50)]]
        time.sleep(0.2)
        s = ex.stats()
        assert s.totals()["tasks"] == 0 and not s.latency


def test_counters_module_constants():
    assert len(metrics.COUNTERS) <= metrics.NCOUNTERS
    assert metrics.TIER_NAMES[metrics.DEFAULT_TIER] == "interactive"


def test_stats_of_a_busy_worker_are_not_64_steps_behind():
    """Counters were published every 64 steps or before parking: a worker busy with a long
    task after 20 short ones showed none of them.  Now also every ~2 ms while busy."""
    import tempfile

    gate = os.path.join(tempfile.mkdtemp(), "gate")
    with stealer.Executor(1, cpus=None) as ex:
        ex.wait_ready(30)
        base = ex.stats().totals()["tasks"]
        fs = [ex.submit(tasks.sleep_then, 0.003) for _ in range(20)]
        long = ex.submit(tasks.wait_for_path, gate)  # busy until the gate opens
        for f in fs:
            f.result(30)
        time.sleep(0.05)
        assert not long.done()
        assert ex.stats().totals()["tasks"] - base >= 20
        open(gate, "w").close()
        long.result(30)


def test_the_steal_row_sits_after_the_histograms():
    """The victim -> thief row (metrics.STEALS_FROM_OFF) overlaps no histogram, fits the block,
    and reads back what a worker's flush packs there: min(workers, VICTIMS) cells."""
    last = metrics.hist_offset(metrics.TIERS - 1, len(metrics.KINDS) - 1) + metrics.HIST_BYTES
    assert last == metrics.STEALS_FROM_OFF
    assert last + 8 * metrics.VICTIMS == metrics.BLOCK_BYTES
    buf = bytearray(metrics.BLOCK_BYTES + 64)
    row = list(range(1, metrics.VICTIMS + 1))
    struct.pack_into(f"={metrics.VICTIMS}Q", buf, 64 + metrics.STEALS_FROM_OFF, *row)
    assert metrics.read_steals_from(buf, 64, 3) == [1, 2, 3]
    assert metrics.read_steals_from(buf, 64, 10_000) == row
    assert [metrics.victim_cell(k) for k in (0, 62, 63, 64, 8191)] == [0, 62, 63, 63, 63]
