"""Snapshots of a running executor, read from its shared segment.

``collect(segment)`` works from any process that can map the segment: the
executor's own client (``Executor.stats()``), or ``stealer top`` attached to
a running executor by its id (the segment name).  Reading never blocks a
worker: counters are published by their single writer and read relaxed, so
a snapshot may be a few events behind, never torn.  Also read by stealer.prometheus
(every scrape); stealer/client/hang.py's Stalls observe these snapshots.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stealer.shared import metrics
from stealer.shared._layout import (
    D_COUNT,
    D_CPU_NS,
    D_DONE,
    D_GEN,
    D_HEAD,
    D_STEPS,
    DIR_BYTES,
    F_AGENT,
    GEN_MASK,
    K_MASK,
    K_ROOT,
    MIGR_SHIFT,
    OWNER_MASK,
    OWNER_MOVING,
    R_KIND,
    R_NEXT,
    R_TSUBMIT,
    RECORD_BYTES,
    S_QUEUED,
    S_RUNNING,
    STATE_MASK,
    STATE_SHIFT,
)
from stealer.shared.shm import (
    H_CREATED_NS,
    H_JOURNAL,
    H_JOURNAL_MODE,
    J_OLDEST,
    J_SYNCED,
    J_WRITTEN,
    JOURNAL_MODES,
    SHM_DIR,
    W_CPU,
    W_CURRENT,
    W_JOURNAL,
    W_PID,
    W_STATE,
    Segment,
    _alive,
    client_pid,
)

__all__ = ["AgentStats", "Stats", "WorkerStats", "collect", "executor_gone", "journal_stats"]

STATE_NAMES = ("starting", "ready", "exiting", "retired", "init-failed")


@dataclass
class WorkerStats:
    index: int
    pid: int | None
    cpu: int | None
    state: str
    running: bool  # a task is running on it right now
    deque_depth: int
    inbox_depth: int
    counters: dict[str, int]
    current: int = 0  # W_CURRENT: handle + 1 of the task or agent step running now (0: none)
    # seconds it has held work without progress (stealer/client/hang.py), as the client's result
    # thread saw it (Executor.stats) or stealer top over its frames; 0.0: not frozen
    frozen_s: float = 0.0
    # its successful steals by victim: cell j counts those from worker j, for the first
    # min(workers, metrics.VICTIMS) cells, the last of VICTIMS cells those from every worker
    # past it (a row of the victim -> thief matrix; flushed with the counters)
    steals_from: list[int] = field(default_factory=list)


@dataclass
class AgentStats:
    """One live agent, as its owner last published it (stealer/worker/agents/host.py)."""

    id: int
    worker: int | None  # index of the worker holding it (None: moving, or not started)
    generation: int
    cpu_ms: float  # CPU time of its steps and handlers so far
    steps: int
    messages: int
    mailbox: int  # messages waiting
    # ms since the oldest waiting message was sent (None: none waiting, or a chain that
    # moved under the reader's walk)
    oldest_ms: float | None = None
    # times it moved to another worker (published for a peer and started there), counted by
    # the worker that adopts it (_layout.py D_OWNER; saturates at 65,535)
    migrations: int = 0


@dataclass
class Stats:
    """One snapshot: per-worker counters and queue depths, latency histograms per tier."""

    id: str
    time: float  # time.time() of the snapshot
    uptime_s: float
    workers: list[WorkerStats]
    injector_depth: int
    latency: dict[str, dict[str, metrics.Histogram]]  # tier -> {"wait"|"run": Histogram}
    client: dict[str, int] = field(default_factory=dict)  # backlog, pending, crashes (client only)
    agents_live: int = 0  # agents started and not finished
    # Records on the free ring, of ``records`` in all: back to its start value once the
    # executor is idle (fewer: a record leaked, e.g. by a kill in a window not yet closed)
    records_free: int = 0
    records: int = 0
    busiest_agents: list[AgentStats] = field(default_factory=list)  # by CPU time, top first
    # agents with messages waiting, the deepest mailbox first (the same scan, same top count)
    fullest_agents: list[AgentStats] = field(default_factory=list)
    # the agents' journal (Executor(journal=PATH)), None without one: its durability mode
    # and how far the fsyncs trail the commits (journal_stats)
    journal: dict[str, Any] | None = None
    # running map(progress=True) calls, the oldest first: label, done (results handed out),
    # total (None: unknown), submitted (inputs read), elapsed_s; only Executor.stats()
    # knows them (the executor's own process), collect() leaves this empty
    maps: list[dict[str, Any]] = field(default_factory=list)

    def totals(self) -> dict[str, int]:
        """Counters summed over workers."""
        out = dict.fromkeys(metrics.COUNTERS, 0)
        for w in self.workers:
            for k, v in w.counters.items():
                out[k] += v
        return out

    def steal_matrix(self) -> list[list[int]]:
        """Successful steals, ``[thief][victim]`` (one row per worker, ``min(workers,
        metrics.VICTIMS)`` columns; the last column lumps victims past it)."""
        return [list(w.steals_from) for w in self.workers]

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (latency as millisecond summaries)."""
        return {
            "id": self.id,
            "time": self.time,
            "uptime_s": self.uptime_s,
            "injector_depth": self.injector_depth,
            "client": dict(self.client),
            "totals": self.totals(),
            "workers": [w.__dict__ for w in self.workers],
            "latency": {tier: {k: h.summary_ms() for k, h in kinds.items()}
                        for tier, kinds in self.latency.items()},
            "agents_live": self.agents_live,
            "records_free": self.records_free,
            "records": self.records,
            "busiest_agents": [a.__dict__ for a in self.busiest_agents],
            "fullest_agents": [a.__dict__ for a in self.fullest_agents],
            "journal": self.journal,
            "maps": list(self.maps),
        }


