"""The dashboard's one sampler: a thread that snapshots the executor for every open page.

Owns the sampling loop, the history it needs (snapshots of the last second for rates,
latency histograms of the last ``window_s`` seconds for the windowed CDF), the worker
processes' CPU and RSS (psutil) and the encoded update that every event stream sends.
The agents' part of a snapshot scans every record slot (O(records), unlike the rest), so
it is taken once a second (``AGENTS_EVERY_S``) and its block reused in between.
While no page is subscribed it samples nothing; with any number of pages it takes one
snapshot per ``interval`` and encodes it once, so its cost grows with workers and
tiers, never with pages or tasks.

Created and closed by :mod:`stealer.dashboard.server` (one per served dashboard);
:func:`stealer.dashboard.payload.build` makes each update.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

from stealer.client.stats import AgentStats, Stats
from stealer.dashboard import payload
from stealer.dashboard.payload import Hists

__all__ = ["Sampler"]

_RATE_SPAN_S = 1.0  # rates cover about the last second (counters flush every 64 steps)
AGENTS_EVERY_S = 1.0  # the agents' scan reads every record slot: once a second, not per tick


class _Procs:
    """CPU % and RSS of each worker process, CPU over about the last ``span`` seconds."""

    def __init__(self, span: float = _RATE_SPAN_S) -> None:
        self.span = span
        self._procs: dict[int, tuple[psutil.Process, collections.deque[tuple[float, float]]]] = {}

    def read(self, pids: list[int | None]) -> list[tuple[float | None, int | None]]:
        out: list[tuple[float | None, int | None]] = []
        now = time.monotonic()
        for pid in pids:
            entry = self._procs.get(pid) if pid else None
            try:
                if pid and entry is None:
                    entry = self._procs[pid] = (psutil.Process(pid), collections.deque())
                if entry is None:
                    out.append((None, None))
                    continue
                proc, seen = entry
                with proc.oneshot():
                    t = proc.cpu_times()
                    rss = proc.memory_info().rss
            except (psutil.Error, OSError):
                self._procs.pop(pid or 0, None)
                out.append((None, None))
                continue
            seen.append((now, t.user + t.system))
            while len(seen) > 2 and now - seen[1][0] >= self.span:
                seen.popleft()  # seen[0]: the newest reading at least a span old
            (t0, c0), (t1, c1) = seen[0], seen[-1]
            out.append(((c1 - c0) / (t1 - t0) * 100 if t1 > t0 else None, rss))
        for pid in set(self._procs) - set(pids):
            del self._procs[pid]
        return out


class Sampler:
    """One snapshot per ``interval`` while a page listens; the encoded update for all.

    ``snapshot(agents=bool)`` returns a fresh :class:`Stats` (with or without the agents'
    scan), or None once the executor is gone
    (``gone_reason`` then says why).  Readers call :meth:`next` with the sequence number
    they last sent; :meth:`latest` samples on demand (``/api/snapshot``).
    """

    def __init__(self, snapshot: Callable[..., Stats | None],
                 gone_reason: Callable[[], str | None], interval: float = 0.25,
                 window_s: float = 10.0, procs: bool = True) -> None:
        if not 0.05 <= interval <= 10:
            raise ValueError(f"interval must be between 0.05 and 10 seconds, got {interval!r}")
        if not window_s >= 1:
            raise ValueError(f"window_s must be at least 1 second, got {window_s!r}")
        self.interval = interval
        self.window_s = window_s
        self._snapshot = snapshot
        self._gone_reason = gone_reason
        self._procs = _Procs() if procs else None
        self._cond = threading.Condition()
        self._sample_lock = threading.Lock()  # one snapshot at a time (thread or latest())
        self._subscribers = 0
        self._closed = False
        self.seq = 0
        self.data = b""  # the latest update, JSON
        self.sampled_at = 0.0  # monotonic time of it
        self.gone: str | None = None
        self._recent: collections.deque[Stats] = collections.deque()  # last ~second
        self._lat: collections.deque[tuple[float, Hists]] = collections.deque()  # 1 per s
        self._agents: dict[int, AgentStats] = {}  # of the last agents' scan, by id
        self._agents_t = 0.0  # Stats.time of that scan (0: none yet)
        self._ag: dict[str, Any] | None = None  # its block, sent until the next scan
        self._cpu: collections.deque[tuple[float, float]] = collections.deque()  # (t, cpu s)
        self._cpu_window = 0.0  # sum of the CPU seconds in _cpu after its first entry
        self.cpu_s = 0.0  # CPU seconds spent sampling and encoding, all told
        self.samples = 0
        self._thread = threading.Thread(target=self._run, name="stealer-dashboard-sampler",
                                        daemon=True)
        self._thread.start()

    # -- readers -----------------------------------------------------------------------

    def subscribe(self) -> None:
        with self._cond:
            self._subscribers += 1
            self._cond.notify_all()

    def unsubscribe(self) -> None:
        with self._cond:
            self._subscribers -= 1

    @property
    def subscribers(self) -> int:
        return self._subscribers

    def next(self, after: int, timeout: float) -> tuple[int, bytes | None]:
        """(seq, update) of the first update after ``after``; (after, None) on timeout.

        Once the executor is gone the last update is ``{"gone": reason}``; once the
        sampler is closed, (-1, None).
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.seq <= after and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0 or self.gone is not None:
                    return after, None
                self._cond.wait(left)
            if self._closed:
                return -1, None
            return self.seq, self.data

    def latest(self) -> bytes:
        """The newest update, sampled now unless one is younger than ``interval``."""
        if time.monotonic() - self.sampled_at >= self.interval and self.gone is None:
            self._tick()
        return self.data

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def cpu_ms_per_s(self) -> float:
        """CPU milliseconds per second the sampler used over the last ``window_s``."""
        if len(self._cpu) < 2:
            return 0.0
        span = self._cpu[-1][0] - self._cpu[0][0]
        return self._cpu_window / span * 1e3 if span > 0 else 0.0

    # -- the loop ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (self._subscribers == 0 or self.gone is not None):
                    self._cond.wait()
                if self._closed:
                    return
            started = time.monotonic()
            if started - self.sampled_at >= self.interval * 0.9:  # else latest() just did
                self._tick()
            with self._cond:
                left = self.interval - (time.monotonic() - started)
                if left > 0 and not self._closed:
                    self._cond.wait(left)

    def _tick(self) -> None:
        with self._sample_lock:
            c0 = time.thread_time()
            scan = time.time() - self._agents_t >= AGENTS_EVERY_S * 0.95
            try:
                cur = self._snapshot(agents=scan)
            except Exception as exc:  # a failed read is shown, and tried again next tick
                update: dict[str, Any] = {"v": 1, "error": f"{type(exc).__name__}: {exc}"}
                cur = None
            else:
                update = self._update(cur, scan) if cur is not None else {}
            if cur is None and "error" not in update:
                self.gone = self._gone_reason() or "the executor is gone"
                update = {"v": 1, "gone": self.gone}
            now = time.monotonic()
            used = time.thread_time() - c0
            self.cpu_s += used
            self.samples += 1
            if self._cpu:
                self._cpu_window += used
            self._cpu.append((now, used))
            while len(self._cpu) > 1 and now - self._cpu[0][0] > self.window_s:
                self._cpu.popleft()
                self._cpu_window -= self._cpu[0][1]  # the new first entry leaves the sum
            update["smp"] = {"cpu_ms_s": round(self.cpu_ms_per_s(), 2),
                             "pages": self._subscribers, "interval_s": self.interval,
                             "bytes": len(self.data)}
            data = json.dumps(update, separators=(",", ":")).encode()
            with self._cond:
                self.seq += 1
                self.data = data
                self.sampled_at = now
                self._cond.notify_all()

    def _update(self, cur: Stats, scanned: bool) -> dict[str, Any]:
        recent = self._recent
        recent.append(cur)
        while len(recent) > 2 and cur.time - recent[1].time >= _RATE_SPAN_S:
            recent.popleft()  # recent[0]: the newest snapshot at least a span old
        prev = recent[0] if len(recent) > 1 else None
        lat = self._lat
        if not lat or cur.time - lat[-1][0] >= 1.0:
            lat.append((cur.time, cur.latency))
        while len(lat) > 1 and cur.time - lat[1][0] >= self.window_s:
            lat.popleft()
        base_t, base = lat[0]
        window = cur.time - base_t
        procs = self._procs.read([w.pid for w in cur.workers]) if self._procs else None
        if scanned:
            dt = cur.time - self._agents_t if self._agents_t else 0.0
            self._ag = payload.agents_block(cur, self._agents, dt)
            self._agents, self._agents_t = payload.agents_by_id(cur), cur.time
        return payload.build(cur, prev, base if window > 0 else None,
                             window if window > 0 else cur.uptime_s, procs, self._ag)


class ClusterSampler(Sampler):
    """The sampler of a cluster executor: its snapshot is the dict its client publishes
    (stealer/cluster/snapshot.py), read from /dev/shm; no worker processes of its own to
    read here (they run on the nodes)."""

    def __init__(self, snapshot: Callable[..., dict[str, Any] | None],
                 gone_reason: Callable[[], str | None], interval: float = 0.25,
                 window_s: float = 10.0) -> None:
        self._snaps: collections.deque[dict[str, Any]] = collections.deque()  # last ~second
        super().__init__(snapshot, gone_reason, interval, window_s, procs=False)

    def _update(self, cur: Any, scanned: bool) -> dict[str, Any]:
        snaps = self._snaps
        snaps.append(cur)
        while len(snaps) > 2 and cur.get("time", 0.0) - snaps[1].get("time", 0.0) >= _RATE_SPAN_S:
            snaps.popleft()  # snaps[0]: the newest snapshot at least a span old
        return payload.cluster_block(cur, snaps[0] if len(snaps) > 1 else None)
