"""Counters and latency histograms in shared memory, and their snapshots.

Every worker owns a metrics block (it is the only writer, so no
read-modify-write atomics are needed; readers take relaxed snapshots that
may be a few events behind, never torn words):

    counters   16 x u64      COUNTERS below; flushed by the worker every
                             64 tasks (stealer/worker/loop.py FLUSH_MASK), at
                             least every FLUSH_NS while busy, and whenever
                             it parks
    histograms TIERS x KINDS each: count, sum, max (u64) + NBUCKETS x u64
    steals_from VICTIMS x u64    successful steals of this worker (the thief) from
                             each peer's deque, by victim (STEALS_FROM_OFF below)

Histograms are log-linear (HDR-style): values below 64 ns have a bucket
each; above, every power of two is split into 64 sub-buckets, so a bucket
is at most 1/64 = 1.6% wide and reporting its midpoint is within 0.8% of
any value in it.  Values are nanoseconds; 2**40 ns (18 minutes) and above
land in the last bucket.  ``bucket_of`` is mirrored in C in
native/_cqueues.pyx (``st_hist_bucket``); tests check they agree.

Written by each worker (stealer/worker/loop.py and join.py, the agents' turns in
stealer/worker/agents/entry.py); read by the client's snapshots (stealer/client/stats.py,
hang.py), ``stealer top`` and stealer.prometheus; the blocks are placed by
stealer/shared/shm.py.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from stealer._lazy import lazy_numpy

np: Any = lazy_numpy(globals())  # numpy, imported on first use


__all__ = [
    "COUNTERS", "TIERS", "TIER_NAMES", "KINDS", "NBUCKETS", "HIST_BYTES", "BLOCK_BYTES",
    "VICTIMS", "STEALS_FROM_OFF", "victim_cell", "read_steals_from",
    "bucket_of", "bucket_bounds", "Histogram", "read_worker",
]

SUB_BITS = 6
SUB = 1 << SUB_BITS  # 64 sub-buckets per power of two
MAX_BITS = 40
NBUCKETS = SUB * (MAX_BITS - SUB_BITS) + SUB  # 2240: covers [0, 2**40)

COUNTERS = (
    "tasks",            # steps run (a task, or one resumption of a fork-join task)
    "steals",           # successful steals (batches)
    "steal_attempts",   # steal calls on a peer's deque
    "parks",            # times the worker went to sleep on its futex
    "wakeups",          # parks that ended by a notification (not a timeout)
    "injector_takes",   # batches taken from the client's injector
    "spawns",           # children spawned
    "resumes",          # suspended tasks resumed after their children
    "errors",           # tasks that raised
    "busy_ns",          # time spent running task code
    "agent_steps",      # agent steps run
    "agent_messages",   # agent messages handled
    "migrations",       # agents this worker published for an idle peer (state pickled once)
    "throttled",        # agent turns demoted or delayed for using more than their cpu_share
    "preempt_publishes",  # agents published from inside a long step, for an idle peer's request
    "inline_controls",  # control-tier turns run inside another agent's step (worker/agents/inline.py)
    "spin_ns",          # CPU ns of idle search rounds before parking (Worker.search's yields)
)
NCOUNTERS = 24  # (room for more: the histograms after them stay on cache-line boundaries)
TIERS = 3
TIER_NAMES = ("control", "interactive", "bulk")
DEFAULT_TIER = 1
KINDS = ("wait", "run")  # queue wait (submit/spawn -> start), run time of a step
HIST_HDR = 64  # count, sum, max, then padding to a cache line
HIST_BYTES = HIST_HDR + 8 * NBUCKETS
COUNTERS_BYTES = 8 * NCOUNTERS
# The victim -> thief steal matrix, one row per thief in the thief's own block: cell j
# counts its successful steals (batches) from worker j, and the last cell those from every
# worker >= VICTIMS - 1, so a row stays 512 bytes whatever the pool's size (MAX_WORKERS is
# 8,192: a full row would be 64 KiB per worker, 4 GiB for the matrix).
VICTIMS = 64
STEALS_FROM_OFF = COUNTERS_BYTES + TIERS * len(KINDS) * HIST_BYTES  # u64[VICTIMS]: the worker
#   (the thief, single writer) stores the row with its counters at each flush (plain stores,
#   as the counters: no RMW, never torn words); readers (stats.py collect) read it relaxed,
#   a few steals behind; it pairs with no other operation (a statistic, ordered by nothing)
BLOCK_BYTES = STEALS_FROM_OFF + 8 * VICTIMS

_HDR = struct.Struct("=QQQ")


def bucket_of(v: int) -> int:
    """Bucket index of a value in ns (clamped to [0, NBUCKETS))."""
    if v < 2 * SUB:
        return max(0, v)
    e = v.bit_length() - (SUB_BITS + 1)
    idx = (e << SUB_BITS) + (v >> e)
    return idx if idx < NBUCKETS else NBUCKETS - 1


def bucket_bounds(i: int) -> tuple[int, int]:
    """[low, high) of bucket ``i`` in ns."""
    if i < 2 * SUB:
        return i, i + 1
    e = (i >> SUB_BITS) - 1
    m = i - (e << SUB_BITS)
    return m << e, (m + 1) << e


_MIDS_CACHE: list[Any] = []


def _mids() -> Any:
    """Each bucket's midpoint (made on first use: numpy is imported lazily)."""
    if not _MIDS_CACHE:
        lows = np.array([bucket_bounds(i)[0] for i in range(NBUCKETS)], dtype=np.float64)
        highs = np.array([bucket_bounds(i)[1] for i in range(NBUCKETS)], dtype=np.float64)
        _MIDS_CACHE.append((lows + highs - 1) / 2.0)
    return _MIDS_CACHE[0]