OLDEST_WALK = 1024  # messages a scan walks per listed agent for the oldest one's age


def agent_stats(seg: Segment, top: int = 10) -> tuple[int, list[AgentStats], list[AgentStats]]:
    """(live agents, the ``top`` busiest by CPU time, the ``top`` with the most messages
    waiting): one scan of records and directory."""
    L = seg.layout
    n = L.records
    mm = seg.mm
    recs = np.frombuffer(mm, np.uint64, n * (RECORD_BYTES // 8),
                         L.offsets["records"]).reshape(n, RECORD_BYTES // 8)
    word0 = recs[:, 0].copy()  # racy reads of single words: a snapshot, never torn
    kind = recs[:, R_KIND // 8] & np.uint64(0xFFFFFFFF)
    st = (word0 >> np.uint64(STATE_SHIFT)) & np.uint64(STATE_MASK)
    live = ((kind & np.uint64(F_AGENT | K_MASK)) == np.uint64(F_AGENT | K_ROOT)) & (
        (st == np.uint64(S_RUNNING)) | (st == np.uint64(S_QUEUED)))
    idx = np.nonzero(live)[0]
    if not len(idx):
        return 0, [], []
    d = np.frombuffer(mm, np.uint64, n * (DIR_BYTES // 8),
                      L.offsets["agents"]).reshape(n, DIR_BYTES // 8)[idx]
    cpu = d[:, D_CPU_NS // 8]
    mailbox = (d[:, D_COUNT // 8] & np.uint64(0xFFFFFFFF)).astype(np.int64)

    now = time.monotonic_ns()

    def oldest_ms(j: int) -> float | None:
        """Age of the oldest waiting message: the chain from D_HEAD (newest first) down
        to D_DONE (the newest handled).  Racy reads, a statistic: the walk stops at the
        mailbox's count plus one, or at anything that is not a record; past OLDEST_WALK
        messages it gives the age of the last one it read (a lower bound)."""
        left = min(int(mailbox[j]), OLDEST_WALK) + 1
        if left <= 1:
            return None
        v = int(d[j, D_HEAD // 8]) & ~(1 << 63)
        done = int(d[j, D_DONE // 8])
        t = None
        while v and v != done and left:
            m = (v - 1) & 0xFFFFFFFF
            if m >= n:
                return None
            t = int(recs[m, R_TSUBMIT // 8])
            v = int(recs[m, R_NEXT // 8])
            left -= 1
        return None if t is None or t > now else round((now - t) / 1e6, 3)

    def row(j: int) -> AgentStats:
        i = int(idx[j])
        w0 = int(word0[i])
        gen_owner = int(d[j, D_GEN // 8])
        steps_msgs = int(d[j, D_STEPS // 8])
        owner = (gen_owner >> 32) & OWNER_MASK
        return AgentStats(
            id=((w0 & GEN_MASK) << 32) | i,
            worker=owner - 1 if owner and owner != OWNER_MOVING else None,
            migrations=gen_owner >> (32 + MIGR_SHIFT),
            generation=gen_owner & 0xFFFFFFFF, cpu_ms=int(cpu[j]) / 1e6,
            steps=steps_msgs & 0xFFFFFFFF, messages=steps_msgs >> 32,
            mailbox=int(mailbox[j]), oldest_ms=oldest_ms(j))

    busiest = [row(j) for j in np.argsort(-cpu.astype(np.int64), kind="stable")[:top]]
    waiting = np.flatnonzero(mailbox)
    fullest = [row(j) for j in waiting[np.argsort(-mailbox[waiting], kind="stable")][:top]]
    return len(idx), busiest, fullest


def journal_stats(seg: Segment) -> dict[str, Any] | None:
    """The journal's lag, None without a journal: ``mode`` (its durability), then per shard
    (``client``, ``w0``...) the events committed, those no fsync covers yet (``unsynced``)
    and the age in ms of the oldest of them (``lag_ms``), and the totals (the sum and the
    worst age).  Under "always" every commit is fsync'ed (0); under "none" stealer never
    fsyncs (the OS writes back when it likes): ``unsynced`` and ``lag_ms`` are None."""
    r = seg.region
    mode = r.load32(H_JOURNAL_MODE)
    if not mode:
        return None
    name = JOURNAL_MODES[mode] if mode < len(JOURNAL_MODES) else str(mode)
    now = time.monotonic_ns()
    shards = []
    bases = [("client", H_JOURNAL)] + [(f"w{k}", seg.layout.worker(k) + W_JOURNAL)
                                        for k in range(seg.layout.nworkers)]
    for label, base in bases:
        written = r.load64(base + J_WRITTEN)
        synced = r.load64(base + J_SYNCED)
        oldest = r.load64(base + J_OLDEST)
        row: dict[str, Any] = {"shard": label, "events": written}
        if name == "none":
            row.update(unsynced=None, lag_ms=None)
        else:
            row.update(unsynced=max(0, written - synced),
                       lag_ms=round(max(0, now - oldest) / 1e6, 3) if oldest else 0.0)
        shards.append(row)
    off = name == "none"
    return {"mode": name, "events": sum(s["events"] for s in shards),
            "unsynced": None if off else sum(s["unsynced"] for s in shards),
            "lag_ms": None if off else max(s["lag_ms"] for s in shards), "shards": shards}


def collect(seg: Segment, queues: Any | None = None, agents: bool = True) -> Stats:
    """Read a snapshot of the executor whose segment is ``seg``.

    ``agents=False`` skips the agents' part (``agents_live`` 0, no busiest or fullest
    agents): it reads every record slot, O(``records``), about 4 ms at 262,144 records,
    where the rest reads a few KiB per worker (the dashboard scans agents once a second).
    """
    Q = queues or seg.Q
    L = seg.layout
    r = seg.region
    mm = seg.mm
    workers = []
    tiers: list[list[metrics.Histogram]] = [
        [metrics.Histogram() for _ in metrics.KINDS] for _ in range(metrics.TIERS)]
    for k in range(L.nworkers):
        base = L.worker(k)
        counters, hists = metrics.read_worker(mm, L.metrics(k))
        for t in range(metrics.TIERS):
            for j in range(len(metrics.KINDS)):
                tiers[t][j] = tiers[t][j].merge(hists[t][j])
        state = r.load32(base + W_STATE)
        pid = r.load32(base + W_PID)
        cpu = r.load32(base + W_CPU)
        cur = r.load64(base + W_CURRENT)
        workers.append(WorkerStats(
            index=k,
            pid=pid or None,
            cpu=cpu - 1 if cpu else None,
            state=STATE_NAMES[state] if state < len(STATE_NAMES) else str(state),
            running=bool(cur),
            deque_depth=len(Q.Deque(r, L.deque(k), L.records)),
            inbox_depth=len(Q.MPMCRing(r, L.inbox(k), L.inbox_cap)),
            counters=counters,
            current=cur,
            steals_from=metrics.read_steals_from(mm, L.metrics(k), L.nworkers),
        ))
    created = r.load64(H_CREATED_NS) / 1e9
    now = time.time()
    latency = {
        metrics.TIER_NAMES[t]: dict(zip(metrics.KINDS, tiers[t]))
        for t in range(metrics.TIERS)
        if any(h.total for h in tiers[t])
    }
    agents_live, busiest, fullest = agent_stats(seg) if agents else (0, [], [])
    return Stats(
        id=seg.name,
        agents_live=agents_live,
        busiest_agents=busiest,
        fullest_agents=fullest,
        time=now,
        uptime_s=max(0.0, now - created) if created else 0.0,
        workers=workers,
        injector_depth=len(Q.MPMCRing(r, L.offsets["injector"], L.injector_cap)),
        latency=latency,
        records_free=len(Q.MPMCRing(r, L.offsets["record_free"], L.free_cap(L.records))),
        records=L.records,
        journal=journal_stats(seg),
    )


def executor_gone(exec_id: str) -> str | None:
    """Why the executor ``exec_id`` is no longer running, or None if it still is.

    Its segment was removed (shut down), or its client process died.  A
    reader attached by id (``stealer top``, the Prometheus endpoint) checks
    this after each snapshot: a mapping outlives the unlinked segment.
    """
    pid = client_pid(exec_id)
    if not os.path.exists(os.path.join(SHM_DIR, exec_id)):
        return f"executor {exec_id} has exited (its shared segment was removed)"
    if pid is not None and not _alive(pid):
        return f"executor {exec_id} is gone: its client process {pid} no longer runs"
    return None
