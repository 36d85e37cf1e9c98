"""One dashboard update: the aggregates of a snapshot, sized by workers and tiers, never by tasks.

Owns the JSON shape that the page (``static/app.js``) draws.  :func:`build` turns the
current :class:`~stealer.client.stats.Stats`, an earlier one (for rates) and the
latency histograms of about ``window_s`` ago (for a windowed CDF) into a plain dict of:

* ``w``: per-worker columns (pid, pinned CPU, state, deque and inbox depth, rates of
  steps, steals, steal attempts, parks, agent steps and migrations, busy fraction, and the
  process's CPU % and RSS when known);
* ``tot`` / ``rate``: counters summed over workers, cumulative and per second;
* ``lat``: per tier and kind ("wait": queued to started, "run"), the window's count,
  p50/p99/p99.9/max (exact to a bucket, 0.8%) and a sparse CDF of at most 280 points
  (8 per power of two), plus the same markers since the start;
* ``ag``: live agents and the union of the busiest (CPU) and fullest (mailbox) top-N
  (:func:`agents_block`, made when the sampler scans agents: once a second);
* ``sm``: the victim -> thief steal matrix (:func:`steal_matrix`): successful steals
  since the start, ``[thief][victim]``, at most ``metrics.VICTIMS`` rows and columns (the
  last row and column lump the workers past it);
* ``jr``: the agents' journal: None without one (the page says "off"), else its mode,
  events committed, those no fsync covers yet and the oldest one's age (ms), in all and
  per shard (client, w0...: one per worker), from :func:`stealer.client.stats.journal_stats`;
* ``maps``: running ``map(progress=True)`` calls, the oldest :data:`MAX_MAPS` (label,
  results handed out, total inputs or None, inputs read, seconds running), and
  ``maps_more``: how many more run (only in the executor's own process);
* ``client``: pending, backlog, crashes, replacements... (only when the dashboard runs in
  the executor's own process; an executor attached by id does not know them).

Called by :mod:`stealer.dashboard.sampler` once per tick; nothing here reads shared
memory or the clock.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from stealer.client.stats import AgentStats, Stats
from stealer.shared import metrics
from stealer.top import _hist_delta, _worker_delta

__all__ = ["build", "steal_matrix", "agents_block", "agents_by_id", "latency_block", "CDF_GROUP", "RATE_KEYS"]

MAX_MAPS = 16  # running maps listed in an update (the rest are counted)
CDF_GROUP = 8  # fine buckets per CDF point: 64 per power of two / 8 = 8 points (9% wide)
#: counters reported per second, per worker and summed
RATE_KEYS = ("tasks", "steals", "steal_attempts", "parks", "errors", "agent_steps",
             "agent_messages", "migrations", "throttled")
_W_RATES = {"tasks": "tasks_s", "steals": "steals_s", "steal_attempts": "attempts_s",
            "parks": "parks_s", "agent_steps": "agent_steps_s", "migrations": "migr_s"}

Hists = dict[str, dict[str, metrics.Histogram]]


def _r(x: float | None, nd: int = 1) -> float | None:
    """A float fit for JSON: rounded, None for nan/inf/None."""
    if x is None or not math.isfinite(x):
        return None
    return round(x, nd)


def _markers(h: metrics.Histogram) -> dict[str, Any]:
    n = h.count
    if not n:
        return {"n": 0}
    return {"n": n, "p50": int(h.percentile(50)), "p99": int(h.percentile(99)),
            "p999": int(h.percentile(99.9)), "max": int(h.max_ns)}


def latency_block(window: metrics.Histogram, cumulative: metrics.Histogram) -> dict[str, Any]:
    """Markers (ns) and a sparse CDF of ``window``; markers of ``cumulative`` under "all".

    The CDF is ``g`` (coarse bucket numbers: fine buckets ``g*8 .. g*8+7`` of
    :mod:`stealer.shared.metrics`) and ``c`` (their counts); the page computes each
    point's upper bound with the same formula as ``metrics.bucket_bounds``.
    """
    out = _markers(window)
    coarse = window.counts.reshape(-1, CDF_GROUP).sum(axis=1)
    g = np.flatnonzero(coarse)
    out["g"] = g.tolist()
    out["c"] = coarse[g].tolist()
    out["all"] = _markers(cumulative)
    return out


def _agent_row(a: AgentStats, prev: AgentStats | None, dt: float) -> dict[str, Any]:
    same = prev is not None and prev.generation == a.generation and dt > 0
    return {
        "id": f"{a.id:#018x}", "worker": a.worker, "gen": a.generation, "mailbox": a.mailbox,
        "oldest_ms": a.oldest_ms,
        "steps": a.steps, "msgs": a.messages, "cpu_ms": _r(a.cpu_ms), "migr": a.migrations,
        "steps_s": _r(max(0, a.steps - prev.steps) / dt) if same and prev else None,
        "cpu_pct": _r(max(0.0, a.cpu_ms - prev.cpu_ms) / 10 / dt) if same and prev else None,
    }


def agents_block(cur: Stats, prev: dict[int, AgentStats] | None = None,
                 dt: float = 0.0) -> dict[str, Any]:
    """``ag`` of an update: live agents, and one row per agent of ``cur``'s busiest and
    fullest lists; ``prev`` (the agents of the scan ``dt`` seconds before, by id) gives
    steps/s and CPU %."""
    prev = prev or {}
    rows = [_agent_row(a, prev.get(a.id), dt) for a in agents_by_id(cur).values()]
    return {"live": cur.agents_live, "rows": rows}


def steal_matrix(cur: Stats) -> list[list[int]]:
    """Successful steals ``[thief][victim]`` since the start, thieves lumped as the victims
    are (worker k's row into row ``metrics.victim_cell(k)``): at most VICTIMS x VICTIMS."""
    rows = min(len(cur.workers), metrics.VICTIMS)
    cols = max((len(w.steals_from) for w in cur.workers), default=0)
    m = [[0] * cols for _ in range(rows)]
    for w in cur.workers:
        row = m[metrics.victim_cell(w.index)]
        for j, v in enumerate(w.steals_from):
            row[j] += v
    return m


def build(cur: Stats, prev: Stats | None, base: Hists | None, window_s: float,
          procs: list[tuple[float | None, int | None]] | None = None,
          ag: dict[str, Any] | None = None) -> dict[str, Any]:
    """The update for snapshot ``cur``.

    ``prev``: an earlier snapshot of the same executor (rates cover ``cur.time -
    prev.time``; None: no rates yet).  ``base``: the latency histograms of ``window_s``
    seconds ago (None: the CDF is cumulative).  ``procs``: (CPU %, RSS bytes) per worker,
    None where unknown.  ``ag``: the agents' block (:func:`agents_block`; default: made
    from ``cur`` without rates).
    """
    if prev is not None and (prev.id != cur.id or cur.time <= prev.time):
        prev = None
    dt = cur.time - prev.time if prev is not None else 0.0
    prev_w = {w.index: w for w in prev.workers} if prev is not None else {}
    deltas = [_worker_delta(prev_w.get(w.index), w) if prev is not None else None
              for w in cur.workers]

    def per_s(d: dict[str, int] | None, key: str) -> float | None:
        return _r(d[key] / dt) if d is not None and dt > 0 else None

    w: dict[str, list[Any]] = {
        "pid": [x.pid for x in cur.workers],
        "cpu": [x.cpu for x in cur.workers],
        "state": [x.state for x in cur.workers],
        "run": [int(x.running) for x in cur.workers],
        "deque": [x.deque_depth for x in cur.workers],
        "inbox": [x.inbox_depth for x in cur.workers],
        "frozen_s": [_r(x.frozen_s) for x in cur.workers],
        "busy": [_r(min(1.0, d["busy_ns"] / 1e9 / dt), 3) if d is not None and dt > 0 else None
                 for d in deltas],
    }
    for key, col in _W_RATES.items():
        w[col] = [per_s(d, key) for d in deltas]
    if procs is not None:
        w["proc_cpu"] = [_r(p[0]) for p in procs]
        w["rss"] = [p[1] for p in procs]

    totals = cur.totals()
    rate = {k: per_s({k: sum(d[k] for d in deltas if d is not None)}, k) if prev is not None
            else None for k in RATE_KEYS}

    lat: dict[str, dict[str, Any]] = {}
    for tier, kinds in cur.latency.items():
        lat[tier] = {}
        for kind, h in kinds.items():
            p = base.get(tier, {}).get(kind) if base is not None else None
            lat[tier][kind] = latency_block(_hist_delta(p, h) if p is not None else h, h)

    return {
        "v": 1,
        "id": cur.id,
        "t": _r(cur.time, 3),
        "up_s": _r(cur.uptime_s),
        "dt": _r(dt, 3),
        "inj": cur.injector_depth,
        "w": w,
        "tot": totals,
        "rate": rate,
        "client": dict(cur.client) if cur.client else None,
        "lat": lat,
        "win_s": _r(window_s),
        "ag": ag if ag is not None else agents_block(cur),
        "rec": [cur.records_free, cur.records],
        "sm": steal_matrix(cur),
        "jr": cur.journal,
        "maps": cur.maps[:MAX_MAPS],
        "maps_more": max(0, len(cur.maps) - MAX_MAPS),
    }


def agents_by_id(cur: Stats) -> dict[int, AgentStats]:
    """The agents an update of ``cur`` lists (busiest first, then the other fullest), by id."""
    out: dict[int, AgentStats] = {}
    for a in [*cur.busiest_agents, *cur.fullest_agents]:
        out.setdefault(a.id, a)
    return out


def cluster_block(cur: dict[str, Any], prev: dict[str, Any] | None) -> dict[str, Any]:
    """An update for a cluster executor, from the snapshot its client publishes
    (stealer/cluster/snapshot.py: ``ClusterExecutor.stats()`` as a dict, with id, time,
    uptime_s) and the one before (rates); the rows ``stealer top`` draws, one per node."""
    dt = cur.get("time", 0.0) - prev.get("time", 0.0) if prev else 0.0
    before = (prev or {}).get("nodes", {})

    def rate(n: str, key: str) -> float | None:
        if dt <= 0 or n not in before:
            return None
        return _r(max(0, (cur["nodes"][n].get(key) or 0) - (before[n].get(key) or 0)) / dt)

    nodes = []
    for n, v in sorted(cur.get("nodes", {}).items()):
        lat = v.get("latency_ms") or {}
        kids = v.get("children") or {}
        nodes.append({
            "id": n, "alive": bool(v.get("alive")), "workers": v.get("workers"),
            "busy": _r(100 * (v.get("busy") or 0.0)), "queued": v.get("queued"),
            "running": v.get("running"), "done": v.get("done"), "tasks_s": rate(n, "done"),
            "msgs_s": rate(n, "msgs"), "agents": v.get("agents"), "active": v.get("active"),
            "got": v.get("got"), "given": v.get("given"),
            "children_out": kids.get("shipped"), "children_in": kids.get("imported"),
            "p50_ms": _r(lat.get("p50"), 2), "p99_ms": _r(lat.get("p99"), 2)})
    return {"v": 1, "cluster": {
        "id": cur.get("id"), "pid": cur.get("pid"), "uptime_s": _r(cur.get("uptime_s")),
        "submitted": cur.get("submitted"), "done": cur.get("done"),
        "outstanding": cur.get("outstanding"), "moved": cur.get("moved"),
        "resubmitted": cur.get("resubmitted"), "duplicates": cur.get("duplicates"),
        "agent_moves": cur.get("agent_moves"), "move_ms": _r(1e3 * (cur.get("move_s") or 0)),
        "replayed": cur.get("replayed"), "losses": len(cur.get("losses") or []),
        "nodes": nodes}}