def hist_offset(tier: int, kind: int) -> int:
    """Offset of a histogram inside a worker's metrics block."""
    return COUNTERS_BYTES + (tier * len(KINDS) + kind) * HIST_BYTES


@dataclass
class Histogram:
    """A snapshot of one (or a merge of several) latency histograms, in ns."""

    counts: np.ndarray = field(default_factory=lambda: np.zeros(NBUCKETS, dtype=np.uint64))
    total: int = 0
    sum_ns: int = 0
    max_ns: int = 0

    @classmethod
    def from_values(cls, values: Iterable[int]) -> Histogram:
        """Build one in Python (tests, and the reference of the native recorder)."""
        h = cls()
        for v in values:
            h.record(int(v))
        return h

    def record(self, v: int) -> None:
        self.counts[bucket_of(v)] += 1
        self.total += 1
        self.sum_ns += v
        self.max_ns = max(self.max_ns, v)

    @classmethod
    def read(cls, buf: Any, off: int) -> Histogram:
        total, sum_ns, max_ns = _HDR.unpack_from(buf, off)
        counts = np.frombuffer(buf, dtype=np.uint64, count=NBUCKETS, offset=off + HIST_HDR).copy()
        return cls(counts, int(total), int(sum_ns), int(max_ns))

    def merge(self, other: Histogram) -> Histogram:
        return Histogram(self.counts + other.counts, self.total + other.total,
                         self.sum_ns + other.sum_ns, max(self.max_ns, other.max_ns))

    def __sub__(self, other: Histogram) -> Histogram:
        """Events between two snapshots of the same histogram (for rates in `stealer top`)."""
        return Histogram(self.counts - other.counts, self.total - other.total,
                         self.sum_ns - other.sum_ns, self.max_ns)

    @property
    def count(self) -> int:
        return int(self.counts.sum())

    def percentile(self, q: float) -> float:
        """The q-th percentile (0..100) in ns: midpoint of the bucket holding it; nan if empty."""
        n = self.count
        if n == 0:
            return float("nan")
        rank = max(1, int(np.ceil(q / 100.0 * n)))
        cum = np.cumsum(self.counts)
        i = int(np.searchsorted(cum, rank))
        if q >= 100.0 and self.max_ns:
            return float(self.max_ns)
        mids = _mids()
        return float(min(mids[i], self.max_ns)) if self.max_ns else float(mids[i])

    def percentiles(self, qs: Sequence[float] = (50, 90, 99, 99.9)) -> dict[str, float]:
        return {f"p{q:g}": self.percentile(q) for q in qs}

    def mean(self) -> float:
        return self.sum_ns / self.total if self.total else float("nan")

    def summary_ms(self) -> dict[str, float]:
        """count, mean and p50/p90/p99/p99.9/max in milliseconds."""
        out = {"count": float(self.count), "mean_ms": self.mean() / 1e6}
        for k, v in self.percentiles().items():
            out[f"{k}_ms"] = v / 1e6
        out["max_ms"] = self.max_ns / 1e6
        return out


def victim_cell(victim: int) -> int:
    """The cell of a steal row that counts steals from worker ``victim``."""
    return min(victim, VICTIMS - 1)


def read_steals_from(buf: Any, base: int, nworkers: int) -> list[int]:
    """The steal row of the worker whose metrics block is at ``base``: its successful steals
    from each of the first ``min(nworkers, VICTIMS)`` cells (see :data:`VICTIMS`)."""
    m = min(nworkers, VICTIMS)
    return list(struct.unpack_from(f"={m}Q", buf, base + STEALS_FROM_OFF))


def read_worker(buf: Any, base: int) -> tuple[dict[str, int], list[list[Histogram]]]:
    """Counters and histograms[tier][kind] of one worker's metrics block at ``base``."""
    vals = struct.unpack_from(f"={NCOUNTERS}Q", buf, base)
    counters = dict(zip(COUNTERS, vals))
    hists = [[Histogram.read(buf, base + hist_offset(t, k)) for k in range(len(KINDS))]
             for t in range(TIERS)]
    return counters, hists
